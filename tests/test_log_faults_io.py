"""The conversation log's input and output under faults, on SQLite and on a real PostgreSQL server.

Bounded waits on a hung server, one file per log, one writer per conversation, the same
content accepted on both backends, escaped views, and a chat whose log cannot open at
its start. The PostgreSQL cases run against the throwaway cluster these tests start.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import test_conversation_log_faults as faults
from pg_cluster import ThrowawayCluster

from chatcore.log import ConversationLogPlugin
from chatcore.log.store import ConversationStore

# The fault suite's fixtures and helpers.
postgres_cluster = faults.postgres_cluster
backend = faults.backend
chat_engine = faults.chat_engine
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
    chat(conversation, ["before the server hangs"])
    with postgres_cluster.frozen():  # without a deadline, the next turn would wait for ever
        chat(conversation, ["said while it hangs", "and this"])
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
