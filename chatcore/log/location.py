"""Where the conversation log lives: ``--db``, else ``CHATCORE_DB``, else a user data file.

Kept free of SQLAlchemy so that commands can resolve the URL (and print it in
``--help``) without importing the database layer.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_DB = "CHATCORE_DB"
APP_NAME = "chatcore"
DEFAULT_FILENAME = "conversations.sqlite3"
HISTORY_FILENAME = "repl_history"  # the REPL's input history, beside the log
MEMORY = ":memory:"
MEMORY_URL = "sqlite:///:memory:"
"""``--db :memory:``: a chat, bot or server keeps its log in memory, for as long as it runs;
the ``logs`` commands refuse it (there is nothing to read)."""


def user_data_path() -> Path:
    """chatcore's per-user data folder (``~/.local/share/chatcore`` on Linux)."""
    import platformdirs

    return Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))


def private_data_folder(name: str | None = None) -> Path:
    """The user data folder, or the folder ``name`` in it (``personas``, ``log-journal``), as it is
    opened: where it exists with the looser mode an older version gave it (0755), it is made 0700
    first, as it is created now (:func:`~chatcore.log.private_files.tighten_folder`)."""
    from chatcore.log.private_files import tighten_folder

    data = user_data_path()
    tighten_folder(data)
    if name is None:
        return data
    tighten_folder(data / name)
    return data / name


def is_default_folder(folder: Path) -> bool:
    """Whether ``folder`` is the user data folder, which chatcore makes when it is missing
    (a folder named in ``--db`` or ``$CHATCORE_DB`` must exist)."""
    return folder.expanduser().resolve() == user_data_path().expanduser().resolve()


def history_path() -> Path:
    """The REPL's input history file, where a chat not given ``--history-file`` keeps it."""
    return user_data_path() / HISTORY_FILENAME


def default_url() -> str:
    return sqlite_url(user_data_path() / DEFAULT_FILENAME)


def sqlite_url(path: str | os.PathLike[str]) -> str:
    return f"sqlite:///{Path(path).expanduser().resolve()}"


def resolve_url(explicit: str | None = None) -> str:
    """The database URL to use: an explicit URL or path, ``$CHATCORE_DB``, or the default file.

    A value without ``://`` is taken as the path of an SQLite file, so
    ``--db chats.db`` works as well as ``--db sqlite:///chats.db``; ``:memory:`` is SQLite's
    in-memory database (:data:`MEMORY_URL`), as in SQLite itself, not a file of that name.
    """
    for candidate in (explicit, os.environ.get(ENV_DB)):
        if candidate is not None and candidate.strip():
            value = candidate.strip()
            if value == MEMORY:
                return MEMORY_URL
            return value if "://" in value else sqlite_url(value)
    return default_url()
