"""Personas: saved system prompts, one UTF-8 text file each in the user data folder's ``personas/``.

``--persona NAME`` on chat, generate, serve and discord reads ``personas/NAME.txt`` as the
system prompt; ``chatcore personas`` lists, adds and removes them.
"""

from __future__ import annotations

import re
from pathlib import Path

from chatcore.errors import ChatcoreError, OptionError

PERSONAS_FOLDER = "personas"
SUFFIX = ".txt"
# A name is a file name on every system: letters, digits, "-" and "_", not starting with "-".
NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,63}")


def personas_folder() -> Path:
    """``personas/`` in the user data folder; one an older version made 0755 (its listing names every
    persona to other users) is made 0700 when it is opened, as it is created now."""
    from chatcore.log.location import private_data_folder

    return private_data_folder(PERSONAS_FOLDER)


def check_name(name: str) -> str:
    if not NAME_PATTERN.fullmatch(name):
        raise OptionError(f"persona name {name!r} must be 1 to 64 letters, digits, '-' or '_' (not starting with '-')")
    return name


def persona_path(name: str) -> Path:
    return personas_folder() / f"{check_name(name)}{SUFFIX}"


def persona_names() -> list[str]:
    folder = personas_folder()
    if not folder.is_dir():
        return []
    return sorted(p.stem for p in folder.glob(f"*{SUFFIX}") if p.is_file() and NAME_PATTERN.fullmatch(p.stem))


def read_persona(name: str) -> str:
    """The system prompt saved as ``name``, or one line saying which personas there are."""
    from chatcore.prompting import read_system_file

    path = persona_path(name)
    if not path.is_file():
        known = ", ".join(persona_names()) or "none yet"
        raise ChatcoreError(f'no persona {name!r} (saved: {known}); `chatcore personas add {name} "TEXT"` saves one')
    return read_system_file(str(path))


def save_persona(name: str, text: str) -> Path:
    """Save ``text`` (checked as a system prompt) as persona ``name``, replacing any earlier one."""
    import os
    import tempfile

    from chatcore.log.private_files import make_private_folder
    from chatcore.prompting import clean_system_prompt

    path = persona_path(name)
    cleaned = clean_system_prompt(text)
    if cleaned is None:
        raise OptionError(f"persona {name!r}: the text is empty")
    # 0700 whatever the umask, as the log's folders: the files are 0600 (mkstemp's), and the
    # folder's listing would name every persona to other users.
    make_private_folder(path.parent)
    # Written whole or not at all: a temporary file beside it, then renamed over it.
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(cleaned + "\n")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def remove_persona(name: str) -> Path:
    path = persona_path(name)
    if not path.is_file():
        raise ChatcoreError(f"no persona {name!r} (saved: {', '.join(persona_names()) or 'none'})")
    path.unlink()
    return path


def system_prompt_with_persona(text: str | None, path: str | None, persona: str | None) -> str | None:
    """The system prompt from ``--system``, ``--system-file`` or ``--persona`` (one of them)."""
    from chatcore.prompting import system_prompt_option

    if persona is not None:
        if text is not None or path is not None:
            raise OptionError("give --persona, --system or --system-file, not two of them")
        return read_persona(persona)
    return system_prompt_option(text, path)
