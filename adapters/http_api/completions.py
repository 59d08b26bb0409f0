"""One completion: from the request body to chatcore's messages and options, and from the
scheduler's tokens to text deltas (:class:`Piece`), each with the log-probabilities of the
tokens that wrote it when they were asked for. :mod:`.choices` puts a request's choices
into OpenAI's chunks and bodies."""

from __future__ import annotations

import asyncio
import logging
import time
import unicodedata
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Literal

from chatcore.adapters.http_api.errors import ApiError
from chatcore.adapters.http_api.schema import MAX_STOP_CHARS, MAX_STOPS, ChatCompletionRequest, Sampling
from chatcore.errors import ChatcoreError

if TYPE_CHECKING:
    from chatcore.adapters.http_api.request_log import Exchange
    from chatcore.engine import Engine, ReplyOptions
    from chatcore.prompting import Message, PromptFormat, Role
    from chatcore.serving import Event, Handle, Scheduler
    from chatcore.serving.logprobs import TokenLogprob

DEFAULT_MAX_N = 8

ALLOWED_CONTROLS = {"\n", "\t", "\r"}


def without_controls(text: str) -> str:
    """``text`` without the control characters a request may not carry."""
    return "".join(c for c in text if c in ALLOWED_CONTROLS or unicodedata.category(c) not in ("Cc", "Cs"))


def refused_character(text: str) -> str | None:
    """Why a request may not carry ``text`` ("contains a control character (U+0000)"), or None.
    A lone surrogate (``"\\ud800"`` in JSON: half of a pair) is no character at all."""
    for char in text:
        category = unicodedata.category(char)
        if category == "Cs":
            return f"contains a lone surrogate (U+{ord(char):04X}), which is not valid Unicode text"
        if category == "Cc" and char not in ALLOWED_CONTROLS:
            return f"contains a control character (U+{ord(char):04X})"
    return None


def history_text(reply: str) -> str:
    """A reply as it comes back in the next request's history: a tiny or odd model may
    write a control character, which a client then sends back as the assistant's turn;
    it is dropped there rather than refused."""
    from chatcore.text import clean_message

    return clean_message(without_controls(reply))


def to_messages(request: ChatCompletionRequest, default_system: str | None) -> list["Message"]:
    """The request's messages as chatcore's: system messages first (joined), the user's last."""
    from chatcore.prompting import Message, clean_system_prompt
    from chatcore.text import clean_message

    system_parts: list[str] = []
    messages: list[Message] = []
    for index, message in enumerate(request.messages):
        param = f"messages.[{index}].content"
        others = message.other_parts()
        if others:
            raise ApiError(
                400,
                f"messages[{index}] has a `{others[0]}` part: this server's models take text only "
                '(send `{"type": "text", "text": ...}` parts or a string)',
                param,
            )
        if message.name is not None:
            raise ApiError(
                400,
                f"messages[{index}].name: this server's prompt formats do not render participant names; "
                "leave `name` out (or write the name into the message's text)",
                f"messages.[{index}].name",
            )
        text = message.text()
        if message.content is None and message.role != "assistant":
            raise ApiError(400, f"messages[{index}] has no content", param)
        if message.role == "assistant":  # the server's own earlier reply
            text = without_controls(text)
        problem = refused_character(text)
        if problem is not None:
            raise ApiError(400, f"messages[{index}] {problem}", param)
        try:
            if message.role in ("system", "developer"):
                if messages:
                    raise ApiError(
                        400,
                        f"messages[{index}]: system messages must come before the conversation",
                        f"messages.[{index}].role",
                    )
                cleaned = clean_system_prompt(text)
                if cleaned:
                    system_parts.append(cleaned)
            elif message.role == "assistant" and not text.strip():
                # A reply cut by a stop string at its very start comes back empty: an empty turn.
                messages.append(Message("assistant", ""))
            else:
                role: Role = "user" if message.role == "user" else "assistant"
                messages.append(Message(role, clean_message(text)))
        except ChatcoreError as error:
            if isinstance(error, ApiError):
                raise
            raise ApiError(400, f"messages[{index}]: {error}", param) from None
    if not messages or messages[-1].role != "user":
        raise ApiError(400, "the last message must be the user's", "messages")
    system = "\n".join(system_parts) or default_system
    return ([Message("system", system)] if system else []) + messages


def to_options(
    request: Sampling,
    registry: Any,
    vocab_size: int | None = None,
    max_n: int = DEFAULT_MAX_N,
    default_budget: int | None = None,
    *,
    machine_names: bool = False,
) -> "ReplyOptions":
    """Decoder, steerers, seed, budget (``default_budget``, the server's, when the request gives
    none) and log-probabilities; checked by the registry before anything is queued.

    ``min_tokens`` (vLLM's name) bans the stop tokens until the reply has that many.
    ``temperature`` and ``top_p`` go to the decoder's settings (top-k by default,
    greedy at temperature 0; the greedy decoder refuses a temperature above 0 or a top_p
    below 1); ``presence_penalty``, ``frequency_penalty`` (when not 0) and ``logit_bias`` too
    (greedy and top-k take them); ``decoder`` and ``steer`` are the command line's spec strings.
    Settings that name files or models on this machine take only their bundled names
    unless ``machine_names`` (the server's --allow-local-files).
    """
    from chatcore.cli.specs import parse_spec
    from chatcore.engine import DEFAULT_DECODER, DEFAULT_MAX_NEW_TOKENS, ReplyOptions, validate_options

    if request.n > max_n:
        raise ApiError(400, f"`n` must be at most {max_n} on this server (--max-n), got {request.n}", "n")
    if isinstance(request, ChatCompletionRequest) and request.top_logprobs is not None and not request.logprobs:
        raise ApiError(400, "`top_logprobs` needs `logprobs` set to true", "top_logprobs")
    if request.stream_options is not None and not request.stream:
        raise ApiError(400, "`stream_options` is only allowed when `stream` is true", "stream_options")
    stops = request.stop_strings()
    if len(stops) > MAX_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(
            400, f"`stop` takes up to {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters", "stop"
        )
    for index, stop in enumerate(stops):
        problem = refused_character(stop)
        if problem is not None:
            named = "`stop`" if isinstance(request.stop, str) else f"stop[{index}]"
            raise ApiError(400, f"{named} {problem}", "stop")
    # The other texts a request gives: the end user (kept in the log) and the plugins' specs.
    texts = [("user", "`user`", request.user), ("decoder", "`decoder`", request.decoder)]
    texts += [("steer", f"steer[{index}]", spec) for index, spec in enumerate(request.steer)]
    for param, named, text in texts:
        problem = refused_character(text) if text is not None else None
        if problem is not None:
            raise ApiError(400, f"{named} {problem}", param)
    try:
        if request.decoder is not None:
            decoder, settings = parse_spec(request.decoder)
        elif request.temperature == 0:
            decoder, settings = "greedy", {}
        else:
            decoder, settings = DEFAULT_DECODER, {}
        steerers = [parse_spec(spec) for spec in request.steer]
    except ChatcoreError as error:
        raise ApiError(400, str(error), "decoder" if request.decoder else "steer") from None
    if decoder == "greedy":
        if request.temperature not in (None, 0):
            raise ApiError(
                400,
                f"`temperature` {request.temperature:g} does not apply to the greedy decoder, which always "
                "takes the best token: send 0, leave it out, or choose a sampling decoder",
                "temperature",
            )
        if request.top_p not in (None, 1):
            raise ApiError(400, "`top_p` does not apply to the greedy decoder: send 1 or leave it out", "top_p")
    fields: dict[str, Any] = {
        "presence_penalty": request.presence_penalty or None,
        "frequency_penalty": request.frequency_penalty or None,
        "logit_bias": token_biases(request.logit_bias, vocab_size) if request.logit_bias else None,
    }
    if decoder != "greedy":
        fields.update(temperature=request.temperature, top_p=request.top_p)
    for name, value in fields.items():
        if value is None:
            continue
        if name in settings:  # as the command line refuses --temperature beside the decoder's own
            raise ApiError(400, f"`{name}` and the decoder's {name}={settings[name]} both given: give it once", name)
        settings[name] = value
    budget = request.budget() or default_budget or DEFAULT_MAX_NEW_TOKENS
    if request.min_tokens is not None and request.min_tokens > budget:
        raise ApiError(
            400, f"`min_tokens` ({request.min_tokens}) must be at most the reply's budget ({budget})", "min_tokens"
        )
    options = ReplyOptions(
        decoder=decoder,
        decoder_settings=settings,
        steerers=steerers,
        seed=request.seed,
        max_new_tokens=budget,
        min_new_tokens=1 if request.min_tokens is None else request.min_tokens,
        logprobs=request.top_logprobs_asked(),
    )
    try:
        validate_options(options, registry, machine_names=machine_names)
    except ChatcoreError as error:
        message = str(error)
        param = "steer" if "steerer" in message and request.steer else "decoder"
        for field_name in ("presence_penalty", "frequency_penalty", "logit_bias"):
            if f"`{field_name}`" in message:
                param = field_name
        raise ApiError(400, message, param) from None
    return options


def token_biases(biases: dict[str, float], vocab_size: int | None) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as strings) as the decoders take it: ids checked against the vocabulary."""
    parsed: dict[int, float] = {}
    for key, value in biases.items():
        if not key.isdigit() or (vocab_size is not None and int(key) >= vocab_size):
            limit = f" below {vocab_size}" if vocab_size is not None else ""
            raise ApiError(400, f"`logit_bias` keys must be token ids{limit}, got {key!r}", "logit_bias")
        if not -100 <= value <= 100:
            raise ApiError(400, f"`logit_bias` values must be between -100 and 100, got {value:g}", "logit_bias")
        parsed[int(key)] = value
    return parsed


@dataclass(frozen=True)
class Interrupt:
    """Put in a reply's event queue by the server, not the scheduler: ``queue-wait`` (the
    request waited past ``--max-queue-wait``; ignored once it was admitted), ``timeout`` (past
    ``--request-timeout``) or ``shutdown`` (the shutdown grace is over)."""

    kind: Literal["queue-wait", "timeout", "shutdown"]


INTERRUPTS: dict[str, tuple[int, str, str]] = {
    "queue-wait": (503, "queue_timeout", "the server is busy: the request waited {seconds:g} s for a free slot"),
    "timeout": (504, "request_timeout", "the reply took longer than the server's limit of {seconds:g} s"),
    "shutdown": (503, "server_shutdown", "the server is shutting down; the reply was cut"),
}


@dataclass
class Piece:
    """Text of a reply as it is sent, with the tokens that completed it (their log-probabilities,
    when the request asked for them; a stop string's tokens included, though its text is not sent)."""

    text: str
    tokens: "list[TokenLogprob]" = field(default_factory=list)


class TokensByText:
    """A streamed reply's tokens held until the text they complete is sent: the text goes out
    a whole word at a time (and held back while it may begin a stop string), so a token is
    listed in the piece whose text holds its last character, not in the piece sent when it
    arrived. A token that completes no character yet (part of one) ends where the next
    character does. Log-probabilities are None when the request asked for none."""

    def __init__(self) -> None:
        self._held: list[tuple[TokenLogprob | None, int | None]] = []  # (log-probability, end in the text)
        self._decoded = 0  # characters decoded so far
        self._sent = 0  # characters sent so far

    def push(self, logprob: TokenLogprob | None, decoded: str) -> None:
        """A token came, decoding to ``decoded`` (empty while it completes no character)."""
        self._held.append((logprob, None))
        if decoded:
            self._decoded += len(decoded)
            self._held = [(each, self._decoded if end is None else end) for each, end in self._held]

    def sent(self, characters: int) -> list[TokenLogprob]:
        """The log-probabilities of the tokens whose text is all sent, once ``characters`` more are."""
        self._sent += characters
        done = 0
        while done < len(self._held) and (end := self._held[done][1]) is not None and end <= self._sent:
            done += 1
        taken, self._held = self._held[:done], self._held[done:]
        return [each for each, _ in taken if each is not None]

    def rest(self) -> list[TokenLogprob]:
        """Every held token's log-probability (the reply ended: its last piece lists them)."""
        taken, self._held = self._held, []
        return [each for each, _ in taken if each is not None]


@dataclass(eq=False)  # each reply is its own, hashable by identity
class Completion:
    """A submitted reply as the HTTP handler reads it: text deltas, then counts and the finish reason."""

    handle: "Handle"
    events: "asyncio.Queue[Event | Interrupt]"
    tokenizer: Any
    stops: list[str]
    model: str
    index: int = 0  # the choice's index among the request's ``n``
    id: str = ""  # the response's id (with ``/index`` when there are several choices), for the server's log
    completion_tokens: int = 0
    finish_reason: str | None = None
    first: "Event | None" = None
    text: str = ""  # what was sent so far
    error: str | None = None  # why the reply ended early, when it failed
    client_gone: bool = False

    def cancel(self) -> None:
        """Stop the reply (the client went away): its slot is free at once, and a reader
        waiting for its next text stops now rather than at the scheduler's next step."""
        from chatcore.serving import End

        self.client_gone = True
        self.handle.cancel()
        self.events.put_nowait(End("cancelled"))

    failure: ChatcoreError | None = None  # the scheduler's error, when the reply failed
    interrupted_by: str | None = None  # the Interrupt's kind, when the server ended the reply
    token_times: list[float] = field(default_factory=list)  # when each token reached the server's loop
    limits: dict[str, float] = field(default_factory=dict)  # the Interrupts' limits in seconds, by kind
    recorded: bool = False  # logged and counted (once, when the reply ended)
    shown: bool = True  # False: an error response went out instead of the reply's text
    _timers: list[asyncio.TimerHandle] = field(default_factory=list)

    @property
    def outcome(self) -> str:
        """How the reply ended, for the metrics: a finish reason, the Interrupt's kind, ``refused``
        (the request's fault, answered 400), ``error`` (the server's, 500) or ``cancelled``."""
        if self.interrupted_by is not None:
            return self.interrupted_by
        if self.finish_reason is not None:
            return self.finish_reason
        if self.error is None:
            return "cancelled"
        refused = self.failure is not None and api_error(self.failure, self.handle).status < 500
        return "refused" if refused else "error"

    def interrupt_after(self, kind: Literal["queue-wait", "timeout"], seconds: float | None) -> None:
        """Put an Interrupt of ``kind`` in the event queue ``seconds`` from now (None: never)."""
        if seconds is None:
            return
        self.limits[kind] = seconds
        loop = asyncio.get_running_loop()
        self._timers.append(loop.call_later(seconds, self.events.put_nowait, Interrupt(kind)))

    def interrupt(self, kind: Literal["shutdown"]) -> None:
        self.events.put_nowait(Interrupt(kind))

    def stop_timers(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()

    def _interrupted(self, interrupt: Interrupt) -> ApiError:
        """Cancel the reply for ``interrupt``: the error the client gets."""
        self.handle.cancel()
        self.interrupted_by = interrupt.kind
        status, code, message = INTERRUPTS[interrupt.kind]
        self.error = message.format(seconds=self.limits.get(interrupt.kind, 0))
        if interrupt.kind != "shutdown":  # the shutdown says in one line how many replies it cut
            logging.getLogger("chatcore.serve").warning("%d %s: %s", status, code, self.error)
        return ApiError(status, self.error, None, code)

    async def _next(self) -> "Event":
        """The scheduler's next event; an Interrupt ends the reply with an ApiError (a queue-wait
        Interrupt only while the request still waits)."""
        while True:
            event = await self.events.get()
            if not isinstance(event, Interrupt):
                return event
            if event.kind == "queue-wait" and self.handle.admitted is not None:
                continue
            raise self._interrupted(event)

    def exchange(self, messages: list["Message"], user: str | None = None) -> "Exchange":
        """What the conversation log keeps of this request: its messages and the reply as sent
        (marked interrupted when it did not end by itself: client gone, an error, the server
        stopping; none of it when an error response went out instead). A reply that ended at
        a stop string the client asked for ended by itself. ``user``: the request's ``user``
        (the end user it names, kept as the author of the user's messages)."""
        from chatcore.adapters.http_api.request_log import Exchange

        provenance = dict(self.handle.provenance)
        timings = dict(provenance.get("timings") or {})
        timings.update(new_tokens=self.completion_tokens, total_s=round(time.perf_counter() - self.handle.submitted, 4))
        provenance.update(timings=timings, usage=self.usage(), finish_reason=self.finish_reason)
        if self.error is not None:
            provenance["error"] = self.error
        finished = datetime.now(timezone.utc)
        return Exchange(
            list(messages),
            self.text if self.shown else "",
            provenance,
            interrupted=self.finish_reason is None,
            received=finished - timedelta(seconds=time.perf_counter() - self.handle.submitted),
            finished=finished,
            user=user,
            token_ids=list(self.handle.token_ids) if self.shown else [],
        )

    @classmethod
    def submit(
        cls,
        scheduler: "Scheduler",
        messages: list["Message"],
        options: "ReplyOptions",
        stops: list[str],
        model: str,
        index: int = 0,
        prompt_format: "PromptFormat | None" = None,
    ) -> "Completion":
        from chatcore.serving import ServerBusy

        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event | Interrupt] = asyncio.Queue()

        def listener(event: Event) -> None:  # on the scheduler's thread: hand the event to the loop
            loop.call_soon_threadsafe(events.put_nowait, event)

        try:
            handle = scheduler.submit(messages, options, listener=listener, prompt_format=prompt_format)
        except ServerBusy as error:
            raise ApiError(429, str(error), None, "server_busy") from None
        return cls(handle, events, scheduler.engine.tokenizer, stops, model, index)

    async def started(self) -> None:
        """Wait for the first token or the end, so a reply that fails to start is an error status."""
        from chatcore.serving import End

        self.first = await self._next()
        if isinstance(self.first, End) and self.first.error is not None:
            self.failure = self.first.error
            self.error = str(self.first.error)
            raise reply_failed(self.first.error, self.handle)

    @property
    def prompt_tokens(self) -> int:
        return int(self.handle.provenance.get("prompt_tokens", 0))

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    async def deltas(self) -> AsyncIterator[Piece]:
        """The reply's text as it comes, a whole word at a time (so that a reply cut short
        never ends in half a word); stop strings end it; leaving early cancels the reply.
        A reply cancelled before its end (the server stopping) raises a 503 ApiError after
        its whole words. Tokens whose text is not sent yet wait for the next piece; those
        left at the end come in a last piece of no text."""
        from chatcore.cutting import WholeWords
        from chatcore.serving import Token
        from chatcore.serving.stops import StopStrings
        from chatcore.streaming import IncrementalDetokenizer

        detokenizer = IncrementalDetokenizer(self.tokenizer)
        stops = StopStrings(self.stops)
        words = WholeWords()
        tokens = TokensByText()
        try:
            while True:
                event, self.first = (self.first, None) if self.first is not None else (await self._next(), None)
                if isinstance(event, Token):
                    self.completion_tokens += 1
                    self.token_times.append(time.perf_counter())
                    decoded = detokenizer.push(event.token_id)
                    tokens.push(event.logprob, decoded)
                    text = words.push(stops.push(decoded))
                    if stops.hit:  # the end the client asked for: the text before it is all there
                        text += words.flush()
                    sent = tokens.sent(len(text)) if not stops.hit else tokens.rest()
                    if text or (stops.hit and sent):
                        self.text += text
                        yield Piece(text, sent)
                    if stops.hit:
                        self.finish_reason = "stop"
                        return
                    continue
                if event.error is not None:
                    self.failure = event.error
                    self.error = str(event.error)
                    raise reply_failed(event.error, self.handle)
                if self.client_gone:
                    return  # nobody to send the rest to; the log keeps what was sent, interrupted
                if self.handle.cancelled or event.reason == "cancelled":
                    self.error = "the reply was cut short: the server is stopping"
                    raise ApiError(503, self.error, None, "server_stopping")
                tail = words.push(stops.push(detokenizer.flush()) + stops.flush()) + words.flush()
                rest = tokens.rest()
                if tail or rest:
                    self.text += tail
                    yield Piece(tail, rest)
                self.finish_reason = "stop" if stops.hit or event.reason != "length" else "length"
                return
        finally:
            self.stop_timers()
            self.handle.cancel()  # a reply left early (stop string, client gone) frees its slot


def provenance_summary(provenance: dict[str, Any]) -> dict[str, Any]:
    """What a client needs to reproduce or explain a reply."""
    keys = ("decoder", "steerers", "seed", "prompt_format", "history_turns_dropped", "truncated_tokens", "timings")
    return {key: provenance[key] for key in keys if key in provenance}


def api_error(error: ChatcoreError, handle: "Handle") -> ApiError:
    """A reply's error as an HTTP error: one raised while the request was prepared (its options,
    its messages against the context) or a setting that does not fit the model (whenever it is
    found) is the client's, 400; a plugin or the model failing, 500."""
    from chatcore.errors import OptionError, PluginError

    if isinstance(error, ApiError):
        return error
    if isinstance(error, OptionError) or (handle.admitted is None and not isinstance(error, PluginError)):
        return ApiError(400, str(error))
    # A plugin's failure comes back on the same request: a client is told not to retry it.
    return ApiError(500, str(error), None, "generation_failed", retry=not isinstance(error, PluginError))


def reply_failed(error: ChatcoreError, handle: "Handle") -> ApiError:
    """:func:`api_error` for a reply that ended with ``error``: a failure on the server's side
    (500) is said on its console too, with the traceback under CHATCORE_DEBUG=1."""
    from chatcore.cli import debug_enabled

    failure = api_error(error, handle)
    if failure.status >= 500:
        logging.getLogger("chatcore.serve").warning("500: %s", error, exc_info=error if debug_enabled() else None)
    return failure


def served_model_name(engine: "Engine") -> str:
    """The model's id in the API: its name, or a local folder's own name (not the whole path)."""
    from pathlib import Path

    name = str(engine.loaded.name)
    return Path(name).name if Path(name).exists() else name
