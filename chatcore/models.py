"""Loading causal language models and their tokenizers: bundled, local folder or hub id."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatcore.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "chatcore-tiny"
DEFAULT_REVERSE_MODEL = "chatcore-tiny-reverse"
BUNDLED_DIR = Path(__file__).with_name("bundled")
DTYPES = ("auto", "float32", "float16", "bfloat16")


def bundled_models() -> list[str]:
    """Names of the model folders shipped inside the package."""
    if not BUNDLED_DIR.is_dir():
        return []
    return sorted(p.name for p in BUNDLED_DIR.iterdir() if (p / "config.json").exists())


def resolve_model_path(name: str) -> str:
    """A bundled model's folder, an existing local folder, or the name as a hub id."""
    if not name or not name.strip():
        raise ModelLoadError("the model name is empty")
    candidate = BUNDLED_DIR / name
    if (candidate / "config.json").exists():
        return str(candidate)
    return name


def pick_device(device: str | None) -> str:
    import torch

    if device in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} asked for, but CUDA is not available here")
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
        config = self.model.config
        for attribute in ("n_positions", "max_position_embeddings", "n_ctx"):
            value = getattr(config, attribute, None)
            if isinstance(value, int) and value > 0:
                return value
        return 1024


def load_model(name: str = DEFAULT_MODEL, device: str | None = None, dtype: str | None = None) -> LoadedModel:
    """Load any Hugging Face causal LM and its tokenizer by bundled name, folder or hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name)
    device = pick_device(device)
    torch_dtype = pick_dtype(dtype, device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    except (OSError, ValueError, EnvironmentError) as error:
        hint = "" if Path(path).exists() else " (not a bundled model or local folder; as a hub id it needs a connection)"
        raise ModelLoadError(f"cannot load model {name!r}{hint}: {error}") from error
    if tokenizer.eos_token_id is None:
        raise ModelLoadError(f"model {name!r}: its tokenizer has no EOS token, which separates turns")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(device)
    model.eval()
    return LoadedModel(name=name, path=path, model=model, tokenizer=tokenizer, device=device, dtype=torch_dtype)
