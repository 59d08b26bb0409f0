"""What logging a turn costs the chat: median and p90 write latency per turn, on SQLite and PostgreSQL.

    python bench/log_write_latency.py                       # both backends, 200 turns each
    python bench/log_write_latency.py --backend sqlite --turns 500

Each turn (a user message and a reply) is handed to the conversation log plugin the way
an adapter does (``log_conversation`` with the turn's two new messages) and timed:

- ``healthy``: the database takes every write (SQLite's default ``synchronous=NORMAL``);
- ``healthy, synchronous=full``: SQLite syncing every commit (``?synchronous=full``);
- ``outage``: another connection holds SQLite's write lock, or the PostgreSQL database
  refuses connections, for every turn: the cost of keeping the turn while the log fails.

PostgreSQL runs in a throwaway cluster (``pg_cluster.py``). No model is loaded: the
turns are text, and the engine is the bundled tiny model's (for the token counts).
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any


def turn_latencies(engine: Any, url: str, turns: int, journal: Path, during: Callable[[], Any]) -> list[float]:
    from chatcore.log.plugin import ConversationLogPlugin
    from chatcore.log.store import ConversationStore

    store = ConversationStore(url)
    plugin = ConversationLogPlugin(store, notify=lambda message: None, journal_dir=journal)
    conversation = engine.conversation(adapter="bench")
    latencies = []
    with during(store):
        for number in range(turns):
            engine.add_user(conversation, f"question number {number}: what do you think about the weather today?")
            conversation.add_bot_text(f"reply number {number}: i think it will rain later, bring an umbrella")
            started = time.perf_counter()
            plugin.log_conversation(conversation, engine.loaded, start=len(conversation.turns) - 2)
            latencies.append(time.perf_counter() - started)
    plugin.close()
    store.close()
    return latencies


@contextmanager
def sqlite_locked(store: Any) -> Iterator[None]:
    import sqlalchemy as sa

    blocker = sqlite3.connect(sa.engine.make_url(store.url).database, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        blocker.rollback()
        blocker.close()


def postgres_refusing(cluster: Any) -> Callable[[Any], AbstractContextManager[None]]:
    @contextmanager
    def refusing(store: Any) -> Iterator[None]:
        import sqlalchemy as sa

        name = sa.engine.make_url(store.url).database
        admin = sa.create_engine(cluster.url(), isolation_level="AUTOCOMMIT")
        with admin.connect() as connection:
            connection.exec_driver_sql(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            connection.exec_driver_sql(
                f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'"
            )
            try:
                yield
            finally:
                connection.exec_driver_sql(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        admin.dispose()

    return refusing


def report(backend: str, case: str, latencies: list[float]) -> None:
    ordered = sorted(latencies)
    p90 = ordered[int(len(ordered) * 0.9)]
    print(f"{backend:10} {case:28} median {statistics.median(ordered) * 1000:8.2f} ms   p90 {p90 * 1000:8.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--model", default="chatcore-tiny")
    args = parser.parse_args()

    from chatcore.engine import Engine
    from chatcore.models import load_model

    engine = Engine(load_model(args.model))
    folder = Path(tempfile.mkdtemp(prefix="chatcore-log-bench-"))
    print(f"{args.turns} turns (2 messages each) per case; {folder}")
    if args.backend in ("sqlite", "both"):
        for case, query, during in (
            ("healthy", "", lambda store: nullcontext()),
            ("healthy, synchronous=full", "?synchronous=full", lambda store: nullcontext()),
            ("outage (write lock held)", "", sqlite_locked),
        ):
            url = f"sqlite:///{folder / (case.split()[0] + str(len(query)) + '.sqlite3')}{query}"
            try:
                latencies = turn_latencies(engine, url, args.turns, folder / f"journal-{len(query)}", during)
            except Exception as error:  # a version without the setting
                print(f"{'sqlite':10} {case:28} not available: {str(error).splitlines()[0]}")
                continue
            report("sqlite", case, latencies)
    if args.backend in ("postgres", "both"):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' throwaway cluster
        from pg_cluster import ThrowawayCluster, unavailable_reason

        reason = unavailable_reason()
        if reason is not None:
            print(f"postgres: skipped ({reason})")
            return
        with ThrowawayCluster() as cluster:
            for case, during in (
                ("healthy", lambda store: nullcontext()),
                ("outage (connections refused)", postgres_refusing(cluster)),
            ):
                url = cluster.create_database()
                report("postgres", case, turn_latencies(engine, url, args.turns, folder / "journal-pg", during))


if __name__ == "__main__":
    main()
