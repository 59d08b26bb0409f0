"""The Discord adapter: message flows on dpytest's fake gateway, slash-command handlers,
the inference worker, the conversation log across a restart, and the settings.

Replies come from the tiny fixture model through the real engine (its text is
gibberish, so tests check where and how replies go, never what they say), or from
``fixed-text``, a test decoder registered like any plugin that yields the token ids
of a given text: the way to make the model "say" ``@everyone``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio

discord = pytest.importorskip("discord")
dpytest = pytest.importorskip("discord.ext.test")

from discord_harness import (  # noqa: E402
    Harness,
    answers,
    interaction,
    make_manager,
    slash,
    start_harness,
)
from fixed_text import MASS_PING, FixedTextPlugin  # noqa: E402

import chatcore  # noqa: E402
from chatcore.adapters.discord_bot import bot as bot_module  # noqa: E402
from chatcore.adapters.discord_bot.bot import ChatBot, Cooldown  # noqa: E402
from chatcore.adapters.discord_bot.config import DiscordSettings, load_settings, read_token  # noqa: E402
from chatcore.adapters.discord_bot.conversations import ChatRuntime  # noqa: E402
from chatcore.adapters.discord_bot.persistence import LogPersistence  # noqa: E402
from chatcore.adapters.discord_bot.routing import conversation_key, split_reply  # noqa: E402
from chatcore.adapters.discord_bot.worker import InferenceWorker, WorkerBusy, WorkerClosed  # noqa: E402
from chatcore.decoding import GenerationSession  # noqa: E402
from chatcore.errors import ChatcoreError  # noqa: E402
from chatcore.testing import ScriptedDecoder  # noqa: E402
from chatcore.text import encode_text  # noqa: E402

backend = dpytest.backend
factories = dpytest.factories


def settings_for(**changes: Any) -> DiscordSettings:
    base = dict(cooldown_s=0, max_new_tokens=12, log=False, shutdown_grace_s=5)
    base.update(changes)
    return DiscordSettings(**base)


@pytest_asyncio.fixture
async def harness(chat_engine):
    started = await start_harness(chat_engine, settings_for())
    yield started
    await started.close()


def assert_pings_no_one(payloads: list[tuple[int, dict[str, Any]]]) -> None:
    assert payloads
    for _, payload in payloads:
        allowed = payload["allowed_mentions"]
        assert allowed["parse"] == []
        assert not allowed.get("users") and not allowed.get("roles")
        assert allowed.get("replied_user", False) is False


# -- where the bot answers -----------------------------------------------------------
@pytest.mark.asyncio
async def test_a_dm_gets_one_reply_in_the_dm_typing_meanwhile(harness: Harness):
    member = harness.member(0)
    dm = await member.create_dm()
    typing_in: list[int] = []

    async def typing(channel: Any) -> None:
        typing_in.append(channel.id)

    dpytest.callbacks.set_callback(typing, "send_typing")
    try:
        sent = await harness.say("hi there, how are you?", dm, member)
    finally:
        dpytest.callbacks.remove_callback("send_typing")
    assert typing_in == [dm.id]
    assert len(sent) == 1
    assert sent[0].channel.id == dm.id
    assert sent[0].content.strip()
    assert harness.bot.stats.replies == 1
    assert_pings_no_one(harness.payloads)


@pytest.mark.asyncio
async def test_a_mention_is_answered_and_other_messages_are_not(harness: Harness):
    channel, member = harness.channel(0), harness.member(0)
    assert await harness.say("just chatting with friends", channel, member) == []
    friend = harness.member(1)
    sent = await harness.say(f"<@{harness.bot.user.id}> what do you think of <@{friend.id}>?", channel, member)
    assert len(sent) == 1 and sent[0].channel.id == channel.id
    # The model reads no mention markup: the bot's own is dropped, others become names.
    key = conversation_key(channel)
    turns = await harness.on_worker(lambda runtime: [t.text for t in runtime.conversation(key).turns])
    assert turns[0] == f"what do you think of @{friend.display_name}?"


@pytest.mark.asyncio
async def test_a_listed_channel_gets_every_message_answered(harness: Harness):
    listed, other, member = harness.channel(0), harness.channel(1), harness.member(0)
    harness.listen_in(listed)
    for text in ("good morning", "what's for breakfast?"):
        sent = await harness.say(text, listed, member)
        assert len(sent) == 1 and sent[0].channel.id == listed.id
    assert await harness.say("good morning", other, member) == []


@pytest.mark.asyncio
async def test_bots_are_ignored_the_bot_itself_included(harness: Harness):
    channel = harness.channel(0)
    harness.listen_in(channel)
    robot_user = backend.make_user("OtherBot", "0042")
    robot_user.bot = True
    robot = backend.make_member(robot_user, harness.guild)
    assert await harness.say(f"<@{harness.bot.user.id}> hello bot", channel, robot) == []
    assert await harness.say("talking to myself", channel, harness.guild.me) == []
    assert harness.bot.stats.replies == 0 and harness.payloads == []


@pytest.mark.asyncio
async def test_each_channel_thread_and_dm_has_its_own_history(harness: Harness):
    first, second, member = harness.channel(0), harness.channel(1), harness.member(0)
    harness.listen_in(first, second)
    dm = await member.create_dm()
    await harness.say("apples are red", first, member)
    await harness.say("the sea is blue", second, member)
    await harness.say("apples are green too", first, member)
    await harness.say("secret plans", dm, member)

    def user_turns(runtime: ChatRuntime) -> dict[str, list[str]]:
        keys = [conversation_key(c) for c in (first, second, dm)]
        return {key: [t.text for t in runtime.conversation(key).turns if t.role == "user"] for key in keys}

    turns = await harness.on_worker(user_turns)
    assert turns[conversation_key(first)] == ["apples are red", "apples are green too"]
    assert turns[conversation_key(second)] == ["the sea is blue"]
    assert turns[conversation_key(dm)] == ["secret plans"]
    assert conversation_key(first) == f"{harness.guild.id}/{first.id}/-"
    assert conversation_key(dm) == f"@me/{dm.id}/-"


@pytest.mark.asyncio
async def test_a_long_conversation_keeps_only_the_newest_turns_that_fit(harness: Harness):
    member = harness.member(0)
    dm = await member.create_dm()
    for index in range(12):
        await harness.say(f"message number {index}: tell me more about the weather today", dm, member)
    provenance = harness.bot.last_provenance[conversation_key(dm)]
    # The fixture model has 128 positions, 12 of them kept for the reply.
    assert provenance["history_turns_dropped"] > 0
    assert provenance["prompt_tokens"] <= 128 - 12
    assert provenance["history_turns_used"] + provenance["history_turns_dropped"] == 23


# -- what the bot sends --------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_reply_saying_everyone_pings_no_one(chat_engine):
    harness = await start_harness(chat_engine, settings_for(decoder="fixed-text", max_new_tokens=100))
    try:
        channel, member = harness.channel(0), harness.member(0)
        # A user mention too (of a real member: dpytest resolves the mentions it is sent).
        harness.bot.default_setup.decoder_settings = {"text": f"{MASS_PING} <@{harness.member(1).id}>"}
        sent = await harness.say(f"<@{harness.bot.user.id}> say hi to everybody", channel, member)
        assert len(sent) == 1
        for ping in ("@everyone", "@here", "<@&123456789012345678>", f"<@{harness.member(1).id}>"):
            assert ping in sent[0].content
        ((_, payload),) = harness.payloads
        assert payload["content"] == sent[0].content
        assert payload["allowed_mentions"] == {"parse": [], "replied_user": False}
        dm = await member.create_dm()
        await harness.say("and here?", dm, member)
        assert_pings_no_one(harness.payloads)
        # And the client's default (dpytest swaps the connection state that holds it,
        # so a client that has not met dpytest shows it).
        fresh = ChatBot(settings_for(), harness.worker)
        default = fresh.allowed_mentions
        assert (default.everyone, default.users, default.roles, default.replied_user) == (False, False, False, False)
    finally:
        await harness.close()


@pytest.mark.asyncio
async def test_a_long_reply_is_split_into_discord_sized_messages(host, tmp_path):
    from chatcore.engine import Engine
    from chatcore.models import load_model
    from chatcore.testing import build_tiny_model

    # A model with room for a 6,000-character reply.
    long_context = load_model(str(build_tiny_model(tmp_path / "long", positions=4096)))
    assert host.register(FixedTextPlugin(), "fixed-text-test")
    harness = await start_harness(
        Engine(long_context, host=host),
        settings_for(decoder="fixed-text text='a rather long line. ' repeat=300", max_new_tokens=4000),
    )
    try:
        member = harness.member(0)
        dm = await member.create_dm()
        sent = await harness.say("tell me a long story", dm, member)
        assert len(sent) == 3  # 6,000 characters
        assert all(0 < len(m.content) <= 2000 for m in sent)
        assert " ".join(m.content for m in sent) == ("a rather long line. " * 300).strip()
        assert_pings_no_one(harness.payloads)
    finally:
        await harness.close()


@pytest.mark.asyncio
async def test_an_empty_reply_is_never_sent(chat_engine):
    harness = await start_harness(chat_engine, settings_for(decoder="fixed-text text=''"))
    try:
        member = harness.member(0)
        dm = await member.create_dm()
        sent = await harness.say("hello?", dm, member)
        assert [m.content for m in sent] == [bot_module.EMPTY_REPLY]
        # A mention with no text asks for some instead of sending nothing.
        sent = await harness.say(f"<@{harness.bot.user.id}>", harness.channel(0), member)
        assert [m.content for m in sent] == [bot_module.NEED_TEXT_REPLY]
    finally:
        await harness.close()


def make_thread(parent: discord.TextChannel, owner: discord.Member, name: str = "a thread") -> discord.Thread:
    """A public thread in ``parent`` (dpytest has no thread helper: feed the gateway event)."""
    thread_id = factories.make_id()
    backend.get_state().parse_thread_create(
        {
            "id": thread_id,
            "guild_id": parent.guild.id,
            "parent_id": parent.id,
            "type": 11,
            "name": name,
            "owner_id": owner.id,
            "message_count": 0,
            "member_count": 1,
            "rate_limit_per_user": 0,
            "thread_metadata": {
                "archived": False,
                "auto_archive_duration": 1440,
                "locked": False,
                "archive_timestamp": "2024-01-01T00:00:00+00:00",
            },
        }
    )
    thread = parent.guild.get_thread(thread_id)
    assert thread is not None
    return thread


async def thread_message(
    harness: Harness, thread: discord.Thread, member: discord.Member, content: str
) -> list[discord.Message]:
    data = factories.make_message_dict(thread, member, content=content, guild_id=thread.guild.id)
    backend.get_state().parse_message_create(data)
    await dpytest.run_all_events()
    return harness.drain()


@pytest.mark.asyncio
async def test_a_thread_of_a_listed_channel_is_its_own_conversation(harness: Harness):
    listed, member = harness.channel(0), harness.member(0)
    harness.listen_in(listed)
    thread = make_thread(listed, member)
    await harness.say("in the channel", listed, member)
    sent = await thread_message(harness, thread, member, "in the thread")
    assert len(sent) == 1
    assert [channel_id for channel_id, _ in harness.payloads] == [listed.id, thread.id]
    key = conversation_key(thread)
    assert key == f"{harness.guild.id}/{listed.id}/{thread.id}"
    turns = await harness.on_worker(lambda runtime: [t.text for t in runtime.conversation(key).turns])
    assert turns[0] == "in the thread" and "in the channel" not in turns


# -- the conversation log across a restart -----------------------------------------
@pytest.mark.asyncio
async def test_a_restart_resumes_each_channels_conversation_from_the_log(chat_engine, tmp_path):
    from chatcore.log.store import ConversationStore

    db = str(tmp_path / "log.sqlite3")
    first = await start_harness(chat_engine, settings_for(), lambda: LogPersistence(chat_engine, db))
    guild_id, channel_id = first.guild.id, first.channel(0).id
    first.listen_in(first.channel(0))
    await first.say("my name is ada", first.channel(0), first.member(0))
    await first.say("i like tea", first.channel(0), first.member(0))
    key = conversation_key(first.channel(0))
    await first.close()
    assert os.stat(db).st_mode & 0o777 == 0o600  # the log is private: created readable by its owner only

    with ConversationStore(f"sqlite:///{db}") as store:
        (summary,) = store.list_conversations(adapter="discord", channel_key=key)
        assert summary.message_count == 4

    # A new process: new client, worker and runtime; the same guild and channel ids.
    second = await start_harness(
        chat_engine, settings_for(channels=(channel_id,)), lambda: LogPersistence(chat_engine, db)
    )
    try:
        guild = backend.make_guild("Same guild", id_num=guild_id)
        channel = backend.make_text_channel("same-channel", guild, id_num=channel_id)
        backend.make_member(backend.get_state().user, guild)
        ada = backend.make_member(backend.make_user("Ada", "0007"), guild)
        sent = await second.say("what is my name?", channel, ada)
        assert len(sent) == 1 and sent[0].channel.id == channel_id
        conversation = await second.on_worker(lambda runtime: runtime.conversation(key))
        assert conversation.id == summary.id
        assert [t.text for t in conversation.turns if t.role == "user"] == [
            "my name is ada",
            "i like tea",
            "what is my name?",
        ]
        # The reply was made from the resumed history: 4 logged turns and the new one.
        assert second.bot.last_provenance[key]["history_turns_used"] == 5
    finally:
        await second.close()
    with ConversationStore(f"sqlite:///{db}") as store:
        assert store.get_conversation(summary.id).message_count == 6


def test_a_reset_survives_a_restart(chat_engine, tmp_path):
    db = str(tmp_path / "log.sqlite3")
    from chatcore.engine import ReplyOptions

    runtime = ChatRuntime(chat_engine, LogPersistence(chat_engine, db))
    runtime.reply("1/2/-", "hello there", ReplyOptions(max_new_tokens=8))
    old_id = runtime.conversation("1/2/-").id
    new_id = runtime.reset("1/2/-").id
    runtime.close()

    restarted = ChatRuntime(chat_engine, LogPersistence(chat_engine, db))
    try:
        resumed = restarted.conversation("1/2/-")
        assert resumed.id == new_id != old_id
        assert resumed.turns == []
    finally:
        restarted.close()


# -- slash commands -------------------------------------------------------------------
@pytest.mark.asyncio
async def test_the_chat_group_has_the_six_commands_and_completes_names(harness: Harness):
    group = harness.bot.tree.get_command("chat")
    assert sorted(c.name for c in group.commands) == ["decoder", "reset", "settings", "steer", "system", "why"]
    system = group.get_command("system")
    assert sorted(c.name for c in system.commands) == ["clear", "default", "set", "show"]
    # What Discord is sent: the scope is a choice of two, the text a required string.
    payload = group.to_dict(harness.bot.tree)
    (system_payload,) = [option for option in payload["options"] if option["name"] == "system"]
    (set_payload,) = [option for option in system_payload["options"] if option["name"] == "set"]
    assert [(o["name"], o["required"]) for o in set_payload["options"]] == [("text", True), ("scope", False)]
    assert [c["value"] for c in set_payload["options"][1]["choices"]] == ["channel", "server"]
    complete = harness.bot.chat_commands.complete
    assert [c.value for c in complete("decoders", "gr")] == ["greedy"]
    assert {c.value for c in complete("decoders", "")} >= {"greedy", "top-k", "fixed-text"}
    assert complete("decoders", "top-k top_k=") == []  # settings are free text


@pytest.mark.asyncio
async def test_reset_in_a_guild_needs_manage_server(harness: Harness):
    channel, plain = harness.channel(0), harness.member(0)
    harness.listen_in(channel)
    await harness.say("remember this", channel, plain)
    key = conversation_key(channel)
    before = await harness.on_worker(lambda runtime: runtime.conversation(key).id)
    assert not plain.guild_permissions.manage_guild

    refused = await slash(harness, "reset", plain, channel)
    assert "Manage Server" in answers(refused)[0] and refused.response.sent[0][1] is True  # ephemeral
    assert await harness.on_worker(lambda runtime: runtime.conversation(key).id) == before

    manager = await make_manager(harness, harness.member(1))
    done = await slash(harness, "reset", manager, channel)
    assert "new conversation" in answers(done)[0]
    conversation = await harness.on_worker(lambda runtime: runtime.conversation(key))
    assert conversation.id != before and conversation.turns == []


@pytest.mark.asyncio
async def test_a_configured_role_may_change_the_decoder(harness: Harness):
    channel = harness.channel(0)
    harness.bot.settings = harness.bot.settings.model_copy(update={"admin_roles": ("Moderators",)})
    moderator = await make_manager(harness, harness.member(0), permissions=0, name="Moderators")
    assert not moderator.guild_permissions.manage_guild
    fake = await slash(harness, "decoder", moderator, channel, spec="greedy")
    assert answers(fake) == ["Decoder in this channel: `greedy`"]
    others = await slash(harness, "decoder", harness.member(1), channel, spec="greedy")
    assert "Manage Server" in answers(others)[0]


@pytest.mark.asyncio
async def test_everyone_may_reset_their_dm(harness: Harness):
    member = harness.member(0)
    dm = await member.create_dm()
    await harness.say("a private chat", dm, member)
    key = conversation_key(dm)
    before = await harness.on_worker(lambda runtime: runtime.conversation(key).id)
    fake = await slash(harness, "reset", member, dm)
    assert "new conversation" in answers(fake)[0]
    assert await harness.on_worker(lambda runtime: runtime.conversation(key).id) != before


@pytest.mark.asyncio
async def test_decoder_and_steer_change_only_this_channels_replies(harness: Harness):
    first, second = harness.channel(0), harness.channel(1)
    harness.listen_in(first, second)
    manager = await make_manager(harness, harness.member(0))

    bad = await slash(harness, "decoder", manager, first, spec="no-such-decoder")
    assert "unknown decoder 'no-such-decoder'" in answers(bad)[0] and "greedy" in answers(bad)[0]
    bad = await slash(harness, "decoder", manager, first, spec="top-k top_k=0")
    assert "`top_k` must be a positive integer, got 0" in answers(bad)[0]
    # Guild managers are not the bot's operator: no files or models on its machine.
    bad = await slash(harness, "steer", manager, first, spec="bow-bias file=/etc/hostname")
    assert "`file` names a file or model on the bot's machine" in answers(bad)[0]
    bad = await slash(harness, "steer", manager, first, spec="bow-bias words=../secrets/list")
    assert "`words` looks like a file path" in answers(bad)[0]
    assert conversation_key(first) not in harness.bot.setups

    fine = await slash(harness, "decoder", manager, second, spec="top-k temperature=.5")
    assert answers(fine) == ["Decoder in this channel: `top-k temperature=.5`"]
    await slash(harness, "decoder", manager, second, spec="top-k")
    await slash(harness, "decoder", manager, first, spec="greedy no_repeat_ngram_size=2")
    steered = await slash(harness, "steer", manager, first, spec="bow-bias topic=food strength=3")
    assert answers(steered) == ["Steering in this channel: `bow-bias topic=food strength=3`"]

    await harness.say("what should we eat?", first, manager)
    await harness.say("what should we eat?", second, manager)
    made_here = harness.bot.last_provenance[conversation_key(first)]
    made_there = harness.bot.last_provenance[conversation_key(second)]
    assert made_here["decoder"] == {
        "name": "greedy",
        "settings": {
            "no_repeat_ngram_size": 2,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "logit_bias": {},
        },
    }
    assert [s["name"] for s in made_here["steerers"]] == ["bow-bias"]
    assert made_there["decoder"]["name"] == "top-k" and made_there["steerers"] == []

    off = await slash(harness, "steer", manager, first, spec="off")
    assert answers(off) == ["Steering in this channel: off"]
    assert harness.bot.setup_for(conversation_key(first)).steerers == []


@pytest.mark.asyncio
async def test_steer_and_decoder_refuse_configurations_that_cannot_reply(bundled_model, tmp_path):
    from refused_configurations import IMPOSSIBLE_STEERERS, NON_DECODABLE_DECODERS, PLUGIN_MODULES

    from chatcore.engine import Engine
    from chatcore.log.store import ConversationStore
    from chatcore.plugin_manager import PluginHost

    host = PluginHost()
    host.load_modules(PLUGIN_MODULES + ("chatcore.plugins.prompt_formats",))
    # The bundled model has a CoCon block, so `/chat steer cocon ...` alone is accepted.
    engine = Engine(bundled_model, host=host)
    db = str(tmp_path / "log.sqlite3")
    harness = await start_harness(engine, settings_for(), lambda: LogPersistence(engine, db))
    try:
        channel = harness.channel(0)
        key = conversation_key(channel)
        manager = await make_manager(harness, harness.member(0))
        for (first, second), line in IMPOSSIBLE_STEERERS:
            await slash(harness, "steer", manager, channel, spec="off")
            assert answers(await slash(harness, "steer", manager, channel, spec=first))[0].startswith("Steering")
            before = harness.bot.setup_for(key).copy()
            refused = await slash(harness, "steer", manager, channel, spec=second)
            assert answers(refused) == [f"Cannot use that: {line}"] and refused.response.sent[0][1] is True
            assert harness.bot.setup_for(key) == before  # the steering stays as it was
        for spec, line in NON_DECODABLE_DECODERS:
            refused = await slash(harness, "decoder", manager, channel, spec=spec)
            assert answers(refused) == [f"Cannot use that: {line}"]
            assert harness.bot.setup_for(key).decoder == "top-k"
    finally:
        await harness.close()
    with ConversationStore(f"sqlite:///{db}") as store:
        assert store.list_conversations() == []  # nothing was logged


@pytest.mark.asyncio
async def test_settings_and_why_describe_the_channel(harness: Harness):
    member = harness.member(0)
    dm = await member.create_dm()
    nothing = await slash(harness, "why", member, dm)
    assert answers(nothing) == ["There is no reply in this channel's conversation yet."]
    await harness.say("hello", dm, member)
    why = await slash(harness, "why", member, dm)
    (text,) = answers(why)
    seed = harness.bot.last_provenance[conversation_key(dm)]["seed"]
    assert text.startswith("decoder top-k ") and "top_k=40" in text and f"seed {seed}" in text
    assert "1 turn(s) used" in text
    assert why.response.sent[0][1] is True  # only the asker sees it
    settings = await slash(harness, "settings", member, dm)
    (text,) = answers(settings)
    assert "decoder: top-k" in text and "replies in progress: 0 (batch of 8, queue of 8)" in text


@pytest.mark.asyncio
async def test_the_reply_budget_is_the_models_own_unless_given_and_settings_show_it(chat_engine, tmp_path, monkeypatch):
    """As chat, generate and serve take it: not given, the model's own budget (200 for smollm2, 64
    for chatcore-tiny); given as an option or in the settings file, that. It was 64 for every model."""
    from chatcore.models import MODEL_ENV

    assert DiscordSettings(model="smollm2").max_new_tokens == 200
    assert DiscordSettings(model="chatcore-tiny").max_new_tokens == 64
    assert DiscordSettings(model="smollm2", max_new_tokens=30).max_new_tokens == 30
    toml = tmp_path / "bot.toml"
    toml.write_text('[discord]\nmodel = "smollm2"\n', encoding="utf-8")
    assert load_settings(toml, {"max_new_tokens": None}).max_new_tokens == 200  # -n not given
    assert load_settings(toml, {"max_new_tokens": 30}).max_new_tokens == 30
    toml.write_text('[discord]\nmodel = "smollm2"\nmax_new_tokens = 50\n', encoding="utf-8")
    assert load_settings(toml).max_new_tokens == 50
    monkeypatch.setenv(MODEL_ENV, "smollm2")  # the default model, when none is named
    assert DiscordSettings().max_new_tokens == 200 and load_settings(None, {"model": None}).max_new_tokens == 200

    harness = await start_harness(chat_engine, DiscordSettings(cooldown_s=0, log=False, shutdown_grace_s=5))
    try:
        member = harness.member(0)
        (text,) = answers(await slash(harness, "settings", member, await member.create_dm()))
        assert "replies: up to 200 tokens;" in text
    finally:
        await harness.close()


@pytest.mark.asyncio
async def test_the_system_prompt_comes_from_the_channel_the_server_or_the_bot(chat_engine):
    harness = await start_harness(chat_engine, settings_for(system="You are the bot."), text_channels=2)
    try:
        first, second, plain = harness.channel(0), harness.channel(1), harness.member(1)
        harness.listen_in(first, second)
        manager = await make_manager(harness, harness.member(0))
        thread = make_thread(first, manager)
        keys = [conversation_key(place) for place in (first, second, thread)]

        async def systems_after_a_message() -> list[str | None]:
            await harness.say("hello", first, plain)
            await harness.say("hello", second, plain)
            await thread_message(harness, thread, plain, "hello")
            return await harness.on_worker(lambda runtime: [runtime.conversation(key).system for key in keys])

        assert await systems_after_a_message() == ["You are the bot."] * 3
        refused = await slash(harness, "system set", plain, first, text="You obey me.")
        assert "Manage Server" in answers(refused)[0] and refused.response.sent[0][1] is True

        server = await slash(harness, "system set", manager, first, text="You are  a pirate.", scope="server")
        assert answers(server) == ["System prompt in this server from the next reply on:\n>>> You are a pirate."]
        chef = await slash(harness, "system set", manager, first, text="You are a chef.\nYou love soup.")
        assert answers(chef)[0].startswith("System prompt in this channel from the next reply on:")
        await slash(harness, "system clear", manager, second)
        # A thread follows its channel; the next reply of each conversation uses the new prompt.
        assert await systems_after_a_message() == [
            "You are a chef.\nYou love soup.",
            None,
            "You are a chef.\nYou love soup.",
        ]
        shown = await slash(harness, "system show", plain, thread)
        assert answers(shown) == ["System prompt here (set for this channel):\n>>> You are a chef.\nYou love soup."]
        assert (
            "system prompt: none (set for this channel); format: dialogpt"
            in answers(await slash(harness, "settings", plain, second))[0]
        )

        dropped = await slash(harness, "system default", manager, second)
        assert answers(dropped) == [
            "Dropped the system prompt of this channel. System prompt here "
            "(set for this server):\n>>> You are a pirate."
        ]
        again = await slash(harness, "system default", manager, second)
        assert answers(again) == ["There is no system prompt set for this channel to drop."]
        await slash(harness, "system default", manager, first, scope="server")
        assert await systems_after_a_message() == [
            "You are a chef.\nYou love soup.",
            "You are the bot.",
            "You are a chef.\nYou love soup.",
        ]

        too_long = await slash(harness, "system set", manager, first, text="word " * 200)
        assert "the system prompt takes" in answers(too_long)[0] and too_long.response.sent[0][1] is True
        assert harness.bot.system_prompts.effective(keys[0])[0] == "You are a chef.\nYou love soup."

        dm = await plain.create_dm()
        nowhere = await slash(harness, "system set", plain, dm, text="Call me Ishmael.", scope="server")
        assert answers(nowhere) == ["There is no server in a direct message: use the channel scope."]
        own = await slash(harness, "system set", plain, dm, text="Call me Ishmael.")  # a DM is the user's own
        assert answers(own)[0].startswith("System prompt in this channel")
        await harness.say("hi", dm, plain)
        assert await harness.on_worker(lambda runtime: runtime.conversation(conversation_key(dm)).system) == (
            "Call me Ishmael."
        )
    finally:
        await harness.close()


@pytest.mark.asyncio
async def test_a_slow_command_is_deferred_and_answered_by_follow_up(harness: Harness, monkeypatch):
    import threading

    from chatcore.adapters.discord_bot import slash as slash_module

    monkeypatch.setattr(slash_module, "DEFER_AFTER_S", 0.05)
    member = harness.member(0)
    dm = await member.create_dm()
    started, release = threading.Event(), threading.Event()

    def hold(runtime, control):  # the worker is busy with something slow
        started.set()
        return release.wait(10)

    busy = harness.worker.submit(hold)
    await wait_until(started.is_set)  # this job itself, not one still finishing before it
    fake = interaction(member, dm)
    command = asyncio.ensure_future(harness.bot.tree.get_command("chat").get_command("reset").callback(fake))
    await wait_until(lambda: fake.response.deferred is not None or command.done())
    assert fake.response.deferred == (False, True) and not command.done(), fake.response.sent
    release.set()
    await command
    await busy
    assert fake.response.sent == [] and "new conversation" in answers(fake)[0]


# -- limits: cooldown, queue, load ----------------------------------------------------
def test_cooldown_warns_once_per_window():
    now = [0.0]
    cooldown = Cooldown(5, clock=lambda: now[0])
    assert [cooldown.check(1), cooldown.check(1), cooldown.check(1), cooldown.check(2)] == ["ok", "warn", "quiet", "ok"]
    now[0] = 5.0
    assert cooldown.check(1) == "ok"
    assert Cooldown(0).check(1) == "ok"


@pytest.mark.asyncio
async def test_a_user_faster_than_the_cooldown_is_told_once(chat_engine):
    harness = await start_harness(chat_engine, settings_for(cooldown_s=60))
    try:
        member, other = harness.member(0), harness.member(1)
        dm = await member.create_dm()
        assert len(await harness.say("one", dm, member)) == 1
        assert [m.content for m in await harness.say("two", dm, member)] == [
            bot_module.COOLDOWN_REPLY.format(seconds=60)
        ]
        assert await harness.say("three", dm, member) == []
        assert len(await harness.say("me too", await other.create_dm(), other)) == 1
        assert harness.bot.stats.cooldown == 2 and harness.bot.stats.replies == 2
    finally:
        await harness.close()


async def burst(harness: Harness, channels: list[Any]) -> tuple[list[discord.Message], float]:
    """Every channel's message at the same moment; what the bot sent and how long it took."""
    started = time.perf_counter()
    await asyncio.gather(
        *(
            dpytest.message(f"hello from channel {index}", channel=channel, member=harness.member(index))
            for index, channel in enumerate(channels)
        )
    )
    await dpytest.run_all_events()
    return harness.drain(), time.perf_counter() - started


@pytest.mark.asyncio
@pytest.mark.parametrize("queue_size", [6, 20])
async def test_twenty_channels_at_once_each_get_exactly_one_reply(chat_engine, queue_size):
    harness = await start_harness(chat_engine, settings_for(queue_size=queue_size), text_channels=20, members=20)
    try:
        channels = harness.config.channels[:20]
        harness.listen_in(*channels)
        sent, elapsed = await burst(harness, channels)
        per_channel = {channel.id: [m for m in sent if m.channel.id == channel.id] for channel in channels}
        assert all(len(replies) == 1 for replies in per_channel.values()), {k: len(v) for k, v in per_channel.items()}
        assert len(sent) == 20
        stats = harness.bot.stats
        busy = sum(m.content == bot_module.BUSY_REPLY for m in sent)
        assert busy == stats.busy and stats.replies + stats.busy == 20 and stats.errors == 0
        if queue_size == 20:
            assert busy == 0
        else:
            assert busy == 20 - 8 - 6  # 20 arrive together: a batch of 8 and 6 waiting is all there is room for
        assert_pings_no_one(harness.payloads)
        print(
            f"\nqueue_size={queue_size}: 20 channels, {stats.replies} model replies + {busy} busy replies "
            f"in {elapsed:.2f} s = {20 / elapsed:.1f} replies/s ({stats.replies / elapsed:.1f} model replies/s)"
        )
    finally:
        await harness.close()


# -- the event loop stays responsive while the model thinks -------------------------
@pytest.mark.asyncio
async def test_the_event_loop_stays_responsive_during_a_long_generation(serving_engine, gate):
    """The decoder holds the scheduler's thread in the middle of the reply until the event
    loop releases it: the reply can only end if the loop runs while it is being decoded.
    (How much the loop lags under load is bench/discord_load.py's to measure.)"""
    gate.text = "Hello there, my friend"
    harness = await start_harness(serving_engine, settings_for(decoder="gated-text", max_new_tokens=40))
    released_by_the_loop = asyncio.Event()

    async def release_from_the_loop(seconds: float) -> None:  # awaited on the loop beside the reply
        assert await asyncio.to_thread(gate.written.wait, 60)  # the reply is being decoded, held
        gate.release.set()  # the loop runs meanwhile, and lets the reply end
        released_by_the_loop.set()
        await asyncio.Event().wait()  # the reply's time never runs out

    harness.bot.reply_timer = release_from_the_loop
    try:
        member = harness.member(0)
        dm = await member.create_dm()
        (answer,) = await harness.say("tell me everything about your day", dm, member)
        assert answer.content == "Hello there, my friend"
        assert released_by_the_loop.is_set() and harness.bot.stats.interrupted == 0
    finally:
        gate.release.set()
        await harness.close()


@pytest.mark.asyncio
async def test_a_plugins_failure_is_named_in_the_channel_without_its_exceptions_text(serving_engine, caplog):
    """What failed is said in the channel; the exception's own text (paths, internals) goes to
    the bot's console only."""
    steer = ("failing-shared at_step=2",)
    harness = await start_harness(serving_engine, settings_for(decoder="greedy", steer=steer))
    try:
        member = harness.member(0)
        dm = await member.create_dm()
        (answer,) = await harness.say("hello there", dm, member)
    finally:
        await harness.close()
    assert answer.content == (
        "Sorry, I can't answer that: plugin 'test-serving': steerer 'failing-shared' failed while generating"
    )
    said = [record.getMessage() for record in caplog.records if record.name == "chatcore.discord"]
    assert any("failing-shared' failed while generating: RuntimeError: boom" in line for line in said), said


# -- shutting down ----------------------------------------------------------------------
@dataclass
class SlowTextSettings:
    words: int = 50
    delay_s: float = 0.02


class SlowTextDecoder(ScriptedDecoder):
    """Says a word's tokens every ``delay_s``: a reply that takes a known while."""

    name = "slow-text"
    Settings = SlowTextSettings

    def script(self, session: GenerationSession) -> list[int]:
        words = [encode_text(session.model.tokenizer, f" word{index}") for index in range(self.settings.words)]
        self._word_starts = set(itertools.accumulate([0] + [len(word) for word in words[:-1]]))
        return [token for word in words for token in word]

    def next_token(self) -> int:
        if self._position in self._word_starts:
            time.sleep(self.settings.delay_s)
        return super().next_token()


class SlowTextPlugin:
    @chatcore.hookimpl
    def register_decoders(self, register: Any) -> None:
        register(SlowTextDecoder)


async def wait_until(condition: Any, timeout_s: float = 120.0) -> None:
    """Poll the event loop until ``condition()``; the timeout only ends a test that would hang."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


@pytest.mark.asyncio
async def test_twenty_channels_are_decoded_in_one_batch_and_equal_replies_decoded_alone(chat_engine):
    from chatcore.engine import ReplyOptions

    harness = await start_harness(
        chat_engine, settings_for(decoder="greedy", queue_size=20, max_new_tokens=16), text_channels=20, members=20
    )
    try:
        channels = harness.config.channels[:20]
        harness.listen_in(*channels)
        steps_before = await harness.on_worker(lambda runtime: runtime.scheduler.steps)
        sent, _ = await burst(harness, channels)
        steps = await harness.on_worker(lambda runtime: runtime.scheduler.steps) - steps_before
        by_channel = {m.channel.id: m.content for m in sent}
        assert len(sent) == 20 and harness.bot.stats.replies == 20
        tokens = 0
        for index, channel in enumerate(channels):
            alone = chat_engine.conversation()
            chat_engine.add_user(alone, f"hello from channel {index}")
            response = chat_engine.respond(alone, ReplyOptions(decoder="greedy", max_new_tokens=16))
            expected = "\n".join(split_reply(response.text())) or bot_module.EMPTY_REPLY
            tokens += len(response.token_ids)
            assert by_channel[channel.id] == expected, index
        # Batched: far fewer forward passes than tokens (one pass advances up to 8 replies).
        assert steps <= tokens / 3, (steps, tokens)
    finally:
        await harness.close()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "written, kept",
    [
        ("Hello there, my frie", "Hello there, my"),  # cut in the middle of "friend"
        ("Hellothere", None),  # not one whole word: the timeout answer, and no reply in the log
    ],
)
async def test_a_reply_past_its_timeout_is_cut_at_a_whole_word_and_frees_its_place_at_once(
    serving_engine, gate, tmp_path, written, kept
):
    from chatcore.log.store import ConversationStore

    gate.text = written
    db = str(tmp_path / "log.sqlite3")
    harness = await start_harness(
        serving_engine,
        settings_for(decoder="gated-text", max_new_tokens=40, max_batch=1, queue_size=1),
        lambda: LogPersistence(serving_engine, db),
    )

    async def time_is_up(seconds: float) -> None:  # the reply's time runs out once it has written its text
        assert await asyncio.to_thread(gate.written.wait, 60)

    harness.bot.reply_timer = time_is_up
    try:
        member = harness.member(0)
        dm = await member.create_dm()
        (answer,) = await harness.say("tell me a story", dm, member)
        if kept is None:
            assert answer.content == bot_module.TIMEOUT_REPLY
        else:
            assert answer.content == kept + bot_module.CUT_MARKS["timeout"]
        assert harness.bot.stats.interrupted == 1
        # Sent while the decoder still holds the scheduler's thread: its place is free already.
        assert await harness.on_worker(lambda runtime: runtime.scheduler.in_flight()) == 0
        assert not await harness.on_worker(lambda runtime: runtime.scheduler.full)
    finally:
        gate.release.set()
        await harness.close()

    with ConversationStore(f"sqlite:///{db}") as store:
        (summary,) = store.list_conversations(channel_key=conversation_key(dm))
        messages = store.get_conversation(summary.id).messages
    if kept is None:
        assert [m.role for m in messages] == ["user"]  # the message waits for a reply
    else:
        assert [(m.role, m.text.strip(), m.interrupted) for m in messages][1:] == [("bot", kept, True)]


@pytest.mark.asyncio
# The long grace is only an upper bound: shutdown returns once the reply is done.
@pytest.mark.parametrize("grace_s, interrupted", [(0.1, True), (300.0, False)])
async def test_shutdown_finishes_or_cuts_the_reply_in_flight_and_flushes_the_log(
    loaded, host, tmp_path, grace_s, interrupted
):
    from chatcore.engine import Engine
    from chatcore.log.store import ConversationStore

    host.register(SlowTextPlugin(), "slow-text-test")
    engine = Engine(loaded, host=host)
    db = str(tmp_path / "log.sqlite3")
    # A batch of one: the second reply waits for a place.
    harness = await start_harness(
        engine,
        settings_for(
            decoder="slow-text words=20 delay_s=0.02", shutdown_grace_s=grace_s, max_batch=1, max_new_tokens=100
        ),
        lambda: LogPersistence(engine, db),
    )
    first, second = harness.member(0), harness.member(1)
    first_dm, second_dm = await first.create_dm(), await second.create_dm()

    def admitted() -> list[bool]:
        return [
            flight.pending is not None and flight.pending.handle.admitted is not None
            for flight in harness.bot.in_flight
        ]

    in_flight = asyncio.ensure_future(dpytest.message("tell me a story", channel=first_dm, member=first))
    await wait_until(lambda: admitted() == [True])
    queued = asyncio.ensure_future(dpytest.message("me too", channel=second_dm, member=second))
    await wait_until(
        lambda: (
            sorted(admitted()) == [False, True] and all(flight.pending is not None for flight in harness.bot.in_flight)
        )
    )

    def streamed() -> str:  # what the admitted reply has decoded so far
        handles = [f.pending.handle for f in harness.bot.in_flight if f.pending and f.pending.handle.admitted]
        return engine.tokenizer.decode(list(handles[0].token_ids)) if handles else ""

    await wait_until(lambda: "word1" in streamed())  # its first word is whole before the grace starts

    harness.bot.ws = None  # dpytest's fake gateway has no socket to close
    await harness.bot.shutdown()
    asked, _ = await asyncio.gather(in_flight, queued)
    sent = {m.channel.id: m.content for m in harness.drain()}
    assert sent[second_dm.id] == bot_module.RESTARTING_REPLY
    assert sent[first_dm.id].startswith("word0")
    assert (sent[first_dm.id].count("word") < 20) is interrupted
    assert harness.bot.stats.interrupted == int(interrupted)
    # No new messages once closing (the connection is closed: hand one over directly).
    sends = len(harness.payloads)
    await harness.bot.on_message(asked)
    assert len(harness.payloads) == sends
    with pytest.raises(WorkerClosed):
        harness.worker.submit(lambda runtime, control: None)

    with ConversationStore(f"sqlite:///{db}") as store:
        (summary,) = store.list_conversations(channel_key=conversation_key(first_dm))
        messages = store.get_conversation(summary.id).messages
    assert [m.role for m in messages] == ["user", "bot"]
    mark = bot_module.CUT_MARKS["shutdown"] if interrupted else ""
    assert messages[1].interrupted is interrupted and messages[1].text.strip() + mark == sent[first_dm.id]
    assert messages[0].author_id == str(first.id)  # an operator can export or delete one person's messages


# -- the worker on its own -------------------------------------------------------------
@pytest.mark.asyncio
async def test_the_worker_runs_jobs_in_order_on_one_thread_and_refuses_when_full():
    import threading

    worker: InferenceWorker[list[str]] = InferenceWorker(lambda: [], queue_size=2)
    worker.start()
    await worker.ready()
    release = threading.Event()
    threads: set[str] = set()

    def job(name: str) -> Any:
        def run(resource: list[str], control: Any) -> str:
            threads.add(threading.current_thread().name)
            if name == "first":
                release.wait(5)
            resource.append(name)
            return name

        return run

    first = worker.submit(job("first"))
    await wait_until(lambda: worker.running)
    waiting = [worker.submit(job("second")), worker.submit(job("third"))]
    with pytest.raises(WorkerBusy):
        worker.submit(job("fourth"))
    urgent = worker.submit(job("control"), control=True)  # slash commands go ahead of waiting replies
    failing = worker.submit(lambda resource, control: 1 / 0, control=True)
    release.set()
    assert await asyncio.gather(first, *waiting, urgent) == ["first", "second", "third", "control"]
    with pytest.raises(ZeroDivisionError):
        await failing
    order = await worker.submit(lambda resource, control: list(resource))
    assert order == ["first", "control", "second", "third"]
    assert threads == {"chatcore-inference"}
    await worker.stop(1)


@pytest.mark.asyncio
async def test_a_worker_whose_resource_fails_to_open_reports_it():
    def broken() -> None:
        raise ChatcoreError("cannot load model 'nope'")

    worker: InferenceWorker[None] = InferenceWorker(broken, queue_size=1)
    worker.start()
    with pytest.raises(ChatcoreError, match="cannot load model 'nope'"):
        await worker.ready()
    with pytest.raises(WorkerClosed):
        worker.submit(lambda resource, control: None)


# -- text -------------------------------------------------------------------------
def test_split_reply_cuts_at_breaks_within_the_limit():
    assert split_reply("   \n ") == []
    assert split_reply("short") == ["short"]
    assert split_reply("x" * 2000) == ["x" * 2000]
    words = " ".join(f"w{i:04d}" for i in range(1000))  # 5,999 characters
    pieces = split_reply(words)
    assert all(len(p) <= 2000 for p in pieces) and " ".join(pieces) == words
    lines = "\n".join(["line " * 30] * 40)
    assert all(p.endswith("line") for p in split_reply(lines))
    assert "".join(split_reply("y" * 4500)) == "y" * 4500  # no break at all: cut anyway
    emoji = "😀" * 1500  # 3,000 UTF-16 units: Discord counts each emoji twice
    pieces = split_reply(emoji)
    assert [len(p) for p in pieces] == [1000, 500]


# -- settings and token ----------------------------------------------------------------
def test_settings_come_from_toml_or_json_with_options_on_top(tmp_path):
    toml = tmp_path / "bot.toml"
    toml.write_text(
        '[discord]\nchannels = [111, 222]\ndecoder = "greedy"\nadmin_roles = ["Mods", 333]\ncooldown_s = 1.5\n',
        encoding="utf-8",
    )
    settings = load_settings(toml, {"queue_size": 3, "channels": (), "model": None})
    assert settings.channels == (111, 222) and settings.decoder == "greedy" and settings.queue_size == 3
    assert settings.cooldown_s == 1.5 and settings.is_admin_role(333, "x") and settings.is_admin_role(1, "Mods")
    assert load_settings(toml, {"channels": (444,)}).channels == (444,)

    as_json = tmp_path / "bot.json"
    as_json.write_text(json.dumps({"channels": ["123456789012345678"], "log": False}), encoding="utf-8")
    settings = load_settings(as_json)
    assert settings.channels == (123456789012345678,) and settings.log is False


def test_the_system_prompt_comes_from_the_settings_file_or_the_options(tmp_path):
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "pirate.txt").write_text("You are a pirate.\n", encoding="utf-8")
    (tmp_path / "chef.txt").write_text("You are a chef.", encoding="utf-8")
    toml = tmp_path / "bot.toml"
    toml.write_text('system_file = "prompts/pirate.txt"\nprompt_format = "dialogpt"\n', encoding="utf-8")
    settings = load_settings(toml)  # a relative file is found next to the settings file
    assert (settings.system, settings.prompt_format) == ("You are a pirate.", "dialogpt")
    assert load_settings(toml, {"system": "You are a poet."}).system == "You are a poet."
    assert load_settings(toml, {"system_file": str(tmp_path / "chef.txt")}).system == "You are a chef."
    assert DiscordSettings(system="  ").system is None and DiscordSettings().prompt_format == "auto"

    toml.write_text('system = "one"\nsystem_file = "chef.txt"\n', encoding="utf-8")
    for path, overrides, message in [
        (toml, {}, "give system or system_file, not both"),
        (None, {"system_file": str(tmp_path / "none.txt")}, "does not exist"),
        (None, {"system_file": str(tmp_path)}, "is not a file"),
        (None, {"system": "x" * 40_000}, "`system`: the system prompt is 40,000 characters long"),
        (None, {"prompt_format": ""}, "`prompt_format` must not be empty, got ''"),
    ]:
        with pytest.raises(ChatcoreError) as error:
            load_settings(path, overrides)
        assert message in str(error.value)


@pytest.mark.parametrize(
    "content, message",
    [
        ("queue_size = 0", "`queue_size` must be a positive integer, got 0"),
        ("chanels = [1]", "unknown setting"),
        ("channels = [-5]", "`channels` must list Discord ids"),
        ("min_new_tokens = 99", "`min_new_tokens` must be an integer between 0 and max_new_tokens (64), got 99"),
        ('token = "abc"', "holds a token"),
        ("decoder = ", "is not valid TOML"),
    ],
)
def test_bad_settings_are_refused_with_the_key_named(tmp_path, content, message):
    path = tmp_path / "bot.toml"
    path.write_text(content + "\n", encoding="utf-8")
    with pytest.raises(ChatcoreError) as error:
        load_settings(path)
    assert message in str(error.value)


def test_the_token_comes_from_the_environment_or_a_file_and_never_shows(tmp_path, caplog):
    secret = "MTA3.secret-token.value"
    assert read_token(environ={"DISCORD_TOKEN": f" {secret}\n"}) == secret
    path = tmp_path / "token"
    path.write_text(secret + "\n", encoding="utf-8")
    path.chmod(0o644)
    assert read_token(path, environ={}) == secret
    assert "can be read by other users" in caplog.text and secret not in caplog.text
    with pytest.raises(ChatcoreError, match="set DISCORD_TOKEN or pass --token-file"):
        read_token(environ={})
    path.write_text("two words", encoding="utf-8")
    with pytest.raises(ChatcoreError) as error:
        read_token(path, environ={})
    assert "does not hold a bot token" in str(error.value) and "two" not in str(error.value)
    with pytest.raises(ValueError, match="`queue_size` must be a positive integer, got 0"):
        DiscordSettings(queue_size=0)


def test_the_discord_command_checks_everything_without_printing_the_token(
    tiny_model_dir, monkeypatch, caplog, tmp_path
):
    import logging

    import click
    from click.testing import CliRunner
    from refused_configurations import IMPOSSIBLE_STEERERS, NON_DECODABLE_DECODERS

    for name in ("chatcore", "discord"):  # the command sets their levels: put them back afterwards
        monkeypatch.setattr(logging.getLogger(name), "level", logging.getLogger(name).level)

    from chatcore.adapters.discord_bot import register_commands

    group = click.Group()
    register_commands(group)
    secret = "MTA3.another-secret.value"
    runner = CliRunner()
    result = runner.invoke(
        group,
        ["discord", "--check", "--no-log", "--model", str(tiny_model_dir), "--channel", "123", "--decoder", "greedy"],
        env={"DISCORD_TOKEN": secret},
    )
    assert result.exit_code == 0, result.output
    assert "decoder: greedy" in result.output and "channels 123" in result.output
    assert "token: found in $DISCORD_TOKEN" in result.output
    assert secret not in result.output and secret not in caplog.text

    result = runner.invoke(group, ["discord", "--check", "--no-log", "--decoder", "greedy"], env={"DISCORD_TOKEN": ""})
    assert result.exit_code != 0 and "no bot token" in str(result.exception or result.output)
    for seconds in ("nan", "inf"):  # a cooldown that compares false with every time would never end
        result = runner.invoke(group, ["discord", "--check", "--cooldown", seconds], env={"DISCORD_TOKEN": secret})
        assert result.exit_code == 2 and "is not a finite number of seconds" in result.output

    persona = ["discord", "--check", "--no-log", "--model", str(tiny_model_dir), "--system", "Be kind."]
    result = runner.invoke(group, [*persona, "--format", "dialogpt"], env={"DISCORD_TOKEN": secret})
    assert result.exit_code == 0 and "format: dialogpt; system prompt: 8 characters" in result.output
    # Checked before the token is read and the model loads:
    for extra, message in [
        (["--format", "nope"], "unknown prompt format 'nope'"),
        (["--system-file", "x.txt"], "give --system or --system-file, not both"),
        (["--decoder", "top-k top_k=0"], "`top_k` must be a positive integer, got 0"),
        (["--steer", "bow-bias strength=500"], "`strength` must be between -100 and 100, got 500.0"),
        (["--steer", "nope"], "unknown steerer 'nope'"),
        *[([arg for spec in specs for arg in ("--steer", spec)], line) for specs, line in IMPOSSIBLE_STEERERS],
        *[(["--decoder", spec], line) for spec, line in NON_DECODABLE_DECODERS],
    ]:
        result = runner.invoke(group, [*persona, *extra], env={"DISCORD_TOKEN": ""})
        assert result.exit_code != 0 and message in str(result.exception)

    # The log the check names is the one the bot would open: --db, else $CHATCORE_DB.
    logged = ["discord", "--check", "--model", str(tiny_model_dir)]
    result = runner.invoke(group, logged, env={"DISCORD_TOKEN": secret, "CHATCORE_DB": str(tmp_path / "bot.db")})
    assert result.exit_code == 0, result.output
    assert f"conversation log: sqlite:///{tmp_path / 'bot.db'}" in result.output


# -- serve: start, SIGTERM, stop --------------------------------------------------------
@pytest.mark.asyncio
async def test_sigterm_stops_the_bot_cleanly(tiny_model_dir, tmp_path, monkeypatch):
    import os
    import signal

    from chatcore.adapters.discord_bot import run

    secret = "MTA3.secret-token.value"
    seen: dict[str, Any] = {}

    async def connect(bot: ChatBot, token: str) -> None:
        # Stands in for the gateway connection: no network in tests.
        seen["token_ok"] = token == secret
        seen["worker_ready"] = bot.worker.accepting
        os.kill(os.getpid(), signal.SIGTERM)  # what systemd sends
        while not bot.is_closed():
            await asyncio.sleep(0.01)
        seen["bot"] = bot

    monkeypatch.setattr(ChatBot, "start", connect)
    settings = settings_for(model=str(tiny_model_dir), log=True, db=str(tmp_path / "log.sqlite3"))
    await asyncio.wait_for(run.serve(settings, secret), timeout=60)
    assert seen["token_ok"] and seen["worker_ready"]
    bot = seen["bot"]
    assert bot.closing and not bot.worker.accepting
    with pytest.raises(WorkerClosed):
        bot.worker.submit(lambda runtime, control: None)


@pytest.mark.asyncio
async def test_a_refused_token_is_a_clear_error_without_the_token(tiny_model_dir, monkeypatch):
    from chatcore.adapters.discord_bot import run

    secret = "MTA3.refused-token.value"

    async def refuse(bot: ChatBot, token: str) -> None:
        raise discord.LoginFailure("Improper token has been passed.")

    monkeypatch.setattr(ChatBot, "start", refuse)
    with pytest.raises(ChatcoreError) as error:
        await run.serve(settings_for(model=str(tiny_model_dir)), secret)
    assert "Discord refused the bot token" in str(error.value) and secret not in str(error.value)


# -- sharding -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "changes, message",
    [
        ({"shard_ids": (0,)}, "`shard_ids` needs `shard_count`"),
        ({"shard_count": 0, "shard_ids": (0,)}, "`shard_ids` needs a fixed `shard_count`: with `shard_count` 0"),
        ({"shard_count": 2, "shard_ids": (0, 2)}, "`shard_ids` must be shard numbers from 0 to 1, got 2"),
        ({"shard_count": 4, "shard_ids": (1, 1)}, "`shard_ids` lists a shard twice: [1, 1]"),
        ({"shard_count": -1}, "`shard_count` must be a non-negative integer"),
    ],
)
def test_bad_shard_settings_are_one_line(changes, message):
    with pytest.raises(ValueError) as caught:
        DiscordSettings(**changes)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_shard_ids_from_the_command_line():
    from click.testing import CliRunner

    from chatcore.adapters.discord_bot.cli import discord_command, parse_shard_ids

    assert parse_shard_ids("0, 2") == (0, 2) and parse_shard_ids(None) is None
    result = CliRunner().invoke(
        discord_command, ["--shard-count", "2", "--shard-ids", "0,5", "--check"], env={"DISCORD_TOKEN": ""}
    )
    assert result.exit_code != 0 and "`shard_ids` must be shard numbers from 0 to 1, got 5" in str(result.exception)
    result = CliRunner().invoke(discord_command, ["--shard-ids", "zero"])
    assert "--shard-ids must list shard numbers" in str(result.exception)


@pytest.mark.asyncio
@pytest.mark.parametrize("count, ids", [(4, (1, 3)), (0, ())])
async def test_a_sharded_bot_is_discord_pys_auto_sharded_client_with_its_shard_ids(count, ids):
    from chatcore.adapters.discord_bot.bot import ShardedChatBot, make_bot

    worker: InferenceWorker[None] = InferenceWorker(lambda: None, queue_size=1)
    bot = make_bot(settings_for(shard_count=count, shard_ids=ids), worker)
    assert isinstance(bot, ShardedChatBot) and isinstance(bot, discord.AutoShardedClient)
    # What discord.py itself will connect: these shards of this many (None: Discord's recommendation).
    assert bot.shard_ids == (list(ids) or None) and bot.shard_count == (count or None)
    assert not isinstance(make_bot(settings_for(), worker), discord.AutoShardedClient)


def test_the_bot_warms_the_fast_path_up_before_it_connects(tiny_model_dir, monkeypatch, caplog):
    """open_runtime (the worker's start, before the client connects) runs the warm-up on the fast path."""
    from chatcore.adapters.discord_bot.conversations import open_runtime
    from chatcore.fast_path_setting import FAST_PATH_ENV

    monkeypatch.setenv(FAST_PATH_ENV, "on")
    with caplog.at_level("INFO", logger="chatcore.discord"):
        runtime = open_runtime(settings_for(model=str(tiny_model_dir), max_batch=2))
    try:
        said = [record.getMessage() for record in caplog.records if record.name == "chatcore.discord"]
        assert any(line.startswith("warming up the fast path for batches of up to 2 (") for line in said), said
        assert any(line.startswith("warmed up in ") for line in said), said
        assert runtime.scheduler.runner.steps > 0 and runtime.scheduler.in_flight() == 0
    finally:
        runtime.close()


@pytest.mark.parametrize(
    "content, message",
    [
        (
            "channels = [5]\n\n[discord]\nguilds = [1]\n",
            "settings file {path!r} has keys outside its [discord] table: 'channels'; move them under [discord]",
        ),
        (
            "[discord]\nguilds = [1]\n\n[other]\nchannels = [5]\n",
            "settings file {path!r} has keys outside its [discord] table: 'other'; move them under [discord]",
        ),
        (
            "max_batch = 2\nchannels = [5]\n[discord]\nguilds = [1]\n[zz]\nx = 1\n",
            "has keys outside its [discord] table: 'channels', 'max_batch', 'zz'; move them under [discord]",
        ),
        ('token = "x"\nchannels = [5]\n\n[discord]\nguilds = [1]\n', "holds a token"),
        ('[discord]\ntoken = "x"\n', "holds a token"),
    ],
    ids=["top-level-key", "other-table", "several", "token-beside", "token-inside"],
)
def test_keys_beside_the_discord_table_are_refused_not_ignored(tmp_path, content, message):
    """With a [discord] table, a key outside it was dropped unread: `channels` ended up empty."""
    path = tmp_path / "bot.toml"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ChatcoreError) as error:
        load_settings(path)
    assert message.format(path=str(path)) in str(error.value) and "\n" not in str(error.value)
    assert '"x"' not in str(error.value)  # a token's value is never shown


def test_keys_beside_the_discord_object_of_a_json_file_are_refused(tmp_path):
    path = tmp_path / "bot.json"
    path.write_text(json.dumps({"channels": [5], "discord": {"guilds": [1]}}), encoding="utf-8")
    with pytest.raises(ChatcoreError, match='outside its "discord" object: \'channels\'; move them under "discord"'):
        load_settings(path)
    path.write_text(json.dumps({"discord": {"guilds": [1], "channels": [5]}}), encoding="utf-8")
    settings = load_settings(path)
    assert settings.guilds == (1,) and settings.channels == (5,)


def test_discord_check_refuses_a_settings_file_with_keys_beside_its_table(tmp_path):
    from click.testing import CliRunner

    from chatcore.cli import build_cli

    path = tmp_path / "s.toml"
    path.write_text("channels = [5]\n\n[discord]\nguilds = [1]\n", encoding="utf-8")
    result = CliRunner().invoke(build_cli(), ["discord", "--check", "--settings", str(path)])
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    assert "keys outside its [discord] table: 'channels'; move them under [discord]" in result.output


def settings_table(markdown: str) -> dict[str, str]:
    """docs/discord.md's configuration table: key -> its default column."""
    import re

    section = markdown.split("## 5. Configuration reference", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \|[^|]*\|([^|]*)\|", section, flags=re.MULTILINE)
    return {key: default.strip() for key, default in rows}


def test_the_documented_settings_defaults_are_the_ones_the_bot_runs_with(monkeypatch):
    from pathlib import Path

    from chatcore.models import DEFAULT_MODEL, MODEL_ENV, PREFERRED_MODEL, known_model_installed

    defaults = settings_table((Path(__file__).resolve().parents[1] / "docs" / "discord.md").read_text("utf-8"))
    numeric = {
        name: field.default
        for name, field in DiscordSettings.model_fields.items()
        if isinstance(field.default, (int, float)) and not isinstance(field.default, bool)
    }
    assert {"max_new_tokens", "min_new_tokens", "max_batch", "cooldown_s"} <= set(numeric)
    for name, value in numeric.items():
        assert float(defaults[name].split()[0].rstrip(",")) == value, (name, defaults[name])
    # The model: smollm2 where its wheel is installed (as here), else chatcore-tiny.
    monkeypatch.delenv(MODEL_ENV, raising=False)
    assert known_model_installed(PREFERRED_MODEL) and DiscordSettings().model == PREFERRED_MODEL
    assert defaults["model"].startswith(f"`{PREFERRED_MODEL}` where"), defaults["model"]
    assert f"else `{DEFAULT_MODEL}`" in defaults["model"] and MODEL_ENV in defaults["model"]
