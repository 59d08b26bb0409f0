"""The log as a plugin: ``on_user_message`` and ``on_response`` write each turn to a store.

An adapter decides which conversations are logged by registering a plugin object
that holds its own store::

    store = ConversationStore(resolve_url(db_option))
    engine.host.register(ConversationLogPlugin(store, notify=show_to_user), "conversation-log")

(the REPL does this unless ``--no-log``; a Discord bot registers one with its own
store). One-shot commands such as ``generate`` and ``eval`` register none, so they
leave no trace in the log.

The writes go out on the log's own thread, in order. A hook waits for its turn to be
held (committed, or fsynced into the journal) unless the plugin was made with
``wait=False``: then the adapter awaits :meth:`ConversationLogPlugin.held` (a
``concurrent.futures.Future``; ``asyncio.wrap_future`` on an event loop) before it shows
the reply. A store opened with ``defer_check=True`` is checked in the background (the
integrity check takes seconds on a large file); the turns go to the journal until it
passes, and are written then (or kept there, with a notice, when the file is damaged).

A database that is unavailable, locked, read-only, full or disconnected never stops
the chat: the write goes at once to a journal on the local disk
(:mod:`~chatcore.log.journal`; fsynced before the turn is acknowledged as held,
so before the reply is shown), ``notify`` is called once with the reason, and the
journaled writes go out, in order and each once, when the database works again: the
store reconnects on every failure; every later write retries first (waiting at most
0.02 s for a locked SQLite file, so an outage never adds the busy timeout to each
turn), and a timer retries after ``retry_after_s`` (1 s), then twice as long each
time, up to 15 s, so the journal drains between turns too. What is still journaled
when the process ends (or is killed) is replayed by the next process logging to the
same database.

Nothing is dropped and nothing breaks referential integrity:

- every write is one message carrying its conversation's row, added in the same
  transaction when missing, so no write depends on another having got through;
- every write carries a key the store recognises, so a write replayed after a crash
  between its commit and the journal's clean-up is stored once;
- when the journal cannot be written either (a full disk), writes wait in memory (up
  to ``max_pending``), the person is told once, and they go out with the next write
  that works; what is still in memory at the end is counted in :attr:`pending`;
- a write the database refuses for good (not a passing fault) is set aside in the
  journal's folder and reported, and the writes after it go on.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import chatcore
from chatcore.log.deadline import DeadlineWorker
from chatcore.log.errors import (
    AwaitingReplyError,
    ConversationDeletedError,
    ConversationTakenError,
    LogError,
    LogUnavailableError,
)
from chatcore.log.journal import (
    REJECTED_SUFFIX,
    Deletions,
    SpillJournal,
    append_line,
    default_journal_folder,
    forget_deletions,
    note_folder,
    screened,
)
from chatcore.log.turn_writes import (
    Write,
    conversation_fields,
    count_tokens,
    response_fields,
    title_from,
    turn_fields,
    write_key,
)

if TYPE_CHECKING:
    from chatcore.conversation import Conversation, Turn
    from chatcore.log.store import ConversationStore
    from chatcore.models import LoadedModel
    from chatcore.response import Response

logger = logging.getLogger("chatcore.conversation_log")

MAX_PENDING_WRITES = 10_000
RETRY_AFTER_S = 1.0
RETRY_WAIT_S = 0.02
MIN_RETRY_INTERVAL_S = 0.05
MAX_RETRY_INTERVAL_S = 15.0
# The longest a turn waits for its write (a hung server, a stuck disk): past it the write is
# journaled and the reply shown. Above the store's SQLite busy timeout (3 s), so a lock held
# briefly by another process is waited out rather than journaled.
WRITE_DEADLINE_S = 5.0
FAILING_WAIT_S = 0.5  # the wait for a write tried while the log fails (each turn, and the timer)


class ConversationLogPlugin:
    """Persists every turn of the conversations on its host to ``store``.

    ``notify(message)`` tells the person in front of the adapter about a failing log
    (once per outage) and about its recovery. ``journal_dir``: where writes the
    database cannot take at once are journaled (default: ``log-journal`` in the user
    data folder). ``max_pending``: how many writes may wait in memory when the journal
    cannot be written either; past it they are dropped, and counted in :attr:`dropped`.
    ``write_deadline_s``: the longest a turn waits for its write (a hung server) before
    the write is journaled.

    A log that could not be opened when the adapter started (locked, a server down, a
    read-only folder): ``store=None`` with its ``url`` and an ``opener``; every write is
    journaled (on the disk, before the reply is shown), and each write, and the retry
    timer, tries to open it; once open, the journal is written to it, in order.
    """

    def __init__(
        self,
        store: "ConversationStore | None",
        notify: Callable[[str], None] | None = None,
        retry_after_s: float = RETRY_AFTER_S,
        max_pending: int = MAX_PENDING_WRITES,
        journal_dir: str | Path | None = None,
        write_deadline_s: float = WRITE_DEADLINE_S,
        *,
        opener: "Callable[[], ConversationStore] | None" = None,
        url: str | None = None,
        wait: bool = True,
    ) -> None:
        if store is None and (opener is None or url is None):
            raise ValueError("a log that is not open yet (`store` None) needs its `url` and an `opener`")
        if max_pending < 1:
            raise ValueError(f"`max_pending` must be a positive integer, got {max_pending}")
        if not write_deadline_s > 0:
            raise ValueError(f"`write_deadline_s` must be a positive number of seconds, got {write_deadline_s}")
        self.store = store
        self._opener = opener
        self.notify = notify or (lambda message: logger.warning("%s", message))
        self.retry_after_s = retry_after_s
        self.max_pending = max_pending
        self.failing: str | None = None  # the reason, while writes fail
        self._failed_at = 0.0
        self.rejected = 0  # writes the database refused for good, set aside in the journal folder
        # Writes neither the database nor the journal could take (a full disk), oldest first.
        self._pending: list[Write] = []
        self._unsaved_told = False
        self.dropped = 0  # writes lost because memory, the journal and the database were all full
        self.writer = uuid.uuid4().hex  # this chat, as the messages' ``writer`` column names it
        self._since: dict[str, int] = {}  # per conversation: the newest logged message this chat had read
        self._forks: dict[str, str] = {}  # conversation -> the new one its turns go to (another chat writes it)
        self._written: set[str] = (
            set()
        )  # conversations this chat has written into (one deleted since is not made again)
        # Conversation -> the writer whose message at its end waits for a reply (a reply that failed):
        # given up (``store.release``) once that chat has ended, so that another may go on after it.
        self._awaiting: dict[str, str] = {}
        self._live: weakref.WeakValueDictionary[str, Conversation] = weakref.WeakValueDictionary()
        # (conversation, title) of the waiting user messages dropped for a deleted author: not a title any more.
        self._withheld_titles: set[tuple[str, str]] = set()
        self.write_deadline_s = write_deadline_s
        self.failing_wait_s = min(FAILING_WAIT_S, write_deadline_s)
        self._writer = DeadlineWorker()  # the one thread that calls the database, each call with a deadline
        # The turns, in order, on a thread of their own: a hook queues its turn and gets a future that
        # resolves once the turn is held (committed, or fsynced into the journal). ``wait``: the hook
        # waits for it (the REPL, ``generate``); else the adapter awaits :meth:`held` before it shows
        # the reply (an event loop, with ``asyncio.wrap_future``).
        self.wait = wait
        self._turns = DeadlineWorker("conversation-log")
        self._held: dict[str, Future[None]] = {}
        self._held_lock = threading.Lock()
        self.checking = False  # the check on open runs: turns go to the journal until it passes
        self.checked = threading.Event()  # set once the check on open has ended (at once when there is none)
        self._lock = threading.RLock()
        self._closing = threading.Event()
        self._retrier: threading.Thread | None = None
        # The model of the latest turn written, whose tokenizer counts the user turns' tokens
        # when a whole conversation is written again (the log file was replaced).
        self._model: LoadedModel | None = None
        if journal_dir is None:
            journal_dir = default_journal_folder()
        self.journal = SpillJournal(Path(journal_dir), store.url if store is not None else str(url))
        self.damaged: str | None = None
        if store is None:  # every write goes to the journal until the log opens (tried on each write)
            self.failing = "the log is not open yet"
            self._failed_at = time.monotonic()
            self.checked.set()
            return
        if getattr(store, "check_deferred", False) and store.damage is None:
            # The check on open (seconds on a large file) runs on the database's thread while the
            # first turns go to the journal; they are written once it passes.
            self.checking = True
            check = self._writer.submit(store.check_on_open)
            check.add_done_callback(lambda done: self._turns.submit(lambda: self._checked(done)))
            return
        self._checked(None)

    def _checked(self, check: "Future[None] | None") -> None:
        """The check on open has ended (``check``: its future, when it ran in the background)."""
        store = self.store
        assert store is not None
        with self._lock:
            self.checking = False
            try:
                if self._closing.is_set():
                    return  # closed first: the turns stay journaled for the next start
                if check is not None and isinstance(check.exception(), LogError):
                    error = check.exception()
                    self.failing = str(error)
                    self._failed_at = time.monotonic()
                    self.notify(
                        f"conversation log {store.display_url} could not be checked ({error}); turns are kept "
                        "in its journal and written when it works again"
                    )
                    self._start_retrying()
                    return
                if check is not None:
                    check.result()  # anything else is a bug: raised
                # A damaged SQLite file is never written into: every write goes to the journal.
                self.damaged = store.quick_check()
                if store.repaired is not None:
                    self.notify(store.repaired)
                if self.damaged is not None:
                    self.failing = f"the log file is damaged ({self.damaged})"
                    self.notify(
                        f"conversation log {store.display_url} is damaged ({self.damaged}); nothing is written "
                        f"into it: turns are kept in {self.journal.folder}. `chatcore logs export --salvage` "
                        "recovers the conversations it holds"
                    )
                elif len(self.journal):  # turns kept during the check, or left by a process that ended
                    self._flush()
            finally:
                self.checked.set()

    # -- hooks ----------------------------------------------------------------------
    @chatcore.hookimpl
    def on_user_message(self, conversation: "Conversation", turn: "Turn", model: "LoadedModel") -> None:
        self._model = model
        fields = {"token_count": count_tokens(model, turn.text)}
        self._hold(conversation, self._message_write(conversation, "user", turn, fields, model.name))

    @chatcore.hookimpl
    def on_response(self, conversation: "Conversation", response: "Response") -> None:
        turn = conversation.turns[-1]  # the bot turn just recorded for this response
        fields, model_name = response_fields(conversation, response)
        self._hold(conversation, self._message_write(conversation, "bot", turn, fields, model_name))

    def log_conversation(self, conversation: "Conversation", model: "LoadedModel", start: int = 0) -> None:
        """Write the turns the conversation holds now from index ``start`` on (all of them
        for a log that became available after the conversation started; the new ones for an
        adapter that hands whole conversations over); each reply with its provenance.
        ``model``: the model that answers it (its tokenizer counts the user turns' tokens)."""
        self._model = model
        for turn in conversation.turns[start:]:
            self._hold(conversation, self._turn_write(conversation, turn, model))

    def held(self, conversation_id: str) -> "Future[None]":
        """The future of the newest turn of ``conversation_id`` handed to the log: done once that
        turn (and every one before it) is committed or journaled. Show a reply after it resolves."""
        with self._held_lock:
            future = self._held.get(conversation_id)
        if future is None:
            future = Future()
            future.set_result(None)
        return future

    def _hold(self, conversation: "Conversation", write: Write) -> None:
        """Queue a turn's write on the log's thread (the write was built here: the conversation
        changes after the hook returns); wait for it to be held unless the adapter awaits :meth:`held`."""
        future = self._turns.submit(lambda: self._submit(conversation, write))
        conversation_id = conversation.id
        with self._held_lock:
            self._held[conversation_id] = future
        future.add_done_callback(lambda done: self._forget(conversation_id, done))
        if self.wait:
            future.result()

    def _forget(self, conversation_id: str, done: "Future[None]") -> None:
        with self._held_lock:
            if self._held.get(conversation_id) is done:
                del self._held[conversation_id]
        if not self.wait and not done.cancelled() and done.exception() is not None:
            logger.error("conversation log: a turn could not be written: %s", done.exception())

    def _turn_write(self, conversation: "Conversation", turn: "Turn", model: "LoadedModel | None") -> Write:
        fields, model_name = turn_fields(turn, model)
        return self._message_write(conversation, turn.role, turn, fields, model_name)

    # -- what to write ---------------------------------------------------------------
    write_key = staticmethod(write_key)

    def _message_write(
        self, conversation: "Conversation", role: str, turn: "Turn", fields: dict[str, Any], model_name: str | None
    ) -> Write:
        author_id = turn.meta.get("author_id")
        # The newest logged message this chat has read: what it resumed (a reply it then drops
        # for a retried one included) or the turns it holds, whichever is newer.
        read = max([conversation.logged_up_to, *(int(t.meta.get("log_message_id") or 0) for t in conversation.turns)])
        since = self._since[conversation.id] = max(self._since.get(conversation.id, 0), read)
        return self._retarget(
            {
                "key": self.write_key(conversation.id, turn),
                "conversation_id": conversation.id,
                "role": role,
                "text": turn.text,
                "fields": dict(
                    fields,
                    created=turn.created,
                    interrupted=turn.interrupted,
                    author_id=None if author_id is None else str(author_id),
                    conversation=conversation_fields(conversation, model_name),
                    writer=self.writer,
                    writer_since=since,
                ),
            }
        )

    def logged_id(self, conversation_id: str) -> str:
        """The id this chat's turns of ``conversation_id`` are logged under (a new one once another
        chat wrote the original: see ``_fork``)."""
        return self._forks.get(conversation_id, conversation_id)

    def _retarget(self, write: Write) -> Write:
        """The write into the conversation this chat's turns moved to, when another chat writes the original."""
        fork = self._forks.get(write["conversation_id"])
        if fork is None:
            return write
        key = hashlib.sha256(f"{fork}\0{write['key']}".encode()).hexdigest()[:32]
        fields = dict(write["fields"], writer_since=0)
        return dict(write, conversation_id=fork, key=key, fields=fields)

    # -- writing ----------------------------------------------------------------------
    def _submit(self, conversation: "Conversation", write: Write) -> None:
        with self._lock:
            self._live[conversation.id] = conversation
            if self._writable() and self._reopened_after_loss(conversation):
                return  # this write was part of the conversation written again
            if not self._writable():
                self._keep(write)
                return
            if self._waiting():
                self._flush()  # each turn tries the waiting writes first (briefly: see _write)
            if self._waiting():
                self._keep(write)  # behind the writes still waiting, so the order holds
            elif self._write(write):
                self._recovered(1)
            else:
                self._keep(write)  # on the disk before the hook returns, so before the reply is shown

    def _writable(self) -> bool:
        """The file has passed its check on open (writes may still fail: then they are journaled)."""
        return self.damaged is None and not self.checking

    def _waiting(self) -> bool:
        return bool(self._pending) or bool(len(self.journal))

    def _reopened_after_loss(self, conversation: "Conversation") -> bool:
        """A log file deleted (or replaced) under a running chat would take every later
        write into the unlinked file, out of sight. Found before a write: say so once,
        open a new file at the path, and write this conversation into it from its first
        turn (the turns of other conversations in the lost file are not recovered)."""
        if self.store is None:
            return False
        try:
            gone = self.store.file_gone()
            if gone is None:
                return False
            self.store.reopen()
        except (OSError, LogError) as error:
            if self.failing is None:
                self.failing = str(error)
                self._failed_at = time.monotonic()
                self.notify(
                    f"conversation log {self.store.display_url}: {error}; turns are kept and written "
                    "when it works again"
                )
            return False
        self.notify(
            f"{gone}: a new one was created there and this conversation is written into it again from its first turn"
        )
        # Writes still waiting go to the new file; this conversation's are replaced by all its turns.
        self._written.clear()  # the new file holds none of them: a conversation missing there was not deleted
        self._pending = [w for w in self._pending if w["conversation_id"] != conversation.id]
        for turn in conversation.turns:
            self._pending.append(self._turn_write(conversation, turn, self._model))
        self._flush()
        return True

    def _keep(self, write: Write) -> None:
        """Keep a write the database has not taken: in the journal (on the disk) when it can, else in memory."""
        if len(self._pending) >= self.max_pending:
            self.dropped += 1
            return
        if not self._pending:  # once one waits in memory, the later ones queue behind it there
            try:
                self.journal.append(write)
                return
            except OSError as error:
                if not self._unsaved_told:
                    self._unsaved_told = True
                    self.notify(
                        f"conversation log journal {self.journal.folder} cannot be written either "
                        f"({error.strerror or error}); turns wait in memory and are written when the log or "
                        f"the disk works again (up to {self.max_pending:,}; those still waiting when the chat "
                        "ends are lost)"
                    )
        self._pending.append(write)

    def _write(self, write: Write) -> bool:
        """Store one write; False when the database is unavailable (the caller keeps the write).

        While the log fails, a retry waits at most RETRY_WAIT_S for SQLite's lock, so
        retrying on every turn never holds a turn up for the whole busy timeout.
        """
        write = self._retarget(write)  # one journaled before its conversation moved
        store = self.store
        if store is not None:
            store.write_wait_s = RETRY_WAIT_S if self.failing is not None else None
        deadline_s = self.failing_wait_s if self.failing is not None else self.write_deadline_s
        written_before = write["conversation_id"] in self._written
        try:
            self._writer.run(
                lambda: (store or self._open()).add_message(
                    write["conversation_id"],
                    write["role"],
                    write["text"],
                    write_key=write["key"],
                    written_before=written_before,
                    **write["fields"],
                ),
                deadline_s,
            )
            self._written.add(write["conversation_id"])
            self._note_awaiting(write)
        except LogUnavailableError as error:
            if self.failing is None:
                self.notify(
                    f"conversation log unavailable ({error}); replies go on: turns are kept in its journal "
                    "and written when it works again"
                )
            self.failing = str(error)
            self._failed_at = time.monotonic()
            self._start_retrying()
            return False
        except ConversationTakenError as error:
            self._fork(write, error)
        except ConversationDeletedError:
            self._restart(write)
        except LogError as error:  # refused for good: set it aside, never block the writes after it
            self.rejected += 1
            self._set_aside(write, error)
        return True

    def _fork(self, write: Write, error: ConversationTakenError) -> None:
        """Another chat writes this conversation too (two terminals on one ``--cid``), or its message
        at the end waits for the reply that chat is making: rather than interleave the two, this chat
        goes on in a new conversation holding its turns so far."""
        original = write["conversation_id"]
        self._forks[original] = fork = uuid.uuid4().hex
        live = self._live.get(original)
        why = (
            "ends with another chat's message still waiting for its reply"
            if isinstance(error, AwaitingReplyError)
            else "is being written by another chat as well"
        )
        self.notify(
            f"conversation {original[:12]} {why}; this chat goes on in a new conversation {fork[:12]}, "
            f"which holds its turns so far (`chatcore chat --cid {fork[:12]}` resumes it)"
        )
        copies = (
            [self._turn_write(live, turn, self._model) for turn in live.turns]
            if live is not None
            else [self._retarget(write)]
        )
        for copy in copies:
            if not self._write(copy):
                self._keep(copy)

    def _restart(self, write: Write) -> None:
        """The conversation was deleted from the log (``chatcore logs delete``) while this chat went
        on: its turns from this one on go to a new conversation, which holds none of the deleted
        turns, its title (if any) from this turn rather than from the deleted first message."""
        deleted = write["conversation_id"]
        self._written.discard(deleted)
        chat = next((original for original, fork in self._forks.items() if fork == deleted), deleted)
        self._forks[chat] = new = uuid.uuid4().hex
        self.notify(
            f"conversation {deleted[:12]} was deleted from the log; this chat's next turns go to a new "
            f"conversation {new[:12]}"
        )
        fields = dict(write["fields"], writer_since=0)
        conversation = dict(fields.get("conversation") or {})
        conversation.update(
            created=fields.get("created"), title=title_from(write["text"]) if write["role"] == "user" else None
        )
        fields["conversation"] = conversation
        key = hashlib.sha256(f"{new}\0{write['key']}".encode()).hexdigest()[:32]
        restarted = dict(write, conversation_id=new, key=key, fields=fields)
        if not self._write(restarted):
            self._keep(restarted)

    def _note_awaiting(self, written: Write) -> None:
        """Keep track of the conversations whose newest message written here waits for a reply."""
        if written["role"] == "user":
            self._awaiting[written["conversation_id"]] = written["fields"].get("writer") or self.writer
        else:
            self._awaiting.pop(written["conversation_id"], None)

    def _release(self, ended_only: bool) -> None:
        """Give up the messages left waiting for a reply by chats that have ended (``ended_only``:
        those of journals adopted from ended processes; else this chat's too, as it ends), so that
        another chat goes on after them rather than in a new conversation. A failure leaves them."""
        store = self.store
        for conversation_id, writer in list(self._awaiting.items()):
            if store is None or (ended_only and writer == self.writer):
                continue
            del self._awaiting[conversation_id]
            try:
                self._writer.run(functools.partial(store.release, conversation_id, writer), self.write_deadline_s)
            except LogError:
                continue  # the message stays this chat's: a chat that goes on there starts a new conversation

    def _open(self) -> "ConversationStore":
        """Open the log that could not be opened at the start (on the writer thread). Any failure
        may pass (a folder made later, a server started): the writes stay journaled."""
        assert self._opener is not None
        try:
            store = self._opener()
        except LogUnavailableError:
            raise
        except LogError as error:
            raise LogUnavailableError(str(error)) from error
        store.write_wait_s = RETRY_WAIT_S
        self.store = store
        return store

    def _set_aside(self, write: Write, error: LogError) -> None:
        where: Path = self.journal.folder / f"{self.journal.prefix}{REJECTED_SUFFIX}"
        line = (json.dumps({"error": str(error), "write": write}, default=str) + "\n").encode("utf-8", "replace")
        note_folder(self.journal.folder, self.journal.url)  # where `chatcore logs delete` finds it
        try:
            append_line(where, line)
            kept = True
        except OSError:
            kept = False
        self.notify(
            f"conversation log refused a message ({error}); "
            + (f"it is kept in {where}" if kept else "it could not be kept")
            + "; later turns go on"
        )

    def _flush(self) -> None:
        """Write what waits, in order: the journal's files (oldest first), then memory. Stops at a failure.

        What was deleted from the log meanwhile (``chatcore logs delete``, recorded beside the
        journal) is dropped, not written: see :class:`~chatcore.log.journal.Deletions`."""
        written = 0
        deletions = Deletions.read(self.journal.folder, self.journal.url)
        withheld = 0
        if len(self.journal):
            done_path = None
            for path, write in self.journal.entries():
                if done_path is not None and path != done_path:
                    self.journal.done(done_path)
                done_path = path
                screened = self._screen(write, deletions)
                if screened is None:
                    withheld += 1
                    continue
                if not self._write(screened):
                    return
                written += 1
            if done_path is not None:
                self.journal.done(done_path)
            forget_deletions(self.journal.folder, self.journal.url)
            self._release(ended_only=True)  # what the ended chats left waiting for a reply
        while self._pending:
            screened = self._screen(self._pending[0], deletions)
            if screened is None:
                withheld += 1
            elif not self._write(screened):
                return
            else:
                written += 1
            self._pending.pop(0)
        if withheld:
            self.notify(
                f"conversation log: {withheld} waiting write(s) of what `chatcore logs delete` deleted were dropped, "
                "not written"
            )
        self._recovered(written)

    def _screen(self, write: Write, deletions: Deletions) -> Write | None:
        """A waiting write as it may be written now: None when it is of what was deleted meanwhile.

        A deleted conversation is never made again under its id: its turns made later, here or by
        the chat that journaled them, go to a new conversation (see :meth:`_restart`). A deleted
        author's first message titled the conversation in every write of it: the title goes too."""
        if write["conversation_id"] in deletions.conversations:
            self._written.add(write["conversation_id"])
        return screened(write, deletions, self._withheld_titles)

    def _recovered(self, written: int) -> None:
        if self.failing is not None and not self._waiting():
            self.failing = None
            self._unsaved_told = False
            self.notify(f"conversation log available again; {written} waiting write(s) saved")

    # -- retrying on a timer ---------------------------------------------------------------
    def _start_retrying(self) -> None:
        """Retry after a failure without waiting for the next turn: after retry_after_s, then
        twice as long each time, up to MAX_RETRY_INTERVAL_S (called holding the lock)."""
        if self._retrier is not None or self._closing.is_set():
            return
        self._retrier = threading.Thread(target=self._retry_loop, name="conversation-log-retry", daemon=True)
        self._retrier.start()

    def _retry_loop(self) -> None:
        interval = max(self.retry_after_s, MIN_RETRY_INTERVAL_S)
        while not self._closing.wait(interval):
            with self._lock:
                if self._closing.is_set():
                    break
                if self._writable() and self._waiting():
                    self._flush()
                if not self._waiting() or not self._writable():
                    self._retrier = None
                    return
            interval = min(interval * 2, MAX_RETRY_INTERVAL_S)
        with self._lock:
            self._retrier = None

    @property
    def pending(self) -> int:
        """Writes not in the database yet: waiting in memory or in the spill journal."""
        return len(self._pending) + self.journal.count

    @property
    def journaled(self) -> int:
        """Writes waiting in the spill journal (this process's file)."""
        return self.journal.count

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait for a write that outlived its deadline to end (True when none runs any more)."""
        return self._writer.wait_idle(timeout_s)

    def flush(self) -> bool:
        """Try the waiting writes now, however recently they failed; True when none is left."""
        return self._turns.submit(self._flush_now).result()

    def _flush_now(self) -> bool:
        with self._lock:
            if self._writable():
                self._flush()
            return not self._pending and not len(self.journal)

    def close(self) -> int:
        """Try the waiting writes once more, then journal what is left; returns how many are journaled.

        Adapters call this at exit: the journaled writes are replayed by the next
        process that logs to the same database. Never raises for a full disk:
        what neither the database nor the journal took stays in :attr:`pending`.
        """
        self._closing.set()
        retrier = self._retrier
        if retrier is not None:
            retrier.join()
        self._turns.submit(lambda: None).result()  # the turns queued before are held
        self._turns.close()
        with self._lock:
            if self._writable() and self._waiting():
                self._flush()
            if self._writable() and not self._waiting():
                self._release(ended_only=False)
            while self._pending:
                try:
                    self.journal.append(self._pending[0])
                except OSError as error:
                    logger.warning("conversation log journal %s: %s", self.journal.path, error)
                    break
                self._pending.pop(0)
            journaled = self.journal.count
            self.journal.close()
            self._writer.close()
            return journaled
