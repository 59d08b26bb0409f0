"""The plugins' ``on_user_message`` and ``on_response`` hooks for the requests ``chatcore serve`` answers.

Every other entry point fires them as its turns happen (``engine.add_user``, ``engine.record``);
an HTTP request carries its whole conversation and gets its reply from the scheduler, so here
they fire once the reply has ended, in order, on a thread of their own (a slow hook never holds
a request): ``on_user_message`` with the conversation up to the request's last user message,
then ``on_response`` with the reply appended. A request that continues an earlier one (its
messages are the earlier ones, that reply and a new user message, from the same ``user``) is
the same conversation, with the same id, as :mod:`chatcore.adapters.http_api.request_log`
recognises it; where the server logs, the log fires them once written, with the id it wrote.
A hook that fails is reported (a warning line) and skipped; the next ones run.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chatcore.adapters.http_api.request_log import Exchange
    from chatcore.engine import Engine

logger = logging.getLogger("chatcore.serve")

HOOKS = ("on_user_message", "on_response")


def hooks_implemented(engine: "Engine") -> bool:
    """Whether any plugin of ``engine`` implements a hook this module fires."""
    return any(getattr(engine.host.pm.hook, name).get_hookimpls() for name in HOOKS)


class ExchangeHooks:
    """Fires the turn hooks for each answered request, on their own thread."""

    def __init__(self, engine: "Engine") -> None:
        from chatcore.adapters.http_api.request_log import Threads

        self.engine = engine
        self._threads = Threads()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chatcore-http-hooks")

    def fire(self, exchange: "Exchange", conversation_id: str | None = None) -> None:
        """Queue ``exchange``'s hooks; returns at once and never raises. ``conversation_id``: the
        id the conversation log gave it (the hooks then see the log's id); None: recognised here."""
        try:
            self._executor.submit(self._fire, exchange, conversation_id)
        except RuntimeError:  # closed: the server is stopping
            pass

    def _fire(self, exchange: "Exchange", conversation_id: str | None) -> None:
        from chatcore.adapters.http_api.request_log import exchange_conversation
        from chatcore.response import Response

        engine = self.engine
        try:
            if conversation_id is None:
                conversation_id = self._threads.continued(exchange)
            conversation = exchange_conversation(exchange, engine, conversation_id)
            self._threads.remember(exchange, conversation.id)
            reply = conversation.turns.pop()
            if conversation.turns and conversation.turns[-1].role == "user":
                turn = conversation.turns[-1]
                engine.host.call_each("on_user_message", conversation=conversation, turn=turn, model=engine.loaded)
            conversation.turns.append(reply)
            response = Response.ended(
                engine.tokenizer, exchange.token_ids, exchange.reply, reply.meta["provenance"], exchange.interrupted
            )
            engine.host.call_each("on_response", conversation=conversation, response=response)
        except Exception:  # a hook's failure is reported by call_each; this is chatcore's own
            logger.exception("firing the plugins' hooks for a request failed")

    def close(self) -> None:
        """Fire what is queued, then stop. Idempotent."""
        self._executor.shutdown(wait=True)
