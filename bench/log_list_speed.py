"""How fast ``chatcore logs list`` and ``logs search`` answer over a big log.

    python bench/log_list_speed.py            # 100,000 messages, SQLite
    python bench/log_list_speed.py --messages 1000000 --db big.sqlite3
    python bench/log_list_speed.py --backend postgres   # a throwaway cluster

Fills a log (an SQLite file in a temporary folder unless ``--db``; with ``--backend
postgres`` a database in a throwaway PostgreSQL cluster) with conversations of
``--per-conversation`` messages each, then times ``ConversationStore.list_conversations``
and ``ConversationStore.search`` in this process, searches against a scan of every
message in the same run (the peer the index is measured against), and, on SQLite,
the whole ``chatcore logs list`` command in a fresh interpreter.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chatcore.log.store import ConversationStore

CLI_LAUNCHER = (
    "import importlib, sys\n"
    "from chatcore.plugin_manager import get_plugin_host\n"
    "host = get_plugin_host()\n"
    "module = importlib.import_module('chatcore.log')\n"
    "if not host.pm.is_registered(module): host.register(module, 'conversation_log')\n"
    "from chatcore.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


TOPICS = (
    "pizza",
    "music",
    "football",
    "gardening",
    "chess",
    "rain",
    "trains",
    "poetry",
    "coffee",
    "films",
    "cats",
    "mountains",
    "bread",
    "jazz",
    "sailing",
    "physics",
    "painting",
    "birds",
    "tea",
    "history",
)
# (label, text): a word in one message in twenty, one message, and no message (the worst case).
SEARCHES = (("common", "sailing"), ("one hit", "message 4321 about"), ("no hit", "zebra crossing"))


def populate(store: "ConversationStore", messages: int, per_conversation: int, batch: int = 20_000) -> int:
    """Bulk-insert synthetic conversations; returns the number of conversations."""
    import sqlalchemy as sa

    from chatcore.log.models import ConversationRow, MessageRow

    conversations = max(1, messages // per_conversation)
    start = datetime(2024, 1, 1, tzinfo=timezone.utc)
    db = store.db
    with db.begin() as connection:
        connection.execute(
            sa.insert(ConversationRow),
            [
                {
                    "id": f"{index:032x}",
                    "created": start + timedelta(minutes=index),
                    "updated": start + timedelta(minutes=index, seconds=per_conversation),
                    "adapter": "bench",
                    "channel_key": f"channel-{index % 50}",
                    "model": "chatcore-tiny",
                    "title": f"benchmark {index}",
                    "meta": {},
                }
                for index in range(conversations)
            ],
        )
    rows = []
    for number in range(messages):
        conversation = number // per_conversation % conversations
        rows.append(
            {
                "conversation_id": f"{conversation:032x}",
                "role": "user" if number % 2 == 0 else "bot",
                "text": f"message {number} about {TOPICS[number % len(TOPICS)]} and the weather",
                "interrupted": False,
                "superseded": False,
                "created": start + timedelta(minutes=conversation, seconds=number % per_conversation),
            }
        )
        if len(rows) == batch:
            with db.begin() as connection:
                connection.execute(sa.insert(MessageRow), rows)
            rows = []
    if rows:
        with db.begin() as connection:
            connection.execute(sa.insert(MessageRow), rows)
    return conversations


def time_search(store: "ConversationStore", text: str, repeat: int) -> tuple[float, int]:
    """The median seconds of ``store.search(text, limit=50)``, and its hit count."""
    times, hits = [], 0
    for _ in range(repeat):
        started = time.perf_counter()
        hits = len(store.search(text, limit=50))
        times.append(time.perf_counter() - started)
    return statistics.median(times), hits


def time_scan(store: "ConversationStore", text: str, repeat: int) -> float:
    """The median seconds of the same search as a scan of every message (no index): the peer."""
    import sqlalchemy as sa

    query = sa.text(
        "SELECT id FROM messages WHERE instr(lower(text), lower(:wanted)) > 0 ORDER BY id DESC LIMIT 50"
        if store.is_sqlite
        else "SELECT id FROM messages WHERE strpos(lower(text), lower(:wanted)) > 0 ORDER BY id DESC LIMIT 50"
    )
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        with store.db.connect() as connection:
            connection.execute(query, {"wanted": text}).all()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run(url: str, args: argparse.Namespace) -> None:
    from chatcore.log.store import ConversationStore

    store = ConversationStore(url)
    started = time.perf_counter()
    conversations = populate(store, args.messages, args.per_conversation)
    if store.is_postgres:
        with store.db.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.exec_driver_sql("VACUUM ANALYZE")
    print(
        f"filled {store.display_url}: {store.count_messages():,} messages in {conversations:,} conversations "
        f"in {time.perf_counter() - started:.1f} s (sqlite fts: {store.fts})"
    )
    times = []
    for _ in range(args.repeat):
        started = time.perf_counter()
        store.list_conversations(limit=20)
        times.append(time.perf_counter() - started)
    print(
        f"list_conversations(limit=20): median {statistics.median(times) * 1000:.2f} ms, "
        f"max {max(times) * 1000:.2f} ms over {args.repeat} runs"
    )
    for label, text in SEARCHES:
        seconds, hits = time_search(store, text, args.repeat)
        scan = time_scan(store, text, max(1, args.repeat // 4))
        print(
            f"search({text!r}, limit=50) [{label}]: median {seconds * 1000:.2f} ms, {hits} hits; "
            f"a scan of every message: {scan * 1000:.2f} ms ({scan / seconds:.1f}x)"
        )
    store.close()
    if store.is_sqlite:
        time_cli(url)


def time_cli(url: str) -> None:
    env = dict(os.environ, CHATCORE_PLUGINS="")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, "-c", CLI_LAUNCHER, "logs", "list", "--db", url], capture_output=True, text=True, env=env
    )
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if completed.returncode != 0:
        raise SystemExit(f"chatcore logs list failed: {completed.stderr.strip()}")
    print(
        f"`chatcore logs list` (a new process, interpreter start-up and imports included): "
        f"{elapsed:.2f} s wall, {cpu:.2f} s CPU, {len(completed.stdout.splitlines()) - 1} rows"
    )


def main(argv: list[str] | None = None) -> None:
    from chatcore.log.location import sqlite_url

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' throwaway cluster
    from pg_cluster import ThrowawayCluster

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--per-conversation", type=int, default=100)
    parser.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--db", default=None, help="SQLite file to fill (default: a temporary one).")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)

    if args.backend == "postgres":
        with ThrowawayCluster() as cluster:
            run(cluster.create_database("bench"), args)
        return
    with tempfile.TemporaryDirectory() as folder:
        run(sqlite_url(Path(args.db) if args.db else Path(folder) / "bench.sqlite3"), args)


if __name__ == "__main__":
    main()
