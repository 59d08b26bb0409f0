"""Steering vectors: built from contrast pairs, saved beside their model's hash, loaded back.

A steering vector is the difference between the mean residual-stream activation of some
positive texts and that of some negative texts at the output of one block (CAA, Rimsky et
al. 2024; repeng). Each text's activation is the mean over its tokens, so that a topic's
vector carries the topic rather than the position of the last word.

On disk a vector is two files with one stem: ``NAME.safetensors`` (the (C,) float32 vector)
and ``NAME.json`` (its layer, width, the hash of the model it was read from, the texts'
sources and counts). A vector is refused on any model whose hash differs.
"""

from __future__ import annotations

import hashlib
import json
import threading
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatcore.api import OptionError, anatomy_of, encode_text, vocabulary_sha256

if TYPE_CHECKING:
    import torch

    from chatcore.api import LoadedModel

PAIRS_DIR = Path(__file__).with_name("pairs")
# Built-in contrast sets: name -> (positive file, negative file) in PAIRS_DIR. Each line of
# one file has a partner of the same shape on the same line of the other, so the difference
# keeps what the pair differs in (the mood, the topic) and cancels the rest.
BUILTIN_PAIRS: dict[str, tuple[str, str]] = {
    "happy": ("happy.txt", "sad.txt"),
    "food": ("food.txt", "plain.txt"),
    "sports": ("sports.txt", "plain.txt"),
}
FORMAT_VERSION = 1
# Rows of the token embedding that join the model hash (all of a small model's would cost a
# read of the whole matrix; these are enough to tell two trained models apart).
HASHED_EMBEDDING_ROWS = 512


class VectorMismatchError(OptionError):
    """A vector made for one model was asked to steer another."""


@dataclass
class VectorInfo:
    """What ``NAME.json`` holds beside the vector."""

    layer: int
    width: int
    model_hash: str
    model_name: str
    positive: str
    negative: str
    count_positive: int
    count_negative: int
    norm: float
    # The mean norm of a token's residual stream at ``layer`` over the texts (None in files
    # made before it was stored: then it is measured when the vector is used).
    residual_norm: float | None = None
    version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class SteeringVector:
    vector: "torch.Tensor"  # (C,) float32
    info: VectorInfo


def model_hash(loaded: "LoadedModel") -> str:
    """A short hash of what a vector depends on: the architecture and sizes, the vocabulary,
    and some of the weights, rounded to bfloat16 so that one model loaded in float32 or in
    half precision (or converted to either) hashes the same."""
    import torch

    anatomy = anatomy_of(loaded.model)
    digest = hashlib.sha256()
    shape = [type(loaded.model).__name__, anatomy.n_layer, anatomy.width, anatomy.vocab_size]
    digest.update(json.dumps(shape).encode())
    digest.update(vocabulary_sha256(loaded.tokenizer).encode())
    embedding: torch.Tensor = anatomy.token_embedding.get_parameter("weight")
    pieces = [embedding[:HASHED_EMBEDDING_ROWS]]
    norm_weight = getattr(anatomy.final_norm, "weight", None)
    if isinstance(norm_weight, torch.Tensor):
        pieces.append(norm_weight)
    for piece in pieces:
        rounded = piece.detach().to("cpu", torch.bfloat16).view(torch.int16)
        digest.update(rounded.numpy().tobytes())
    return digest.hexdigest()[:16]


def read_texts(path: str | Path) -> list[str]:
    """The non-empty lines of a text file (one example per line; ``#`` starts a comment line)."""
    file = Path(path).expanduser()
    try:
        lines = file.read_text(encoding="utf-8-sig").splitlines()  # a leading byte-order mark is no text
    except FileNotFoundError:
        raise OptionError(f"contrast file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise OptionError(f"contrast file {str(path)!r} cannot be read: {error}") from None
    texts = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not texts:
        raise OptionError(f"contrast file {str(path)!r} holds no text (one example per line)")
    return texts


def builtin_pair_files(name: str) -> tuple[Path, Path]:
    if name not in BUILTIN_PAIRS:
        raise OptionError(f"`pairs` must be one of {', '.join(sorted(BUILTIN_PAIRS))}, got {name!r}")
    positive, negative = BUILTIN_PAIRS[name]
    return PAIRS_DIR / positive, PAIRS_DIR / negative


def default_layer(n_layer: int) -> int:
    """A third of the way up: early enough that most of the network still acts on the change,
    late enough that the activations carry meaning rather than spelling (CAA finds the
    middle layers of a 32-layer Llama best; the same share holds on small models)."""
    return n_layer // 3


def check_layer(layer: int, n_layer: int) -> None:
    if not 0 <= layer < n_layer:
        raise OptionError(f"`layer` must be between 0 and {n_layer - 1} on this model, got {layer}")


def mean_activation(loaded: "LoadedModel", layer: int, texts: Sequence[str]) -> tuple["torch.Tensor", float]:
    """The residual stream after block ``layer``, averaged over each text's tokens and then over
    the texts: ((C,) float32, the mean norm of a token's residual there)."""
    import torch

    anatomy = anatomy_of(loaded.model)
    limit = loaded.max_positions
    pooled: list[torch.Tensor] = []
    norms: list[float] = []
    seen: list[torch.Tensor] = []
    owner = threading.get_ident()

    def read(hidden: "torch.Tensor") -> None:
        # Only this thread's passes: another thread may be decoding with the same model.
        if threading.get_ident() == owner:
            seen.append(hidden)

    with torch.no_grad(), anatomy.residual_hook(layer, read):
        for text in texts:
            ids = encode_text(loaded.tokenizer, text)[:limit]
            if not ids:
                continue
            input_ids = torch.tensor([ids], dtype=torch.long, device=loaded.device)
            loaded.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False)
            hidden = seen.pop()[0].float()  # (T, C)
            pooled.append(hidden.mean(dim=0))
            norms.append(float(hidden.norm(dim=-1).mean()))
    if not pooled:
        raise OptionError("the contrast texts encode to no tokens")
    return torch.stack(pooled).mean(dim=0), sum(norms) / len(norms)


def residual_norm(loaded: "LoadedModel", layer: int) -> float:
    """The mean norm of a token's residual stream after block ``layer``, over the built-in plain
    texts: the yardstick of a vector's strength where its file does not carry one, or where it
    is added at another layer than it was read at."""
    return mean_activation(loaded, layer, read_texts(PAIRS_DIR / "plain.txt"))[1]


def build_vector(
    loaded: "LoadedModel",
    positive: Sequence[str],
    negative: Sequence[str],
    layer: int | None = None,
    sources: tuple[str, str] = ("", ""),
    progress: Callable[[str], None] | None = None,
) -> SteeringVector:
    """The mean difference of the residual stream at ``layer`` between ``positive`` and ``negative`` texts."""
    anatomy = anatomy_of(loaded.model)
    layer = default_layer(anatomy.n_layer) if layer is None else layer
    check_layer(layer, anatomy.n_layer)
    if progress is not None:
        progress(f"reading {len(positive)} positive and {len(negative)} negative texts at layer {layer}")
    towards, towards_norm = mean_activation(loaded, layer, positive)
    away, away_norm = mean_activation(loaded, layer, negative)
    vector = (towards - away).cpu()
    info = VectorInfo(
        layer=layer,
        width=anatomy.width,
        model_hash=model_hash(loaded),
        model_name=loaded.name,
        positive=sources[0],
        negative=sources[1],
        count_positive=len(positive),
        count_negative=len(negative),
        norm=round(float(vector.norm()), 6),
        residual_norm=round((towards_norm + away_norm) / 2, 6),
    )
    return SteeringVector(vector, info)


def vector_files(path: str | Path) -> tuple[Path, Path]:
    """``x``, ``x.safetensors`` or ``x.json`` -> (``x.safetensors``, ``x.json``); a path with
    no name (empty, ``.``, a folder's ``x/..``) is one OptionError line."""
    base = Path(path).expanduser()
    if not base.name or base.name == "..":
        raise OptionError(f"a steering vector's path needs a name (e.g. `formal`), got {str(path)!r}")
    if base.suffix in (".safetensors", ".json"):
        base = base.with_suffix("")
    return base.with_name(base.name + ".safetensors"), base.with_name(base.name + ".json")


def save_vector(found: SteeringVector, path: str | Path) -> tuple[Path, Path]:
    from safetensors.torch import save_file

    tensors, meta = vector_files(path)
    tensors.parent.mkdir(parents=True, exist_ok=True)
    save_file({"vector": found.vector.float().contiguous()}, str(tensors))
    meta.write_text(json.dumps(asdict(found.info), indent=2) + "\n", encoding="utf-8")
    return tensors, meta


def load_vector(path: str | Path) -> SteeringVector:
    """Read a saved vector; a missing or damaged file is one line."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    shown = f"steering vector {str(path)!r}"
    if Path(path).expanduser().is_dir():
        raise OptionError(
            f"{shown}: {str(path)!r} is a folder, not a vector (NAME.safetensors and NAME.json, "
            "as `chatcore train vector` writes them)"
        )
    tensors, meta = vector_files(path)
    if not tensors.is_file():
        raise OptionError(f"{shown}: {tensors} does not exist (make one: chatcore train vector)")
    if not meta.is_file():
        raise OptionError(
            f"{shown}: its metadata {meta} is missing beside {tensors.name} (`chatcore train vector` writes both)"
        )
    try:
        data = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise OptionError(f"{shown}: {meta} cannot be read as JSON ({error})") from None
    info = vector_info(data, f"{shown}: {meta}")
    try:
        vector = load_file(str(tensors))["vector"]
    except KeyError:
        raise OptionError(f"{shown}: {tensors} holds no 'vector' tensor (make one: chatcore train vector)") from None
    except (SafetensorError, OSError, ValueError) as error:
        raise OptionError(f"{shown}: {tensors} cannot be read as safetensors ({error})") from None
    if vector.dim() != 1 or vector.numel() != info.width:
        raise OptionError(f"{shown} holds {tuple(vector.shape)}, not ({info.width},)")
    return SteeringVector(vector.float(), info)


def vector_info(data: Any, shown: str) -> VectorInfo:
    """The metadata of ``NAME.json`` as a VectorInfo, or OptionError saying in one line why the
    file is none (``shown`` names it): not an object, keys missing or unknown, a value of the
    wrong type."""
    kinds = typing.get_type_hints(VectorInfo)
    not_ours = "is not a vector's metadata from `chatcore train vector`"
    if not isinstance(data, dict):
        raise OptionError(f"{shown} {not_ours} (it holds no JSON object)")
    required = [f.name for f in fields(VectorInfo) if f.default is MISSING and f.default_factory is MISSING]
    missing = [name for name in required if name not in data]
    if missing:
        listed = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise OptionError(f"{shown} {not_ours} (it lacks {listed})")
    unknown = sorted(str(key) for key in data if key not in kinds)
    if unknown:
        raise OptionError(f"{shown} {not_ours} (unknown keys: {', '.join(unknown)})")
    for name, value in data.items():
        if not _is_kind(value, kinds[name]):
            raise OptionError(f"{shown}: `{name}` must be {_kind_name(kinds[name])}, got {value!r}")
    return VectorInfo(**data)


def _is_kind(value: Any, kind: Any) -> bool:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return any(_is_kind(value, option) for option in typing.get_args(kind))
    kind = typing.get_origin(kind) or kind
    if kind is type(None):
        return value is None
    if isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


def _kind_name(kind: Any) -> str:
    names = {int: "an integer", float: "a number", str: "text", dict: "a JSON object", type(None): "null"}
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return " or ".join(_kind_name(option) for option in typing.get_args(kind))
    return names.get(typing.get_origin(kind) or kind, str(kind))


def check_model(found: SteeringVector, loaded: "LoadedModel", shown: str) -> None:
    """Refuse a vector made for another model, in one line."""
    this = model_hash(loaded)
    if found.info.model_hash != this:
        raise VectorMismatchError(
            f"steering vector {shown!r} was made for model {found.info.model_name!r} (hash "
            f"{found.info.model_hash}), not for {loaded.name!r} (hash {this}): make one for it with "
            f"`chatcore train vector --model {loaded.name} ...`"
        )
