"""Settings of the Discord bot: a TOML or JSON file, overridden by command-line options.

The file holds the same keys as the options (``channels``, ``decoder``, ...), either at
the top level or under a ``[discord]`` table. Unknown keys and bad values are refused
with a message naming the key. The system prompt is ``system`` (the text) or
``system_file`` (a UTF-8 file, relative to the settings file); ``--system`` or
``--system-file`` on the command line replaces either. The bot token is never part of the settings: it comes
from ``DISCORD_TOKEN`` or a token file, so a settings file can be shared or committed.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    StringConstraints,
    field_validator,
    model_validator,
)

from chatcore.errors import ChatcoreError, OptionError
from chatcore.models import default_model_name, default_reply_budget
from chatcore.options import Settings, parse_settings
from chatcore.prompting import AUTO, clean_system_prompt, read_system_file

TOKEN_ENV = "DISCORD_TOKEN"
FILE_TABLE = "discord"
SYSTEM_KEYS = {"system", "system_file"}

logger = logging.getLogger("chatcore.discord")

Named = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]


def _snowflake(value: int) -> int:
    # Discord ids are positive 64-bit integers ("snowflakes").
    if not 0 < value < 2**64:
        raise ValueError(f"must list Discord ids (positive integers), got {value!r}")
    return value


Snowflake = Annotated[int, AfterValidator(_snowflake)]


class DiscordSettings(Settings):
    """Everything ``chatcore discord`` can be told, with defaults that are safe to deploy."""

    model: Named = Field(default_factory=default_model_name)
    """Bundled model name, smollm2, a GGUF file, local folder or hub id (default: smollm2 where installed)."""
    device: str | None = None
    """cpu, cuda, cuda:1 ... (default: cuda when present)."""
    threads: PositiveInt | None = None
    """CPU threads for inference (default: half the cores, at most 4; see chatcore.cpu)."""
    decoder: Named = "top-k"
    """Decoder spec, e.g. "top-k top_k=20 temperature=0.7"."""
    steer: tuple[Named, ...] = ()
    """Steerer specs applied to every conversation, in order."""
    system: str | None = None
    """The system prompt (persona) of every conversation; admins may override it per server and per channel (/chat
    system)."""
    prompt_format: Named = AUTO
    """How turns become the prompt: auto (the model's chat template if it has one, else dialogpt), chat-template,
    dialogpt, or a plugin's."""
    max_new_tokens: PositiveInt = 64
    """The longest reply, in tokens (not given: the model's own budget, as chat, generate and serve take it: 200 for
    smollm2; else this)."""
    min_new_tokens: NonNegativeInt = 1
    """Replies are at least this many tokens."""
    channels: tuple[Snowflake, ...] = ()
    """Channel or thread ids where every message is answered (a thread inside a listed channel counts too);
    elsewhere only DMs and mentions are answered."""
    guilds: tuple[Snowflake, ...] = ()
    """Guild ids to sync the slash commands to at start (instant); none: sync globally (can take up to an hour to
    appear)."""
    admin_roles: tuple[int | str, ...] = ()
    """Role ids or names that may change the decoder and steering in a guild, besides members with the Manage Server
    permission."""
    max_batch: PositiveInt = 8
    """Replies decoded together in one batch (the serving scheduler's batch size); channels beyond it wait in the
    queue."""
    queue_size: PositiveInt = 8
    """Replies waiting for a place in the batch; beyond it the bot says it is busy."""
    cooldown_s: NonNegativeFloat = 2.0
    """Seconds a user waits between two messages the bot answers."""
    shard_count: NonNegativeInt | None = None
    """Split the bot's gateway connection into this many shards (discord.py's ``AutoShardedClient``); none: one
    connection, or as many shards as Discord recommends when ``shard_ids`` is empty and ``shard_count`` is 0."""
    shard_ids: tuple[NonNegativeInt, ...] = ()
    """The shards this process runs (with ``shard_count``); several processes, each with its own ids, then share one
    bot, and ``db`` on PostgreSQL gives them one log. Empty: every shard."""
    reply_timeout_s: PositiveFloat = 120.0
    """A reply still generating after this long is cut short."""
    shutdown_grace_s: NonNegativeFloat = 10.0
    """On SIGTERM / Ctrl-C, how long the reply in flight may finish."""
    max_conversations: PositiveInt = 1000
    """Conversations kept in memory; older ones resume from the log."""
    locked_settings: tuple[str, ...] = ("file", "discriminator", "block", "reverse_model", "model", "path")
    """Decoder and steerer settings that name files or models on the bot's machine: /chat decoder and /chat steer
    refuse them (as they refuse any value that looks like a path); the settings file may still use them."""
    log: bool = True
    """Log conversations (resumed after a restart); false keeps them in memory only."""
    db: Named | None = None
    """The conversation log's database: an SQLAlchemy URL or an SQLite file path (default: ``$CHATCORE_DB`` or the
    user data folder)."""

    @model_validator(mode="before")
    @classmethod
    def _model_reply_budget(cls, values: Any) -> Any:
        """``max_new_tokens`` not given: the model's own reply budget (:func:`~chatcore.models.default_reply_budget`),
        else the field's default; one given always wins."""
        if not isinstance(values, Mapping) or "max_new_tokens" in values:
            return values
        model = values.get("model")
        name = model.strip() if isinstance(model, str) and model.strip() else default_model_name()
        fallback = cls.model_fields["max_new_tokens"].default
        return {**values, "max_new_tokens": default_reply_budget(name, fallback)}

    @field_validator("system")
    @classmethod
    def _clean_system(cls, system: str | None) -> str | None:
        try:
            return clean_system_prompt(system)
        except ChatcoreError as error:
            raise ValueError(f"`system`: {error}") from None

    @field_validator("admin_roles")
    @classmethod
    def _roles(cls, roles: tuple[int | str, ...]) -> tuple[int | str, ...]:
        for role in roles:
            if not (isinstance(role, int) and role > 0 or isinstance(role, str) and role.strip()):
                raise ValueError(f"`admin_roles` must list role ids or names, got {role!r}")
        return roles

    @model_validator(mode="after")
    def _check_together(self) -> DiscordSettings:
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"`min_new_tokens` must be an integer between 0 and max_new_tokens ({self.max_new_tokens}), "
                f"got {self.min_new_tokens!r}"
            )
        if not self.shard_ids:
            return self
        if self.shard_count is None:
            raise ValueError("`shard_ids` needs `shard_count`: how many shards the bot has in all")
        if self.shard_count == 0:
            raise ValueError(
                "`shard_ids` needs a fixed `shard_count`: with `shard_count` 0 Discord chooses the count "
                "and this process runs every shard; give the count to pick shards"
            )
        for shard_id in self.shard_ids:
            if shard_id >= self.shard_count:
                raise ValueError(
                    f"`shard_ids` must be shard numbers from 0 to {self.shard_count - 1}, got {shard_id!r}"
                )
        if len(set(self.shard_ids)) != len(self.shard_ids):
            raise ValueError(f"`shard_ids` lists a shard twice: {list(self.shard_ids)}")
        return self

    @property
    def sharded(self) -> bool:
        return self.shard_count is not None

    def refused_setting(self, settings: Mapping[str, Any]) -> str | None:
        """Why a decoder or steerer setting given from Discord is refused, if it is.

        Only the bot's operator may point the bot at files and models on its machine;
        a guild's managers may not (they could make it read any file or fetch any model)."""
        for key, value in settings.items():
            if key.replace("-", "_") in self.locked_settings:
                return f"`{key}` names a file or model on the bot's machine; only the bot's settings file may set it"
            text = str(value)
            if "/" in text or "\\" in text or text.startswith("~"):
                return f"`{key}` looks like a file path; paths can only be set in the bot's settings file"
        return None

    def is_admin_role(self, role_id: int, role_name: str) -> bool:
        wanted = {str(role).strip() for role in self.admin_roles}
        return str(role_id) in wanted or role_name in wanted


def read_settings_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The raw key/values of a ``.toml`` or ``.json`` settings file."""
    path = Path(path)
    if not path.is_file():
        raise ChatcoreError(f"no such settings file: {str(path)!r}")
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            import tomllib

            with path.open("rb") as handle:
                raw: Any = tomllib.load(handle)
        elif suffix == ".json":
            raw = json.loads(path.read_text(encoding="utf-8"))
        else:
            raise ChatcoreError(f"settings file {str(path)!r}: expected a .toml or .json file")
    except (ValueError, UnicodeDecodeError) as error:  # TOMLDecodeError and JSONDecodeError are ValueErrors
        raise ChatcoreError(f"settings file {str(path)!r} is not valid {suffix[1:].upper()}: {error}") from None
    if not isinstance(raw, dict):
        raise ChatcoreError(f"settings file {str(path)!r}: expected a table of settings at the top level")
    table = raw.get(FILE_TABLE)
    if "token" in raw or (isinstance(table, dict) and "token" in table):
        raise ChatcoreError(
            f"settings file {str(path)!r} holds a token: keep it out of settings files; use {TOKEN_ENV} or --token-file"
        )
    if isinstance(table, dict):
        # Beside the table, a key would be read by nobody: the bot would run without it, unnoticed.
        outside = sorted(key for key in raw if key != FILE_TABLE)
        if outside:
            named = ", ".join(repr(key) for key in outside)
            under, kind = (f"[{FILE_TABLE}]", "table") if suffix == ".toml" else (f'"{FILE_TABLE}"', "object")
            raise ChatcoreError(
                f"settings file {str(path)!r} has keys outside its {under} {kind}: {named}; move them under {under}"
            )
        raw = table
    return dict(raw)


def load_settings(
    path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None
) -> DiscordSettings:
    """Settings from ``path`` (if given) with ``overrides`` (command-line options) on top.

    Overrides whose value is ``None`` or an empty tuple mean "not given" and leave the
    file's value in place. A system prompt given as an override (``system`` or
    ``system_file``) replaces the file's, whichever key the file used.
    """
    values: dict[str, Any] = read_settings_file(path) if path is not None else {}
    given = {key: value for key, value in (overrides or {}).items() if value is not None and value != ()}
    if SYSTEM_KEYS & set(given):
        for key in SYSTEM_KEYS:
            values.pop(key, None)
    elif path is not None and isinstance(values.get("system_file"), str):
        values["system_file"] = str(Path(path).parent / values["system_file"])
    values.update(given)
    where = f"settings file {str(path)!r}" if path is not None else "the discord settings"
    if "system_file" in values:
        system_file = values.pop("system_file")
        if "system" in values:
            raise OptionError(f"give system or system_file, not both, in {where}")
        if not isinstance(system_file, str) or not system_file.strip():
            raise OptionError(f"`system_file` must be a file path, got {system_file!r} in {where}")
        values["system"] = read_system_file(system_file)
    try:
        return parse_settings(DiscordSettings, values, owner=where)
    except OptionError:
        raise
    except (TypeError, ValueError) as error:
        raise OptionError(f"{error} in {where}") from None


def read_token(token_file: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The bot token from ``token_file``, else ``$DISCORD_TOKEN``.

    The token never appears in a message: errors describe where it was looked for and
    what is wrong with it, not its value.
    """
    environ = os.environ if environ is None else environ
    if token_file is not None:
        path = Path(token_file)
        try:
            mode = path.stat().st_mode
            token = path.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            raise ChatcoreError(f"no such token file: {str(path)!r}") from None
        except (OSError, UnicodeDecodeError) as error:
            raise ChatcoreError(f"cannot read the token file {str(path)!r}: {type(error).__name__}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("the token file %s can be read by other users; chmod 600 it", path)
        source = f"the token file {str(path)!r}"
    else:
        token = environ.get(TOKEN_ENV, "").strip()
        source = f"${TOKEN_ENV}"
        if not token:
            raise ChatcoreError(f"no bot token: set {TOKEN_ENV} or pass --token-file PATH")
    if not token:
        raise ChatcoreError(f"{source} is empty")
    if any(char.isspace() for char in token) or not token.isprintable():
        raise ChatcoreError(f"{source} does not hold a bot token (it contains spaces or control characters)")
    return token
