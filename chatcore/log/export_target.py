"""Where ``chatcore logs export -o FILE`` writes: never onto the log, never over a file by surprise.

The log file, its ``-wal``, ``-shm`` and ``-journal`` and the journal folder are
refused, by name and by file identity (a hard link or another spelling of the same
file is caught), even with ``--force``. Any other existing file is refused unless
``--force``; a symbolic link is followed only with ``--force``, and saying so. A new
file is created 0600. Devices and pipes (``/dev/stdout``) are written as they are.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TextIO

from chatcore.errors import ChatcoreError
from chatcore.log.private_files import PRIVATE_FILE

LOG_COMPANIONS = ("", "-wal", "-shm", "-journal")


def log_files(log_path: Path | None) -> list[Path]:
    """The SQLite file and the companions SQLite keeps beside it."""
    if log_path is None:
        return []
    return [log_path.with_name(log_path.name + suffix) for suffix in LOG_COMPANIONS]


def _identity(found: os.stat_result) -> tuple[int, int]:
    return (found.st_dev, found.st_ino)


class ExportTarget:
    """Checks an output path against the files it must never replace, then opens it."""

    def __init__(self, path: str, *, force: bool, log_path: Path | None, journal_folder: Path | None) -> None:
        self.path = path
        self.force = force
        self.protected = log_files(log_path)
        self.journal_folder = journal_folder
        self.notes: list[str] = []

    def _refuse(self, why: str) -> ChatcoreError:
        return ChatcoreError(f"cannot export to {self.path!r}: {why}; nothing was written")

    def _resolved(self, target: Path) -> Path:
        try:
            return target.resolve()
        except (OSError, RuntimeError):  # a loop of symbolic links
            raise self._refuse("it is a loop of symbolic links") from None

    def _check_protected(self, target: Path, found: os.stat_result | None) -> None:
        resolved = self._resolved(target)
        identities: dict[tuple[int, int], Path] = {}
        for path in self.protected:
            try:
                identities[_identity(path.stat())] = path
            except OSError:
                pass
            if resolved == path.resolve():
                raise self._refuse(f"it is the conversation log's own file {path}")
        if found is not None and _identity(found) in identities:
            raise self._refuse(f"it is the conversation log's own file {identities[_identity(found)]}")
        folder = self.journal_folder
        if folder is not None and (resolved.parent == folder.resolve() or resolved == folder.resolve()):
            raise self._refuse(f"it is in the conversation log's journal folder {folder}")

    def open(self) -> TextIO:
        """The file opened for UTF-8 text, or ChatcoreError saying in one line why not."""
        target = Path(self.path)
        if target.is_dir():
            raise self._refuse("it is a folder")
        if not target.parent.is_dir():
            raise self._refuse(f"the folder {str(target.parent)!r} does not exist")
        is_link = target.is_symlink()
        if is_link:
            points_to = os.readlink(target)
            if not self.force:
                raise self._refuse(f"it is a symbolic link to {points_to!r} (--force writes where it points)")
            self.notes.append(f"{self.path} is a symbolic link: writing to {self._resolved(target)}")
        try:
            found: os.stat_result | None = target.stat()
        except FileNotFoundError:
            found = None
        except OSError as error:
            raise self._refuse(error.strerror or str(error)) from None
        self._check_protected(target, found)
        if found is not None and stat.S_ISREG(found.st_mode) and not self.force:
            raise self._refuse("the file exists (--force replaces it)")
        flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        if found is None:
            flags |= os.O_EXCL  # a file that appeared since the check is not replaced either
        if not is_link:
            flags |= getattr(os, "O_NOFOLLOW", 0)  # nor a link that appeared since
        try:
            descriptor = os.open(target, flags, PRIVATE_FILE)
        except OSError as error:
            raise self._refuse(error.strerror or str(error)) from None
        try:
            opened = os.fstat(descriptor)
            self._check_protected(target, opened)  # the file actually opened, whatever happened since the check
            if stat.S_ISREG(opened.st_mode):
                os.ftruncate(descriptor, 0)  # only now: a refused file keeps every byte
            return os.fdopen(descriptor, "w", encoding="utf-8")
        except BaseException:
            os.close(descriptor)
            raise


def open_export(
    path: str, *, force: bool, log_path: Path | None, journal_folder: Path | None
) -> tuple[TextIO, list[str]]:
    """``path`` opened for the export, and notes to show (a symbolic link followed)."""
    target = ExportTarget(path, force=force, log_path=log_path, journal_folder=journal_folder)
    return target.open(), target.notes
