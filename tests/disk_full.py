"""A full disk for the block, without root: every write that would make a file longer fails.

RLIMIT_FSIZE is set to 0 for this process, so any write past a file's current end fails
at the OS boundary with EFBIG ("File too large"), where a full disk fails with ENOSPC:
both are an OSError from the write, and SQLite reports both as SQLITE_FULL. SIGXFSZ is
ignored, so the write fails instead of the signal ending the process. Files may still be
created (empty), read, and rewritten within their length, as on a full disk.
"""

from __future__ import annotations

import resource
import signal
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def files_cannot_grow(beyond: int = 0) -> Iterator[None]:
    """No file may grow past ``beyond`` bytes (0: no file may grow at all) inside the block."""
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (beyond, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
