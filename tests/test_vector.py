"""The built-in ``vector`` steerer and ``chatcore train vector`` on tiny real models (GPT-2 and Llama)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from chatcore.cli import build_cli
from chatcore.engine import Engine, ReplyOptions
from chatcore.errors import ChatcoreError
from chatcore.prompting import Message
from chatcore.serving import Scheduler

POSITIVE = "i love pizza and pasta\nthe soup was delicious\nlet us cook dinner\n"
NEGATIVE = "i fixed the printer\nthe meeting was long\nlet us send the report\n"
PROMPT = "what did you do today?"


@pytest.fixture
def vector_engine(loaded, host):
    host.load_modules(("chatcore.plugins.vector",))
    return Engine(loaded, host=host)


@pytest.fixture
def contrast_files(tmp_path):
    positive, negative = tmp_path / "food.txt", tmp_path / "plain.txt"
    positive.write_text(POSITIVE)
    negative.write_text(NEGATIVE)
    return positive, negative


def train(model_path, contrast_files, out, *extra: str):
    positive, negative = contrast_files
    arguments = ["train", "vector", "--model", str(model_path), "--positive", str(positive)]
    arguments += ["--negative", str(negative), "--out", str(out), *extra]
    return CliRunner().invoke(build_cli(), arguments)


def reply(engine, steerers, seed=3, max_new_tokens=10):
    options = ReplyOptions(decoder="top-k", seed=seed, max_new_tokens=max_new_tokens, steerers=steerers)
    response = engine.reply_to([PROMPT], options)
    response.text()
    return response


def test_train_vector_writes_the_mean_difference_with_the_models_hash(loaded, tiny_model_dir, contrast_files, tmp_path):
    import torch
    from safetensors.torch import load_file

    from chatcore.anatomy import anatomy_of
    from chatcore.plugins.vector.vectors import mean_activation, model_hash

    result = train(tiny_model_dir, contrast_files, tmp_path / "food", "--layer", "1")
    assert result.exit_code == 0, result.output
    info = json.loads((tmp_path / "food.json").read_text())
    assert info["layer"] == 1 and info["width"] == anatomy_of(loaded.model).width
    assert info["model_hash"] == model_hash(loaded)
    assert (info["count_positive"], info["count_negative"]) == (3, 3)
    towards, _ = mean_activation(loaded, 1, POSITIVE.splitlines())
    away, _ = mean_activation(loaded, 1, NEGATIVE.splitlines())
    assert torch.allclose(load_file(str(tmp_path / "food.safetensors"))["vector"], towards - away)
    before = (tmp_path / "food.safetensors").read_bytes()
    kept = train(tiny_model_dir, contrast_files, tmp_path / "food", "--layer", "0")
    assert kept.exit_code == 1 and "exists: give --force to replace it" in kept.output, kept.output
    assert (tmp_path / "food.safetensors").read_bytes() == before  # the vector made is kept
    assert train(tiny_model_dir, contrast_files, tmp_path / "food", "--layer", "0", "--force").exit_code == 0
    assert json.loads((tmp_path / "food.json").read_text())["layer"] == 0


def test_strength_zero_is_the_plain_reply_and_a_strong_vector_changes_it(
    vector_engine, tiny_model_dir, contrast_files, tmp_path
):
    from chatcore.anatomy import anatomy_of

    blocks = anatomy_of(vector_engine.loaded.model).blocks
    hooks_before = [list(block._forward_hooks) for block in blocks]  # the shared model's own, if any
    assert train(tiny_model_dir, contrast_files, tmp_path / "food").exit_code == 0
    plain = reply(vector_engine, [])
    zero = reply(vector_engine, [("vector", {"path": str(tmp_path / "food"), "strength": 0})])
    assert zero.token_ids == plain.token_ids
    steered = reply(vector_engine, [("vector", {"path": str(tmp_path / "food.json"), "strength": 3})])
    assert steered.token_ids != plain.token_ids
    details = steered.provenance["details"]["vector"]
    assert details["strength"] == 3 and details["layer"] == 0  # a third of 2 layers
    info = json.loads((tmp_path / "food.json").read_text())
    assert details["residual_norm"] == round(info["residual_norm"], 4)
    # The hook lives only while a step runs: the model is left as it was.
    assert [list(block._forward_hooks) for block in blocks] == hooks_before


@pytest.mark.slow
def test_a_steered_reply_beside_plain_ones_in_the_scheduler_equals_each_alone(vector_engine):
    """The steered reply runs eagerly beside the shared batch: its edit never reaches the other rows."""
    steered = ReplyOptions(
        decoder="top-k", seed=5, max_new_tokens=8, steerers=[("vector", {"pairs": "food", "strength": 2})]
    )
    plain = ReplyOptions(decoder="top-k", seed=5, max_new_tokens=8)
    expected = [reply_ids(vector_engine, options) for options in (steered, plain, plain)]
    with Scheduler(vector_engine, max_batch=4) as scheduler:
        handles = [scheduler.submit([Message("user", PROMPT)], options) for options in (steered, plain, plain)]
        for handle in handles:
            assert handle.wait(60)
    assert [handle.token_ids for handle in handles] == expected
    assert expected[0] != expected[1]


def test_the_added_vector_is_strength_times_the_residual_norm_long(vector_engine):
    """Strength is relative to the model: the addition keeps the vector's direction and is
    ``strength`` times the residual stream's mean norm at the layer long."""
    import torch

    from chatcore.plugins.vector.steerer import VectorSettings, VectorSteerer

    prepared = VectorSteerer.setup(vector_engine.loaded, VectorSettings(pairs="food"))
    addition = prepared.addition(0.5).float()
    assert float(addition.norm()) == pytest.approx(0.5 * prepared.residual_norm, rel=1e-3)
    cosine = torch.nn.functional.cosine_similarity(addition, prepared.vector.float(), dim=0)
    assert float(cosine) == pytest.approx(1.0, abs=1e-4)


def reply_ids(engine, options):
    response = engine.reply_to([PROMPT], options)
    response.text()
    return response.token_ids


def test_a_vector_made_for_another_model_is_refused_in_one_line(
    tiny_llama, tiny_model_dir, contrast_files, tmp_path, host
):
    assert train(tiny_model_dir, contrast_files, tmp_path / "gpt2-food").exit_code == 0
    host.load_modules(("chatcore.plugins.vector",))
    engine = Engine(tiny_llama, host=host)
    options = ReplyOptions(steerers=[("vector", {"path": str(tmp_path / "gpt2-food")})])
    with pytest.raises(ChatcoreError, match="was made for model .* not for .*chatcore train vector --model") as caught:
        engine.check_options(options)
    assert "\n" not in str(caught.value)


def test_built_in_pairs_steer_a_llama_family_model(tiny_llama, host):
    """The same steerer on a rotary, grouped-query Llama: the anatomy module finds its blocks."""
    host.load_modules(("chatcore.plugins.vector",))
    engine = Engine(tiny_llama, host=host)
    plain = reply(engine, [])
    steered = reply(engine, [("vector", {"pairs": "happy", "strength": 3, "layer": 1})])
    assert steered.token_ids != plain.token_ids
    assert steered.provenance["details"]["vector"]["source"] == "pairs:happy"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, "vector needs one source"),
        ({"pairs": "food", "path": "x"}, "vector needs one source"),
        ({"pairs": "weather"}, "`pairs` must be one of food, happy, sports"),
        ({"pairs": "food", "strength": 10}, "`strength` must be between -4 and 4"),
        ({"pairs": "food", "layer": 7}, "^steerer 'vector': `layer` must be between 0 and 1 on this model, got 7$"),
        ({"path": "/no/such/vector"}, "/no/such/vector.safetensors does not exist"),
    ],
)
def test_bad_settings_are_refused_when_chosen_in_one_line(vector_engine, settings, message):
    with pytest.raises(ChatcoreError, match=message) as caught:
        vector_engine.check_options(ReplyOptions(steerers=[("vector", settings)]))
    assert "\n" not in str(caught.value)


def test_a_path_that_is_no_saved_vector_says_what_it_is(vector_engine, tiny_model_dir, contrast_files, tmp_path):
    assert train(tiny_model_dir, contrast_files, tmp_path / "food").exit_code == 0
    made = json.loads((tmp_path / "food.json").read_text())
    for stem, metadata in [("empty", {}), ("typed", {**made, "layer": "x"}), ("listed", [1])]:
        (tmp_path / f"{stem}.safetensors").write_bytes((tmp_path / "food.safetensors").read_bytes())
        (tmp_path / f"{stem}.json").write_text(json.dumps(metadata))
    (tmp_path / "alone.safetensors").write_bytes((tmp_path / "food.safetensors").read_bytes())
    (tmp_path / "garbled.safetensors").write_text("garbage")
    (tmp_path / "garbled.json").write_text(json.dumps(made))
    ours = "is not a vector's metadata from `chatcore train vector`"
    for path, message in [
        ("empty", f"empty.json {ours} (it lacks layer, width, model_hash and 6 more)"),
        ("typed", "typed.json: `layer` must be an integer, got 'x'"),
        ("listed", f"listed.json {ours} (it holds no JSON object)"),
        ("alone.safetensors", "its metadata {tmp}/alone.json is missing beside alone.safetensors"),
        ("garbled", "{tmp}/garbled.safetensors cannot be read as safetensors"),
        ("{tmp}", "'{tmp}' is a folder, not a vector"),
    ]:
        shown = path.format(tmp=tmp_path) if path == "{tmp}" else str(tmp_path / path)
        with pytest.raises(ChatcoreError) as caught:
            vector_engine.check_options(ReplyOptions(steerers=[("vector", {"path": shown})]))
        error = str(caught.value)
        assert error.startswith(f"steering vector '{shown}': "), error
        assert message.format(tmp=tmp_path) in error and "\n" not in error, error
        assert "VectorInfo" not in error and "TypeError" not in error


def test_train_vector_input_errors_are_one_line(tiny_model_dir, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("# only a comment\n\n")
    cli = build_cli()
    runner = CliRunner()
    for arguments, message in [
        (["--positive", str(empty), "--negative", str(empty)], "holds no text"),
        (["--positive", str(tmp_path / "missing.txt"), "--negative", str(empty)], "does not exist"),
        (["--positive", str(empty)], "give --positive FILE and --negative FILE"),
        (["--pairs", "food", "--layer", "9"], "`layer` must be between 0 and 1"),
        (["--pairs", "food", "--device", ""], "--device must name a device (auto, cpu, cuda, cuda:N or mps), got ''"),
    ]:
        result = runner.invoke(
            cli, ["train", "vector", "--model", str(tiny_model_dir), "--out", str(tmp_path / "v"), *arguments]
        )
        assert result.exit_code != 0
        assert message in result.output and result.output.count("\n") == 1, result.output


@pytest.mark.parametrize(
    ("out", "message"),
    [
        ("", "a steering vector's path needs a name (e.g. `formal`), got ''"),
        (
            "{tmp}/missing/v",
            "cannot write --out '{tmp}/missing/v.safetensors': the folder '{tmp}/missing' does not exist",
        ),
    ],
)
def test_train_vector_refuses_an_out_without_a_name_or_folder_before_any_work(tmp_path, monkeypatch, out, message):
    import chatcore.api

    monkeypatch.setattr(chatcore.api, "load_model", lambda *args, **kwargs: pytest.fail("the model was loaded"))
    result = CliRunner().invoke(
        build_cli(),
        ["train", "vector", "--model", "chatcore-tiny", "--pairs", "food", "--out", out.format(tmp=tmp_path)],
    )
    assert isinstance(result.exception, SystemExit) and result.exit_code != 0, result.exception
    assert result.stderr == f"Error: {message.format(tmp=tmp_path)}\n"
    assert not (tmp_path / "missing").exists()


def test_train_vector_defaults_to_the_model_generate_loads(tiny_model_dir, contrast_files, tmp_path, monkeypatch):
    """No --model: the vector is made on the default model of chat and generate ($CHATCORE_MODEL here)."""
    monkeypatch.setenv("CHATCORE_MODEL", str(tiny_model_dir))
    positive, negative = contrast_files
    arguments = ["train", "vector", "--positive", str(positive), "--negative", str(negative)]
    result = CliRunner().invoke(build_cli(), [*arguments, "--out", str(tmp_path / "food")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "food.json").read_text())["model_name"] == str(tiny_model_dir)


@pytest.mark.slow
def test_generate_steers_with_a_saved_vector_as_the_python_api_does(
    vector_engine, tiny_model_dir, contrast_files, tmp_path
):
    """The command line (a solo reply) gives the Python API's reply; the REPL, Discord and HTTP
    submit to the scheduler, whose result the scheduler test above checks."""
    assert train(tiny_model_dir, contrast_files, tmp_path / "food").exit_code == 0
    steerers = [("vector", {"path": str(tmp_path / "food"), "strength": 1.5})]
    options = ReplyOptions(decoder="top-k", seed=7, max_new_tokens=6, steerers=steerers)
    expected = reply_ids(vector_engine, options)
    result = CliRunner().invoke(
        build_cli(),
        ["generate", "--model", str(tiny_model_dir), "--steer", f"vector path={tmp_path / 'food'} strength=1.5"]
        + ["--decoder", "top-k", "--seed", "7", "-n", "6", "--json", PROMPT],
    )
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["token_ids"] == expected
