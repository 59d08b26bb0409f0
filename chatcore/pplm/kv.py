"""Key/value caches as lists of plain tensors, and fresh caches built from them.

A transformers forward pass appends to the cache it is given, in place. PPLM runs the
model several times from the same (perturbed) past, so it keeps the past as tensors and
builds a new cache for every pass: a cache is never reused once a forward has seen it.

``Past = list[tuple[keys, values]]``, one pair per layer, each (B, H, L, D).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

Past = list[tuple["torch.Tensor", "torch.Tensor"]]


def past_of(cache: Any, length: int | None = None) -> Past:
    """The per-layer (keys, values) of ``cache``, the first ``length`` positions only if given.

    The tensors are views of the cache's own: transformers' DynamicCache replaces (never
    writes into) its tensors when it grows, so the views stay valid after later passes.
    """
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"pplm needs a transformers Cache with per-layer tensors, got {type(cache).__name__}")
    past: Past = []
    for layer in layers:
        keys, values = layer.keys, layer.values
        if length is not None:
            keys, values = keys[:, :, :length], values[:, :, :length]
        past.append((normal(keys), normal(values)))
    return past


def normal(tensor: "torch.Tensor") -> "torch.Tensor":
    """``tensor`` itself, or a copy if it was made under inference mode (such tensors
    cannot take part in a computation that is differentiated)."""
    if tensor.is_inference():
        import torch

        with torch.inference_mode(False):
            return tensor.clone()
    return tensor


def fresh_cache(past: Past, config: Any = None) -> Any:
    """A new DynamicCache holding ``past`` (the tensors are not copied; the cache
    concatenates new positions onto new tensors, leaving these untouched)."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=list(past), config=config)


def past_length(past: Past) -> int:
    return int(past[0][0].size(2))


def select_rows(past: Past, rows: "torch.Tensor") -> Past:
    return [(keys.index_select(0, rows), values.index_select(0, rows)) for keys, values in past]
