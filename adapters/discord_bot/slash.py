"""``/chat reset | decoder | steer | system | settings | why``: the bot's slash commands.

Each command acts on the conversation of the channel, thread or DM it is used in;
``/chat system set | clear | default`` act on the channel or, with ``scope: server``,
on the whole server (see :mod:`chatcore.adapters.discord_bot.system_prompts`).
Changing anything in a guild (reset, decoder, steering, system prompt) needs the
Manage Server permission or one of the configured ``admin_roles``; in a DM the
conversation is the user's own, so everyone may change theirs. Commands that need the engine run on the
inference worker, ahead of waiting replies; when one is not done within
:data:`DEFER_AFTER_S` (the worker is finishing a reply), the interaction is deferred
and the answer comes as a follow-up, since Discord drops interactions left
unanswered for three seconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import discord
from discord import app_commands

from chatcore.adapters.discord_bot.routing import MESSAGE_LIMIT, conversation_key, split_reply
from chatcore.adapters.discord_bot.worker import WorkerBusy, WorkerClosed
from chatcore.cli.specs import parse_spec, with_steerer
from chatcore.errors import ChatcoreError
from chatcore.prompting import clean_system_prompt

# Relative, so that mypy (which checks this package from its source folder, adapters/) knows
# the choices: discord.py reads them from the annotation to offer them, and a scope typed
# Any makes the command decorator's signature ambiguous.
from .system_prompts import Scope

if TYPE_CHECKING:
    from chatcore.adapters.discord_bot.bot import ChannelSetup, ChatBot
    from chatcore.adapters.discord_bot.conversations import ChatRuntime
    from chatcore.adapters.discord_bot.worker import JobControl

T = TypeVar("T")

DEFER_AFTER_S = 2.0
NO_MENTIONS = discord.AllowedMentions.none()


def describe_spec(name: str, settings: dict[str, Any]) -> str:
    return " ".join([name, *(f"{key}={value}" for key, value in settings.items())])


def format_provenance(provenance: dict[str, Any]) -> str:
    """The "why" of one reply, short enough for one message."""
    from chatcore.explain import explain

    text = "\n".join(explain(provenance, every_candidate=False))
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 1] + "…"


SCOPE_NAMES = {"channel": "this channel", "server": "this server"}
SOURCE_NAMES = {"channel": "set for this channel", "server": "set for this server", "bot": "the bot's default"}


def quote(text: str) -> str:
    """Text as a Discord block quote (every line after ``>>>``), markdown and all."""
    return ">>> " + text


def describe_system(text: str | None, source: str) -> str:
    if text is None:
        return f"No system prompt here ({SOURCE_NAMES[source]})."
    return f"System prompt here ({SOURCE_NAMES[source]}):\n{quote(text)}"


class ChatCommands:
    """The handlers behind the ``/chat`` group; ``group`` is what the command tree holds."""

    def __init__(self, bot: "ChatBot") -> None:
        self.bot = bot
        self.group = self._build_group()

    # -- the command group --------------------------------------------------------
    def _build_group(self) -> app_commands.Group:
        group = app_commands.Group(name="chat", description="The conversation with the bot in this channel")
        handlers = self

        @group.command(name="reset", description="Start a new conversation in this channel")
        async def reset(interaction: discord.Interaction) -> None:
            await handlers.reset(interaction)

        @group.command(name="decoder", description="Change how replies are chosen in this channel")
        @app_commands.describe(spec="a decoder and its settings, e.g. top-k top_k=20 temperature=0.7")
        async def decoder(interaction: discord.Interaction, spec: str) -> None:
            await handlers.decoder(interaction, spec)

        @group.command(name="steer", description="Add steering in this channel, or 'off' to remove it")
        @app_commands.describe(spec="a steerer and its settings, e.g. bow-bias topic=food strength=4; or off")
        async def steer(interaction: discord.Interaction, spec: str) -> None:
            await handlers.steer(interaction, spec)

        system = app_commands.Group(
            name="system", description="The system prompt (persona) replies here use", parent=group
        )

        @system.command(name="show", description="Show the system prompt replies in this channel use")
        async def system_show(interaction: discord.Interaction) -> None:
            await handlers.system_show(interaction)

        @system.command(name="set", description="Set the system prompt of this channel (or of the whole server)")
        @app_commands.describe(
            text="the system prompt, e.g. You are a cheerful pirate who loves puns.",
            scope="this channel (the default) or the whole server",
        )
        async def system_set(interaction: discord.Interaction, text: str, scope: Scope = "channel") -> None:
            await handlers.system_set(interaction, text, scope)

        @system.command(name="clear", description="No system prompt in this channel (or server), whatever the default")
        @app_commands.describe(scope="this channel (the default) or the whole server")
        async def system_clear(interaction: discord.Interaction, scope: Scope = "channel") -> None:
            await handlers.system_set(interaction, None, scope)

        @system.command(
            name="default", description="Drop this channel's (or server's) own system prompt: the next level's applies"
        )
        @app_commands.describe(scope="this channel (the default) or the whole server")
        async def system_default(interaction: discord.Interaction, scope: Scope = "channel") -> None:
            await handlers.system_default(interaction, scope)

        @group.command(name="settings", description="Show the settings this channel's conversation uses")
        async def settings(interaction: discord.Interaction) -> None:
            await handlers.settings(interaction)

        @group.command(name="why", description="Show how the last reply in this channel was made")
        async def why(interaction: discord.Interaction) -> None:
            await handlers.why(interaction)

        @decoder.autocomplete("spec")
        async def decoder_names(interaction: discord.Interaction, current: str) -> list[app_commands.Choice[str]]:
            return handlers.complete("decoders", current)

        @steer.autocomplete("spec")
        async def steerer_names(interaction: discord.Interaction, current: str) -> list[app_commands.Choice[str]]:
            choices = handlers.complete("steerers", current)
            if "off".startswith(current.strip()):
                choices.append(app_commands.Choice(name="off", value="off"))
            return choices

        return group

    def complete(self, kind: str, current: str) -> list[app_commands.Choice[str]]:
        typed = current.strip()
        if " " in typed:  # settings are being typed after the name: leave them alone
            return []
        return [
            app_commands.Choice(name=name, value=name)
            for name in self.bot.catalog.get(kind, [])
            if name.startswith(typed)
        ][:25]

    # -- permission ---------------------------------------------------------------
    def may_change(self, interaction: discord.Interaction) -> bool:
        """Manage Server or a configured role in a guild; anyone in their own DM."""
        if interaction.guild is None:
            return True
        user = interaction.user
        permissions = getattr(user, "guild_permissions", None)
        if permissions is None:  # a user Discord sent without member data
            permissions = getattr(interaction, "permissions", None)
        if permissions is not None and permissions.manage_guild:  # administrators have it too
            return True
        return any(self.bot.settings.is_admin_role(role.id, role.name) for role in getattr(user, "roles", ()))

    async def _refuse(self, interaction: discord.Interaction, what: str) -> None:
        await respond(
            interaction,
            f"Only members with the Manage Server permission or a bot admin role can {what} here.",
            ephemeral=True,
        )

    # -- handlers -----------------------------------------------------------------
    async def reset(self, interaction: discord.Interaction) -> None:
        if not self.may_change(interaction):
            await self._refuse(interaction, "reset the conversation")
            return
        key = conversation_key(interaction.channel)

        def job(runtime: "ChatRuntime", control: "JobControl") -> str:
            return runtime.reset(key).id

        ok, _ = await self._run(interaction, job, ephemeral=False)
        if ok:
            self.bot.last_provenance.pop(key, None)
            await respond(interaction, "Started a new conversation here; earlier messages are forgotten.")

    async def _checked_setup(
        self, interaction: discord.Interaction, key: str, spec: str, kind: str
    ) -> tuple["ChannelSetup", str, dict[str, Any]] | None:
        """The conversation's setup with a decoder or steerer spec applied, once the spec
        parses, names nothing on the bot's machine, and the whole resulting setup (each
        steerer with the others) could make a reply (checked on the worker, without
        decoding); with the spec's name and settings. None once the user has been told why not."""
        try:
            name, settings = parse_spec(spec)
        except ChatcoreError as error:
            await respond(interaction, f"Cannot use that: {error}", ephemeral=True)
            return None
        refused = self.bot.settings.refused_setting(settings)
        if refused is not None:
            await respond(interaction, f"Cannot use that: {refused}", ephemeral=True)
            return None
        setup = self.bot.setup_for(key).copy()
        if kind == "decoder":
            setup.decoder, setup.decoder_settings = name, dict(settings)
        else:
            setup.steerers = with_steerer(setup.steerers, name, settings)
        options = self.bot.options_of(setup)

        def job(runtime: "ChatRuntime", control: "JobControl") -> None:
            runtime.check_options(options)

        ok, _ = await self._run(interaction, job, ephemeral=False)
        return (setup, name, settings) if ok else None

    async def decoder(self, interaction: discord.Interaction, spec: str) -> None:
        if not self.may_change(interaction):
            await self._refuse(interaction, "change the decoder")
            return
        key = conversation_key(interaction.channel)
        checked = await self._checked_setup(interaction, key, spec, "decoder")
        if checked is not None:
            setup, name, settings = checked
            self.bot.setups[key] = setup
            await respond(interaction, f"Decoder in this channel: `{describe_spec(name, settings)}`")

    async def steer(self, interaction: discord.Interaction, spec: str) -> None:
        if not self.may_change(interaction):
            await self._refuse(interaction, "change the steering")
            return
        key = conversation_key(interaction.channel)
        if spec.strip().lower() == "off":
            self._own_setup(key).steerers = []
            await respond(interaction, "Steering in this channel: off")
            return
        checked = await self._checked_setup(interaction, key, spec, "steerer")
        if checked is not None:
            setup, _, _ = checked
            self.bot.setups[key] = setup
            listed = ", ".join(f"`{describe_spec(n, s)}`" for n, s in setup.steerers)
            await respond(interaction, f"Steering in this channel: {listed}")

    async def system_show(self, interaction: discord.Interaction) -> None:
        text, source = self.bot.system_prompts.effective(conversation_key(interaction.channel))
        await respond(interaction, describe_system(text, source), ephemeral=True)

    async def _may_change_system(self, interaction: discord.Interaction, scope: Scope) -> bool:
        """Whether this person may change the system prompt of ``scope`` here (they are told why not)."""
        if not self.may_change(interaction):
            await self._refuse(interaction, "change the system prompt")
            return False
        return await self._scope_exists(interaction, scope)

    async def system_set(self, interaction: discord.Interaction, text: str | None, scope: Scope) -> None:
        """Set (``text``) or clear (None) the system prompt of this channel or server."""
        if not await self._may_change_system(interaction, scope):
            return
        key = conversation_key(interaction.channel)
        try:
            cleaned = clean_system_prompt(text)
        except ChatcoreError as error:
            await respond(interaction, f"Cannot use that: {error}", ephemeral=True)
            return
        max_new_tokens = self.bot.settings.max_new_tokens

        def job(runtime: "ChatRuntime", control: "JobControl") -> None:
            runtime.check_system(cleaned, max_new_tokens)  # it must leave room for a message and a reply

        ok, _ = await self._run(interaction, job, ephemeral=False)
        if ok:
            self.bot.system_prompts.override(key, scope, cleaned)
            where = SCOPE_NAMES[scope]
            if cleaned is None:
                await respond(interaction, f"No system prompt in {where} from the next reply on.")
            else:
                await respond(interaction, f"System prompt in {where} from the next reply on:\n{quote(cleaned)}")

    async def system_default(self, interaction: discord.Interaction, scope: Scope) -> None:
        if not await self._may_change_system(interaction, scope):
            return
        key = conversation_key(interaction.channel)
        if not self.bot.system_prompts.drop_override(key, scope):
            await respond(
                interaction, f"There is no system prompt set for {SCOPE_NAMES[scope]} to drop.", ephemeral=True
            )
            return
        text, source = self.bot.system_prompts.effective(key)
        await respond(
            interaction, f"Dropped the system prompt of {SCOPE_NAMES[scope]}. " + describe_system(text, source)
        )

    async def _scope_exists(self, interaction: discord.Interaction, scope: Scope) -> bool:
        if scope == "server" and interaction.guild is None:
            await respond(interaction, "There is no server in a direct message: use the channel scope.", ephemeral=True)
            return False
        return True

    async def settings(self, interaction: discord.Interaction) -> None:
        bot = self.bot
        key = conversation_key(interaction.channel)
        setup = bot.setup_for(key)
        steering = ", ".join(describe_spec(n, s) for n, s in setup.steerers) or "none"
        channel = interaction.channel
        listed = {getattr(channel, "id", None), getattr(channel, "parent_id", None)} & set(bot.settings.channels)
        where = "every message" if listed or interaction.guild is None else "mentions"
        system, source = bot.system_prompts.effective(key)
        system_line = "none" if system is None else repr(system if len(system) <= 80 else system[:79] + "…")
        lines = [
            f"decoder: {describe_spec(setup.decoder, setup.decoder_settings)}",
            f"steering: {steering}",
            f"system prompt: {system_line} ({SOURCE_NAMES[source]}); format: {bot.prompt_format}",
            f"replies: up to {bot.settings.max_new_tokens} tokens; answers {where} here",
            f"cooldown: {bot.settings.cooldown_s:g} s per user",
            f"replies in progress: {len(bot.in_flight)} (batch of {bot.settings.max_batch}, "
            f"queue of {bot.settings.queue_size})",
            f"conversation log: {'on' if bot.settings.log else 'off'} (key {key})",
        ]
        await respond(interaction, "\n".join(lines), ephemeral=True)

    async def why(self, interaction: discord.Interaction) -> None:
        key = conversation_key(interaction.channel)
        provenance = self.bot.last_provenance.get(key)
        if provenance is None:

            def job(runtime: "ChatRuntime", control: "JobControl") -> dict[str, Any] | None:
                return runtime.last_provenance(key)

            ok, provenance = await self._run(interaction, job, ephemeral=True)
            if not ok:
                return
        if not provenance:
            await respond(interaction, "There is no reply in this channel's conversation yet.", ephemeral=True)
            return
        await respond(interaction, format_provenance(provenance), ephemeral=True)

    # -- helpers ------------------------------------------------------------------
    def _own_setup(self, key: str) -> "ChannelSetup":
        if key not in self.bot.setups:
            self.bot.setups[key] = self.bot.default_setup.copy()
        return self.bot.setups[key]

    async def _run(
        self, interaction: discord.Interaction, job: Callable[["ChatRuntime", "JobControl"], T], ephemeral: bool
    ) -> tuple[bool, T | None]:
        """Run ``job`` on the worker; defer the interaction if it is slow. (ok, result)."""
        try:
            future = self.bot.worker.submit(job, control=True)
        except (WorkerBusy, WorkerClosed) as error:
            await respond(interaction, f"Not now: {error}.", ephemeral=True)
            return False, None
        done, _ = await asyncio.wait({future}, timeout=DEFER_AFTER_S)
        if not done and not interaction.response.is_done():
            await interaction.response.defer(ephemeral=ephemeral, thinking=True)
        try:
            return True, await future
        except ChatcoreError as error:
            await respond(interaction, f"Cannot use that: {error}", ephemeral=True)
            return False, None


async def respond(interaction: discord.Interaction, text: str, ephemeral: bool = False) -> None:
    """Answer an interaction (or follow up a deferred one), split and without mentions."""
    pieces = split_reply(text) or ["(nothing to show)"]
    for piece in pieces:
        if interaction.response.is_done():
            await interaction.followup.send(piece, ephemeral=ephemeral, allowed_mentions=NO_MENTIONS)
        else:
            await interaction.response.send_message(piece, ephemeral=ephemeral, allowed_mentions=NO_MENTIONS)
