"""The shared batch's key/value cache: a slot per row, no padding to the longest row.

Each row of the shared batch owns a slot of a preallocated buffer per layer,

    keys, values: (slots, H, capacity, D)    row r's tokens in columns [0, lengths[r])

so a decoding step writes one column per row in place (no copy of the whole cache, as a
growing ``DynamicCache`` makes at every step) and a row that leaves frees its slot by
moving the rows after it up. The model sees an ordinary transformers ``Cache``; the step
passes a 4-D mask that hides each row's unused columns, so any attention implementation
reads the right keys.

Rows of very different lengths (one long history beside short chats) would still make
every row attend over the longest one's columns. :func:`ragged_plan` splits the step's
attention: one SDPA call for every row over the first ``width`` columns (the short rows'
longest), and one call per longer row over its own columns only. With the model's
attention implementation ``sdpa`` the batch's step swaps in :func:`ragged_attention` for
its own pass (:func:`ragged_pass`); any other implementation reads the padded columns,
masked, and gets the same result.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transformers.cache_utils import Cache, CacheLayerMixin

from chatcore.decoding import to_device

if TYPE_CHECKING:
    import torch

RAGGED = "chatcore_ragged"
# One extra attention call per long row costs about as much as attending over this many
# more columns for every row (measured on the CPU: bench/serve_speed.py --only long-row).
CALL_COST_COLUMNS = 64


@dataclass(frozen=True)
class RaggedPlan:
    """How one step's attention is split: every row over ``width`` columns, then each of
    ``long_rows`` (row, length) over its own ``length`` columns."""

    width: int
    long_rows: tuple[tuple[int, int], ...]


def ragged_plan(lengths: list[int]) -> RaggedPlan:
    """The cheapest split for rows of these lengths (columns each attends over, its new token included):
    minimise rows x width + the long rows' own lengths (+ a call's cost each)."""
    rows = len(lengths)
    best_cost, best_width = rows * max(lengths), max(lengths)
    for width in sorted(set(lengths)):
        longer = [length for length in lengths if length > width]
        cost = rows * width + sum(longer) + CALL_COST_COLUMNS * len(longer)
        if cost < best_cost:
            best_cost, best_width = cost, width
    long_rows = tuple((row, length) for row, length in enumerate(lengths) if length > best_width)
    return RaggedPlan(best_width, long_rows)


def ragged_attention(
    module: Any,
    query: "torch.Tensor",
    key: "torch.Tensor",
    value: "torch.Tensor",
    attention_mask: "torch.Tensor | None",
    **kwargs: Any,
) -> tuple["torch.Tensor", None]:
    """SDPA split by the step's :class:`RaggedPlan` (passed as ``chatcore_ragged``); plain
    SDPA without one (the model called from elsewhere meanwhile)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plan: RaggedPlan | None = kwargs.pop(RAGGED, None)
    if plan is None or query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    width = plan.width
    mask = attention_mask[..., :width] if attention_mask is not None else None
    output, _ = sdpa_attention_forward(module, query, key[:, :, :width], value[:, :, :width], mask, **kwargs)
    for row, length in plan.long_rows:  # (B, 1, H, D) outputs
        keys, values = key[row : row + 1, :, :length], value[row : row + 1, :, :length]
        alone, _ = sdpa_attention_forward(module, query[row : row + 1], keys, values, None, **kwargs)
        output[row : row + 1] = alone
    return output, None


_REGISTERED = False


@contextlib.contextmanager
def ragged_pass(model: Any, plan: RaggedPlan) -> Iterator[dict[str, Any]]:
    """For one forward pass of ``model``: the keyword arguments that carry ``plan`` to its
    attention, with :func:`ragged_attention` swapped in when the model uses ``sdpa``
    (otherwise nothing changes: the mask alone keeps the result right)."""
    global _REGISTERED
    config = model.config
    if not plan.long_rows or getattr(config, "_attn_implementation", None) != "sdpa":
        yield {}
        return
    if not _REGISTERED:
        from transformers import AttentionInterface

        AttentionInterface.register(RAGGED, ragged_attention)
        _REGISTERED = True
    # The internal field, not the property: its setter would walk and validate sub-configs at every step.
    config._attn_implementation_internal = RAGGED
    try:
        yield {RAGGED: plan}
    finally:
        config._attn_implementation_internal = "sdpa"


PACKED = "chatcore_packed"
# One more attention call costs about as much as this many attention scores (a CPU SDPA
# call's fixed cost against scores of 64-wide heads).
CALL_COST_SCORES = 4096
# On a GPU the scores are nearly free and a call is not: its launches (a few concatenations,
# the mask's columns, the attention) cost the host about what the card spends on a million
# scores of a 1.7B model, so prompts are split only past a very long cached history.
CALL_COST_SCORES_GPU = 1 << 20


@dataclass(frozen=True)
class PackedPlan:
    """Prompts laid end to end in one pass (see chatcore.serving.packed_prompts):
    per prompt, ``(past_start, past_end, new_start, new_end)``: its cached keys' columns, and
    its new tokens' rows (their keys' columns are ``past_total`` further on)."""

    past_total: int
    segments: tuple[tuple[int, int, int, int], ...]


def packed_plan(past: list[int], new: list[int], call_cost: int = CALL_COST_SCORES) -> PackedPlan | None:
    """How to split the attention of prompts with ``past`` cached and ``new`` new tokens laid
    end to end: each prompt's queries over its own keys only, when that reads well under the
    one masked call over every key (long cached prefixes); None when one call is cheaper.
    ``call_cost``: what one more call costs, in attention scores (:data:`CALL_COST_SCORES`
    on the CPU, :data:`CALL_COST_SCORES_GPU` on a GPU)."""
    total_past, total_new = sum(past), sum(new)
    whole = total_new * (total_past + total_new)
    split = sum(n * (p + n) for p, n in zip(past, new)) + call_cost * len(new)
    if whole <= 2 * split:
        return None
    segments, past_start, new_start = [], 0, 0
    for p, n in zip(past, new):
        segments.append((past_start, past_start + p, new_start, new_start + n))
        past_start, new_start = past_start + p, new_start + n
    return PackedPlan(total_past, tuple(segments))


def packed_attention(
    module: Any,
    query: "torch.Tensor",
    key: "torch.Tensor",
    value: "torch.Tensor",
    attention_mask: "torch.Tensor | None",
    **kwargs: Any,
) -> tuple["torch.Tensor", None]:
    """SDPA per prompt of a :class:`PackedPlan` (passed as ``chatcore_packed``): each prompt's
    queries over its cached and new keys, with the columns of the step's mask that belong to
    them (so the result is the one masked call's); plain SDPA without a plan."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plan: PackedPlan | None = kwargs.pop(PACKED, None)
    if plan is None or attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outputs = []
    offset = plan.past_total
    for past_start, past_end, new_start, new_end in plan.segments:
        columns = [slice(past_start, past_end), slice(offset + new_start, offset + new_end)]
        keys = torch.cat([key[:, :, c] for c in columns], dim=2)
        values = torch.cat([value[:, :, c] for c in columns], dim=2)
        rows = attention_mask[:, :, new_start:new_end]
        mask = torch.cat([rows[..., c] for c in columns], dim=-1)
        output, _ = sdpa_attention_forward(module, query[:, :, new_start:new_end], keys, values, mask, **kwargs)
        outputs.append(output)  # (1, t, H, D)
    return torch.cat(outputs, dim=1), None


def _register(name: str, function: Any) -> None:
    if name not in _REGISTERED_NAMES:
        from transformers import AttentionInterface

        AttentionInterface.register(name, function)
        _REGISTERED_NAMES.add(name)


_REGISTERED_NAMES: set[str] = set()


@contextlib.contextmanager
def packed_pass(model: Any, plan: PackedPlan | None) -> Iterator[dict[str, Any]]:
    """For one packed prompt pass of ``model``: the keyword arguments that carry ``plan`` to its
    attention, with :func:`packed_attention` swapped in when the model uses ``sdpa`` and a
    plan was made (otherwise the mask alone keeps the result right)."""
    config = model.config
    if plan is None or getattr(config, "_attn_implementation", None) != "sdpa":
        yield {}
        return
    _register(PACKED, packed_attention)
    config._attn_implementation_internal = PACKED
    try:
        yield {PACKED: plan}
    finally:
        config._attn_implementation_internal = "sdpa"


class SlotLayer(CacheLayerMixin):
    """One layer's slots: (slots, H, capacity, D) keys and values, written one column per row per step."""

    is_sliding = False

    def __init__(self, owner: "SlotCache") -> None:
        super().__init__()
        self.owner = owner
        self.is_initialized = True

    def lazy_initialization(self, key_states: "torch.Tensor", value_states: "torch.Tensor") -> None:
        pass

    def update(
        self, key_states: "torch.Tensor", value_states: "torch.Tensor", *args: Any, **kwargs: Any
    ) -> tuple["torch.Tensor", "torch.Tensor"]:
        owner = self.owner
        assert key_states.shape[2] == 1, "the shared batch is fed one token per row"
        assert self.keys is not None and self.values is not None
        rows, columns = owner.step_rows, owner.step_columns
        self.keys[rows, :, columns] = key_states[:, :, 0]  # (B, H, D) into each row's next column
        self.values[rows, :, columns] = value_states[:, :, 0]
        count, width = owner.rows, owner.step_width
        return self.keys[:count, :, :width], self.values[:count, :, :width]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.step_width, 0

    def get_seq_length(self) -> int:
        return max(self.owner.lengths, default=0)

    def get_max_length(self) -> int:
        return -1


class SlotCache(Cache):
    """Key/values of the shared batch's rows, a slot each (see the module's docstring)."""

    def __init__(self, layers: int) -> None:
        self.slots = [SlotLayer(self) for _ in range(layers)]
        super().__init__(layers=list(self.slots))
        self.lengths: list[int] = []  # tokens cached per row
        self.step_rows: Any = None
        self.step_columns: Any = None
        self.step_width = 0

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def _reserve(self, rows: int, columns: int, like: list[tuple["torch.Tensor", "torch.Tensor"]]) -> None:
        """Room for ``rows`` rows of ``columns`` tokens, grown by doubling so that steps seldom copy;
        ``like``: a (1, H, T, D) tensor pair per layer, for the shapes of a first allocation."""
        import torch

        first = self.slots[0].keys
        slots, capacity = (first.shape[0], first.shape[2]) if first is not None else (0, 0)
        if slots >= rows and capacity >= columns:
            return
        if slots < rows:
            slots = max(rows, 2 * slots)
        if capacity < columns:
            capacity = max(columns, 2 * capacity, 64)
        used = max(self.lengths, default=0)
        for layer, (keys, _) in zip(self.slots, like):
            for name in ("keys", "values"):
                old = getattr(layer, name)
                _, heads, _, dim = keys.shape
                new = torch.zeros((slots, heads, capacity, dim), dtype=keys.dtype, device=keys.device)
                if old is not None:
                    new[: self.rows, :, :used] = old[: self.rows, :, :used]
                setattr(layer, name, new)

    def append(self, layers: list[tuple["torch.Tensor", "torch.Tensor"]], rows: int) -> None:
        """Add ``rows`` rows that share one prompt's key/values ((1, H, T, D) per layer)."""
        import torch

        with torch.inference_mode():  # the buffers are inference tensors, as every pass over them
            self._append(layers, rows)

    def _append(self, layers: list[tuple["torch.Tensor", "torch.Tensor"]], rows: int) -> None:
        length = layers[0][0].shape[2]
        start = self.rows
        self._reserve(start + rows, length + 1, layers)
        for layer, (keys, values) in zip(self.slots, layers):
            assert layer.keys is not None and layer.values is not None
            layer.keys[start : start + rows, :, :length] = keys
            layer.values[start : start + rows, :, :length] = values
        self.lengths.extend([length] * rows)

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (ascending), moved up to the first slots in that order; the rest are freed."""
        import torch

        if rows == list(range(len(rows))):  # the rows kept are first already: nothing moves
            del self.lengths[len(rows) :]
            return
        lengths = [self.lengths[row] for row in rows]
        used = max(lengths)
        with torch.inference_mode():
            index = to_device(rows, self.slots[0].keys)
            for layer in self.slots:
                assert layer.keys is not None and layer.values is not None
                layer.keys[: len(rows), :, :used] = layer.keys[index, :, :used]  # gathered: a copy
                layer.values[: len(rows), :, :used] = layer.values[index, :, :used]
        self.lengths = lengths

    def row(self, index: int) -> list[tuple["torch.Tensor", "torch.Tensor"]]:
        """Row ``index``'s key/values: (1, H, length, D) views per layer."""
        length = self.lengths[index]
        return [
            (layer.keys[index : index + 1, :, :length], layer.values[index : index + 1, :, :length])  # type: ignore[index]
            for layer in self.slots
        ]

    def begin_step(self, device: Any) -> tuple["torch.Tensor", "torch.Tensor", RaggedPlan]:
        """Before a step: each row's position (B, 1), the (B, 1, 1, width) additive mask, and the attention's split."""
        import torch

        lengths = self.lengths
        width = max(lengths) + 1
        first = self.slots[0].keys
        assert first is not None
        self._reserve(self.rows, width, [(layer.keys, layer.values) for layer in self.slots])  # type: ignore[misc]
        self.step_rows = torch.arange(self.rows, device=device)
        self.step_columns = torch.tensor(lengths, dtype=torch.long, device=device)
        self.step_width = width
        dtype = first.dtype
        visible = torch.arange(width, device=device)[None, :] <= self.step_columns[:, None]  # (B, width)
        mask = torch.zeros(visible.shape, dtype=dtype, device=device)
        mask.masked_fill_(~visible, torch.finfo(dtype).min)
        plan = ragged_plan([length + 1 for length in lengths])
        return self.step_columns[:, None], mask[:, None, None, :], plan

    def end_step(self) -> None:
        self.lengths = [length + 1 for length in self.lengths]
