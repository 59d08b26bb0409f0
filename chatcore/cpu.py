"""How many CPU threads torch decodes with: ``--threads`` on every command that decodes.

torch's own default is one thread per core. On a machine whose cores other processes
share, those threads wait on each other and decoding collapses (measured in
docs/serving.md, "Threads"), so chatcore's default is smaller: half the cores this
process may run on, at most 4, at least 1. ``OMP_NUM_THREADS``, when set, is left to torch.
"""

from __future__ import annotations

import os

MAX_DEFAULT_THREADS = 4


def available_cores() -> int:
    """The cores this process may run on (its affinity where the system tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_threads() -> int:
    return max(1, min(MAX_DEFAULT_THREADS, available_cores() // 2))


def use_threads(threads: int | None) -> int:
    """Set torch's CPU threads to ``threads`` (None: the default above, or torch's own when
    ``OMP_NUM_THREADS`` is set); returns the number in use."""
    import torch

    if threads is None and os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    if threads is not None and threads < 1:
        raise ValueError(f"`threads` must be a positive integer, got {threads!r}")
    torch.set_num_threads(threads if threads is not None else default_threads())
    return torch.get_num_threads()
