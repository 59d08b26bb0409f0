"""The ``mmi`` decoder and chatcore.plugins.mmi.reranking: batched candidates, reverse scores, selection."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import chatcore
from chatcore.engine import Engine, ReplyOptions
from chatcore.errors import ModelLoadError, OptionError
from chatcore.explain import explain
from chatcore.models import load_model
from chatcore.plugins.mmi import reranking
from chatcore.plugins.mmi.plugin import MMIDecoder, choose, combined_scores
from chatcore.steering import Steerer
from chatcore.step import Step, StepState
from chatcore.text import encode_text


@pytest.fixture
def mmi_host(host):
    host.load_modules(("chatcore.plugins.mmi.plugin",))
    assert host.problems == []
    return host


@pytest.fixture(scope="module")
def bundled_reverse():
    return reranking.load_reverse_model("chatcore-tiny-reverse", device="cpu")


@dataclasses.dataclass
class EndRowsSettings:
    pass


class EndRowsAtOwnStep(Steerer):
    """Test steerer: row r must end at step r (EOS certain), and no row may end before it."""

    name = "end-rows"
    Settings = EndRowsSettings
    eos = 0
    steps_seen = 0

    def prepare(self, session) -> None:
        self.eos = session.eos_token_id
        self.steps_seen = 0

    def wrap(self, step: Step) -> Step:
        def steered(state: StepState):
            output = step(state)
            logits = output.logits.clone()
            for row in range(logits.size(0)):
                logits[row, self.eos] = 1e4 if row == state.step else float("-inf")
            self.steps_seen = state.step + 1
            return output.replace(logits=logits)

        return steered


class EndRowsPlugin:
    """Registers the test steerer through the public hook, as a plugin would."""

    @chatcore.hookimpl
    def register_steerers(self, register):
        register(EndRowsAtOwnStep)


# -- selection ---------------------------------------------------------------------------


def test_choose_argmax_picks_the_highest_score():
    scores = [-12.0, -3.5, -7.25, -3.6]
    assert choose(scores, [True] * 4) == 1
    assert choose([-1.0, -1.0, -2.0], [True] * 3) == 0  # ties: the first


def test_empty_candidates_never_win_unless_all_are_empty():
    scores = [-1.0, -5.0, -2.0]
    assert choose(scores, [False, True, True]) == 2
    assert choose(scores, [False, False, False]) == 0


def test_sampled_selection_is_seeded_eligible_and_sharpens_to_argmax():
    scores = [-4.0, -1.0, -3.0, -0.5]
    eligible = [True, True, True, False]
    draws = [choose(scores, eligible, "sample", 1.0, torch.Generator().manual_seed(s)) for s in range(40)]
    assert set(draws) <= {0, 1, 2} and len(set(draws)) > 1
    again = [choose(scores, eligible, "sample", 1.0, torch.Generator().manual_seed(s)) for s in range(40)]
    assert draws == again
    cold = {choose(scores, eligible, "sample", 0.01, torch.Generator().manual_seed(s)) for s in range(20)}
    assert cold == {1}


def test_combined_score_adds_the_weighted_forward_score():
    assert combined_scores([-2.0, -1.0], [-5.0, -6.0], 0.0) == [-5.0, -6.0]
    assert combined_scores([-2.0, -1.0], [-5.0, -6.0], 0.5) == [-6.0, -6.5]


# -- scoring -----------------------------------------------------------------------------


def test_reranking_picks_the_reply_with_the_highest_reverse_score(bundled_model, bundled_reverse):
    """A constructed case: on-topic replies explain the source far better than generic ones."""
    tokenizer = bundled_reverse.tokenizer
    source = [encode_text(tokenizer, "do you like pizza?")]
    texts = ["ok", "i do not know", "yes, pizza with extra cheese is my favorite food", "lol", "i like it"]
    candidates = [encode_text(tokenizer, t) for t in texts]
    scores = [s.total for s in reranking.reverse_scores(bundled_reverse, candidates, source)]
    best = max(range(len(texts)), key=scores.__getitem__)
    assert texts[best] == texts[2], dict(zip(texts, scores))
    assert choose(combined_scores([0.0] * len(texts), scores, 0.0), [True] * len(texts)) == best


def test_batch_scoring_equals_one_at_a_time(bundled_model, bundled_reverse):
    tokenizer = bundled_reverse.tokenizer
    source = [encode_text(tokenizer, "what did you do this weekend?"), encode_text(tokenizer, "hey there")]
    texts = [
        "i went hiking with my friends up in the mountains",
        "nothing",
        "",
        "we watched a movie and then got pizza",
    ]
    candidates = [encode_text(tokenizer, t) for t in texts]
    batched = reranking.reverse_scores(bundled_reverse, candidates, source)
    alone = [reranking.reverse_scores(bundled_reverse, [c], source)[0] for c in candidates]
    for b, a in zip(batched, alone):
        assert b.tokens == a.tokens == sum(len(t) + 1 for t in source)
        assert b.total == pytest.approx(a.total, abs=1e-4)

    prompt = encode_text(bundled_model.tokenizer, "hi, how are you?") + [bundled_model.eos_token_id]
    batched = reranking.forward_scores(bundled_model, prompt, candidates)
    alone = [reranking.forward_scores(bundled_model, prompt, [c])[0] for c in candidates]
    for candidate, b, a in zip(candidates, batched, alone):
        assert b.tokens == a.tokens == len(candidate) + 1
        assert b.total == pytest.approx(a.total, abs=1e-4)


def test_forward_score_is_the_models_log_probability(bundled_model):
    """Cross-check the batched scorer against a plain full-sequence forward pass."""
    eos = bundled_model.eos_token_id
    prompt = encode_text(bundled_model.tokenizer, "what do you do for fun?") + [eos]
    reply = encode_text(bundled_model.tokenizer, "i play the guitar")
    ids = torch.tensor([prompt + reply + [eos]])
    with torch.inference_mode():
        log_probs = torch.log_softmax(bundled_model.model(input_ids=ids).logits[0].float(), dim=-1)
    expected = sum(float(log_probs[i - 1, ids[0, i]]) for i in range(len(prompt), ids.size(1)))
    (score,) = reranking.forward_scores(bundled_model, prompt, [reply])
    assert score.total == pytest.approx(expected, abs=1e-4)
    assert score.mean == pytest.approx(expected / (len(reply) + 1), abs=1e-5)


def test_reverse_rows_put_the_source_newest_first_after_the_candidate():
    eos = 0
    rows = reranking.reverse_rows([[5, 6], []], [[7, 8, 9], [3]], eos, max_positions=64)
    assert rows == [([0, 5, 6, 0], [7, 8, 9, 0, 3, 0]), ([0, 0], [7, 8, 9, 0, 3, 0])]
    cut = reranking.reverse_rows([[5] * 4], [[7] * 10], eos, max_positions=12)
    assert cut[0][1] == [7] * 7 and len(cut[0][0]) + len(cut[0][1]) - 1 == 12  # the source is cut to fit
    long = reranking.reverse_rows([list(range(1, 30))], [[7, 8]], eos, max_positions=12)
    assert long[0] == ([0, 26, 27, 28, 29, 0], [7, 8, 0])  # a long reply keeps its end, in half the positions


def test_split_turns_recovers_the_prompt_turns():
    assert reranking.split_turns([4, 5, 0, 0, 6, 0], eos=0) == [[4, 5], [], [6]]
    assert reranking.split_turns([4, 0, 7], eos=0) == [[4], [7]]


def test_tokenizers_are_compared_by_content(bundled_model, bundled_reverse, tokenizer):
    assert bundled_model.tokenizer is not bundled_reverse.tokenizer
    assert reranking.same_tokenizer(bundled_model.tokenizer, bundled_reverse.tokenizer)
    assert not reranking.same_tokenizer(tokenizer, bundled_reverse.tokenizer)


def test_reverse_model_is_loaded_once_per_engine_and_settings(loaded, mmi_host):
    engine = Engine(loaded, host=mmi_host)
    retokenize = {"allow_retokenize": True}  # the bundled reverse model, beside the test model's tokenizer
    first = engine.make_decoder("mmi", {"candidates": 2, **retokenize})
    again = engine.make_decoder("mmi", {"candidates": 2, **retokenize})
    other = engine.make_decoder("mmi", {"candidates": 3, **retokenize})
    assert first.shared is again.shared and first.shared.name == "chatcore-tiny-reverse"
    assert other.shared is not first.shared  # other settings: its own setup, kept beside
    assert Engine(loaded, host=mmi_host).make_decoder("mmi", {"candidates": 2, **retokenize}).shared is not first.shared


# -- the decoder -------------------------------------------------------------------------


def test_candidates_come_from_one_batch_where_each_row_stops_at_its_own_eos(loaded, tiny_model_dir, mmi_host):
    mmi_host.register(EndRowsPlugin(), "end-rows-plugin")
    engine = Engine(loaded, host=mmi_host)
    options = ReplyOptions(
        decoder="mmi",
        decoder_settings={"candidates": 5, "reverse_model": str(tiny_model_dir), "quorum": 1},
        steerers=[("end-rows", {})],
        seed=3,
        max_new_tokens=20,
        min_new_tokens=0,
    )
    response = engine.reply_to(["hello there, how are you?"], options)
    response.text()
    candidates = response.provenance["candidates"]
    assert [len(c["token_ids"]) for c in candidates] == [0, 1, 2, 3, 4]
    assert all(c["scores"]["ended"] == 1.0 for c in candidates)
    assert all(loaded.eos_token_id not in c["token_ids"] for c in candidates)
    chosen = [c for c in candidates if c["chosen"]]
    assert len(chosen) == 1 and chosen[0]["token_ids"], "an empty candidate must not win"
    assert response.token_ids == chosen[0]["token_ids"]
    assert max(c["scores"]["score"] for c in candidates[1:]) == chosen[0]["scores"]["score"]


@pytest.mark.parametrize(
    ("quorum", "lengths", "ended_rows"),
    [
        # Row r ends at step r; row 0's empty reply does not count towards the quorum.
        (0.5, [0, 1, 2, 3, 4, 5, 5, 5], 5),  # 4 of 8 ended at step 4: rows 5-7 are cut there
        (0.25, [0, 1, 2, 3, 3, 3, 3, 3], 3),
        (1.0, [0, 1, 2, 3, 4, 5, 6, 7], 8),  # wait for every row
    ],
)
def test_sampling_stops_once_the_quorum_of_candidates_has_ended(
    quorum, lengths, ended_rows, loaded, tiny_model_dir, mmi_host
):
    mmi_host.register(EndRowsPlugin(), "end-rows-plugin")
    engine = Engine(loaded, host=mmi_host)
    options = ReplyOptions(
        decoder="mmi",
        decoder_settings={"candidates": 8, "reverse_model": str(tiny_model_dir), "quorum": quorum},
        steerers=[("end-rows", {})],
        seed=3,
        max_new_tokens=20,
        min_new_tokens=0,
    )
    response = engine.reply_to(["hello there, how are you?"], options)
    response.text()
    candidates = response.provenance["candidates"]
    steerer = response.provenance["details"]
    assert [len(c["token_ids"]) for c in candidates] == lengths
    ended = [c["scores"]["ended"] == 1.0 for c in candidates]
    assert ended == [row < ended_rows for row in range(8)]
    assert steerer["mmi"]["ended"] == ended_rows
    # Only a candidate that ended can win: the cut-off ones are unfinished sentences.
    chosen = [c for c in candidates if c["chosen"]]
    assert len(chosen) == 1 and chosen[0]["scores"]["ended"] == 1.0 and chosen[0]["token_ids"]


def test_end_to_end_chosen_candidate_has_the_max_reverse_score(bundled_model, bundled_reverse, mmi_host):
    engine = Engine(bundled_model, host=mmi_host)
    conversation = engine.conversation()
    engine.add_user(conversation, "hi! do you have any pets?")
    conversation.add_bot_text("yes, i have two cats")
    engine.add_user(conversation, "what are their names?")
    options = ReplyOptions(
        decoder="mmi", decoder_settings={"candidates": 4, "source_turns": 2}, seed=7, max_new_tokens=24
    )
    response = engine.respond(conversation, options)
    text = response.text()
    provenance = response.provenance
    candidates = provenance["candidates"]
    assert len(candidates) == 4
    details = provenance["details"]["mmi"]
    assert details["source_turns"] == 2 and details["retokenized"] is False
    chosen = [c for c in candidates if c["chosen"]]
    assert len(chosen) == 1
    assert chosen[0]["token_ids"] == response.token_ids and chosen[0]["text"] == text
    eligible = [c for c in candidates if c["token_ids"] and c["scores"]["ended"]]
    assert eligible and chosen[0]["scores"]["reverse"] == max(c["scores"]["reverse"] for c in eligible)
    # The recorded scores are what the scoring functions give for these candidates.
    turns = reranking.split_turns(_prompt_ids(engine, conversation, 24), bundled_model.eos_token_id)
    source = list(reversed(turns[-2:]))
    ids = [c["token_ids"] for c in candidates]
    for candidate, score in zip(candidates, reranking.reverse_scores(bundled_reverse, ids, source)):
        assert candidate["scores"]["reverse"] == pytest.approx(score.total, abs=1e-4)
    # Forward scores come from the sampling pass; with no steerer they are the plain model's.
    ended = [c for c in candidates if c["scores"]["ended"]]
    assert ended
    prompt = _prompt_ids(engine, conversation, 24)
    for candidate in ended:
        (score,) = reranking.forward_scores(bundled_model, prompt, [candidate["token_ids"]])
        assert candidate["scores"]["forward"] == pytest.approx(score.total, abs=1e-4)
    assert conversation.turns[-1].text == text


def _prompt_ids(engine, conversation, max_new_tokens):
    """The prompt the reply was made from: every turn but the reply itself."""
    turns = conversation.turns
    conversation.turns = turns[:-1]
    try:
        return engine.prompt(conversation, max_new_tokens).token_ids
    finally:
        conversation.turns = turns


def test_a_reverse_model_with_another_tokenizer_is_refused_when_configured(loaded, mmi_host):
    engine = Engine(loaded, host=mmi_host)  # the tiny test model's tokenizer is not the bundled one
    settings = {"candidates": 3, "reverse_model": "chatcore-tiny-reverse"}
    options = ReplyOptions(decoder="mmi", decoder_settings=settings, seed=1, max_new_tokens=8)
    with pytest.raises(OptionError) as refused:
        engine.check_options(options)
    message = str(refused.value)
    assert "\n" not in message and "uses another tokenizer than" in message
    assert f"chatcore train model --reverse --tokenizer {loaded.name}" in message and "allow_retokenize=true" in message


def test_auto_refuses_a_model_whose_tokenizer_no_bundled_reverse_model_shares(loaded, mmi_host):
    engine = Engine(loaded, host=mmi_host)
    options = ReplyOptions(decoder="mmi", decoder_settings={"candidates": 3}, seed=1, max_new_tokens=8)
    with pytest.raises(OptionError) as refused:
        engine.check_options(options)
    message = str(refused.value)
    assert "\n" not in message and "no bundled MMI reverse model shares the tokenizer" in message
    assert f"--reverse --tokenizer {loaded.name} --out DIR" in message


def test_a_mismatched_reverse_model_is_refused_naming_the_bundled_one_that_fits(bundled_model, mmi_host, monkeypatch):
    from chatcore.plugins.mmi import reranking

    engine = Engine(bundled_model, host=mmi_host)
    options = ReplyOptions(decoder="mmi", decoder_settings={"reverse_model": "smollm2-reverse"}, max_new_tokens=4)
    loads: list[str] = []
    monkeypatch.setattr(reranking, "load_reverse_model", lambda name, device="cpu": loads.append(name))
    with pytest.raises(OptionError) as refused:
        engine.check_options(options)
    assert loads == []  # refused by its tokenizer, before its weights load
    message = str(refused.value)
    assert "\n" not in message and "'smollm2-reverse' uses another tokenizer than" in message
    assert "reverse_model=chatcore-tiny-reverse" in message and "reverse_model=auto" in message


@pytest.mark.parametrize(
    ("forward", "expected"),
    [("chatcore-tiny", "chatcore-tiny-reverse"), ("smollm2-reverse", "smollm2-reverse")],
)
def test_auto_takes_the_bundled_reverse_model_on_the_model_s_tokenizer(mmi_host, forward, expected):
    # smollm2-reverse stands in for any model on SmolLM2's tokenizer (SmolLM2 itself is slow to load)
    engine = Engine(load_model(forward), host=mmi_host)
    decoder = engine.make_decoder("mmi", {"candidates": 2})
    assert decoder.shared.name == expected
    assert reranking.same_tokenizer(engine.tokenizer, decoder.shared.tokenizer)
    response = engine.reply_to(["do you like music?"], ReplyOptions(decoder="mmi", seed=3, max_new_tokens=6))
    response.text()
    mmi = response.provenance["details"]["mmi"]
    assert mmi["reverse_model"] == expected and mmi["retokenized"] is False


@pytest.mark.slow
def test_smollm2_replies_are_reranked_by_the_bundled_reverse_model_on_its_tokenizer(smollm2, mmi_host):
    engine = Engine(smollm2, host=mmi_host)
    options = ReplyOptions(decoder="mmi", decoder_settings={"candidates": 4}, seed=2, max_new_tokens=12)
    response = engine.reply_to(["what is your favorite food?"], options)
    assert response.text().strip()
    mmi = response.provenance["details"]["mmi"]
    assert mmi["reverse_model"] == "smollm2-reverse" and mmi["retokenized"] is False
    reverse = engine.make_decoder("mmi", {"candidates": 4}).shared
    source = [encode_text(reverse.tokenizer, "what is your favorite food?")]
    candidates = response.provenance["candidates"]
    scores = reranking.reverse_scores(reverse, [c["token_ids"] for c in candidates], source)
    for candidate, score in zip(candidates, scores):  # the ids are scored as they are: one tokenizer
        assert candidate["scores"]["reverse"] == pytest.approx(score.total, abs=1e-3)


def test_candidates_are_retokenized_for_a_reverse_model_with_another_tokenizer(loaded, bundled_reverse, mmi_host):
    engine = Engine(loaded, host=mmi_host)  # the tiny test model's tokenizer is not the bundled one
    settings = {"candidates": 3, "allow_retokenize": True}
    options = ReplyOptions(decoder="mmi", decoder_settings=settings, seed=1, max_new_tokens=8)
    response = engine.reply_to(["what is your favorite food?"], options)
    response.text()
    assert response.provenance["details"]["mmi"]["retokenized"] is True
    assert any("'retokenized': True" in line for line in explain(response.provenance))  # what /why shows
    candidates = response.provenance["candidates"]
    reverse_tokenizer = bundled_reverse.tokenizer
    ids = [encode_text(reverse_tokenizer, loaded.tokenizer.decode(c["token_ids"])) for c in candidates]
    source = [encode_text(reverse_tokenizer, "what is your favorite food?")]
    for candidate, score in zip(candidates, reranking.reverse_scores(bundled_reverse, ids, source)):
        assert candidate["scores"]["reverse"] == pytest.approx(score.total, abs=1e-4)


@pytest.mark.parametrize(
    "settings, field",
    [
        ({"candidates": 0}, "candidates"),
        ({"candidates": -3}, "candidates"),
        ({"candidates": 100_000}, "candidates"),
        ({"source_turns": 0}, "source_turns"),
        ({"selection": "best"}, "selection"),
        ({"selection_temperature": 0}, "selection_temperature"),
        ({"weight": -1}, "weight"),
        ({"quorum": 0}, "quorum"),
        ({"quorum": 1.5}, "quorum"),
        ({"quorum": True}, "quorum"),
        ({"reverse_model": " "}, "reverse_model"),
        ({"top_k": 0}, "top_k"),
        ({"beams": 4}, "beams"),
    ],
)
def test_bad_settings_are_refused_with_the_setting_named(settings, field, loaded, mmi_host):
    engine = Engine(loaded, host=mmi_host)
    with pytest.raises(OptionError, match=f"`?{field}`?"):
        engine.make_decoder("mmi", settings)


def test_a_reverse_model_that_cannot_load_is_a_clear_error(loaded, mmi_host, tmp_path):
    engine = Engine(loaded, host=mmi_host)
    missing = str(tmp_path / "no-such-model")
    options = ReplyOptions(decoder="mmi", decoder_settings={"reverse_model": missing}, seed=0, max_new_tokens=4)
    with pytest.raises(ModelLoadError, match="reverse model"):
        engine.reply_to(["hi"], options).text()


def test_candidate_draws_follow_the_top_k_distribution():
    """The batched sampler draws only among each row's k best, with softmax probabilities."""
    decoder = MMIDecoder.from_options({"top_k": 2, "temperature": 1.0})
    scores = torch.full((2, 50), -3.0)
    scores[0, 7], scores[0, 11] = math.log(3.0), 0.0  # p = 0.75 / 0.25 among the two best
    scores[1, 40], scores[1, 3] = 5.0, 5.0
    for processor in decoder.sampler().processors():
        scores = processor(torch.zeros((2, 1), dtype=torch.long), scores)
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([decoder.select(scores, generator) for _ in range(4000)])  # (4000, 2)
    assert set(draws[:, 0].tolist()) == {7, 11} and set(draws[:, 1].tolist()) == {3, 40}
    assert (draws[:, 0] == 7).float().mean().item() == pytest.approx(0.75, abs=0.03)
    assert (draws[:, 1] == 40).float().mean().item() == pytest.approx(0.5, abs=0.03)


def test_the_decoder_samples_with_its_top_k_settings():
    decoder = MMIDecoder.from_options({"top_k": 5, "temperature": 0.5, "no_repeat_ngram_size": 3, "candidates": 2})
    sampler = decoder.sampler()
    assert (sampler.settings.top_k, sampler.settings.temperature, sampler.settings.no_repeat_ngram_size) == (5, 0.5, 3)
    assert decoder.describe()["settings"]["candidates"] == 2
