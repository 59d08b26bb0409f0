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


def user_data_path() -> Path:
    """chatcore's per-user data folder (``~/.local/share/chatcore`` on Linux)."""
    import platformdirs

    return Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))


def default_url() -> str:
    return sqlite_url(user_data_path() / DEFAULT_FILENAME)


def sqlite_url(path: str | os.PathLike[str]) -> str:
    return f"sqlite:///{Path(path).expanduser().resolve()}"


def resolve_url(explicit: str | None = None) -> str:
    """The database URL to use: an explicit URL or path, ``$CHATCORE_DB``, or the default file.

    A value without ``://`` is taken as the path of an SQLite file, so
    ``--db chats.db`` works as well as ``--db sqlite:///chats.db``.
    """
    for candidate in (explicit, os.environ.get(ENV_DB)):
        if candidate is not None and candidate.strip():
            value = candidate.strip()
            return value if "://" in value else sqlite_url(value)
    return default_url()
