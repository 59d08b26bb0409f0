"""The fast path: the shared batch's decode step with fixed shapes, captured on a GPU.

The shared batch (:class:`chatcore.serving.shared_batch.SharedBatch`) holds rows whose steerers
all edit scores only (``shares_batch = True``): the model's pass is the whole of their
step, and their steerers, the decoder's processors and the sampler run on its logits
afterwards. That pass is what this module makes fast. Its shapes are fixed per
batch-size bucket (:data:`BUCKETS`):

    staged (2, bucket)            each row's newest token and its position (the tokens it
                                  has cached); padding rows: token 0 at position 0
    keys, values (slots, H, capacity, D) per layer: the slot cache's own buffers

and the pass itself builds each row's mask (0 over its own columns and its new one, -inf
elsewhere) from the positions, so a step is one copy of ``staged`` and one launch;
the new key/value is written at each row's own column (per-row positions, so rows of
different lengths share the step: transformers' ``StaticCache`` writes one
``cache_position`` for every row, which does not fit). Padding rows write into free
slots at column 0 and attend to that column only; their logits are dropped.

With fixed shapes and fixed buffers, a CUDA device captures the pass once per bucket
(and per buffer allocation: the slot cache grows by doubling, so seldom) as a
``torch.cuda.CUDAGraph`` and replays it: one launch instead of a few hundred kernel
launches and the Python between them. A step's graphs share one memory pool. A batch
that empties hands its step, with its graphs and its slot buffers, back to a per-model
pool (:func:`take_static_step`, :func:`hand_back`), so the next batch on that model (the
scheduler's next burst, or the next reply of ``engine.respond``, which builds a runner
of its own) replays the graphs instead of capturing them again. Two batches at once on one model each get a step.
Elsewhere the same step runs eagerly, which is how its positions and masks are tested on
the CPU. A capture that fails logs one debug line and the step runs eagerly from then on.

Replies with a step steerer (PPLM, CoCon, activation steering: ``shares_batch = False``)
never reach this step: they run eagerly beside the batch with caches of their own.

``CHATCORE_FAST_PATH`` selects it: ``auto`` (default: on CUDA devices only; on the CPU
the growing slot cache's ragged step attends over fewer columns and is not slower),
``on`` (everywhere, eagerly off CUDA), ``compile`` (as ``on``, with the model's pass
compiled by ``torch.compile`` first, which fuses its small kernels and, its weights read
as constants, its projections of one input: fewer launches in each captured graph, for
more device memory; the first replies of a process wait for the compilation), ``off``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transformers.cache_utils import Cache, CacheLayerMixin

from chatcore.decoding import to_device
from chatcore.errors import ChatcoreError
from chatcore.fast_path_setting import FAST_PATH_ENV as FAST_PATH_ENV
from chatcore.fast_path_setting import FAST_PATH_MODES as FAST_PATH_MODES
from chatcore.fast_path_setting import compile_failure, fast_path_mode

if TYPE_CHECKING:
    import torch

    from chatcore.serving.slots import SlotCache

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32)
COMPILING = (
    "fast path: compiling the decode step (CHATCORE_FAST_PATH=compile); "
    "the first replies wait for it: seconds for a small model, a minute or more for a large one"
)
# ``compile`` reads the weights as constants (inductor's freezing; the step runs in inference
# mode), so that projections of one input (queries, keys and values; an MLP's gate and up)
# fold into one matrix product each: fewer, larger kernels in each captured graph. The folded
# weights are copies: more device memory (for a Llama, about 60 % of its weights' bytes).
# False compiles without (benchmarks compare the two).
FREEZE = True
# Attention implementations that honour a 4-D additive mask (flash attention reads lengths instead).
MASKED_ATTENTION = ("sdpa", "eager")


def bucket_for(rows: int) -> int | None:
    """The smallest bucket that holds ``rows`` rows (None: more rows than the largest)."""
    return next((bucket for bucket in BUCKETS if bucket >= rows), None)


class FixedLayer(CacheLayerMixin):
    """One layer's slot buffers as the fixed step sees them: every row's column written in place."""

    is_sliding = False

    def __init__(self, owner: FixedSlots, index: int) -> None:
        super().__init__()
        self.owner = owner
        self.index = index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        owner = self.owner
        keys, values = owner.buffers[self.index]
        rows, columns = owner.rows, owner.columns
        keys[rows, :, columns] = key_states[:, :, 0]  # (bucket, H, D) into each row's next column
        values[rows, :, columns] = value_states[:, :, 0]
        bucket = rows.shape[0]
        return keys[:bucket], values[:bucket]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.capacity, 0

    def get_seq_length(self) -> int:
        return self.owner.capacity - 1  # the positions come from position_ids: a constant keeps the graph fixed

    def get_max_length(self) -> int:
        return self.owner.capacity


class FixedSlots(Cache):
    """The slot cache's buffers under fixed-shape inputs: ``rows`` (bucket,) and ``columns`` (bucket,),
    the positions row of ``staged`` (2, bucket)."""

    def __init__(self, buffers: list[tuple[torch.Tensor, torch.Tensor]], staged: torch.Tensor) -> None:
        import torch

        self.buffers = buffers
        keys = buffers[0][0]
        self.rows = torch.arange(staged.shape[1], device=keys.device)
        self.columns = staged[1]
        self.every_column = torch.arange(int(keys.shape[2]), device=keys.device)
        super().__init__(layers=[FixedLayer(self, index) for index in range(len(buffers))])

    @property
    def capacity(self) -> Any:
        """The buffers' columns: read from their shape, so that a compiled step keeps it symbolic."""
        return self.buffers[0][0].shape[2]


@dataclass
class FixedInputs:
    """One bucket's fixed tensors: what a captured graph reads and writes."""

    cache: FixedSlots
    staged: torch.Tensor  # (2, bucket): tokens, positions
    logits: torch.Tensor | None = None  # (bucket, 1, V): the captured graph's output
    graph: Any = None  # torch.cuda.CUDAGraph once captured


class StaticStep:
    """The shared batch's fixed-shape decode step (see the module's docstring)."""

    def __init__(self, model: Any, cache_argument: str, capture: bool, compiled: bool = False) -> None:
        # Weakly: the idle pool is keyed by the model, and a strong reference here would keep
        # the model (and its buffers) alive for as long as its step waits there.
        self._model = weakref.ref(model)
        self.cache_argument = cache_argument
        self.capture = capture
        self.compiled = compiled
        self.wanted_compiled = compiled  # as asked: ``compiled`` turns False if compiling fails
        self.frozen = compiled and FREEZE  # compiled with the weights read as constants
        self._pass: Any = None  # the compiled model, once made
        self.inputs: dict[int, FixedInputs] = {}
        self.owner: tuple[int, int] | None = None  # (first buffer's address, capacity) the inputs were made for
        self.steps = 0  # steps taken on this path (for tests and benchmarks)
        self.replays = 0  # of them, replays of a captured graph
        self.slots: SlotCache | None = None  # an emptied slot cache kept with its buffers (see hand_back)
        self.pool: Any = None  # the memory pool the step's graphs share
        self._retired: list[Any] = []  # graphs of replaced buffers, released at the next call

    def forward(self, tokens: torch.Tensor, cache: SlotCache) -> torch.Tensor | None:
        """One pass for every row's newest token ``tokens`` (B, 1) over ``cache``: (B, V) float32
        logits, the new key/values written; None (nothing done) when the batch has more rows
        than the largest bucket. The caller advances the cache's lengths."""
        import torch

        rows = cache.rows
        bucket = bucket_for(rows)
        if bucket is None:
            return None
        lengths = cache.lengths
        buffers: list[tuple[torch.Tensor, torch.Tensor]] = [(layer.keys, layer.values) for layer in cache.slots]  # type: ignore[misc]
        cache._reserve(bucket, max(lengths) + 1, buffers)  # room for the padding rows' slots and the new column
        buffers = [(layer.keys, layer.values) for layer in cache.slots]  # type: ignore[misc]
        first = buffers[0][0]
        owner = (first.data_ptr(), int(first.shape[2]))
        # Graphs retired by an earlier call: their last replay came before a pass whose tokens
        # the host has read since (even with a pass run ahead), so it is done.
        self._retired = []
        if owner != self.owner:  # new buffers: every fixed input and graph pointed at the old ones
            self._retired.extend(inputs.graph for inputs in self.inputs.values() if inputs.graph is not None)
            self.inputs.clear()
            self.owner = owner
        inputs = self.inputs.get(bucket)
        if inputs is None:
            staged = torch.zeros((2, bucket), dtype=torch.long, device=first.device)
            inputs = self.inputs[bucket] = FixedInputs(FixedSlots(buffers, staged), staged)
        staged = inputs.staged
        # Copied without waiting for the device: the runner may queue this pass before it has
        # read the previous step's tokens (chatcore.serving.ahead).
        staged[1].copy_(to_device(lengths + [0] * (bucket - rows), staged))
        staged[0, :rows].copy_(tokens[:, 0])
        if rows < bucket:
            staged[0, rows:].zero_()
        self.steps += 1
        if self.capture and inputs.graph is None:
            self._capture(inputs)
        if inputs.graph is not None:
            inputs.graph.replay()
            self.replays += 1
            assert inputs.logits is not None
            logits = inputs.logits
        else:
            logits = self._run(inputs)
        return logits[:rows, -1].to(torch.float32, copy=True)

    @property
    def model(self) -> Any:
        model = self._model()
        if model is None:
            raise ChatcoreError("the fast path's model is gone")
        return model

    def _run(self, inputs: FixedInputs) -> torch.Tensor:
        import torch

        fixed = inputs.cache
        visible = fixed.every_column[None, :] <= fixed.columns[:, None]  # (bucket, capacity)
        dtype = fixed.buffers[0][0].dtype
        mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
        mask = mask.masked_fill(~visible, torch.finfo(dtype).min)[:, None, None, :]
        arguments = dict(
            input_ids=inputs.staged[0][:, None],
            attention_mask=mask,
            position_ids=fixed.columns[:, None],
            use_cache=True,
            logits_to_keep=1,
        )
        arguments[self.cache_argument] = fixed
        if self.compiled:
            _symbolic_sizes(mask, fixed.buffers)
        try:
            with self._compile_settings():
                output = self._model_pass()(**arguments)
        except Exception as error:
            if not self.compiled:
                raise
            # No compiler on this machine, or a model torch.compile cannot take: uncompiled from now on.
            log.warning(
                "fast path: compiling the decode step failed, running it uncompiled: %s", compile_failure(error)
            )
            self.compiled, self._pass = False, None
            output = self.model(**arguments)
        logits: torch.Tensor = output.logits
        return logits

    def _compile_settings(self) -> contextlib.AbstractContextManager[Any]:
        """Inductor's settings while the compiled pass runs (it compiles on its first calls):
        the weights read as constants (:data:`FREEZE`)."""
        if not (self.compiled and self.frozen):
            return contextlib.nullcontext()
        import torch._inductor.config as inductor

        return inductor.patch(freezing=True)

    def _model_pass(self) -> Any:
        """The model, or once made, its compiled pass (``compile``: see the module's docstring)."""
        if not self.compiled:
            return self.model
        if self._pass is None:
            import torch

            log.warning(COMPILING)  # the first replies wait for it: say why
            self._pass = torch.compile(self.model, dynamic=None, fullgraph=False)
        return self._pass

    def _capture(self, inputs: FixedInputs) -> None:
        """Capture the pass as a CUDA graph (warmed up on a side stream, as torch's docs ask).
        The warm-up passes write this step's own key/values, so they change nothing. Other
        threads may use the device meanwhile (``thread_local``)."""
        import torch

        try:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._run(inputs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                inputs.logits = self._run(inputs)
            inputs.graph = graph
        except Exception as error:  # an operation that cannot be captured: run eagerly from now on
            log.debug("fast path: capturing the decode step failed, running it eagerly: %s", error)
            self.capture = False
            inputs.graph = inputs.logits = None


def _symbolic_sizes(mask: torch.Tensor, buffers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Mark the sizes that grow with the slot cache (its slots and columns) symbolic for
    ``torch.compile``, so that the compiled step is not compiled again as they grow (a size
    of 1 stays fixed: torch compiles one row's slot buffer apart)."""
    from torch._dynamo import maybe_mark_dynamic

    maybe_mark_dynamic(mask, 3)
    for pair in buffers:
        for buffer in pair:
            maybe_mark_dynamic(buffer, 0)
            maybe_mark_dynamic(buffer, 2)


def fast_path_on(model: Any, device: Any) -> bool:
    """Whether the shared batch of ``model`` on ``device`` takes the fast path, under
    ``CHATCORE_FAST_PATH`` (a bad value is refused in one line)."""
    mode = fast_path_mode()
    on_cuda = str(device).startswith("cuda")
    if mode == "off" or (mode == "auto" and not on_cuda):
        return False
    if getattr(model.config, "_attn_implementation", None) not in MASKED_ATTENTION:
        log.debug("fast path: attention %r ignores the step's mask; not used", model.config._attn_implementation)
        return False
    return True


# Idle steps by model and device: what a batch that emptied handed back (its graphs and buffers).
_idle: weakref.WeakKeyDictionary[Any, dict[str, StaticStep]] = weakref.WeakKeyDictionary()
_idle_lock = threading.Lock()


def take_static_step(model: Any, device: Any, cache_argument: str) -> StaticStep:
    """The idle step of ``model`` on ``device`` (captured graphs, kept slot buffers), or a new one.
    Call only where :func:`fast_path_on` holds; give it back with :func:`hand_back`."""
    compiled = fast_path_mode() == "compile"
    with _idle_lock:
        kept = _idle.get(model, {}).pop(str(device), None)
    if kept is not None and (kept.wanted_compiled, kept.frozen) == (compiled, compiled and FREEZE):
        return kept
    return StaticStep(model, cache_argument, capture=str(device).startswith("cuda"), compiled=compiled)


def hand_back(model: Any, device: Any, step: StaticStep, slots: SlotCache | None) -> None:
    """An emptied batch's step, with its slot cache (no rows left, buffers kept), for the next
    batch on ``model``; if another batch already handed one back, this one is let go."""
    step.slots = slots if slots is not None and slots.rows == 0 else None
    with _idle_lock:
        _idle.setdefault(model, {}).setdefault(str(device), step)


def idle_static_step(model: Any, device: Any) -> StaticStep | None:
    """The step waiting in the pool for ``model`` on ``device``, if any (for tests and benchmarks)."""
    with _idle_lock:
        return _idle.get(model, {}).get(str(device))
