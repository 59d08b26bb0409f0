"""Conversations: prompt formatting and budgeting, message cleaning, seeds, hooks, interrupts."""

from __future__ import annotations

import pytest

import chatcore
from chatcore.conversation import Conversation, PromptPlan, build_prompt
from chatcore.engine import ReplyOptions
from chatcore.errors import ChatcoreError, OptionError
from chatcore.text import MAX_MESSAGE_CHARS, clean_message, encode_text

EOS = 0


# -- build_prompt -----------------------------------------------------------------------


def test_build_prompt_puts_eos_after_every_turn():
    plan = build_prompt([[1, 2], [3], [4, 5, 6]], eos=EOS, budget=100)
    assert plan == PromptPlan([1, 2, EOS, 3, EOS, 4, 5, 6, EOS], turns_used=3, turns_dropped=0, truncated_tokens=0)


def test_build_prompt_drops_oldest_whole_turns():
    turns = [[1, 2], [3], [4, 5, 6]]
    assert build_prompt(turns, EOS, budget=9).token_ids == [1, 2, EOS, 3, EOS, 4, 5, 6, EOS]  # exactly fits
    assert build_prompt(turns, EOS, budget=8) == PromptPlan([3, EOS, 4, 5, 6, EOS], 2, 1, 0)
    assert build_prompt(turns, EOS, budget=6) == PromptPlan([3, EOS, 4, 5, 6, EOS], 2, 1, 0)
    assert build_prompt(turns, EOS, budget=5) == PromptPlan([4, 5, 6, EOS], 1, 2, 0)
    assert build_prompt(turns, EOS, budget=4) == PromptPlan([4, 5, 6, EOS], 1, 2, 0)


def test_build_prompt_keeps_a_contiguous_suffix_of_turns():
    # The small oldest turn would fit, but the history must not have holes.
    plan = build_prompt([[1], [2, 2, 2, 2], [3]], EOS, budget=4)
    assert plan == PromptPlan([3, EOS], 1, 2, 0)


def test_build_prompt_truncates_the_newest_turn_when_it_alone_is_too_long():
    plan = build_prompt([[9, 9], list(range(1, 11))], EOS, budget=4)
    assert plan == PromptPlan([8, 9, 10, EOS], turns_used=1, turns_dropped=1, truncated_tokens=7)
    assert len(plan.token_ids) == 4


def test_build_prompt_budget_too_small():
    with pytest.raises(ChatcoreError, match="budget"):
        build_prompt([[1]], EOS, budget=1)


# -- prompts through a Conversation -------------------------------------------------------


def test_conversation_prompt_is_dialogpt_formatted(engine, tokenizer):
    conversation = engine.conversation()
    engine.add_user(conversation, "hello there")
    conversation.add_bot_text("hi! how are you?")
    engine.add_user(conversation, "great, thanks")
    eos = tokenizer.eos_token_id
    expected = []
    for text in ("hello there", "hi! how are you?", "great, thanks"):
        expected += encode_text(tokenizer, text) + [eos]
    plan = engine.prompt(conversation, 32)
    assert plan.token_ids == expected
    assert (plan.turns_used, plan.turns_dropped, plan.truncated_tokens) == (3, 0, 0)


def test_long_history_drops_oldest_turns_and_still_replies(engine, tokenizer, loaded):
    conversation = engine.conversation()
    texts = [f"message number {i} talks about pizza, movies and the weather" for i in range(30)]
    for index, text in enumerate(texts):
        if index % 2 == 0:
            engine.add_user(conversation, text)
        else:
            conversation.add_bot_text(text)
    max_new = 40
    budget = loaded.max_positions - max_new
    plan = engine.prompt(conversation, max_new)
    assert plan.turns_dropped > 0 and plan.turns_used >= 1
    assert plan.turns_used + plan.turns_dropped == len(texts)
    assert len(plan.token_ids) <= budget
    eos = tokenizer.eos_token_id
    kept = texts[-plan.turns_used :]
    assert plan.token_ids == [t for text in kept for t in encode_text(tokenizer, text) + [eos]]
    # one more turn would not have fit
    older = encode_text(tokenizer, texts[-plan.turns_used - 1])
    assert len(plan.token_ids) + len(older) + 1 > budget

    response = engine.respond(
        conversation, ReplyOptions(decoder="greedy", max_new_tokens=max_new, min_new_tokens=max_new)
    )
    response.text()
    assert len(response.token_ids) == max_new
    provenance = response.provenance
    assert provenance["history_turns_dropped"] == plan.turns_dropped
    assert provenance["history_turns_used"] == plan.turns_used
    assert provenance["prompt_tokens"] == len(plan.token_ids)
    assert provenance["truncated_tokens"] == 0


def test_a_too_long_newest_turn_keeps_its_most_recent_tokens(engine, tokenizer, loaded):
    conversation = engine.conversation()
    engine.add_user(conversation, "an old turn")
    conversation.add_bot_text("an old reply")
    long_text = " ".join(f"word{i}" for i in range(120))
    engine.add_user(conversation, long_text)
    ids = encode_text(tokenizer, long_text)
    max_new = 64
    budget = loaded.max_positions - max_new
    assert len(ids) + 1 > budget
    plan = engine.prompt(conversation, max_new)
    assert plan.token_ids == ids[-(budget - 1) :] + [tokenizer.eos_token_id]
    assert (plan.turns_used, plan.turns_dropped, plan.truncated_tokens) == (1, 2, len(ids) - (budget - 1))
    response = engine.respond(
        conversation, ReplyOptions(decoder="greedy", max_new_tokens=max_new, min_new_tokens=max_new)
    )
    assert len(response.text()) > 0
    assert response.provenance["truncated_tokens"] == len(ids) - (budget - 1)


def test_a_conversation_without_turns_cannot_be_answered(engine):
    with pytest.raises(ChatcoreError, match="no turns"):
        engine.respond(engine.conversation(), ReplyOptions(decoder="greedy"))


def test_special_token_text_from_the_user_is_ordinary_text(engine, tokenizer):
    eos = tokenizer.eos_token_id
    conversation = engine.conversation()
    turn = engine.add_user(conversation, "<|endoftext|>")
    assert turn.text == "<|endoftext|>"
    ids = engine.prompt_format.encode_text(turn.text)
    assert eos not in ids and len(ids) > 1
    assert tokenizer.decode(ids) == "<|endoftext|>"
    assert encode_text(tokenizer, "a <|endoftext|> b").count(eos) == 0
    plan = engine.prompt(conversation, 16)
    assert plan.token_ids.count(eos) == 1 and plan.token_ids[-1] == eos
    conversation.add_bot_text("sure <|endoftext|> thing")
    engine.add_user(conversation, "ok")
    assert engine.prompt(conversation, 16).token_ids.count(eos) == 3


# -- clean_message --------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "   ", "\n\t \r\n", "\x00\x01\x7f", b"", b" \x00 "])
def test_empty_messages_are_rejected(text):
    with pytest.raises(ChatcoreError, match="empty"):
        clean_message(text)


@pytest.mark.parametrize(
    "raw, cleaned",
    [
        ("hello", "hello"),
        ("  hello   world  ", "hello world"),
        ("line one\nline two", "line one\nline two"),
        ("a\r\nb\tc\vd\fe", "a\nb\tc\nd\ne"),
        ("def f():\n    return 1  \n\n\n\nprint(f())\n", "def f():\n    return 1\n\nprint(f())"),
        ("\n\n  first  \n \n\t\n last", "first\n\n last"),
        ("bell\x07 and null\x00 and del\x7f gone", "bell and null and del gone"),
        ("esc\x1b[31mred", "escred"),
        ("\x1b[31mred\x1b[0m \x1b[1;4mbold\x1b[m", "red bold"),  # whole escape sequences go
        ("title\x1b]0;owned\x07 bar\x1b[2J\x1b[H", "title bar"),
        ("\x1b(Bcharset \x1b7saved \x9b31mc1", "charset saved c1"),
        ("stray \x1b] kept [31m", "stray kept [31m"),
        ("lone \ud800 surrogate", "lone surrogate"),
        ("para\u2029graph and line\u2028sep", "para\ngraph and line\nsep"),
        ("café 😀 日本", "café 😀 日本"),
        (b"caf\xc3\xa9 bytes", "café bytes"),
    ],
)
def test_clean_message_normalises(raw, cleaned):
    assert clean_message(raw) == cleaned


def test_next_line_character_breaks_the_line():
    assert clean_message("first\x85second") == "first\nsecond"


def test_non_utf8_bytes_are_rejected_clearly():
    with pytest.raises(ChatcoreError) as excinfo:
        clean_message(b"ok \xff\xfe bad")
    assert "not UTF-8" in str(excinfo.value)
    assert "position 3" in str(excinfo.value)
    assert excinfo.value.__cause__ is None  # a message for people, not a chained traceback


def test_non_text_messages_are_rejected():
    with pytest.raises(ChatcoreError, match="must be text, got int"):
        clean_message(42)


def test_huge_messages_are_rejected_and_leave_the_conversation_unchanged(engine):
    seen = []

    class Watcher:
        @chatcore.hookimpl
        def on_user_message(self, conversation, turn):
            seen.append(turn.text)

    engine.host.register(Watcher(), "watcher")
    conversation = engine.conversation()
    engine.add_user(conversation, "hello")
    before = list(conversation.turns)
    huge = "x" * (MAX_MESSAGE_CHARS + 1)
    with pytest.raises(ChatcoreError) as excinfo:
        engine.add_user(conversation, huge)
    assert f"{MAX_MESSAGE_CHARS:,}" in str(excinfo.value)
    with pytest.raises(ChatcoreError):
        engine.send(conversation, huge, ReplyOptions(decoder="greedy"))
    with pytest.raises(ChatcoreError):
        engine.send(conversation, b"\xff\xff", ReplyOptions(decoder="greedy"))
    with pytest.raises(ChatcoreError):
        engine.send(conversation, " \n ", ReplyOptions(decoder="greedy"))
    assert conversation.turns == before
    assert seen == ["hello"]
    # exactly at the limit is fine
    assert len(clean_message("y" * MAX_MESSAGE_CHARS)) == MAX_MESSAGE_CHARS


def test_send_refuses_a_configuration_that_cannot_reply_before_the_message_is_added(loaded):
    from refused_configurations import (
        IMPOSSIBLE_STEERERS,
        NON_DECODABLE_DECODERS,
        PLUGIN_MODULES,
        REPEATED_STEERERS,
    )

    from chatcore.cli.specs import parse_spec
    from chatcore.engine import Engine
    from chatcore.plugin_manager import PluginHost

    seen = []

    class Watcher:  # where the conversation log learns of a user's message
        @chatcore.hookimpl
        def on_user_message(self, conversation, turn):
            seen.append(turn.text)

    host = PluginHost()
    host.load_modules(PLUGIN_MODULES + ("chatcore.plugins.prompt_formats",))
    host.register(Watcher(), "watcher")
    engine = Engine(loaded, host=host)
    conversation = engine.conversation()
    refused = [
        (ReplyOptions(steerers=[parse_spec(spec) for spec in specs]), line)
        for specs, line in IMPOSSIBLE_STEERERS + REPEATED_STEERERS
    ]
    refused += [
        (ReplyOptions(decoder=parse_spec(spec)[0], decoder_settings=parse_spec(spec)[1]), line)
        for spec, line in NON_DECODABLE_DECODERS
    ]
    for options, line in refused:
        with pytest.raises(OptionError) as excinfo:
            engine.send(conversation, "hello", options)
        assert str(excinfo.value) == line
    with pytest.raises(OptionError, match="`temperature` must be between 1e-15 and 1e"):
        engine.send(conversation, "hello", decoder_settings={"temperature": 1e-300})  # overrides are checked too
    assert conversation.turns == [] and seen == []


# -- options and seeds ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"max_new_tokens": 0}, "`max_new_tokens` must be a positive integer, got 0"),
        ({"max_new_tokens": 4, "min_new_tokens": 5}, "`min_new_tokens`"),
        ({"min_new_tokens": -1}, "got -1"),
        ({"seed": -3}, f"`seed` must be an integer from 0 to {2**63 - 1}, got -3"),
    ],
)
def test_reply_options_are_validated(kwargs, needle):
    with pytest.raises(OptionError) as excinfo:
        ReplyOptions(**kwargs)
    assert needle in str(excinfo.value)


def sample(engine, seed, message="tell me about your day"):
    options = ReplyOptions(
        decoder="top-k",
        decoder_settings={"top_k": 100, "temperature": 1.2},
        seed=seed,
        min_new_tokens=12,
        max_new_tokens=12,
    )
    response = engine.send(engine.conversation(), message, options)
    response.text()
    return response


def test_same_seed_same_reply(engine):
    first, second = sample(engine, 7), sample(engine, 7)
    assert first.text() == second.text() and first.token_ids == second.token_ids
    assert first.provenance["seed"] == second.provenance["seed"] == 7
    others = {tuple(sample(engine, seed).token_ids) for seed in (1, 2, 3)}
    assert len(others | {tuple(first.token_ids)}) > 1


def test_a_random_seed_is_recorded_and_reproduces_the_reply(engine):
    options = ReplyOptions(
        decoder="top-k", decoder_settings={"top_k": 100, "temperature": 1.2}, min_new_tokens=12, max_new_tokens=12
    )
    response = engine.send(engine.conversation(), "tell me about your day", options)
    response.text()
    seed = response.provenance["seed"]
    assert isinstance(seed, int) and seed >= 0
    assert sample(engine, seed).token_ids == response.token_ids


def test_provenance_describes_the_reply(engine, loaded):
    response = engine.send(
        engine.conversation(),
        "hi",
        ReplyOptions(
            decoder="greedy",
            decoder_settings={"repetition_penalty": "1.2"},
            seed=3,
            steerers=[("bow-bias", {"words": "pizza"})],
            max_new_tokens=5,
        ),
    )
    data = response.to_dict()
    assert data["text"] == response.text()
    assert data["model"] == loaded.name
    assert data["decoder"] == {
        "name": "greedy",
        "settings": {
            "no_repeat_ngram_size": 0,
            "repetition_penalty": 1.2,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "logit_bias": {},
        },
    }
    assert data["steerers"][0]["name"] == "bow-bias"
    assert data["steerers"][0]["settings"]["words"] == ["pizza"]
    assert data["seed"] == 3 and data["max_new_tokens"] == 5
    assert data["interrupted"] is False
    assert {"total_s", "new_tokens", "tokens_per_s", "first_token_s"} <= set(data["timings"])


def test_reply_and_send_accept_option_overrides(engine):
    conversation = engine.conversation()
    response = engine.send(conversation, "hi", decoder="greedy", max_new_tokens=3, min_new_tokens=3, seed=9)
    response.text()
    assert len(response.token_ids) == 3 and response.provenance["seed"] == 9
    assert response.provenance["decoder"]["name"] == "greedy"
    base = ReplyOptions(decoder="top-k", max_new_tokens=5, min_new_tokens=5)
    again = engine.respond(conversation, base, seed=9)
    again.text()
    assert len(again.token_ids) == 5 and again.provenance["seed"] == 9 and base.seed is None
    with pytest.raises(OptionError):
        engine.respond(conversation, base, max_new_tokens=0)


def test_reply_to_alternates_turns_ending_with_the_user(engine):
    response = engine.reply_to(["hi", "hello!", "how are you?"], ReplyOptions(decoder="greedy", max_new_tokens=4))
    response.text()
    assert response.provenance["history_turns_used"] == 3


# -- hooks -----------------------------------------------------------------------------------------


class Recorder:
    def __init__(self):
        self.events = []

    @chatcore.hookimpl
    def on_user_message(self, conversation, turn):
        self.events.append(("user", turn.text, conversation.turns[-1] is turn, len(conversation.turns)))

    @chatcore.hookimpl
    def on_response(self, conversation, response):
        self.events.append(
            ("response", response.text(), response.done, conversation.turns[-1].text, response.interrupted)
        )


def test_user_message_and_response_hooks_fire(engine):
    recorder = Recorder()
    assert engine.host.register(recorder, "test-plugin")
    conversation = engine.conversation()
    response = engine.send(
        conversation, "  hello\nthere ", ReplyOptions(decoder="greedy", min_new_tokens=6, max_new_tokens=6)
    )
    assert recorder.events == [("user", "hello\nthere", True, 1)]  # before any generation
    text = response.text()
    assert recorder.events[1:] == [("response", text, True, text, False)]
    response.text()  # replaying does not fire again
    assert len(recorder.events) == 2
    bot = conversation.turns[-1]
    assert bot.role == "bot" and bot.text == text and not bot.interrupted
    assert bot.meta["provenance"] is response.provenance


def test_a_raising_hook_is_reported_and_the_message_still_lands(engine):
    class Broken:
        @chatcore.hookimpl
        def on_user_message(self, conversation, turn):
            raise RuntimeError("boom")

    recorder = Recorder()
    engine.host.register(Broken(), "broken-hook")
    engine.host.register(recorder, "test-plugin")
    conversation = engine.conversation()
    engine.add_user(conversation, "hi")
    assert [t.text for t in conversation.turns] == ["hi"]
    assert recorder.events == [("user", "hi", True, 1)]
    assert [(p.plugin, p.stage) for p in engine.host.problems] == [("broken-hook", "hook on_user_message")]
    assert "boom" in engine.host.problems[0].message


# -- interrupt ---------------------------------------------------------------------------------------


def test_interrupting_keeps_the_partial_reply_up_to_its_last_whole_word(engine):
    from chatcore.cutting import whole_words

    recorder = Recorder()
    engine.host.register(recorder, "test-plugin")
    conversation = engine.conversation()
    response = engine.send(
        conversation, "hi", ReplyOptions(decoder="top-k", seed=1, min_new_tokens=40, max_new_tokens=40)
    )
    deltas = []
    for delta in response:
        deltas.append(delta)
        if whole_words("".join(deltas)):  # stopped once a word is whole, most likely in the next one
            break
    response.interrupt()
    assert response.interrupted and response.done
    assert response.provenance["interrupted"] is True
    assert 0 < len(response.token_ids) < 40
    last = conversation.turns[-1]
    assert last.role == "bot" and last.interrupted
    assert last.text == response.text() == whole_words("".join(deltas))
    responses = [e for e in recorder.events if e[0] == "response"]
    assert len(responses) == 1 and responses[0][4] is True
    response.interrupt()  # a second interrupt changes nothing
    assert len([e for e in recorder.events if e[0] == "response"]) == 1
    assert len(conversation.turns) == 2


def test_interrupting_while_the_stream_is_still_held(engine):
    recorder = Recorder()
    engine.host.register(recorder, "test-plugin")
    conversation = engine.conversation()
    response = engine.send(
        conversation, "hi", ReplyOptions(decoder="top-k", seed=2, min_new_tokens=40, max_new_tokens=40)
    )
    from chatcore.cutting import whole_words

    stream = iter(response)
    seen = next(stream)
    while not whole_words(seen):
        seen += next(stream)
    response.interrupt()
    assert list(stream) == []  # the stream ends quietly
    assert response.interrupted
    assert conversation.turns[-1].interrupted and conversation.turns[-1].text == whole_words(seen)
    assert len([e for e in recorder.events if e[0] == "response"]) == 1
    # the conversation goes on
    follow_up = engine.send(conversation, "and then?", ReplyOptions(decoder="greedy", max_new_tokens=4))
    follow_up.text()
    assert not follow_up.interrupted
    assert [t.role for t in conversation.turns] == ["user", "bot", "user", "bot"]


def test_a_reply_interrupted_before_its_first_token_is_not_a_turn(engine):
    recorder = Recorder()
    engine.host.register(recorder, "test-plugin")
    conversation = engine.conversation()
    response = engine.send(conversation, "hi", ReplyOptions(decoder="greedy"))
    response.interrupt()
    assert response.interrupted and response.text() == "" and response.token_ids == []
    # Nothing was said: no empty bot turn, none logged; the user's message waits for a reply.
    assert [t.role for t in conversation.turns] == ["user"]
    assert not [e for e in recorder.events if e[0] == "response"]
    follow_up = engine.send(conversation, "are you there?", ReplyOptions(decoder="greedy", max_new_tokens=4))
    assert follow_up.text() and [t.role for t in conversation.turns] == ["user", "user", "bot"]


def test_conversation_ids_and_meta(engine):
    first, second = engine.conversation(channel="x"), engine.conversation()
    assert first.id != second.id and first.meta == {"channel": "x"}
    assert isinstance(first, Conversation)


def test_a_user_turn_carries_its_meta_to_the_hooks(engine):
    seen = []

    class Plugin:
        @chatcore.hookimpl
        def on_user_message(self, conversation, turn):
            seen.append(dict(turn.meta))

    engine.host.register(Plugin(), "meta-watcher")
    conversation = engine.conversation()
    engine.add_user(conversation, "hi", meta={"author_id": "42"})
    engine.add_user(conversation, "again")
    assert seen == [{"author_id": "42"}, {}]


def test_the_python_api_takes_spec_strings_and_says_where_a_stray_option_belongs(engine):
    conversation = engine.conversation()
    spec = engine.send(conversation, "hi", decoder="greedy no_repeat_ngram_size=2", max_new_tokens=3, seed=1)
    plain = engine.send(
        engine.conversation(),
        "hi",
        decoder="greedy",
        decoder_settings={"no_repeat_ngram_size": 2},
        max_new_tokens=3,
        seed=1,
    )
    assert spec.text() == plain.text() and spec.provenance["decoder"] == plain.provenance["decoder"]
    pair = engine.send(
        engine.conversation(), "hi", decoder=("greedy", {"no_repeat_ngram_size": 2}), max_new_tokens=3, seed=1
    )
    assert pair.text() == plain.text() and pair.provenance["decoder"] == plain.provenance["decoder"]
    with pytest.raises(OptionError, match="`no_repeat_ngram_size` is given in the decoder's pair and in"):
        engine.send(
            conversation,
            "hi",
            decoder=("greedy", {"no_repeat_ngram_size": 2}),
            decoder_settings={"no_repeat_ngram_size": 3},
        )
    for stray, where in (("temperature", "decoder_settings"), ("steer", "steerers=")):
        with pytest.raises(OptionError, match=f"unknown reply option '{stray}'.*{where}"):
            engine.send(conversation, "hi", **{stray: 0.5})
    with pytest.raises(
        OptionError, match="`no_repeat_ngram_size` is given in the decoder's spec and in decoder_settings"
    ):
        engine.send(
            conversation, "hi", decoder="greedy no_repeat_ngram_size=2", decoder_settings={"no_repeat_ngram_size": 3}
        )
    assert [turn.role for turn in conversation.turns] == ["user", "bot"]  # the refused ones added nothing
