"""Output files named on command lines: checked before the work starts, failures in one line."""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

from chatcore.errors import ChatcoreError


def check_output_path(path: str) -> Path:
    """``path`` if a file can be written there, else ChatcoreError saying why (before any long work)."""
    target = Path(path)
    if target.is_dir():
        raise ChatcoreError(f"cannot write {path!r}: it is a folder")
    folder = target.parent
    if not folder.is_dir():
        raise ChatcoreError(f"cannot write {path!r}: the folder {str(folder)!r} does not exist")
    return target


def open_output(path: str) -> TextIO:
    """``path`` opened for writing UTF-8 text, or ChatcoreError saying why it cannot be."""
    target = check_output_path(path)
    try:
        return target.open("w", encoding="utf-8")
    except OSError as error:
        raise ChatcoreError(f"cannot write {path!r}: {error.strerror or error}") from None
