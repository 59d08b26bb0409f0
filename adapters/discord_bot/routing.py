"""Which messages the bot answers, in which conversation, and how text crosses over.

- :func:`answer_reason`: DMs, messages that mention the bot, and messages in listed
  channels (or threads of listed channels); never bots (the bot itself included),
  webhooks or system messages.
- :func:`conversation_key`: one conversation per channel, thread or DM, keyed
  ``guild/channel/thread`` (``@me`` for DMs, ``-`` when there is no thread), like the
  paths of Discord's own links; :func:`channel_of` and :func:`guild_of` read it back.
- :func:`incoming_text`: the message as the model should read it: the bot's own
  mention removed, other mentions and custom emoji as plain names.
- :func:`split_reply`: a reply cut into Discord-sized messages at line or word breaks.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Protocol

import discord

MESSAGE_LIMIT = 2000  # Discord's limit on one message's content

USER_MENTION = re.compile(r"<@!?(\d+)>")
ROLE_MENTION = re.compile(r"<@&(\d+)>")
CHANNEL_MENTION = re.compile(r"<#(\d+)>")
CUSTOM_EMOJI = re.compile(r"<a?:(\w+):\d+>")

ANSWERED_TYPES = (discord.MessageType.default, discord.MessageType.reply)


class Channel(Protocol):
    """What :func:`conversation_key` reads of a channel: its id (and ``guild``, None in DMs, if it has one)."""

    @property
    def id(self) -> int: ...


def conversation_key(channel: Channel) -> str:
    guild = getattr(channel, "guild", None)
    channel_id = channel.id
    if guild is None:
        return f"@me/{channel_id}/-"
    if isinstance(channel, discord.Thread):
        return f"{guild.id}/{channel.parent_id}/{channel_id}"
    return f"{guild.id}/{channel_id}/-"


def channel_of(key: str) -> str:
    """The key of the channel a conversation key is in (a thread's parent; else the key itself)."""
    guild, channel, _ = key.split("/")
    return f"{guild}/{channel}/-"


def guild_of(key: str) -> int | None:
    """The guild id of a conversation key; None for a DM."""
    guild = key.split("/")[0]
    return None if guild == "@me" else int(guild)


def _mentions_bot(message: discord.Message, bot_id: int) -> bool:
    if any(user.id == bot_id for user in message.mentions):
        return True
    # "@BotName" typed in a guild can resolve to the bot's own managed role.
    self_role = message.guild.self_role if message.guild is not None else None
    return self_role is not None and any(role.id == self_role.id for role in message.role_mentions)


def answer_reason(message: discord.Message, bot_id: int, channels: Collection[int]) -> str | None:
    """ "dm", "mention" or "channel" when the bot should answer ``message``; else None."""
    if message.author.bot or message.author.system or message.author.id == bot_id:
        return None
    if message.webhook_id is not None:  # bridges and integrations: answering them can loop
        return None
    if message.type not in ANSWERED_TYPES:  # joins, pins, thread starters ...
        return None
    if message.guild is None:
        return "dm"
    if _mentions_bot(message, bot_id):
        return "mention"
    channel = message.channel
    if channel.id in channels:
        return "channel"
    if isinstance(channel, discord.Thread) and channel.parent_id in channels:
        return "channel"
    return None


def incoming_text(message: discord.Message, bot_id: int) -> str:
    """The message's text for the model (may be empty: only a mention, or only an image)."""
    users = {user.id: getattr(user, "display_name", user.name) for user in message.mentions}
    roles = {role.id: role.name for role in message.role_mentions}
    self_role = message.guild.self_role if message.guild is not None else None
    guild = message.guild

    def user(match: re.Match[str]) -> str:
        user_id = int(match.group(1))
        if user_id == bot_id:
            return " "
        return f"@{users[user_id]}" if user_id in users else "@someone"

    def role(match: re.Match[str]) -> str:
        role_id = int(match.group(1))
        if self_role is not None and role_id == self_role.id:
            return " "
        return f"@{roles[role_id]}" if role_id in roles else "@some-role"

    def channel(match: re.Match[str]) -> str:
        found = guild.get_channel_or_thread(int(match.group(1))) if guild is not None else None
        return f"#{found.name}" if found is not None else "#channel"

    text = USER_MENTION.sub(user, message.content or "")
    text = ROLE_MENTION.sub(role, text)
    text = CHANNEL_MENTION.sub(channel, text)
    text = CUSTOM_EMOJI.sub(lambda match: f":{match.group(1)}:", text)
    return " ".join(text.split())


def _length(text: str) -> int:
    # Discord counts UTF-16 code units: an emoji outside the BMP counts twice.
    return len(text.encode("utf-16-le")) // 2


def split_reply(text: str, limit: int = MESSAGE_LIMIT) -> list[str]:
    """``text`` in pieces of at most ``limit`` characters, none empty, cut at a line
    break, else a space, else anywhere; a text of only whitespace gives no pieces."""
    if limit < 2:
        raise ValueError(f"`limit` must be at least 2, got {limit}")
    pieces: list[str] = []
    rest = text.strip()
    while rest:
        if _length(rest) <= limit:
            pieces.append(rest)
            break
        window = rest[:limit]
        while _length(window) > limit:
            # Each character is 1 or 2 units: dropping half the excess (rounded up) in
            # characters never cuts far below the limit.
            window = window[: len(window) - (_length(window) - limit + 1) // 2]
        cut = window.rfind("\n")
        if cut < len(window) // 2:  # a line break too early would leave a stub message
            cut = window.rfind(" ")
        if cut < len(window) // 2:
            cut = len(window)
        piece = rest[:cut].rstrip()
        if piece:
            pieces.append(piece)
        rest = rest[cut:].lstrip()
    return pieces
