"""The shared batch: the rows of the replies decoded together, and their key/value slots."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from chatcore.models import cache_keyword
from chatcore.serving.prefix_cache import Layers

if TYPE_CHECKING:
    import torch

    from chatcore.serving.static_step import StaticStep


from chatcore.serving.jobs import Job


class SharedBatch:
    """The rows of the shared replies and their key/value cache, a slot per row.

    Every row keeps its own tokens from column 0 (:class:`chatcore.serving.slots.SlotCache`):
    rows are not padded to the longest, a step writes one column per row in place, and its
    attention reads each row's own columns (a long history costs the other rows next to
    nothing). A reply that ends leaves at once.
    """

    def __init__(self, model: Any, device: Any) -> None:
        self.model = model
        self.device = device
        self.cache_argument = cache_keyword(model)
        self.jobs: list[Job] = []
        # The jobs whose rows the cache holds, in row order: ``jobs`` and those that left since
        # the last pass (their rows are dropped together, before the next one: see leave).
        self._layout: list[Job] = []
        self.cache: Any = None  # a SlotCache once a reply has joined
        self.split_steps = 0  # steps whose attention was split by row length (for tests and benchmarks)
        from chatcore.serving.static_step import fast_path_on

        self.fast_path = fast_path_on(model, device)
        # The fast path's step while rows are in the batch (taken from the model's pool at the
        # first join, handed back when the batch empties); the last one used, after.
        self.static_step: StaticStep | None = None

    def __contains__(self, job: Job) -> bool:
        return job in self.jobs

    def offset(self, job: Job) -> int:
        """The first cache row of ``job``."""
        offset = 0
        for other in self._layout:
            if other is job:
                return offset
            offset += other.rows
        raise KeyError("the reply is not in the batch")

    def join(self, job: Job, cache: Any) -> None:
        """Add a job whose prompt has run, with its cache of one row (every row shares the prompt)."""
        from chatcore.serving.slots import SlotCache

        if self.cache is None:
            if self.fast_path:
                from chatcore.serving.static_step import take_static_step

                self.static_step = take_static_step(self.model, self.device, self.cache_argument)
                self.cache, self.static_step.slots = self.static_step.slots, None
            if self.cache is None:
                self.cache = SlotCache(len(cache.layers))
        self._compact()
        self.cache.append([(layer.keys, layer.values) for layer in cache.layers], job.rows)
        self.jobs.append(job)
        self._layout.append(job)

    def leave(self, job: Job) -> None:
        """Remove ``job`` from the batch. Its rows stay in the cache until the next pass or
        join, which drops the rows of every job that left meanwhile in one move of the rows
        kept (replies that end at the same step do not each move the rows after them)."""
        if job not in self.jobs:
            return
        self.jobs.remove(job)
        if not self.jobs:
            self._layout = []
            self.cache.keep([])
            if self.fast_path and self.static_step is not None:  # its graphs and buffers, for the next batch
                from chatcore.serving.static_step import hand_back

                hand_back(self.model, self.device, self.static_step, self.cache)
            self.cache = None  # off the fast path, its buffers go with it

    def _compact(self) -> None:
        """Drop the rows of the jobs that left since the last pass (see leave)."""
        if self.cache is None or len(self._layout) == len(self.jobs):
            return
        kept: list[int] = []
        offset = 0
        for job in self._layout:
            if job in self.jobs:
                kept.extend(range(offset, offset + job.rows))
            offset += job.rows
        self.cache.keep(kept)
        self._layout = list(self.jobs)

    def layers_of(self, job: Job) -> Layers:
        """The key/values of every token ``job``'s first row has fed the model: (1, H, cached, D) per layer."""
        return self.cache.row(self.offset(job))

    def _newest(self) -> "torch.Tensor":
        """Every row's newest token, (B, 1) on the device: from the host where a job keeps its
        tokens there (Job.host_tokens), in one copy for all such jobs in a row."""
        import torch

        from chatcore.decoding import to_device

        pieces: list[torch.Tensor] = []
        held: list[int] = []
        for job in self.jobs:
            if job.host_tokens:
                held.append(job.chosen[-1])
                continue
            if held:
                pieces.append(to_device(held, self.device)[:, None])
                held = []
            pieces.append(job.sequences[:, job.length - 1 : job.length])
        if held:
            pieces.append(to_device(held, self.device)[:, None])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def forward(self, tokens: "torch.Tensor | None" = None) -> "torch.Tensor":
        """One forward pass for every row's newest token (``tokens``, (B, 1) on the device, when
        they are not recorded yet: a pass run ahead): (B, V) logits."""

        from chatcore.serving.slots import ragged_pass

        self._compact()
        last = tokens
        if last is None:
            last = self._newest()
        logits = self.static_step.forward(last, self.cache) if self.static_step is not None else None
        if logits is None:
            positions, mask, plan = self.cache.begin_step(self.device)
            with ragged_pass(self.model, plan) as extra:
                self.split_steps += bool(extra)
                output = self.model(
                    input_ids=last,
                    attention_mask=mask,
                    position_ids=positions,
                    **{self.cache_argument: self.cache},
                    use_cache=True,
                    logits_to_keep=1,
                    **extra,
                )
            logits = output.logits[:, -1, :].float()
        self.cache.end_step()
        for job in self.jobs:
            job.cached += 1
        return logits
