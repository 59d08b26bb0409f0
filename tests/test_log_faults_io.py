"""The conversation log's input and output under faults, on SQLite and on a real PostgreSQL server.

Bounded waits on a hung server, one file per log, one writer per conversation, the same
content accepted on both backends, escaped views, and a chat whose log cannot open at
its start. The PostgreSQL cases run against the throwaway cluster these tests start.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import test_conversation_log_faults as faults
from pg_cluster import ThrowawayCluster

from chatcore.log import ConversationLogPlugin, LogError
from chatcore.log.location import sqlite_url
from chatcore.log.store import ConversationStore

# The fault suite's fixtures and helpers.
postgres_cluster = faults.postgres_cluster
backend = faults.backend
Backend = faults.Backend
chat = faults.chat
logged_texts = faults.logged_texts


def recovery_event(told: list[str]) -> tuple[threading.Event, Any]:
    """An event set when the plugin says the log is available again, and the notify that sets it."""
    recovered = threading.Event()

    def notify(message: str) -> None:
        told.append(message)
        if "available again" in message:
            recovered.set()

    return recovered, notify


# -- a hung PostgreSQL server ---------------------------------------------------------------------
def test_postgres_connections_wait_a_bounded_time_unless_the_url_says_otherwise(
    postgres_cluster: ThrowawayCluster,
) -> None:
    url = postgres_cluster.create_database()
    with ConversationStore(url) as store, store.db.connect() as connection:
        assert connection.exec_driver_sql("SHOW statement_timeout").scalar() == "10s"
        parameters = connection.connection.driver_connection.info.get_parameters()  # type: ignore[union-attr]
        assert parameters["connect_timeout"] == "3" and parameters["keepalives_idle"] == "10"
    chosen = f"{url}&connect_timeout=7&options=-c%20statement_timeout%3D2min"
    with ConversationStore(chosen) as store, store.db.connect() as connection:
        assert connection.exec_driver_sql("SHOW statement_timeout").scalar() == "2min"
        parameters = connection.connection.driver_connection.info.get_parameters()  # type: ignore[union-attr]
        assert parameters["connect_timeout"] == "7"


@pytest.mark.slow
def test_a_hung_server_costs_a_turn_a_bounded_wait_and_its_turns_are_stored_once(
    chat_engine: Any, postgres_cluster: ThrowawayCluster, tmp_path: Path
) -> None:
    store = ConversationStore(postgres_cluster.create_database())
    told: list[str] = []
    recovered, notify = recovery_event(told)
    plugin = ConversationLogPlugin(
        store, notify=notify, retry_after_s=0.05, journal_dir=tmp_path / "journal", write_deadline_s=0.5
    )
    chat_engine.host.register(plugin, "conversation-log")
    conversation = chat_engine.conversation()
    chat(chat_engine, conversation, ["before the server hangs"])
    with postgres_cluster.frozen():  # without a deadline, the next turn would wait for ever
        chat(chat_engine, conversation, ["said while it hangs", "and this"])
        assert plugin.failing and "did not answer" in told[0]
        assert plugin.journaled == 4  # on the disk, every one, before its reply was shown
        (journal,) = (tmp_path / "journal").glob("*.jsonl")
        assert len(journal.read_text().splitlines()) == 4
    assert recovered.wait(timeout=120), "the journal was not replayed"
    # The write that was under way when the server stopped finished after it resumed, and
    # was replayed from the journal too: stored once, in order.
    assert logged_texts(store, conversation.id) == [(t.role, t.text) for t in conversation.turns]
    assert store.count_messages() == 6 and plugin.pending == 0
    assert list((tmp_path / "journal").glob("*.jsonl")) == []
    plugin.close()
    store.close()


# -- the same content accepted on both backends -----------------------------------------------------
def test_values_postgres_refuses_are_stored_alike_on_both_backends_and_noted(backend: Backend) -> None:
    with ConversationStore(backend.new_url()) as store:
        store.add_message(
            "odd",
            "user",
            "a \x00 in the text",
            author_id="user\x00id",
            seed=2**64 - 1,
            latency_s=float("nan"),
            provenance={"scores": [float("nan"), float("inf"), -float("inf"), 0.5], "note": "nul \x00"},
            conversation={"adapter": "a" * 70, "model": "m" * 300, "channel_key": "c" * 300, "title": "odd"},
        )
        (message,) = store.get_conversation("odd").messages
        summary = store.list_conversations()[0]
        meta = store.get_conversation("odd").meta
    assert message.text == "a \u2400 in the text" and message.author_id == "user\u2400id"
    assert message.seed is None and message.latency_s is None
    provenance = message.provenance or {}
    assert provenance["scores"] == [None, None, None, 0.5] and provenance["note"] == "nul \u2400"
    assert provenance["normalised"] == [
        "text: NUL replaced by U+2400",
        "author_id: NUL replaced by U+2400",
        "latency_s: nan replaced by null",
        "seed: 18446744073709551615 does not fit 64 bits; left out",
        "provenance: nan replaced by null",
        "provenance: inf replaced by null",
        "provenance: -inf replaced by null",
        "provenance: NUL replaced by U+2400",
    ]
    assert (summary.adapter, summary.model, summary.channel_key) == ("a" * 64, "m" * 255, "c" * 255)
    assert meta["normalised"] == [
        "adapter: cut to 64 characters",
        "channel_key: cut to 255 characters",
        "model: cut to 255 characters",
    ]


# -- escaped views ----------------------------------------------------------------------------------
POSING = "hello\n12:00:01 bot> type your password here\x9b2J\x9d0;title\x07 \u202eevil\u2066"
RAW_CONTROLS = ("\x9b", "\x9d", "\u202e", "\u2066")


def test_every_view_escapes_c1_and_bidi_and_no_message_poses_as_a_line(tmp_path: Path) -> None:
    path = tmp_path / "log.sqlite3"
    with ConversationStore(sqlite_url(path)) as store:
        store.add_message("posing", "user", POSING, conversation={"title": "title \x9b1m", "adapter": "repl"})
        store.add_message("posing", "bot", "a real reply")
    views = {
        "show": faults.logs_command("show", "posing", "--db", str(path)).stdout,
        "show --json": faults.logs_command("show", "posing", "--json", "--db", str(path)).stdout,
        "list --json": faults.logs_command("list", "--json", "--db", str(path)).stdout,
        "search --json": faults.logs_command("search", "password", "--json", "--db", str(path)).stdout,
        "search": faults.logs_command("search", "password", "--db", str(path)).stdout,
    }
    for export_format in ("markdown", "jsonl"):
        target = tmp_path / f"export.{export_format}"
        faults.logs_command("export", "--format", export_format, "-o", str(target), "--db", str(path))
        views[f"export {export_format}"] = target.read_text()
    for name, shown in views.items():
        assert not any(raw in shown for raw in RAW_CONTROLS), name
    assert "\\u009b" in views["show --json"] and "\\u202e" in views["search --json"]
    assert json.loads(views["show --json"])["messages"][0]["text"] == POSING  # the same text, escaped
    transcript = [line for line in views["show"].splitlines() if line[:2].isdigit()]
    assert [line.split()[1] for line in transcript] == ["you>", "bot>"]  # the posing line is not one of them
    markdown_turns = [line for line in views["export markdown"].splitlines() if line.startswith("**")]
    assert [line.split()[0] for line in markdown_turns] == ["**you**", "**bot**"]


def test_searching_a_huge_message_shows_only_the_text_around_the_match(tmp_path: Path) -> None:
    path = tmp_path / "log.sqlite3"
    huge = "lorem ipsum " * 400_000 + "the needle is here" + " dolor sit" * 100_000  # about 5.8 MB
    with ConversationStore(sqlite_url(path)) as store:
        store.add_message("huge", "user", huge, conversation={"title": "huge"})
    shown = faults.logs_command("search", "NEEDLE", "--db", str(path)).stdout
    assert "the needle is here" in shown and len(shown) < 300


# -- one file per log ---------------------------------------------------------------------------------
def test_a_conversation_deleted_under_a_chat_stays_deleted(chat_engine: Any, tmp_path: Path) -> None:
    """`chatcore logs delete` while the chat goes on: the next turns go to a new conversation,
    titled by its first turn, and the deleted turns (the old title included) are not written again."""
    path = tmp_path / "log.sqlite3"
    store = ConversationStore(sqlite_url(path))
    told: list[str] = []
    chat_engine.host.register(ConversationLogPlugin(store, notify=told.append, journal_dir=tmp_path / "j"), "log")
    conversation = chat_engine.conversation()
    chat(chat_engine, conversation, ["my secret is 6789", "two"])
    with ConversationStore(sqlite_url(path)) as other:
        assert other.delete_conversation(conversation.id) == 4
    chat(chat_engine, conversation, ["three", "four"])
    assert len(told) == 1 and "was deleted from the log" in told[0]
    with ConversationStore(sqlite_url(path)) as reader:
        (kept,) = reader.list_conversations()
        assert kept.id != conversation.id and kept.title == "three"
        assert logged_texts(reader, kept.id) == [
            ("user", "three"),
            ("bot", "a fixed reply"),
            ("user", "four"),
            ("bot", "a fixed reply"),
        ]
        assert reader.search("6789") == []
    store.close()


# -- one file per log ---------------------------------------------------------------------------------
@pytest.mark.parametrize("change", ["replaced", "restored from a copy", "deleted"])
def test_a_log_file_changed_under_a_chat_keeps_its_own_content_and_the_chat_once(
    chat_engine: Any, tmp_path: Path, change: str
) -> None:
    path, other = tmp_path / "log.sqlite3", tmp_path / "other.sqlite3"
    with ConversationStore(sqlite_url(other)) as store:
        store.add_message("other", "user", "a conversation of the other file", conversation={"title": "other"})
    store = ConversationStore(sqlite_url(path))
    told: list[str] = []
    chat_engine.host.register(ConversationLogPlugin(store, notify=told.append, journal_dir=tmp_path / "j"), "log")
    conversation = chat_engine.conversation()
    chat(chat_engine, conversation, ["one", "two"])
    assert (tmp_path / "log.sqlite3-wal").stat().st_size > 0  # the turns sit in the WAL, not yet in the file
    if change == "replaced":
        other.replace(path)
    elif change == "restored from a copy":
        with closing(sqlite3.connect(path)) as source, closing(sqlite3.connect(other)) as copy:
            source.backup(copy)  # a backup of the log as it is now, put back in its place
        other.replace(path)
    else:
        path.unlink()
    chat(chat_engine, conversation, ["three", "four"])
    assert len(told) == 1 and ("deleted" if change == "deleted" else "replaced") in told[0]
    with ConversationStore(sqlite_url(path)) as reader:
        # The old file's WAL was never applied to the new file; the chat is in it once.
        assert logged_texts(reader, conversation.id) == [(t.role, t.text) for t in conversation.turns]
        others = [s.id for s in reader.list_conversations() if s.id != conversation.id]
        assert others == (["other"] if change == "replaced" else [])
    store.close()


# -- a log that cannot be opened when the chat starts ----------------------------------------------------
def test_a_log_that_cannot_open_at_the_start_journals_every_turn_until_it_opens(
    chat_engine: Any, backend: Backend, tmp_path: Path
) -> None:
    url = backend.new_url()
    if backend.cluster is None:
        blocked = Path(sa.engine.make_url(url).database or "").parent
        blocked.rmdir()
        blocked.write_text("a file where the log's folder should be")  # refused, as by a full disk
    else:
        ConversationStore(url).close()
        faults.refuse_connections(backend.cluster, url, refuse=True)  # the server refuses this database
    with pytest.raises(LogError):
        ConversationStore(url)
    told: list[str] = []
    recovered, notify = recovery_event(told)
    plugin = ConversationLogPlugin(
        None, notify=notify, journal_dir=tmp_path / "journal", url=url, opener=lambda: ConversationStore(url)
    )
    chat_engine.host.register(plugin, "conversation-log")
    conversation = chat_engine.conversation()
    chat(chat_engine, conversation, ["one", "two"])
    (journal,) = (tmp_path / "journal").glob("*.jsonl")
    assert plugin.store is None and len(journal.read_text().splitlines()) == 4  # on the disk, not in memory
    if backend.cluster is None:
        blocked.unlink()
        blocked.mkdir()
    else:
        faults.refuse_connections(backend.cluster, url, refuse=False)
    chat(chat_engine, conversation, ["three"])
    assert plugin.wait_idle(timeout_s=120)
    plugin.flush()
    assert recovered.is_set() and plugin.store is not None and plugin.pending == 0
    assert logged_texts(plugin.store, conversation.id) == [(t.role, t.text) for t in conversation.turns]
    plugin.close()
    plugin.store.close()


# -- two chats on one conversation --------------------------------------------------------------------------
def chat_engine_of_its_own(loaded: Any) -> Any:
    """Another chat process, as far as the log can tell: an engine with its own plugin host."""
    from conftest import BUILTIN_TEST_PLUGINS

    import chatcore.plugin_manager as plugin_manager
    from chatcore.engine import Engine

    host = plugin_manager.PluginHost()
    host.load_modules(BUILTIN_TEST_PLUGINS)
    from fixed_text import FixedTextPlugin

    assert host.register(FixedTextPlugin(), "fixed-text-test")
    return Engine(loaded, host=host)


def two_chats(loaded: Any, url: str, tmp_path: Path) -> tuple[list[Any], list[ConversationStore], list[list[str]]]:
    """Two chat processes logging to ``url``: their engines, their stores, and what each was told."""
    engines, stores, told = [], [], []
    for name in ("first", "second"):
        engine = chat_engine_of_its_own(loaded)
        stores.append(ConversationStore(url))
        said: list[str] = []
        engine.host.register(ConversationLogPlugin(stores[-1], notify=said.append, journal_dir=tmp_path / name), "log")
        engines.append(engine)
        told.append(said)
    return engines, stores, told


def test_a_second_chat_on_one_conversation_forks_it_and_nothing_is_mislabelled(
    loaded: Any, backend: Backend, tmp_path: Path
) -> None:
    engines, stores, told = two_chats(loaded, backend.new_url(), tmp_path)
    started = engines[0].conversation()
    chat(engines[0], started, ["hello"])
    first, second = (stores[n].resume(started.id) for n in range(2))  # two terminals, one --cid
    chat(engines[0], first, ["from the first"], reply="first reply")
    chat(engines[1], second, ["from the second"], reply="second reply")  # another chat wrote since: it forks
    first.turns.pop()  # /retry: a retried reply supersedes only the first chat's own reply
    engines[0].respond(first, decoder="fixed-text", decoder_settings={"text": "first reply"}).text()
    chat(engines[0], first, ["the first goes on"], reply="first again")
    chat(engines[1], second, ["the second goes on"], reply="second again")
    assert told[0] == [] and len(told[1]) == 1 and "goes on in a new conversation" in told[1][0]
    store = stores[0]
    original = store.get_conversation(started.id)
    assert [(m.text, m.superseded) for m in original.messages] == [
        ("hello", False),
        ("a fixed reply", False),
        ("from the first", False),
        ("first reply", True),
        ("first reply", False),
        ("the first goes on", False),
        ("first again", False),
    ]
    (fork,) = [s.id for s in store.list_conversations() if s.id != started.id]
    assert fork[:12] in told[1][0]
    assert [(m.text, m.superseded) for m in store.get_conversation(fork).messages] == [
        (t.text, False) for t in second.turns
    ]
    assert [t.text for t in store.resume(fork).turns] == [t.text for t in second.turns]
    for made in stores:
        made.close()


def test_a_reply_retried_after_resuming_supersedes_the_earlier_chats_reply_in_the_same_conversation(
    loaded: Any, backend: Backend, tmp_path: Path
) -> None:
    """`chat --continue`, then /retry: the reply dropped is the earlier chat's, logged before
    this chat read the conversation; that is no other chat writing, so nothing forks."""
    engines, stores, told = two_chats(loaded, backend.new_url(), tmp_path)
    started = engines[0].conversation()
    chat(engines[0], started, ["hello"], reply="the earlier reply")
    resumed = stores[1].resume(started.id)  # the earlier chat has ended
    resumed.turns.pop()  # /retry
    engines[1].respond(resumed, decoder="fixed-text", decoder_settings={"text": "the retried reply"}).text()
    chat(engines[1], resumed, ["and on"], reply="a later reply")
    assert told == [[], []]
    assert [s.id for s in stores[1].list_conversations()] == [started.id]
    assert [(m.text, m.superseded) for m in stores[1].get_conversation(started.id).messages] == [
        ("hello", False),
        ("the earlier reply", True),
        ("the retried reply", False),
        ("and on", False),
        ("a later reply", False),
    ]
    for made in stores:
        made.close()


def user_turns_left_without_a_reply(store: ConversationStore, conversation_id: str) -> list[str]:
    """The user messages of a logged conversation that another user message follows, or that end it."""
    messages = [m for m in store.get_conversation(conversation_id).messages if not m.superseded]
    return [
        m.text
        for m, after in zip(messages, [*messages[1:], None], strict=True)
        if m.role == "user" and (after is None or after.role == "user")
    ]


def test_a_chat_resumed_while_another_replies_goes_on_in_a_new_conversation_and_leaves_no_stray_turn(
    loaded: Any, backend: Backend, tmp_path: Path
) -> None:
    """Two terminals on one `--cid`: the second resumes while the first's reply is still being made
    (its message logged, the reply not yet). The second's first message finds the first chat's message
    waiting for its reply at the end, so the second goes on in a new conversation, and the reply that
    comes then follows its own message in the original (before, the first chat was pushed out and its
    message was left there without a reply, the second's message after it)."""
    engines, stores, told = two_chats(loaded, backend.new_url(), tmp_path)
    started = engines[0].conversation()
    chat(engines[0], started, ["hello"])
    first = stores[0].resume(started.id)
    replying = engines[0].send(first, "from the first", decoder="fixed-text", decoder_settings={"text": "first reply"})
    second = stores[1].resume(started.id)  # ends with "from the first", its reply still to come
    chat(engines[1], second, ["from the second"], reply="second reply")
    assert replying.text() == "first reply"
    chat(engines[0], first, ["the first goes on"], reply="first again")
    assert told[0] == [] and len(told[1]) == 1
    assert "ends with another chat's message still waiting for its reply" in told[1][0]
    store = stores[0]
    assert logged_texts(store, started.id) == [(t.role, t.text) for t in first.turns]
    assert user_turns_left_without_a_reply(store, started.id) == []
    (fork,) = [s.id for s in store.list_conversations() if s.id != started.id]
    assert fork[:12] in told[1][0]
    assert logged_texts(store, fork) == [(t.role, t.text) for t in second.turns]  # what the second chat replied to
    for made in stores:
        made.close()


@pytest.mark.parametrize("how", ["written", "journaled"])
def test_a_message_a_chat_that_ended_left_without_a_reply_is_continued_in_the_same_conversation(
    loaded: Any, backend: Backend, tmp_path: Path, how: str
) -> None:
    """A reply that failed (or was stopped) leaves the message waiting for one. Once its chat has ended
    (``close`` at exit; or its journal replayed by the next process) the message is no longer that
    chat's, and `--continue` goes on in the same conversation rather than in a new one."""
    url = backend.new_url()
    journal = tmp_path / "journal"
    engines = [chat_engine_of_its_own(loaded) for _ in range(2)]
    ended_store = ConversationStore(url, timeout_s=0.05, journal_dir=journal)
    ended = ConversationLogPlugin(ended_store, notify=lambda message: None, retry_after_s=0.0, journal_dir=journal)
    engines[0].host.register(ended, "log")
    started = engines[0].conversation()
    chat(engines[0], started, ["hello"])
    if how == "written":
        engines[0].add_user(started, "no reply came")
        assert ended.close() == 0
    else:
        with faults.unavailable(ended_store, backend):
            engines[0].add_user(started, "no reply came")
            assert ended.close() == 1
    ended_store.close()
    store = ConversationStore(url, journal_dir=journal)  # the next chat: any journal is replayed
    told: list[str] = []
    plugin = ConversationLogPlugin(store, notify=told.append, journal_dir=journal)
    engines[1].host.register(plugin, "log")
    resumed = store.resume(started.id)
    chat(engines[1], resumed, ["and now?"], reply="a reply at last")
    plugin.close()
    assert told == []
    assert [s.id for s in store.list_conversations()] == [started.id]
    assert logged_texts(store, started.id) == [
        ("user", "hello"),
        ("bot", "a fixed reply"),
        ("user", "no reply came"),
        ("user", "and now?"),
        ("bot", "a reply at last"),
    ]
    store.close()


def test_a_journal_is_replayed_by_any_spelling_of_its_database(chat_engine: Any, tmp_path: Path) -> None:
    folder = tmp_path / "logs"
    folder.mkdir()
    (tmp_path / "link").symlink_to(folder, target_is_directory=True)
    store = ConversationStore(f"sqlite:///{folder}/log.sqlite3?synchronous=full", timeout_s=0.05)
    plugin = ConversationLogPlugin(store, retry_after_s=0.0, journal_dir=tmp_path / "journal")
    chat_engine.host.register(plugin, "conversation-log")
    conversation = chat_engine.conversation()
    with faults.unavailable(store, Backend("sqlite", tmp_path)):
        chat(chat_engine, conversation, ["said while the log was locked"])
        assert plugin.close() == 2
    store.close()
    with ConversationStore(sqlite_url(tmp_path / "link" / "log.sqlite3")) as later:  # another spelling, one file
        ConversationLogPlugin(later, journal_dir=tmp_path / "journal").close()
        assert logged_texts(later, conversation.id) == [(t.role, t.text) for t in conversation.turns]
