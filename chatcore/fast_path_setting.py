"""``CHATCORE_FAST_PATH``: which step the shared batch takes (docs/serving.md, "The fast path").

Read without torch, so that the command line refuses a bad value before it loads a model.
"""

from __future__ import annotations

import os

from chatcore.errors import ChatcoreError

FAST_PATH_ENV = "CHATCORE_FAST_PATH"
FAST_PATH_MODES = ("auto", "on", "compile", "off")


def fast_path_mode() -> str:
    """The ``CHATCORE_FAST_PATH`` setting; a bad value is refused in one line."""
    mode = os.environ.get(FAST_PATH_ENV, "auto").strip().lower() or "auto"
    if mode not in FAST_PATH_MODES:
        raise ChatcoreError(f"{FAST_PATH_ENV} must be one of {', '.join(FAST_PATH_MODES)}, got {mode!r}")
    return mode


def compile_failure(error: BaseException) -> str:
    """Why compiling failed, in one line: the error's type and the first line of its message
    (torch appends paragraphs of advice to what it raises)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
