"""The Discord client: which messages to answer, and answering them without stalling.

Every message the bot sends goes out with ``AllowedMentions.none()`` (also set as
the client's default), so nothing the model writes (``@everyone``, a role, a user id)
pings anyone. Nothing slow runs on the event loop: a message handler submits the reply
to the serving scheduler itself (many channels in one batch; a full batch and queue is
the one "busy" answer), awaits its end with the typing indicator on (the scheduler's
listener resolves an asyncio future with ``loop.call_soon_threadsafe``), adds the user's
turn and records the reply on the loop (the log's hooks only queue the turns on the log's
own thread), and awaits the log's acknowledgement (``asyncio.wrap_future``) before it
sends the reply, so the log holds it before it is shown. Only a conversation not open
yet is read from the log on the worker thread. Messages of one channel are answered in order,
one after the other; different channels are answered at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import discord
from discord import app_commands

from chatcore.adapters.discord_bot.routing import answer_reason, conversation_key, incoming_text, split_reply
from chatcore.adapters.discord_bot.system_prompts import SystemPrompts
from chatcore.adapters.discord_bot.worker import WorkerBusy, WorkerClosed
from chatcore.cli.specs import parse_spec
from chatcore.errors import ChatcoreError
from chatcore.serving.requests import End, ServerBusy

if TYPE_CHECKING:
    from chatcore.adapters.discord_bot.config import DiscordSettings
    from chatcore.adapters.discord_bot.conversations import ChatRuntime, PendingReply, ReplyResult
    from chatcore.adapters.discord_bot.worker import InferenceWorker, JobControl
    from chatcore.conversation import Conversation
    from chatcore.engine import ReplyOptions

logger = logging.getLogger("chatcore.discord")

NO_MENTIONS = discord.AllowedMentions.none()

BUSY_REPLY = "I'm answering a lot of people right now. Please try again in a minute."
EMPTY_REPLY = "…I'm not sure what to say to that. Could you put it another way?"
NEED_TEXT_REPLY = "I only read text: write your message after the mention and I'll answer."
COOLDOWN_REPLY = "You're going a little fast for me: wait {seconds:g} s between messages."
RESTARTING_REPLY = "I'm restarting and dropped your message; please send it again in a minute."
TIMEOUT_REPLY = "Sorry, I took too long to answer that. Please try again."
# After a reply cut short, by why it was cut: the person sees that it is not all.
CUT_MARKS = {"timeout": " [interrupted: I ran out of time]", "shutdown": " [interrupted: I'm restarting]"}
ERROR_REPLY = "Sorry, something went wrong while I was thinking. Please try again."


def shown_in_channel(key: str, error: ChatcoreError) -> str:
    """What a channel is told of a reply that failed: a setting's or a message's error whole
    (the user's to mend); for a plugin's or the model's failure, what failed without the text
    of the exception under it (which may hold paths or other internals), which the bot's
    console gets instead."""
    from chatcore.cli import debug_enabled
    from chatcore.errors import OptionError

    text, cause = str(error), error.__cause__
    if isinstance(error, OptionError) or cause is None or isinstance(cause, ChatcoreError):
        return text
    logger.warning("a reply in %s failed: %s", key, text, exc_info=error if debug_enabled() else None)
    cut = text.find(f": {type(cause).__name__}")
    return text[:cut] if cut > 0 else text


def bot_intents() -> discord.Intents:
    """Guilds, guild and DM messages, and message content (a privileged intent: it
    must be switched on in the developer portal; mentions and DMs carry their content
    even without it, messages in listed channels do not)."""
    intents = discord.Intents.none()
    intents.guilds = True
    intents.guild_messages = True
    intents.dm_messages = True
    intents.message_content = True
    return intents


class Cooldown:
    """At most one answered message per user every ``seconds``; one warning per window."""

    def __init__(self, seconds: float, clock: Any = time.monotonic) -> None:
        self.seconds = seconds
        self.clock = clock
        self._last: dict[int, float] = {}
        self._warned: set[int] = set()

    def check(self, user_id: int) -> Literal["ok", "warn", "quiet"]:
        if self.seconds <= 0:
            return "ok"
        now = self.clock()
        last = self._last.get(user_id)
        if last is None or now - last >= self.seconds:
            if len(self._last) > 10_000:  # forget users whose window has passed
                self._last = {user: t for user, t in self._last.items() if now - t < self.seconds}
                self._warned &= set(self._last)
            self._last[user_id] = now
            self._warned.discard(user_id)
            return "ok"
        if user_id in self._warned:
            return "quiet"
        self._warned.add(user_id)
        return "warn"


@dataclass
class BotStats:
    """Counters since start: how each message the bot took up ended."""

    replies: int = 0
    busy: int = 0
    cooldown: int = 0
    errors: int = 0
    interrupted: int = 0

    def __str__(self) -> str:
        """In words: "3 replies sent (1 cut short), 1 failed"."""
        sent = f"{self.replies} {'reply' if self.replies == 1 else 'replies'} sent"
        if self.interrupted:
            sent += f" ({self.interrupted} cut short)"
        others = [
            f"{count} {what}"
            for count, what in (
                (self.busy, "turned away while busy"),
                (self.cooldown, "held back by the cooldown"),
                (self.errors, "failed"),
            )
            if count
        ]
        return ", ".join([sent, *others])

    @property
    def took_up_any(self) -> bool:
        """Whether the bot took up any message."""
        return any((self.replies, self.busy, self.cooldown, self.errors, self.interrupted))


@dataclass
class ChannelSetup:
    """The decoder and steerers one conversation key uses."""

    decoder: str
    decoder_settings: dict[str, Any] = field(default_factory=dict)
    steerers: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def copy(self) -> "ChannelSetup":
        return ChannelSetup(
            self.decoder, dict(self.decoder_settings), [(name, dict(settings)) for name, settings in self.steerers]
        )


def _open_job(key: str, runtime: "ChatRuntime", control: "JobControl") -> "Conversation":
    return runtime.conversation(key)


@dataclass(eq=False)
class InFlight:
    """A reply being decoded, as the event loop sees it."""

    ended: "asyncio.Future[None]"
    pending: "PendingReply | None" = None
    stop_reason: str | None = None

    def stop(self, reason: str) -> None:
        """Cut the reply (on the event loop): its slot is free at once, and its handler stops
        waiting and sends what was written."""
        if self.stop_reason is None:
            self.stop_reason = reason
        if self.pending is not None:
            self.pending.handle.cancel()  # thread-safe; the slot is free at once
            if not self.ended.done():
                self.ended.set_result(None)


@contextlib.asynccontextmanager
async def typing_indicator(channel: discord.abc.Messageable) -> AsyncIterator[None]:
    """The typing indicator while the block runs; a channel that refuses it is no error."""
    typing = channel.typing()
    try:
        await typing.__aenter__()
    except discord.HTTPException:
        yield
        return
    try:
        yield
    finally:
        await typing.__aexit__(None, None, None)


class ChatBot(discord.Client):
    """chatcore on Discord: one engine (behind the worker) for every channel."""

    def __init__(
        self,
        settings: "DiscordSettings",
        worker: "InferenceWorker[ChatRuntime]",
        *,
        intents: discord.Intents | None = None,
        raise_errors: bool | None = None,
        **client_options: Any,
    ) -> None:
        from chatcore.cli import debug_enabled

        # A text bot has no use for voice: skip discord.py's warnings about voice libraries.
        discord.VoiceClient.warn_nacl = False
        discord.VoiceClient.warn_dave = False
        super().__init__(intents=intents or bot_intents(), allowed_mentions=NO_MENTIONS, **client_options)
        self.settings = settings
        self.worker = worker
        self.raise_errors = debug_enabled() if raise_errors is None else raise_errors
        decoder, decoder_settings = parse_spec(settings.decoder)
        self.default_setup = ChannelSetup(decoder, decoder_settings, [parse_spec(spec) for spec in settings.steer])
        self.setups: dict[str, ChannelSetup] = {}
        self.system_prompts = SystemPrompts(settings.system)
        self.prompt_format = settings.prompt_format  # the name the engine resolved, once prepared
        self.cooldown = Cooldown(settings.cooldown_s)
        # Waits out `reply_timeout_s`; tests put an event in its place, so that a reply is
        # cut at a moment they choose rather than by the clock.
        self.reply_timer: Callable[[float], Awaitable[Any]] = asyncio.sleep
        self.stats = BotStats()
        self.last_provenance: dict[str, dict[str, Any]] = {}
        self.catalog: dict[str, list[str]] = {"decoders": [], "steerers": []}
        self.runtime: "ChatRuntime | None" = None  # the worker's, once prepared: its scheduler takes replies
        self.closing = False
        self._handler_tasks: set[asyncio.Task[Any]] = set()
        self.in_flight: set[InFlight] = set()
        # A channel's lock and how many handlers use it (dropped when none does).
        self._channel_locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self._shutdown_task: asyncio.Task[None] | None = None
        self.tree = app_commands.CommandTree(self)
        from chatcore.adapters.discord_bot.slash import ChatCommands

        self.chat_commands = ChatCommands(self)
        self.tree.add_command(self.chat_commands.group)

    # -- setup --------------------------------------------------------------------
    async def prepare(self) -> None:
        """Check the configured decoder, steerers and system prompt on the engine (bad
        settings fail here, before connecting) and learn the names the slash commands offer."""
        options = self.options_of(self.default_setup)
        system, max_new_tokens = self.settings.system, self.settings.max_new_tokens

        def check(runtime: "ChatRuntime", control: "JobControl") -> "tuple[dict[str, list[str]], str, ChatRuntime]":
            runtime.check_options(options)
            runtime.check_system(system, max_new_tokens)
            return runtime.names(), runtime.prompt_format, runtime

        self.catalog, self.prompt_format, self.runtime = await self.worker.submit(check, control=True)

    async def setup_hook(self) -> None:
        """Sync the slash commands: to the listed guilds (at once), else globally."""
        try:
            if self.settings.guilds:
                for guild_id in self.settings.guilds:
                    guild = discord.Object(id=guild_id)
                    self.tree.copy_global_to(guild=guild)
                    await self.tree.sync(guild=guild)
                logger.info("slash commands synced to %d guild(s)", len(self.settings.guilds))
            else:
                await self.tree.sync()
                logger.info("slash commands synced globally (they can take a while to appear)")
        except discord.HTTPException as error:
            logger.warning("cannot sync the slash commands (%s); messages still work", error)

    async def on_ready(self) -> None:
        assert self.user is not None
        logger.info("connected as %s (id %s) in %d guild(s)", self.user, self.user.id, len(self.guilds))

    # -- conversation setups --------------------------------------------------------
    def setup_for(self, key: str) -> ChannelSetup:
        return self.setups.get(key, self.default_setup)

    def reply_options(self, key: str) -> "ReplyOptions":
        return self.options_of(self.setup_for(key))

    def options_of(self, setup: ChannelSetup) -> "ReplyOptions":
        """The reply options of a conversation with ``setup``."""
        from chatcore.engine import ReplyOptions

        return ReplyOptions(
            decoder=setup.decoder,
            decoder_settings=dict(setup.decoder_settings),
            steerers=[(name, dict(settings)) for name, settings in setup.steerers],
            max_new_tokens=self.settings.max_new_tokens,
            min_new_tokens=self.settings.min_new_tokens,
        )

    def remember_provenance(self, key: str, provenance: dict[str, Any]) -> None:
        """Keep the newest reply's provenance per key for /chat why (as many keys as
        conversations are kept open; older ones are read back from the conversation)."""
        self.last_provenance.pop(key, None)
        self.last_provenance[key] = provenance
        while len(self.last_provenance) > self.settings.max_conversations:
            del self.last_provenance[next(iter(self.last_provenance))]

    # -- messages -----------------------------------------------------------------
    async def on_message(self, message: discord.Message) -> None:
        if self.closing or self.user is None:
            return
        reason = answer_reason(message, self.user.id, self.settings.channels)
        if reason is None:
            return
        task = asyncio.current_task()
        if task is not None:
            self._handler_tasks.add(task)
        try:
            await self._answer(message, reason)
        finally:
            if task is not None:
                self._handler_tasks.discard(task)

    async def _answer(self, message: discord.Message, reason: str) -> None:
        assert self.user is not None
        text = incoming_text(message, self.user.id)
        if not text:
            if reason != "channel":  # in a listed channel, an image alone is not for us
                await self.send_reply(message, NEED_TEXT_REPLY)
            return
        verdict = self.cooldown.check(message.author.id)
        if verdict != "ok":
            self.stats.cooldown += 1
            if verdict == "warn":
                await self.send_reply(message, COOLDOWN_REPLY.format(seconds=self.settings.cooldown_s))
            return
        key = conversation_key(message.channel)
        # One reply at a time per channel, in the order the messages came.
        lock, users = self._channel_locks.get(key) or (asyncio.Lock(), 0)
        self._channel_locks[key] = (lock, users + 1)
        try:
            async with lock:
                if self.closing:
                    return
                system, _ = self.system_prompts.effective(key)
                result = await self._generate(message, key, text, system)
        finally:
            lock, users = self._channel_locks[key]
            if users == 1:
                del self._channel_locks[key]
            else:
                self._channel_locks[key] = (lock, users - 1)
        if result is None:
            return
        self.remember_provenance(key, result.provenance)
        text = result.text
        if result.interrupted:
            self.stats.interrupted += 1
            text = cut_reply_text(result.text, result.stop_reason)
        await self.send_reply(message, text)
        self.stats.replies += 1

    async def _generate(
        self, message: discord.Message, key: str, text: str, system: str | None
    ) -> "ReplyResult | None":
        """Decode one reply on the scheduler; None when the user was already answered
        (busy, restarting, an error)."""
        loop = asyncio.get_running_loop()
        flight = InFlight(loop.create_future())

        def ended() -> None:
            if not flight.ended.done():
                flight.ended.set_result(None)

        def listener(event: Any) -> None:  # on the scheduler's thread
            if isinstance(event, End):
                loop.call_soon_threadsafe(ended)

        runtime = self.runtime
        assert runtime is not None, "prepare() first"
        self.in_flight.add(flight)
        try:
            try:
                conversation = runtime.open_conversation(key)
                if conversation is None:  # resumed from the log (or new): storage is the worker's
                    conversation = await self.worker.submit(functools.partial(_open_job, key), control=True)
                flight.pending, cleaned = runtime.submit_reply(
                    key, conversation, text, self.reply_options(key), system, listener
                )
                runtime.add_user(flight.pending, cleaned, str(message.author.id))
            except (ServerBusy, WorkerBusy):  # the batch and its queue are full (WorkerBusy: the worker's cap)
                if flight.pending is not None:  # submitted, but its turn cannot be added: not answered
                    flight.pending.handle.cancel()
                self.stats.busy += 1
                await self.send_reply(message, BUSY_REPLY)
                return None
            except WorkerClosed:
                if flight.pending is not None:
                    flight.pending.handle.cancel()
                return None
            except ChatcoreError as error:
                if flight.pending is not None:
                    flight.pending.handle.cancel()
                self.stats.errors += 1
                await self.send_reply(message, f"Sorry, I can't answer that: {shown_in_channel(key, error)}")
                return None
            if flight.stop_reason is not None:  # shutdown began while it was being submitted
                flight.stop(flight.stop_reason)
            try:
                async with typing_indicator(message.channel):
                    await self._wait_for_end(flight)
            except asyncio.CancelledError:
                flight.stop("cancelled")
                raise
        finally:
            self.in_flight.discard(flight)
        pending = flight.pending
        if flight.stop_reason is not None and pending.handle.admitted is None:
            # Cut while it waited for a place in the batch: the model never saw it.
            runtime.finish_reply(pending, flight.stop_reason)
            if flight.stop_reason == "shutdown":
                await self.send_reply(message, RESTARTING_REPLY)
            else:
                self.stats.busy += 1
                await self.send_reply(message, BUSY_REPLY)
            return None
        try:
            result = runtime.finish_reply(pending, flight.stop_reason)
            held = runtime.held(pending.conversation.id)
            if held is not None:  # the log holds the reply (committed or journaled) before it is shown
                await asyncio.wrap_future(held)
            return result
        except ChatcoreError as error:
            self.stats.errors += 1
            await self.send_reply(message, f"Sorry, I can't answer that: {shown_in_channel(key, error)}")
        except Exception:
            self.stats.errors += 1
            logger.exception("replying in %s failed", key)
            await self.send_reply(message, ERROR_REPLY)
            if self.raise_errors:
                raise
        return None

    async def _wait_for_end(self, flight: InFlight) -> None:
        """Until the reply ends, is stopped, or is past `reply_timeout_s` (then it is cut)."""
        timer = asyncio.ensure_future(self.reply_timer(self.settings.reply_timeout_s))
        try:
            await asyncio.wait({flight.ended, timer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()
        if not flight.ended.done():
            flight.stop("timeout")

    async def send_reply(self, message: discord.Message, text: str) -> list[discord.Message]:
        """Send ``text`` in answer to ``message``: split to Discord's size, never empty,
        never pinging anyone. The first piece replies to the message in guild channels,
        where several people may be talking."""
        pieces = split_reply(text) or [EMPTY_REPLY]
        sent: list[discord.Message] = []
        quote = message.guild is not None
        for piece in pieces:
            try:
                if quote:
                    try:
                        sent.append(
                            await message.channel.send(
                                piece,
                                allowed_mentions=NO_MENTIONS,
                                mention_author=False,
                                reference=message.to_reference(fail_if_not_exists=False),
                            )
                        )
                    except discord.Forbidden:
                        # Quoting needs Read Message History; a plain message does not.
                        sent.append(await message.channel.send(piece, allowed_mentions=NO_MENTIONS))
                    quote = False
                else:
                    sent.append(await message.channel.send(piece, allowed_mentions=NO_MENTIONS))
            except discord.HTTPException as error:
                logger.warning("cannot send to %s: %s", conversation_key(message.channel), error)
                break
        return sent

    # -- shutting down ------------------------------------------------------------
    def request_shutdown(self) -> None:
        """Start shutting down (once); for signal handlers."""
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.ensure_future(self._shutdown())

    async def shutdown(self) -> None:
        """Shut down and wait until it is done (however often it is called)."""
        self.request_shutdown()
        assert self._shutdown_task is not None
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self) -> None:
        # Stop taking messages, let the reply in flight finish (or cut it short after
        # `shutdown_grace_s`), close the log, send what is left, close the connection.
        self.closing = True
        logger.info("shutting down (%d message(s) in hand)", len(self._handler_tasks))
        flights = list(self.in_flight)
        for flight in flights:  # waiting for a place in the batch: dropped, the user is told
            if flight.pending is None or flight.pending.handle.admitted is None:
                flight.stop("shutdown")
        running = [flight.ended for flight in flights if flight.stop_reason is None]
        if running:
            await asyncio.wait(running, timeout=self.settings.shutdown_grace_s)
        for flight in list(self.in_flight):
            if not flight.ended.done():
                logger.info("interrupting a reply in flight")
                flight.stop("shutdown")
        handlers = [task for task in self._handler_tasks if not task.done()]
        if handlers:
            await asyncio.wait(handlers, timeout=10)
        await self.worker.stop(self.settings.shutdown_grace_s)
        await self.close()
        if self.stats.took_up_any:  # a bot that took up nothing (one that never connected) says only why it stopped
            logger.info("stopped: %s", self.stats)


def cut_reply_text(text: str, stop_reason: str | None) -> str:
    """What a person is sent of a reply cut short: its whole words and a mark saying it was
    cut; when not one whole word was written, the timeout (or restarting) answer instead."""
    if not text.strip():
        return RESTARTING_REPLY if stop_reason == "shutdown" else TIMEOUT_REPLY
    return text + CUT_MARKS.get(stop_reason or "", " [interrupted]")


class ShardedChatBot(ChatBot, discord.AutoShardedClient):
    """The bot on several gateway shards (discord.py's ``AutoShardedClient``): all of
    them in this process, or the ``shard_ids`` it was given, so that several processes
    share one bot."""


def make_bot(settings: "DiscordSettings", worker: "InferenceWorker[ChatRuntime]", **options: Any) -> ChatBot:
    """The client the settings ask for: one connection, or the sharded client."""
    if not settings.sharded:
        return ChatBot(settings, worker, **options)
    return ShardedChatBot(
        settings,
        worker,
        shard_count=settings.shard_count or None,
        shard_ids=list(settings.shard_ids) or None,
        **options,
    )
