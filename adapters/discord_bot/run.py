"""Starting and stopping the bot: worker, client, signals, and the token's safety.

Order at start: the worker loads the model and opens the log (a bad model or
setting fails here, before Discord is contacted); the configured decoder and
steerers are checked; then the client logs in. SIGTERM and Ctrl-C (SIGINT) run
:meth:`ChatBot.shutdown`: no new messages, the reply in flight finishes or is cut
short, the log is flushed, the connection closed.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chatcore.errors import ChatcoreError

if TYPE_CHECKING:
    from chatcore.adapters.discord_bot.bot import ChatBot
    from chatcore.adapters.discord_bot.config import DiscordSettings
    from chatcore.adapters.discord_bot.conversations import ChatRuntime
    from chatcore.adapters.discord_bot.worker import InferenceWorker
    from chatcore.plugin_manager import PluginHost

logger = logging.getLogger("chatcore.discord")


class RedactToken(logging.Filter):
    """Replaces the token in any log record that would contain it (belt and braces:
    neither chatcore nor discord.py logs it)."""

    def __init__(self, token: str) -> None:
        super().__init__()
        self.token = token

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.token in message:
            record.msg = message.replace(self.token, "[token]")
            record.args = None
        return True


def guard_logging(token: str) -> None:
    redact = RedactToken(token)
    for handler in logging.getLogger().handlers:
        handler.addFilter(redact)


@dataclass
class StartedBot:
    bot: "ChatBot"
    worker: "InferenceWorker[ChatRuntime]"


async def start_bot(settings: "DiscordSettings", host: "PluginHost | None" = None) -> StartedBot:
    """The worker (model loaded, log open) and a prepared client, not yet connected."""
    from chatcore.adapters.discord_bot.bot import make_bot
    from chatcore.adapters.discord_bot.conversations import ChatRuntime, open_runtime
    from chatcore.adapters.discord_bot.worker import InferenceWorker

    worker: InferenceWorker[ChatRuntime] = InferenceWorker(
        lambda: open_runtime(settings, host),
        queue_size=settings.max_batch + settings.queue_size,
        close_resource=ChatRuntime.close,
    )
    worker.start()
    logger.info("loading %s ...", settings.model)
    await worker.ready()
    bot = make_bot(settings, worker)
    try:
        await bot.prepare()
    except BaseException:
        await worker.stop(0)
        raise
    return StartedBot(bot, worker)


async def serve(settings: "DiscordSettings", token: str, host: "PluginHost | None" = None) -> None:
    """Run the bot until SIGTERM / Ctrl-C or until Discord closes the connection for good."""
    import discord

    started = await start_bot(settings, host)
    bot = started.bot
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(signum, bot.request_shutdown)
        except (NotImplementedError, RuntimeError):  # not on this platform or thread
            pass
    try:
        async with bot:
            await bot.start(token)
    except discord.LoginFailure:
        raise ChatcoreError(
            "Discord refused the bot token: copy it again from the developer portal (Bot > Reset Token)"
        ) from None
    except discord.PrivilegedIntentsRequired:
        raise ChatcoreError(
            "Discord refused the message content intent: switch on 'Message Content Intent' "
            "in the developer portal (Bot > Privileged Gateway Intents)"
        ) from None
    except (OSError, discord.GatewayNotFound) as error:  # aiohttp's connection errors are OSErrors
        raise ChatcoreError(f"cannot reach Discord: {type(error).__name__}: {error}") from None
    finally:
        await bot.shutdown()
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.remove_signal_handler(signum)
            except (NotImplementedError, RuntimeError):
                pass


def log_location(settings: "DiscordSettings") -> str:
    """Where the bot's conversation log is (its URL, password hidden), or "off"."""
    if not settings.log:
        return "off"
    from sqlalchemy.engine import make_url

    from chatcore.log.location import resolve_url

    return make_url(resolve_url(settings.db)).render_as_string(hide_password=True)


async def check(settings: "DiscordSettings", host: "PluginHost | None" = None) -> list[str]:
    """Load and check everything ``serve`` would, without connecting; a summary to show."""
    started = await start_bot(settings, host)
    try:
        catalog = started.bot.catalog
        lines = [
            f"model: {settings.model}",
            f"decoder: {settings.decoder}; steering: {', '.join(settings.steer) or 'none'}",
            f"format: {started.bot.prompt_format}; system prompt: "
            + (f"{len(settings.system):,} characters" if settings.system else "none"),
            "answers: DMs, mentions"
            + (f", channels {', '.join(map(str, settings.channels))}" if settings.channels else ""),
            "slash commands: " + (f"guilds {', '.join(map(str, settings.guilds))}" if settings.guilds else "global"),
            f"conversation log: {log_location(settings)}",
            f"batch: {settings.max_batch} {'reply' if settings.max_batch == 1 else 'replies'} at once, "
            f"{settings.queue_size} more may wait",
            "shards: "
            + (
                "one connection"
                if not settings.sharded
                else f"{', '.join(map(str, settings.shard_ids)) or 'all'} of "
                f"{settings.shard_count or 'as many as Discord recommends'}"
            ),
            f"decoders available: {', '.join(catalog['decoders'])}",
            f"steerers available: {', '.join(catalog['steerers'])}",
        ]
        return lines
    finally:
        await started.worker.stop(0)
