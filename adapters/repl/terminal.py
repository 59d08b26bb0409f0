"""Terminal I/O: the read-reply loop, streaming, and the prompt-toolkit line editor.

On a terminal the line editor is a prompt-toolkit session (history file, completion,
toolbar, multi-line). When standard input is not a terminal (a pipe, a file), lines
are read plainly so that ``chatcore chat < script.txt`` works too.

A reply is printed a whole word at a time (the unfinished end waits for the next
delta). Ctrl-C while it streams raises KeyboardInterrupt in the loop; the reply is then
interrupted, which keeps its text up to its last whole word (what was printed) in the
conversation, marked interrupted (and the log records it so). Ctrl-C while a slash command
runs cancels it (see ``cancelling``). Ctrl-C at the prompt clears the line; Ctrl-D exits.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from chatcore.adapters.repl.completion import completions, toolbar_text
from chatcore.adapters.repl.line_guard import LineGuard
from chatcore.adapters.repl.slash_commands import Outcome, handle_line
from chatcore.errors import ChatcoreError
from chatcore.log.formatting import display_safe
from chatcore.log.location import history_path

if TYPE_CHECKING:
    from chatcore.adapters.repl.state import ChatState
    from chatcore.response import Response

ReadLine = Callable[[], str]
PROMPT = "you> "
REPLY_PREFIX = "bot> "
# More plain characters than this in one read of the terminal is a paste, not typing.
PASTE_RUN = 32
PLUGIN_LOGGER = "chatcore.plugins"  # where the plugin host reports plugin problems


def debug_enabled() -> bool:
    from chatcore.cli import debug_enabled as enabled

    return enabled()


def stream_reply(response: "Response", out: IO[str]) -> str:
    """Print a reply as it is generated, a whole word at a time; Ctrl-C stops it and keeps
    its whole words (what was printed). Returns the error shown, if the reply failed."""
    from chatcore.cutting import WholeWords

    out.write(REPLY_PREFIX)
    out.flush()
    words = WholeWords()
    printed = ""

    def show(text: str) -> None:
        nonlocal printed
        shown_text = text if printed.strip() else text.lstrip()  # after "bot> ", no second space
        printed += text
        out.write(display_safe(shown_text))
        out.flush()

    shown = ""
    try:
        for delta in response:
            show(words.push(delta))
        show(words.flush())
        if response.cut_by_budget:
            out.write(mark_spacing(printed) + dim(budget_marker(response), out))
    except KeyboardInterrupt as pressed:
        response.interrupt()
        with contextlib.suppress(OSError):  # a terminal closed (SIGHUP) takes no more text
            show(kept_rest(response, printed))
            out.write(mark_spacing(printed) + "[interrupted]\n")
            out.flush()
        if isinstance(pressed, Stopped):
            raise  # the chat ends, the shown reply kept
        return ""
    except ChatcoreError as error:
        show(kept_rest(response, printed))
        shown = f"error: {error}"
    except Exception as error:
        if debug_enabled():
            raise
        show(kept_rest(response, printed))
        shown = f"error: unexpected {type(error).__name__}: {error} (CHATCORE_DEBUG=1 shows a traceback)"
    out.write(f"\n{shown}\n" if shown else "\n")
    out.flush()
    return shown


def mark_spacing(printed: str) -> str:
    """What goes between a reply and its mark: a space after a word, nothing at a line's start."""
    return " " if printed and not printed.endswith("\n") else ""


def budget_marker(response: "Response") -> str:
    """The mark after a reply that used its whole token budget (it may stop mid-sentence)."""
    budget = response.provenance.get("max_new_tokens")
    return f"[cut at {budget} {'token' if budget == 1 else 'tokens'}: /max to raise]"


def dim(text: str, out: IO[str]) -> str:
    """``text`` dimmed on a terminal (ANSI faint), as is elsewhere."""
    isatty = getattr(out, "isatty", None)
    return f"\033[2m{text}\033[0m" if isatty is not None and isatty() else text


def kept_rest(response: "Response", printed: str) -> str:
    """What the stopped reply keeps beyond what was printed (a final "." that waited for
    what followed it, say): the chat then shows exactly the text it records."""
    kept = response.text() if response.done else ""
    return kept[len(printed) :] if kept.startswith(printed) else ""


@contextlib.contextmanager
def plugin_problems_held() -> Iterator[list[Any]]:
    """Plugin problems reported while one line is handled, held back from the log output.

    A plugin failing in a reply is reported by the plugin host (a log line) and raised
    as the error the chat shows: the person should read it once. The caller shows the
    held problems that its error did not already name (a failing hook, say).
    """
    import logging

    held: list[Any] = []

    def hold(record: logging.LogRecord) -> bool:
        held.append(record.args[0] if isinstance(record.args, tuple) and record.args else record.getMessage())
        return False

    logger = logging.getLogger(PLUGIN_LOGGER)
    logger.addFilter(hold)
    try:
        yield held
    finally:
        logger.removeFilter(hold)


def show_notices(state: "ChatState", out: IO[str]) -> None:
    for notice in state.take_notices():
        out.write(f"note: {display_safe(notice)}\n")
    out.flush()


class InputTooLong(ChatcoreError):
    """A line longer than the chat accepts; it was dropped as it arrived."""


@contextlib.contextmanager
def typing_held(fd: int) -> Iterator[None]:
    """While a reply streams, keys typed on the terminal ``fd`` are not echoed into it.

    Echo and line editing are off meanwhile (Ctrl-C still interrupts); what was typed
    stays in the terminal's input queue and shows up at the next prompt, as type-ahead
    does in a shell. Ctrl-C discards it with the rest of the reply.
    """
    import termios
    import tty

    try:
        saved = termios.tcgetattr(fd)
    except termios.error:  # not a terminal after all
        yield
        return
    tty.setcbreak(fd, termios.TCSANOW)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)  # TCSANOW: keep what was typed ahead


def run_loop(
    state: "ChatState",
    read_line: ReadLine,
    out: IO[str],
    while_streaming: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    err: IO[str] | None = None,
) -> None:
    """Read lines until /quit or end of input, answering each; ``while_streaming`` wraps each line's
    command or reply.

    Replies and what commands print go to ``out``; errors and notes to ``err`` (default: ``out``,
    as on a terminal; standard error when the chat reads a pipe)."""
    err = err if err is not None else out
    while True:
        show_notices(state, err)
        try:
            line = read_line()
        except KeyboardInterrupt:
            continue  # the line is cleared; a new prompt follows
        except EOFError:
            out.write("\n")
            break
        except InputTooLong as error:
            err.write(f"error: {error}\n")
            continue
        try:
            # Keys typed while a command runs or a reply streams wait for the next prompt (and
            # Ctrl-C, which cancels the command or stops the reply, is not echoed into them).
            with plugin_problems_held() as problems, while_streaming(), stops_on_signals():
                outcome = handle_line(state, line)
                if outcome.output:
                    (err if outcome.error else out).write(outcome.output + "\n")
                    err.flush()
                shown = outcome.output if outcome.error else ""
                if outcome.reply is not None:
                    shown += stream_reply(outcome.reply, out)
            for problem in problems:
                if f"'{getattr(problem, 'plugin', '')}'" not in shown:
                    state.notify(str(problem))
        except Stopped as stopped:
            with contextlib.suppress(OSError):
                err.write(f"chat ended ({stopped}); what was shown is kept\n")
                err.flush()
            break
        except KeyboardInterrupt:
            out.write("^C\n")  # between reading and streaming (e.g. while the log writes)
            continue
        except Exception as error:
            if debug_enabled():
                raise
            outcome = Outcome(error=True)
            err.write(f"error: unexpected {type(error).__name__}: {error} (CHATCORE_DEBUG=1 shows a traceback)\n")
        out.flush()
        err.flush()
        if outcome.quit:
            break
    show_notices(state, err)


class Stopped(KeyboardInterrupt):
    """SIGTERM, or SIGHUP (the terminal closed), while a reply streams or a command runs: the
    reply stops as Ctrl-C stops it (what was shown is kept, marked interrupted, and logged),
    and the chat ends, closing its log as /quit does."""


@contextlib.contextmanager
def stops_on_signals() -> Iterator[None]:
    """Within: SIGTERM and SIGHUP raise :class:`Stopped` (on the main thread, where signals
    arrive; elsewhere nothing changes). At the prompt nothing is in flight: they act as usual."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(number: int, frame: Any) -> None:
        raise Stopped(signal.Signals(number).name)

    kinds = [getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)]
    previous = {kind: signal.signal(kind, stop) for kind in kinds}
    try:
        yield
    finally:
        for kind, handler in previous.items():
            signal.signal(kind, handler)


# -- line readers -----------------------------------------------------------------
def plain_reader(stream: IO[bytes] | None = None) -> ReadLine:
    """Lines from a pipe or file. Bytes that are not UTF-8 become lone surrogates,
    which the command handler refuses with a clear message."""
    source = stream if stream is not None else sys.stdin.buffer

    def read_line() -> str:
        raw = source.readline()
        if not raw:
            raise EOFError
        return raw.decode("utf-8", errors="surrogateescape").rstrip("\r\n")

    return read_line


def coalesce_pastes(keys: list[Any]) -> list[Any]:
    """Runs of plain characters in one read become one paste (a ``BracketedPaste`` key press).

    A terminal without bracketed paste delivers a paste as key presses, and
    prompt-toolkit matches every one against every key binding: 100,000 characters
    took minutes. As one paste they are inserted at once. Enter, Tab and escape
    sequences in the run stay keys, so a pasted "line\\r" is still sent.
    """
    from prompt_toolkit.key_binding import KeyPress
    from prompt_toolkit.keys import Keys

    def plain(press: Any) -> bool:
        return type(press.key) is str and len(press.key) == 1 and press.key.isprintable()

    result: list[Any] = []
    run: list[Any] = []
    for press in [*keys, None]:
        if press is not None and plain(press):
            run.append(press)
            continue
        if len(run) > PASTE_RUN:
            text = "".join(p.data for p in run)
            result.append(KeyPress(Keys.BracketedPaste, text))
        else:
            result.extend(run)
        run = []
        if press is not None:
            result.append(press)
    return result


def paste_aware(terminal_input: Any) -> Any:
    """``terminal_input`` (a prompt-toolkit Input) reading pastes whole (see :func:`coalesce_pastes`)."""
    read_keys = terminal_input.read_keys
    terminal_input.read_keys = lambda: coalesce_pastes(read_keys())
    return terminal_input


def longest_line(line: str) -> tuple[int, str]:
    """The most characters a line that starts like ``line`` may have, and what it is."""
    from chatcore.prompting import MAX_SYSTEM_CHARS
    from chatcore.text import MAX_MESSAGE_CHARS

    start = line.lstrip()
    if start.startswith("/") and not start.startswith("//"):
        return MAX_SYSTEM_CHARS + 100, "command"  # a command may carry a system prompt (/system TEXT)
    return MAX_MESSAGE_CHARS, "message"


def fits_a_line(line: str) -> bool:
    """Whether the chat accepts a line this long (one that does not stays out of the input history)."""
    return len(line) <= longest_line(line)[0]


def prompt_toolkit_reader(
    state: "ChatState",
    history_file: Path | None = None,
    input: Any = None,
    output: Any = None,
    keep_history: bool = True,
) -> ReadLine:
    """A prompt-toolkit session: history file, completion, toolbar, multi-line."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.application.current import get_app
    from prompt_toolkit.completion import Completer, Completion
    from prompt_toolkit.filters import Condition
    from prompt_toolkit.history import FileHistory, History, InMemoryHistory
    from prompt_toolkit.input import create_input
    from prompt_toolkit.key_binding import KeyBindings
    from prompt_toolkit.keys import Keys

    from chatcore.log.input_history import append_entry
    from chatcore.log.private_files import create_private_file, make_private_folder

    class BoundedFileHistory(FileHistory):
        """The input history file; one that cannot be read or written (a full disk) leaves the
        history in memory, with one note, instead of an error on every line typed. Each entry is
        appended under the file's lock (:func:`~chatcore.log.input_history.append_entry`), so
        that ``chatcore logs delete`` taking deleted messages out of it meanwhile loses none."""

        saving = True

        def append_string(self, string: str) -> None:
            if fits_a_line(string):
                super().append_string(string)

        def load_history_strings(self) -> Iterable[str]:
            try:
                return list(super().load_history_strings())
            except OSError as error:
                self.stop_saving(error)
                return []

        def store_string(self, string: str) -> None:
            if not self.saving:
                return
            try:
                append_entry(Path(os.fsdecode(self.filename)), string)
            except OSError as error:
                self.stop_saving(error)

        def stop_saving(self, error: OSError) -> None:
            if self.saving:
                self.saving = False
                state.notify(
                    f"input history is no longer saved ({os.fsdecode(self.filename)}: {error.strerror or error}); "
                    "the chat goes on and keeps it in memory"
                )

    class BoundedMemoryHistory(InMemoryHistory):
        def append_string(self, string: str) -> None:
            if fits_a_line(string):
                super().append_string(string)

    class SlashCompleter(Completer):
        def get_completions(self, document: Any, complete_event: Any) -> Any:
            for suggestion in completions(state, document.text_before_cursor):
                yield Completion(suggestion.text, start_position=suggestion.start, display_meta=suggestion.meta)

    history: History = BoundedMemoryHistory()  # --no-log: the lines typed leave no trace on disk either
    path = history_file if history_file is not None else history_path()
    if keep_history:
        if history_file is None:
            from chatcore.log.location import private_data_folder

            private_data_folder()  # one an older version made 0755 is made 0700, as it is created now
        try:
            make_private_folder(path.parent)
            create_private_file(path)  # the lines typed are as private as the log
            history = BoundedFileHistory(str(path))
        except OSError as error:
            state.notify(f"input history is not saved ({path}: {error.strerror or error})")

    multiline = Condition(lambda: state.multiline)
    bindings = KeyBindings()

    @bindings.add("escape", "enter", filter=~multiline)
    def _newline(event: Any) -> None:
        # Single-line mode: Esc-Enter (Alt-Enter) adds a line and Enter sends. In
        # multi-line mode prompt-toolkit's own bindings swap the two.
        event.current_buffer.insert_text("\n")

    @bindings.add("c-@")  # Ctrl-Space
    def _no_mark(event: Any) -> None:
        # Emacs mode sets a mark here, and typing with a mark set inserts nothing: easy to
        # press by accident (it switches input methods elsewhere), so it does nothing.
        pass

    def typing_a_command() -> bool:
        text = get_app().current_buffer.text
        return text.startswith("/") and not text.startswith("//") and "\n" not in text

    @bindings.add("enter", filter=multiline & Condition(typing_a_command))
    def _run_command(event: Any) -> None:
        # Even in multi-line mode a one-line slash command runs on Enter (/multi, /quit).
        event.current_buffer.validate_and_handle()

    # A line longer than the chat accepts is never laid out in the input (see LineGuard).
    guard = LineGuard(fits_a_line)
    overflowing = Condition(lambda: guard.overflowing)

    @bindings.add(Keys.BracketedPaste)
    def _paste(event: Any) -> None:
        data = event.data.replace("\r\n", "\n").replace("\r", "\n")
        event.current_buffer.document = guard.paste(event.current_buffer.document, data)

    @bindings.add(Keys.Vt100MouseEvent, eager=True)
    def _not_a_mouse(event: Any) -> None:
        # The chat never turns mouse reporting on, so a "mouse event" is text that an
        # unmarked paste brought in (coloured text: ESC [ 3 1 m). It is kept as typed; the
        # message's cleaning removes the escape sequences when it is sent.
        event.current_buffer.document = guard.paste(event.current_buffer.document, event.data)

    @bindings.add(Keys.Any, filter=overflowing)
    def _drop(event: Any) -> None:
        guard.typed(event.data)

    @bindings.add("c-c", filter=overflowing)
    def _clear(event: Any) -> None:
        event.app.exit(exception=KeyboardInterrupt, style="class:aborting")

    @bindings.add("enter", filter=overflowing)
    @bindings.add("escape", "enter", filter=overflowing)
    def _refuse(event: Any) -> None:
        text = event.current_buffer.text
        limit, kind = longest_line(guard.start(text))
        event.app.exit(
            exception=InputTooLong(
                f"the {kind} is {guard.length(text):,} characters long; the limit is {limit:,}; nothing was sent"
            )
        )

    def toolbar() -> str:
        if guard.overflowing:
            return f"too long: {guard.length(session.default_buffer.text):,} characters; Enter drops it"
        return toolbar_text(state)

    session: Any = PromptSession(
        history=history,
        completer=SlashCompleter(),
        complete_while_typing=True,
        bottom_toolbar=toolbar,
        key_bindings=bindings,
        multiline=multiline,
        prompt_continuation=lambda width, line_number, wrap_count: "." * (width - 1) + " ",
        input=paste_aware(input if input is not None else create_input()),
        output=output,
    )

    def read_line() -> str:
        guard.reset()
        return str(session.prompt(PROMPT))

    return read_line


def run_terminal(
    state: "ChatState",
    out: IO[str] | None = None,
    interactive: bool | None = None,
    history_file: Path | None = None,
    input: Any = None,
    output: Any = None,
    keep_history: bool = True,
    err: IO[str] | None = None,
) -> None:
    """Chat until /quit or Ctrl-D, with prompt-toolkit when on a terminal; without one,
    errors and notes go to ``err`` (standard error), apart from the replies."""
    out = out if out is not None else sys.stdout
    if interactive is None:
        interactive = input is not None or (sys.stdin.isatty() and sys.stdout.isatty())
    while_streaming: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext
    if interactive:
        read_line = prompt_toolkit_reader(state, history_file, input=input, output=output, keep_history=keep_history)
        if input is None and sys.platform != "win32":
            fd = sys.stdin.fileno()
            while_streaming = lambda: typing_held(fd)  # noqa: E731
    else:
        read_line = plain_reader()
    run_loop(state, read_line, out, while_streaming, out if interactive else (err if err is not None else sys.stderr))
