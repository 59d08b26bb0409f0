"""The learning-rate schedule of chatcore's training loops: linear warmup, then a cosine
decay to ``min_lr_ratio`` of the peak rate.

transformers' ``get_cosine_with_min_lr_schedule_with_warmup`` has the same cosine, but
its warmup starts at 0 (step 0 would not learn); this one's first step already takes
``1 / warmup_steps`` of the peak.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The share of the peak learning rate that optimizer step ``step`` (from 0) takes."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + 0.5 * (1.0 - min_lr_ratio) * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(
    optimizer: "torch.optim.Optimizer", warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> "torch.optim.lr_scheduler.LambdaLR":
    """The schedule as a scheduler of ``optimizer``: one ``step()`` after each optimizer step.

    The factor is a plain function, so the scheduler's saved state holds the step and the
    base rates but not the schedule's shape: a resumed run follows its own settings."""
    from torch.optim.lr_scheduler import LambdaLR

    def factor(step: int) -> float:
        return lr_factor(step, warmup_steps, total_steps, min_lr_ratio)

    return LambdaLR(optimizer, factor)


def move_schedule(scheduler: "torch.optim.lr_scheduler.LambdaLR", step: int, learning_rate: float) -> None:
    """Put ``scheduler`` (and its optimizer's rates) at ``step`` with the peak ``learning_rate``:
    after loading a checkpoint whose step count, length or peak rate this run changes."""
    scheduler.base_lrs = [learning_rate for _ in scheduler.optimizer.param_groups]
    scheduler.last_epoch = step - 1
    scheduler.step()
