"""What printing a search hit costs when the message is huge: cut around the match, then escape.

    python bench/log_search_huge.py                 # a 10 MB message
    python bench/log_search_huge.py --chars 1000000

Times ``store.search`` plus ``formatting.search_lines`` (the hit cut around its match
before it is escaped) against the peer measured in the same run: the same hits printed
by escaping the whole text first and cutting it after (what ``logs search`` did before).
Median of 3 runs each; prints the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chars", type=int, default=10_000_000)
    args = parser.parse_args()

    from chatcore.log import formatting
    from chatcore.log.location import sqlite_url
    from chatcore.log.store import ConversationStore

    needle = "the needle is here"
    filler = "lorem ipsum dolor sit amet " * (args.chars // 27 + 1)
    text = filler[: args.chars - len(needle)] + needle
    path = Path(tempfile.mkdtemp(prefix="chatcore-search-bench-")) / "log.sqlite3"
    with ConversationStore(sqlite_url(path)) as store:
        store.add_message("huge", "user", text, conversation={"title": "huge"})

    def cut_first() -> str:
        return formatting.search_lines(store.search("needle"), "needle")

    def escape_first() -> str:
        return "\n".join(formatting.one_line(hit.message.text, 100) for hit in store.search("needle"))

    with ConversationStore(sqlite_url(path), create=False) as store:
        timings = {}
        for name, call in (("cut, then escape", cut_first), ("escape, then cut (peer)", escape_first)):
            runs = []
            for _ in range(3):
                started = time.perf_counter()
                call()
                runs.append(time.perf_counter() - started)
            timings[name] = statistics.median(runs)
            print(f"{name:26} median {timings[name] * 1000:9.1f} ms")
    ratio = timings["escape, then cut (peer)"] / timings["cut, then escape"]
    print(f"{len(text):,} characters: cutting first is {ratio:.1f}x faster")


if __name__ == "__main__":
    main()
