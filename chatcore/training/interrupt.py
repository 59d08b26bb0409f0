"""Ctrl-C while a training loop runs: the first stops it after its step, with a checkpoint.

A loop that can stop at any step with a checkpoint (``train cocon``, whose ``--run-steps``
and ``--time-limit`` chunks end that way) checks :attr:`StopRequest.requested` between
steps: the first Ctrl-C sets it and says what happens, so the steps done are kept and
``--resume`` continues; a second Ctrl-C stops at once, as Ctrl-C does elsewhere. Only the
main thread of a process can take the signal; elsewhere the request is never set.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

SAY = "stopping after this step, with a checkpoint (--resume continues); Ctrl-C again stops at once"


class StopRequest:
    """A context in which the first SIGINT asks the loop to stop (``say`` tells the user)."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.say(SAY)

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False
