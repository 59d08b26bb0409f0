"""The conversation log under faults, on SQLite and on a real PostgreSQL server.

Each of the losses of issue 17 is reproduced here and shown fixed: many processes
opening a new log at once, SIGKILL during the first open, a file read-only when the
chat starts, a full queue of waiting writes, a NUL in a reply. The PostgreSQL cases
run against a throwaway cluster started by these tests (``make test`` installs the
server from the distribution's packages).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from log_openers import open_in_crowds
from pg_cluster import (
    ThrowawayCluster,
    unavailable_reason,
)

from chatcore.log import ConversationLogPlugin
from chatcore.log.location import sqlite_url
from chatcore.log.store import ConversationStore

FORK = multiprocessing.get_context("fork")
SPAWN = multiprocessing.get_context("spawn")
TRIALS = 20
OPENERS = 4


# -- backends -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def postgres_cluster() -> Iterator[ThrowawayCluster]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with ThrowawayCluster() as cluster:
        yield cluster


@dataclass
class Backend:
    """Makes new, empty logs on one kind of database."""

    name: str
    folder: Path
    cluster: ThrowawayCluster | None = None
    made: list[str] = field(default_factory=list)

    def new_url(self) -> str:
        if self.cluster is not None:
            self.made.append(self.cluster.create_database())
            return self.made[-1]
        return sqlite_url(Path(tempfile.mkdtemp(dir=self.folder)) / "log.sqlite3")

    def drop_all(self) -> None:
        while self.cluster is not None and self.made:
            self.cluster.drop_database(self.made.pop())


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "postgres":
        made = Backend("postgres", tmp_path, request.getfixturevalue("postgres_cluster"))
    else:
        made = Backend("sqlite", tmp_path)
    yield made
    made.drop_all()


def open_only(url: str) -> None:
    ConversationStore(url, timeout_s=30).close()


# -- 1. many processes opening a new log at once -----------------------------------------------
@pytest.mark.slow
def test_processes_opening_a_new_log_at_once_all_log(backend: Backend) -> None:
    urls = [backend.new_url() for _ in range(TRIALS)]
    results = SPAWN.Queue()
    # The openers are forked by a fresh process of their own: forked from this one, they could
    # inherit a lock that another of the suite's threads held at that moment, and wait forever.
    forker = SPAWN.Process(target=open_in_crowds, args=(urls, OPENERS, results))
    forker.start()
    try:
        for trial, url in enumerate(urls):
            assert results.get(timeout=120) == [0] * OPENERS, f"trial {trial}"
            with ConversationStore(url) as store:
                assert store.count_messages() == 2 * OPENERS and store.count_conversations() == OPENERS + 1
                assert len(store.search("hello from process")) == OPENERS
                assert len(store.get_conversation("shared").messages) == OPENERS
    finally:
        forker.join(60)
        if forker.is_alive():
            forker.kill()


# -- 2. SIGKILL during the first open ------------------------------------------------------------
@pytest.mark.slow
def test_a_kill_at_any_point_of_the_first_open_leaves_a_working_log(backend: Backend) -> None:
    timing = backend.new_url()
    started = time.perf_counter()
    open_only(timing)
    first_open_s = time.perf_counter() - started
    chooser = random.Random(17)
    for trial in range(TRIALS):
        url = backend.new_url()
        process = FORK.Process(target=open_only, args=(url,))
        process.start()
        time.sleep(chooser.uniform(0, first_open_s * 1.5))
        os.kill(process.pid, signal.SIGKILL)
        process.join(30)
        with ConversationStore(url) as store:  # whatever the kill left, the log works
            store.add_message("after", "user", "a pizza after the crash", conversation={"title": "after"})
            assert [s.id for s in store.list_conversations()] == ["after"], f"trial {trial}"
            assert [h.message.text for h in store.search("pizza")] == ["a pizza after the crash"]
            if store.is_sqlite:
                assert store.fts  # the search index and its triggers are whole


# -- 3. a log that cannot be written when the chat starts, then can ----------------------------------
NOBODY = 65534


@contextmanager
def as_user(uid: int | None) -> Iterator[None]:
    """Run the block with this effective user id (root only: file modes do not bind root)."""
    if uid is None:
        yield
        return
    os.setegid(uid)
    os.seteuid(uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def chat(engine: Any, conversation: Any, texts: Iterable[str], reply: str = "a fixed reply") -> None:
    for text in texts:
        engine.send(conversation, text, decoder="fixed-text", decoder_settings={"text": reply}).text()


def logged_texts(store: ConversationStore, conversation_id: str) -> list[tuple[str, str]]:
    return [(m.role, m.text) for m in store.get_conversation(conversation_id).messages]


def test_a_file_read_only_at_the_start_is_written_once_it_is_writable(chat_engine: Any) -> None:
    folder = Path(tempfile.mkdtemp())
    try:
        folder.chmod(0o777)  # the unprivileged user makes the WAL files and the journal here
        path = folder / "log.sqlite3"
        ConversationStore(sqlite_url(path)).close()
        path.chmod(0o444)
        other = NOBODY if os.geteuid() == 0 else None
        told: list[str] = []
        with as_user(other):
            store = ConversationStore(sqlite_url(path), timeout_s=0.2)  # its connection opens read-only
            plugin = ConversationLogPlugin(store, notify=told.append, retry_after_s=0.0, journal_dir=folder / "journal")
            chat_engine.host.register(plugin, "conversation-log")
            conversation = chat_engine.conversation()
            chat(chat_engine, conversation, ["one", "two"])
            assert plugin.failing and "readonly" in plugin.failing.replace(" ", "").replace("-", "")
            with as_user(None if other is None else 0):
                path.chmod(0o666)  # writable again, while the chat goes on
            chat(chat_engine, conversation, ["three"])
            assert plugin.pending == 0 and plugin.failing is None and "available again" in told[-1]
            assert logged_texts(store, conversation.id) == [(t.role, t.text) for t in conversation.turns]
            store.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# -- a database that fails, and comes back ------------------------------------------------------
@contextmanager
def unavailable(store: ConversationStore, backend: Backend) -> Iterator[None]:
    """The database refuses every write for the block: locked (SQLite), or closed to connections (PostgreSQL)."""
    if backend.cluster is None:
        blocker = sqlite3.connect(sa.engine.make_url(store.url).database, isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")  # another process holding the write lock
        try:
            yield
        finally:
            blocker.rollback()
            blocker.close()
        return
    name = sa.engine.make_url(store.url).database
    admin = sa.create_engine(backend.cluster.url(), isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.exec_driver_sql(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        connection.exec_driver_sql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'")
        try:
            yield
        finally:
            connection.exec_driver_sql(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
    admin.dispose()


def refuse_connections(cluster: ThrowawayCluster, url: str, refuse: bool) -> None:
    """Close the database at ``url`` to connections (and end those it has), or open it again."""
    name = sa.engine.make_url(url).database
    admin = sa.create_engine(cluster.url(), isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.exec_driver_sql(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {"false" if refuse else "true"}')
        if refuse:
            connection.exec_driver_sql(
                f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'"
            )
    admin.dispose()


# -- 4. writes the database cannot take go to the journal at once ---------------------------------------
def test_writes_that_cannot_reach_the_database_are_journaled_at_once_and_replayed_in_order(
    chat_engine: Any, backend: Backend, tmp_path: Path
) -> None:
    store = ConversationStore(backend.new_url(), timeout_s=0.05)
    told: list[str] = []
    plugin = ConversationLogPlugin(store, notify=told.append, retry_after_s=0.0, journal_dir=tmp_path / "journal")
    chat_engine.host.register(plugin, "conversation-log")
    conversation = chat_engine.conversation()
    with unavailable(store, backend):
        chat(chat_engine, conversation, [f"turn {n}" for n in range(6)])
        assert plugin.failing and plugin.pending == 12 and plugin.journaled == 12  # none waits in memory only
        (journal,) = (tmp_path / "journal").glob("*.jsonl")
        assert len(journal.read_text().splitlines()) == 12  # on the disk as each turn was acknowledged
    chat(chat_engine, conversation, ["after"])  # the next turn retries
    assert plugin.pending == 0 and plugin.failing is None and "available again" in told[-1]
    assert logged_texts(store, conversation.id) == [(t.role, t.text) for t in conversation.turns]  # in order
    assert list((tmp_path / "journal").glob("*.jsonl")) == []
    plugin.close()
    store.close()


def test_a_timer_retries_without_waiting_for_the_next_turn(chat_engine: Any, backend: Backend, tmp_path: Path) -> None:
    import threading

    store = ConversationStore(backend.new_url(), timeout_s=0.05)
    recovered = threading.Event()

    def notify(message: str) -> None:
        if "available again" in message:
            recovered.set()

    plugin = ConversationLogPlugin(store, notify=notify, retry_after_s=0.05, journal_dir=tmp_path / "journal")
    chat_engine.host.register(plugin, "conversation-log")
    conversation = chat_engine.conversation()
    with unavailable(store, backend):
        chat(chat_engine, conversation, ["said while the log was down"])
        assert plugin.journaled == 2
    assert recovered.wait(timeout=60), "the journal was not replayed"
    assert plugin.pending == 0 and logged_texts(store, conversation.id) == [
        (t.role, t.text) for t in conversation.turns
    ]
    plugin.close()
    store.close()


def test_writes_journaled_at_exit_are_replayed_by_the_next_process(
    chat_engine: Any, backend: Backend, tmp_path: Path
) -> None:
    url = backend.new_url()
    store = ConversationStore(url, timeout_s=0.05)
    plugin = ConversationLogPlugin(
        store, notify=lambda message: None, retry_after_s=0.0, journal_dir=tmp_path / "journal"
    )
    chat_engine.host.register(plugin, "conversation-log")
    conversation = chat_engine.conversation()
    with unavailable(store, backend):
        chat(chat_engine, conversation, ["said while the log was down", "and this"])
        assert plugin.close() == 4  # the process ends: its waiting writes go to the journal
    store.close()
    chat_engine.host.unregister(plugin)

    with ConversationStore(url) as later:
        ConversationLogPlugin(later, journal_dir=tmp_path / "journal")  # the next process adopts the journal
        assert logged_texts(later, conversation.id) == [(t.role, t.text) for t in conversation.turns]
    assert list((tmp_path / "journal").glob("*.jsonl")) == []


def test_a_resumed_conversation_holds_what_an_ended_chat_journaled_and_goes_on_as_one(
    chat_engine: Any, backend: Backend, tmp_path: Path
) -> None:
    """`chat --continue` after a chat that could only journal its turns: the journal is written when
    the log opens, before the conversation is read. Read without them, the resumed chat's next
    write found them (another writer's, written since it read) and went on in a new conversation."""
    journal = tmp_path / "journal"
    url = backend.new_url()
    with ConversationStore(url, journal_dir=journal) as first:
        plugin = ConversationLogPlugin(first, notify=lambda message: None, journal_dir=journal)
        chat_engine.host.register(plugin, "conversation-log")
        conversation = chat_engine.conversation()
        chat(chat_engine, conversation, ["one"])
        plugin.close()
        chat_engine.host.unregister("conversation-log")

    with ConversationStore(url, timeout_s=0.05, journal_dir=journal) as second:  # --continue, with the log down
        resumed = second.resume(conversation.id)
        plugin = ConversationLogPlugin(second, notify=lambda message: None, retry_after_s=0.0, journal_dir=journal)
        chat_engine.host.register(plugin, "conversation-log")
        with unavailable(second, backend):
            chat(chat_engine, resumed, ["two"])
            assert plugin.close() == 2  # the chat ends with its turns in the journal
        chat_engine.host.unregister("conversation-log")

    told: list[str] = []
    with ConversationStore(url, journal_dir=journal) as third:  # --continue, the log back
        again = third.resume(conversation.id)
        assert [t.text for t in again.turns if t.role == "user"] == ["one", "two"]
        plugin = ConversationLogPlugin(third, notify=told.append, journal_dir=journal)
        chat_engine.host.register(plugin, "conversation-log")
        chat(chat_engine, again, ["three"])
        plugin.close()
        assert told == []  # no "being written by another chat as well"
        assert [summary.id for summary in third.list_conversations()] == [conversation.id]
        users = [text for role, text in logged_texts(third, conversation.id) if role == "user"]
        assert users == ["one", "two", "three"]
    assert list(journal.glob("*.jsonl")) == []


def journal_while_unavailable(
    chat_engine: Any, store: ConversationStore, backend: Backend, journal: Path, turns: Any
) -> None:
    """A chat that ends while the database is unavailable: what ``turns()`` says in it waits in the
    journal for the next process."""
    plugin = ConversationLogPlugin(store, notify=lambda message: None, retry_after_s=0.0, journal_dir=journal)
    chat_engine.host.register(plugin, "conversation-log")
    with unavailable(store, backend):
        turns()
        assert plugin.close() > 0
    chat_engine.host.unregister("conversation-log")
    store.close()


def test_a_deleted_conversation_does_not_come_back_when_the_journal_is_replayed(
    chat_engine: Any, backend: Backend, tmp_path: Path, monkeypatch: Any
) -> None:
    """`logs delete` of a conversation whose later turns wait in the journal (the log was locked when
    its chat ended): the next opener replayed them, and the conversation was back under its id, its
    deleted first message as its title."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))  # `logs delete` finds the journal there
    journal = tmp_path / "data" / "chatcore" / "log-journal"
    url = backend.new_url()
    store = ConversationStore(url, timeout_s=0.05, journal_dir=journal)
    secret, kept = chat_engine.conversation(), chat_engine.conversation()

    def turns() -> None:
        chat(chat_engine, secret, ["and my pin is 9999"])
        chat(chat_engine, kept, ["keep this one"])

    store.add_message(secret.id, "user", "a secret", conversation={"title": "a secret"})
    journal_while_unavailable(chat_engine, store, backend, journal, turns)
    assert len(list(journal.glob("*.jsonl"))) == 1
    listed = logs_command("list", "--db", url)  # what it shows leaves the waiting writes out, and says so
    assert listed.exit_code == 0 and listed.stderr.startswith("note: 4 write(s) wait in the journal"), listed.output

    deleted = logs_command("delete", "--yes", secret.id[:12], "--db", url)
    assert deleted.exit_code == 0, deleted.output
    assert deleted.stdout.strip() == (
        f"deleted conversation {secret.id} and its 1 message(s), and 2 waiting in the journal, "
        "which will not be written"
    )
    shown = logs_command("search", "pin", "--db", url)  # the deleted conversation's writes are not counted
    assert shown.exit_code == 0 and "note: 2 write(s) wait in the journal" in shown.stderr, shown.output
    with ConversationStore(url, journal_dir=journal) as later:  # the next chat: the journal is replayed
        assert [summary.id for summary in later.list_conversations()] == [kept.id]
        assert logged_texts(later, kept.id) == [("user", "keep this one"), ("bot", "a fixed reply")]
        assert later.search("9999") == []
    assert list(journal.iterdir()) == []  # the journal, and the record of the deletion, gone with it


def files_holding(folder: Path, text: str) -> list[str]:
    """The names of the files under ``folder`` whose bytes hold ``text``."""
    return sorted(path.name for path in folder.rglob("*") if path.is_file() and text.encode() in path.read_bytes())


def test_logs_delete_scrubs_every_journal_folder_and_the_writes_set_aside(
    chat_engine: Any, backend: Backend, tmp_path: Path, monkeypatch: Any
) -> None:
    """A chat that journals into a folder other than the default (``journal_dir=``) notes it in the
    default one; `logs delete` then finds it, and takes the deleted conversation out of the writes the
    log refused (``-rejected.jsonl``) and out of the journal of the chat that ended, at once: no file
    keeps its text. The other conversation's writes stay, and the next opener writes them."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    journal = tmp_path / "elsewhere"
    url = backend.new_url()
    store = ConversationStore(url, timeout_s=0.05, journal_dir=journal)
    plugin = ConversationLogPlugin(store, notify=lambda message: None, journal_dir=journal)
    chat_engine.host.register(plugin, "conversation-log")
    secret, kept = chat_engine.conversation(), chat_engine.conversation()
    chat(chat_engine, secret, ["my pin is 9999"])
    with store.db.begin() as connection:  # a rule the next messages break: refused for their content
        connection.execute(sa.text("CREATE UNIQUE INDEX one_of_each ON messages (text)"))
    chat(chat_engine, secret, ["my pin is 9999"])  # both turns refused: set aside
    chat(chat_engine, kept, ["keep this one"])  # its reply repeats the first: set aside
    plugin.close()
    chat_engine.host.unregister("conversation-log")
    assert plugin.rejected == 3

    def turns() -> None:
        chat(chat_engine, secret, ["the pin was 9999"], reply="noted 9999")
        chat(chat_engine, kept, ["keep this too"], reply="kept reply")

    journal_while_unavailable(chat_engine, store, backend, journal, turns)
    assert files_holding(journal, "9999") == sorted(path.name for path in journal.glob("*.jsonl"))

    deleted = logs_command("delete", "--yes", secret.id[:12], "--db", url)
    assert deleted.exit_code == 0, deleted.output
    assert deleted.stdout.strip() == (
        f"deleted conversation {secret.id} and its 2 message(s), and 2 waiting in the journal, which will not be "
        "written, and 2 set aside as refused"
    )
    assert files_holding(journal, "9999") == [] and files_holding(tmp_path / "data", "9999") == []
    (rejected,) = journal.glob("*-rejected.jsonl")
    assert "keep this one" in rejected.read_text() and len(rejected.read_text().splitlines()) == 1
    with ConversationStore(url, journal_dir=journal) as later:  # the next chat: the journal is replayed
        assert [summary.id for summary in later.list_conversations()] == [kept.id]
        assert [text for _, text in logged_texts(later, kept.id)] == ["keep this one", "keep this too", "kept reply"]
    assert sorted(path.name for path in journal.iterdir()) == [rejected.name]


def test_an_authors_messages_waiting_in_the_journal_are_deleted_with_the_author(
    chat_engine: Any, backend: Backend, tmp_path: Path
) -> None:
    journal = tmp_path / "journal"
    url = backend.new_url()
    store = ConversationStore(url, timeout_s=0.05, journal_dir=journal)
    room = chat_engine.conversation(adapter="discord")
    carol = "c" * 80  # longer than the column: found by its stored digest

    def turns() -> None:
        chat_engine.add_user(room, "carol: my address is 1 Elm St", meta={"author_id": carol})
        chat_engine.add_user(room, "dave: hello all", meta={"author_id": "dave"})

    store.add_message(room.id, "user", "carol was here", author_id=carol, conversation={"adapter": "discord"})
    journal_while_unavailable(chat_engine, store, backend, journal, turns)

    with ConversationStore(url, create=False, journal_dir=journal) as operator:
        assert operator.delete_author(carol) == 1 and operator.journal_withheld == 1
    assert files_holding(journal, "1 Elm St") == []  # the ended chat's journal, the title of his write too
    with ConversationStore(url, journal_dir=journal) as later:  # the next chat: the journal is replayed
        record = later.get_conversation(room.id)
        assert [(m.text, m.author_id) for m in record.messages] == [("dave: hello all", "dave")]
        assert record.title is None  # not her deleted message, which the journaled write of his was titled by
        assert list(journal.iterdir()) == []  # the journal, and the record of the deletion, gone with it
        plugin = ConversationLogPlugin(later, notify=lambda message: None, journal_dir=journal)
        chat_engine.host.register(plugin, "conversation-log")
        chat_engine.add_user(room, "carol: one more thing", meta={"author_id": carol})
        plugin.close()
        chat_engine.host.unregister("conversation-log")
        # What she says after the deletion is logged as ever.
        assert [hit.message.text for hit in later.search("one more thing")] == ["carol: one more thing"]


# -- 5. values the database cannot store, and a write it refuses -------------------------------------
def test_a_nul_in_a_reply_is_stored_and_the_turns_after_it_too(
    chat_engine: Any, backend: Backend, tmp_path: Path
) -> None:
    store = ConversationStore(backend.new_url())
    told: list[str] = []
    plugin = ConversationLogPlugin(store, notify=told.append, journal_dir=tmp_path / "journal")
    chat_engine.host.register(plugin, "conversation-log")
    conversation = chat_engine.conversation()
    chat(chat_engine, conversation, ["say a nul"], reply="before\x00after")
    assert conversation.turns[-1].text == "before\x00after"  # the model did say it
    chat(chat_engine, conversation, [f"turn {n}" for n in range(7)])
    assert told == [] and plugin.pending == 0
    logged = logged_texts(store, conversation.id)
    assert len(logged) == 16
    # PostgreSQL's text cannot hold NUL: it is replaced on every backend alike, and noted.
    assert logged[1] == ("bot", "before\u2400after")
    assert (
        "text: NUL replaced by U+2400"
        in (store.get_conversation(conversation.id).messages[1].provenance or {})["normalised"]
    )
    store.add_message(conversation.id, "user", "lone \udc80 surrogate")
    assert store.get_conversation(conversation.id).messages[-1].text == "lone \ufffd surrogate"
    store.close()


def test_a_write_the_database_refuses_is_set_aside_and_the_rest_go_on(
    chat_engine: Any, backend: Backend, tmp_path: Path
) -> None:
    store = ConversationStore(backend.new_url())
    told: list[str] = []
    plugin = ConversationLogPlugin(store, notify=told.append, journal_dir=tmp_path / "journal")
    chat_engine.host.register(plugin, "conversation-log")
    conversation = chat_engine.conversation()
    chat(chat_engine, conversation, ["first"])
    with store.db.begin() as connection:  # a rule the next message breaks: refused for its content
        connection.execute(sa.text("CREATE UNIQUE INDEX one_of_each ON messages (text)"))
    chat(chat_engine, conversation, ["second"])  # its reply repeats the first reply: refused
    chat(chat_engine, conversation, ["third"], reply="a different reply")
    assert plugin.pending == 0 and plugin.rejected == 1 and len(told) == 1 and "refused" in told[0]
    assert [text for _, text in logged_texts(store, conversation.id)] == [
        "first",
        "a fixed reply",
        "second",
        "third",
        "a different reply",
    ]
    rejected = list((tmp_path / "journal").glob("*-rejected.jsonl"))
    assert len(rejected) == 1 and "a fixed reply" in rejected[0].read_text()
    plugin.close()
    store.close()
    # What was set aside is a record beside the journal, not a journal: the next opener leaves it be.
    with ConversationStore(store.url, journal_dir=tmp_path / "journal") as later:
        ConversationLogPlugin(later, journal_dir=tmp_path / "journal").close()
        assert later.count_messages() == 5
    assert rejected[0].exists() and "a fixed reply" in rejected[0].read_text()


# -- PostgreSQL: a dropped connection is replaced ----------------------------------------------------------
def test_connections_dropped_by_the_server_are_replaced(
    chat_engine: Any, postgres_cluster: ThrowawayCluster, tmp_path: Path
) -> None:
    url = postgres_cluster.create_database()
    store = ConversationStore(url)
    plugin = ConversationLogPlugin(store, retry_after_s=0.0, journal_dir=tmp_path / "journal")
    chat_engine.host.register(plugin, "conversation-log")
    conversation = chat_engine.conversation()
    chat(chat_engine, conversation, ["one"])
    name = sa.engine.make_url(url).database
    admin = sa.create_engine(postgres_cluster.url(), isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:  # a server restart, as the pooled connections see it
        connection.exec_driver_sql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'")
    admin.dispose()
    chat(chat_engine, conversation, ["two"])
    assert plugin.pending == 0 and plugin.failing is None
    assert logged_texts(store, conversation.id) == [(t.role, t.text) for t in conversation.turns]
    with store.db.connect() as connection:  # search is served by the trigram index, not a scan
        connection.exec_driver_sql("SET enable_seqscan = off")
        plan = " ".join(
            row[0]
            for row in connection.exec_driver_sql("EXPLAIN SELECT id FROM messages WHERE text ILIKE '%%fixed rep%%'")
        )
    assert "ix_messages_text_trgm" in plan
    store.close()


# -- reading where nothing can be written ------------------------------------------------------------
def test_a_log_in_a_read_only_folder_can_be_read() -> None:
    folder = Path(tempfile.mkdtemp())
    path = folder / "log.sqlite3"
    with ConversationStore(sqlite_url(path)) as store:
        store.add_message("kept", "user", "a message about pizza", conversation={"title": "kept"})
    path.chmod(0o644)
    folder.chmod(0o555)  # no -shm file can be made here
    other = NOBODY if os.geteuid() == 0 else None
    try:
        with as_user(other):
            with ConversationStore(sqlite_url(path), create=False) as reader:
                assert [s.id for s in reader.list_conversations()] == ["kept"]
                assert [h.message.text for h in reader.search("pizza")] == ["a message about pizza"]
    finally:
        folder.chmod(0o755)
    assert sorted(p.name for p in folder.iterdir()) == ["log.sqlite3"]


# -- the log's own commands cannot destroy it -----------------------------------------------------------
def logs_command(*args: str) -> Any:
    """`chatcore logs ARGS` through the real command line, with the log commands' plugin loaded."""
    from click.testing import CliRunner

    import chatcore.plugin_manager as plugin_manager
    from chatcore.cli import build_cli

    host = plugin_manager.PluginHost()
    host.load_modules(("chatcore.log",))
    plugin_manager.set_plugin_host(host)
    return CliRunner().invoke(build_cli(), ["logs", *args], catch_exceptions=False)


@pytest.fixture
def written_log(tmp_path: Path) -> Path:
    """A log with 38 messages, its -wal still beside it (a chat has it open)."""
    path = tmp_path / "log.sqlite3"
    with ConversationStore(sqlite_url(path)) as store:
        for number in range(19):
            store.add_message("kept", "user", f"question {number}", conversation={"title": "kept"})
            store.add_message("kept", "bot", f"answer {number}")
    return path


def count_messages(path: Path) -> int:
    with ConversationStore(sqlite_url(path), create=False) as store:
        return store.count_messages()


def test_export_never_writes_onto_the_log_or_an_existing_file(written_log: Path, tmp_path: Path) -> None:
    holder = ConversationStore(sqlite_url(written_log))  # a chat holding the log open keeps its -wal and -shm
    holder.add_message("kept", "user", "one more", conversation={"title": "kept"})
    wal, shm = (written_log.with_name(written_log.name + suffix) for suffix in ("-wal", "-shm"))
    assert wal.exists() and shm.exists()
    linked = tmp_path / "hard-link.sqlite3"
    os.link(written_log, linked)
    before = {path: path.read_bytes() for path in (written_log, wal)}
    for target in (written_log, wal, shm, linked, tmp_path / ".." / tmp_path.name / "log.sqlite3"):
        for force in ((), ("--force",)):  # the log's own files are refused even with --force
            result = logs_command("export", "--db", str(written_log), "-o", str(target), *force)
            assert result.exit_code == 1 and "the conversation log's own file" in result.output, target
            assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert {path: path.read_bytes() for path in (written_log, wal)} == before
    assert count_messages(written_log) == 39

    other = tmp_path / "notes.txt"
    other.write_text("precious")
    refused = logs_command("export", "--db", str(written_log), "-o", str(other))
    assert refused.exit_code == 1 and "the file exists (--force replaces it)" in refused.output
    assert other.read_text() == "precious"
    replaced = logs_command("export", "--db", str(written_log), "-o", str(other), "--force")
    assert replaced.exit_code == 0 and other.read_text().count('"role"') == 39
    holder.close()


def test_export_follows_a_symbolic_link_only_when_told_and_says_so(written_log: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_text("")
    link = tmp_path / "export.jsonl"
    link.symlink_to(elsewhere)
    refused = logs_command("export", "--db", str(written_log), "-o", str(link))
    assert refused.exit_code == 1 and "symbolic link" in refused.output and elsewhere.read_text() == ""
    followed = logs_command("export", "--db", str(written_log), "-o", str(link), "--force")
    assert followed.exit_code == 0 and f"writing to {elsewhere}" in followed.output
    assert elsewhere.read_text().count('"role"') == 38
    loop = tmp_path / "loop.jsonl"
    loop.symlink_to(loop)
    looped = logs_command("export", "--db", str(written_log), "-o", str(loop), "--force")
    assert looped.exit_code == 1 and len(looped.output.strip().splitlines()) == 1
    onto_the_log = tmp_path / "innocent.jsonl"
    onto_the_log.symlink_to(written_log)
    for force in ((), ("--force",)):
        result = logs_command("export", "--db", str(written_log), "-o", str(onto_the_log), *force)
        assert result.exit_code == 1 and count_messages(written_log) == 38


def test_an_export_that_cannot_be_written_is_one_line(written_log: Path, tmp_path: Path) -> None:
    """/dev/full answers every write with ENOSPC, as a full disk does."""
    result = logs_command("export", "--db", str(written_log), "-o", "/dev/full")
    assert result.exit_code == 1 and "No space left on device" in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    fresh = tmp_path / "fresh.jsonl"
    assert logs_command("export", "--db", str(written_log), "-o", str(fresh)).exit_code == 0
    assert os.stat(fresh).st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    "args",
    [("export",), ("export", "--format", "markdown"), ("list",), ("show", "kept"), ("search", "question")],
)
def test_standard_output_closed_early_ends_a_logs_command_quietly(written_log: Path, args: tuple[str, ...]) -> None:
    """`chatcore logs export | head -1`: the reader gone is no error, as for any Unix tool (click exits 1)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # gone before the first write, as `head -1` is after its line
    try:
        done = subprocess.run(
            [sys.executable, "-m", "chatcore.cli", "logs", *args, "--db", str(written_log)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            env=dict(os.environ, CHATCORE_PLUGINS=""),
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert done.returncode == 1 and done.stderr.decode() == "", done.stderr.decode()


# -- private by default --------------------------------------------------------------------------------
def mode(path: Path) -> int:
    return os.stat(path).st_mode & 0o777


def test_the_log_its_companions_and_the_journal_are_private(chat_engine: Any, tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    old_umask = os.umask(0o022)  # the usual umask, which used to leave every chat readable by all
    try:
        folder = tmp_path / "data" / "chatcore"  # the user data folder, made when missing (with its parent)
        path = folder / "conversations.sqlite3"
        store = ConversationStore(sqlite_url(path), timeout_s=0.05)
        journal = tmp_path / "data" / "chatcore" / "log-journal"
        plugin = ConversationLogPlugin(store, notify=lambda message: None, retry_after_s=0.0, journal_dir=journal)
        chat_engine.host.register(plugin, "conversation-log")
        conversation = chat_engine.conversation()
        chat(chat_engine, conversation, ["hello"])
        wal, shm = (path.with_name(path.name + suffix) for suffix in ("-wal", "-shm"))
        assert [mode(p) for p in (path, wal, shm)] == [0o600] * 3
        assert mode(folder) == mode(folder.parent) == 0o700
        with unavailable(store, Backend("sqlite", tmp_path)):
            chat(chat_engine, conversation, ["kept in the journal"])
            (journaled,) = journal.glob("*.jsonl")
            assert mode(journaled) == 0o600 and mode(journal) == 0o700
        chat(chat_engine, conversation, ["after"])
        with store.db.begin() as connection:  # a rule the next write breaks: it is set aside
            connection.execute(
                sa.text(
                    "CREATE TRIGGER refuse BEFORE INSERT ON messages WHEN NEW.text = 'refused' "
                    "BEGIN SELECT RAISE(ABORT, 'refused'); END"
                )
            )
        chat(chat_engine, conversation, ["refused"])
        (rejected,) = journal.glob("*-rejected.jsonl")
        assert mode(rejected) == 0o600
        store.close()
    finally:
        os.umask(old_umask)

    assert logs_command("where", "--db", str(path)).output.strip() == sqlite_url(path)
    path.chmod(0o644)
    rejected.chmod(0o640)
    reported = logs_command("where", "--db", str(path))
    warnings = [line for line in reported.output.splitlines() if line.startswith("warning:")]
    assert warnings == [
        f"warning: {path} (file, mode 0644) is open to other users: chmod 600 {path}",
        f"warning: {rejected} (file, mode 0640) is open to other users: chmod 600 {rejected}",
    ]


def test_the_log_folders_an_older_version_left_open_are_made_private_when_opened(
    chat_engine: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    """The user data folder and its log-journal/ made 0755 by an older version are made 0700 when a chat
    opens the log and its journal; a folder named by hand (``--db`` elsewhere) is the user's to choose."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    folder = tmp_path / "data" / "chatcore"
    journal = folder / "log-journal"
    chosen = tmp_path / "chosen"
    for made in (journal, chosen):
        made.mkdir(parents=True)
    for made in (folder, journal, chosen):
        made.chmod(0o755)
    store = ConversationStore(sqlite_url(folder / "conversations.sqlite3"))  # it replays the journal there
    assert mode(folder) == mode(journal) == 0o700
    journal.chmod(0o755)
    plugin = ConversationLogPlugin(store, notify=lambda message: None)  # its journal: the default folder
    assert plugin.journal.folder == journal and mode(journal) == 0o700
    plugin.close()
    store.close()
    ConversationStore(sqlite_url(chosen / "log.sqlite3")).close()
    assert mode(chosen) == 0o755


# -- a full disk ---------------------------------------------------------------------------------------
def test_a_full_disk_loses_no_turn_that_was_shown(chat_engine: Any, tmp_path: Path) -> None:
    """The log, its journal and the disk fill up mid-chat (see tests/disk_full.py: RLIMIT_FSIZE,
    writes fail with EFBIG at the OS boundary), then space is freed: every turn is written, in
    order, and the person was told once that turns wait in memory. A chat that ends while the disk
    is still full ends without an error, and says what was not kept."""
    from disk_full import files_cannot_grow

    path = tmp_path / "log.sqlite3"
    store = ConversationStore(sqlite_url(path), timeout_s=0.05)
    told: list[str] = []
    plugin = ConversationLogPlugin(store, notify=told.append, retry_after_s=0.0, journal_dir=tmp_path / "journal")
    chat_engine.host.register(plugin, "conversation-log")
    conversation = chat_engine.conversation()
    chat(chat_engine, conversation, ["before"])
    store.db.dispose()  # the WAL is checkpointed and removed: the next write must grow a file
    with files_cannot_grow():
        chat(chat_engine, conversation, ["while full 1", "while full 2"])
        assert plugin.pending == 4 and plugin.journaled == 0
        assert [m for m in told if "cannot be written either" in m] == told[1:]  # told once
        assert len(told) == 2 and "wait in memory" in told[1]
    chat(chat_engine, conversation, ["space freed"])
    assert plugin.pending == 0 and plugin.failing is None and plugin.dropped == 0
    assert logged_texts(store, conversation.id) == [(t.role, t.text) for t in conversation.turns]

    told.clear()
    with files_cannot_grow():
        chat(chat_engine, conversation, ["the disk fills again"])
        assert plugin.close() == 0  # nothing could be journaled, and closing does not raise
    assert plugin.pending == 2 and plugin.failing is not None
    assert len([m for m in told if "cannot be written either" in m]) == 1
    chat_engine.host.unregister(plugin)
    store.close()


def test_a_journal_append_cut_short_by_a_full_disk_leaves_no_half_line(tmp_path: Path) -> None:
    """The disk fills in the middle of an append (tests/disk_full.py: the file may grow by 10
    bytes, then the write fails at the OS boundary): the append raises, the file is as it was,
    and the next append after space is freed reads back whole. Closing never raises."""
    from disk_full import files_cannot_grow

    from chatcore.log.journal import SpillJournal

    journal = SpillJournal(tmp_path / "journal", "sqlite:///somewhere.sqlite3")
    journal.append({"key": "first", "text": "kept"})
    size = journal.path.stat().st_size
    with files_cannot_grow(beyond=size + 10):
        with pytest.raises(OSError):
            journal.append({"key": "second", "text": "x" * 100})
        assert journal.path.stat().st_size == size
        journal.close()  # nothing buffered: closing on a full disk is quiet
    reopened = SpillJournal(tmp_path / "journal", "sqlite:///somewhere.sqlite3")  # adopts the file
    reopened.append({"key": "third", "text": "after the disk was freed"})
    assert [entry["key"] for _, entry in reopened.entries()] == ["first", "third"]
    reopened.close()


def test_writes_past_the_memory_bound_on_a_full_disk_are_counted(chat_engine: Any, tmp_path: Path) -> None:
    """Database and journal both full (tests/disk_full.py): past ``max_pending`` writes in
    memory, later ones are dropped and counted, so the exit can say how many were lost."""
    from disk_full import files_cannot_grow

    store = ConversationStore(sqlite_url(tmp_path / "log.sqlite3"), timeout_s=0.05)
    told: list[str] = []
    plugin = ConversationLogPlugin(
        store, notify=told.append, retry_after_s=0.0, max_pending=3, journal_dir=tmp_path / "journal"
    )
    chat_engine.host.register(plugin, "conversation-log")
    conversation = chat_engine.conversation()
    store.db.dispose()
    with files_cannot_grow():
        chat(chat_engine, conversation, ["one", "two", "three"])
        assert plugin.pending == 3 and plugin.dropped == 3 and "up to 3" in told[1]
    chat(chat_engine, conversation, ["four"])
    assert plugin.pending == 0
    assert [text for _, text in logged_texts(store, conversation.id)] == [
        "one",
        "a fixed reply",
        "two",
        "four",
        "a fixed reply",
    ]
    plugin.close()
    store.close()
