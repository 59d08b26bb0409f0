"""A converted GGUF model's weights kept in the file's own quantized blocks.

De-quantized weights are what transformers computes from a GGUF file, and they are what a
converted folder must reproduce exactly. Stored as float32 they take about five times the
GGUF file (517 MiB for SmolLM2-135M's 93 MB Q4_1 file); rounded to bfloat16 they take half
that but are no longer the same numbers. So a converted folder keeps each weight matrix as
the GGUF's quantized blocks (reordered the way transformers reorders its rows) in
``packed.safetensors``, and a load de-quantizes them with the ``gguf`` package, the same
function transformers uses, so the model equals the one transformers builds from the file.

Packing is checked, not assumed: a tensor is kept packed only if de-quantizing its blocks
gives back, bit for bit, the weight transformers built. Any other tensor (norms, biases, a
layout a model's converter changes in another way) is stored in full: bfloat16 when that
or float16 holds its values exactly, float32 otherwise.

The same layout also stores a trained model folder in 8 bits (``chatcore models pack``):
each weight matrix whose rows split into blocks of 32 is rounded to Q8_0 blocks (per block a
float16 scale and 32 signed bytes; GGUF's Q8_0, made by the ``gguf`` package), about half
the size of a float16 folder. Unlike a GGUF conversion this changes the numbers, by at most
half a step of each block's scale; the command reports how much the model's
log-probabilities move on a sample text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chatcore.errors import ModelLoadError

PACKED_FILE = "packed.safetensors"
# Metadata key of each packed tensor: its GGUF block type and the weight's shape.
_PACKED_PREFIX = "packed:"


def is_packed_folder(folder: str | Path) -> bool:
    return (Path(folder) / PACKED_FILE).is_file()


def write_packed(gguf_path: Path, model: Any, out: Path) -> dict[str, int]:
    """Save ``model``'s weights (de-quantized from ``gguf_path`` by transformers) into
    ``out/packed.safetensors``; returns how many tensors each storage took (a GGUF block type
    such as ``Q4_1``, or ``bfloat16``, ``float16``, ``float32``)."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from safetensors.torch import save_file

    weights = _unique_state(model)
    blocks = _row_blocks(model, GGUFReader(str(gguf_path)))
    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    counts: dict[str, int] = {}
    for name, weight in weights.items():
        found = blocks.get(name)
        if found is not None:
            raw, kind = found
            packed = torch.from_numpy(np.array(raw, copy=True, order="C"))
            try:
                values = dequantize_blocks(packed, kind.name)
                same = values.numel() == weight.numel() and torch.equal(
                    values.reshape(weight.shape), weight.detach().float()
                )
            except (ValueError, NotImplementedError, KeyError, RuntimeError):
                same = False
            if same:
                tensors[name] = packed
                metadata[_PACKED_PREFIX + name] = json.dumps([kind.name, list(weight.shape)])
                counts[kind.name] = counts.get(kind.name, 0) + 1
                continue
        tensors[name] = exact_narrow(weight, (torch.bfloat16, torch.float16))
        kind_name = str(tensors[name].dtype).removeprefix("torch.")
        counts[kind_name] = counts.get(kind_name, 0) + 1
    save_file(tensors, str(out / PACKED_FILE), metadata=metadata)
    return counts


def exact_narrow(weight: Any, dtypes: tuple[Any, ...]) -> Any:
    """``weight`` in the first of ``dtypes`` that holds its values exactly, else in float32."""
    import torch

    full = weight.detach().float().contiguous()
    return next((narrow for narrow in (full.to(dtype) for dtype in dtypes) if torch.equal(narrow.float(), full)), full)


Q8_BLOCK = 32  # values in a Q8_0 block


def quantize_q8_0(weight: Any) -> Any:
    """GGUF Q8_0 blocks of a float tensor whose last dimension splits into blocks of 32 (the
    ``gguf`` package's own quantizer), as uint8 rows: per block a float16 scale and 32 signed
    bytes. ``dequantize_blocks(..., "Q8_0")`` gives back the rounded values."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    values = weight.detach().float().cpu().numpy()
    blocks = quantize(values.reshape(values.shape[0] if values.ndim > 1 else 1, -1), GGMLQuantizationType.Q8_0)
    return torch.from_numpy(np.ascontiguousarray(blocks))


def pack_model_folder(model: Any, out: Path) -> dict[str, int]:
    """Save a trained model's weights into ``out/packed.safetensors``: weight matrices in Q8_0
    blocks, anything else (norms, biases, rows that are not whole blocks) in full, float16 or
    bfloat16 when that holds the values exactly. Returns how many tensors each storage took."""
    import torch
    from safetensors.torch import save_file

    tensors: dict[str, Any] = {}
    metadata: dict[str, str] = {}
    counts: dict[str, int] = {}
    for name, weight in _unique_state(model).items():
        if weight.dim() == 2 and weight.is_floating_point() and weight.shape[-1] % Q8_BLOCK == 0:
            tensors[name] = quantize_q8_0(weight)
            metadata[_PACKED_PREFIX + name] = json.dumps(["Q8_0", list(weight.shape)])
            kind = "Q8_0"
        else:
            full = weight.detach().contiguous()
            if full.is_floating_point():
                full = exact_narrow(full, (torch.float16, torch.bfloat16))
            tensors[name] = full
            kind = str(full.dtype).removeprefix("torch.")
        counts[kind] = counts.get(kind, 0) + 1
    save_file(tensors, str(out / PACKED_FILE), metadata=metadata)
    # safetensors writes the file private (0600); a model folder is read by whoever runs it.
    (out / PACKED_FILE).chmod(0o644)
    return counts


def read_packed(folder: str | Path, dtype: Any) -> dict[str, Any]:
    """The folder's weights as a state dict in ``dtype``, de-quantizing the packed ones."""
    import torch
    from safetensors import SafetensorError, safe_open

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    state: dict[str, Any] = {}
    path = Path(folder) / PACKED_FILE
    try:
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {}
            for name in file.keys():
                tensor = file.get_tensor(name)
                packed = metadata.get(_PACKED_PREFIX + name)
                if packed is not None:
                    kind, shape = json.loads(packed)
                    tensor = dequantize_blocks(tensor, kind).reshape(shape)
                state[name] = tensor.to(dtype)
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as error:
        reason = " ".join(str(error).split()) or type(error).__name__
        message = damaged_folder(Path(folder), reason)
        if is_converted_copy(Path(folder)):
            raise DamagedCopy(message, Path(folder), reason) from error
        raise ModelLoadError(message) from error
    return state


class DamagedCopy(ModelLoadError):
    """A GGUF file's converted copy (in the cache) whose weights cannot be read: loading the
    GGUF file again removes ``folder`` and converts it anew."""

    def __init__(self, message: str, folder: Path, reason: str) -> None:
        super().__init__(message)
        self.folder = folder
        self.reason = reason  # what could not be read, on one line


def is_converted_copy(folder: Path) -> bool:
    """Whether ``folder`` is a GGUF file's converted copy in the cache."""
    from chatcore.gguf import cache_root

    return folder.resolve().parent == cache_root().resolve()


def damaged_folder(folder: Path, reason: str) -> str:
    """One line for a packed folder whose weights cannot be read, saying how to mend it: a
    GGUF file's converted copy (in the cache) is removed and made anew on the next load; a
    folder from ``chatcore models pack`` is packed again."""
    if is_converted_copy(folder):
        return (
            f"the converted copy of this GGUF model, {str(folder)!r}, is damaged ({reason}): remove it with "
            f"`chatcore models rm {folder.name}` and the next load converts the GGUF file again"
        )
    return f"packed model {str(folder)!r} cannot be read ({reason}): pack it again with `chatcore models pack`"


def dequantize_blocks(blocks: Any, kind: str) -> Any:
    """The float32 values of GGUF blocks of type ``kind`` (a uint8 tensor whose last dimension is
    a row's bytes). Q4_0, Q4_1 and Q8_0 are computed in torch, as the ``gguf`` package computes
    them (a float16 scale times each quant, plus a float16 minimum for Q4_1, in float32); other
    types go through the ``gguf`` package. Either way a tensor is only stored packed when this
    gives back the exact weights transformers built (``write_packed`` checks)."""
    import torch

    layout = _TORCH_BLOCKS.get(kind)
    if layout is None:
        import numpy as np
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(blocks.numpy(), GGMLQuantizationType[kind])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    size, has_minimum = layout
    rows = blocks.reshape(-1, size)
    scale = rows[:, 0:2].contiguous().view(torch.float16).float()
    start = 4 if has_minimum else 2
    if kind == "Q8_0":
        quants = rows[:, start:].contiguous().view(torch.int8).float()
    else:
        nibbles = rows[:, start:]
        quants = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=1).float()
        if not has_minimum:
            quants = quants - 8
    values = scale * quants
    if has_minimum:
        values = values + rows[:, 2:4].contiguous().view(torch.float16).float()
    return values


# Block types computed in torch: block size in bytes, whether a block has a minimum.
_TORCH_BLOCKS = {"Q4_0": (18, False), "Q4_1": (20, True), "Q8_0": (34, False)}


def load_packed_model(folder: str | Path, dtype: Any) -> Any:
    """A causal LM built from the folder's config and its packed weights."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    config = AutoConfig.from_pretrained(str(folder))
    state = read_packed(folder, dtype)
    try:
        model_class: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError as error:
        raise ModelLoadError(f"converted model {str(folder)!r}: no causal LM for {config.model_type!r}") from error
    model = model_class.from_pretrained(None, config=config, state_dict=state, dtype=dtype)
    generation = Path(folder) / "generation_config.json"
    if generation.is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(folder))
    return model


def _unique_state(model: Any) -> dict[str, Any]:
    """The model's saved weights, a tied weight once (under its first name)."""
    seen: set[int] = set()
    unique: dict[str, Any] = {}
    for name, tensor in model.state_dict().items():
        key = tensor.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        unique[name] = tensor
    return unique


def _row_blocks(model: Any, reader: Any) -> dict[str, tuple[Any, Any]]:
    """Each quantized GGUF tensor's blocks under the model's weight name, with its rows put in
    the order transformers puts the de-quantized rows (its tensor processor reorders whole rows,
    which a row of blocks follows). A tensor transformers' processor cannot take raw blocks for
    is left out and stored in full."""
    from gguf import GGMLQuantizationType
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    full_types = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
    config = model.config.to_dict()  # the settings transformers read from the file, under its own names
    field = reader.get_field("general.architecture")
    architecture = field.contents() if field is not None else ""
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config)
    mapping = get_gguf_hf_weights_map(model, processor)
    found: dict[str, tuple[Any, Any]] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type in full_types:
            continue
        try:
            result = processor.process(
                weights=tensor.data,
                name=tensor.name,
                tensor_key_mapping=mapping,
                parsed_parameters={"config": config, "tensors": {}},
            )
        except Exception:  # a converter that needs float values: the tensor is stored in full
            continue
        if result.name in mapping:
            found[mapping[result.name]] = (result.weights, tensor.tensor_type)
    return found


# Ordinary chat text, to show how far packing moves a model's log-probabilities.
SAMPLE_TEXT = (
    "Hi! How was your weekend? It was lovely, thanks. We walked by the river and had lunch at a "
    "small place that makes fresh bread every morning. Do you like cooking? I do, mostly soups and "
    "pasta, and I am learning to bake. What music do you listen to while you work? Mostly jazz, "
    "sometimes old rock songs. Have you seen any good films lately? Not really, I have been reading more."
)


@dataclass
class PackShift:
    """How much packing moved a model's scores of the sample text's next tokens."""

    tokens: int
    perplexity_before: float
    perplexity_after: float
    mean_shift: float  # mean |change| of the log-probability of each actual next token, nats
    largest_shift: float


def packing_shift(before: Any, after: Any, tokenizer: Any, text: str = SAMPLE_TEXT) -> PackShift:
    """Score ``text`` with the model before and after packing (both on the CPU in float32);
    only as much of it as the model's positions hold."""
    import torch

    from chatcore.models import max_positions_of

    ids = torch.tensor([tokenizer(text)["input_ids"][: max_positions_of(before.config)]])
    scores = []
    with torch.no_grad():
        for model in (before, after):
            logits = model(input_ids=ids).logits[0, :-1].float()
            scores.append(torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0])
    shift = (scores[1] - scores[0]).abs()
    return PackShift(
        tokens=int(shift.numel()),
        perplexity_before=float(torch.exp(-scores[0].mean())),
        perplexity_after=float(torch.exp(-scores[1].mean())),
        mean_shift=float(shift.mean()),
        largest_shift=float(shift.max()),
    )
