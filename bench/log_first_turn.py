"""The first turn's wait on a large log: the check on open before it, or beside it.

    python bench/log_first_turn.py                     # 100,000 messages
    python bench/log_first_turn.py --messages 1000000

Fills a log with ``--messages`` messages (bench/log_list_speed.py's synthetic
conversations), then times, in the same run and on the same file, from opening the
store to the first turn being held (the hook returning with the turn committed or
journaled): with the check on open first (``ConversationStore(url)``, the peer) and with
it in the background (``defer_check=True``: the turn is journaled until it passes).
Also prints how long the background check took to end and write the journaled turn.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from log_damage import filled  # noqa: E402


def first_turn(path: Path, journal: Path, deferred: bool) -> tuple[float, float]:
    """Seconds to the first turn held, and to the check's end (with the turn in the file)."""
    from chatcore.log.location import sqlite_url
    from chatcore.log.plugin import ConversationLogPlugin
    from chatcore.log.store import ConversationStore
    from chatcore.values import Turn

    started = time.perf_counter()
    store = ConversationStore(sqlite_url(path), defer_check=deferred)
    plugin = ConversationLogPlugin(store, notify=lambda message: None, journal_dir=journal)
    turn = Turn("user", "hello", created=datetime.now(timezone.utc))
    plugin.log_conversation(_Conversation(turn), None)  # type: ignore[arg-type]
    held = time.perf_counter() - started
    assert plugin.checked.wait(600) and plugin.pending == 0
    checked = time.perf_counter() - started
    plugin.close()
    store.close()
    return held, checked


class _Conversation:
    """The least a write needs of a conversation."""

    def __init__(self, turn: object) -> None:
        import uuid

        self.id = uuid.uuid4().hex
        self.turns = [turn]
        self.meta: dict[str, object] = {}
        self.system = None
        self.prompt_format = "dialogpt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "log.sqlite3"
        filled(path, args.messages)
        print(f"{args.messages:,} messages; median of {args.repeat} (check first and in the background alternate)")
        before, after, ended = [], [], []
        for round_ in range(args.repeat):
            before.append(first_turn(path, Path(folder) / f"j{round_}a", deferred=False)[0])
            held, checked = first_turn(path, Path(folder) / f"j{round_}b", deferred=True)
            after.append(held)
            ended.append(checked)
        b, a = statistics.median(before), statistics.median(after)
        print(f"  first turn held, check on open first:        {b * 1000:8.0f} ms")
        print(f"  first turn held, check in the background:    {a * 1000:8.0f} ms ({b / a:.0f}x sooner)")
        print(f"  the background check ended, turn in the file: {statistics.median(ended) * 1000:8.0f} ms")


if __name__ == "__main__":
    main()
