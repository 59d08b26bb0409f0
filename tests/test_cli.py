"""The command line, through click's test runner (and one real interpreter for import costs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

import chatcore
from chatcore.cli import build_cli


@pytest.fixture
def run():
    runner = CliRunner()

    def invoke(*args, input=None):
        return runner.invoke(build_cli(), list(args), input=input, catch_exceptions=True)

    return invoke


def error_lines(result):
    return [line for line in result.stderr.splitlines() if line.strip()]


def assert_clean_failure(result, *needles):
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit), result.exception  # handled, not a crash
    assert "Traceback" not in result.output
    lines = error_lines(result)
    assert len(lines) == 1, lines
    assert lines[0].startswith("Error: ")
    for needle in needles:
        assert needle in lines[0]
    assert result.stdout == ""


def test_generate_json(run, tiny_model_dir):
    result = run(
        "generate", "--model", str(tiny_model_dir), "--decoder", "greedy", "--seed", "4", "-n", "6", "--json", "hi"
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert {"text", "seed", "decoder", "steerers", "timings"} <= set(data)
    assert data["seed"] == 4
    assert data["decoder"]["name"] == "greedy"
    assert data["steerers"] == []
    assert data["max_new_tokens"] == 6
    assert isinstance(data["text"], str) and 1 <= len(data["token_ids"]) <= 6
    assert data["timings"]["new_tokens"] == len(data["token_ids"])
    assert data["interrupted"] is False


def test_generate_is_reproducible_and_takes_steerers(run, tiny_model_dir):
    args = (
        "generate",
        "--model",
        str(tiny_model_dir),
        "--decoder",
        "top-k top_k=50 temperature=0.9",
        "--steer",
        "bow-bias words=pizza,pasta strength=4",
        "--seed",
        "11",
        "-n",
        "8",
        "--json",
        "hello",
        "hi there",
        "what do you like to eat?",
    )
    first, second = run(*args), run(*args)
    assert first.exit_code == 0, first.output
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert a["text"] == b["text"] and a["token_ids"] == b["token_ids"]
    assert a["decoder"]["settings"]["top_k"] == 50 and a["decoder"]["settings"]["temperature"] == 0.9
    assert a["steerers"][0]["name"] == "bow-bias"
    assert a["steerers"][0]["settings"]["words"] == ["pizza", "pasta"]
    assert a["history_turns_used"] == 3


def test_generate_streams_plain_text(run, tiny_model_dir):
    from chatcore.text import display_safe

    plain = run("generate", "--model", str(tiny_model_dir), "--decoder", "greedy", "-n", "6", "hi")
    as_json = run("generate", "--model", str(tiny_model_dir), "--decoder", "greedy", "-n", "6", "--json", "hi")
    assert plain.exit_code == 0, plain.output
    # the same text, its control characters shown (the JSON keeps them as they are)
    assert plain.stdout == display_safe(json.loads(as_json.stdout)["text"]) + "\n"


def test_generate_reads_turns_from_stdin(run, tiny_model_dir):
    result = run(
        "generate",
        "--model",
        str(tiny_model_dir),
        "--decoder",
        "greedy",
        "-n",
        "4",
        "--json",
        "-",
        input="hello\n\nhi there\nhow are you?\n",
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["history_turns_used"] == 3


@pytest.mark.parametrize(
    "decoder_spec, needles",
    [
        ("top-k top_k=0", ["top_k", "got 0"]),
        ("top-k top_k=abc", ["`top_k` must be an integer, got 'abc'"]),
        ("top-k temperature=-1", ["`temperature`", "-1"]),
        ("top-k foo=1", ["unknown setting", "'foo'"]),
        ("top-k top_k", ["expected key=value, got 'top_k'"]),
        ("top-k top_k=5 top-k=6", ["`top-k` is given twice ('5' and '6'): give it once"]),
        ("beam", ["unknown decoder 'beam'", "greedy", "top-k"]),
        ("'unclosed", ["cannot parse"]),
    ],
)
def test_bad_decoders_fail_with_one_clean_line(run, tiny_model_dir, decoder_spec, needles):
    result = run("generate", "--model", str(tiny_model_dir), "--decoder", decoder_spec, "hi")
    assert_clean_failure(result, *needles)


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--steer", "bow-bias"], ["needs words"]),
        (["--steer", "nudge words=x"], ["unknown steerer 'nudge'", "bow-bias"]),
        (["--steer", "bow-bias words=x strength=1e9"], ["`strength`"]),
    ],
)
def test_bad_steerers_fail_with_one_clean_line(run, tiny_model_dir, args, needles):
    result = run("generate", "--model", str(tiny_model_dir), "--decoder", "greedy", *args, "hi")
    assert_clean_failure(result, *needles)


def test_bad_messages_and_models_fail_cleanly(run, tiny_model_dir, tmp_path):
    assert_clean_failure(run("generate", "--model", str(tiny_model_dir), "  "), "empty")
    for seed in ("-5", str(2**64)):  # torch takes a signed 64-bit seed
        assert_clean_failure(
            run("generate", "--model", str(tiny_model_dir), "--seed", seed, "hi"),
            f"`seed` must be an integer from 0 to {2**63 - 1}, got {seed}",
        )
    # A reply budget beyond the context is capped by the room the prompt leaves.
    capped = run("generate", "--model", str(tiny_model_dir), "-n", "200", "--json", "--seed", "1", "hi")
    assert capped.exit_code == 0, capped.output
    provenance = json.loads(capped.output)
    assert provenance["max_new_tokens"] == 128 - provenance["prompt_tokens"]
    assert len(provenance["token_ids"]) <= provenance["max_new_tokens"]
    assert_clean_failure(
        run("generate", "--model", str(tmp_path / "no-such-model"), "hi"), "no-such-model' does not exist"
    )


def test_debug_mode_shows_the_exception(run, tiny_model_dir, monkeypatch):
    from chatcore.errors import OptionError

    monkeypatch.setenv("CHATCORE_DEBUG", "1")
    result = run("generate", "--model", str(tiny_model_dir), "--decoder", "top-k top_k=0", "hi")
    assert result.exit_code != 0
    assert isinstance(result.exception, OptionError)


def test_plugins_json_lists_the_builtins(run):
    result = run("plugins", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    rows = {row["name"]: row for row in data["plugins"]}
    assert {"greedy", "top_k", "bow_bias"} <= set(rows)
    assert rows["greedy"]["decoders"] == ["greedy"]
    assert rows["top_k"]["decoders"] == ["top-k"]
    assert rows["bow_bias"]["steerers"] == ["bow-bias"]
    assert rows["prompt_formats"]["prompt_formats"] == ["chat-template", "dialogpt"]
    for name in ("greedy", "top_k", "bow_bias"):
        assert rows[name]["builtin"] is True and rows[name]["module"] == f"chatcore.plugins.{name}"
    decoders = {d for row in rows.values() for d in row["decoders"]}
    steerers = {s for row in rows.values() for s in row["steerers"]}
    assert {"greedy", "top-k"} <= decoders and "bow-bias" in steerers
    assert [p for p in data["problems"] if p["plugin"] in ("greedy", "top_k", "bow_bias")] == []


def test_plugins_text_listing(run):
    result = run("plugins")
    assert result.exit_code == 0, result.output
    assert "greedy  (built-in; chatcore.plugins.greedy)" in result.stdout
    assert "decoders: top-k" in result.stdout
    assert "steerers: bow-bias" in result.stdout


def test_plugins_name_shows_the_settings_with_their_help(run):
    result = run("plugins", "top-k")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("top-k  (decoder, plugin top_k): samples from the k best tokens")
    row = next(index for index, line in enumerate(lines) if line.split()[:1] == ["top_p"])
    assert lines[row].split() == ["top_p", "number", "(default", "1.0;", ">", "0", "and", "<=", "1)"]
    assert lines[row + 1].strip().startswith("Nucleus sampling")
    assert 'Set them as `--decoder "top-k KEY=VALUE ..."`.' in result.stdout

    # A setting checked against a list only at run time shows the plugin's list.
    topic = next(line for line in run("plugins", "bow-bias").stdout.splitlines() if line.split()[:1] == ["topic"])
    assert "one of " in topic and "food" in topic and "sports" in topic

    listed = run("plugins", "bow-bias", "--json")
    schema = json.loads(listed.stdout)
    assert (schema["id"], schema["object"], schema["plugin"]) == ("bow-bias", "steerer", "bow_bias")
    assert schema["settings"]["properties"]["strength"]["maximum"] == 100

    unknown = run("plugins", "nope")
    assert unknown.exit_code != 0
    assert "unknown decoder or steerer 'nope' (decoders: " in unknown.output and "Traceback" not in unknown.output


def test_help_lists_the_commands(run):
    result = run("--help")
    assert result.exit_code == 0
    for command in ("generate", "plugins", "train"):
        assert command in result.stdout


def test_building_the_cli_imports_neither_torch_nor_transformers():
    code = (
        "import sys; from chatcore.cli import build_cli; build_cli(); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, "
        "sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))"
    )
    env = dict(os.environ, CHATCORE_PLUGINS="")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert completed.returncode == 0, completed.stderr


def test_eval_fails_when_every_context_failed(run, tiny_model_dir):
    # A system prompt that fills the tiny model's 128 positions leaves no room for any context.
    result = run("eval", "--model", str(tiny_model_dir), "--limit", "2", "--system", "word " * 300)
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "every context failed (2), e.g.:" in lines[0], result.stderr
    assert "the system prompt takes" in lines[0]
    fine = run("eval", "--model", str(tiny_model_dir), "--limit", "2", "--system", "be kind", "-n", "4")
    assert fine.exit_code == 0, fine.output


def test_generate_from_stdin_refuses_bytes_that_are_not_utf8(run, tiny_model_dir):
    bad = run("generate", "--model", str(tiny_model_dir), "-", input=b"hi \xff there\n")
    assert_clean_failure(bad, "the input is not UTF-8 text (bad byte at position 3)")
    good = run(
        "generate",
        "--model",
        str(tiny_model_dir),
        "--json",
        "--seed",
        "1",
        "-",
        input=b"hello there\n\nhi! how are you?\nfine, thanks\n",
    )
    assert good.exit_code == 0, good.output
    assert json.loads(good.output)["history_turns_used"] == 3


def test_output_files_in_missing_folders_fail_before_the_work(run, tiny_model_dir, tmp_path):
    missing = tmp_path / "no-such-folder" / "report.json"
    assert_clean_failure(
        run("eval", "--model", "does-not-matter", "--json", str(missing)), "the folder", "does not exist"
    )
    from chatcore.log.location import sqlite_url
    from chatcore.log.store import ConversationStore

    ConversationStore(sqlite_url(tmp_path / "log.sqlite3")).close()
    assert_clean_failure(
        run("logs", "--db", str(tmp_path / "log.sqlite3"), "export", "-o", str(missing)), "the folder", "does not exist"
    )
    assert_clean_failure(run("eval", "--model", str(tiny_model_dir), "--json", str(tmp_path)), "it is a folder")


def test_chat_refuses_an_empty_cid_and_cid_with_continue(run):
    assert_clean_failure(run("chat", "--cid", ""), "`--cid` is empty")
    assert_clean_failure(run("chat", "--cid", "abc", "--continue"), "give --cid ID or --continue, not both")


# -- configurations that cannot reply, refused when they are given -----------------------------
def refused_on_the_command_line():
    from refused_configurations import IMPOSSIBLE_STEERERS, NON_DECODABLE_DECODERS, REPEATED_STEERERS

    for specs, line in IMPOSSIBLE_STEERERS + REPEATED_STEERERS:
        yield [arg for spec in specs for arg in ("--steer", spec)], line
    for spec, line in NON_DECODABLE_DECODERS:
        yield ["--decoder", spec], line


@pytest.mark.parametrize("command", [["generate", "hi"], ["eval", "--limit", "1"], ["chat"], ["discord", "--check"]])
def test_configurations_that_cannot_reply_are_refused_before_anything_starts(run, command, tmp_path):
    # No model is loaded and no log opened: the model does not exist and the log's folder stays empty.
    where = ["--model", str(tmp_path / "no-such-model")]
    if command[0] in ("chat", "discord"):
        where += ["--db", str(tmp_path / "log.sqlite3")]
    for args, line in refused_on_the_command_line():
        result = run(*command, *where, *args)
        assert_clean_failure(result)
        assert error_lines(result) == [f"Error: {line}"]
    assert list(tmp_path.iterdir()) == []


def _bounds_of(model, name):
    """The ge/le bounds of ``model``'s field ``name``, read from the model itself."""
    bounds = {}
    for item in model.model_fields[name].metadata:
        for key in ("ge", "le"):
            if hasattr(item, key):
                bounds[key] = getattr(item, key)
    return bounds


def test_a_generated_option_shows_the_model_default_and_bounds(run):
    from chatcore.training.trainer import TrainConfig

    field = TrainConfig.model_fields["block_size"]
    bounds = _bounds_of(TrainConfig, "block_size")
    result = run("train", "model", "--help")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    shown = f"[default: {field.default}; {bounds['ge']}<=x<={bounds['le']}]"
    assert f"--block-size INTEGER RANGE {shown}" in text, text


def test_a_value_outside_the_model_bounds_is_refused_in_one_line_naming_the_option(run, tmp_path):
    from chatcore.training.trainer import TrainConfig

    bounds = _bounds_of(TrainConfig, "block_size")
    low, high = bounds["ge"], bounds["le"]
    result = run("train", "model", "--out", str(tmp_path / "run"), "--block-size", str(low - 1))
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output and result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert errors == [f"Error: Invalid value for '--block-size': {low - 1} is not in the range {low}<=x<={high}."]
    assert not (tmp_path / "run").exists()


def test_options_from_model_reads_exclusive_bounds_optional_fields_and_flags():
    from typing import Annotated, Literal

    import click
    from click.testing import CliRunner
    from pydantic import Field, PositiveInt

    from chatcore.cli.options import options_from_model
    from chatcore.options import Settings

    class Example(Settings):
        count: PositiveInt = 3
        """How many."""
        share: Annotated[float, Field(ge=0.0, lt=1.0)] | None = None
        mode: Literal["fast", "slow"] = "fast"
        verbose: bool = False

    @click.command()
    @options_from_model(Example, ("count", "share", "mode", "verbose"), {"count": ("-c", "--count")})
    def command(**values):
        click.echo(repr(Example(**values)))

    help_text = " ".join(CliRunner().invoke(command, ["--help"]).output.split())
    assert "-c, --count INTEGER RANGE How many. [default: 3; x>=1]" in help_text
    assert "--share FLOAT RANGE [0.0<=x<1.0]" in help_text
    assert "--mode [fast|slow] [default: fast]" in help_text
    assert "--verbose / --no-verbose [default: no-verbose]" in help_text
    result = CliRunner().invoke(command, ["-c", "5", "--share", "0.5", "--mode", "slow", "--verbose"])
    assert result.output.strip() == "Example(count=5, share=0.5, mode='slow', verbose=True)"
    assert "is not in the range" in CliRunner().invoke(command, ["--share", "1"]).output


@pytest.mark.parametrize(
    "spec, expected",
    [
        ('top-k logit_bias={"28": -100}', ("top-k", {"logit_bias": '{"28": -100}'})),
        (
            'top-k temperature=0.5 logit_bias={"2 8": 5, "3": [1, 2]} top_k=3',
            ("top-k", {"temperature": "0.5", "logit_bias": '{"2 8": 5, "3": [1, 2]}', "top_k": "3"}),
        ),
        ("pplm topic='food and drink' words=[a b]", ("pplm", {"topic": "food and drink", "words": "[a b]"})),
        ("top-k a=b=c", ("top-k", {"a": "b=c"})),
    ],
)
def test_a_spec_keeps_a_json_value_whole_as_typed(spec, expected):
    from chatcore.cli.specs import parse_spec

    assert parse_spec(spec) == expected


def test_a_spec_with_a_json_value_works_on_the_command_line(run, tiny_model_dir):
    """The form the error message shows (`{"a": 1}`), typed in one shell word, is accepted."""
    result = run("generate", "--model", str(tiny_model_dir), "-n", "2", "--decoder", 'top-k logit_bias={"5": 2}', "hi")
    assert result.exit_code == 0, result.output


def test_a_message_argument_that_is_not_utf8_is_refused_in_one_line(run, tiny_model_dir):
    # Python decodes command-line arguments with surrogateescape: byte 0xE9 arrives as U+DCE9.
    result = run("generate", "--model", str(tiny_model_dir), "-n", "2", "caf\udce9 ok")
    assert result.exit_code != 0 and "the message is not UTF-8 text (bad byte at position 3)" in result.output
    assert "Traceback" not in result.output


def test_a_system_prompt_or_persona_that_is_not_utf8_is_refused_not_cut(run, tiny_model_dir, tmp_path, monkeypatch):
    """A Latin-1 "café" would otherwise lose its é for good (a persona keeps it)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    says = "the system prompt is not UTF-8 text (bad byte at position 3)"
    assert_clean_failure(run("generate", "--model", str(tiny_model_dir), "--system", "caf\udce9 ok", "hi"), says)
    assert_clean_failure(run("personas", "add", "latin", "caf\udce9 ok"), says)
    assert "latin" not in run("personas").output


def test_eval_takes_the_sampling_options_the_other_commands_take(run, tiny_model_dir, tmp_path):
    common = ("eval", "--model", str(tiny_model_dir), "--limit", "2", "--samples", "0", "-n", "4", "--dtype", "float32")
    shortcut = run(*common, "--temperature", "0.5", "--top-p", "0.9", "--json", str(tmp_path / "a.json"))
    spelled = run(*common, "--decoder", "top-k temperature=0.5 top_p=0.9", "--json", str(tmp_path / "b.json"))
    assert shortcut.exit_code == 0 and spelled.exit_code == 0, shortcut.output + spelled.output
    replies = [[s["reply"] for s in json.loads((tmp_path / f"{n}.json").read_text())["samples"]] for n in "ab"]
    assert replies[0] == replies[1] and len(replies[0]) == 2
    both = run(*common, "--temperature", "0.5", "--decoder", "top-k temperature=0.3")
    assert both.exit_code != 0 and "both given" in both.output


def test_a_plugin_failing_mid_reply_ends_generate_with_one_line_after_the_partial_reply(tiny_model_dir):
    """The partial reply stays on standard output on a line of its own; standard error has the
    one error line naming the plugin (not the warning a long-running process gives besides)."""
    from serving_steerers import ServingTestPlugin

    from chatcore import plugin_manager

    host = plugin_manager.PluginHost()
    host.load_entry_points()
    host.register(ServingTestPlugin(), "test-serving")
    plugin_manager.set_plugin_host(host)
    result = CliRunner().invoke(
        build_cli(),
        [
            "generate",
            "--model",
            str(tiny_model_dir),
            "--decoder",
            "greedy",
            "--steer",
            "failing-shared at_step=3",
            "hi",
        ],
    )
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stdout.endswith("\n") and result.stdout.strip()
    assert error_lines(result) == [
        "Error: plugin 'test-serving': steerer 'failing-shared' failed while generating: RuntimeError: boom"
    ]


def test_a_hook_failing_in_generate_is_said_and_the_reply_stands(tiny_model_dir, caplog):
    """An ``on_response`` that raises ends nothing: the reply is printed, and the failure is
    said (a decoder's or steerer's failure is said once, by the command's error line)."""
    import logging

    import chatcore
    from chatcore import plugin_manager

    class Listener:
        @chatcore.hookimpl
        def on_response(self, conversation, response):
            raise RuntimeError("on_response boom")

    host = plugin_manager.PluginHost()
    host.load_entry_points()
    host.register(Listener(), "listener")
    plugin_manager.set_plugin_host(host)
    with caplog.at_level(logging.WARNING, logger="chatcore.plugins"):
        result = CliRunner().invoke(build_cli(), ["generate", "--model", str(tiny_model_dir), "-n", "4", "hi"])
    assert result.exit_code == 0 and result.stdout.strip() and "Traceback" not in result.output
    said = [record.getMessage() for record in caplog.records if record.name == "chatcore.plugins"]
    assert said == ["plugin 'listener' failed at hook on_response: RuntimeError: on_response boom"]


def test_a_line_logged_while_a_reply_streams_is_said_after_the_reply_s_line():
    """What a hook logs as the reply ends waits for the reply's newline (one terminal, one
    stream here), and goes to the handlers there were."""
    import io
    import logging

    from chatcore.cli.generate import log_lines_held

    terminal = io.StringIO()
    handler = logging.StreamHandler(terminal)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with log_lines_held():
            terminal.write("Hello!")
            logging.getLogger("chatcore.plugins").warning("plugin 'p' failed at hook on_response")
            terminal.write("\n")
        assert handler in root.handlers
    finally:
        root.removeHandler(handler)
    assert terminal.getvalue() == "Hello!\nplugin 'p' failed at hook on_response\n"


def test_generate_continue_writes_what_an_ended_chat_journaled_before_it_reads(
    run, tiny_model_dir, engine, tmp_path, monkeypatch
):
    """A chat whose log was locked ends with its turns in the journal; `generate --continue` then
    writes them before it reads the conversation, and goes on in that one conversation."""
    import sqlite3

    from chatcore.log import ConversationLogPlugin
    from chatcore.log.location import sqlite_url
    from chatcore.log.store import ConversationStore

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))  # the journal's folder is in it
    path = tmp_path / "log.sqlite3"
    url = sqlite_url(path)
    store = ConversationStore(url, timeout_s=0.05)
    plugin = ConversationLogPlugin(store, notify=lambda message: None, retry_after_s=0.0)
    assert engine.host.register(plugin, "conversation-log")
    conversation = engine.conversation(adapter="repl")
    engine.send(conversation, "one", decoder="greedy", max_new_tokens=2).text()
    locker = sqlite3.connect(path, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")  # another process holding the write lock
    engine.send(conversation, "two", decoder="greedy", max_new_tokens=2).text()
    assert plugin.close() == 2  # the chat ends: its turns wait in the journal
    locker.rollback()
    locker.close()
    engine.host.unregister("conversation-log")
    store.close()

    result = run("generate", "-m", str(tiny_model_dir), "-d", "greedy", "-n", "2", "--db", url, "--continue", "three")
    assert result.exit_code == 0, result.output
    assert "another chat" not in result.output
    with ConversationStore(url, create=False) as reader:
        assert [summary.id for summary in reader.list_conversations()] == [conversation.id]
        messages = reader.get_conversation(conversation.id).messages
        assert [m.text for m in messages if m.role == "user"] == ["one", "two", "three"]
    assert list((tmp_path / "data" / "chatcore" / "log-journal").glob("*.jsonl")) == []


def test_serve_and_chat_refuse_a_log_they_cannot_open_in_one_line_naming_the_remedy(run, tmp_path):
    missing = tmp_path / "no" / "such"
    damaged = tmp_path / "cut.sqlite3"
    damaged.write_bytes(b"SQLite format 3\x00" + b"\x10\x00\x02\x02" + b"\x00" * 1980)  # a header, then nothing
    salvage = f"`chatcore logs export --salvage --db {damaged} -o saved.jsonl` recovers what it holds"
    no_model = str(tmp_path / "no-model")  # the log is opened first; were it opened, the model would fail at once
    for command in (("serve", "--port", "0", "-m", no_model), ("chat", "--continue", "-m", no_model)):
        assert_clean_failure(run(*command, "--db", str(missing / "log.sqlite3")), f"no folder {missing} ")
        assert_clean_failure(run(*command, "--db", str(damaged)), "cannot open: ", salvage)
    assert not (tmp_path / "no").exists()


def test_generate_shows_control_characters_of_a_reply_instead_of_sending_them(run, tiny_model_dir):
    """A reply made of ESC characters (its token forced by logit_bias) is printed as ``\\x1b``,
    as the chat and ``logs show`` print it: a reply cannot drive the terminal."""
    import json

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    escape = next(i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\x1b")
    bias = json.dumps({str(escape): 100})
    result = run("generate", "--model", str(tiny_model_dir), "-n", "3", "--decoder", f"greedy logit_bias={bias}", "hi")
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.stdout and result.stdout.strip() == "\\x1b" * 3


def test_generate_names_the_plugins_that_failed_to_load(tiny_model_dir):
    """A plugin that failed to load takes its decoders and steerers with it: ``generate`` says
    so in one line on standard error, as the chat does, and replies."""
    from chatcore import plugin_manager

    host = plugin_manager.PluginHost()
    host.load_entry_points()
    host.load_modules(("chatcore.plugins.does_not_exist",))
    plugin_manager.set_plugin_host(host)
    result = CliRunner().invoke(build_cli(), ["generate", "--model", str(tiny_model_dir), "-n", "3", "hi"])
    assert result.exit_code == 0 and result.stdout.strip()
    assert error_lines(result)[0] == (
        "note: 1 plugin had problems (chatcore.plugins.does_not_exist): `chatcore plugins` says what"
    )


def test_serve_names_the_plugins_that_failed_to_load_before_it_serves(tiny_model_dir, monkeypatch):
    """The operator hears of a plugin that failed to load when the server starts, not from a
    client told that a name is unknown."""
    from chatcore import plugin_manager
    from chatcore.adapters.http_api import server

    class Served:
        def run(self, sockets):
            click.echo("chatcore: the server ran", err=True)

    monkeypatch.setattr(server, "make_server", lambda app, grace: Served())
    host = plugin_manager.PluginHost()
    host.load_entry_points()
    host.load_modules(("chatcore.plugins.does_not_exist",))
    plugin_manager.set_plugin_host(host)
    result = CliRunner().invoke(build_cli(), ["serve", "--port", "0", "--no-warm-up", "--model", str(tiny_model_dir)])
    assert result.exit_code == 0, result.output
    lines = error_lines(result)
    note = "chatcore: note: 1 plugin had problems (chatcore.plugins.does_not_exist): `chatcore plugins` says what"
    assert note in lines and lines.index(note) < lines.index("chatcore: the server ran"), lines


# -- what plugins add to the command line: prompt sets and commands ---------------------------
def plugin_host_with(plugin, name):
    """The process-wide host: chatcore's own plugins and ``plugin``, registered as ``name``."""
    from chatcore import plugin_manager

    host = plugin_manager.PluginHost()
    host.load_entry_points()
    assert host.register(plugin, name)
    plugin_manager.set_plugin_host(host)
    return host


class BadPromptSets:
    @chatcore.hookimpl
    def register_prompt_sets(self, register):
        register("raising-set", lambda: 1 / 0)
        register("wrongtype-set", lambda: [1, 2, 3])
        register("notalist-set", lambda: "hi there")
        register("empty-set", lambda: [])


@pytest.mark.parametrize(
    "prompt_set, needle",
    [
        ("raising-set", "prompt set 'raising-set' failed to load: ZeroDivisionError"),
        ("wrongtype-set", "prompt set 'wrongtype-set': item 0 is not an EvalContext"),
        ("notalist-set", "prompt set 'notalist-set': expected a list of EvalContext"),
        ("empty-set", "prompt set 'empty-set' holds no contexts"),
    ],
)
def test_a_plugins_prompt_set_that_fails_is_one_line_naming_the_plugin(tmp_path, prompt_set, needle):
    plugin_host_with(BadPromptSets(), "bad-sets")
    # Refused before the model loads: the model does not exist.
    result = CliRunner().invoke(
        build_cli(), ["eval", "--model", str(tmp_path / "no-such-model"), "--prompts", prompt_set, "--limit", "2"]
    )
    assert_clean_failure(result, "plugin 'bad-sets'", needle)


@pytest.mark.parametrize(
    "record, needle",
    [
        ('{"turns": ["hi"], "reference": 5}', "got 5"),
        ('{"turns": ["hi"], "reference": ""}', "got ''"),
        ('{"turns": ["hi"], "reference": "  "}', "or left out"),
    ],
)
def test_a_prompt_files_reference_must_be_text_before_the_model_loads(run, tmp_path, record, needle):
    prompts = tmp_path / "badref.jsonl"
    prompts.write_text(record + "\n")
    result = run("eval", "--model", str(tmp_path / "no-such-model"), "--prompts", str(prompts), "-n", "8")
    assert_clean_failure(result, f"{prompts}:1:", '"reference" must be', needle)


@pytest.mark.parametrize(
    "name, line, needle",
    [
        ("long.jsonl", '{"turns": ["' + "a" * 9000 + '"]}', ":1: the turn: the message is 9,000 characters long"),
        ("blank.jsonl", '{"turns": ["hi", " \\u0007 "]}', ":1: turn 2: the message is empty"),
        ("long.txt", "b" * 9000, ":1: the line: the message is 9,000 characters long"),
    ],
)
def test_a_prompt_files_turns_are_checked_as_messages_before_the_model_loads(run, tmp_path, name, line, needle):
    prompts = tmp_path / name
    prompts.write_text(line + "\n")
    result = run("eval", "--model", str(tmp_path / "no-such-model"), "--prompts", str(prompts), "-n", "8")
    assert_clean_failure(result, f"{prompts}{needle}")


@pytest.mark.parametrize("seed", ["-5", str(2**63 - 1)])
def test_eval_refuses_a_seed_out_of_range_before_the_model_loads(run, tmp_path, seed):
    # The second: context 1 would take seed + 1, past the largest seed.
    result = run(
        "eval", "--model", str(tmp_path / "no-such-model"), "--prompts", "openers", "--limit", "2", "--seed", seed
    )
    assert_clean_failure(result, "--seed", seed)


def test_eval_json_dash_writes_the_report_to_standard_output(run, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\n")
    result = run("eval", "--model", str(tiny_model_dir), "--prompts", str(prompts), "-n", "3", "--json", "-")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["settings"]["contexts"] == 1
    assert "dist-1" in result.stderr and not (tmp_path / "-").exists()
    assert "standard output" in run("eval", "--help").output


def add_reads_command(group: click.Group) -> None:
    """A ``reads`` command whose option fails as it is read (a ValueError in its callback)."""

    def bad_level(ctx: click.Context, param: click.Parameter, value: str) -> str:
        raise ValueError(f"no level {value!r}")

    @group.command("reads")
    @click.option("--level", callback=bad_level, default="x")
    def reads(level: str) -> None:
        click.echo(level)


class Commands:
    @chatcore.hookimpl
    def register_commands(self, cli):
        @cli.command("boom")
        def boom() -> None:
            raise RuntimeError("it went off")

        @cli.command("quits")
        def quits() -> None:
            raise click.exceptions.Exit(3)

        @cli.command("refuses")
        def refuses() -> None:
            raise click.ClickException("not today")

        add_reads_command(cli)

        @cli.command("generate")
        def generate() -> None:
            click.echo("the plugin's generate")

        @cli.command("chat")
        def chat() -> None:
            click.echo("the plugin's chat")


def test_a_plugin_command_that_raises_is_one_line_naming_the_plugin(monkeypatch):
    plugin_host_with(Commands(), "commands-test")
    result = CliRunner().invoke(build_cli(), ["boom"])
    assert_clean_failure(result, "'boom'", "plugin 'commands-test'", "RuntimeError: it went off")
    monkeypatch.setenv("CHATCORE_DEBUG", "1")
    assert isinstance(CliRunner().invoke(build_cli(), ["boom"]).exception, RuntimeError)


def test_a_plugin_command_that_fails_reading_its_arguments_is_one_line_naming_the_plugin():
    plugin_host_with(Commands(), "commands-test")
    result = CliRunner().invoke(build_cli(), ["reads"])
    assert_clean_failure(result, "'reads'", "plugin 'commands-test'", "ValueError: no level 'x'")


def test_click_ends_a_plugin_command_as_click_does():
    plugin_host_with(Commands(), "commands-test")
    assert CliRunner().invoke(build_cli(), ["quits"]).exit_code == 3
    assert_clean_failure(CliRunner().invoke(build_cli(), ["refuses"]), "Error: not today")


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_plugin_cannot_take_a_built_in_commands_name(command):
    host = plugin_host_with(Commands(), "commands-test")
    group = build_cli()
    result = CliRunner().invoke(group, [command, "--help"])
    assert result.exit_code == 0 and "the plugin's" not in result.output
    problems = [str(p) for p in host.problems if p.plugin == "commands-test"]
    assert f"plugin 'commands-test' failed at hook register_commands: command {command!r} is a built-in command" in (
        "\n".join(problems)
    )
    assert "boom" in group.commands  # the plugin's other commands are added


class NestedCommands:
    @chatcore.hookimpl
    def register_commands(self, cli):
        train = cli.commands["train"]

        @train.command("boom")
        def boom() -> None:
            raise RuntimeError("it went off")

        @train.command("model")
        def model() -> None:
            click.echo("the plugin's train model")

        @train.group("extra")
        def extra() -> None:
            pass

        @extra.command("deep")
        def deep() -> None:
            raise ValueError("deeper")

        add_reads_command(train)


@pytest.fixture
def cli_built_again():
    """chatcore's groups without the test's plugin's commands afterwards (they are module-wide)."""
    from chatcore import plugin_manager

    yield
    plugin_manager.set_plugin_host(None)
    build_cli()
    assert "boom" not in build_cli().commands["train"].commands


def test_a_plugin_command_inside_a_built_in_group_fails_in_one_line_and_takes_no_name(monkeypatch, cli_built_again):
    host = plugin_host_with(NestedCommands(), "nested-test")
    for _ in range(2):  # a group built again settles the same way
        group = build_cli()
    assert_clean_failure(
        CliRunner().invoke(group, ["train", "boom"]),
        "'train boom'",
        "plugin 'nested-test'",
        "RuntimeError: it went off",
    )
    assert_clean_failure(CliRunner().invoke(group, ["train", "extra", "deep"]), "'train extra'", "ValueError: deeper")
    assert_clean_failure(CliRunner().invoke(group, ["train", "reads"]), "'train reads'", "ValueError: no level 'x'")
    taken = CliRunner().invoke(group, ["train", "model", "--help"])
    assert taken.exit_code == 0 and "the plugin's" not in taken.output and "--corpus" in taken.output
    problems = "\n".join(str(p) for p in host.problems if p.plugin == "nested-test")
    assert "command 'train model' is a built-in command" in problems and "boom" not in problems
    monkeypatch.setenv("CHATCORE_DEBUG", "1")
    assert isinstance(CliRunner().invoke(group, ["train", "boom"]).exception, RuntimeError)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_output_or_a_folder_that_cannot_be_made_is_one_line(tmp_path):
    """Errors of the system that no command turns into its own line: an output that cannot
    be written (``> /dev/full``), a data folder under a file."""
    home_file = tmp_path / "home"
    home_file.write_text("not a folder\n")
    environment = {**os.environ, "CHATCORE_PLUGINS": "", "HOME": str(home_file)}
    environment.pop("XDG_DATA_HOME", None)
    command = [sys.executable, "-m", "chatcore.cli"]
    with open("/dev/full", "w") as full:
        written = subprocess.run([*command, "plugins"], stdout=full, stderr=subprocess.PIPE, env=environment)
    assert written.returncode == 1
    assert written.stderr.decode().splitlines() == ["Error: cannot write the output: No space left on device"]
    made = subprocess.run([*command, "personas", "add", "x", "hi"], capture_output=True, env=environment)
    assert made.returncode == 1 and made.stdout == b""
    assert made.stderr.decode().splitlines() == [f"Error: Not a directory: {home_file}/.local"]
