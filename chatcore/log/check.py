"""Damage in an SQLite log: found when a chat opens it, and by ``chatcore logs check``.

``PRAGMA quick_check`` reads every page but never compares an index with its table:
a few changed bytes in an index page pass it, and every read through that index
(``logs show``, resuming) then silently misses rows. ``PRAGMA integrity_check`` does
compare them, so it is the check on open (3.7x the cost of ``quick_check`` on 100,000
messages: ``python bench/log_damage.py``, docs/measurements.md). The FTS5 search index
is checked cheaply on open (its row count, and one search through its structure) and
fully by ``logs check`` (FTS5's own ``integrity-check``, seconds per 100,000 messages).

What is damaged decides what happens:

- only indexes or the search index: they hold nothing that is not in the tables, so
  they are rebuilt from the rows (``REINDEX``, FTS5 ``rebuild``), with a one-line
  notice;
- the rows themselves (a table's pages, the schema, the file's structure): nothing is
  written into the file; a chat keeps its turns in the journal, and
  ``chatcore logs export --salvage`` recovers what the file still holds.

FTS5 runs its own check as a write (an ``INSERT`` of the ``integrity-check`` command), which
a read-only log (a read-only mount or folder, a ``?mode=ro`` URI) refuses. That refusal is
not damage: such a log has the search index's cheap check instead, and is reported sound
and read-only.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.exc import SQLAlchemyError

from chatcore.log.connection import _WRITE, reason
from chatcore.log.errors import LogError
from chatcore.log.reading import StoreReading

FTS_TABLE = "messages_fts"
PROBLEMS_SHOWN = 20
_NAMED_INDEX = re.compile(r"\bindex (\w+)")
_TREE_PAGE = re.compile(r"\btree page (\d+)")


@dataclass
class Damage:
    """What a check found: damaged rows, damaged indexes (by name), a damaged search index."""

    rows: list[str] = field(default_factory=list)
    indexes: list[str] = field(default_factory=list)
    fts: str | None = None
    rows_read: bool = False
    """Every table still reads in full (``NOT INDEXED``) though the file cannot be checked: the
    damage is in an index or the file's own bookkeeping, which SQLite cannot rebuild in place."""
    read_only: str | None = None
    """Why the search index had only the cheap check where the full one was asked for: the log
    cannot be written (FTS5's own check runs as a write)."""

    @property
    def found(self) -> bool:
        return bool(self.rows or self.indexes or self.fts)

    @property
    def repairable(self) -> bool:
        """Only what can be rebuilt from intact rows is damaged."""
        return not self.rows and bool(self.indexes or self.fts)

    def describe(self) -> str:
        """One line: what is damaged."""
        parts = []
        if self.rows:
            more = f" (and {len(self.rows) - 1} more)" if len(self.rows) > 1 else ""
            where = "its structure" if self.rows_read else "rows"
            parts.append(f"{where}: {self.rows[0]}{more}")
        if self.indexes:
            parts.append(f"index{'es' if len(self.indexes) > 1 else ''} {', '.join(self.indexes)}")
        if self.fts:
            parts.append(f"search index: {self.fts}")
        return "; ".join(parts) or "no damage"


class StoreCheck(StoreReading):
    """Finding damage in an SQLite log, and rebuilding its indexes and search index."""

    damage: Damage | None = None
    """What the check on open found (None: not checked, or not an SQLite file)."""
    repaired: str | None = None
    """The one-line notice of what the check on open rebuilt, if anything."""

    def find_damage(self, full: bool = False) -> Damage:
        """Check the file: ``PRAGMA integrity_check`` and the search index (fully with ``full``)."""
        damage = Damage()
        if not self.is_sqlite:
            return damage
        try:
            with self.db.connect() as connection:
                # SQLite may put several problems into one row, one a line, under a "*** in database" title.
                problems = [
                    line.strip()
                    for row in connection.exec_driver_sql(f"PRAGMA integrity_check({PROBLEMS_SHOWN})")
                    for line in str(row[0]).splitlines()
                    if line.strip() and not line.startswith("***")
                ]
                if problems != ["ok"]:
                    self._sort_problems(connection, problems, damage)
                if self.fts:
                    damage.fts = self._fts_problem(connection, full, damage)
        except SQLAlchemyError as error:
            damage.rows.append(reason(error))
            damage.rows_read = self._rows_read()
        return damage

    def _rows_read(self) -> bool:
        """Whether every table of the log reads in full without its indexes."""
        try:
            with self.db.connect() as connection:
                tables = [
                    name
                    for (name,) in connection.exec_driver_sql(
                        "SELECT name FROM sqlite_master WHERE type = 'table' AND sql NOT LIKE 'CREATE VIRTUAL%'"
                    )
                ]
                for table in tables:
                    for _ in connection.exec_driver_sql(f'SELECT * FROM "{table}" NOT INDEXED'):
                        pass
        except (SQLAlchemyError, MemoryError):
            return False
        return bool(tables)

    def _sort_problems(self, connection: sa.Connection, problems: list[str], damage: Damage) -> None:
        """Put each problem with the index it names or whose page it is on; anything else is the rows'."""
        indexes, fts_tables, owners = self._page_owners(connection)
        for problem in problems:
            named = _NAMED_INDEX.search(problem)
            page = _TREE_PAGE.search(problem)
            owner = named.group(1) if named else owners.get(int(page.group(1))) if page else None
            if owner in indexes:
                if owner not in damage.indexes:
                    damage.indexes.append(owner)
            elif owner in fts_tables:
                damage.fts = damage.fts or problem
            else:
                damage.rows.append(problem)

    def _page_owners(self, connection: sa.Connection) -> tuple[set[str], set[str], dict[int, str]]:
        """The file's indexes, the search index's tables, and the b-tree each page belongs to."""
        indexes: set[str] = set()
        fts_tables: set[str] = set()
        owners: dict[int, str] = {}
        try:
            for kind, name in connection.exec_driver_sql("SELECT type, name FROM sqlite_master"):
                if kind == "index":
                    indexes.add(name)
                elif name.startswith(FTS_TABLE + "_"):
                    fts_tables.add(name)
            # dbstat walks every b-tree; on a file whose structure is damaged it may fail,
            # and then every page problem counts as the rows' (never written into).
            owners = {row[0]: row[1] for row in connection.exec_driver_sql("SELECT pageno, name FROM dbstat")}
        except SQLAlchemyError:
            pass
        return indexes, fts_tables, owners

    def _fts_problem(self, connection: sa.Connection, full: bool, damage: Damage) -> str | None:
        """Why the search index cannot be used, or None: cheap on open, FTS5's own check with ``full``
        (the cheap one, noted in ``damage.read_only``, when the log cannot be written)."""
        run = connection.exec_driver_sql
        try:
            if full:
                try:
                    run(f"INSERT INTO {FTS_TABLE}({FTS_TABLE}, rank) VALUES ('integrity-check', 0)")
                    return None
                except sa.exc.OperationalError as error:
                    if not _is_read_only(error):
                        raise
                    damage.read_only = reason(error)
            indexed = run(f"SELECT count(*) FROM {FTS_TABLE}_docsize").scalar()
            messages = run("SELECT count(*) FROM messages").scalar()
            if indexed != messages:
                return f"it holds {indexed} message(s) of {messages}"
            newest = run("SELECT text FROM messages ORDER BY id DESC LIMIT 1").scalar()
            if newest and len(newest.strip()) >= 3:
                # One search through the index's structure, for a word the newest message holds.
                phrase = '"' + newest.strip()[:3].replace('"', '""') + '"'
                found = run(
                    f"SELECT count(*) FROM (SELECT rowid FROM {FTS_TABLE} WHERE {FTS_TABLE} MATCH ? LIMIT 1)",
                    (phrase,),
                ).scalar()
                if not found:
                    return "the newest message is not found in it"
        except SQLAlchemyError as error:
            return reason(error)
        except MemoryError:
            # SQLITE_NOMEM: a damaged block that decodes as an absurd size (see _errors).
            return "SQLite ran out of memory reading it (a damaged block)"
        return None

    def repair(self, damage: Damage) -> str:
        """Rebuild the damaged indexes and search index from the rows; returns what was rebuilt.

        Raises LogError when the rows are damaged (nothing is written then) or when a
        rebuild fails.
        """
        if damage.rows:
            what = "it is damaged where no rebuild reaches" if damage.rows_read else "its rows are damaged"
            raise LogError(
                f"conversation log {self.display_url}: {what} ({damage.describe()}); nothing is "
                f"written into it: `chatcore logs export --salvage --db {self.display_url} -o saved.jsonl` "
                "recovers what it holds"
            )
        rebuilt = []
        with self._errors("rebuild its indexes"), self.db.connect() as connection:
            connection.execution_options(**_WRITE)
            with connection.begin():
                for index in damage.indexes:
                    connection.exec_driver_sql(f'REINDEX "{index}"')
                    rebuilt.append(f"index {index}")
                if damage.fts:
                    _rebuild_fts(connection)
                    rebuilt.append("the search index")
        return ", ".join(rebuilt)

    def check_on_open(self) -> None:
        """The check when a chat opens the file: rebuild what can be, and note damaged rows in :attr:`damage`."""
        damage = self.find_damage()
        if damage.repairable:
            what = damage.describe()
            try:
                rebuilt = self.repair(damage)
            except LogError as error:
                damage.rows.append(f"a rebuild failed: {error}")
            else:
                damage = self.find_damage()
                if damage.repairable:
                    damage.rows.append(f"still damaged after the rebuild: {damage.describe()}")
                elif not damage.found:
                    self.repaired = (
                        f"conversation log {self.display_url} was damaged ({what}): rebuilt {rebuilt} from its "
                        "rows, no message lost"
                    )
        self.damage = damage

    def quick_check(self) -> str | None:
        """None when the rows can be written to (after the check on open rebuilt any index), else the damage."""
        damage = self.damage if self.damage is not None else self.find_damage()
        return damage.describe() if damage.rows else None


def _is_read_only(error: sa.exc.OperationalError) -> bool:
    """SQLite refused a write because the database cannot be written (SQLITE_READONLY and its
    extended codes), not because of what it holds."""
    code = getattr(error.orig, "sqlite_errorcode", None)
    return isinstance(code, int) and code & 0xFF == sqlite3.SQLITE_READONLY


def _cannot_write(error: sa.exc.OperationalError) -> bool:
    """The database cannot be written now (read-only, or locked by another process): a rebuild
    that failed so changed nothing, and may work later."""
    code = getattr(error.orig, "sqlite_errorcode", None)
    locked = isinstance(code, int) and code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    return locked or _is_read_only(error)


def _rebuild_fts(connection: sa.Connection) -> None:
    """FTS5's ``rebuild``, from an empty index: its own records may be too damaged to open it at all.

    The shadow tables are emptied and given the records a new FTS5 table starts with
    (copied from one made in the temporary schema), then FTS5 indexes every message anew."""
    run = connection.exec_driver_sql
    run("CREATE VIRTUAL TABLE temp.chatcore_empty_fts USING fts5(text)")
    try:
        run(f"DELETE FROM {FTS_TABLE}_data")
        run(f"DELETE FROM {FTS_TABLE}_idx")
        run(f"DELETE FROM {FTS_TABLE}_docsize")
        run(f"INSERT INTO {FTS_TABLE}_data (id, block) SELECT id, block FROM temp.chatcore_empty_fts_data")
    finally:
        run("DROP TABLE temp.chatcore_empty_fts")
    run(f"INSERT INTO {FTS_TABLE}({FTS_TABLE}) VALUES ('rebuild')")


def check_report(store: StoreCheck, repair: bool, echo: Callable[[str], None]) -> int:
    """``chatcore logs check``: the full check, said in a few lines; the exit status (0: sound)."""
    if not store.is_sqlite:
        echo(f"{store.display_url} is not an SQLite file: the database server checks its own pages")
        return 0
    damage = store.find_damage(full=True)
    if not damage.found:
        checked = (
            "every page, every index and the search index checked"
            if damage.read_only is None
            else "every page and every index checked, the search index by its size and one search: the log is "
            f"read-only ({damage.read_only}) and FTS5's full check runs as a write"
        )
        echo(
            f"ok: {store.display_url}: {store.count_conversations()} conversation(s), {store.count_messages()} "
            f"message(s); {checked}"
        )
        return 0
    echo(f"damaged: {store.display_url}: {damage.describe()}")
    salvage = f"`chatcore logs export --salvage --db {store.display_url} -o saved.jsonl`"
    if damage.rows and damage.rows_read:
        echo(
            "every row still reads, but the damage (an index page or the file's bookkeeping) is where SQLite "
            f"cannot rebuild in place: a chat never writes into it (turns go to the journal); {salvage} "
            "recovers every conversation"
        )
        return 1
    if damage.rows:
        echo(
            f"its rows are damaged: a chat never writes into it (turns go to the journal); {salvage} "
            "recovers what it holds"
        )
        return 1
    if not repair:
        echo(f"`chatcore logs check --repair --db {store.display_url}` rebuilds them from the rows (nothing is lost)")
        return 1
    try:
        rebuilt = store.repair(damage)
    except LogError as error:
        if isinstance(error.__cause__, sa.exc.OperationalError) and _cannot_write(error.__cause__):
            echo(f"nothing was rebuilt ({error}); run it again once the log can be written")
            return 1
        # A damaged page of an index can be past rebuilding in place: REINDEX and DROP INDEX
        # both need to read it. The rows are intact, and the file is never written into.
        echo(
            f"the rebuild failed ({error}); SQLite cannot rebuild it in place: a chat never writes into it "
            f"(turns go to the journal); {salvage} recovers every conversation"
        )
        return 1
    after = store.find_damage(full=True)
    if after.found:
        echo(f"rebuilt {rebuilt}, but it is still damaged: {after.describe()}")
        return 1
    echo(f"rebuilt {rebuilt} from the rows; the log is sound now")
    return 0
