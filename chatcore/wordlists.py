"""Word lists: the built-in topics (``chatcore/bundled/wordlists``) and the user's own files.

Shared by every plugin that steers or ranks toward a bag of words (``bow-bias``,
``pplm topic=``, ``rank``) and by ``chatcore eval`` (which counts on-topic replies).
"""

from __future__ import annotations

from pathlib import Path

from chatcore.errors import OptionError
from chatcore.text import shown_value

WORDLIST_DIR = Path(__file__).parent / "bundled" / "wordlists"


def builtin_topics() -> list[str]:
    return sorted(p.stem for p in WORDLIST_DIR.glob("*.txt"))


def read_word_file(path: str | Path, setting: str = "`file`") -> list[str]:
    """One word or phrase per line; blank lines and lines starting with # are skipped. A path
    that is no readable word file is an OptionError naming ``setting`` (the option or setting
    that gave the path)."""
    from chatcore.errors import CorpusError
    from chatcore.training.corpus import data_lines

    if Path(path).is_dir():
        raise OptionError(f"{setting}: {str(path)!r} is a folder, not a word file (one word or phrase per line)")
    try:
        return [line.strip() for _, line in data_lines(path, "word file")]
    except CorpusError as error:
        raise OptionError(f"{setting}: {error}") from None


def check_word_sources(topic: str | None, file: str | None) -> None:
    """Raise ValueError for an unknown built-in ``topic`` or an unreadable word ``file``
    (settings call this, so a bad list fails when the plugin is set up, not mid-reply)."""
    if topic is not None and topic not in builtin_topics():
        raise ValueError(f"`topic` must be one of {', '.join(builtin_topics())}, got {shown_value(topic)}")
    if file is not None:
        read_word_file(file)


def collect_words(words: tuple[str, ...], topic: str | None, file: str | None) -> list[str]:
    """The inline ``words``, then the built-in ``topic``'s list, then the ``file``'s."""
    collected = [w.strip() for w in words if w.strip()]
    if topic:
        collected += read_word_file(WORDLIST_DIR / f"{topic}.txt")
    if file:
        collected += read_word_file(file)
    return collected
