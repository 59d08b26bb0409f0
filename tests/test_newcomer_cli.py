"""What a newcomer meets first: the default model, the sampling shortcuts, /max and /set, the
budget mark, personas and continuing a logged conversation from ``generate`` (tiny model)."""

from __future__ import annotations

import io
import json
import os
import stat

import click
import pytest
from click.testing import CliRunner

from chatcore.cli import build_cli
from chatcore.engine import ReplyOptions
from chatcore.explain import explain
from chatcore.log import ConversationLogPlugin
from chatcore.log.location import sqlite_url
from chatcore.log.store import ConversationStore


@pytest.fixture
def run():
    runner = CliRunner()

    def invoke(*args, input=None):
        return runner.invoke(build_cli(), list(args), input=input, catch_exceptions=True)

    return invoke


def one_line_failure(result, *needles):
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.fixture
def data_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    return tmp_path / "data" / "chatcore"


# -- the default model -----------------------------------------------------------------------
def test_the_commands_default_to_smollm2_where_installed_and_the_tests_to_the_tiny_model(monkeypatch):
    from chatcore import models

    # The suite pins the tiny model, so that no test switches to SmolLM2 (slow) by leaving --model out.
    assert models.default_model_name() == "chatcore-tiny"
    generate = build_cli().commands["generate"]
    (model,) = [p for p in generate.params if p.name == "model"]
    assert model.get_default(click.Context(generate)) == "chatcore-tiny"

    monkeypatch.delenv(models.MODEL_ENV)
    installed = models.known_model_installed("smollm2")
    assert models.default_model_name() == ("smollm2" if installed else "chatcore-tiny")
    missing = models.KnownModel(package="chatcore_no_such_package", filename="x.gguf", install="-")
    monkeypatch.setitem(models.KNOWN_MODELS, "smollm2", missing)
    assert models.default_model_name() == "chatcore-tiny"
    monkeypatch.setenv(models.MODEL_ENV, "/some/model")
    assert models.default_model_name() == "/some/model"


# -- shortcuts -----------------------------------------------------------------------------------
def test_sampling_shortcuts_set_the_decoders_settings(run, tiny_model_dir):
    result = run(
        "generate", "-m", str(tiny_model_dir), "--temperature", "0.3", "--top-p", "0.8", "--max-tokens", "3",
        "--seed", "1", "--json", "hi",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["decoder"]["settings"]["temperature"], data["decoder"]["settings"]["top_p"]) == (0.3, 0.8)
    assert data["max_new_tokens"] == 3 and len(data["token_ids"]) <= 3


def test_temperature_0_is_greedy_decoding_as_over_http(run, tiny_model_dir):
    replies = [
        run("generate", "-m", str(tiny_model_dir), *args, "--max-tokens", "6", "--json", "hi") for args in (
            ("--temperature", "0"), ("-d", "greedy"))
    ]  # fmt: skip
    assert all(result.exit_code == 0 for result in replies), [result.output for result in replies]
    zero, greedy = (json.loads(result.stdout) for result in replies)
    assert zero["decoder"]["name"] == "greedy" and zero["token_ids"] == greedy["token_ids"]


@pytest.mark.parametrize(
    "args, needles",
    [
        (("-d", "greedy", "--temperature", "0.5"), ("--temperature: decoder 'greedy' has no setting 'temperature'",)),
        (("-d", "top-k top_p=0.5", "--top-p", "0.9"), ("--top-p and the decoder's top_p=0.5 both given",)),
        (("--temperature", "-1"), ("`temperature` must be",)),
        (("--temperature", "0", "--top-p", "0.9"), ("--temperature 0 is greedy decoding, which takes no --top-p",)),
        (("-d", "top-k", "top_k=2"), ("reads like a setting", '--decoder "top-k top_k=2"')),
    ],
)
def test_shortcuts_and_unquoted_specs_are_refused_in_one_line(run, tiny_model_dir, args, needles):
    one_line_failure(run("generate", "-m", str(tiny_model_dir), *args, "hi"), *needles)


def test_an_unquoted_spec_on_chat_gets_a_hint(run):
    result = run("chat", "--decoder", "rank", "topic=sports")
    assert result.exit_code == 2 and "Traceback" not in result.output
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert "unexpected extra argument (topic=sports)" in error and '--decoder "rank topic=sports"' in error


# -- the budget mark -------------------------------------------------------------------------------
def test_a_reply_cut_by_its_budget_is_marked_in_the_chat_why_history_and_log(serving_engine, gate, tmp_path, data_home):
    from chatcore.adapters.repl.slash_commands import handle_line
    from chatcore.adapters.repl.state import ChatState
    from chatcore.adapters.repl.terminal import run_loop

    gate.text = "one two three four five six seven"
    store = ConversationStore(sqlite_url(tmp_path / "log.sqlite3"))
    chat = ChatState(serving_engine, ReplyOptions(decoder="gated-text", max_new_tokens=3), store=store)
    chat.attach_log(store)
    lines = ["tell me a story", "/max 60", "go on"]
    gate.release.set()  # the second reply is said whole, then ends at its stop token

    def read_line() -> str:
        if lines:
            return lines.pop(0)
        raise EOFError

    out = io.StringIO()
    run_loop(chat, read_line, out)
    shown = out.getvalue().splitlines()
    assert shown[0].startswith("bot> one") and shown[0].endswith(" [cut at 3 tokens: /max to raise]")
    assert shown[1] == "max new tokens: 60 from the next reply on"
    assert shown[2] == "bot> one two three four five six seven"  # ended by the model: no mark
    first_reply = chat.current.turns[1]
    assert first_reply.meta["provenance"]["finish_reason"] == "length"
    assert "cut by its budget: the reply used all of its max_new_tokens (3)" in "\n".join(
        explain(first_reply.meta["provenance"])
    )
    history = handle_line(chat, "/history").output.splitlines()
    assert history[1].endswith("[cut at 3 tokens]") and not history[3].endswith("]")
    assert "cut by its budget" not in handle_line(chat, "/why").output
    chat.log_plugin.close()
    logged = [m for m in store.get_conversation(chat.current.id).messages if m.role == "bot"]
    assert [m.provenance["finish_reason"] for m in logged] == ["length", "stop"]
    store.close()


def test_generate_flags_a_reply_cut_by_its_budget(run, tiny_model_dir):
    result = run("generate", "-m", str(tiny_model_dir), "-d", "greedy", "-n", "1", "--json", "hi")
    data = json.loads(result.stdout)  # a stop token cannot come first: one token is always the whole budget
    assert (data["cut_by_budget"], data["finish_reason"]) == (True, "length")
    plain = run("generate", "-m", str(tiny_model_dir), "-d", "greedy", "-n", "1", "hi")
    assert plain.stderr == "[cut at 1 token: -n/--max-tokens raises the budget]\n" and "[cut" not in plain.stdout


@pytest.mark.slow  # starts a server (about 3.5 s)
def test_the_server_takes_its_default_budget_and_says_length(serving_engine, gate):
    import openai

    from chatcore.adapters.http_api.app import ServeConfig, build_app
    from chatcore.adapters.http_api.server import start_in_thread
    from chatcore.serving import Scheduler

    gate.text = "one two three four five six seven"
    scheduler = Scheduler(serving_engine, max_batch=1, max_waiting=1)
    server = start_in_thread(build_app(scheduler, ServeConfig(max_new_tokens=3)))
    try:
        client = openai.OpenAI(base_url=server.url, api_key="-", max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "tell me a story"}],
            extra_body={"decoder": "gated-text"},
        )
    finally:
        server.stop()
        scheduler.close()
    assert (reply.choices[0].finish_reason, reply.usage.completion_tokens) == ("length", 3)


# -- /max, /set and /settings ----------------------------------------------------------------------
def test_max_and_set_change_the_budget_and_decoder_settings_with_one_line_errors(engine):
    from chatcore.adapters.repl.slash_commands import handle_line
    from chatcore.adapters.repl.state import ChatState

    chat = ChatState(engine, ReplyOptions(decoder="top-k", max_new_tokens=4))
    engine.sampling_defaults = {"temperature": 0.2, "top_p": 0.9}  # as SmolLM2's known settings
    assert handle_line(chat, "/max").output == "max new tokens: 4 (/max N changes it)"
    assert handle_line(chat, "/max 9").output == "max new tokens: 9 from the next reply on"
    assert chat.options.max_new_tokens == 9
    for bad in ("/max 0", "/max lots", "/max 5000"):
        outcome = handle_line(chat, bad)
        assert outcome.error and "\n" not in outcome.output and "`/max` takes a number of tokens" in outcome.output
    assert chat.options.max_new_tokens == 9
    settings = handle_line(chat, "/settings").output
    assert "temperature=0.2" in settings and "model defaults: temperature=0.2 top_p=0.9" in settings
    assert "max new tokens: 9" in settings

    assert "temperature=0.7" in handle_line(chat, "/set temperature=0.7 top_k=5").output
    assert chat.options.decoder_settings == {"temperature": "0.7", "top_k": "5"}
    for bad, needle in (
        ("/set temperature=-1", "`temperature` must be"),
        ("/set bogus=1", "unknown setting"),
        ("/set temperature", "expected key=value"),
    ):
        outcome = handle_line(chat, bad)
        assert outcome.error and "\n" not in outcome.output and needle in outcome.output, outcome.output
    assert chat.options.decoder_settings == {"temperature": "0.7", "top_k": "5"}  # errors change nothing
    assert "top_p=0.9" in handle_line(chat, "/settings").output  # the model's default where not set
    from chatcore.adapters.repl.completion import completions

    assert [s.text for s in completions(chat, "/set top_k=5 temp")] == ["temperature="]  # the decoder's keys
    reply = handle_line(chat, "hello there").reply
    reply.text()
    assert reply.provenance["max_new_tokens"] == 9 and reply.provenance["decoder"]["settings"]["temperature"] == 0.7


def test_the_banner_names_the_model_and_how_to_pick_another(engine):
    from chatcore.adapters.repl.app import banner
    from chatcore.adapters.repl.state import ChatState

    first = banner(ChatState(engine, ReplyOptions())).splitlines()[0]
    assert first.startswith(f"chatcore chat with {engine.loaded.name} ") and "--model NAME" in first


def test_plugins_shows_the_models_recommended_sampling(run):
    shown = run("plugins", "top-k").stdout
    assert "models' recommended sampling" in shown and "smollm2: temperature=0.2 top_p=0.9" in shown
    assert "models' recommended sampling" not in run("plugins", "greedy").stdout


def test_eval_names_the_topics_when_the_attribute_is_neither_a_topic_nor_a_file(run, tiny_model_dir):
    line = one_line_failure(run("eval", "-m", str(tiny_model_dir), "--attribute", "nosuch", "--limit", "1"))
    assert line.startswith("Error: --attribute: no topic or word file 'nosuch' (topics: ") and "food" in line


# -- personas --------------------------------------------------------------------------------------
def test_personas_are_saved_listed_used_and_removed(run, tiny_model_dir, data_home):
    assert "no personas yet" in run("personas").stdout
    assert run("personas", "add", "pirate", "You are a pirate.").stdout.startswith("saved persona 'pirate' in ")
    kept = run("personas", "add", "pirate", "You are a pirate.  Say arr.")
    assert kept.exit_code == 1 and kept.stderr.strip() == (
        "Error: persona 'pirate' exists: give --force to replace it (`chatcore personas show pirate` prints it)"
    )
    assert (data_home / "personas" / "pirate.txt").read_text() == "You are a pirate.\n"
    again = run("personas", "add", "pirate", "You are a pirate.  Say arr.", "--force")
    assert again.exit_code == 0 and again.stdout.startswith("replaced persona 'pirate' in ")  # said, not silent
    assert (data_home / "personas" / "pirate.txt").read_text() == "You are a pirate. Say arr.\n"
    assert run("personas").stdout == "pirate  You are a pirate. Say arr.\n"
    (data_home / "personas" / "broken.txt").write_bytes(b"\xff\xfe\x00")
    assert run("personas").stdout.splitlines()[0].startswith("broken  (cannot be used: system prompt file")
    (data_home / "personas" / "broken.txt").unlink()
    assert run("personas", "show", "pirate").stdout == "You are a pirate. Say arr.\n"
    result = run("generate", "-m", str(tiny_model_dir), "--persona", "pirate", "-n", "2", "--json", "hi")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["system"] == "You are a pirate. Say arr."
    one_line_failure(run("generate", "--persona", "ninja", "hi"), "no persona 'ninja' (saved: pirate)")
    one_line_failure(run("chat", "--persona", "pirate", "--system", "x"), "give --persona, --system")
    one_line_failure(run("personas", "add", "../evil", "x"), "persona name '../evil' must be")
    one_line_failure(run("personas", "add", "blank", "   "), "the text is empty")
    assert run("personas", "rm", "pirate").exit_code == 0 and run("personas").stdout.startswith("no personas yet")
    one_line_failure(run("personas", "rm", "pirate"), "no persona 'pirate'")


def test_the_personas_folder_is_private_whatever_the_umask(run, data_home):
    old_umask = os.umask(0o022)  # the usual umask, which made the folder 0755
    try:
        assert run("personas", "add", "pirate", "You are a pirate.").exit_code == 0
    finally:
        os.umask(old_umask)
    folder = data_home / "personas"
    modes = {path: stat.S_IMODE(path.stat().st_mode) for path in (data_home, folder, folder / "pirate.txt")}
    assert modes == {data_home: 0o700, folder: 0o700, folder / "pirate.txt": 0o600}


def test_a_personas_folder_an_older_version_left_open_is_made_private_when_opened(run, data_home):
    """Older versions made the data folder and personas/ 0755: every persona's name listed to other
    users. Opening them (here: listing) makes them 0700; the personas in them are as they were."""
    folder = data_home / "personas"
    folder.mkdir(parents=True)
    (folder / "pirate.txt").write_text("You are a pirate.\n", encoding="utf-8")
    for made in (data_home, folder):
        made.chmod(0o755)
    assert run("personas").stdout == "pirate  You are a pirate.\n"
    assert {path: stat.S_IMODE(path.stat().st_mode) for path in (data_home, folder)} == {
        data_home: 0o700,
        folder: 0o700,
    }


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="making another user's folder needs root")
def test_a_personas_folder_of_another_user_is_left_as_it_is(run, data_home):
    folder = data_home / "personas"
    folder.mkdir(parents=True)
    data_home.chmod(0o755)
    folder.chmod(0o755)
    os.chown(folder, 65534, 65534)  # nobody's
    assert "no personas yet" in run("personas").stdout
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755 and stat.S_IMODE(data_home.stat().st_mode) == 0o700


# -- generate --continue / --cid -----------------------------------------------------------------
def test_generate_continues_the_latest_or_a_given_logged_conversation(run, tiny_model_dir, engine, tmp_path, data_home):
    url = sqlite_url(tmp_path / "log.sqlite3")
    store = ConversationStore(url)
    plugin = ConversationLogPlugin(store)
    engine.host.register(plugin, "conversation-log")
    older = engine.conversation(adapter="repl")
    engine.send(older, "an older chat", decoder="greedy", max_new_tokens=2).text()
    latest = engine.conversation(adapter="repl", system="Be brief.")
    engine.send(latest, "hello there", decoder="greedy", max_new_tokens=2).text()
    plugin.close()
    engine.host.unregister("conversation-log")

    base = ("generate", "-m", str(tiny_model_dir), "-d", "greedy", "-n", "2", "--db", url, "--json")
    result = run(*base, "--continue", "and then?")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["history_turns_used"] == 3 and data["system"] == "Be brief."  # its history is the context
    result = run(*base, "--cid", older.id[:8], "more")
    assert result.exit_code == 0, result.output
    roles = {c: [(m.role, m.text) for m in store.get_conversation(c).messages] for c in (older.id, latest.id)}
    assert [r for r, _ in roles[latest.id]] == ["user", "bot", "user", "bot"] and roles[latest.id][2][1] == "and then?"
    assert [r for r, _ in roles[older.id]] == ["user", "bot", "user", "bot"] and roles[older.id][2][1] == "more"
    store.close()

    one_line_failure(run(*base, "--cid", "nope", "x"), "no conversation 'nope'")
    one_line_failure(run(*base, "--continue", "two", "turns"), "take one message")
    one_line_failure(run(*base, "--continue", "--cid", older.id, "x"), "not both")
    empty = sqlite_url(tmp_path / "empty.sqlite3")
    one_line_failure(run("generate", "--db", empty, "--continue", "x"), "no logged conversation to continue")


@pytest.mark.parametrize(
    "command",
    [
        ["train", "model", "--corpus", "chitchat", "--epochs", "0.01", "--out", "{file}/sub"],
        ["train", "tokenizer", "--corpus", "chitchat", "--vocab-size", "300", "--no-filter", "--out", "{file}/sub"],
        ["train", "vector", "--model", "chatcore-tiny", "--pairs", "food", "--out", "{file}/v"],
        ["train", "discriminator", "--model", "chatcore-tiny", "--data", "{labels}", "--out", "{file}/h.safetensors"],
        ["train", "cocon", "--model", "chatcore-tiny", "--steps", "1", "--out", "{file}/sub"],
        ["train", "filter", "--corpus", "chitchat", "--out", "{file}/kept.jsonl"],
    ],
    ids=lambda command: command[1],
)
def test_a_training_output_that_cannot_be_written_is_refused_in_one_line_before_any_work(
    run, tmp_path, monkeypatch, command
):
    import chatcore.api
    import chatcore.models

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(chatcore.models, "load_model", no_model)
    monkeypatch.setattr(chatcore.api, "load_model", no_model)
    in_the_way = tmp_path / "afile"
    in_the_way.write_text("a file where a folder should be")
    labels = tmp_path / "labels.tsv"
    labels.write_text("good\tI love it\nbad\tI hate it\n")
    args = [part.format(file=in_the_way, labels=labels) for part in command]
    error = one_line_failure(run(*args), "--out", str(in_the_way))
    assert "not a folder" in error or "Not a directory" in error, error


@pytest.mark.parametrize("command", ["model", "cocon"])
def test_a_training_run_is_not_overwritten_without_resume(run, tmp_path, command):
    out = tmp_path / "run"
    kept = out / ("best" if command == "model" else "block")
    kept.mkdir(parents=True)
    (kept / "config.json").write_text("{}")
    args = ["train", command, "--out", str(out)]
    args += ["--corpus", "chitchat", "--epochs", "0.01"] if command == "model" else ["--model", "chatcore-tiny"]
    one_line_failure(run(*args), "already holds a training run", "--resume")
    assert (kept / "config.json").read_text() == "{}"


def test_settings_show_a_mapping_as_the_json_that_set_takes_back():
    from chatcore.explain import format_settings

    shown = format_settings({"top_k": 40, "logit_bias": {"28": -100.0}, "words": ["a", "b"], "empty": {}})
    assert shown == 'top_k=40 logit_bias={"28":-100.0} words=a,b'


# -- input refused in one line, before the model loads ---------------------------------------------
@pytest.fixture
def no_model_load(monkeypatch):
    """Fails a test whose command loads a model: its input should have been refused first."""
    import chatcore.engine

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(chatcore.engine, "load_model", no_model)


def test_eval_refuses_an_attribute_file_without_words_or_a_folder(run, tmp_path, no_model_load):
    empty = tmp_path / "empty.txt"
    empty.write_text("# a comment, then nothing\n\n")
    one_line_failure(run("eval", "--attribute", str(empty), "--limit", "1"), "--attribute", "holds no words")
    one_line_failure(
        run("eval", "--attribute", str(tmp_path), "--limit", "1"), f"--attribute: '{tmp_path}' is a folder"
    )


def test_eval_refuses_an_empty_json_path(run, no_model_load):
    one_line_failure(run("eval", "--json", "", "--limit", "1"), "--json must name a file", "got ''")


@pytest.mark.parametrize("command", [["generate", "hi"], ["eval", "--limit", "1"], ["chat"]])
def test_an_empty_device_is_refused(run, command, no_model_load):
    one_line_failure(run(command[0], "--device", "", *command[1:]), "--device must name a device", "got ''")


def test_eval_whose_every_context_fails_says_so_without_a_table(run, tiny_model_dir, tmp_path):
    from serving_steerers import ServingTestPlugin

    from chatcore import plugin_manager

    host = plugin_manager.PluginHost()
    host.load_entry_points()
    host.register(ServingTestPlugin(), "test-serving")
    plugin_manager.set_plugin_host(host)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hi there\n")
    report = tmp_path / "report.json"
    steer = ["--steer", "failing-shared at_step=0"]  # every reply fails at its first step
    result = run("eval", "-m", str(tiny_model_dir), "--prompts", str(prompts), "-n", "2", *steer, "--json", str(report))
    one_line_failure(result, "every context failed (1)", "RuntimeError: boom")
    assert result.stdout == ""
    assert "RuntimeError: boom" in json.loads(report.read_text())["samples"][0]["error"]  # the report still says why


def test_generate_names_the_turn_that_is_empty(run, no_model_load):
    one_line_failure(run("generate", "hi", "", "there"), "turn 2 of 3 is empty")
    one_line_failure(run("generate", "hi", "x" * 9000, "there"), "turn 2 of 3 is 9,000 characters long")
    one_line_failure(run("generate", " "), "the message is empty")


def test_a_word_file_that_is_a_folder_is_said_to_be_one(run, tmp_path, no_model_load):
    for spec in (f"bow-bias file={tmp_path}", f"rank file={tmp_path}"):
        flag = "--steer" if spec.startswith("bow-bias") else "--decoder"
        one_line_failure(run("generate", flag, spec, "hi"), f"`file`: '{tmp_path}' is a folder, not a word file")


@pytest.mark.parametrize(
    "bias, needle",
    [
        ('{"-1": 1}', "decoder 'greedy': `logit_bias` keys must be token ids in [0, vocab size), got -1"),
        ('{"abc": 1}', "decoder 'greedy': `logit_bias` keys must be token ids in [0, vocab size), got 'abc'"),
        ('{"5": 1000}', "decoder 'greedy': `logit_bias` values must be between -100 and 100, got 1000 for token 5"),
        ('{"999999": 1}', "decoder 'greedy': `logit_bias` keys must be token ids below "),
    ],
)
def test_logit_bias_keys_and_values_are_refused_as_what_they_are(run, tiny_model_dir, bias, needle):
    error = one_line_failure(run("generate", "-m", str(tiny_model_dir), "--decoder", f"greedy logit_bias={bias}", "hi"))
    assert error.startswith("Error: " + needle), error


# -- the Python API's steerers ----------------------------------------------------------------------
def test_steerers_take_a_spec_string_alone_and_refuse_other_entries_in_one_line(engine):
    from chatcore.errors import OptionError

    expected = engine.reply_to(
        ["hi"], ReplyOptions(seed=1, max_new_tokens=4, steerers=[("bow-bias", {"topic": "food"})])
    )
    conversation = engine.conversation()
    alone = engine.send(conversation, "hi", seed=1, max_new_tokens=4, steerers="bow-bias topic=food")
    assert alone.text() == expected.text() and alone.provenance["steerers"] == expected.provenance["steerers"]
    assert ReplyOptions(steerers=("bow-bias", {"words": ["a", "b"]})).steerers == [("bow-bias", {"words": ["a", "b"]})]
    assert ReplyOptions(steerers=["bow-bias words=a,b"]).steerers == [("bow-bias", {"words": "a,b"})]
    turns = len(conversation.turns)
    for steerers, needle in (
        ([("bow-bias", {"topic": "food"}, 1)], "each of `steerers` must be a spec string ('bow-bias topic=food') or a"),
        ([3], "(name, settings) pair such as ('bow-bias', {'topic': 'food'}), got 3"),
        (3, "`steerers` must be a list of steerer specs, e.g. ['bow-bias topic=food']"),
    ):
        with pytest.raises(OptionError) as caught:
            engine.send(conversation, "hi again", steerers=steerers)
        assert needle in str(caught.value) and "\n" not in str(caught.value), caught.value
        assert "validation" not in str(caught.value)
    assert len(conversation.turns) == turns  # a refused message is not added


# -- discord without a connection -------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("answered", [0, 2])
async def test_the_discord_bot_says_what_it_answered_in_words_when_it_stops(
    tiny_model_dir, monkeypatch, caplog, answered
):
    import logging

    from chatcore.adapters.discord_bot import run
    from chatcore.adapters.discord_bot.bot import ChatBot
    from chatcore.adapters.discord_bot.config import DiscordSettings
    from chatcore.errors import ChatcoreError

    async def unreachable(bot: ChatBot, token: str) -> None:
        # What a machine without network meets, after the bot answered `answered` messages.
        bot.stats.replies = answered
        bot.stats.errors = 1 if answered else 0
        raise OSError("Cannot connect to host discord.com:443")

    monkeypatch.setattr(ChatBot, "start", unreachable)
    settings = DiscordSettings(model=str(tiny_model_dir), log=False, shutdown_grace_s=5)
    with caplog.at_level(logging.INFO, logger="chatcore"), pytest.raises(ChatcoreError, match="cannot reach Discord"):
        await run.serve(settings, "MTA3.token.value")
    stopped = [record.getMessage() for record in caplog.records if record.getMessage().startswith("stopped")]
    assert stopped == (["stopped: 2 replies sent, 1 failed"] if answered else [])
    assert not any("BotStats(" in record.getMessage() for record in caplog.records)


def test_the_personas_help_says_the_list_joins_a_personas_lines(run, data_home):
    """The list shows each persona on one line, its lines joined: the help says so."""
    assert run("personas", "add", "poet", "Speak in verse.\nKeep it short.").exit_code == 0
    assert run("personas").stdout == "poet  Speak in verse. Keep it short.\n"
    assert "each with the start of its text (its lines joined)" in " ".join(run("personas", "--help").stdout.split())
