"""Graceful shutdown: the replies a server is sending, and how they are cut when it stops.

The first SIGTERM (or Ctrl-C) stops accepting requests and gives the running replies
``--shutdown-grace`` seconds; then each one still running is cancelled and its client gets
an error event and ``[DONE]`` (or a 503), and the server exits 0. A second signal cuts
them at once, just as properly. See :class:`chatcore.adapters.http_api.server.GracefulServer`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chatcore.adapters.http_api.completions import Completion

logger = logging.getLogger("chatcore.serve")


@dataclass
class LiveReplies:
    """The replies being answered now (on the server's event loop), and whether it drains."""

    draining: bool = False
    replies: set["Completion"] = field(default_factory=set)

    def add(self, completion: "Completion") -> None:
        self.replies.add(completion)

    def discard(self, completion: "Completion") -> None:
        self.replies.discard(completion)

    def drain(self) -> None:
        """Refuse new requests from now on; the running ones go on."""
        self.draining = True

    def cut(self) -> int:
        """End every running reply now (each with a proper error); returns how many were cut."""
        self.draining = True
        cut = list(self.replies)
        for completion in cut:
            logger.warning("shutdown: cut reply %s after %d tokens", completion.id, completion.completion_tokens)
            completion.interrupt("shutdown")
        return len(cut)
