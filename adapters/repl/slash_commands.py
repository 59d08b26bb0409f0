"""The REPL's slash commands and message handling, free of any terminal I/O.

:func:`handle_line` takes the state and one input line and returns an
:class:`Outcome`: text to show, maybe a lazy reply to stream, and whether to quit.
Bad input and bad settings come back as a one-line error, never as an exception
(anything that is not a :class:`~chatcore.errors.ChatcoreError` is a bug and does
propagate).

A line starting with ``/`` is a command; start it with ``//`` to send a message that
begins with ``/``. A command that fails, or during which Ctrl-C is pressed, changes nothing
(see :mod:`~chatcore.adapters.repl.cancelling`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chatcore.cli.specs import parse_spec, split_settings, with_steerer
from chatcore.errors import ChatcoreError, OptionError
from chatcore.explain import explain, format_settings
from chatcore.log.formatting import SHORT_ID, display_safe, one_line, summary_table
from chatcore.text import shown_value, undecodable_at

if TYPE_CHECKING:
    from chatcore.adapters.repl.state import ChatState, Saved
    from chatcore.conversation import Conversation, Turn
    from chatcore.response import Response

KEYS_HELP = """keys: Enter sends; Esc-Enter (or Alt-Enter) adds a line; /multi swaps the two.
      Ctrl-C stops a reply (the partial reply is kept, marked interrupted), cancels a command
      (nothing changes) or clears the line;
      Ctrl-D or /quit exits. Tab completes commands, decoder and steerer names and settings.
      Start a message with // to send a line that begins with /."""


@dataclass
class Outcome:
    output: str = ""
    reply: "Response | None" = None
    quit: bool = False
    error: bool = False


def failure(message: Any) -> Outcome:
    text = " ".join(str(message).split()) or "failed"
    return Outcome(output=f"error: {text}", error=True)


@dataclass(frozen=True)
class Command:
    name: str
    usage: str
    summary: str
    run: Callable[["ChatState", str], Outcome]

    @property
    def takes_arguments(self) -> bool:
        return self.usage != self.name  # "/new" takes none, "/max [N]" does


COMMANDS: dict[str, Command] = {}
ALIASES = {"/exit": "/quit", "/q": "/quit", "/?": "/help"}


def command(name: str, usage: str, summary: str) -> Callable[[Callable[["ChatState", str], Outcome]], Any]:
    def add(function: Callable[["ChatState", str], Outcome]) -> Callable[["ChatState", str], Outcome]:
        COMMANDS[name] = Command(name, usage, summary, function)
        return function

    return add


def handle_line(state: "ChatState", line: str) -> Outcome:
    """One line from the person: a slash command, or a message to reply to."""
    if undecodable_at(line) is not None:  # terminals and the plain reader decode with surrogateescape
        return failure("the input is not UTF-8 text (undecodable bytes); nothing was sent")
    stripped = line.strip()
    if not stripped:
        return Outcome()
    if stripped.startswith("/") and not stripped.startswith("//"):
        return run_command(state, stripped)
    text = stripped[1:] if stripped.startswith("//") else line
    try:
        return Outcome(reply=state.send(text))
    except ChatcoreError as error:
        return failure(error)


def run_command(state: "ChatState", line: str) -> Outcome:
    name, rest = (line.split(maxsplit=1) + [""])[:2]  # "/system" then Esc-Enter and a text works too
    name = ALIASES.get(name.lower(), name.lower())
    found = COMMANDS.get(name)
    if found is None:
        return failure(f"unknown command {one_line(name, 40)!r}; /help lists the commands")
    rest = rest.strip()
    if rest and not found.takes_arguments:
        return failure(f"{found.name} takes no arguments, got {one_line(rest, 40)!r} (usage: {found.usage})")
    from chatcore.adapters.repl.cancelling import ctrl_c_noted

    saved = state.save()
    try:
        with ctrl_c_noted() as presses:
            outcome = found.run(state, rest)
    except KeyboardInterrupt:
        return cancelled(state, saved, found.name, None)
    except ChatcoreError as error:
        state.restore(saved)
        outcome = failure(error)
    if presses.pressed:  # it ran on (Ctrl-C is only noted outside the wait for loading): undone
        return cancelled(state, saved, found.name, outcome.reply)
    return outcome


def cancelled(state: "ChatState", saved: "Saved", name: str, reply: "Response | None") -> Outcome:
    """Ctrl-C during a command: what it changed is put back, and a reply it started (``/retry``'s)
    is stopped unread, so it records nothing."""
    state.restore(saved)
    if reply is not None:
        reply.interrupt()
    return Outcome(output=f"{name} cancelled; nothing changed", error=True)


# -- showing settings ---------------------------------------------------------------


def describe_decoder(state: "ChatState") -> str:
    name, given = state.options.decoder, dict(state.options.decoder_settings)
    decoder = state.background(lambda: state.engine.make_decoder(name, given)).describe()
    return f"{decoder['name']} {format_settings(decoder['settings'])}".strip()


def describe_model_defaults(state: "ChatState") -> str:
    """The sampling the model recommends (its generation config, else the known models' table),
    which the decoder takes for the settings not given."""
    defaults = state.engine.sampling_defaults
    if not defaults:
        return "none (the decoder's own defaults)"
    return format_settings(defaults) + " (for settings not given; /set overrides)"


def describe_steerers(state: "ChatState") -> list[str]:
    specs = list(state.options.steerers)
    steerers = state.background(lambda: [state.engine.make_steerer(name, raw) for name, raw in specs])
    lines = []
    for steerer in steerers:
        described = steerer.describe()
        lines.append(f"{described['name']} {format_settings(described['settings'])}".strip())
    return lines


def available(table: dict[str, Any]) -> str:
    return ", ".join(sorted(table)) or "none"


def count(number: int, noun: str) -> str:
    """``1 turn``, ``2 turns``."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def unquote_spec(rest: str) -> str:
    """A spec typed as the command line wants it, ``"top-k top_k=20"``, is the spec inside the quotes."""
    import shlex

    try:
        words = shlex.split(rest)
    except ValueError:
        return rest  # parse_spec reports the unbalanced quote
    return words[0] if len(words) == 1 and len(words[0].split()) > 1 else rest


def describe_system(text: str | None, default: str | None = None) -> str:
    if not text and default:
        return (
            "no system prompt of its own: the model's chat template adds its default (/system TEXT replaces it):\n"
            + "\n".join(f"  {line}" for line in display_safe(default).splitlines())
        )
    if not text:
        return "no system prompt (/system TEXT sets one)"
    return "system prompt:\n" + "\n".join(f"  {line}" for line in display_safe(text).splitlines())


# -- the commands -----------------------------------------------------------------
@command("/help", "/help", "this list")
def help_command(state: "ChatState", rest: str) -> Outcome:
    width = max(len(c.usage) for c in COMMANDS.values())
    lines = [f"{c.usage.ljust(width)}  {c.summary}" for c in COMMANDS.values()]
    return Outcome(output="\n".join(lines) + "\n" + KEYS_HELP)


@command("/decoder", "/decoder [NAME key=value ...]", "show or switch the decoder (e.g. /decoder top-k top_k=20)")
def decoder_command(state: "ChatState", rest: str) -> Outcome:
    if not rest:
        return Outcome(
            output=f"decoder: {describe_decoder(state)}\navailable: {available(state.engine.registry.decoders)}"
        )
    name, settings = parse_spec(unquote_spec(rest))
    settings, not_applied = with_command_line_sampling(state, name, settings)
    options = state.options.replace(decoder=name, decoder_settings=settings)
    state.check_options(options)  # the whole configuration, before anything changes
    state.options.decoder, state.options.decoder_settings = name, settings
    return Outcome(output=f"decoder: {describe_decoder(state)}" + (f"\nnote: {not_applied}" if not_applied else ""))


def with_command_line_sampling(state: "ChatState", name: str, settings: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """``settings`` of the decoder ``name`` with the command line's ``--temperature`` and ``--top-p``
    for those its spec leaves out, and what was not applied (a setting the decoder does not
    have, a value it refuses: a one-line note), or ""."""
    if not state.sampling_shortcuts:
        return settings, ""
    from chatcore.options import settings_fields

    cls = state.engine.registry.decoder(name)  # an unknown name fails here, in one line
    fields = settings_fields(cls.Settings)
    merged = dict(settings)
    skipped = []
    for setting, value in state.sampling_shortcuts.items():
        flag = f"--{setting.replace('_', '-')} {value:g}"
        if setting in settings:
            continue
        if setting not in fields:
            skipped.append(f"{flag} (it has no such setting)")
            continue
        try:
            cls.from_options({setting: repr(value)})
        except (ChatcoreError, ValueError, TypeError) as error:
            skipped.append(f"{flag} ({one_line(str(error), 120)})")
            continue
        merged[setting] = repr(value)
    return merged, f"{name} does not use the command line's {'; '.join(skipped)}" if skipped else ""


@command(
    "/steer",
    "/steer NAME key=value ... | off [NAME]",
    "turn a steerer on (or change its settings), or off (all, or one)",
)
def steer_command(state: "ChatState", rest: str) -> Outcome:
    active = [name for name, _ in state.options.steerers]
    if not rest:
        shown = "\n  ".join(describe_steerers(state)) or "none"
        return Outcome(output=f"steering: {shown}\navailable: {available(state.engine.registry.steerers)}")
    words = unquote_spec(rest).split()
    if words[0].lower() == "off":
        names = words[1:]
        if not names:
            state.options.steerers = []
            return Outcome(output="steering off")
        missing = [name for name in names if name not in active]
        if missing:
            return failure(f"steerer {missing[0]!r} is not on (on: {', '.join(active) or 'none'})")
        state.options.steerers = [(n, s) for n, s in state.options.steerers if n not in names]
        left = ", ".join(n for n, _ in state.options.steerers) or "none"
        return Outcome(output=f"steering off: {', '.join(names)} (still on: {left})")
    name, settings = parse_spec(unquote_spec(rest))
    steerers = with_steerer(state.options.steerers, name, settings)
    state.check_options(state.options.replace(steerers=steerers))  # all of it, before anything changes
    state.options.steerers = steerers
    return Outcome(output="steering: " + "; ".join(describe_steerers(state)))


@command("/max", "/max [N]", "show or set the reply budget in tokens (e.g. /max 200)")
def max_command(state: "ChatState", rest: str) -> Outcome:
    if not rest:
        return Outcome(output=f"max new tokens: {state.options.max_new_tokens} (/max N changes it)")
    try:
        budget = int(rest)
    except ValueError:
        budget = 0
    if not 1 <= budget <= MAX_BUDGET:
        raise OptionError(f"`/max` takes a number of tokens from 1 to {MAX_BUDGET}, got {one_line(rest, 40)!r}")
    # What the system prompt leaves room for is checked too, before anything changes.
    options = state.options.replace(max_new_tokens=budget)
    from chatcore.prompting import check_system_fits

    check_system_fits(
        state.engine.format_for(state.current), state.current.system, state.engine.loaded.max_positions, budget
    )
    state.options = options
    room = state.engine.loaded.max_positions
    capped = f" (capped by the room the prompt leaves in the model's {room} positions)" if budget >= room else ""
    return Outcome(output=f"max new tokens: {budget} from the next reply on{capped}")


@command("/set", "/set KEY=VALUE ...", "change decoder settings (e.g. /set temperature=0.7 top_p=0.9)")
def set_command(state: "ChatState", rest: str) -> Outcome:
    from chatcore.options import parse_key_values

    if not rest:
        return Outcome(output=f"decoder: {describe_decoder(state)}\n/set KEY=VALUE changes a setting")
    changes = parse_key_values(split_settings(rest))
    settings = {**state.options.decoder_settings, **changes}
    options = state.options.replace(decoder_settings=settings)
    state.check_options(options)  # the decoder's own settings model validates, before anything changes
    state.options.decoder_settings = settings
    return Outcome(output=f"decoder: {describe_decoder(state)}")


@command("/settings", "/settings", "model, decoder, steerers, seed, log and conversation")
def settings_command(state: "ChatState", rest: str) -> Outcome:
    loaded = state.engine.loaded
    conversation = state.current
    seed = "random" if state.next_seed is None else f"{state.next_seed} (next reply; +1 per reply)"
    log = state.log_status if state.store is None else f"{state.log_status}: {state.store.display_url}"
    lines = [
        f"model:          {loaded.name} ({loaded.device})",
        f"decoder:        {describe_decoder(state)}",
        f"model defaults: {describe_model_defaults(state)}",
        f"steerers:       {'; '.join(describe_steerers(state)) or 'none'}",
        f"seed:           {seed}",
        f"max new tokens: {state.options.max_new_tokens} (/max N changes it; /set KEY=VALUE the decoder's)",
        f"format:         {state.format_name}",
        f"system prompt:  {one_line(conversation.system, 60) if conversation.system else 'none'}",
        f"log:            {log}",
        f"conversation:   {conversation.id} ({count(len(conversation.turns), 'turn')})",
        f"multi-line:     {'on (Esc-Enter sends)' if state.multiline else 'off (Esc-Enter adds a line)'}",
    ]
    return Outcome(output="\n".join(lines))


CLEAR_WORDS = ("clear", "off")
MAX_BUDGET = 4096  # as -n/--max-new-tokens


@command("/system", "/system [TEXT | clear]", "show, set or clear the system prompt (from the next reply on)")
def system_command(state: "ChatState", rest: str) -> Outcome:
    if not rest:
        return Outcome(
            output=describe_system(state.current.system, state.engine.format_for(state.current).default_system)
        )
    if rest.lower() in CLEAR_WORDS:
        had = state.current.system is not None
        state.set_system(None)
        return Outcome(output="system prompt cleared" if had else "no system prompt to clear")
    state.set_system(rest)
    return Outcome(
        output=describe_system(state.current.system, state.engine.format_for(state.current).default_system)
        + "\n(used from the next reply on)"
    )


@command("/format", "/format [NAME | auto]", "show or switch the prompt format (how turns become the prompt)")
def format_command(state: "ChatState", rest: str) -> Outcome:
    names = available({"auto": None, **state.engine.registry.prompt_formats})
    if not rest:
        return Outcome(output=f"format: {state.format_name}\navailable: {names}")
    name = rest.split()[0]
    if name != "auto" and name not in state.engine.registry.prompt_formats:
        return failure(f"unknown prompt format {one_line(name, 40)!r} (available: {names})")
    chosen = state.set_format(name)
    picked = " (auto picked it)" if name == "auto" else ""
    return Outcome(output=f"format: {chosen}{picked}")


@command("/new", "/new", "start a new conversation")
def new_command(state: "ChatState", rest: str) -> Outcome:
    conversation = state.new_conversation()
    return Outcome(output=f"new conversation {conversation.id[:SHORT_ID]}")


def format_turns(state: "ChatState", limit: int | None = None) -> str:
    turns = state.current.turns
    shown = turns if limit is None else turns[-limit:]
    lines = []
    if len(shown) < len(turns):
        lines.append(f"({count(len(turns) - len(shown), 'earlier turn')} not shown; /history shows all)")
    for turn in shown:
        label = "you" if turn.role == "user" else "bot"
        if turn.meta.get("provenance", {}).get("error"):
            mark = " [cut short by an error]"
        elif turn.interrupted:
            mark = " [interrupted]"
        elif turn.meta.get("provenance", {}).get("finish_reason") == "length":
            budget = turn.meta["provenance"].get("max_new_tokens")
            mark = f" [cut at {budget} {'token' if budget == 1 else 'tokens'}]"
        else:
            mark = ""
        lines.append(f"{label}> {display_safe(turn.text)}{mark}")
    return "\n".join(lines)


@command("/history", "/history", "the turns of this conversation")
def history_command(state: "ChatState", rest: str) -> Outcome:
    if not state.current.turns:
        return Outcome(output="(no turns yet)")
    return Outcome(output=format_turns(state))


@command("/retry", "/retry", "drop the last reply and generate a new one")
def retry_command(state: "ChatState", rest: str) -> Outcome:
    conversation = state.current
    if not any(turn.role == "user" for turn in conversation.turns):
        return failure("nothing to retry: send a message first")
    if conversation.turns[-1].role != "bot":
        return Outcome(reply=state.reply())  # the last reply was stopped before its first word: none to drop
    # The log keeps the dropped reply, marked superseded once the new one is written.
    dropped = conversation.turns.pop()
    reply = state.reply()  # what fails here is undone by the dispatcher: the reply comes back
    reply.on_done(lambda ended: keep_unless_replaced(state, conversation, dropped, ended))
    return Outcome(reply=reply)


def keep_unless_replaced(state: "ChatState", conversation: "Conversation", dropped: "Turn", reply: "Response") -> None:
    """A retried reply stopped (or failed) before its first whole word is not a turn, so it
    supersedes nothing in the log: the reply it was to replace comes back, and the chat and
    the log agree on the conversation."""
    if conversation.turns and conversation.turns[-1].role == "bot":
        return  # the new reply (whole or cut short) replaced it
    conversation.turns.append(dropped)
    if state.last_response is reply:
        state.last_response = None  # /why explains the reply kept
    how = "failed" if reply.error is not None else "was stopped"
    state.notify(f"the retry {how} before its first word: the previous reply is kept")


def _last_provenance(state: "ChatState") -> dict[str, Any] | None:
    response = state.last_response
    if response is not None and response.done:
        return response.provenance
    for turn in reversed(state.current.turns):
        if turn.role == "bot":
            return turn.meta.get("provenance")
    return None


@command("/why", "/why", "how the last reply was chosen: MMI candidates and scores, steering details")
def why_command(state: "ChatState", rest: str) -> Outcome:
    provenance = _last_provenance(state)
    if not provenance:
        return failure("no reply yet")
    return Outcome(output="\n".join(explain(provenance)))


def _store(state: "ChatState") -> Any:
    if state.store is None:
        raise ChatcoreError(f"the conversation log is off ({state.log_off_reason})")
    return state.store


@command("/conversations", "/conversations [N]", "recent logged conversations (N of them, default 10)")
def conversations_command(state: "ChatState", rest: str) -> Outcome:
    try:
        limit = int(rest) if rest else 10
    except ValueError:
        raise OptionError(f"expected a number of conversations, got {rest!r}") from None
    if limit < 1:
        raise OptionError(f"expected a positive number of conversations, got {limit}")
    summaries = _store(state).list_conversations(limit=limit)
    if not summaries:
        return Outcome(output="(no logged conversations yet)")
    return Outcome(output=summary_table(summaries) + "\n/resume ID continues one")


@command("/resume", "/resume ID", "continue a logged conversation (any unique prefix of its id)")
def resume_command(state: "ChatState", rest: str) -> Outcome:
    if not rest:
        return failure("usage: /resume ID (/conversations lists them)")
    conversation = _store(state).resume(rest.split()[0])
    state.switch_to(conversation)
    title = one_line(str(conversation.meta.get("title") or ""), 60)
    header = (
        f"resumed {conversation.id[:SHORT_ID]} ({count(len(conversation.turns), 'turn')})"
        f"{': ' + title if title else ''}"
    )
    recent = format_turns(state, limit=6)
    return Outcome(output=header + ("\n" + recent if recent else ""))


@command("/seed", "/seed [N | random]", "fix the seed of the next reply (then +1 per reply), or go random")
def seed_command(state: "ChatState", rest: str) -> Outcome:
    if not rest:
        return Outcome(output=f"seed: {'random' if state.next_seed is None else state.next_seed}")
    if rest.lower() in ("random", "off", "none"):
        state.next_seed = None
        return Outcome(output="seed: random")
    try:
        seed = int(rest)
    except ValueError:
        seed = -1
    if seed < 0 or seed >= 2**63:
        raise OptionError(f"`seed` must be an integer from 0 to 2**63 - 1, or 'random'; got {shown_value(rest)}")
    state.next_seed = seed
    return Outcome(output=f"seed: {seed} for the next reply")


@command("/multi", "/multi", "multi-line input on/off (on: Enter adds a line, Esc-Enter sends)")
def multi_command(state: "ChatState", rest: str) -> Outcome:
    state.multiline = not state.multiline
    if state.multiline:
        return Outcome(output="multi-line on: Enter adds a line, Esc-Enter sends")
    return Outcome(output="multi-line off: Enter sends, Esc-Enter adds a line")


@command("/quit", "/quit", "leave (Ctrl-D does too)")
def quit_command(state: "ChatState", rest: str) -> Outcome:
    return Outcome(quit=True)
