"""The cost of the damage check when a chat opens a log, and what the salvage recovers.

    python bench/log_damage.py                         # 100,000 messages for the check; 20,000 to damage
    python bench/log_damage.py --check-messages 1000000 --skip-salvage

Fills a log with ``--check-messages`` messages (bench/log_list_speed.py's synthetic
conversations) and times, in the same run: ``PRAGMA quick_check`` (the check on open
before, the peer), the check on open now (``integrity_check`` and the search index's
cheap probe) and the full ``chatcore logs check`` (FTS5's ``integrity-check`` too).
Then fills a log of ``--salvage-messages`` in conversations of 100, damages copies of
it the four ways below, and prints what ``logs export --salvage`` recovers from each:

- flipped: 300 bytes flipped at seeded random places (the header spared);
- truncated: cut to half its size;
- index: 4 bytes changed in the middle of a leaf page of ix_messages_conversation_id;
- fts: every third block of the search index overwritten with random bytes.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from log_list_speed import populate  # noqa: E402


def filled(path: Path, messages: int) -> int:
    from chatcore.log.location import sqlite_url
    from chatcore.log.store import ConversationStore

    with ConversationStore(sqlite_url(path)) as store:
        conversations = populate(store, messages, 100)
    connection = sqlite3.connect(path)
    connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    connection.close()
    return conversations


def median_seconds(action: object, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        action()  # type: ignore[operator]
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def time_checks(folder: Path, messages: int, repeat: int) -> None:
    from chatcore.log.location import sqlite_url
    from chatcore.log.store import ConversationStore

    path = folder / "check.sqlite3"
    filled(path, messages)
    with ConversationStore(sqlite_url(path), create=False) as store:

        def quick() -> None:
            with store.db.connect() as connection:
                connection.exec_driver_sql("PRAGMA quick_check").all()

        before = median_seconds(quick, repeat)
        on_open = median_seconds(store.find_damage, repeat)
        full = median_seconds(lambda: store.find_damage(full=True), max(1, repeat // 2))
    size = path.stat().st_size / 2**20
    print(f"{messages:,} messages ({size:.0f} MiB), median of {repeat}:")
    print(f"  PRAGMA quick_check (the check on open before): {before * 1000:.0f} ms")
    print(f"  the check on open now: {on_open * 1000:.0f} ms ({on_open / before:.1f}x quick_check)")
    print(f"  `logs check` (full, search index included): {full * 1000:.0f} ms ({full / before:.1f}x)")


def damage(base: Path, kind: str, target: Path) -> None:
    data = bytearray(base.read_bytes())
    if kind == "flipped":
        for position in random.Random(26).sample(range(100, len(data)), 300):
            data[position] ^= 0xFF
    elif kind == "truncated":
        data = data[: len(data) // 2]
    elif kind == "index":
        connection = sqlite3.connect(base)
        pages = [
            page
            for (page,) in connection.execute(
                "SELECT pageno FROM dbstat WHERE name = 'ix_messages_conversation_id' AND pagetype = 'leaf'"
            )
        ]
        connection.close()
        offset = (pages[len(pages) // 2] - 1) * 4096 + 2000
        data[offset : offset + 4] = b"\x00\x11\x22\x33"
    target.write_bytes(bytes(data))
    if kind == "fts":
        shutil.copy(base, target)
        connection = sqlite3.connect(target)
        connection.execute("UPDATE messages_fts_data SET block = randomblob(length(block)) WHERE id % 3 = 0")
        connection.commit()
        connection.close()


def time_salvage(folder: Path, messages: int) -> None:
    from chatcore.log.location import sqlite_url
    from chatcore.log.salvage import salvage
    from chatcore.log.store import ConversationStore

    base = folder / "base.sqlite3"
    conversations = filled(base, messages)
    print(f"salvage of a log of {messages:,} messages in {conversations} conversations:")
    for kind in ("flipped", "truncated", "index", "fts"):
        damaged = folder / f"{kind}.sqlite3"
        damage(base, kind, damaged)
        into_path = folder / f"{kind}-salvaged.sqlite3"
        with ConversationStore(sqlite_url(into_path)) as into:
            started = time.perf_counter()
            report = salvage(damaged, into)
            elapsed = time.perf_counter() - started
        print(
            f"  {kind}: {report.messages:,}/{messages:,} messages, {report.conversations}/{conversations} "
            f"conversations in {elapsed:.1f} s; " + "; ".join(report.lines()[1:])
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check-messages", type=int, default=100_000)
    parser.add_argument("--salvage-messages", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--skip-salvage", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        time_checks(Path(folder), args.check_messages, args.repeat)
        if not args.skip_salvage:
            time_salvage(Path(folder), args.salvage_messages)


if __name__ == "__main__":
    main()
