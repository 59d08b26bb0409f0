"""The serving scheduler on a tiny random GPT-2: batched rows equal the same replies decoded alone."""

from __future__ import annotations

import re
import time

import pytest

from chatcore.engine import ReplyOptions
from chatcore.errors import PluginError
from chatcore.prompting import Message
from chatcore.serving import Scheduler, ServerBusy

PROMPTS = [
    "hi, how are you?",
    "what do you do for fun? i like to cook a lot and go hiking with my dog on weekends",
    "tell me about your dog",
    "ok",
    "do you like pizza or pasta more?",
]
OPTIONS = [
    ReplyOptions(decoder="greedy", max_new_tokens=12),
    ReplyOptions(decoder="top-k", seed=3, max_new_tokens=16),
    ReplyOptions(
        decoder="top-k",
        seed=5,
        max_new_tokens=10,
        steerers=[("bow-bias", {"topic": "food"})],
        decoder_settings={"top_p": 0.9, "repetition_penalty": 1.3},
    ),
    ReplyOptions(decoder="greedy", max_new_tokens=6, min_new_tokens=6, decoder_settings={"no_repeat_ngram_size": 2}),
    ReplyOptions(decoder="top-k", seed=11, max_new_tokens=14, decoder_settings={"temperature": 1.3}),
]


def alone(engine, prompt: str, options: ReplyOptions) -> list[int]:
    response = engine.reply_to([prompt], options)
    response.text()
    return response.token_ids


@pytest.mark.parametrize("prefill_chunk", [256, 5])
def test_batched_rows_equal_replies_decoded_alone(serving_engine, prefill_chunk):
    expected = [alone(serving_engine, p, o) for p, o in zip(PROMPTS, OPTIONS)]
    with Scheduler(serving_engine, max_batch=8, prefill_chunk=prefill_chunk) as scheduler:
        handles = [scheduler.submit([Message("user", p)], o) for p, o in zip(PROMPTS, OPTIONS)]
        for handle in handles:
            assert handle.wait(60)
    for handle, ids in zip(handles, expected):
        assert handle.error is None
        assert handle.token_ids == ids
    # One shared forward pass per step, not one per reply (long prompts read in chunks add a few).
    assert scheduler.steps < sum(len(ids) for ids in expected) - len(expected)
    assert scheduler.steps <= max(len(ids) for ids in expected) + (8 if prefill_chunk < 10 else 0)


def test_a_compiled_prompt_pass_is_never_left_one_token(serving_engine):
    """Where the prompt pass is compiled (``prompt_rest`` 2) a long prompt's chunks and a cached
    prefix leave it two tokens at least: a pass over one token would be a graph of its own,
    compiled in the middle of serving. The replies are unchanged."""
    texts = [f"{'very ' * index}{PROMPTS[1]}" for index in range(5)]  # five lengths in a row
    options = ReplyOptions(decoder="greedy", max_new_tokens=4)
    expected = [alone(serving_engine, text, options) for text in texts]
    with Scheduler(serving_engine, max_batch=8, prefill_chunk=5) as scheduler:
        runner = scheduler.runner
        runner.prompt_rest = 2
        lengths: list[int] = []
        rests: list[int] = []
        chunk = runner._prefill_chunk

        def spy(job):
            ran = chunk(job)
            if not ran:  # what is left for the prompt's pass, after its chunks or a cached prefix
                lengths.append(len(job.session.prompt_ids))
                rests.append(len(job.session.prompt_ids) - job.prefilled)
            return ran

        runner._prefill_chunk = spy
        handles = []
        for text in texts:
            handles.append(scheduler.submit([Message("user", text)], options))
            assert handles[-1].wait(60) and handles[-1].error is None
        # The first conversation asked again (its whole prompt is cached: a retry), then its
        # next turn: both reuse the first reply's keys.
        reply = serving_engine.loaded.tokenizer.decode(handles[0].token_ids, skip_special_tokens=True)
        for again in ([Message("user", texts[0])], [Message("user", texts[0]), Message("assistant", reply)]):
            handle = scheduler.submit([*again, Message("user", "and?")] if len(again) > 1 else again, options)
            assert handle.wait(60) and handle.error is None
        assert handle.provenance["prefix_cached_tokens"] > 0 and runner.prefix_cache.hits >= 2
    assert [handle.token_ids for handle in handles] == expected
    assert any(length % 5 == 1 for length in lengths)  # chunks of five alone would leave it one token
    assert len(rests) == 7 and min(rests) >= 2


def test_replies_join_a_running_batch_between_steps(serving_engine):
    long = ReplyOptions(decoder="top-k", seed=7, max_new_tokens=40, min_new_tokens=40)
    expected_long = alone(serving_engine, PROMPTS[1], long)
    expected = [alone(serving_engine, p, o) for p, o in zip(PROMPTS[2:], OPTIONS[2:])]
    with Scheduler(serving_engine, max_batch=4, prefill_chunk=4) as scheduler:
        first = scheduler.submit([Message("user", PROMPTS[1])], long)
        tokens = first.tokens()
        for _ in range(5):
            next(tokens)  # the long reply is running before the others arrive
        later = [scheduler.submit([Message("user", p)], o) for p, o in zip(PROMPTS[2:], OPTIONS[2:])]
        assert list(tokens) == expected_long[5:]
        for handle in later:
            assert handle.wait(60)
    assert first.token_ids == expected_long and first.finish_reason == "length"
    assert [h.token_ids for h in later] == expected


def test_a_long_history_row_beside_short_ones_keeps_every_reply(serving_engine):
    """Rows are not padded to the longest: the long row's attention runs on its own columns
    (the step is split), and every reply equals the same reply decoded alone."""
    history = []
    for index in range(12):
        history.append(Message("user" if index % 2 == 0 else "assistant", PROMPTS[1]))
    history.append(Message("user", "and what else?"))
    long = ReplyOptions(decoder="greedy", max_new_tokens=24, min_new_tokens=24)
    expected_long = list(alone_messages(serving_engine, history, long))
    expected = [alone(serving_engine, p, o) for p, o in zip(PROMPTS, OPTIONS)]
    with Scheduler(serving_engine, max_batch=8) as scheduler:
        first = scheduler.submit(history, long)
        tokens = first.tokens()
        next(tokens)  # the long row decodes before the short ones join
        handles = [scheduler.submit([Message("user", p)], o) for p, o in zip(PROMPTS, OPTIONS)]
        assert [next(tokens), *tokens] == expected_long[1:]
        for handle in handles:
            assert handle.wait(60) and handle.error is None
    assert [h.token_ids for h in handles] == expected
    assert scheduler.runner.batch.split_steps > 0


def test_a_failing_steerer_fails_its_row_alone(serving_engine):
    options = ReplyOptions(decoder="greedy", max_new_tokens=10, min_new_tokens=10)
    expected = alone(serving_engine, PROMPTS[0], options)
    failing = ReplyOptions(
        decoder="greedy", max_new_tokens=10, min_new_tokens=10, steerers=[("failing-shared", {"at_step": 3})]
    )
    with Scheduler(serving_engine) as scheduler:
        bad = scheduler.submit([Message("user", PROMPTS[2])], failing)
        good = scheduler.submit([Message("user", PROMPTS[0])], options)
        assert good.wait(60) and bad.wait(60)
    assert bad.finish_reason == "error" and isinstance(bad.error, PluginError)
    assert "failing-shared" in str(bad.error) and "boom" in str(bad.error)
    assert len(bad.token_ids) == 3
    assert good.error is None and good.token_ids == expected
    with pytest.raises(PluginError, match="failing-shared"):
        list(bad.tokens())


def test_a_steerer_that_passes_the_model_a_broken_state_is_blamed_for_it(serving_engine):
    """The model failing on the state a steerer's step passed on is that steerer's failure,
    named and reported as one, through the scheduler and alone."""
    options = ReplyOptions(decoder="greedy", max_new_tokens=10, min_new_tokens=10)
    expected = alone(serving_engine, PROMPTS[0], options)
    cutting = ReplyOptions(decoder="greedy", steerers=[("cuts-state", {})], max_new_tokens=10, min_new_tokens=10)
    says = "steerer 'cuts-state' failed while generating: the model failed on the state it passed on: "
    with Scheduler(serving_engine) as scheduler:
        good = scheduler.submit([Message("user", PROMPTS[0])], options)
        bad = scheduler.submit([Message("user", PROMPTS[2])], cutting)
        assert good.wait(60) and bad.wait(60)
    assert isinstance(bad.error, PluginError) and says in str(bad.error), bad.error
    assert bad.error.plugin == "test-serving" and len(bad.token_ids) == 2
    assert good.error is None and good.token_ids == expected
    with pytest.raises(PluginError, match=re.escape(says)):
        serving_engine.reply_to([PROMPTS[2]], cutting).text()
    assert any(p.plugin == "test-serving" and "cuts-state" in p.stage for p in serving_engine.host.problems)


@pytest.mark.parametrize(
    "decoder, steerers, says",
    [
        ("wrong-ids what=far", [], "decoder 'wrong-ids' failed while generating: ValueError: select chose token id"),
        ("wrong-ids what=negative", [], "ValueError: select chose token id -5, outside the scores' 0 to"),
        ("wrong-ids what=float", [], "TypeError: select returned torch.float32 values: token ids are integers"),
        ("wrong-ids what=shape", [], "ValueError: select returned shape (1, 2) for 1 row(s): (1,) is needed"),
        (
            "greedy",
            [("wrong-scores", {"what": "none"})],
            "steerer 'wrong-scores' failed while generating: TypeError: its step returned NoneType",
        ),
        (
            "greedy",
            [("wrong-scores", {"what": "narrow"})],
            "steerer 'wrong-scores' failed while generating: ValueError: its step returned logits of shape (1, 100)",
        ),
        (
            "wrong-ids what=nan",
            [],
            "decoder 'wrong-ids' failed while generating: ValueError: select was given scores with NaN or a row of",
        ),
        (
            "greedy",
            [("wrong-scores", {"what": "integers"})],
            "steerer 'wrong-scores' failed while generating: TypeError: its step returned logits of torch.int64",
        ),
        (
            "greedy",
            [("wrong-scores", {"what": "nan"})],
            "steerer 'wrong-scores' failed while generating: ValueError: its step left scores with NaN",
        ),
        (
            "greedy",
            [("wrong-scores", {"what": "chatcore-error"})],
            "steerer 'wrong-scores' failed while generating: ChatcoreError: layer 99 is outside the model's blocks",
        ),
        (
            "greedy",
            [("wrong-scores", {"what": "banned"})],
            "steerer 'wrong-scores' failed while generating: ValueError: its step left scores with NaN or a row of no",
        ),
        (
            "top-k",
            [("wrong-scores", {"what": "nan"})],
            "steerer 'wrong-scores' failed while generating: ValueError: its step left scores with NaN",
        ),
        (
            "top-k",
            [("wrong-scores", {"what": "banned"})],
            "steerer 'wrong-scores' failed while generating: ValueError: its step left scores with NaN or a row of no",
        ),
    ],
)
def test_a_plugin_choosing_impossible_tokens_fails_its_row_alone(serving_engine, decoder, steerers, says):
    """A decoder that chooses ids outside the vocabulary (or not ids), or a steerer returning no
    scores or fewer of them, ends its own reply with an error naming it; the replies sharing
    the batch with it go on as alone."""
    options = ReplyOptions(decoder="greedy", max_new_tokens=10, min_new_tokens=10)
    expected = alone(serving_engine, PROMPTS[0], options)
    name, _, setting = decoder.partition(" ")
    settings = dict([setting.split("=")]) if setting else {}
    wrong = ReplyOptions(decoder=name, decoder_settings=settings, steerers=steerers, max_new_tokens=10)
    with Scheduler(serving_engine) as scheduler:
        good = scheduler.submit([Message("user", PROMPTS[0])], options)
        bad = scheduler.submit([Message("user", PROMPTS[2])], wrong)
        assert good.wait(60) and bad.wait(60)
    assert bad.finish_reason == "error" and isinstance(bad.error, PluginError), bad.error
    assert says in str(bad.error) and len(bad.token_ids) == 2
    assert good.error is None and good.token_ids == expected


@pytest.mark.parametrize("steerer", ["negate", "negate-beside"])  # on the scheduler's thread, on the worker
def test_steerers_that_cannot_share_are_decoded_beside_the_batch(serving_engine, steerer):
    options = [ReplyOptions(decoder="greedy", max_new_tokens=8, steerers=[(steerer, {})]), OPTIONS[1]]
    expected = [alone(serving_engine, p, o) for p, o in zip(PROMPTS, options)]
    with Scheduler(serving_engine) as scheduler:
        handles = [scheduler.submit([Message("user", p)], o) for p, o in zip(PROMPTS, options)]
        for handle in handles:
            assert handle.wait(60)
    assert [h.token_ids for h in handles] == expected
    assert len(scheduler.runner) == 0 and not scheduler.runner.batch.jobs


def test_a_slow_eager_step_does_not_hold_the_batch_back(serving_engine):
    """A reply whose steerer runs beside the batch (``runs_beside``) is stuck in one step; the
    shared replies finish meanwhile, and the stuck one ends as it would alone once let go."""
    from serving_steerers import step_gate

    gate = step_gate("slow-eager-step")
    held = ReplyOptions(
        decoder="greedy", max_new_tokens=6, min_new_tokens=6, steerers=[("held-beside", {"gate": "slow-eager-step"})]
    )
    long = ReplyOptions(decoder="top-k", seed=7, max_new_tokens=30, min_new_tokens=30)
    try:
        with Scheduler(serving_engine) as scheduler:
            shared = scheduler.submit([Message("user", PROMPTS[1])], long)
            eager = scheduler.submit([Message("user", PROMPTS[0])], held)
            assert gate.entered.wait(60)
            assert shared.wait(60) and shared.finish_reason == "length" and len(shared.token_ids) == 30
            assert eager.finish_reason is None  # still in its step
            gate.release.set()
            assert eager.wait(60)
    finally:
        gate.release.set()
    assert shared.token_ids == alone(serving_engine, PROMPTS[1], long)
    assert eager.error is None and eager.token_ids == alone(serving_engine, PROMPTS[0], held)


def test_cancelling_frees_the_slot_at_once(serving_engine):
    endless = ReplyOptions(decoder="greedy", max_new_tokens=100, min_new_tokens=100, steerers=[("slow", {})])
    with Scheduler(serving_engine, max_batch=1, max_waiting=0) as scheduler:
        first = scheduler.submit([Message("user", "hi")], endless)
        stream = first.tokens()
        next(stream)
        with pytest.raises(ServerBusy, match="busy"):
            scheduler.submit([Message("user", "hello")], endless)
        first.cancel()
        second = scheduler.submit([Message("user", "hello")], ReplyOptions(decoder="greedy", max_new_tokens=4))
        assert second.wait(60) and first.wait(60)
    assert first.finish_reason == "cancelled" and len(first.token_ids) < 100
    assert list(stream) == first.token_ids[1:]  # the stream ends, without an error
    assert second.finish_reason in ("stop", "length") and second.error is None


def test_a_reader_that_stops_reading_cancels_its_reply(serving_engine):
    endless = ReplyOptions(decoder="greedy", max_new_tokens=100, min_new_tokens=100, steerers=[("slow", {})])
    with Scheduler(serving_engine) as scheduler:
        handle = scheduler.submit([Message("user", "hi")], endless)
        for _ in handle.response(serving_engine.tokenizer):
            break  # the Response closes its token stream
        assert handle.wait(10)
    assert handle.finish_reason == "cancelled"


def test_respond_records_the_reply_in_the_conversation(serving_engine):
    conversation = serving_engine.conversation(system="You are terse.")
    serving_engine.add_user(conversation, "hi there")
    expected = serving_engine.conversation(system="You are terse.")
    serving_engine.add_user(expected, "hi there")
    options = ReplyOptions(decoder="top-k", seed=1, max_new_tokens=12)
    with Scheduler(serving_engine) as scheduler:
        response = scheduler.respond(conversation, options)
        text = response.text()
    assert text == serving_engine.respond(expected, options).text()
    assert conversation.turns[-1].role == "bot" and conversation.turns[-1].text == text
    assert response.provenance["seed"] == 1 and response.provenance["finish_reason"] in ("stop", "length")


def test_bad_options_fail_the_request_alone(serving_engine):
    with Scheduler(serving_engine) as scheduler:
        bad = scheduler.submit([Message("user", "hi")], ReplyOptions(decoder="no-such-decoder"))
        empty = scheduler.submit([Message("system", "only a system prompt")], ReplyOptions(decoder="greedy"))
        good = scheduler.submit([Message("user", "hi")], ReplyOptions(decoder="greedy", max_new_tokens=3))
        assert bad.wait(60) and empty.wait(60) and good.wait(60)
    assert bad.finish_reason == "error" and "no-such-decoder" in str(bad.error)
    assert empty.finish_reason == "error" and "no turns" in str(empty.error)
    assert good.error is None and good.token_ids


def test_options_as_a_dict_and_a_failing_setup_check_end_their_requests_alone(serving_engine, monkeypatch):
    """submit reads a dict of options as the engine does (bad ones raise at once); a request
    whose setup check raises ends with its error, and the others admitted with it reply."""
    from chatcore.errors import OptionError

    with Scheduler(serving_engine) as scheduler:
        as_dict = scheduler.submit([Message("user", "hi")], {"decoder": "greedy", "max_new_tokens": 3})
        expected = scheduler.submit([Message("user", "hi")], ReplyOptions(decoder="greedy", max_new_tokens=3))
        assert as_dict.wait(60) and expected.wait(60)
        assert as_dict.error is None and as_dict.token_ids == expected.token_ids
        with pytest.raises(OptionError, match="unknown reply option 'sed'"):
            scheduler.submit([Message("user", "hi")], {"sed": 1})
        checked = serving_engine.setups_missing

        def broken(options: ReplyOptions) -> bool:
            if options.seed == 7:
                raise RuntimeError("the setup check broke")
            return checked(options)

        monkeypatch.setattr(serving_engine, "setups_missing", broken)
        with scheduler.together():
            bad = scheduler.submit([Message("user", "hi")], ReplyOptions(decoder="greedy", seed=7, max_new_tokens=3))
            good = scheduler.submit([Message("user", "hi")], ReplyOptions(decoder="greedy", seed=1, max_new_tokens=3))
        assert bad.wait(60) and good.wait(60)
    assert bad.finish_reason == "error" and "the setup check broke" in str(bad.error)
    assert good.error is None and good.token_ids == expected.token_ids


def test_scheduler_settings_are_checked(serving_engine):
    from chatcore.errors import OptionError

    with pytest.raises(OptionError, match="max_batch"):
        Scheduler(serving_engine, max_batch=0)


@pytest.mark.parametrize(
    "deltas, stops, expected, hit",
    [
        (["hello wor", "ld, fine"], ["world"], "hello ", True),
        (["ab", "c<", "|us", "er|>", "tail"], ["<|user|>"], "abc", True),
        (["a <", "b"], ["<|user|>"], "a <b", False),
        (["xyz"], ["y", "xy"], "", True),
        (["no stop here"], [], "no stop here", False),
    ],
)
def test_stop_strings_hold_back_what_may_start_one(deltas, stops, expected, hit):
    from chatcore.serving.stops import StopStrings

    stop = StopStrings(stops)
    emitted = [stop.push(delta) for delta in deltas]
    text = "".join(emitted) + stop.flush()
    assert text == expected and stop.hit is hit
    if stops == ["<|user|>"] and not hit:
        assert emitted[0] == "a "  # "<" might begin the stop string


def test_stop_strings_must_be_text():
    from chatcore.serving.stops import StopStrings

    with pytest.raises(ValueError, match="stop"):
        StopStrings([""])


@pytest.mark.parametrize(
    "options",
    [
        ReplyOptions(decoder="greedy", max_new_tokens=10),
        ReplyOptions(decoder="top-k", seed=21, max_new_tokens=12, steerers=[("bow-bias", {"topic": "food"})]),
    ],
)
def test_prefix_cache_reuses_earlier_turns_with_the_same_tokens(serving_engine, options):
    user_turns = ["hi, how are you doing today?", "what do you like to eat?", "and what about dessert?"]
    expected = serving_engine.conversation(system="You like food.")
    cached = serving_engine.conversation(system="You like food.")
    with Scheduler(serving_engine) as scheduler:
        for text in user_turns:
            serving_engine.add_user(expected, text)
            serving_engine.add_user(cached, text)
            plain = serving_engine.respond(expected, options)
            plain.text()
            reply = scheduler.respond(cached, options)
            reply.text()
            assert reply.token_ids == plain.token_ids
        reused = [turn.meta["provenance"]["prefix_cached_tokens"] for turn in cached.turns if turn.role == "bot"]
    assert reused[0] == 0 and all(count > 10 for count in reused[1:])
    assert scheduler.prefix_cache.hits == 2 and scheduler.prefix_cache.reused_tokens == sum(reused)


def test_replies_admitted_together_reuse_a_shared_history(serving_engine):
    """Requests that share a history and differ in the last message, submitted at once:
    the first one's prompt is reused by the others, whichever conversation it came from."""
    history = [
        Message("system", "You like food."),
        Message("user", "hi, how are you doing today?"),
        Message("assistant", "pretty good, just cooked some pasta"),
    ]
    lasts = ["what sauce?", "do you like pizza too?", "and dessert?"]
    options = ReplyOptions(decoder="greedy", max_new_tokens=6)
    expected = [list(alone_messages(serving_engine, [*history, Message("user", last)], options)) for last in lasts]
    with Scheduler(serving_engine) as scheduler:
        handles = [scheduler.submit([*history, Message("user", last)], options) for last in lasts]
        for handle in handles:
            assert handle.wait(60) and handle.error is None
    assert [h.token_ids for h in handles] == expected
    reused = [h.provenance["prefix_cached_tokens"] for h in handles]
    assert reused[0] == 0 and all(count > 10 for count in reused[1:])


def alone_messages(engine, messages, options):
    return engine.reply_tokens(engine.prepare_reply(messages, options))


@pytest.fixture(scope="module", params=["llama", "mistral"])
def template_engine(request, tiny_chat_model_dir):
    """An engine on a tiny chat model (chat template, rotary positions) of each architecture."""
    from chatcore.testing import make_engine

    return make_engine(tiny_chat_model_dir(request.param), "chatcore.plugins.bow_bias")


def test_chat_models_batch_and_reuse_prefixes_exactly(template_engine):
    """Rotary positions, grouped-query attention and a chat template: left padding and cached
    prefixes must not move any row's positions."""
    messages = [[Message("system", "Be brief."), Message("user", p)] for p in PROMPTS[:4]]
    expected = []
    for message_list, options in zip(messages, OPTIONS[:4]):
        reply = template_engine.prepare_reply(message_list, options)
        expected.append(list(template_engine.reply_tokens(reply)))
    with Scheduler(template_engine) as scheduler:
        handles = [scheduler.submit(m, o) for m, o in zip(messages, OPTIONS[:4])]
        for handle in handles:
            assert handle.wait(60)
        assert [h.token_ids for h in handles] == expected
        # The next turn of the first conversation starts with what the first reply fed the model.
        text = template_engine.tokenizer.decode(handles[0].token_ids)
        follow = messages[0] + [Message("assistant", text), Message("user", "and then?")]
        again = scheduler.submit(follow, OPTIONS[0])
        again.wait(60)
        assert again.token_ids == list(template_engine.reply_tokens(template_engine.prepare_reply(follow, OPTIONS[0])))
    # Mistral's sliding-window cache layers cannot be stacked: its replies decode beside the batch.
    merged = template_engine.loaded.model.config.model_type == "llama"
    assert scheduler.runner._can_merge is merged
    assert (again.provenance.get("prefix_cached_tokens", 0) > 10) is merged


def test_replies_beside_the_batch_interleave_and_cancel_cleanly(serving_engine):
    lone = ReplyOptions(decoder="greedy", max_new_tokens=30, min_new_tokens=30, steerers=[("negate", {})])
    expected = alone(serving_engine, PROMPTS[0], lone)
    with Scheduler(serving_engine) as scheduler:
        first = scheduler.submit([Message("user", PROMPTS[0])], lone)
        second = scheduler.submit([Message("user", PROMPTS[1])], lone)
        stream = second.tokens()
        next(stream)
        second.cancel()
        assert first.wait(60) and second.wait(60)
        after = scheduler.submit([Message("user", PROMPTS[2])], OPTIONS[2])
        assert after.wait(60)
    assert first.token_ids == expected and second.finish_reason == "cancelled"
    assert after.error is None and after.token_ids == alone(serving_engine, PROMPTS[2], OPTIONS[2])


def test_a_listener_that_fails_cancels_only_its_reply(serving_engine):
    def gone(event) -> None:
        raise RuntimeError("event loop is closed")

    with Scheduler(serving_engine) as scheduler:
        orphan = scheduler.submit(
            [Message("user", "hi")], ReplyOptions(decoder="greedy", max_new_tokens=20, min_new_tokens=20), listener=gone
        )
        other = scheduler.submit([Message("user", "hello")], OPTIONS[0])
        assert orphan.wait(60) and other.wait(60)
    assert orphan.finish_reason == "cancelled" and len(orphan.token_ids) < 20
    assert other.token_ids == alone(serving_engine, "hello", OPTIONS[0])


def test_eval_on_the_scheduler_gives_the_same_replies(serving_engine):
    from chatcore.evaluation.prompts import EvalContext
    from chatcore.evaluation.runner import evaluate

    contexts = [EvalContext([p]) for p in PROMPTS] + [EvalContext(["hi", "hello!", "how are you?"])]
    options = ReplyOptions(decoder="top-k", max_new_tokens=10, steerers=[("bow-bias", {"topic": "food"})])
    alone_report = evaluate(serving_engine, contexts, options, seed=5)
    with Scheduler(serving_engine) as scheduler:
        batched_report = evaluate(serving_engine, contexts, options, seed=5, scheduler=scheduler)
        assert scheduler.steps <= 10
    assert batched_report.samples == alone_report.samples
    assert batched_report.rows[0].perplexity == alone_report.rows[0].perplexity
    assert batched_report.rows[0].tokens_per_s > 0


def test_the_chat_command_decodes_on_the_scheduler(tiny_model_dir, host):
    from chatcore.adapters.repl.app import ChatConfig, build_state, close_state
    from chatcore.adapters.repl.state import ChatState

    config = ChatConfig(model=str(tiny_model_dir), decoder_spec="top-k", max_new_tokens=8, seed=1, no_log=True)
    state = build_state(config, host, say=lambda message: None)
    plain = ChatState(state.engine, state.options, next_seed=1)
    try:
        assert state.scheduler is not None
        for text in ("hi there, how are you doing today?", "what did you do this weekend?"):
            reply = state.send(text)
            assert reply.text() == plain.send(text).text()
        assert reply.provenance["prefix_cached_tokens"] > 10
        interrupted = state.send("and tomorrow?")
        interrupted.interrupt()  # never read: its reply stops being decoded
        assert state.scheduler.in_flight() == 0
    finally:
        close_state(state)


def test_eval_command_batches_with_the_same_replies(tiny_model_dir, tmp_path):
    import json

    from click.testing import CliRunner

    from chatcore.cli import build_cli

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hi there\nwhat do you do for fun?\ndo you like pizza?\nok\n", encoding="utf-8")
    reports = []
    for batch in ("1", "3"):
        out = tmp_path / f"report-{batch}.json"
        result = CliRunner().invoke(
            build_cli(),
            [
                "eval",
                "--model",
                str(tiny_model_dir),
                "--prompts",
                str(prompts),
                "-n",
                "8",
                "--batch",
                batch,
                "--json",
                str(out),
            ],
        )
        assert result.exit_code == 0, result.output
        reports.append(json.loads(out.read_text()))
    assert [s["reply"] for s in reports[0]["samples"]] == [s["reply"] for s in reports[1]["samples"]]
    assert len(reports[0]["samples"]) == 4


def test_a_reply_cancelled_while_its_prompt_is_read_frees_its_slot(serving_engine):
    slow = ReplyOptions(decoder="greedy", max_new_tokens=5, steerers=[("slow", {})])
    with Scheduler(serving_engine, max_batch=1, max_waiting=0, prefill_chunk=1) as scheduler:
        handle = scheduler.submit([Message("user", " ".join(PROMPTS))], slow)
        deadline = time.monotonic() + 600  # a hang guard: a loaded machine only makes it slower
        while not scheduler.runner.prefilling() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert scheduler.runner.prefilling()  # cancelled while its prompt is being read, not before
        handle.cancel()
        assert handle.wait(10) and handle.finish_reason == "cancelled" and not handle.token_ids
        after = scheduler.submit([Message("user", "hi")], OPTIONS[0])
        assert after.wait(60) and after.token_ids == alone(serving_engine, "hi", OPTIONS[0])
    assert not scheduler.runner.prefilling()


def test_a_replys_timings_add_up_through_the_scheduler_and_alone(serving_engine):
    """Queued, then the first token, then the whole reply: measured from one moment, whichever
    entry point decoded it (a reply of several rows sends every token at its end)."""
    serving_engine.host.load_modules(("chatcore.plugins.mmi.plugin",))
    options = ReplyOptions(
        decoder="mmi", decoder_settings={"candidates": 2, "allow_retokenize": True}, seed=1, max_new_tokens=6
    )
    conversation = serving_engine.conversation()
    serving_engine.add_user(conversation, "hi there")
    with Scheduler(serving_engine) as scheduler:
        through_scheduler = scheduler.respond(conversation, options)
        through_scheduler.text()
    alone = serving_engine.reply_to(["hi there"], options)
    alone.text()
    for response in (through_scheduler, alone):
        timings = response.provenance["timings"]
        assert 0 <= timings["queued_s"] <= timings["first_token_s"] <= timings["total_s"], timings


@pytest.mark.parametrize(
    "lengths, width, long_rows",
    [
        ([12] * 8 + [400], 12, ((8, 400),)),  # one long history: it attends alone over its own columns
        ([30, 31, 29, 30], 31, ()),  # alike: one call over the longest
        ([5, 300, 7, 310], 7, ((1, 300), (3, 310))),
        ([100, 140], 140, ()),  # a second call would cost more than the padding it saves
    ],
)
def test_a_steps_attention_is_split_where_it_reads_fewer_columns(lengths, width, long_rows):
    from chatcore.serving.slots import ragged_plan

    plan = ragged_plan(lengths)
    assert (plan.width, plan.long_rows) == (width, long_rows)


def test_prompts_that_start_together_are_read_in_one_pass(serving_engine):
    """Replies that start at the same step have their prompts read in one packed pass (each
    token sees only its own prompt), with the same replies as each decoded alone; a prompt that
    shares a history with one of them waits a step and reuses that one's keys."""
    from chatcore.serving.prefix_cache import PrefixCache
    from chatcore.serving.requests import Handle
    from chatcore.serving.runner import Runner

    history = [Message("system", "You like food."), Message("user", "hi, how are you doing today?")]
    conversations = [[Message("user", p)] for p in PROMPTS[:4]]
    conversations += [[*history, Message("user", "what sauce?")], [*history, Message("user", "and dessert?")]]
    options = [ReplyOptions(decoder="greedy", max_new_tokens=8), OPTIONS[1], OPTIONS[3], OPTIONS[4]] + [
        ReplyOptions(decoder="greedy", max_new_tokens=6)
    ] * 2
    expected = [list(alone_messages(serving_engine, m, o)) for m, o in zip(conversations, options)]
    runner = Runner(serving_engine.loaded, serving_engine, PrefixCache(2**24))
    handles = []
    for messages, option in zip(conversations, options):
        reply = serving_engine.prepare_reply(messages, option)
        handles.append(Handle())
        runner.add(handles[-1], serving_engine.start_session(reply), reply.decoder, handles[-1].provenance)
    while runner.jobs:
        runner.step()
    assert [h.error for h in handles] == [None] * len(handles)
    assert [h.token_ids for h in handles] == expected
    assert runner.packed_prefills == 1
    assert handles[4].provenance["prefix_cached_tokens"] == 0 and handles[5].provenance["prefix_cached_tokens"] > 10


def test_prompts_with_long_cached_histories_are_read_together_exactly(serving_engine):
    """Prompts that continue a long cached history start in one packed pass, each prompt's
    attention over its own keys only (the split), with the same replies as each decoded alone."""
    from chatcore.serving.prefix_cache import PrefixCache
    from chatcore.serving.requests import Handle
    from chatcore.serving.runner import Runner
    from chatcore.serving.slots import packed_plan

    history = [Message("user" if i % 2 == 0 else "assistant", PROMPTS[1]) for i in range(8)]
    lasts = [f"{index} {('ok', 'why?', 'and then?', 'tell me more')[index % 4]}" for index in range(16)]
    options = ReplyOptions(decoder="greedy", max_new_tokens=5)
    expected = [list(alone_messages(serving_engine, [*history, Message("user", m)], options)) for m in lasts]
    runner = Runner(serving_engine.loaded, serving_engine, PrefixCache(2**24))

    def add(last: str) -> Handle:
        reply = serving_engine.prepare_reply([*history, Message("user", last)], options)
        handle = Handle()
        handle.provenance = reply.provenance
        runner.add(handle, serving_engine.start_session(reply), reply.decoder, handle.provenance)
        return handle

    add("hi")  # its prompt fills the prefix cache
    while runner.jobs:
        runner.step()
    handles = [add(last) for last in lasts]
    while runner.jobs:
        runner.step()
    assert [h.token_ids for h in handles] == expected
    assert runner.packed_prefills == 1
    cached = [h.provenance["prefix_cached_tokens"] for h in handles]
    prompts = [h.provenance["prompt_tokens"] for h in handles]
    assert min(cached) > 100
    assert packed_plan(cached, [p - c for p, c in zip(prompts, cached)]) is not None  # the split was taken


def test_a_gpu_reads_a_burst_of_prompts_in_one_attention_call():
    """On a GPU a call costs about a million scores: 32 short prompts with no history, or 16
    after 2,000 cached tokens each, are read in one masked call; 4 after 100,000 are split."""
    from chatcore.serving.slots import CALL_COST_SCORES_GPU, packed_plan

    assert packed_plan([0] * 32, [50] * 32) is not None  # on the CPU the burst is split
    assert packed_plan([0] * 32, [50] * 32, CALL_COST_SCORES_GPU) is None
    assert packed_plan([2000] * 16, [50] * 16, CALL_COST_SCORES_GPU) is None
    assert packed_plan([100_000] * 4, [50] * 4, CALL_COST_SCORES_GPU) is not None


def test_replies_sharing_a_history_beyond_a_cached_system_prompt_reuse_it(serving_engine):
    """The prefix cache holds a system prompt; replies admitted together share a longer
    history after it: the first one's prompt is read, the others wait a step and reuse it."""
    system = Message("system", "You like food and you always talk about cooking at home.")
    history = [system, *[Message("user" if i % 2 == 0 else "assistant", PROMPTS[1]) for i in range(4)]]
    lasts = ["what sauce?", "do you like pizza too?", "and dessert?"]
    options = ReplyOptions(decoder="greedy", max_new_tokens=4)
    expected = [list(alone_messages(serving_engine, [*history, Message("user", m)], options)) for m in lasts]
    with Scheduler(serving_engine) as scheduler:
        first = scheduler.submit([system, Message("user", "hi")], options)
        assert first.wait(60) and first.provenance["prefix_cached_tokens"] == 0
        handles = [scheduler.submit([*history, Message("user", m)], options) for m in lasts]
        for handle in handles:
            assert handle.wait(60) and handle.error is None
    assert [h.token_ids for h in handles] == expected
    reused = [h.provenance["prefix_cached_tokens"] for h in handles]
    assert reused[0] > 10 and all(count > reused[0] + 40 for count in reused[1:])


@pytest.mark.parametrize("budget", [0, 2**24])
def test_a_burst_sharing_a_system_prompt_is_read_at_once_whatever_the_prefix_cache(template_engine, budget):
    """Eight requests that share a system prompt, admitted together: with no prefix cache
    (budget 0) their prompts are read in one packed pass; with one, the first is read, and
    the rest a step later reusing its keys; never one prompt a step. Replies as alone."""
    from chatcore.serving.prefix_cache import PrefixCache
    from chatcore.serving.requests import Handle
    from chatcore.serving.runner import Runner

    system = Message("system", "You like food and you always talk about cooking at home.")
    options = ReplyOptions(decoder="greedy", max_new_tokens=4, min_new_tokens=4)
    conversations = [[system, Message("user", f"question {index}: what do you cook?")] for index in range(8)]
    expected = [list(alone_messages(template_engine, messages, options)) for messages in conversations]
    runner = Runner(template_engine.loaded, template_engine, PrefixCache(budget))
    handles = []
    for messages in conversations:
        reply = template_engine.prepare_reply(messages, options)
        handle = Handle()
        handle.provenance = reply.provenance
        runner.add(handle, template_engine.start_session(reply), reply.decoder, handle.provenance)
        handles.append(handle)
    steps = 0
    while runner.jobs:
        runner.step()
        steps += 1
    assert [h.token_ids for h in handles] == expected
    assert steps <= 4 + (1 if budget else 0)
    reused = [h.provenance.get("prefix_cached_tokens", 0) for h in handles]
    if runner._can_merge:  # Mistral's sliding-window caches decode beside the batch, uncached
        assert (min(reused[1:]) > 10) is bool(budget)


def test_a_setup_is_made_beside_the_replies_in_flight(serving_engine):
    """A reply whose steerer must first be set up (as loading a reverse model) does not stop the
    batch: a reply submitted after it runs to its end while the setup waits, and the held reply
    follows once its setup is made; a cancel during the setup ends it at once."""
    from serving_steerers import step_gate

    with Scheduler(serving_engine, max_batch=4) as scheduler:
        held = step_gate("setup-beside")
        slow = ReplyOptions(decoder="greedy", max_new_tokens=4, steerers=[("held-setup", {"gate": "setup-beside"})])
        waiting = scheduler.submit([Message("user", "hi")], slow)
        assert held.entered.wait(60)  # its setup has begun
        plain = scheduler.submit([Message("user", "hello")], ReplyOptions(decoder="greedy", max_new_tokens=4))
        assert plain.wait(60) and plain.finish_reason in ("length", "stop")
        assert not waiting.finished.is_set() and scheduler.setting_up() == 1  # as /health shows it
        held.release.set()
        assert waiting.wait(60) and waiting.finish_reason in ("length", "stop")
        assert scheduler.setting_up() == 0
        # the setup changed nothing of the reply: the same tokens as the plain greedy reply to "hi"
        assert waiting.token_ids == alone(serving_engine, "hi", ReplyOptions(decoder="greedy", max_new_tokens=4))

        cancelled_gate = step_gate("setup-cancelled")
        options = ReplyOptions(decoder="greedy", steerers=[("held-setup", {"gate": "setup-cancelled"})])
        cancelled = scheduler.submit([Message("user", "hi")], options)
        assert cancelled_gate.entered.wait(60)
        cancelled.cancel()
        assert cancelled.wait(60) and cancelled.finish_reason == "cancelled"
        cancelled_gate.release.set()
