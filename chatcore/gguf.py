"""GGUF files (from llama.cpp or Ollama), converted once into a cached Hugging Face folder.

transformers reads a GGUF file by de-quantizing every tensor into a float model, which
takes about 20 s for a 135M-parameter model on a CPU. Doing that on every start would
make GGUF models slow to open, so the first load saves the converted model (float32
safetensors, tokenizer, generation config) under the user's cache folder and every later
load reads that folder like any other. The cache entry is named after the file's name,
size and modification time, so replacing the file converts it anew.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from chatcore.errors import ModelLoadError

GGUF_SUFFIX = ".gguf"
# Bumped when the layout of a converted folder changes, so old entries are not reused.
CONVERSION_VERSION = "1"
# Every converted folder holds this file; it is written last, inside the temporary folder.
COMPLETE_MARKER = "config.json"
# A staging folder this old belongs to a conversion that was killed; a live one is younger.
STALE_STAGING_SECONDS = 24 * 3600


def is_gguf_path(name: str) -> bool:
    return name.lower().endswith(GGUF_SUFFIX)


def cache_root() -> Path:
    """Where converted GGUF models live: ``<user cache>/chatcore/gguf`` (XDG_CACHE_HOME on Linux)."""
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("chatcore")) / "gguf"


def cache_key(path: Path) -> str:
    """Changes whenever the file is replaced or rewritten: its size and modification time, hashed."""
    stat = path.stat()
    identity = f"{CONVERSION_VERSION}:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def cached_folder(path: Path) -> Path:
    """The folder the converted model of ``path`` lives in (whether or not it exists yet)."""
    return cache_root() / f"{path.stem}-{cache_key(path)}"


def read_architecture(path: Path) -> str:
    """The file's ``general.architecture``, reading the whole index so that a truncated file fails here."""
    try:
        from gguf import GGUFReader
    except ImportError as error:  # pragma: no cover - a declared dependency
        raise ModelLoadError("reading GGUF files needs the `gguf` package: pip install gguf") from error
    try:
        reader = GGUFReader(str(path))
        field = reader.get_field("general.architecture")
        architecture = field.contents() if field is not None else None
    except Exception as error:  # the reader raises ValueError, struct.error, IndexError...
        raise ModelLoadError(
            f"GGUF file {str(path)!r} cannot be read (truncated or not a GGUF file): {error}"
        ) from error
    if not isinstance(architecture, str) or not architecture:
        raise ModelLoadError(f"GGUF file {str(path)!r} names no architecture (general.architecture)")
    return architecture


def converted_model_folder(path: Path) -> Path:
    """The cached Hugging Face folder for a GGUF file, converting it first if needed."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    folder = cached_folder(path)
    if (folder / COMPLETE_MARKER).is_file():
        return folder
    architecture = read_architecture(path)
    print(f"converting {path.name} into a Hugging Face folder once (cached in {folder.parent})", file=sys.stderr)
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(folder)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        with _quiet_conversion():
            _convert(path, staging, architecture)
        _publish(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _convert(path: Path, out: Path, architecture: str) -> None:
    """De-quantize the file through transformers and save it as an ordinary float32 folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except ValueError as error:
        if "not supported" in str(error):
            raise ModelLoadError(
                f"GGUF file {str(path)!r}: transformers cannot read its {architecture!r} architecture"
            ) from error
        raise ModelLoadError(f"GGUF file {str(path)!r} cannot be converted: {error}") from error
    except (OSError, KeyError, TypeError) as error:
        raise ModelLoadError(f"GGUF file {str(path)!r} cannot be converted: {error}") from error
    # The weights are already de-quantized floats; the GGUF "quantizer" only marks the model
    # as quantized, which makes save_pretrained refuse. (transformers sets it on the instance
    # at loading; torch's types take an undeclared module attribute for a tensor or module.)
    cast(Any, model).hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def _publish(staging: Path, folder: Path) -> None:
    """Move a finished conversion into place atomically; a concurrent conversion that won is kept."""
    try:
        os.rename(staging, folder)
    except OSError:
        if not (folder / COMPLETE_MARKER).is_file():
            raise


def _remove_stale_staging(folder: Path) -> None:
    """Delete what killed conversions of this file left behind (never loaded, only litter)."""
    now = time.time()
    for leftover in folder.parent.glob(f".{folder.name}-*"):
        with contextlib.suppress(OSError):
            if now - leftover.stat().st_mtime > STALE_STAGING_SECONDS:
                shutil.rmtree(leftover, ignore_errors=True)


@contextlib.contextmanager
def _quiet_conversion() -> Iterator[None]:
    """Hide transformers' de-quantizing progress bar and notices unless CHATCORE_DEBUG is set."""
    if os.environ.get("CHATCORE_DEBUG"):
        yield
        return
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        # The GGUF bar is a plain tqdm bar (not behind transformers' progress-bar switch).
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
