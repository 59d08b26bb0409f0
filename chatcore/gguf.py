"""GGUF files (from llama.cpp or Ollama), converted once into a cached Hugging Face folder.

transformers reads a GGUF file by de-quantizing every tensor into a float model, which
takes about 20 s for a 135M-parameter model on a CPU. Doing that on every start would
make GGUF models slow to open, so the first load saves the converted model (safetensors,
tokenizer, generation config) under the user's cache folder and every later load reads
that folder like any other.

The cache entry is keyed by the file's content (its sha256, computed once per path, size
and modification time and remembered in ``hashes.json``), so a copy or a move of a file
reuses its conversion and a rewritten file is converted anew.

The weights are stored in the file's own quantized blocks (``chatcore.gguf_packed``), so a
load gives exactly the model transformers de-quantizes from the file, in less disk than the
GGUF file itself takes; tensors that cannot stay packed are stored in bfloat16 or float16
where that holds them exactly, float32 otherwise.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chatcore.errors import ModelLoadError

GGUF_SUFFIX = ".gguf"
# Bumped when the layout of a converted folder changes, so old entries are not reused.
CONVERSION_VERSION = "3"
# Written into every converted folder: the source file, its sha256, the stored dtype.
SOURCE_FILE = "chatcore_source.json"
# Remembers each GGUF file's sha256 by path, size and modification time.
HASHES_FILE = "hashes.json"
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


def content_sha256(path: Path) -> str:
    """The sha256 of the file's bytes, read once per path, size and modification time (a
    100 MB file takes about a second) and remembered in the cache's ``hashes.json``."""
    stat = path.stat()
    resolved = str(path.resolve())
    stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    known = _read_hashes()
    entry = known.get(resolved)
    if isinstance(entry, dict) and all(entry.get(key) == value for key, value in stamp.items()):
        digest = entry.get("sha256")
        if isinstance(digest, str) and len(digest) == 64:
            return digest
    sha = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            sha.update(chunk)
    digest = sha.hexdigest()
    known = {name: entry for name, entry in _read_hashes().items() if name != resolved and Path(name).exists()}
    known[resolved] = {**stamp, "sha256": digest}
    _write_hashes(known)
    return digest


def _read_hashes() -> dict[str, Any]:
    try:
        found = json.loads((cache_root() / HASHES_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _write_hashes(known: dict[str, Any]) -> None:
    """Replace ``hashes.json`` atomically; a cache that cannot be written only costs a re-read."""
    root = cache_root()
    with contextlib.suppress(OSError):
        root.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(prefix=f".{HASHES_FILE}-", dir=root)
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            json.dump(known, file, indent=1)
        os.replace(temporary, root / HASHES_FILE)


def cache_key(path: Path) -> str:
    """The file's content (and the conversion's layout version), hashed: the same for a copy
    or a move of the file, new when its bytes change."""
    identity = f"{CONVERSION_VERSION}:{content_sha256(path)}"
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def cached_folder(path: Path) -> Path:
    """The folder the converted model of ``path`` lives in (whether or not it exists yet):
    an existing conversion of the same content under another file name, else one named
    after this file."""
    key = cache_key(path)
    root = cache_root()
    if root.is_dir():
        for folder in sorted(root.glob(f"*-{key}")):
            if (folder / COMPLETE_MARKER).is_file():
                return folder
    return root / f"{path.stem}-{key}"


def read_architecture(path: Path) -> tuple[str, set[str]]:
    """The file's ``general.architecture`` and the types of its tensors (``Q4_1``, ``F32`` ...),
    reading the whole index so that a truncated file fails here."""
    try:
        from gguf import GGUFReader
    except ImportError as error:  # pragma: no cover - a declared dependency
        raise ModelLoadError("reading GGUF files needs the `gguf` package: pip install gguf") from error
    try:
        reader = GGUFReader(str(path))
        field = reader.get_field("general.architecture")
        architecture = field.contents() if field is not None else None
        tensor_types = {tensor.tensor_type.name for tensor in reader.tensors}
    except Exception as error:  # the reader raises ValueError, struct.error, IndexError...
        raise ModelLoadError(
            f"GGUF file {str(path)!r} cannot be read (truncated or not a GGUF file): {error}"
        ) from error
    if not isinstance(architecture, str) or not architecture:
        raise ModelLoadError(f"GGUF file {str(path)!r} names no architecture (general.architecture)")
    return architecture, tensor_types


def converted_model_folder(path: Path) -> Path:
    """The cached Hugging Face folder for a GGUF file, converting it first if needed."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    folder = cached_folder(path)
    if (folder / COMPLETE_MARKER).is_file():
        return folder
    architecture, _tensor_types = read_architecture(path)
    print(f"converting {path.name} into a Hugging Face folder once (cached in {folder.parent})", file=sys.stderr)
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(folder)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        with _quiet_conversion():
            stored = _convert(path, staging, architecture)
        source = {
            "file": path.name,
            "path": str(path.resolve()),
            "sha256": content_sha256(path),
            "size": path.stat().st_size,
            "dtype": "+".join(sorted(stored, key=lambda kind: -stored[kind])),
            "tensors": stored,
            "version": CONVERSION_VERSION,
        }
        (staging / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
        _publish(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _convert(path: Path, out: Path, architecture: str) -> dict[str, int]:
    """De-quantize the file through transformers (to float32) and save its config, tokenizer and
    packed weights (how many tensors were stored packed, in bfloat16 and in float32)."""
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
    from chatcore.gguf_packed import write_packed

    # The weights are de-quantized floats; the GGUF "quantizer" only marks the model as quantized.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    stored = write_packed(path, model, out)
    tokenizer.save_pretrained(str(out))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(out))
    model.config.save_pretrained(str(out))  # config.json last: the folder's completion mark
    return stored


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
