"""Ctrl-C while a slash command runs: the command is cancelled, and it changes nothing.

Some commands take seconds: ``/decoder mmi`` loads its reverse model, ``/steer pplm`` its
attribute head, ``/steer vector`` its vectors. A KeyboardInterrupt raised in the middle of
such loading came out of torch's code as another error (a bundled model "that cannot be
read"), or inside a finalizer, where Python can only print it and the command went on.
So while a command runs (:func:`ctrl_c_noted`), Ctrl-C is only noted; the loading runs on
a thread of its own (``ChatState.background``), and the one place where Ctrl-C raises is
the chat's wait for it (:func:`wait_for`), which stops the wait, never the loading. The
dispatcher then puts back everything the command had changed (``run_command``), whatever
it had got to when Ctrl-C was pressed.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from types import FrameType
from typing import TypeVar

T = TypeVar("T")


class Presses:
    """Ctrl-C during one command: noted; raised (once) only in :func:`wait_for`'s wait."""

    def __init__(self) -> None:
        self.pressed = False
        self.waiting = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.pressed = True
        if self.waiting:
            # Once: a second press must not land in the clean-up of the wait the first one ended.
            self.waiting = False
            raise KeyboardInterrupt


_noting: Presses | None = None  # the command running now, while Ctrl-C is noted


@contextlib.contextmanager
def ctrl_c_noted() -> Iterator[Presses]:
    """Within: Ctrl-C is noted in the :class:`Presses` yielded rather than raised where it lands.

    Only the main thread can take signals, and Ctrl-C is taken over only from Python's own
    handler (an embedding program's handler, or an ignored SIGINT, stays as it is): there
    KeyboardInterrupt is raised as usual, and the dispatcher undoes the command all the same.
    """
    global _noting
    presses = Presses()
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield presses
        return
    previous = signal.signal(signal.SIGINT, presses.handle)
    _noting = presses
    try:
        yield presses
    finally:
        _noting = None
        signal.signal(signal.SIGINT, previous)


def wait_for(future: "Future[T]") -> T:
    """The result of work running on another thread; Ctrl-C (pressed now, or earlier in the
    command) raises KeyboardInterrupt here and leaves the work to finish on its own."""
    presses = _noting
    if presses is None:
        return future.result()
    presses.waiting = True
    try:
        if presses.pressed:
            raise KeyboardInterrupt
        return future.result()
    finally:
        presses.waiting = False
