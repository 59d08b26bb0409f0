"""Saving and loading trained CoCon blocks, and refusing a block on the wrong model.

A block folder holds ``cocon_block.safetensors`` (the weights) and ``cocon_config.json``:
the block's :class:`~chatcore.plugins.cocon.block.CoconConfig`, the fingerprint of the base
model it was trained on, and training notes. The fingerprint is what makes a block
usable: the model type, depth, width, heads, vocabulary size and a hash of the
tokenizer's vocabulary must all match the model it is loaded for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatcore.api import ModelLoadError, OptionError, vocabulary_sha256

if TYPE_CHECKING:
    import torch

    from .block import CoconBlock

BLOCK_FILE = "cocon_block.safetensors"
CONFIG_FILE = "cocon_config.json"
FINGERPRINT_KEYS = ("model_type", "n_layer", "n_embd", "n_head", "vocab_size", "tokenizer_sha256")


class BlockMismatchError(OptionError):
    """A CoCon block trained for one base model was asked to run on another: a setting that
    does not fit this model."""


def bundled_dir() -> Path:
    from chatcore.api import BUNDLED_DIR

    return BUNDLED_DIR


def model_fingerprint(model: Any, tokenizer: Any) -> dict[str, Any]:
    """What a block depends on in its base model."""
    config = model.config
    return {
        "model_type": getattr(config, "model_type", type(model).__name__),
        "n_layer": int(getattr(config, "n_layer", getattr(config, "num_hidden_layers", 0))),
        "n_embd": int(getattr(config, "n_embd", getattr(config, "hidden_size", 0))),
        "n_head": int(getattr(config, "n_head", getattr(config, "num_attention_heads", 0))),
        "vocab_size": int(model.get_input_embeddings().weight.shape[0]),
        "tokenizer_sha256": vocabulary_sha256(tokenizer),
    }


def fingerprint_differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    differences = []
    for key in FINGERPRINT_KEYS:
        if expected.get(key) != actual.get(key):
            if key == "tokenizer_sha256":
                differences.append("a different tokenizer")
            else:
                differences.append(f"{key} {expected.get(key)} (this model: {actual.get(key)})")
    return differences


def check_compatible(info: dict[str, Any], fingerprint: dict[str, Any], block_name: str, model_name: str) -> None:
    """Raise :class:`BlockMismatchError` unless the block was trained for this model."""
    trained_for = info.get("base_model", {})
    differences = fingerprint_differences(trained_for.get("fingerprint", {}), fingerprint)
    if differences:
        raise BlockMismatchError(
            f"CoCon block {block_name!r} was trained for model {trained_for.get('name', '?')!r}, not for "
            f"{model_name!r}: it expects {', '.join(differences)}. Train a block for this model with "
            f"`chatcore train cocon --model {model_name} --out DIR` and pass block=DIR/block"
        )


def save_block(
    block: "CoconBlock",
    directory: str | Path,
    base_model: dict[str, Any],
    training: dict[str, Any] | None = None,
    dtype: str = "float16",
) -> Path:
    """Write the block's weights (in ``dtype``) and its config with the base model's fingerprint."""
    import torch
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = getattr(torch, dtype)
    tensors = {name: tensor.detach().to("cpu", target).contiguous() for name, tensor in block.state_dict().items()}
    save_file(tensors, str(directory / BLOCK_FILE))
    info = {
        "format": "chatcore-cocon/1",
        "block": block.config.to_dict(),
        "base_model": base_model,
        "training": training or {},
        "dtype": dtype,
    }
    (directory / CONFIG_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return directory


def read_info(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG_FILE
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"cannot read the CoCon block config {str(path)!r}: {error}") from None
    if not isinstance(info, dict) or "block" not in info or "base_model" not in info:
        raise ModelLoadError(f"{str(path)!r} is not a CoCon block config")
    return info


def bundled_blocks() -> list[Path]:
    root = bundled_dir()
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / CONFIG_FILE).exists() and (p / BLOCK_FILE).exists())


def resolve_block(name: str | None, fingerprint: dict[str, Any], model_name: str) -> Path:
    """A block folder: the given bundled name or folder (a training run's folder: its
    ``block/``), or (None) the bundled block made for this model."""
    if name is None:
        for candidate in bundled_blocks():
            trained_for = read_info(candidate).get("base_model", {}).get("fingerprint", {})
            if not fingerprint_differences(trained_for, fingerprint):
                return candidate
        raise BlockMismatchError(
            f"no bundled CoCon block fits model {model_name!r}; train one with "
            f"`chatcore train cocon --model {model_name} --out DIR` and pass block=DIR/block"
        )
    # a bundled name, a block's folder, or a `train cocon --out` folder (its block is in block/)
    for candidate in (bundled_dir() / name, Path(name), Path(name) / "block"):
        if (candidate / CONFIG_FILE).exists():
            return candidate
    raise ModelLoadError(f"no CoCon block {name!r}: give a bundled block name or a folder with {CONFIG_FILE}")


_loaded: dict[tuple[str, str, str], tuple["CoconBlock", dict[str, Any]]] = {}


def load_block(
    directory: str | Path, device: "str | torch.device" = "cpu", dtype: "torch.dtype | None" = None
) -> tuple["CoconBlock", dict[str, Any]]:
    """The block in ``directory`` (eval mode, on ``device`` in ``dtype``) and its config.

    Loaded blocks are kept, per folder, device and dtype: a reply does not re-read files.
    """
    import torch
    from safetensors.torch import load_file

    from .block import CoconBlock, CoconConfig

    directory = Path(directory).resolve()
    dtype = dtype or torch.float32
    key = (str(directory), str(device), str(dtype))
    if key in _loaded:
        return _loaded[key]
    info = read_info(directory)
    try:
        config = CoconConfig.from_dict(info["block"])
        block = CoconBlock(config)
        block.load_state_dict(load_file(str(directory / BLOCK_FILE)))
    except (OSError, ValueError, RuntimeError, TypeError, KeyError) as error:
        raise ModelLoadError(f"cannot load the CoCon block in {str(directory)!r}: {error}") from None
    block.to(device=device, dtype=dtype).eval()
    block.requires_grad_(False)
    _loaded[key] = (block, info)
    return block, info
