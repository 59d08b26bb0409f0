"""Running the shared batch one pass ahead of the host.

On a GPU the device runs what the host queues while the host goes on, until the host
reads a result. A decoding loop that reads each step's tokens before queueing the next
pass leaves the device idle while the host records them, streams them and prepares the
next step (about half a millisecond a step at batch 1: a fifth of a large model's step
once its pass is captured). The runner instead queues the next pass on the chosen tokens
as they lie on the device, then reads them (:class:`TokenRead` waits for the copy of the
tokens alone, not for that pass), and does its host work while the pass runs.

The pass run ahead is used at the next step for the rows still in the batch
(:class:`Ahead`); a row whose reply ended meanwhile (a stop token, cancelled) had its
column computed for nothing, which costs one row of one pass per reply, and where the
batch empties, one pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from chatcore.serving.jobs import Job


@dataclass
class Ahead:
    """A shared pass run before its step: the batch's jobs when it was queued (a row each,
    in batch order) and its (rows, V) logits."""

    jobs: list[Job]
    logits: torch.Tensor

    def rows_of(self, jobs: list[Job]) -> torch.Tensor:
        """The logits of ``jobs``: the batch now, in its order, the jobs of the pass less those
        that ended since (the runner runs a pass ahead only where no job can join before it
        is used: a job that did would have no row, and the others' newest tokens would be fed
        twice)."""
        import torch

        if jobs == self.jobs:
            return self.logits
        index = {job: row for row, job in enumerate(self.jobs)}
        rows = [index.get(job) for job in jobs]
        if any(row is None for row in rows):
            raise RuntimeError("a reply joined the batch after its pass was run ahead")
        return self.logits.index_select(0, torch.tensor(rows, device=self.logits.device))


class TokenRead:
    """Tokens on their way to the host: the copy is queued at once, and :meth:`values`
    waits for it alone (on a GPU, not for the work queued after it)."""

    def __init__(self, tokens: torch.Tensor) -> None:
        import torch

        self.event = None
        if tokens.device.type == "cuda":
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tokens

    def values(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        values: list[int] = self.host.tolist()
        return values
