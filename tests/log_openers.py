"""The crowd of processes of the log's first fault test, importable by a fresh process."""

from __future__ import annotations

import multiprocessing
from typing import Any

from chatcore.log.store import ConversationStore


def open_and_write(url: str, barrier: Any, number: int) -> None:
    """One process of a crowd: open the log the moment the others do, write a message."""
    barrier.wait(timeout=60)
    store = ConversationStore(url, timeout_s=30)
    store.add_message(
        f"conversation-{number}",
        "user",
        f"hello from process {number}",
        conversation={"adapter": "test", "title": f"process {number}"},
    )
    # Every process adds the same new conversation too: one row, and no write refused.
    store.add_message("shared", "user", f"process {number} in the shared room", conversation={"title": "shared"})
    store.close()


def open_in_crowds(urls: list[str], openers: int, results: Any) -> None:
    """For each log in ``urls``, fork ``openers`` processes that open it at the same moment and
    write; put their exit codes (None: still running a minute later) in ``results``."""
    fork = multiprocessing.get_context("fork")
    for url in urls:
        barrier = fork.Barrier(openers)
        processes = [fork.Process(target=open_and_write, args=(url, barrier, n)) for n in range(openers)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(60)
        results.put([process.exitcode for process in processes])
