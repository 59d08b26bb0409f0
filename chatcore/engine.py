"""The dialogue engine: a loaded model, the plugin registry, and replies.

engine = Engine()                       # the bundled chatcore-tiny model
conversation = engine.conversation()    # plain data: turns, system prompt, format name
for delta in engine.send(conversation, "hi, how are you?"):
    print(delta, end="", flush=True)
"""

from __future__ import annotations

import os
import random
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from chatcore.conversation import Conversation
from chatcore.decoding import Decoder
from chatcore.errors import ChatcoreError, OptionError, PluginError
from chatcore.models import DEFAULT_MODEL, LoadedModel, load_model, sampling_defaults
from chatcore.options import Configurable, Settings, machine_settings, settings_fields
from chatcore.plugin_manager import PluginHost, get_plugin_host
from chatcore.prompting import (
    AUTO,
    PromptFormat,
    choose_format,
    prompt_budget,
    scripted_messages,
    validate_format_name,
)
from chatcore.registry import Registry, registry_of
from chatcore.response import Response
from chatcore.serving.logprobs import MAX_TOP_LOGPROBS
from chatcore.steering import GenerationSession, Steerer, check_composition, failed_layer, model_caller
from chatcore.text import clean_message, shown_argument
from chatcore.values import Message, PromptPlan, Turn

DEFAULT_DECODER = "top-k"
DEFAULT_MAX_NEW_TOKENS = 64
BUILTIN_FORMATS = "prompt_formats"  # the entry point of chatcore's own prompt formats
MAX_SHARED_SETUPS = 32  # setup results (decoders and steerers) kept per engine
MAX_SEED = 2**63 - 1  # torch's generators take a signed 64-bit seed


class ReplyOptions(Settings):
    """How to produce one reply. Decoder and steerers are names plus raw settings."""

    decoder: str = DEFAULT_DECODER
    """The decoder's name; a (name, settings) pair, or a spec string (``"top-k top_k=20"``),
    is read as the name and its settings."""
    decoder_settings: dict[str, Any] = {}
    """The decoder's settings, as given (checked when the decoder is built)."""
    steerers: list[tuple[str, dict[str, Any]]] = []
    """(name, settings) of each steerer, in order; a spec string (``"pplm topic=food"``) is
    read as such a pair, and a spec string or a pair alone as a list of one."""
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    """The random seed, 0 to 2**63 - 1 (None: a fresh one per reply)."""
    max_new_tokens: PositiveInt = DEFAULT_MAX_NEW_TOKENS
    """The longest reply, in tokens."""
    min_new_tokens: NonNegativeInt = 1
    """Replies are at least this many tokens."""
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    """Keep each chosen token's log-probability and this many best alternatives' (None: none);
    the reply's Handle.logprobs holds them (see chatcore.serving.logprobs)."""

    @model_validator(mode="before")
    @classmethod
    def _read_steerer_specs(cls, values: Any) -> Any:
        # Before the text conventions of Settings, which would split a spec string at its commas.
        if isinstance(values, Mapping) and "steerers" in values:
            values = {**values, "steerers": steerer_pairs(values["steerers"])}
        decoder = values.get("decoder") if isinstance(values, Mapping) else None
        if isinstance(decoder, (list, tuple)) and len(decoder) == 2 and isinstance(decoder[1], Mapping):
            # decoder=("top-k", {"top_k": 20}), as steerers take their pairs
            given = dict(values.get("decoder_settings") or {})
            both = sorted(set(decoder[1]) & set(given))
            if both:
                raise OptionError(f"`{both[0]}` is given in the decoder's pair and in decoder_settings: give it once")
            values = {**values, "decoder": decoder[0], "decoder_settings": {**dict(decoder[1]), **given}}
        elif isinstance(decoder, str):  # decoder="top-k top_k=20", the command line's spec
            values = read_decoder_spec(values)
        return values

    @model_validator(mode="after")
    def _min_within_max(self) -> ReplyOptions:
        if self.min_new_tokens > self.max_new_tokens:
            raise OptionError(
                f"`min_new_tokens` must be an integer between 0 and max_new_tokens ({self.max_new_tokens}), "
                f"got {self.min_new_tokens!r}"
            )
        return self


def read_decoder_spec(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with a ``decoder`` spec string (``"top-k top_k=20"``) split into the name and
    ``decoder_settings``; a setting in both is refused."""
    decoder = values.get("decoder")
    if not isinstance(decoder, str) or len(decoder.split()) < 2:
        return dict(values)
    from chatcore.cli.specs import parse_spec

    name, settings = parse_spec(decoder)
    given = dict(values.get("decoder_settings") or {})
    both = sorted(set(settings) & set(given))
    if both:
        raise OptionError(f"`{both[0]}` is given in the decoder's spec and in decoder_settings: give it once")
    return {**values, "decoder": name, "decoder_settings": {**settings, **given}}


STEERERS_EXAMPLE = "['bow-bias topic=food'] or [('bow-bias', {'topic': 'food'})]"


def steerer_pairs(given: Any) -> Any:
    """``steerers`` as :class:`ReplyOptions` keeps them, (name, settings) pairs: each spec string
    parsed (``"pplm topic=food"``), a spec string or a pair alone a list of one. What is neither
    a spec string nor a (name, settings) pair is refused in one line saying what an entry must be."""
    from chatcore.cli.specs import parse_spec
    from chatcore.text import shown_value

    if isinstance(given, str):
        return [parse_spec(given)] if given.strip() else []
    if not isinstance(given, (list, tuple)):
        raise OptionError(
            f"`steerers` must be a list of steerer specs, e.g. {STEERERS_EXAMPLE}; got {shown_value(given)}"
        )
    if len(given) == 2 and isinstance(given[0], str) and isinstance(given[1], Mapping):
        given = [given]  # one (name, settings) pair: no list's entry is a mapping
    pairs = []
    for entry in given:
        if isinstance(entry, str):
            pairs.append(parse_spec(entry))
        elif (
            isinstance(entry, (list, tuple))
            and len(entry) == 2
            and isinstance(entry[0], str)
            and isinstance(entry[1], Mapping)
        ):
            pairs.append((entry[0], dict(entry[1])))
        else:
            raise OptionError(
                "each of `steerers` must be a spec string ('bow-bias topic=food') or a (name, settings) pair "
                f"such as ('bow-bias', {{'topic': 'food'}}), got {shown_value(entry)}"
            )
    return pairs


def check_turns(turns: Any) -> None:
    """Refuse (ChatcoreError, one line) ``turns`` that are not a list of messages: a lone string
    (or bytes) would otherwise be read as one turn per character."""
    if isinstance(turns, (str, bytes, bytearray)) or not isinstance(turns, Sequence):
        raise ChatcoreError(
            "`turns` must be a list of turns (oldest first, the user's last), e.g. ['hello']; "
            f"got {shown_argument(turns)}"
        )


def check_conversation(conversation: Any) -> None:
    """Refuse (ChatcoreError, one line) anything but a :class:`Conversation` where one is needed."""
    if not isinstance(conversation, Conversation):
        raise ChatcoreError(
            "`conversation` must be a Conversation (engine.conversation() makes one); "
            f"got {shown_argument(conversation)}"
        )


@dataclass
class PreparedReply:
    """One reply ready to decode: its plugins built, its prompt rendered, its provenance started."""

    options: ReplyOptions
    decoder: Decoder
    steerers: list[Steerer]
    seed: int
    prompt_format: PromptFormat
    plan: PromptPlan
    max_new_tokens: int
    provenance: dict[str, Any]


def build_plugin_object(host: PluginHost, registry: Registry, kind: str, name: str, build: Any) -> Any:
    """``build()`` a decoder, steerer or prompt format, turning any failure into a one-line ChatcoreError.

    Bad settings (ValueError, TypeError, or an OptionError the plugin raised) are an
    OptionError naming the decoder, steerer or format; anything else is the
    plugin's fault: reported with its name (``chatcore plugins`` lists it) and raised as
    a PluginError, so that a broken plugin never takes the program down.
    """
    try:
        return build()
    except OptionError as error:  # said by the plugin: named for it where it does not name itself
        if type(error) is not OptionError or name in str(error):
            raise
        raise OptionError(f"{kind} {name!r}: {error}") from error
    except ChatcoreError:
        raise
    except (ValueError, TypeError) as error:
        raise OptionError(f"{kind} {name!r}: {error}") from error
    except Exception as error:
        plugin = registry.plugin_of(kind, name)
        host.report(plugin, f"{kind} {name}", error)
        raise PluginError(plugin, f"{kind} {name!r} failed to start: {type(error).__name__}: {error}") from error


def validate_options(
    options: ReplyOptions,
    registry: Registry | None = None,
    host: PluginHost | None = None,
    *,
    machine_names: bool = True,
) -> None:
    """Check a whole reply configuration without loading a model: the decoder's and the
    steerers' names, whether the steerers can work together (:func:`check_composition`),
    then each one's settings; the first problem is an OptionError in one line.

    Every entry point calls this (or :meth:`Engine.check_options`, which adds what needs
    the model) when a configuration is given, before it is accepted or anything is logged.
    With ``machine_names=False`` (a request from elsewhere) a setting marked
    :class:`~chatcore.options.OnThisMachine` may only take its default or a bundled name
    (see :func:`refuse_machine_names`).
    """
    host = host or get_plugin_host()
    registry = registry or registry_of(host)
    decoder = registry.decoder(options.decoder)
    steerers = [registry.steerer(name) for name, _ in options.steerers]
    check_composition(steerers)
    for kind, name, cls, settings in [("decoder", options.decoder, decoder, options.decoder_settings)] + [
        ("steerer", name, cls, settings) for cls, (name, settings) in zip(steerers, options.steerers)
    ]:
        if not machine_names:
            refuse_machine_names(kind, name, cls, settings or {})
        build_plugin_object(
            host, registry, kind, name, lambda cls=cls, settings=settings: cls.from_options(settings or {})
        )


def refuse_machine_names(kind: str, name: str, cls: type[Configurable], settings: Mapping[str, Any]) -> None:
    """Refuse (OptionError) a raw setting marked :class:`~chatcore.options.OnThisMachine`
    whose value is neither its default nor one of ``cls.setting_choices`` (the bundled
    names): what a request from elsewhere may not set, since it would make this machine
    open a file of its choosing or load a model. Checked before the settings are built,
    since building them may already read the file. The operator's own configuration is
    not checked."""
    marked = machine_settings(cls.Settings)
    for key, value in settings.items():
        field = key.replace("-", "_")
        if field not in marked:
            continue
        marker, default = marked[field]
        text = "" if value is None else str(value).strip()
        if text.lower() in ("", "none") or value == default or text == str(default):
            continue
        choices = cls.setting_choices(field)
        if text in choices:
            continue
        offered = f" (it may be one of: {', '.join(choices)})" if choices else ""
        raise OptionError(
            f"{kind} {name!r}: `{field}` names a {marker.what} on the machine that runs chatcore, which a "
            f"request cannot set{offered}; its operator can allow it (--allow-local-files)"
        )


def _has_setup(cls: type[Configurable]) -> bool:
    """Whether a decoder's or steerer's class makes a setup of its own."""
    return cls.setup.__func__ is not Configurable.setup.__func__  # type: ignore[attr-defined]


class Engine:
    """Owns one model (and tokenizer) and builds decoders and steerers from the registry."""

    def __init__(
        self,
        model: str | os.PathLike[str] | LoadedModel = DEFAULT_MODEL,
        device: str | None = None,
        dtype: str | None = None,
        host: PluginHost | None = None,
        prompt_format: str = AUTO,
    ) -> None:
        self.host = host or get_plugin_host()
        if not self.registry.prompt_formats:
            # Every engine needs a prompt format: a host assembled by hand (tests, embedding
            # programs) gets the built-in ones, as the entry-point host always has them.
            self.host.load_builtins((BUILTIN_FORMATS,))
        validate_format_name(prompt_format, self.registry)  # an unknown name fails before the model loads
        self.loaded = model if isinstance(model, LoadedModel) else load_model(model, device=device, dtype=dtype)
        self.sampling_defaults = sampling_defaults(self.loaded)
        self._formats: dict[str, PromptFormat] = {}
        self._setups: OrderedDict[tuple[type, str], Any] = OrderedDict()  # decoders' and steerers' setup results
        self._setups_lock = threading.Lock()  # the scheduler makes setups on a thread of their own
        self.prompt_format = self.make_prompt_format(prompt_format)

    @property
    def registry(self) -> Registry:
        """The names the host's plugins registered (built once per set of plugins: :func:`registry_of`)."""
        return registry_of(self.host)

    # -- model -------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def eos_token_id(self) -> int:
        return self.loaded.eos_token_id

    # -- prompt formats --------------------------------------------------------------
    def make_prompt_format(self, name: str = AUTO) -> PromptFormat:
        """The model's prompt format by name (``auto``: its chat template, else dialogpt); built once per name."""
        cls = choose_format(self.registry, self.tokenizer, name)
        if cls.name not in self._formats:
            generation_config = getattr(self.loaded.model, "generation_config", None)
            self._formats[cls.name] = self._construct(
                lambda: cls(self.tokenizer, generation_config, self.loaded.name), "prompt format", cls.name
            )
        return self._formats[cls.name]

    def format_for(self, conversation: Conversation) -> PromptFormat:
        """The conversation's own format if it names one, else the engine's."""
        if conversation.prompt_format is None:
            return self.prompt_format
        return self.make_prompt_format(conversation.prompt_format)

    # -- plugins -----------------------------------------------------------------
    def make_decoder(self, name: str, settings: Mapping[str, Any] | None = None) -> Decoder:
        """The decoder ``name`` with ``settings``; settings not given take the model's own
        recommended sampling where the decoder has them (:func:`chatcore.models.sampling_defaults`)."""
        decoder = self._decoder_object(name, settings)
        decoder.shared = self._shared_setup(decoder)
        return decoder

    def _decoder_object(self, name: str, settings: Mapping[str, Any] | None) -> Decoder:
        cls = self.registry.decoder(name)
        fields = settings_fields(cls.Settings)  # names only: building the JSON schema took ~8 ms per reply
        given = dict(settings or {})
        merged = {**{k: v for k, v in self.sampling_defaults.items() if k in fields and k not in given}, **given}
        decoder: Decoder = self._construct(lambda: cls.from_options(merged), "decoder", name)
        return decoder

    def _steerer_object(self, name: str, settings: Mapping[str, Any] | None) -> Steerer:
        cls = self.registry.steerer(name)
        steerer: Steerer = self._construct(lambda: cls.from_options(settings or {}), "steerer", name)
        return steerer

    def make_steerer(self, name: str, settings: Mapping[str, Any] | None = None) -> Steerer:
        steerer = self._steerer_object(name, settings)
        steerer.shared = self._shared_setup(steerer)
        return steerer

    def setups_missing(self, options: ReplyOptions) -> bool:
        """Whether a reply with ``options`` would first make a decoder's or steerer's setup
        (load a reverse model, read a block, compute a vector): what the scheduler makes on a
        thread of its own, so that the replies it decodes go on meanwhile. Options that cannot
        be built count as ready: their error comes where the reply is prepared."""
        try:
            classes: list[type[Configurable]] = [self.registry.decoder(options.decoder)]
            classes += [self.registry.steerer(name) for name, _ in options.steerers]
            if not any(map(_has_setup, classes)):  # most replies: nothing to build twice on the scheduler's thread
                return False
            built: list[Configurable] = [self._decoder_object(options.decoder, options.decoder_settings)]
            built += [self._steerer_object(name, settings) for name, settings in options.steerers]
        except ChatcoreError:
            return False
        keys = [key for key in map(self._setup_key, built) if key is not None]
        with self._setups_lock:
            return any(key not in self._setups for key in keys)

    def check_options(self, options: ReplyOptions) -> None:
        """Refuse ``options`` now if a reply could not be made with them: what
        :func:`validate_options` checks, then each steerer's setup on this engine's model (a
        layer the model lacks, a block that does not fit it). Nothing is decoded or logged."""
        options = self.options_for(options)
        validate_options(options, self.registry, self.host)
        self.checked_decoder(options)
        for name, settings in options.steerers:
            self.make_steerer(name, settings)

    def checked_decoder(self, options: ReplyOptions) -> Decoder:
        """The options' decoder, its settings checked against this model too: a ``logit_bias``
        key outside the vocabulary is refused in one line, whichever entry point it came through."""
        decoder = self.make_decoder(options.decoder, options.decoder_settings)
        outside = [t for t in getattr(decoder.settings, "logit_bias", None) or {} if t >= len(self.tokenizer)]
        if outside:
            raise OptionError(
                f"decoder {options.decoder!r}: `logit_bias` keys must be token ids below {len(self.tokenizer)}, "
                f"got {min(outside)!r}"
            )
        return decoder

    def options_for(self, options: ReplyOptions | Mapping[str, Any] | None = None, **overrides: Any) -> ReplyOptions:
        """``options`` (default: the defaults) with ``overrides`` applied, as :meth:`respond` reads them.

        ``decoder`` and ``steerers`` also take the command line's spec strings
        (``decoder="top-k top_k=20"``, ``steerers=["pplm topic=food"]``); an override that is
        no reply option (``temperature``, ``steer``) is refused with where it belongs.

        ``options`` may also be a dict of the same fields (``{"seed": 1}``), read as overrides
        (those given as keywords win); anything else is refused in one line."""
        if isinstance(options, Mapping):
            overrides = {**options, **overrides}
            options = None
        elif options is not None and not isinstance(options, ReplyOptions):
            raise OptionError(
                "`options` must be a ReplyOptions or a dict of its fields, e.g. {'seed': 1}; "
                f"got {shown_argument(options)}"
            )
        options = options or ReplyOptions()
        if not overrides:
            return options

        unknown = [name for name in overrides if name not in ReplyOptions.model_fields]
        if unknown:
            raise OptionError(
                f"unknown reply option {unknown[0]!r} (they are: {', '.join(ReplyOptions.model_fields)}); a decoder's "
                "settings go in decoder_settings={'temperature': 0.7} or the decoder's spec "
                "(decoder='top-k temperature=0.7'), steerers in steerers=['pplm topic=food'] or [(name, settings)]"
            )
        # The spec read here, so that its settings replace the options' (not meet them as a clash).
        overrides = read_decoder_spec(overrides)
        return options.replace(**overrides)  # ReplyOptions reads the steerers' spec strings

    def _shared_setup(self, plugin_object: Configurable) -> Any:
        """``setup(model, settings)`` of a decoder's or steerer's class, run once per settings and kept."""
        key = self._setup_key(plugin_object)
        if key is None:
            return None
        with self._setups_lock:
            if key in self._setups:
                self._setups.move_to_end(key)
                return self._setups[key]
        cls = type(plugin_object)
        shared = self._construct(lambda: cls.setup(self.loaded, plugin_object.settings), cls.kind, plugin_object.name)
        with self._setups_lock:
            self._setups[key] = shared
            while len(self._setups) > MAX_SHARED_SETUPS:
                self._setups.popitem(last=False)
        return shared

    @staticmethod
    def _setup_key(plugin_object: Configurable) -> tuple[type, str] | None:
        """What a setup is kept by (its class and settings); None for a class without one."""
        cls = type(plugin_object)
        return (cls, repr(plugin_object.settings)) if _has_setup(cls) else None

    def _construct(self, build: Any, kind: str, name: str) -> Any:
        return build_plugin_object(self.host, self.registry, kind, name, build)

    # -- conversations ----------------------------------------------------------
    def conversation(self, system: str | None = None, prompt_format: str | None = None, **meta: Any) -> Conversation:
        """A new conversation, with an optional system prompt and prompt format name (default:
        the engine's, by the name it resolved to)."""
        chosen = self.make_prompt_format(prompt_format) if prompt_format is not None else self.prompt_format
        return Conversation(system=system, prompt_format=chosen.name, **meta)

    def scripted(self, turns: Sequence[str], system: str | None = None) -> Conversation:
        """A conversation holding a scripted context (oldest turn first; the user's turn last).

        ``turns`` is a list of messages: a lone string is refused rather than read as its
        characters (one turn each)."""
        check_turns(turns)
        conversation = self.conversation(system=system)
        for message in scripted_messages(turns):
            if message.role == "user":
                self.add_user(conversation, message.text)
            else:
                conversation.add_bot_text(clean_message(message.text))
        return conversation

    def reply_to(
        self,
        turns: Sequence[str],
        options: ReplyOptions | Mapping[str, Any] | None = None,
        system: str | None = None,
        **overrides: Any,
    ) -> Response:
        """One-shot: a reply to a scripted context (oldest turn first, the user's last)."""
        options = self.options_for(options, **overrides)
        self.check_options(options)  # as send does: refused before a turn is added or logged
        return self.respond(self.scripted(turns, system), options)

    def add_user(self, conversation: Conversation, text: Any, meta: dict[str, Any] | None = None) -> Turn:
        """Append a user turn (validated and normalised) to ``conversation`` and fire ``on_user_message``.

        ``meta``: facts about the turn that adapters record, e.g. ``{"author_id": "123"}``
        (the conversation log stores the author so that an operator can export or delete
        one person's messages).
        """
        check_conversation(conversation)
        turn = Turn("user", clean_message(text), meta=dict(meta or {}))
        conversation.turns.append(turn)
        self.host.call_each("on_user_message", conversation=conversation, turn=turn, model=self.loaded)
        return turn

    def send(
        self,
        conversation: Conversation,
        text: Any,
        options: ReplyOptions | Mapping[str, Any] | None = None,
        **overrides: Any,
    ) -> Response:
        """``add_user(conversation, text)`` then ``respond(conversation)``.

        Options that cannot make a reply (an unknown name, a bad setting, steerers that
        cannot work together) are refused first, so the message is not added or logged.
        """
        options = self.options_for(options, **overrides)
        self.check_options(options)
        self.add_user(conversation, text)  # refuses what is no Conversation before anything is added
        return self.respond(conversation, options)

    def respond(
        self, conversation: Conversation, options: ReplyOptions | Mapping[str, Any] | None = None, **overrides: Any
    ) -> Response:
        """A lazy reply to the conversation so far (its last turn should be the user's),
        recorded in it when it ends (:meth:`record`)."""
        check_conversation(conversation)
        reply = self.prepare_reply(conversation, self.options_for(options, **overrides))
        return Response(
            lambda: self.reply_tokens(reply),
            self.tokenizer,
            reply.provenance,
            finalize=lambda response: self.record(conversation, response),
        )

    def record(self, conversation: Conversation, response: Response) -> None:
        """Add a finished reply to ``conversation`` as a bot turn (with its provenance) and fire
        ``on_response``; every entry point's replies end here, once each."""
        text = response.text()  # the reply has ended: this is what it streamed, cut to whole words
        if not text and (response.error is not None or response.interrupted):
            # A reply that failed or was stopped before its first whole word (Ctrl-C while
            # MMI ranks its candidates, a timeout in the middle of the first word) is not a
            # turn: the user's message waits for one.
            return
        conversation.add_bot_text(text, interrupted=response.interrupted, meta={"provenance": response.provenance})
        self.host.call_each("on_response", conversation=conversation, response=response)

    def prompt(self, conversation: Conversation, max_new_tokens: int) -> PromptPlan:
        """The prompt's token ids for ``conversation``, leaving room for a reply of
        ``max_new_tokens`` (see :func:`chatcore.prompting.prompt_budget`)."""
        return self._fit(self.format_for(conversation), conversation.messages(), max_new_tokens)

    def _fit(self, prompt_format: PromptFormat, messages: list[Message], max_new_tokens: int) -> PromptPlan:
        if not any(m.role != "system" for m in messages):
            raise ChatcoreError("the conversation has no turns to reply to")
        return prompt_format.fit(messages, prompt_budget(self.loaded.max_positions, max_new_tokens))

    def prepare_reply(
        self,
        source: Conversation | Sequence[Message],
        options: ReplyOptions | None = None,
        prompt_format: PromptFormat | None = None,
    ) -> PreparedReply:
        """Build the decoder and steerers and render the prompt of one reply, without decoding.

        ``source`` is a conversation (its own format and system prompt) or a list of
        messages (system first if any) rendered in ``prompt_format`` (default: the
        engine's). ``respond`` and the serving scheduler both start here, so a reply has
        the same prompt, seed and provenance whichever of them decodes it.
        """
        options = self.options_for(options)
        decoder = self.checked_decoder(options)
        steerers = [self.make_steerer(name, settings) for name, settings in options.steerers]
        check_composition([type(steerer) for steerer in steerers])
        seen: dict[str, int] = {}
        for steerer in steerers:  # the second instance of a steerer notes as "name#2", and so on
            seen[steerer.name] = seen.get(steerer.name, 0) + 1
            steerer.details_key = steerer.name if seen[steerer.name] == 1 else f"{steerer.name}#{seen[steerer.name]}"
        seed = options.seed if options.seed is not None else random.randrange(2**31)
        if isinstance(source, Conversation):
            prompt_format = self.format_for(source)
            plan = self._fit(prompt_format, source.messages(), options.max_new_tokens)
        else:
            prompt_format = prompt_format or self.prompt_format
            plan = prompt_format.fit(list(source), prompt_budget(self.loaded.max_positions, options.max_new_tokens))
        # A reply never runs past the context: a large budget is capped by the room the prompt leaves.
        max_new_tokens = min(options.max_new_tokens, self.loaded.max_positions - len(plan.token_ids))
        provenance: dict[str, Any] = {
            "model": self.loaded.name,
            "prompt_format": prompt_format.name,
            # The system prompt the reply was made with, so that each logged reply can be reproduced.
            "system": plan.messages[0].text if plan.messages and plan.messages[0].role == "system" else None,
            "decoder": decoder.describe(),
            "steerers": [s.describe() for s in steerers],
            "seed": seed,
            "max_new_tokens": max_new_tokens,
            "prompt_tokens": len(plan.token_ids),
            "history_turns_used": plan.turns_used,
            "history_turns_dropped": plan.turns_dropped,
            "truncated_tokens": plan.truncated_tokens,
        }
        return PreparedReply(options, decoder, steerers, seed, prompt_format, plan, max_new_tokens, provenance)

    def start_session(self, reply: PreparedReply) -> GenerationSession:
        """The reply's generation session (its seeded generator), with every steerer prepared."""
        import torch

        generator = torch.Generator(device=self.loaded.device).manual_seed(reply.seed)
        session = GenerationSession(
            model=self.loaded,
            prompt_ids=reply.plan.token_ids,
            steerers=reply.steerers,
            max_new_tokens=reply.max_new_tokens,
            min_new_tokens=min(reply.options.min_new_tokens, reply.max_new_tokens),
            generator=generator,
            seed=reply.seed,
            stop_token_ids=reply.prompt_format.stop_token_ids,
            banned_token_ids=reply.prompt_format.banned_token_ids,
            messages=reply.plan.messages,
            logprobs=reply.options.logprobs,
        )
        for steerer in reply.steerers:
            self.guard(steerer, "prepare", lambda s=steerer: s.prepare(session))
        return session

    def reply_tokens(self, reply: PreparedReply) -> Iterator[int]:
        """Decode ``reply`` on the caller's thread, through the one runner (a batch of one):
        its token ids as they come (plugin failures as one-line ChatcoreErrors)."""
        from chatcore.serving.runner import decode_alone

        # A generator: the session starts (and its steerers prepare) when the reply is first read.
        yield from decode_alone(self.loaded, self, self.start_session(reply), reply.decoder, reply.provenance)

    def guard(self, plugin_object: Any, what: str, call: Any) -> Any:
        """``call()`` on behalf of a decoder or steerer: a failure becomes a one-line
        PluginError naming it (and is reported to the plugin host)."""
        try:
            return call()
        except ChatcoreError:
            raise
        except Exception as error:
            kind = "decoder" if isinstance(plugin_object, Decoder) else "steerer"
            plugin = self.registry.plugin_of(kind, plugin_object.name)
            self.host.report(plugin, f"{kind} {plugin_object.name} {what}", error)
            raise PluginError(
                plugin, f"{kind} {plugin_object.name!r} failed in {what}: {type(error).__name__}: {error}"
            ) from error

    def blame(self, error: Exception, decoder: Decoder) -> ChatcoreError:
        """The one-line error for a failure while generating: the model's, a steerer's (the
        step layer it came from) or else the decoder's; a plugin's is reported with its name."""
        layer = failed_layer(error)
        what = f"{type(error).__name__}: {error}"
        if layer == "model":
            caller = model_caller(error)
            if caller is None:
                return ChatcoreError(f"the model failed while generating: {what}")
            # The model failed on the state a steerer's step passed on to it: the steerer's failure.
            layer, what = caller, f"the model failed on the state it passed on: {what}"
        if layer is not None and layer.startswith("steerer:"):
            kind, name = "steerer", layer.split(":", 1)[1]
        else:
            kind, name = "decoder", decoder.name
        plugin = self.registry.plugin_of(kind, name)
        self.host.report(plugin, f"{kind} {name}", error)
        return PluginError(plugin, f"{kind} {name!r} failed while generating: {what}")
