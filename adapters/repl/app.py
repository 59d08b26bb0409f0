"""Starting a terminal chat: options, the conversation log, the model, then the loop."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from chatcore.cli import plugin_problems_note
from chatcore.errors import ChatcoreError
from chatcore.log.errors import LogError
from chatcore.log.formatting import SHORT_ID, one_line

if TYPE_CHECKING:
    from chatcore.adapters.repl.state import ChatState
    from chatcore.engine import Engine
    from chatcore.log.store import ConversationStore
    from chatcore.plugin_manager import PluginHost


@dataclass
class ChatConfig:
    """``chatcore chat``'s start options (they mirror ``chatcore generate``'s)."""

    model: str = "chatcore-tiny"
    decoder_spec: str = "top-k"
    # --temperature and --top-p (in decoder_spec already): the defaults of decoders chosen in the chat
    sampling_shortcuts: dict[str, float] = field(default_factory=dict)
    steer_specs: tuple[str, ...] = ()
    system: str | None = None  # the system prompt; with a resumed conversation, it replaces the logged one
    prompt_format: str = "auto"
    seed: int | None = None
    max_new_tokens: int = 64
    device: str | None = None
    threads: int | None = None  # CPU threads (None: chatcore.cpu's default)
    dtype: str | None = None
    continue_last: bool = False
    conversation_id: str | None = None
    no_log: bool = False
    db_url: str | None = None
    history_file: Path | None = None


def open_log(config: ChatConfig, say: Callable[[str], None]) -> tuple["ConversationStore | None", str]:
    """The store to log to, or None and the reason. Resuming needs it; chatting does not."""
    if config.no_log:
        if config.continue_last or config.conversation_id:
            raise ChatcoreError("--continue and --cid resume from the conversation log; drop --no-log")
        return None, "--no-log"
    from chatcore.log.location import resolve_url
    from chatcore.log.store import ConversationStore

    try:
        return ConversationStore(resolve_url(config.db_url)), ""
    except LogError as error:
        if config.continue_last or config.conversation_id:
            raise
        say(
            f"note: {error}; chatting without the conversation log for now: turns are kept in its journal "
            "and written once it opens"
        )
        return None, "unavailable"


def load_engine(config: ChatConfig, host: "PluginHost | None", say: Callable[[str], None]) -> "Engine":
    say(f"loading {config.model} ...")
    started = time.perf_counter()
    from chatcore.cpu import use_threads
    from chatcore.engine import Engine  # torch and transformers load here

    use_threads(config.threads)
    engine = Engine(
        config.model, device=config.device, dtype=config.dtype, host=host, prompt_format=config.prompt_format
    )
    parameters = sum(p.numel() for p in engine.loaded.model.parameters())
    size = f"{parameters / 1e6:.1f}M" if parameters >= 1e6 else f"{parameters:,}"
    say(f"loaded {config.model}: {size} parameters on {engine.loaded.device} in {time.perf_counter() - started:.1f} s")
    return engine


def find_resume_id(config: ChatConfig, store: "ConversationStore | None", say: Callable[[str], None]) -> str | None:
    from chatcore.adapters.repl.state import ADAPTER

    if store is None:
        return None
    if config.conversation_id:
        return store.resolve_id(config.conversation_id)
    if config.continue_last:
        found = store.latest_conversation_id(adapter=ADAPTER)
        if found is None:
            say("note: no earlier terminal conversation to continue; starting a new one")
        return found
    return None


def build_state(
    config: ChatConfig, host: "PluginHost | None" = None, say: Callable[[str], None] = print
) -> "ChatState":
    """Everything up to the first prompt: options checked, log opened, model loaded, conversation ready."""
    from chatcore.adapters.repl.state import ChatState
    from chatcore.cli.specs import parse_spec
    from chatcore.engine import ReplyOptions, validate_options
    from chatcore.log.location import resolve_url
    from chatcore.log.store import ConversationStore
    from chatcore.prompting import clean_system_prompt
    from chatcore.serving import Scheduler

    system = clean_system_prompt(config.system)
    decoder, decoder_settings = parse_spec(config.decoder_spec)
    steerers = [parse_spec(spec) for spec in config.steer_specs]
    options = ReplyOptions(
        decoder=decoder, decoder_settings=decoder_settings, steerers=steerers, max_new_tokens=config.max_new_tokens
    )
    validate_options(options, host=host)  # a configuration that cannot reply fails before the log opens
    store, off_reason = open_log(config, say)
    try:
        resume_id = find_resume_id(config, store, say)  # an unknown id fails before the model loads
        engine = load_engine(config, host, say)
        engine.check_options(options)  # what needs the model fails before the first prompt
        state = ChatState(
            engine,
            options,
            store=store,
            log_off_reason=off_reason,
            next_seed=config.seed,
            scheduler=Scheduler(engine, max_batch=1),
            sampling_shortcuts=dict(config.sampling_shortcuts),
        )
        if store is not None and resume_id is not None:
            state.switch_to(store.resume(resume_id))
        if system is not None:  # given on resuming too: it replaces the logged one
            state.set_system(system)  # one that leaves no room fails here, before the first prompt
        if store is not None:
            state.attach_log(store)
        elif off_reason == "unavailable":  # journaled until it opens (tried on each write): a fault may pass
            url = resolve_url(config.db_url)
            state.attach_log(None, url=url, opener=lambda: ConversationStore(url))
    except BaseException:
        if store is not None:
            store.close()
        raise
    return state


def close_state(state: "ChatState", say: Callable[[str], None] = print) -> None:
    if state.loading:
        say("finishing the loading a cancelled command started ...")
    state.finish_loading()
    if state.scheduler is not None:
        state.scheduler.close()
    if state.log_plugin is not None:
        from chatcore.adapters.repl.state import LOG_PLUGIN_NAME

        state.engine.host.unregister(LOG_PLUGIN_NAME)
        failing = state.log_plugin.failing
        journaled = state.log_plugin.close()  # what the log cannot take now waits in its journal
        if journaled:
            say(
                f"note: {journaled} write(s) could not be saved to the conversation log ({failing}); they are kept "
                f"in {state.log_plugin.journal.folder} and written by the next chat that logs there"
            )
        lost = state.log_plugin.pending - journaled + state.log_plugin.dropped
        if lost > 0:
            say(f"note: {lost} write(s) to the conversation log were lost ({failing})")
        elif not journaled:
            keep_last_system(state, say)
    if state.store is not None:
        state.store.close()
    elif state.log_plugin is not None and state.log_plugin.store is not None:
        state.log_plugin.store.close()  # opened by its plugin after the last turn


def keep_last_system(state: "ChatState", say: Callable[[str], None]) -> None:
    """A system prompt set (or cleared) after the conversation's last message is kept in the
    log too, so ``--continue`` goes on with it (messages carry it otherwise)."""
    from chatcore.log.errors import LogError

    store = state.store or (state.log_plugin.store if state.log_plugin is not None else None)
    if store is None or not state.current.turns:
        return
    conversation_id = state.current.id
    if state.log_plugin is not None:
        conversation_id = state.log_plugin.logged_id(conversation_id)
    try:
        store.keep_system(conversation_id, state.current.system)
    except LogError as error:
        say(f"note: the system prompt set last was not kept in the conversation log ({error})")


def banner(state: "ChatState") -> str:
    from chatcore.adapters.repl.slash_commands import count, describe_steerers, format_turns

    conversation = state.current
    if state.store is not None:
        log = f"logged to {state.store.display_url}"
    elif state.log_off_reason == "unavailable":  # journaled, and written once the log opens (see open_log)
        log = "the log cannot be opened now: turns are kept in its journal until it can"
    else:
        log = f"not logged ({state.log_off_reason})"
    loaded = state.engine.loaded
    lines = [
        f"chatcore chat with {loaded.name} (`chatcore chat --model NAME` picks another: chatcore-tiny, smollm2, "
        "a GGUF file, a folder or a hub id)",
        f"decoder {state.options.decoder}"
        + (f", steering {'; '.join(describe_steerers(state))}" if state.options.steerers else "")
        + f", format {state.format_name}"
        + (", with a system prompt (/system shows it)" if conversation.system else "")
        + f"; {log}",
        "/help lists the commands; Ctrl-C stops a reply; Ctrl-D or /quit exits.",
    ]
    note = plugin_problems_note(state.engine.host)
    if note is not None:
        lines.append(note)
    if conversation.turns:
        title = one_line(str(conversation.meta.get("title") or ""), 60)
        lines.append(
            f"resumed {conversation.id[:SHORT_ID]} ({count(len(conversation.turns), 'turn')})"
            + (f": {title}" if title else "")
        )
        lines.append(format_turns(state, limit=6))
    return "\n".join(lines)


def start_chat(
    config: ChatConfig,
    host: "PluginHost | None" = None,
    out: IO[str] | None = None,
    err: IO[str] | None = None,
    interactive: bool | None = None,
    input: Any = None,
    output: Any = None,
) -> "ChatState":
    """Run ``chatcore chat`` to the end; returns the final state (for tests and embedding).

    Replies and command output go to ``out`` (stdout); loading progress and the
    banner to ``err`` (stderr), and without a terminal errors and notes too, so
    ``chatcore chat < script > replies`` keeps them apart.
    """
    import sys

    from chatcore.adapters.repl.terminal import run_terminal

    stream = out if out is not None else sys.stdout
    status = err if err is not None else (out if out is not None else sys.stderr)

    def say(message: str) -> None:
        status.write(message + "\n")
        status.flush()

    state = build_state(config, host, say)
    try:
        say(banner(state))
        run_terminal(
            state,
            out=stream,
            interactive=interactive,
            history_file=config.history_file,
            input=input,
            output=output,
            keep_history=not config.no_log,
            err=status,
        )
    finally:
        close_state(state, say)
    return state
