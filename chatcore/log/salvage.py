"""``chatcore logs export --salvage``: every row a damaged SQLite log still holds.

SQLite cannot read past a damaged page: a query stops at the first one, and a file
whose schema page or tail is damaged does not open at all. The salvage reads the file
page by page instead, as SQLite's own recovery (the shell's ``.recover``) does: every
table leaf page of the file (and the newest committed copy of each page in its
``-wal``) is parsed on its own, whichever tree it hangs from, and each row whose shape
is a conversation or a message is kept. One damaged page loses only the rows it held;
a damaged schema page, interior page or a truncated tail lose nothing else.

Pages are parsed by :mod:`dissect.database.sqlite3` (a maintained reader of SQLite's
file format). The shell's ``.recover`` is not used: the ``sqlite3`` binary that Debian
and Ubuntu ship is built without the ``sqlite_dbpage`` table it needs (it fails with
"no such table: sqlite_dbpage"), and no Python binding exposes the recovery extension.

Pages on the freelist are skipped, so deleted conversations do not come back. The
rows go into a new log (made by the same migrations as every log), from which the
export reads them like any other.
"""

from __future__ import annotations

import io
import json
import struct
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import sqlalchemy as sa

from chatcore.log.errors import LogError, folder_refused

if TYPE_CHECKING:
    import click

    from chatcore.log.store import ConversationStore

_MAGIC = b"SQLite format 3\x00"
_HEADER_BYTES = 100
_TABLE_LEAF = 0x0D
_INDEX_LEAF = 0x0A
_ROLES = frozenset({"user", "bot", "system"})
_ID_CHARS = 64  # the id and conversation_id columns' width


@dataclass
class SalvageReport:
    """What the salvage read, and what it could not."""

    pages: int = 0
    """Pages the file (and its -wal) should hold, by its header, or found when the header is unreadable."""
    pages_present: int = 0
    """Pages actually in the file (fewer than ``pages`` when it was cut short)."""
    unreadable_pages: int = 0
    """Pages that are not a valid b-tree page (damaged, or overflow and free pages)."""
    unreadable_cells: int = 0
    """Cells on table leaf pages that could not be parsed, or held no valid row."""
    conversations: int = 0
    messages: int = 0
    rebuilt_conversations: int = 0
    """Conversations whose own row was lost: rebuilt from their messages (no title, model or adapter)."""
    missing_message_ids: int = 0
    """Ids below the highest message id found that no page held: deleted, or lost with a damaged page."""
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The report, one line each: what was recovered, then what was not."""
        lines = [f"recovered {self.conversations} conversation(s) and {self.messages} message(s)"]
        if self.pages_present < self.pages:
            lines.append(f"the file is cut short: {self.pages_present} of {self.pages} pages are present")
        if self.rebuilt_conversations:
            lines.append(
                f"{self.rebuilt_conversations} conversation(s) lost their own row (title, model, adapter): "
                "rebuilt from their messages"
            )
        if self.missing_message_ids:
            lines.append(
                f"{self.missing_message_ids} message id(s) below the highest found were not found "
                "(deleted, or held by a damaged page)"
            )
        if self.unreadable_cells:
            lines.append(f"{self.unreadable_cells} damaged row(s) on readable pages were skipped")
        lines.extend(self.notes)
        return lines


class _PatchedHeader(io.RawIOBase):
    """The file with a sane 100-byte header over its own, for a file whose header is damaged."""

    def __init__(self, file: IO[bytes], header: bytes) -> None:
        self._file = file
        self._header = header
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._file.seek(0, io.SEEK_END)}[whence]
        self._position = base + offset
        return self._position

    def tell(self) -> int:
        return self._position

    def read(self, size: int | None = -1) -> bytes:
        self._file.seek(self._position)
        data = bytearray(self._file.read(size if size is not None and size >= 0 else -1))
        if self._position < len(self._header):
            head = self._header[self._position : self._position + len(data)]
            data[: len(head)] = head
        self._position += len(data)
        return bytes(data)


def _sane_header(header: bytes) -> bytes:
    """A header whose magic and page size SQLite's format allows (the page size guessed when damaged)."""
    fixed = bytearray(header.ljust(_HEADER_BYTES, b"\x00"))
    fixed[:16] = _MAGIC
    (page_size,) = struct.unpack(">H", fixed[16:18])
    if page_size != 1 and (page_size < 512 or page_size & (page_size - 1)):
        fixed[16:18] = struct.pack(">H", 4096)
    fixed[20] = 0  # reserved bytes per page: a damaged value would shift every cell
    fixed[56:60] = struct.pack(">I", 1)  # UTF-8, the only encoding chatcore writes
    return bytes(fixed)


def _open_pages(path: Path) -> tuple[Any, IO[bytes]]:
    """The dissect reader over the file (and its -wal), header repaired in memory when damaged."""
    from dissect.database.sqlite3 import SQLite3
    from dissect.database.sqlite3.exception import Error as DissectError

    file = path.open("rb")
    header = file.read(_HEADER_BYTES)
    file.seek(0)
    source: IO[bytes] = file
    if _sane_header(header)[:_HEADER_BYTES] != header.ljust(_HEADER_BYTES, b"\x00")[:_HEADER_BYTES]:
        source = _PatchedHeader(file, _sane_header(header))  # type: ignore[assignment]
    wal = path.with_name(path.name + "-wal")
    try:
        try:
            return SQLite3(source, wal=wal if wal.is_file() and wal.stat().st_size else None), file
        except (DissectError, EOFError, ValueError, struct.error):
            # A damaged -wal: read the file alone.
            return SQLite3(source, wal=None), file
    except (DissectError, EOFError, ValueError, struct.error) as error:
        file.close()
        reason = str(error).strip() or ("it is too short" if path.stat().st_size < 512 else type(error).__name__)
        raise LogError(f"{path} cannot be read as an SQLite file: {reason}") from None


def _freelist(db: Any, limit: int) -> set[int]:
    """Pages on the freelist (their rows were deleted): trunk pages and the leaves they list."""
    free: set[int] = set()
    trunk = int(db.header.first_freelist_page)
    while 1 < trunk <= limit and trunk not in free:
        free.add(trunk)
        try:
            data = db.raw_page(trunk)
            following, count = struct.unpack(">II", data[:8])
            count = min(count, (len(data) - 8) // 4)
            free.update(n for n in struct.unpack(f">{count}I", data[8 : 8 + 4 * count]) if 1 < n <= limit)
        except Exception:  # a damaged trunk page: the rest of the list is unknown
            break
        trunk = following
    return free


def _is_time(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        datetime.fromisoformat(value)
    except ValueError:
        return False
    return True


def _text(value: Any) -> Any:
    """A text value dissect could not decode comes back as bytes: keep what is readable."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _json_or_none(value: Any) -> Any:
    """A JSON column's text, or None where damage left text that is not JSON."""
    if not isinstance(value, str):
        return None
    try:
        json.loads(value)
    except ValueError:
        return None
    return value


class _Layout:
    """Where each column sits in the rows of a table, as the migrations made it."""

    def __init__(self, columns: list[str], json_columns: set[str]) -> None:
        self.columns = columns
        self.index = {name: position for position, name in enumerate(columns)}
        self.json_positions = [position for position, name in enumerate(columns) if name in json_columns]

    def row(self, values: list[Any]) -> list[Any] | None:
        """The values padded to every column (a row written before a later column was added), or None.

        A JSON value that damage made unreadable is dropped (None), keeping the row."""
        if not len(self.columns) - 2 <= len(values) <= len(self.columns):
            return None
        row = [_text(value) for value in values] + [None] * (len(self.columns) - len(values))
        for position in self.json_positions:
            if row[position] is not None:
                row[position] = _json_or_none(row[position])
        return row

    def message(self, rowid: int, values: list[Any]) -> list[Any] | None:
        row = self.row(values)
        if row is None or row[0] is not None:  # `id` is the rowid: SQLite stores NULL in the record
            return None
        i = self.index
        conversation_id, role, text, created = (row[i[k]] for k in ("conversation_id", "role", "text", "created"))
        if not (isinstance(conversation_id, str) and 0 < len(conversation_id) <= _ID_CHARS):
            return None
        if role not in _ROLES or not isinstance(text, str) or not _is_time(created):
            return None
        if any(row[i[k]] not in (0, 1) for k in ("interrupted", "superseded")):
            return None
        row[0] = rowid
        return row

    def conversation(self, values: list[Any]) -> list[Any] | None:
        row = self.row(values)
        if row is None:
            return None
        i = self.index
        if not (isinstance(row[0], str) and 0 < len(row[0]) <= _ID_CHARS):
            return None
        if not (_is_time(row[i["created"]]) and _is_time(row[i["updated"]])):
            return None
        if row[i["meta"]] is None:
            row[i["meta"]] = "{}"
        return row


def _layouts(store: "ConversationStore") -> tuple[_Layout, _Layout]:
    with store.db.connect() as connection:
        conversations = [row[1] for row in connection.exec_driver_sql("PRAGMA table_info(conversations)")]
        messages = [row[1] for row in connection.exec_driver_sql("PRAGMA table_info(messages)")]
    from chatcore.log.models import ConversationRow, MessageRow

    def json_columns(model: Any) -> set[str]:
        return {column.name for column in model.__table__.columns if isinstance(column.type, sa.JSON)}

    return _Layout(conversations, json_columns(ConversationRow)), _Layout(messages, json_columns(MessageRow))


def salvage(path: Path, into: "ConversationStore") -> SalvageReport:
    """Read every row of the log file at ``path`` that still can be, into the new log ``into``."""
    if path.is_dir():
        raise LogError(folder_refused(path))
    if not path.is_file():
        raise LogError(f"no conversation log at {path}")
    conversation_layout, message_layout = _layouts(into)
    report = SalvageReport()
    db, file = _open_pages(path)
    conversations: dict[str, list[Any]] = {}
    messages: dict[int, list[Any]] = {}
    # Index entries (key, rowid): a message whose conversation id was damaged finds its
    # conversation through the entry ix_messages_conversation_id holds for its rowid.
    indexed: dict[int, list[str]] = {}
    try:
        page_size = int(db.page_size)
        present = -(-path.stat().st_size // page_size)
        if db.wal is not None:
            present = max(present, int(db.wal.highest_page_num))
        declared = int(db.header.page_count)
        # A -wal may hold pages past the file's header count (committed, not yet folded in).
        report.pages = max(declared, present) if 0 < declared < 4 * present + 16 else present
        report.pages_present = min(present, report.pages)
        db.page_count = report.pages_present  # a damaged page count must not send the reader past the file
        free = _freelist(db, report.pages_present)
        updated_at = conversation_layout.index["updated"]
        for number in range(1, report.pages_present + 1):
            if number in free:
                continue
            try:
                page = db.page(number)
                kind, count = page.header.flags, int(page.header.cell_count)
            except Exception:  # dissect raises several kinds (and struct/index errors) on garbage
                report.unreadable_pages += 1
                continue
            if kind not in (_TABLE_LEAF, _INDEX_LEAF):
                continue
            for values, rowid in _cells(page, count, report):
                if kind == _INDEX_LEAF:
                    # (key, ..., rowid); ix_messages_conversation_id's is (conversation_id, id, rowid)
                    if 2 <= len(values) <= 3 and isinstance(values[0], str) and isinstance(values[-1], int):
                        indexed.setdefault(values[-1], []).append(values[0])
                    continue
                message = message_layout.message(rowid, values)
                if message is not None:
                    messages.setdefault(rowid, message)
                    continue
                conversation = conversation_layout.conversation(values)
                if conversation is not None:
                    known = conversations.get(conversation[0])
                    if known is None or str(conversation[updated_at]) > str(known[updated_at]):
                        conversations[conversation[0]] = conversation
    finally:
        file.close()
    _mend_conversation_ids(conversations, messages, indexed, message_layout)
    _rebuild_missing_conversations(conversations, messages, conversation_layout, message_layout, report)
    _store_rows(into, conversation_layout, list(conversations.values()), message_layout, list(messages.values()))
    report.conversations = into.count_conversations()
    report.messages = into.count_messages()
    if messages:
        report.missing_message_ids = max(messages) - len(messages)
    return report


def _cells(page: Any, count: int, report: SalvageReport) -> Iterator[tuple[list[Any], int]]:
    """Each cell's values and key (0 on index pages), one at a time: a damaged cell loses only itself."""
    for number in range(count):
        try:
            cell = page.cell(number)
            yield cell.values, int(cell.key or 0)
        except Exception:  # a cell pointer or record header is garbage
            report.unreadable_cells += 1


def _mend_conversation_ids(
    conversations: dict[str, list[Any]],
    messages: dict[int, list[Any]],
    indexed: dict[int, list[str]],
    layout: _Layout,
) -> None:
    """A message naming no known conversation takes the one an index entry for its rowid names,
    else the only known one whose id differs from its own in one character (a damaged byte)."""
    at = layout.index["conversation_id"]
    named = Counter(message[at] for message in messages.values())
    # Known: a conversation's own row, or an id that several messages name (its row may be lost).
    # (U+FFFD: bytes that were not UTF-8, which the log never writes.)
    known = set(conversations) | {key for key, count in named.items() if count > 1 and "\ufffd" not in key}
    for rowid, message in messages.items():
        damaged = message[at]
        if damaged in known:
            continue
        by_index = {key for key in indexed.get(rowid, ()) if key in known}
        one_off = {key for key in known if len(key) == len(damaged) and sum(a != b for a, b in zip(key, damaged)) == 1}
        # Both agreeing first: a damaged index page may hold entries for this rowid too.
        for found in (by_index & one_off, by_index, one_off):
            if len(found) == 1:
                message[at] = found.pop()
                break


def _rebuild_missing_conversations(
    conversations: dict[str, list[Any]],
    messages: dict[int, list[Any]],
    conversation_layout: _Layout,
    message_layout: _Layout,
    report: SalvageReport,
) -> None:
    """A conversation row for every conversation whose messages were found but whose own row was not."""
    at = message_layout.index
    created, updated = conversation_layout.index["created"], conversation_layout.index["updated"]
    rebuilt: set[str] = set()
    for message in sorted(messages.values(), key=lambda row: row[0]):
        conversation_id = message[at["conversation_id"]]
        if conversation_id not in conversations:
            row: list[Any] = [None] * len(conversation_layout.columns)
            row[0] = conversation_id
            row[created] = row[updated] = message[at["created"]]
            row[conversation_layout.index["meta"]] = "{}"
            conversations[conversation_id] = row
            rebuilt.add(conversation_id)
        elif conversation_id in rebuilt:  # the newest message sets `updated`, as the log does
            row = conversations[conversation_id]
            row[updated] = max(str(row[updated]), str(message[at["created"]]))
    report.rebuilt_conversations = len(rebuilt)


def _store_rows(
    into: "ConversationStore",
    conversation_layout: _Layout,
    conversations: list[list[Any]],
    message_layout: _Layout,
    messages: list[list[Any]],
) -> None:
    def insert(table: str, layout: _Layout) -> str:
        names = ", ".join(f'"{name}"' for name in layout.columns)
        return f"INSERT INTO {table} ({names}) VALUES ({', '.join('?' * len(layout.columns))})"

    with into.db.begin() as connection:
        # The new log is only read back for the export: no search index to keep up.
        for trigger in (
            connection.exec_driver_sql(
                "SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'messages'"
            )
            .scalars()
            .all()
        ):
            connection.exec_driver_sql(f'DROP TRIGGER "{trigger}"')
        # (an executemany of no rows is not one of no statement: each insert only with rows to insert)
        if conversations:
            connection.exec_driver_sql(insert("conversations", conversation_layout), [tuple(r) for r in conversations])
        if messages:
            # OR IGNORE: a damaged row may repeat another's unique write key; the first one is kept.
            connection.exec_driver_sql(
                insert("messages", message_layout).replace("INSERT", "INSERT OR IGNORE", 1),
                [tuple(r) for r in sorted(messages, key=lambda row: row[0])],
            )


def salvaged_store(ctx: "click.Context", url: str | None, problems: list[str]) -> tuple["ConversationStore", Path]:
    """A new log (in a private temporary folder, removed when the command ends) holding what the
    SQLite file named by ``url`` still holds, and that file's path; the report goes into ``problems``."""
    import tempfile

    from chatcore.log.connection import sqlite_file
    from chatcore.log.location import resolve_url, sqlite_url
    from chatcore.log.store import ConversationStore

    path = sqlite_file(resolve_url(url))
    if path is None:
        raise LogError("--salvage reads an SQLite file: give its path with --db")
    folder = tempfile.TemporaryDirectory(prefix="chatcore-salvage-")
    ctx.call_on_close(folder.cleanup)
    store = ConversationStore(sqlite_url(Path(folder.name) / "salvaged.sqlite3"))
    ctx.call_on_close(store.close)
    problems.extend(salvage(path, store).lines())
    return store, path
