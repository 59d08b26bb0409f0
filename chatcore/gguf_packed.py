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
"""

from __future__ import annotations

import json
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
        full = weight.detach().float().contiguous()
        tensors[name] = next(
            (
                narrow
                for narrow in (full.to(torch.bfloat16), full.to(torch.float16))
                if torch.equal(narrow.float(), full)
            ),
            full,
        )
        kind_name = str(tensors[name].dtype).removeprefix("torch.")
        counts[kind_name] = counts.get(kind_name, 0) + 1
    save_file(tensors, str(out / PACKED_FILE), metadata=metadata)
    return counts


def read_packed(folder: str | Path, dtype: Any) -> dict[str, Any]:
    """The folder's weights as a state dict in ``dtype``, de-quantizing the packed ones."""
    import torch
    from safetensors import safe_open

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
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise ModelLoadError(f"converted model {str(folder)!r} cannot be read: {error}") from error
    return state


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
