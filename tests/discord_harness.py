"""A Discord bot on dpytest's fake gateway, and its slash commands run the way Discord would
call them: shared by the Discord adapter's tests and the entry-point matrix."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import discord
import discord.ext.test as dpytest

from chatcore.adapters.discord_bot.bot import ChatBot, bot_intents
from chatcore.adapters.discord_bot.config import DiscordSettings
from chatcore.adapters.discord_bot.conversations import ChatRuntime
from chatcore.adapters.discord_bot.persistence import MemoryPersistence
from chatcore.adapters.discord_bot.worker import InferenceWorker

backend = dpytest.backend


# -- a bot on dpytest's fake Discord -------------------------------------------------
class Harness:
    """A ChatBot with its worker, connected to dpytest; records every send's payload."""

    def __init__(self, bot: ChatBot, worker: InferenceWorker[ChatRuntime]) -> None:
        self.bot = bot
        self.worker = worker
        self.config = dpytest.get_config()
        self.payloads: list[tuple[int, dict[str, Any]]] = []
        original = bot.http.send_message

        async def record(channel_id: int, *, params: Any) -> Any:
            # dpytest's fake HTTP reads `channel` from its caller's frame: keep it visible.
            channel = sys._getframe(1).f_locals.get("channel")  # noqa: F841
            self.payloads.append((channel_id, params.payload))
            return await original(channel_id, params=params)

        bot.http.send_message = record

    @property
    def guild(self) -> discord.Guild:
        return self.config.guilds[0]

    def channel(self, index: int) -> discord.TextChannel:
        return self.config.channels[index]

    def member(self, index: int) -> discord.Member:
        return self.config.members[index]

    def listen_in(self, *channels: Any) -> None:
        self.bot.settings = self.bot.settings.model_copy(update={"channels": tuple(c.id for c in channels)})

    async def say(self, content: str, channel: Any, member: Any) -> list[discord.Message]:
        """Send a message as ``member`` and return what the bot sent in answer."""
        await dpytest.message(content, channel=channel, member=member)
        return self.drain()

    def drain(self) -> list[discord.Message]:
        sent = []
        while not dpytest.sent_queue.empty():
            sent.append(dpytest.sent_queue.get_nowait())
        return sent

    async def on_worker(self, function: Any) -> Any:
        return await self.worker.submit(lambda runtime, control: function(runtime), control=True)

    async def close(self) -> None:
        self.bot.ws = None  # dpytest's fake gateway has no socket to close
        await self.bot.shutdown()
        self.drain()


async def start_harness(
    engine: Any,
    settings: DiscordSettings,
    persistence: Any = MemoryPersistence,
    *,
    text_channels: int = 2,
    members: int = 2,
) -> Harness:
    """``persistence()`` runs on the worker thread, as in the real bot."""
    worker: InferenceWorker[ChatRuntime] = InferenceWorker(
        lambda: ChatRuntime(engine, persistence(), max_batch=settings.max_batch, queue_size=settings.queue_size),
        queue_size=settings.max_batch + settings.queue_size,
        close_resource=ChatRuntime.close,
    )
    worker.start()
    await worker.ready()
    intents = bot_intents()
    intents.members = True  # dpytest fakes message authors from the member cache
    bot = ChatBot(settings, worker, intents=intents, raise_errors=True)
    dpytest.configure(bot, text_channels=text_channels, voice_channels=0, members=members)
    await bot._async_setup_hook()  # binds the client (and dpytest's fake state) to this loop
    await bot.prepare()
    return Harness(bot, worker)


# -- slash commands, as Discord calls their handlers -----------------------------------
class FakeResponse:
    """The part of discord.InteractionResponse the handlers use."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bool, Any]] = []
        self.deferred: tuple[bool, bool] | None = None

    def is_done(self) -> bool:
        return bool(self.sent) or self.deferred is not None

    async def send_message(self, content: str, *, ephemeral: bool = False, allowed_mentions: Any = None) -> None:
        assert not self.is_done(), "an interaction is answered once; then comes the follow-up"
        self.sent.append((content, ephemeral, allowed_mentions))

    async def defer(self, *, ephemeral: bool = False, thinking: bool = False) -> None:
        assert not self.is_done()
        self.deferred = (ephemeral, thinking)


class FakeFollowup:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bool, Any]] = []

    async def send(self, content: str, *, ephemeral: bool = False, allowed_mentions: Any = None) -> None:
        self.sent.append((content, ephemeral, allowed_mentions))


def interaction(user: Any, channel: Any) -> Any:
    return SimpleNamespace(
        user=user,
        channel=channel,
        channel_id=channel.id,
        guild=getattr(channel, "guild", None),
        response=FakeResponse(),
        followup=FakeFollowup(),
    )


def answers(fake: Any) -> list[str]:
    for _, _, allowed in fake.response.sent + fake.followup.sent:
        assert allowed is not None and allowed.everyone is False and allowed.roles is False and allowed.users is False
    return [content for content, _, _ in fake.response.sent + fake.followup.sent]


async def slash(harness: Harness, name: str, user: Any, channel: Any, **arguments: Any) -> Any:
    """Run ``/chat name`` (``name`` may be a subcommand path: "system set")."""
    fake = interaction(user, channel)
    command = harness.bot.tree.get_command("chat")
    for part in name.split():
        command = command.get_command(part)
    await command.callback(fake, **arguments)
    return fake


async def make_manager(
    harness: Harness, member: discord.Member, *, permissions: int = 0x20, name: str = "Managers"
) -> discord.Member:
    role = backend.make_role(name, harness.guild, permissions=permissions)
    await dpytest.add_role(member, role)
    return harness.guild.get_member(member.id)
