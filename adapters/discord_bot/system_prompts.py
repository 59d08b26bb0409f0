"""Which system prompt each conversation gets: the bot's, its server's, or its channel's.

The bot's settings give the default (``system``); admins override it for a whole
server or for one channel with ``/chat system``. A thread follows its channel unless
it has its own. An override may be "none": no system prompt there, whatever the bot's
default. Like the per-channel decoder and steering, overrides live in memory: after a
restart the settings' system prompt applies everywhere again (the conversation log
keeps the system prompt each conversation was started with).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from chatcore.adapters.discord_bot.routing import channel_of, guild_of

Scope = Literal["channel", "server"]
Source = Literal["channel", "server", "bot"]
_ABSENT = object()  # an override of None means "no system prompt": absence needs its own marker


@dataclass
class SystemPrompts:
    """The default system prompt and the overrides per server (guild id) and per channel (conversation key)."""

    default: str | None = None
    servers: dict[int, str | None] = field(default_factory=dict)
    channels: dict[str, str | None] = field(default_factory=dict)

    def effective(self, key: str) -> tuple[str | None, Source]:
        """The system prompt of conversation ``key`` and where it is set."""
        for channel_key in (key, channel_of(key)):
            if channel_key in self.channels:
                return self.channels[channel_key], "channel"
        guild = guild_of(key)
        if guild is not None and guild in self.servers:
            return self.servers[guild], "server"
        return self.default, "bot"

    def override(self, key: str, scope: Scope, text: str | None) -> None:
        """Set ``key``'s channel (or its server's) system prompt; None: no system prompt there."""
        if scope == "server":
            self.servers[self._guild(key)] = text
        else:
            self.channels[key] = text

    def drop_override(self, key: str, scope: Scope) -> bool:
        """Forget the channel's (or server's) own system prompt; False if it had none."""
        if scope == "server":
            return self.servers.pop(self._guild(key), _ABSENT) is not _ABSENT
        return self.channels.pop(key, _ABSENT) is not _ABSENT

    @staticmethod
    def _guild(key: str) -> int:
        guild = guild_of(key)
        if guild is None:
            raise ValueError(f"conversation {key!r} is not in a server")
        return guild
