"""The terminal REPL: the slash-command dispatcher, completion, prompt-toolkit through pipe
input, the `chat` command, and the real `chatcore chat` in a pseudo-terminal."""

from __future__ import annotations

import io
import json
import os
import re
import select
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

import chatcore
import chatcore.plugin_manager as plugin_manager
from chatcore.adapters.repl.app import ChatConfig, start_chat
from chatcore.adapters.repl.completion import completions, toolbar_text
from chatcore.adapters.repl.slash_commands import COMMANDS, handle_line
from chatcore.adapters.repl.state import ChatState
from chatcore.adapters.repl.terminal import run_loop
from chatcore.engine import ReplyOptions
from chatcore.log import ConversationLogPlugin
from chatcore.log.location import sqlite_url
from chatcore.log.store import ConversationStore
from chatcore.plugins.greedy import GreedyDecoder, GreedySettings
from chatcore.plugins.prompt_formats import DialoGPTFormat
from chatcore.steering import Steerer
from chatcore.text import encode_text

ADAPTERS = ("chatcore.log", "chatcore.adapters.repl")
BUILTIN_TEST_PLUGINS = (
    "chatcore.plugins.greedy",
    "chatcore.plugins.top_k",
    "chatcore.plugins.bow_bias",
    "chatcore.plugins.prompt_formats",
)


@pytest.fixture
def store(tmp_path):
    opened = ConversationStore(sqlite_url(tmp_path / "log.sqlite3"))
    yield opened
    opened.close()


def logged_state(engine, store):
    chat = ChatState(engine, ReplyOptions(decoder="greedy", max_new_tokens=4), store=store)
    chat.log_plugin = ConversationLogPlugin(store, notify=chat.notify)
    engine.host.register(chat.log_plugin, "conversation-log")
    return chat


@pytest.fixture
def state(engine, store):
    return logged_state(engine, store)


@pytest.fixture(scope="module")
def chat_loaded(tmp_path_factory):
    """A tiny Qwen2 with a ChatML chat template: the chat-template format's real path."""
    from chatcore.models import load_model
    from chatcore.testing import CHATML_TEMPLATE, build_tiny_model

    folder = build_tiny_model(
        tmp_path_factory.mktemp("tiny-chat"), architecture="qwen2", chat_template=CHATML_TEMPLATE, positions=256
    )
    return load_model(str(folder))


@pytest.fixture
def chat_state(chat_loaded, host, store):
    from chatcore.engine import Engine

    return logged_state(Engine(chat_loaded, host=host), store)


def run(state, line):
    """One line through the dispatcher; a reply is generated to the end, as the terminal would."""
    outcome = handle_line(state, line)
    if outcome.reply is not None:
        outcome.reply.text()
    return outcome


def assert_one_line_error(outcome, needle):
    assert outcome.error and outcome.output.startswith("error: ")
    assert "\n" not in outcome.output and "Traceback" not in outcome.output
    assert needle in outcome.output, outcome.output


# -- the dispatcher ----------------------------------------------------------------------------
def test_every_slash_command(state, store):
    used = set()

    def command(line):
        used.add(line.split()[0])
        return run(state, line)

    help_text = command("/help").output
    assert all(name in help_text for name in COMMANDS) and "Esc-Enter" in help_text

    assert command("/decoder").output.startswith("decoder: greedy")
    assert "top_k=5" in command("/decoder top-k top_k=5 temperature=0.5").output
    assert (state.options.decoder, state.options.decoder_settings) == ("top-k", {"top_k": "5", "temperature": "0.5"})
    assert_one_line_error(command("/decoder top-k top_k=0"), "`top_k` must be a positive integer, got 0")
    assert_one_line_error(command("/decoder nope"), "unknown decoder 'nope'")
    assert_one_line_error(command("/decoder top-k bogus=1"), "unknown setting")
    assert state.options.decoder_settings == {"top_k": "5", "temperature": "0.5"}  # errors change nothing
    # Quoted as the command line wants it, or not: the same spec.
    assert "top_k=7" in command('/decoder "top-k top_k=7"').output and state.options.decoder_settings == {"top_k": "7"}
    assert "top_k=5" in command("/decoder 'top-k' top_k=5 temperature=0.5").output
    assert_one_line_error(command('/decoder "top-k top_k=7'), "cannot parse")

    assert "bow-bias" in command("/steer bow-bias words=pizza strength=3").output
    assert "strength=5.0" in command("/steer bow-bias words=pizza strength=5").output
    assert state.options.steerers == [("bow-bias", {"words": "pizza", "strength": "5"})]
    command('/steer "bow-bias words=pizza strength=5"')
    assert state.options.steerers == [("bow-bias", {"words": "pizza", "strength": "5"})]
    assert "bow-bias" in command("/steer").output
    assert_one_line_error(command("/steer bow-bias strength=abc"), "`strength` must be a number")
    assert_one_line_error(command("/steer off nope"), "steerer 'nope' is not on")
    assert "still on: none" in command("/steer off bow-bias").output and state.options.steerers == []
    command("/steer bow-bias topic=food")
    # A steerer that replaces the model step (as CoCon does) could never work after bow-bias: refused now.

    @dataclass
    class NoSettings:
        pass

    class WholeModel(Steerer):
        name = "whole-model-test"
        Settings = NoSettings
        replaces_model = True

        def wrap(self, step):  # pragma: no cover - refused before any reply
            return step

    class Plugin:
        @chatcore.hookimpl
        def register_steerers(self, register):
            register(WholeModel)

    state.engine.host.register(Plugin(), "whole-model")
    assert_one_line_error(command("/steer whole-model-test"), "'whole-model-test' replaces the model step, so it must")
    assert state.options.steerers == [("bow-bias", {"topic": "food"})]
    assert command("/steer off").output == "steering off" and state.options.steerers == []

    assert_one_line_error(command("/why"), "no reply yet")
    assert_one_line_error(command("/retry"), "nothing to retry")
    assert command("/history").output == "(no turns yet)"

    assert "seed: 5" in command("/seed 5").output
    first = run(state, "hello there")
    assert first.reply.provenance["seed"] == 5 and state.next_seed == 6
    assert_one_line_error(command("/seed -1"), "`seed` must be an integer from 0 to 2**63 - 1, or 'random'")
    assert_one_line_error(command("/seed soon"), "`seed` must be an integer from 0 to 2**63 - 1")
    assert_one_line_error(command("/seed " + "9" * 30), "`seed` must be an integer from 0 to 2**63 - 1")
    assert command("/seed random").output == "seed: random" and state.next_seed is None

    why = command("/why").output
    assert why.startswith("decoder top-k") and "seed 5" in why
    history = command("/history").output.splitlines()
    assert history[0] == "you> hello there" and history[1].startswith("bot> ")

    retried = command("/retry")
    retried.reply.text()
    assert [t.role for t in state.current.turns] == ["user", "bot"]
    logged = store.get_conversation(state.current.id).messages
    assert [(m.role, m.superseded) for m in logged] == [("user", False), ("bot", True), ("bot", False)]

    settings = command("/settings").output
    for needle in (
        "model:",
        "decoder:        top-k ",
        "top_k=5",
        "temperature=0.5",
        "steerers:       none",
        "log:            on",
        state.current.id,
    ):
        assert needle in settings

    assert state.current.id[:12] in command("/conversations").output
    assert_one_line_error(command("/conversations many"), "expected a number")
    old_id = state.current.id
    assert command("/new").output.startswith("new conversation") and state.current.turns == []
    assert state.current.id != old_id
    resumed = command(f"/resume {old_id[:8]}")
    assert resumed.output.startswith(f"resumed {old_id[:12]} (2 turns): hello there")
    assert state.current.id == old_id and [t.text for t in state.current.turns][0] == "hello there"
    assert_one_line_error(command("/resume nope"), "no conversation 'nope'")
    assert_one_line_error(command("/resume"), "usage: /resume ID")

    assert command("/system").output.startswith("no system prompt")
    assert command("/system You are a patient  tutor.").output.startswith("system prompt:\n  You are a patient tutor.")
    assert state.current.system == state.system == "You are a patient tutor."
    assert "You are a patient tutor." in command("/settings").output
    assert_one_line_error(command("/system " + "x" * 40_000), "the limit is 32,000")
    # Refused when set, not with the next message: 128 positions leave no room for this one.
    assert_one_line_error(command("/system " + "be kind " * 100), "the system prompt takes")
    assert state.current.system == "You are a patient tutor."
    assert command("/system clear").output == "system prompt cleared" and state.current.system is None
    assert command("/system off").output == "no system prompt to clear"
    state.engine.prompt_format.default_system = "You are a helpful bot."  # as SmolLM2's template has one
    assert "the model's chat template adds its default" in command("/system").output
    assert "You are a helpful bot." in command("/system").output
    state.engine.prompt_format.default_system = None
    assert command("/format").output == "format: dialogpt\navailable: auto, chat-template, dialogpt"
    assert command("/format auto").output == "format: dialogpt (auto picked it)"
    assert_one_line_error(command("/format nope"), "unknown prompt format 'nope' (available: auto, chat-template")
    assert_one_line_error(command("/format chat-template"), "has no chat template")
    assert state.format_name == "dialogpt"

    assert command("/max 3").output == "max new tokens: 3 from the next reply on" and state.options.max_new_tokens == 3
    assert "temperature=0.6" in command("/set temperature=0.6").output  # tests/test_newcomer_cli.py has the rest
    vocabulary = len(state.engine.tokenizer)
    assert_one_line_error(
        command(f"/set 'logit_bias={{\"{vocabulary + 1}\": -100}}'"),
        f"`logit_bias` keys must be token ids below {vocabulary}, got {vocabulary + 1}",
    )
    assert "logit_bias" not in state.options.decoder_settings  # refused when set, not at the next reply
    # typed as the error message shows it, unquoted: the JSON value stays whole
    assert "logit_bias=" in command('/set logit_bias={"28": -100} top_p=0.9').output
    assert state.options.decoder_settings["logit_bias"] == '{"28": -100}'

    assert "multi-line on" in command("/multi").output and state.multiline
    assert "multi-line off" in command("/multi").output and not state.multiline

    assert command("/quit").quit and run(state, "/exit").quit and run(state, "/q").quit
    assert_one_line_error(run(state, "/nope"), "unknown command '/nope'")
    assert used == set(COMMANDS)


def template_length(tokenizer, messages):
    chat = [{"role": role, "content": text} for role, text in messages]
    return len(
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    )


def test_system_prompt_and_format_change_from_the_next_reply_on(chat_state, store):
    state, tokenizer = chat_state, chat_state.engine.tokenizer
    assert run(state, "/format").output.startswith("format: chat-template\n")
    first = run(state, "hello")
    assert first.reply.provenance["prompt_format"] == "chat-template"
    assert first.reply.provenance["prompt_tokens"] == template_length(tokenizer, [("user", "hello")])

    run(state, "/system You answer in French.")
    second = run(state, "and now?")
    history = [("user", "hello"), ("assistant", state.current.turns[1].text), ("user", "and now?")]
    assert second.reply.provenance["prompt_tokens"] == template_length(
        tokenizer, [("system", "You answer in French."), *history]
    )

    run(state, "/system clear")
    retried = run(state, "/retry")  # the new reply to the same turns has no system prompt
    assert retried.reply.provenance["prompt_tokens"] == template_length(tokenizer, history)

    assert run(state, "/format dialogpt").output == "format: dialogpt"
    assert run(state, "more").reply.provenance["prompt_format"] == "dialogpt"
    assert "format: dialogpt" in toolbar_text(state) and "system prompt" not in toolbar_text(state)

    run(state, "/system Be brief.")
    run(state, "/new")  # a new conversation keeps the system prompt and the format
    assert (state.current.system, state.format_name) == ("Be brief.", "dialogpt")
    assert "system prompt" in toolbar_text(state)
    assert run(state, "/format auto").output == "format: chat-template (auto picked it)"
    assert run(state, "bonjour").reply.provenance["prompt_format"] == "chat-template"
    logged_id = state.current.id
    assert store.get_conversation(logged_id).system == "Be brief."

    run(state, "/system off")
    run(state, "/new")
    assert state.current.system is None
    resumed = run(state, f"/resume {logged_id}")  # the logged conversation brings its own system prompt
    assert "(2 turns)" in resumed.output and state.system == state.current.system == "Be brief."
    assert run(state, "/system").output == "system prompt:\n  Be brief."


def test_why_shows_candidates_and_scores_of_a_logged_reply(state, store):
    store.ensure_conversation("mmi1", adapter="repl")
    store.add_message("mmi1", "user", "hi")
    candidates = [
        {"token_ids": [1], "text": "hello!", "scores": {"forward": -1.5, "reverse": -2.25}, "chosen": False},
        {"token_ids": [2], "text": "hey, you", "scores": {"forward": -1.0, "reverse": -0.5}, "chosen": True},
    ]
    store.add_message(
        "mmi1",
        "bot",
        "hey, you",
        decoder={"name": "mmi", "settings": {"candidates": 2}},
        seed=9,
        candidates=candidates,
        provenance={"decoder": {"name": "mmi", "settings": {"candidates": 2}}, "steerers": [], "seed": 9},
    )
    run(state, "/resume mmi1")
    why = run(state, "/why").output.splitlines()
    assert why[0] == "decoder mmi candidates=2, seed 9"
    assert why[1] == "2 candidates (* = chosen):"
    assert why[2].startswith("   1  forward=-1.500  reverse=-2.250") and "'hello!'" in why[2]
    assert why[3].startswith(" * 2  forward=-1.000  reverse=-0.500")


def test_why_after_a_reply_interrupted_before_its_first_token_says_so(state):
    run(state, "/decoder greedy")
    outcome = handle_line(state, "hello there")
    outcome.reply.interrupt()  # Ctrl-C before any token (as while MMI ranks its candidates)
    why = run(state, "/why").output
    assert "interrupted before the decoder had chosen anything" in why and "no candidates or steering" not in why
    assert [t.role for t in state.current.turns] == ["user"]  # no empty reply kept
    with state.store as store:
        (summary,) = store.list_conversations(limit=1)
        assert [m.role for m in store.get_conversation(summary.id).messages] == ["user"]


class CtrlCWhen(io.StringIO):
    """The terminal, where Ctrl-C is pressed (once) at the first flush at which ``pressed(text
    so far, flushes)`` holds: at a moment the test chooses, not one a clock does."""

    def __init__(self, pressed) -> None:
        super().__init__()
        self.pressed = pressed
        self.flushes = 0

    def flush(self) -> None:
        self.flushes += 1
        if self.pressed is not None and self.pressed(self.getvalue(), self.flushes):
            self.pressed = None
            raise KeyboardInterrupt


@pytest.mark.parametrize(
    "written, pressed, shown, kept",
    [
        # Pressed once "my" is on the screen (the reply has gone on to " frie"): cut inside "friend".
        ("Hello there, my frie", lambda text, _: "my" in text, "Hello there, my [interrupted]", "Hello there, my"),
        # Pressed after the first token (flushes: the notices, the "bot> " prefix, the first
        # delta): not one whole word, so no reply is kept.
        ("Hellothere", lambda _, flushes: flushes == 3, "[interrupted]", None),
    ],
)
def test_ctrl_c_keeps_the_reply_up_to_its_last_whole_word_and_the_log_says_so(
    serving_engine, store, gate, written, pressed, shown, kept
):
    from chatcore.serving import Scheduler

    gate.text = written
    chat = logged_state(serving_engine, store)
    chat.options = ReplyOptions(decoder="gated-text", max_new_tokens=40)
    chat.scheduler = Scheduler(serving_engine)  # as `chatcore chat` decodes
    out = CtrlCWhen(pressed)
    try:
        run_loop(chat, lines_then_end(["tell me a story"]), out)
    finally:
        gate.release.set()
        chat.scheduler.close()
    assert out.getvalue() == f"bot> {shown}\n\n"  # whole words only, then the mark (and the end of input)
    with store as opened:
        (summary,) = opened.list_conversations(limit=1)
        messages = opened.get_conversation(summary.id).messages
    if kept is None:
        assert [t.role for t in chat.current.turns] == ["user"] and [m.role for m in messages] == ["user"]
    else:
        assert (chat.current.turns[-1].text, chat.current.turns[-1].interrupted) == (kept, True)
        assert [(m.role, m.text, m.interrupted) for m in messages][1:] == [("bot", kept, True)]


class SignalWhen(io.StringIO):
    """The terminal, where the process gets ``number`` (SIGTERM, SIGHUP) once ``text`` is on it."""

    def __init__(self, number: int, text: str) -> None:
        super().__init__()
        self.number, self.text = number, text

    def flush(self) -> None:
        if self.text is not None and self.text in self.getvalue():
            self.text = None
            signal.raise_signal(self.number)


def test_a_reply_that_starts_with_a_space_is_shown_one_space_after_the_prompt(serving_engine, store, gate):
    """A tokenizer that writes a word's space before it (" Hello") does not make "bot>  Hello"."""
    from chatcore.serving import Scheduler

    gate.text = " Hello there."
    gate.release.set()
    chat = logged_state(serving_engine, store)
    chat.options = ReplyOptions(decoder="gated-text", max_new_tokens=40)
    chat.scheduler = Scheduler(serving_engine)
    out = io.StringIO()
    try:
        run_loop(chat, lines_then_end(["hi"]), out, err=io.StringIO())
    finally:
        chat.scheduler.close()
    assert out.getvalue().startswith("bot> Hello there.\n")


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_sigterm_or_a_closed_terminal_keeps_the_shown_reply_and_ends_the_chat(serving_engine, store, gate, name):
    """SIGTERM, or SIGHUP (the terminal closed), while a reply streams: the reply stops as at
    Ctrl-C, its shown words kept and logged as interrupted, and the chat ends (the next line
    is never read); the signals' own handlers are back afterwards."""
    from chatcore.serving import Scheduler

    number = getattr(signal, name)
    before = signal.getsignal(number)
    gate.text = "Hello there, my frie"
    chat = logged_state(serving_engine, store)
    chat.options = ReplyOptions(decoder="gated-text", max_new_tokens=40)
    chat.scheduler = Scheduler(serving_engine)
    out, err = SignalWhen(number, "my"), io.StringIO()
    try:
        run_loop(chat, lines_then_end(["tell me a story", "never read"]), out, err=err)
    finally:
        gate.release.set()
        chat.scheduler.close()
    assert out.getvalue() == "bot> Hello there, my [interrupted]\n"
    assert err.getvalue().endswith(f"chat ended ({name}); what was shown is kept\n")
    assert signal.getsignal(number) is before
    with store as opened:
        (summary,) = opened.list_conversations(limit=1)
        messages = opened.get_conversation(summary.id).messages
    assert [(m.role, m.text, m.interrupted) for m in messages] == [
        ("user", "tell me a story", False),
        ("bot", "Hello there, my", True),
    ]


@pytest.mark.parametrize(
    "written, pressed, shown, kept",
    [
        # Ctrl-C before the retry wrote a whole word: the reply it was to replace stays, in the log too.
        ("Hellothere", lambda _, flushes: flushes == 3, "[interrupted]", None),
        # Ctrl-C once it had written some: its words replace the old reply, which the log marks superseded.
        ("Hello there, my frie", lambda text, _: "my" in text, "Hello there, my [interrupted]", "Hello there, my"),
    ],
)
def test_a_retry_stopped_by_ctrl_c_leaves_the_chat_and_the_log_agreeing(
    serving_engine, store, gate, written, pressed, shown, kept
):
    from chatcore.serving import Scheduler

    gate.text = written
    chat = logged_state(serving_engine, store)
    chat.scheduler = Scheduler(serving_engine)  # as `chatcore chat` decodes
    read_line = lines_then_end(["/retry"])
    out = CtrlCWhen(pressed)
    try:
        run(chat, "hello there")
        old = chat.current.turns[1]
        run(chat, "/decoder gated-text")
        run(chat, "/max 40")
        run_loop(chat, read_line, out)
    finally:
        gate.release.set()
        chat.scheduler.close()
    with store as opened:
        logged = opened.get_conversation(chat.current.id).messages
        resumed = opened.resume(chat.current.id).turns
    if kept is None:
        note = "note: the retry was stopped before its first word: the previous reply is kept"
        assert out.getvalue() == f"bot> {shown}\n{note}\n\n"
        assert chat.current.turns[1:] == [old]
        assert [(m.role, m.text, m.superseded) for m in logged] == [
            ("user", "hello there", False),
            ("bot", old.text, False),
        ]
        assert run(chat, "/why").output.startswith("decoder greedy")  # the reply kept, not the retry
    else:
        assert out.getvalue() == f"bot> {shown}\n\n"
        assert [(t.role, t.text, t.interrupted) for t in chat.current.turns][1:] == [("bot", kept, True)]
        assert [(m.role, m.superseded) for m in logged] == [("user", False), ("bot", True), ("bot", False)]
    assert [(t.role, t.text) for t in resumed] == [(t.role, t.text) for t in chat.current.turns]  # --continue agrees


# -- Ctrl-C while a slash command loads what it needs ----------------------------------------------
class HeldLoad:
    """A load (a reverse model, an attribute head) that the test holds open: ``started`` once it
    runs, ``release`` lets it end."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()


HELD_LOADS: dict[str, HeldLoad] = {}


def held_load(gate: str) -> str:
    load = HELD_LOADS.setdefault(gate, HeldLoad())
    load.started.set()
    try:
        assert load.release.wait(60), "the test never released the load"
    except KeyboardInterrupt as error:
        # What torch does with a Ctrl-C that lands in its C code: another error comes out.
        raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'") from error
    return gate


class HeldLoadSettings(GreedySettings):
    gate: str = "default"


class HeldLoadDecoder(GreedyDecoder):
    name = "held-load"
    Settings = HeldLoadSettings

    @classmethod
    def setup(cls, model, settings):
        return held_load(settings.gate)


class HeldLoadSteerer(Steerer):
    name = "held-load"
    Settings = HeldLoadSettings

    @classmethod
    def setup(cls, model, settings):
        return held_load(settings.gate)

    def wrap(self, step):  # pragma: no cover - no reply is made
        return step


class HeldLoadPlugin:
    @chatcore.hookimpl
    def register_decoders(self, register):
        register(HeldLoadDecoder)

    @chatcore.hookimpl
    def register_steerers(self, register):
        register(HeldLoadSteerer)


@pytest.mark.parametrize("command", ["/decoder", "/steer"])
def test_ctrl_c_while_a_command_loads_cancels_it_and_changes_nothing(state, command):
    state.engine.host.register(HeldLoadPlugin(), "held-load")
    line = f"{command} held-load gate={command}"
    load = HELD_LOADS[command] = HeldLoad()
    before = state.options.model_copy(deep=True)

    def press_ctrl_c() -> None:
        if load.started.wait(60):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    presser = threading.Thread(target=press_ctrl_c)
    presser.start()
    try:
        outcome = handle_line(state, line)
    finally:
        presser.join()
        load.release.set()
    assert (outcome.output, outcome.error) == (f"{command} cancelled; nothing changed", True)
    assert state.options == before
    # Given again, the command waits for the load it cancelled (it was never cut short) and uses it.
    again = handle_line(state, line)
    assert not again.error and "held-load" in again.output and state.options != before


class PressedInAFinalizer:
    def __del__(self):
        signal.raise_signal(signal.SIGINT)  # as Ctrl-C can land in asyncio's BaseEventLoop.__del__


class FinalizingFormat(DialoGPTFormat):
    """Building it runs a finalizer, which Ctrl-C interrupts."""

    name = "finalizing"

    def __init__(self, *args):
        super().__init__(*args)
        PressedInAFinalizer()  # dropped at once: its finalizer runs here


class FinalizingFormatPlugin:
    @chatcore.hookimpl
    def register_prompt_formats(self, register):
        register(FinalizingFormat)


def test_ctrl_c_that_lands_in_a_finalizer_still_cancels_the_command(state):
    state.engine.host.register(FinalizingFormatPlugin(), "finalizing")
    before = (state.format_name, state.prompt_format, state.current.prompt_format)
    outcome = handle_line(state, "/format finalizing")  # Python cannot raise in a finalizer: only print
    assert outcome.output == "/format cancelled; nothing changed"
    assert (state.format_name, state.prompt_format, state.current.prompt_format) == before


def test_a_command_without_arguments_refuses_them(state):
    run(state, "hello")
    before = (state.current.id, list(state.current.turns), state.multiline)
    for name, command in COMMANDS.items():
        if command.usage == name:
            assert_one_line_error(
                run(state, f"{name} extra words"), f"{name} takes no arguments, got 'extra words' (usage: {name})"
            )
    for alias in ("/q", "/exit", "/QUIT"):
        refused = run(state, f"{alias} now")
        assert not refused.quit
        assert_one_line_error(refused, "/quit takes no arguments, got 'now' (usage: /quit)")
    assert (state.current.id, list(state.current.turns), state.multiline) == before
    assert run(state, "/q").quit and run(state, "/new ").output.startswith("new conversation")


def test_the_command_lines_sampling_stays_the_default_of_decoders_chosen_later(state):
    state.sampling_shortcuts = {"temperature": 0.9, "top_p": 0.5}
    for line, settings in [
        ("/decoder top-k", {"temperature": "0.9", "top_p": "0.5"}),
        ('/decoder "top-k top_k=20"', {"top_k": "20", "temperature": "0.9", "top_p": "0.5"}),
        ("/decoder top-k temperature=0.3", {"temperature": "0.3", "top_p": "0.5"}),  # the spec's own wins
    ]:
        shown = run(state, line).output
        assert state.options.decoder_settings == settings and "\n" not in shown
        assert f"temperature={settings['temperature']}" in shown and "top_p=0.5" in shown
    greedy = run(state, "/decoder greedy").output.splitlines()
    assert greedy[0].startswith("decoder: greedy") and state.options.decoder_settings == {}
    assert greedy[1] == (
        "note: greedy does not use the command line's --temperature 0.9 (it has no such setting); "
        "--top-p 0.5 (it has no such setting)"
    )
    state.sampling_shortcuts = {"temperature": 0.0}  # --temperature 0: greedy decoding
    zero = run(state, "/decoder top-k")
    assert not zero.error and state.options.decoder_settings == {}
    assert zero.output.splitlines()[1].startswith("note: top-k does not use the command line's --temperature 0 (")


def test_why_shows_steering(state):
    run(state, "/steer bow-bias words=pizza,pasta strength=2")
    run(state, "what do you like?")
    why = run(state, "/why").output
    assert "steerer bow-bias: words=pizza,pasta" in why and "strength=2.0" in why


def test_bad_input_is_refused_or_cleaned_never_raised(state, engine):
    for blank in ("", "   ", "\t"):
        assert handle_line(state, blank).output == "" and handle_line(state, blank).reply is None
    assert_one_line_error(handle_line(state, "x" * 100_000), "the limit is 8,000")
    assert_one_line_error(handle_line(state, "\x00\x07\x1b"), "the message is empty")
    assert_one_line_error(handle_line(state, "caf\udcc3 bad bytes"), "not UTF-8")
    assert state.current.turns == []

    run(state, "\x1b[31mred\x1b[0m and a \x07bell")
    assert state.current.turns[0].text == "red and a bell"

    special = run(state, "<|endoftext|> hi")
    assert state.current.turns[-2].text == "<|endoftext|> hi"
    assert engine.eos_token_id not in encode_text(engine.tokenizer, "<|endoftext|> hi")
    assert special.reply.provenance["prompt_tokens"] > 2

    run(state, "//shrug")
    assert state.current.turns[-2].text == "/shrug"


def test_configurations_that_cannot_reply_are_refused_by_steer_and_decoder(bundled_model, store):
    from refused_configurations import IMPOSSIBLE_STEERERS, NON_DECODABLE_DECODERS, PLUGIN_MODULES

    from chatcore.engine import Engine

    host = plugin_manager.PluginHost()
    host.load_modules(PLUGIN_MODULES + ("chatcore.plugins.prompt_formats",))
    # The bundled model has a CoCon block, so `/steer cocon ...` alone is accepted.
    state = logged_state(Engine(bundled_model, host=host), store)
    for (first, second), line in IMPOSSIBLE_STEERERS:
        run(state, "/steer off")
        assert not run(state, f"/steer {first}").error
        before = list(state.options.steerers)
        assert run(state, f"/steer {second}").output == f"error: {line}"
        assert state.options.steerers == before  # the steering stays as it was
    for spec, line in NON_DECODABLE_DECODERS:
        assert run(state, f"/decoder {spec}").output == f"error: {line}"
        assert run(state, f'/decoder "{spec}"').output == f"error: {line}"
        assert state.options.decoder == "greedy"
    assert state.current.turns == [] and store.list_conversations() == []  # nothing was logged


def test_chat_refuses_a_configuration_that_cannot_reply_before_the_log_opens(repl_host, tiny_model_dir, tmp_path):
    from refused_configurations import IMPOSSIBLE_STEERERS, NON_DECODABLE_DECODERS

    from chatcore.errors import OptionError

    repl_host.load_modules(("chatcore.plugins.pplm.plugin", "chatcore.plugins.cocon.plugin"))
    db = tmp_path / "chat.sqlite3"
    for steers, decoder, line in [(specs, "greedy", line) for specs, line in IMPOSSIBLE_STEERERS] + [
        ((), spec, line) for spec, line in NON_DECODABLE_DECODERS if spec.startswith(("top-k", "greedy"))
    ]:
        config = ChatConfig(model=str(tiny_model_dir), decoder_spec=decoder, steer_specs=steers, db_url=str(db))
        with pytest.raises(OptionError) as refused:
            start_chat(config, host=repl_host, err=io.StringIO(), input=None)
        assert str(refused.value) == line
    assert not db.exists()  # nothing was logged


def test_a_failing_log_is_reported_once_and_the_chat_goes_on(state, store):
    store.db.dispose()
    Path(store.db.url.database).write_bytes(b"no longer a database" * 100)
    run(state, "one")
    run(state, "two")
    assert len(state.take_notices()) == 1
    assert [t.role for t in state.current.turns] == ["user", "bot", "user", "bot"]
    assert state.log_status.startswith("failing")
    assert "log: failing" in toolbar_text(state)


@dataclass
class BrokenSettings:
    after: int = 0


class BrokenSteerer(Steerer):
    name = "broken"
    description = "fails while generating"
    Settings = BrokenSettings

    def wrap(self, step):
        def broken(state):
            raise RuntimeError("boom")

        return broken


class BrokenSteererPlugin:
    @chatcore.hookimpl
    def register_steerers(self, register):
        register(BrokenSteerer)


class FailingHookPlugin:
    @chatcore.hookimpl
    def on_user_message(self, conversation, turn):
        raise RuntimeError("hook down")


def lines_then_end(lines):
    """A terminal's line reader: ``lines`` one by one, then the end of input (Ctrl-D)."""
    pending = list(lines)

    def read_line() -> str:
        if not pending:
            raise EOFError
        return pending.pop(0)

    return read_line


def chat_lines(state, *lines):
    """``lines`` through the terminal loop; what it printed."""
    out = io.StringIO()
    run_loop(state, lines_then_end(lines), out)
    return out.getvalue()


def test_a_plugin_failure_is_shown_once(loaded, caplog):
    from chatcore.engine import Engine
    from chatcore.testing import plugin_host

    host = plugin_host(BrokenSteererPlugin())
    state = ChatState(Engine(loaded, host=host), ReplyOptions(decoder="greedy", max_new_tokens=3))
    shown = chat_lines(state, "/steer broken", "hello")
    assert shown.count("boom") == 1 and "\nerror: plugin 'BrokenSteererPlugin': steerer 'broken'" in shown
    assert not [record for record in caplog.records if record.name == "chatcore.plugins"]

    # A failure the chat does not show as its error (a hook's) comes as a note instead.
    assert host.register(FailingHookPlugin(), "failing-hook")
    shown = chat_lines(state, "/steer off", "hello again")
    assert shown.count("hook down") == 1 and "note: plugin 'failing-hook' failed at hook on_user_message" in shown


# -- completion and toolbar ----------------------------------------------------------------------
def texts(state, typed):
    return [s.text for s in completions(state, typed)]


def test_completion_of_commands_names_and_settings(state, store):
    assert texts(state, "/de") == ["/decoder"]
    assert "/steer" in texts(state, "/") and texts(state, "hello /de") == []
    assert {"greedy", "top-k"} <= set(texts(state, "/decoder "))
    assert set(texts(state, "/decoder top-k t")) == {"top_k=", "top_p=", "temperature="}
    assert "top_k=" not in texts(state, "/decoder top-k top_k=3 ")
    assert texts(state, "/decoder top-k top_k=") == []  # any number goes: nothing to offer
    assert texts(state, "/steer ") == ["off", "bow-bias"]
    assert texts(state, "/steer bow-bias st") == ["strength="]
    # Each setting comes with its help: the docstring under the field.
    help_of = {s.text: s.meta for s in completions(state, "/decoder top-k t")}
    assert help_of["top_k="] == "Sample from this many best tokens."
    assert help_of["temperature="].startswith("Divide the scores by this")
    assert texts(state, "/steer off ") == []
    assert texts(state, "/form") == ["/format"] and texts(state, "/sys") == ["/system"]
    assert texts(state, "/format ") == ["auto", "chat-template", "dialogpt"]
    assert texts(state, "/format d") == ["dialogpt"]
    assert texts(state, "/system ") == ["clear"] and texts(state, "/system Be ") == []
    state.options.steerers = [("bow-bias", {})]
    assert texts(state, "/steer off ") == ["bow-bias"]
    store.ensure_conversation("abc123", title="t")
    assert texts(state, "/resume ab") == ["abc123"]
    assert completions(state, "/decoder to")[0].start == -2


def test_completion_offers_the_values_a_setting_takes(loaded):
    from chatcore.engine import Engine
    from chatcore.plugins.bow_bias import builtin_topics
    from chatcore.testing import plugin_host

    host = plugin_host("chatcore.plugins.bow_bias", "chatcore.plugins.pplm.plugin", "chatcore.plugins.mmi.plugin")
    state = ChatState(Engine(loaded, host=host), ReplyOptions(decoder="greedy"))
    topics = builtin_topics()
    assert "food" in topics and len(topics) > 1
    assert texts(state, "/steer pplm topic=") == [f"topic={topic}" for topic in topics]
    assert texts(state, "/steer bow-bias strength=2 topic=fo") == ["topic=food"]
    assert texts(state, "/decoder mmi selection=") == ["selection=argmax", "selection=sample"]
    assert texts(state, "/decoder mmi length_normalize=t") == ["length_normalize=true"]
    assert texts(state, "/steer pplm words=") == [] and texts(state, "/steer nope topic=") == []
    assert completions(state, "/steer pplm topic=fo")[0].start == -len("topic=fo")


def test_toolbar_shows_model_decoder_steerers_and_log(state):
    text = toolbar_text(state)
    assert "decoder: greedy" in text and "steer: none" in text and "log: on" in text
    run(state, "/steer bow-bias topic=food")
    run(state, "/seed 3")
    run(state, "/multi")
    text = toolbar_text(state)
    assert "steer: bow-bias" in text and "seed: 3" in text and "multi-line" in text


# -- prompt-toolkit, driven through its pipe input -------------------------------------------------
@pytest.fixture
def repl_host():
    host = plugin_manager.PluginHost()
    host.load_modules(BUILTIN_TEST_PLUGINS + ADAPTERS)
    assert host.problems == []
    plugin_manager.set_plugin_host(host)
    return host


def test_the_prompt_toolkit_session(repl_host, tiny_model_dir, tmp_path):
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    url = sqlite_url(tmp_path / "chat.sqlite3")
    config = ChatConfig(
        model=str(tiny_model_dir),
        decoder_spec="greedy",
        max_new_tokens=4,
        seed=1,
        db_url=url,
        history_file=tmp_path / "history",
    )
    out = io.StringIO()
    with create_pipe_input() as pipe:
        pipe.send_text(
            "hello \x00there\r"  # Ctrl-Space (NUL) does nothing
            "/system Be kind.\r"
            "/format auto\r"
            "/decoder top-k top_k=5\r"
            "first line\x1b\rsecond line\r"  # Esc-Enter adds a line
            "typed, then dropped\x03"  # Ctrl-C at the prompt clears the line
            "/retry\r"
            "/multi\r"  # now Enter adds a line and Esc-Enter sends ...
            "line one\rline two\x1b\r"
            "/multi\r"  # ... though a one-line command still runs on Enter
            "\x04"
        )  # Ctrl-D exits
        state = start_chat(config, out=out, input=pipe, output=DummyOutput())
    shown = out.getvalue()
    assert shown.count("bot> ") == 4 and "top_k=5" in shown
    assert "multi-line on" in shown and "multi-line off" in shown and not state.multiline
    assert "system prompt:\n  Be kind.\n" in shown and "format: dialogpt (auto picked it)" in shown
    assert state.current.system == "Be kind."
    assert [t.text for t in state.current.turns if t.role == "user"] == [
        "hello there",
        "first line\nsecond line",  # a message keeps its lines
        "line one\nline two",
    ]
    assert "dropped" not in shown
    history = (tmp_path / "history").read_text()
    assert "+hello there" in history and "+first line\n+second line" in history
    with ConversationStore(url) as store:
        record = store.get_conversation(state.current.id)
    assert [(m.role, m.superseded) for m in record.messages] == [
        ("user", False),
        ("bot", False),
        ("user", False),
        ("bot", True),
        ("bot", False),
        ("user", False),
        ("bot", False),
    ]
    assert [m.seed for m in record.messages if m.role == "bot"] == [1, 2, 3, 4]
    assert record.messages[-1].decoder["name"] == "top-k"
    assert repl_host.pm.get_plugin("conversation-log:repl") is None  # unregistered at exit


def test_a_fresh_chat_keeps_its_files_private(repl_host, tiny_model_dir, tmp_path, monkeypatch):
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    config = ChatConfig(model=str(tiny_model_dir), decoder_spec="greedy", max_new_tokens=2)
    old_umask = os.umask(0o022)  # the usual umask, under which every file used to be readable by all
    try:
        with create_pipe_input() as pipe:
            pipe.send_text("a private thought\r\x04")
            start_chat(config, out=io.StringIO(), err=io.StringIO(), input=pipe, output=DummyOutput())
    finally:
        os.umask(old_umask)
    folder = tmp_path / "data" / "chatcore"
    modes = {path.name: path.stat().st_mode & 0o777 for path in [tmp_path / "data", folder, *folder.iterdir()]}
    assert modes == {"data": 0o700, "chatcore": 0o700, "conversations.sqlite3": 0o600, "repl_history": 0o600}
    assert "a private thought" in (folder / "repl_history").read_text()


def test_a_chat_started_on_a_full_disk_works_without_its_history_and_says_what_was_not_kept(
    repl_host, tiny_model_dir, tmp_path, monkeypatch
):
    """The disk is full from the start (tests/disk_full.py: RLIMIT_FSIZE, so every write that
    grows a file fails at the OS boundary): the history file, the log and its journal cannot be
    written. Every line is still answered, the person is told once about the history and once
    about the log, and the exit says what was not kept, without an error."""
    from disk_full import files_cannot_grow
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    url = sqlite_url(tmp_path / "chat.sqlite3")
    holder = ConversationStore(url)  # another chat holds the log open (its -wal and -shm exist)
    holder.journal_mode()
    config = ChatConfig(
        model=str(tiny_model_dir),
        decoder_spec="greedy",
        max_new_tokens=2,
        db_url=url,
        history_file=tmp_path / "history",
    )
    out, err = io.StringIO(), io.StringIO()
    with files_cannot_grow(), create_pipe_input() as pipe:
        pipe.send_text("one\rtwo\rthree\r/quit\r")
        state = start_chat(config, out=out, err=err, input=pipe, output=DummyOutput())
    holder.close()
    shown = out.getvalue()
    assert [t.text for t in state.current.turns if t.role == "user"] == ["one", "two", "three"]
    assert shown.count("bot> ") == 3
    assert shown.count("input history is no longer saved") == 1 and "File too large" in shown
    assert shown.count("cannot be written either") == 1
    assert err.getvalue().count("note: 6 write(s) to the conversation log were lost") == 1
    assert "Traceback" not in shown + err.getvalue()
    assert (tmp_path / "history").read_text() == ""


@pytest.mark.slow
def test_coloured_text_pasted_without_paste_marks_is_one_whole_message(repl_host, tiny_model_dir):
    """ESC [ 3 1 m reads like a terminal's mouse report; the chat never asks for those, so it
    is text: the message stays whole, its escape sequences removed, and nothing crashes."""
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    config = ChatConfig(model=str(tiny_model_dir), decoder_spec="greedy", max_new_tokens=2, no_log=True)
    out = io.StringIO()
    with create_pipe_input() as pipe:
        pipe.send_text("hello \x1b[31mred\x1b[0m world \x1b[<0;3;4M end\r\x04")
        state = start_chat(config, out=out, input=pipe, output=DummyOutput())
    (turn,) = [t for t in state.current.turns if t.role == "user"]
    assert turn.text.startswith("hello ") and "red" in turn.text and turn.text.endswith("world end")
    assert "\x1b" not in turn.text and "Traceback" not in out.getvalue()


def test_a_long_paste_is_refused_at_once_and_kept_out_of_the_history(repl_host, tiny_model_dir, tmp_path, monkeypatch):
    import threading

    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    from chatcore.adapters.repl import terminal

    config = ChatConfig(
        model=str(tiny_model_dir),
        decoder_spec="greedy",
        max_new_tokens=2,
        db_url=sqlite_url(tmp_path / "chat.sqlite3"),
        history_file=tmp_path / "history",
    )
    out = io.StringIO()
    dispatched = []  # the key presses the chat's key bindings were matched against, per read
    coalesce = terminal.coalesce_pastes

    def counted(keys):
        presses = coalesce(keys)
        dispatched.append(len(presses))
        return presses

    monkeypatch.setattr(terminal, "coalesce_pastes", counted)
    # Pasted without bracketed paste: the characters come as keys, 1,024 to a read.
    keys = (
        "y" * 100_000
        + "\r"
        + "hello\r"
        + "y" * 9_000
        + "\x03"  # Ctrl-C clears an over-long line too
        + "/system "
        + "s" * 33_000
        + "\r"
        + "\x04"
    )
    with create_pipe_input() as pipe:
        sender = threading.Thread(target=pipe.send_text, args=(keys,))  # more than a pipe holds
        sender.start()
        state = start_chat(config, out=out, err=io.StringIO(), input=pipe, output=DummyOutput())
        sender.join()
    assert out.getvalue().splitlines() == [
        "error: the message is 100,000 characters long; the limit is 8,000; nothing was sent",
        out.getvalue().splitlines()[1],
        "error: the command is 33,008 characters long; the limit is 32,100; nothing was sent",
        "",
    ]
    assert out.getvalue().splitlines()[1].startswith("bot> ")
    assert [t.text for t in state.current.turns if t.role == "user"] == ["hello"] and state.system is None
    # Read whole: a few presses per read of 1,024 characters, not one per character (each
    # matched against every binding: the 142,000 characters took 146 s that way).
    assert sum(dispatched) < 2_000, sum(dispatched)
    assert (tmp_path / "history").read_text().count("\n+") == 1  # only "hello"


def test_a_paste_in_pieces_that_makes_the_line_too_long_is_taken_back_whole():
    """A terminal without bracketed paste sends a paste one read at a time: the pieces that
    fit are shown as they come, and the one that makes the line too long takes them back
    out, so the input holds what was typed before the paste; Enter reports the whole length."""
    from prompt_toolkit.document import Document

    from chatcore.adapters.repl.line_guard import LineGuard

    guard = LineGuard(lambda text: len(text) <= 10)
    document = guard.paste(Document("ab ", 3), "wxyz")
    assert (document.text, document.cursor_position, guard.overflowing) == ("ab wxyz", 7, False)
    document = guard.paste(document, "1234")
    assert (document.text, document.cursor_position) == ("ab ", 3)
    assert guard.overflowing and guard.length(document.text) == 11 and guard.start(document.text) == "ab wxyz1234"
    document = guard.paste(document, "56")  # the rest of the paste, and what is typed after it
    guard.typed("q")
    assert document.text == "ab " and guard.length(document.text) == 14
    guard.reset()
    assert not guard.overflowing and guard.length("ab ") == 3 and guard.start("ab ") == "ab "

    # Something typed between two pastes: the first is the person's text, and stays.
    guard = LineGuard(lambda text: len(text) <= 10)
    document = guard.paste(Document("ab", 2), "cdef")
    document = Document(document.text + "!", 7)  # typed
    document = guard.paste(document, "ghijk")
    assert document.text == "abcdef!" and guard.length(document.text) == 12
    # A piece pasted into the middle of the line lands at the cursor.
    guard = LineGuard(lambda text: len(text) <= 10)
    assert guard.paste(Document("abcd", 2), "XY").text == "abXYcd"


def test_no_log_keeps_the_typed_lines_off_the_disk_too(repl_host, tiny_model_dir, tmp_path):
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    config = ChatConfig(
        model=str(tiny_model_dir),
        decoder_spec="greedy",
        max_new_tokens=2,
        no_log=True,
        history_file=tmp_path / "history",
    )
    with create_pipe_input() as pipe:
        pipe.send_text("a secret\r\x04")
        state = start_chat(config, out=io.StringIO(), err=io.StringIO(), input=pipe, output=DummyOutput())
    assert [t.text for t in state.current.turns if t.role == "user"] == ["a secret"]
    assert not (tmp_path / "history").exists()


def test_a_line_typed_while_logs_delete_rewrites_the_history_is_kept(repl_host, tiny_model_dir, tmp_path, monkeypatch):
    """`logs delete` rewrites the input history under its lock (a new file renamed over it); the chat
    appends each line under the same lock, and to the new file when the one it opened was replaced
    meanwhile. Appended to the file it had opened, without the lock, the line was lost with it."""
    import fcntl
    from types import SimpleNamespace

    from prompt_toolkit.history import FileHistory
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    from chatcore.log import input_history, journal

    history = tmp_path / "history"
    history.write_bytes(b"\n# 2024-05-01 12:00:00.000000\n+an old line\n")
    first_file = history.stat().st_ino
    rewriting, chat_waits = threading.Event(), threading.Event()
    replace = input_history.replace_private_file

    def paused_replace(path, data):  # the deletion holds the lock, has read the file, and is about to replace it
        rewriting.set()
        assert chat_waits.wait(60), "the chat never asked for the history file's lock"
        replace(path, data)

    def flock(descriptor, operation):
        if os.fstat(descriptor).st_ino == first_file:
            chat_waits.set()  # the chat opened the file being rewritten, and waits for its lock
        fcntl.flock(descriptor, operation)

    monkeypatch.setattr(input_history, "replace_private_file", paused_replace)
    monkeypatch.setattr(journal, "fcntl", SimpleNamespace(flock=flock, LOCK_EX=fcntl.LOCK_EX, LOCK_NB=fcntl.LOCK_NB))
    deletion = threading.Thread(target=input_history.scrub_history, args=(history, {"an old line"}))
    deletion.start()
    assert rewriting.wait(60)
    config = ChatConfig(
        model=str(tiny_model_dir),
        decoder_spec="greedy",
        max_new_tokens=2,
        db_url=sqlite_url(tmp_path / "chat.sqlite3"),
        history_file=history,
    )
    try:
        with create_pipe_input() as pipe:
            pipe.send_text("typed meanwhile\r\x04")
            start_chat(config, out=io.StringIO(), err=io.StringIO(), input=pipe, output=DummyOutput())
    finally:
        chat_waits.set()  # a chat that never waited: the deletion goes on, and the test says what it lost
        deletion.join()
    assert history.stat().st_ino != first_file and history.stat().st_mode & 0o777 == 0o600
    assert list(FileHistory(str(history)).load_history_strings()) == ["typed meanwhile"]


def test_logs_delete_takes_what_was_typed_in_a_deleted_conversation_out_of_the_input_history(
    cli, tiny_model_dir, tmp_path, monkeypatch
):
    """The lines typed in a conversation `logs delete` deleted stayed in the input history, where Up
    and Ctrl-R offered them. The entries that sent its messages go (typed as sent, with `//`, with
    spaces, over two lines); the commands and the other conversations' entries stay, in
    prompt-toolkit's format, 0600. `--history-file` names another history; one that cannot be
    rewritten is a one-line error saying it still holds them."""
    from prompt_toolkit.history import FileHistory
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    url = sqlite_url(tmp_path / "chat.sqlite3")
    config = ChatConfig(model=str(tiny_model_dir), decoder_spec="greedy", max_new_tokens=2, db_url=url)
    with create_pipe_input() as pipe:
        pipe.send_text(
            "my pin is 9999\r"
            "//9999 starts with a slash\r"
            "  spaced   out 9999  \r"
            "/system not a message 9999\r"
            "first line 9999\x1b\rsecond line\r"
            "/new\r"
            "kept for now\r"
            "/new\r"
            "the last one\r"
            "\x04"
        )
        start_chat(config, out=io.StringIO(), err=io.StringIO(), input=pipe, output=DummyOutput())
    history = tmp_path / "data" / "chatcore" / "repl_history"
    with ConversationStore(url) as store:
        last, kept, secret = [summary.id for summary in store.list_conversations()]

    deleted = cli("logs", "delete", "--yes", secret[:12], "--db", url)
    assert deleted.exit_code == 0, deleted.output
    assert deleted.stdout.splitlines()[1].startswith(f"took 4 typed message(s) out of the input history {history} ")
    assert list(FileHistory(str(history)).load_history_strings()) == [
        "the last one",
        "/new",
        "kept for now",
        "/new",
        "/system not a message 9999",
    ]
    assert history.stat().st_mode & 0o777 == 0o600 and history.read_text().startswith("\n# ")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(history.read_bytes())
    moved = cli("logs", "delete", "--yes", kept[:12], "--db", url, "--history-file", str(elsewhere))
    assert moved.exit_code == 0 and f"took 1 typed message(s) out of the input history {elsewhere} " in moved.stdout
    assert "kept for now" not in elsewhere.read_text() and "kept for now" in history.read_text()

    history.rename(tmp_path / "saved")
    history.mkdir()  # what cannot be read as a file
    failed = cli("logs", "delete", "--yes", last[:12], "--db", url)
    assert failed.exit_code == 1 and failed.stdout.startswith(f"deleted conversation {last} and its 2 message(s)")
    assert failed.stderr.strip().splitlines() == [
        f"Error: deleted from the log, but the input history {history} still holds what was typed "
        "(it cannot be rewritten: Is a directory); delete the file, or those lines in it"
    ]


# -- the `chat` command (plain lines when stdin is not a terminal) --------------------------------
@pytest.fixture
def cli(repl_host):
    from chatcore.cli import build_cli

    runner, group = CliRunner(), build_cli()

    def invoke(*args, input=None):
        return runner.invoke(group, list(args), input=input, catch_exceptions=False)

    return invoke


def test_the_chat_command(cli, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    model = ("--model", str(tiny_model_dir), "--decoder", "greedy", "-n", "3")
    first = cli("chat", *model, input="hello\n/quit\n")
    assert first.exit_code == 0, first.output
    assert first.stdout.startswith("bot> ") and "loading" in first.stderr and "logged to" in first.stderr
    default_log = tmp_path / "data" / "chatcore" / "conversations.sqlite3"
    with ConversationStore(sqlite_url(default_log)) as store:
        assert [m.text for m in store.get_conversation(store.latest_conversation_id()).messages][0] == "hello"

    again = cli("chat", *model, "--continue", input="/history\n")
    assert again.exit_code == 0 and again.stdout.startswith("you> hello\nbot> ")
    assert "resumed" in again.stderr
    persona = cli("chat", *model, "--continue", "--system", "Be new.", input="/system\n/history\n")
    assert persona.stdout.startswith("system prompt:\n  Be new.\nyou> hello\n")  # given on resuming: it wins

    unlogged = cli("chat", *model, "--no-log", "--db", str(tmp_path / "other.db"), input="hi\n/bogus\n/max 2\n")
    assert unlogged.exit_code == 0 and "not logged (--no-log)" in unlogged.stderr
    # Without a terminal the replies and what commands print stay on stdout, apart from errors and notes.
    assert "error: unknown command '/bogus'" in unlogged.stderr and "error" not in unlogged.stdout
    assert unlogged.stdout.startswith("bot> ") and "max new tokens: 2" in unlogged.stdout
    assert not (tmp_path / "other.db").exists()

    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(b"not sqlite" * 100)
    unavailable = cli("chat", *model, "--db", str(corrupt), input="hi\n/conversations\n")
    assert unavailable.exit_code == 0 and "chatting without the conversation log" in unavailable.stderr
    assert "the log cannot be opened now: turns are kept in its journal" in unavailable.stderr  # the banner
    assert "not logged" not in unavailable.stderr
    assert unavailable.stdout.startswith("bot> ") and "the conversation log is off (unavailable)" in unavailable.stderr

    for args, needle in [
        (("--cid", "nope"), "no conversation 'nope'"),
        (("--no-log", "--continue"), "drop --no-log"),
        (("--decoder", "top-k top_k=-1"), "`top_k` must be a positive integer"),
    ]:
        failed = cli("chat", "--model", str(tiny_model_dir), *args, input="")
        assert failed.exit_code == 1 and failed.stderr.strip().splitlines()[-1].startswith("Error: ")
        assert needle in failed.stderr


def test_a_system_prompt_set_after_the_last_message_is_kept_for_continue(cli, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    model = ("--model", str(tiny_model_dir), "--decoder", "greedy", "-n", "2", "--db", str(tmp_path / "log.db"))
    assert cli("chat", *model, input="hello\n/system Be brief.\n/quit\n").exit_code == 0
    assert cli("chat", *model, "--continue", input="/system\n").stdout.startswith("system prompt:\n  Be brief.\n")
    assert cli("chat", *model, "--continue", input="/system clear\n").exit_code == 0
    assert cli("chat", *model, "--continue", input="/system\n").stdout.startswith("no system prompt")
    # nothing said yet: nothing is written for it
    assert cli("chat", *model, input="/system Unsaid.\n").exit_code == 0
    with ConversationStore(sqlite_url(tmp_path / "log.db")) as store:
        assert len(store.list_conversations()) == 1


def test_chat_system_prompt_and_format_options(cli, tiny_model_dir, tmp_path):
    model = ("--model", str(tiny_model_dir), "--decoder", "greedy", "-n", "3", "--no-log")
    persona = tmp_path / "persona.txt"
    persona.write_text("You are a pirate.\nYou say arr.\n", encoding="utf-8")
    chatted = cli(
        "chat", *model, "--system-file", str(persona), "--format", "dialogpt", input="/system\n/format\nhello\n"
    )
    assert chatted.exit_code == 0, chatted.output
    assert chatted.stdout.startswith("system prompt:\n  You are a pirate.\n  You say arr.\nformat: dialogpt\n")
    assert "with a system prompt" in chatted.stderr and "bot> " in chatted.stdout
    typed = cli("chat", *model, "--system", "  Be   brief. ", input="/system\n")
    assert typed.exit_code == 0 and typed.stdout == "system prompt:\n  Be brief.\n\n"

    (tmp_path / "empty.txt").write_text(" \n\n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    missing_model = ("--model", str(tmp_path / "no-such-model"))  # option errors come before any loading
    for args, needle in [
        (("--system-file", str(tmp_path / "nope.txt")), "does not exist"),
        (("--system-file", str(tmp_path)), "is not a file"),
        (("--system-file", str(tmp_path / "latin1.txt")), "is not UTF-8 text (bad byte at position 3)"),
        (("--system-file", str(tmp_path / "empty.txt")), "is empty"),
        (("--system", "x", "--system-file", str(persona)), "not both"),
        (("--format", "nope"), "unknown prompt format 'nope' (available: "),
    ]:
        failed = cli("chat", *missing_model, "--no-log", *args, input="")
        assert failed.exit_code == 1, failed.output
        assert failed.stderr.count("\n") == 1 and failed.stderr.startswith("Error: ") and needle in failed.stderr
        assert "loading" not in failed.stderr
    wrong = cli("chat", "--model", str(tiny_model_dir), "--no-log", "--format", "chat-template", input="")
    assert wrong.exit_code == 1 and "has no chat template" in wrong.stderr
    too_long = cli("chat", *model, "--system", "be kind " * 100, input="hello\n")  # 128 positions
    assert too_long.exit_code == 1 and "the system prompt takes" in too_long.stderr and "bot>" not in too_long.stdout


def test_the_chat_command_keeps_its_sampling_flags_for_decoders_chosen_later(cli, tiny_model_dir):
    chatted = cli("chat", "--model", str(tiny_model_dir), "--no-log", "--temperature", "0.9", input="/decoder top-k\n")
    assert chatted.exit_code == 0, chatted.output
    assert chatted.stdout.startswith("decoder: top-k ") and "temperature=0.9" in chatted.stdout


def test_building_the_cli_imports_no_heavy_module():
    code = (
        "import sys\n"
        "from chatcore.plugin_manager import PluginHost, set_plugin_host\n"
        f"host = PluginHost(); host.load_modules({ADAPTERS!r}); set_plugin_host(host)\n"
        "from chatcore.cli import build_cli\n"
        "group = build_cli(); assert {'chat', 'logs'} <= set(group.commands)\n"
        "heavy = [m for m in ('torch', 'transformers', 'sqlalchemy', 'prompt_toolkit') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr


# -- real processes --------------------------------------------------------------------------------
# Registers the adapters even where the installed entry points predate them, then runs
# the ordinary command line. Extra plugin modules come as the first argument.
LAUNCHER = textwrap.dedent("""
    import importlib, sys
    from chatcore.plugin_manager import get_plugin_host
    host = get_plugin_host()
    for name in ("chatcore.log", "chatcore.adapters.repl", *sys.argv[1].split(",")):
        if name and not host.pm.is_registered(module := importlib.import_module(name)):
            host.register(module, name)
    from chatcore.cli import main
    sys.exit(main(sys.argv[2:]))
""")

SLOW_STEERER = textwrap.dedent("""
    import time
    from dataclasses import dataclass

    import chatcore
    from chatcore.steering import Steerer

    @dataclass
    class SlowSettings:
        delay: float = 0.2

    class SlowSteerer(Steerer):
        name = "slow"
        description = "waits before every step, so that a reply can be interrupted"
        Settings = SlowSettings

        def wrap(self, step):
            def slowed(state):
                time.sleep(self.settings.delay)
                return step(state)
            return slowed

    @dataclass
    class HeldLoadSettings:
        fifo: str = ""

    class HeldLoadSteerer(Steerer):
        name = "held-load"
        description = "loads until the test writes to its fifo, so that a command can be cancelled"
        Settings = HeldLoadSettings

        @classmethod
        def setup(cls, model, settings):
            print("held-load: loading", flush=True)
            with open(settings.fifo) as fifo:  # until the test closes its end
                fifo.read()

        def wrap(self, step):
            return step

    @chatcore.hookimpl
    def register_steerers(register):
        register(SlowSteerer)
        register(HeldLoadSteerer)
""")


def child_env(tmp_path):
    env = dict(
        os.environ,
        PYTHONPATH=str(tmp_path),
        XDG_DATA_HOME=str(tmp_path / "data"),
        CHATCORE_PLUGINS="",
        TERM="xterm",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    env.pop("CHATCORE_DEBUG", None)
    env.pop("CHATCORE_DB", None)
    return env


ANSI = re.compile(r"\x1b\[[0-9;?<=>]*[ -/]*[@-~]|\x1b\][^\x07]*\x07|\x1b[()][0-9A-Za-z]|\x1b[=>78]")


class PseudoTerminal:
    """A child process on a pty: send keys, wait for text (escape sequences removed).

    It answers cursor-position requests as a terminal does; prompt-toolkit draws its
    bottom toolbar only once it knows where the cursor is.
    """

    def __init__(self, argv, env, cwd):
        import pty

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child
            os.chdir(cwd)
            os.execve(argv[0], argv, env)
        import fcntl
        import struct
        import termios

        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
        self.raw = b""
        self.seen = 0
        self.exit_code = None

    def text(self):
        return ANSI.sub("", self.raw.decode("utf-8", errors="replace")).replace("\r", "")

    def expect(self, pattern, timeout=60.0):
        deadline = time.monotonic() + timeout
        while True:
            found = re.compile(pattern, re.S).search(self.text(), self.seen)
            if found:
                self.seen = found.end()
                return found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"timed out waiting for {pattern!r}; screen so far:\n{self.text()[-3000:]}")
            ready, _, _ = select.select([self.fd], [], [], min(remaining, 0.5))
            if ready:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:  # the child exited
                    raise AssertionError(f"exited while waiting for {pattern!r}:\n{self.text()[-3000:]}") from None
                self.raw += chunk
                for _ in range(chunk.count(b"\x1b[6n")):
                    self.send("\x1b[20;1R")

    def send(self, keys):
        os.write(self.fd, keys.encode())

    def wait(self, timeout=30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.raw += os.read(self.fd, 65536) if select.select([self.fd], [], [], 0.2)[0] else b""
            except OSError:
                pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.exit_code = os.waitstatus_to_exitcode(status)
                return self.exit_code
        raise AssertionError("the chat did not exit")

    def close(self):
        if self.exit_code is None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")
def test_chatcore_chat_in_a_pseudo_terminal(tiny_model_dir, tmp_path, repl_host):
    (tmp_path / "chatcore_test_slow.py").write_text(SLOW_STEERER)
    url = sqlite_url(tmp_path / "e2e.sqlite3")
    argv = [
        sys.executable,
        "-c",
        LAUNCHER,
        "chatcore_test_slow",
        "chat",
        "--model",
        str(tiny_model_dir),
        "--decoder",
        "greedy",
        "-n",
        "12",
        "--seed",
        "1",
        "--db",
        url,
    ]
    term = PseudoTerminal(argv, child_env(tmp_path), cwd=tmp_path)
    try:
        term.expect(r"you>", timeout=120)

        def line(text, answer):
            term.send(text + "\r")
            term.expect(answer)
            term.expect(r"you>")

        term.expect(
            r"tiny-model0 \| format: dialogpt \| decoder: greedy \| steer: none \| seed: 1 \| log: on"
        )  # the toolbar
        line("hello there", r"bot> [^\n]*\n")
        line("/decoder top-k top_k=20", r"decoder: top-k [^\n]*top_k=20")
        term.expect(r"decoder: top-k top_k=20 \| steer: none \| seed: 2")
        line("what do you like to eat?", r"bot> [^\n]*\n")
        line("/steer bow-bias words=pizza,pasta strength=4", r"steering: bow-bias")
        term.expect(r"steer: bow-bias \| seed: 3")
        line("and for dinner?", r"bot> [^\n]*\n")
        line("/steer off", r"steering off")
        term.send("/sys")  # the menu offers the command as it is typed; Tab takes it ...
        term.expect(r"/system +show, set or clear the system prompt")
        term.send("\t")
        term.expect(r"tem")  # the rest of the word, written after "/sys"
        term.send(" Be kind.\r")
        term.expect(r"system prompt:\n  Be kind.\n")
        term.expect(r"system prompt \| seed: 4")  # ... and the toolbar shows it is set
        term.send("/format d")  # ... and a format name
        term.expect(r"dialogpt +turns joined by EOS")
        term.send("\t")
        term.expect(r"ialogpt")
        line("", r"format: dialogpt\n")
        line("/retry", r"bot> [^\n]*\n")
        line("/steer slow delay=0.25", r"steering: slow")
        term.send("one more question\r")
        term.expect(r"bot> ")
        term.send("/steer slow delay=2\r")  # typed while the reply streams: not mixed into it ...
        reply = term.expect(r"([^\n]*)\n").group(1)
        assert "steer" not in reply and "delay" not in reply, reply
        term.expect(r"steering: slow delay=2")  # ... but run once the reply is done
        term.expect(r"you>")
        term.send("tell me a long story\r")
        # Two words of the reply have streamed; each further step waits 2 s, room enough for the
        # Ctrl-C to arrive before the reply's 12 tokens are out on a machine busy with other work ...
        term.expect(r"bot> \S+ \S")
        term.send("\x03")  # ... and Ctrl-C cuts it
        term.expect(r"\[interrupted\]")
        term.expect(r"you>")
        fifo = tmp_path / "load.fifo"
        os.mkfifo(fifo)
        holder = os.open(fifo, os.O_RDWR)  # the load reads until this is closed (opening never blocks)
        try:
            term.send(f"/steer held-load fifo={fifo}\r")
            loading = term.expect(r"held-load: loading\n")
            term.send("\x03")  # Ctrl-C while a command loads what it needs cancels the command ...
            cancelled = term.expect(r"/steer cancelled; nothing changed\n")
            assert cancelled.start() == loading.end()  # in one line (no ^C echoed into it)
            term.expect(r"you>")
            term.expect(r"steer: slow \|")  # ... and changes nothing
        finally:
            os.close(holder)  # the load it left runs on, and ends
        term.send("/quit\r")
        assert term.wait() == 0
        assert "Traceback" not in term.text() and "Exception ignored" not in term.text()
    finally:
        term.close()

    from chatcore.cli import build_cli

    runner = CliRunner()
    listed = json.loads(runner.invoke(build_cli(), ["logs", "list", "--json", "--db", url]).stdout)
    assert len(listed) == 1
    shown = runner.invoke(build_cli(), ["logs", "show", listed[0]["id"][:8], "--db", url])
    assert shown.exit_code == 0, shown.output
    lines = [line for line in shown.stdout.splitlines() if "> " in line]
    users = [line.split("you> ", 1)[1] for line in lines if " you> " in line]
    assert users == [
        "hello there",
        "what do you like to eat?",
        "and for dinner?",
        "one more question",
        "tell me a long story",
    ]
    bots = [line for line in lines if " bot> " in line]
    # The interrupted reply is kept when it had written a whole word by the Ctrl-C (its
    # text is random, its speed the machine's); otherwise the last message waits for one.
    assert len(bots) in (5, 6)
    assert "[greedy, " in bots[0] and "[top-k, " in bots[1]
    assert "top-k + bow-bias" in bots[2] and "superseded by a retry" in bots[2]
    assert "[top-k, " in bots[3] and "superseded" not in bots[3]
    assert "top-k + slow" in bots[4] and "interrupted" not in bots[4]
    with ConversationStore(url) as store:
        last = store.get_conversation(listed[0]["id"]).messages[-1]
    if len(bots) == 6:
        assert "top-k + slow" in bots[5] and "interrupted" in bots[5]
        assert last.interrupted and 1 <= last.token_count < 12
    else:
        assert (last.role, last.text) == ("user", "tell me a long story")


def read_line(process, buffer, timeout=600.0, stream=None):  # only ends a hung chat; a loaded machine is slow
    stream = stream if stream is not None else process.stdout
    deadline = time.monotonic() + timeout
    while b"\n" not in buffer[0]:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no line from the chat; so far {buffer[0]!r}"
        if select.select([stream], [], [], min(remaining, 0.5))[0]:
            chunk = os.read(stream.fileno(), 65536)
            assert chunk, "the chat exited early"
            buffer[0] += chunk
    line, buffer[0] = buffer[0].split(b"\n", 1)
    return line.decode()


@pytest.mark.slow
def test_a_killed_chat_keeps_every_completed_turn(tiny_model_dir, tmp_path):
    url = sqlite_url(tmp_path / "killed.sqlite3")
    argv = [
        sys.executable,
        "-c",
        LAUNCHER,
        "",
        "chat",
        "--model",
        str(tiny_model_dir),
        "--decoder",
        "greedy",
        "-n",
        "4",
        "--db",
        url,
    ]
    process = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_env(tmp_path),
        cwd=tmp_path,
    )
    buffer, errors = [b""], [b""]

    def next_error() -> str:  # without a terminal, errors go to stderr, after the loading lines and the banner
        while not (line := read_line(process, errors, stream=process.stderr)).startswith("error: "):
            pass
        return line

    try:
        process.stdin.write(b"caf\xc3 \xff\xfe not utf-8\n" + b"y" * 100_000 + b"\n")
        process.stdin.flush()
        assert "not UTF-8" in next_error()
        assert "the limit is 8,000" in next_error()
        turns = 3
        for number in range(turns):
            process.stdin.write(f"message number {number}\n".encode())
            process.stdin.flush()
            assert read_line(process, buffer).startswith("bot> ")
        process.kill()  # SIGKILL: no clean-up code runs
        assert process.wait(timeout=30) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    with ConversationStore(url) as store:
        messages = store.get_conversation(store.latest_conversation_id()).messages
    assert [m.role for m in messages] == ["user", "bot"] * turns
    assert [m.text for m in messages if m.role == "user"] == [f"message number {n}" for n in range(turns)]
    assert all(m.token_count and not m.interrupted for m in messages if m.role == "bot")


@pytest.mark.slow
def test_turns_shown_while_the_log_is_locked_survive_a_kill(tiny_model_dir, tmp_path):
    """Another process holds SQLite's write lock while turns are answered; the chat is then
    SIGKILLed. The turns were journaled before each reply was shown: the next process that
    logs there writes every one of them, in order, and none twice."""
    db_path = tmp_path / "locked.sqlite3"
    url = sqlite_url(db_path)
    ConversationStore(url).close()
    blocker = sqlite3.connect(str(db_path), isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # another process holding the write lock for the whole chat
    argv = [sys.executable, "-c", LAUNCHER, "", "chat", "--model", str(tiny_model_dir), "--decoder", "greedy"]
    process = subprocess.Popen(
        [*argv, "-n", "3", "--db", url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=child_env(tmp_path),
        cwd=tmp_path,
    )
    buffer = [b""]
    turns = 4
    try:
        for number in range(turns):
            process.stdin.write(f"said during the outage {number}\n".encode())
            process.stdin.flush()
            line = read_line(process, buffer)
            while line.startswith("note: "):  # the log being unavailable is noted before the next prompt
                line = read_line(process, buffer)
            assert line.startswith("bot> ")
        process.kill()  # SIGKILL: no clean-up code runs
        assert process.wait(timeout=30) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        blocker.rollback()
        blocker.close()
    journal = tmp_path / "data" / "chatcore" / "log-journal"
    with ConversationStore(url) as store:
        assert store.count_messages() == 0  # nothing reached the database during the outage
        ConversationLogPlugin(store, journal_dir=journal).close()  # the next process replays the journal
        ConversationLogPlugin(store, journal_dir=journal).close()  # and a second one finds nothing left
        messages = store.get_conversation(store.latest_conversation_id()).messages
    assert [m.role for m in messages] == ["user", "bot"] * turns
    assert [m.text for m in messages if m.role == "user"] == [f"said during the outage {n}" for n in range(turns)]
    assert list(journal.glob("*.jsonl")) == []


def test_writes_the_log_cannot_take_at_exit_wait_in_its_journal(engine, tmp_path):
    import sqlite3

    from chatcore.adapters.repl.app import close_state

    db_path = tmp_path / "locked.sqlite3"
    store = ConversationStore(sqlite_url(db_path), timeout_s=0.05)
    chat = ChatState(engine, ReplyOptions(decoder="greedy", max_new_tokens=3), store=store)
    chat.log_plugin = ConversationLogPlugin(
        store, notify=chat.notify, retry_after_s=0.0, journal_dir=tmp_path / "journal"
    )
    engine.host.register(chat.log_plugin, "conversation-log")
    blocker = sqlite3.connect(str(db_path), isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # another process holds the write lock until after the exit
    said = []
    try:
        run(chat, "hello there")
        close_state(chat, say=said.append)
    finally:
        blocker.rollback()
        blocker.close()
    assert len(said) == 1 and "2 write(s) could not be saved" in said[0] and "written by the next chat" in said[0]
    # The next process that logs there writes them.
    reopened = ConversationStore(sqlite_url(db_path))
    ConversationLogPlugin(reopened, journal_dir=tmp_path / "journal").close()
    assert [m.text for m in reopened.get_conversation(chat.current.id).messages][0] == "hello there"
    reopened.close()


def test_a_log_that_cannot_be_opened_at_the_start_is_used_once_it_can(repl_host, tiny_model_dir, tmp_path, monkeypatch):
    from chatcore.adapters.repl.app import build_state, close_state

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))  # its journal

    folder = tmp_path / "not-yet"
    folder.write_text("a file where the log's folder should be")  # refused at the start, as by a full disk
    config = ChatConfig(
        model=str(tiny_model_dir), decoder_spec="greedy", max_new_tokens=3, db_url=sqlite_url(folder / "log.sqlite3")
    )
    said = []
    state = build_state(config, repl_host, said.append)
    assert state.store is None and any("kept in its journal" in line for line in said)
    run(state, "first message")
    assert state.store is None and state.log_plugin is not None and state.log_plugin.journaled == 2  # on the disk
    folder.unlink()
    folder.mkdir()
    run(state, "second message")  # tries to open the log (and goes on if that takes long)
    assert state.log_plugin.wait_idle(timeout_s=120) and state.log_plugin.flush()
    run(state, "third message")
    assert state.store is not None and "every turn since the start" in " ".join(state.take_notices())
    close_state(state, said.append)
    with ConversationStore(sqlite_url(folder / "log.sqlite3")) as store:
        messages = store.get_conversation(state.current.id).messages
    assert [m.text for m in messages if m.role == "user"] == ["first message", "second message", "third message"]
    assert [m.role for m in messages] == ["user", "bot"] * 3
