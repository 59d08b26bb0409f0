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


class GrowingPast:
    """A past that grows one position per step, in one preallocated buffer.

    PPLM's perturbed past takes the step's deltas on its most recent positions and then
    the fed token's keys and values, at every step. Kept as per-layer tensors, each step
    would copy the whole past twice (add the deltas, append a position); in a buffer
    (2 * layers, B, H, capacity, D) both are writes of the changed positions only, and
    the past a pass reads is a view. The buffer doubles when it is full.
    """

    def __init__(self, past: Past, capacity: int = 0) -> None:
        import torch

        keys = past[0][0]
        batch, heads, length, head_dim = keys.shape
        self.buffer = torch.empty(
            (2 * len(past), batch, heads, max(capacity, length + 1), head_dim), dtype=keys.dtype, device=keys.device
        )
        for index, (layer_keys, layer_values) in enumerate(past):
            self.buffer[2 * index, :, :, :length] = layer_keys
            self.buffer[2 * index + 1, :, :, :length] = layer_values
        self.length = length

    def view(self, length: int | None = None) -> Past:
        """The first ``length`` (default: all) positions, as per-layer views of the buffer."""
        end = self.length if length is None else length
        layers = self.buffer[:, :, :, :end].unbind(0)
        return [(layers[i], layers[i + 1]) for i in range(0, len(layers), 2)]

    def add_recent(self, deltas: "torch.Tensor", rows: "torch.Tensor | None" = None, first_layer: int = 0) -> None:
        """Add (2 * layers', B, H, W, D) deltas of the layers from ``first_layer`` up to the
        most recent W positions, in place (with ``rows``: deltas (2 * layers', b, H, W, D) of
        those rows only)."""
        window = deltas.size(3)
        recent = slice(self.length - window, self.length)
        layers = slice(2 * first_layer, 2 * first_layer + deltas.size(0))
        if rows is None:
            self.buffer[layers, :, :, recent] += deltas.to(self.buffer.dtype)
        else:
            self.buffer[layers, rows, :, recent] += deltas.to(self.buffer.dtype)

    def add_recent_products(
        self,
        key_a: "torch.Tensor",
        key_b: "torch.Tensor",
        value_a: "torch.Tensor",
        value_b: "torch.Tensor",
        first_layer: int = 0,
    ) -> None:
        """Add deltas given as products, ``key_a @ key_b`` per layer from ``first_layer`` up
        ((layers', B, H, W, r) @ (layers', B, H, r, D)) and the same for values, to the most
        recent W positions, in place, without building the deltas."""
        window = key_a.size(3)
        recent = slice(self.length - window, self.length)
        for index in range(key_a.size(0)):
            for offset, (a, b) in enumerate(((key_a, key_b), (value_a, value_b))):
                target = self.buffer[2 * (first_layer + index) + offset, :, :, recent].flatten(0, 1)  # a view
                target.baddbmm_(a[index].flatten(0, 1).to(target.dtype), b[index].flatten(0, 1).to(target.dtype))

    def append(self, new: Past) -> None:
        """Append one position: per layer the (B, H, 1, D) keys and values."""
        import torch

        if self.length + 1 > self.buffer.size(3):
            grown = self.buffer.new_empty((*self.buffer.shape[:3], 2 * self.buffer.size(3), self.buffer.size(4)))
            grown[:, :, :, : self.length] = self.buffer[:, :, :, : self.length]
            self.buffer = grown
        self.buffer[:, :, :, self.length : self.length + 1] = torch.stack([t for pair in new for t in pair])
        self.length += 1
