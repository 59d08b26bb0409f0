"""Output files named on command lines: checked before the work starts, failures in one line."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
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


def output_folder(path: str, option: str = "--out") -> Path:
    """The folder ``path``, created with its parents if missing, or OptionError saying in one
    line why it cannot be (a file in the way, no permission): before any long work."""
    from chatcore.errors import OptionError

    target = Path(path)
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OptionError(f"cannot create {option} {path!r}: {error.strerror or error}") from None
    return target


def output_file(path: str, option: str = "--out", replace: bool = True) -> Path:
    """``path`` as a file to write, its folder created if missing, or OptionError saying in one
    line why it cannot be written: before any long work. ``replace=False``: an existing file is
    refused too (the command's ``--force`` replaces it)."""
    from chatcore.errors import OptionError

    target = Path(path)
    if target.is_dir():
        raise OptionError(f"cannot write {option} {path!r}: it is a folder")
    if not replace and target.exists():
        raise OptionError(f"{option} {path!r} exists: give --force to replace it, or another {option}")
    folder = next((above for above in target.parents if above.exists()), None)
    if folder is not None and not folder.is_dir():
        raise OptionError(f"cannot write {option} {path!r}: {str(folder)!r} is not a folder")
    output_folder(str(target.parent), option)
    if target.exists() and not os.access(target, os.W_OK):
        raise OptionError(f"cannot write {option} {path!r}: permission denied")
    return target


@contextlib.contextmanager
def removed_if_left_empty(path: str) -> Iterator[None]:
    """The folder ``path``, where it does not exist yet and the block fails before writing
    anything in it (a run's folder made by :func:`run_folder`, then too little text to train
    on), is removed again: a failed command leaves nothing behind."""
    made = not Path(path).exists()
    try:
        yield
    except BaseException:
        folder = Path(path)
        if made and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
        raise


def run_folder(path: str, resume: bool, kept: tuple[str, ...] = ("checkpoint",), option: str = "--out") -> Path:
    """A training run's folder (see :func:`output_folder`). Without ``resume``, one that already
    holds a run (any of ``kept``: its checkpoint, its trained model) is refused in one line
    rather than overwritten."""
    from chatcore.errors import OptionError

    target = Path(path)
    if not resume:
        for name in kept:
            if (target / name).exists():
                raise OptionError(
                    f"{option} {path!r} already holds a training run ({target / name}): continue it with "
                    f"--resume, or give another {option}"
                )
    return output_folder(path, option)
