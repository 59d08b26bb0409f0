"""Files that hold chats: created readable by their owner only, and checked for looser modes.

Every file the conversation log makes (the SQLite file, whose ``-wal`` and ``-shm``
SQLite creates with the same mode, the journal, the rejected file, exports) and the
REPL's input history are created 0600, and the folders made for them 0700, whatever
the umask. chatcore's own folders (the user data folder, its ``personas`` and
``log-journal``) that an older version made 0755 are made 0700 when they are opened
(:func:`tighten_folder`). :func:`loose_modes` finds existing ones that others can read, for
``chatcore logs where``.
"""

from __future__ import annotations

import os
import shlex
import stat
import uuid
from collections.abc import Iterable
from pathlib import Path

PRIVATE_FILE = 0o600
PRIVATE_FOLDER = 0o700


def fsync_folder(folder: Path) -> None:
    """Put the folder's entries (a file just created or removed in it) on the disk."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # a platform without folder handles (Windows): nothing to sync
    try:
        os.fsync(descriptor)
    except OSError:
        pass  # some file systems refuse fsync on a folder; the entry is still written
    finally:
        os.close(descriptor)


def make_private_folder(folder: Path) -> None:
    """Create ``folder`` and its missing parents 0700 (each new entry synced to the disk).

    Existing folders are left as they are (:func:`loose_modes` reports them). OSError if
    one cannot be made.
    """
    missing: list[Path] = []
    current = folder
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for made in reversed(missing):
        try:
            made.mkdir(mode=PRIVATE_FOLDER)
        except FileExistsError:
            continue  # another process made it first
        made.chmod(PRIVATE_FOLDER)  # mkdir's mode passes through the umask
        fsync_folder(made.parent)


def tighten_folder(folder: Path) -> None:
    """Take the other users' access away from ``folder`` when it is a folder of this user's that
    others may read or enter (as older versions made chatcore's own folders: 0755 becomes 0700;
    the owner's own bits are kept, so 0555 becomes 0500). Anything else is left as it is: another
    user's folder, a symbolic link (its target may be anything), a missing folder, and one whose
    mode cannot be changed (a read-only file system). Never raises."""
    getuid = getattr(os, "getuid", None)
    if getuid is None:
        return  # Windows: no owner and mode bits to go by
    try:
        found = os.lstat(folder)
        mode = stat.S_IMODE(found.st_mode)
        if stat.S_ISDIR(found.st_mode) and found.st_uid == getuid() and mode & 0o077:
            os.chmod(folder, mode & PRIVATE_FOLDER)
    except OSError:
        pass


def create_private_file(path: Path) -> bool:
    """Create ``path`` empty and 0600 unless it exists; True if this call created it."""
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
    except FileExistsError:
        return False
    try:
        os.fchmod(descriptor, PRIVATE_FILE)
    finally:
        os.close(descriptor)
    fsync_folder(path.parent)
    return True


def open_private_append(path: Path) -> int:
    """A descriptor appending to ``path``, created 0600 if missing (its folder made 0700)."""
    make_private_folder(path.parent)
    created = not path.exists()
    descriptor = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, PRIVATE_FILE)
    if created:
        fsync_folder(path.parent)
    return descriptor


def replace_private_file(path: Path, data: bytes) -> None:
    """``path`` now holds ``data``, whole or not at all: a new file (0600, on the disk) is renamed over
    it, and the rename put on the disk too. OSError if it cannot be."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
    try:
        try:
            os.fchmod(descriptor, PRIVATE_FILE)
            written = 0
            while written < len(data):
                written += os.write(descriptor, data[written:])
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def loose_modes(paths: Iterable[Path]) -> list[str]:
    """One line per existing file or folder that others may read or enter, with the command that fixes it."""
    lines = []
    for path in paths:
        try:
            found = path.stat()
        except OSError:
            continue
        mode = stat.S_IMODE(found.st_mode)
        if not mode & 0o077:
            continue
        private = PRIVATE_FOLDER if stat.S_ISDIR(found.st_mode) else PRIVATE_FILE
        kind = "folder" if stat.S_ISDIR(found.st_mode) else "file"
        lines.append(
            f"{path} ({kind}, mode {mode:04o}) is open to other users: chmod {private:o} {shlex.quote(str(path))}"
        )
    return lines
