"""PPLM: the perturbation on real caches, the attribute models, heads and their training."""

from __future__ import annotations

import json

import click
import pytest
import torch
from click.testing import CliRunner

from chatcore.decoding import GenerationSession
from chatcore.engine import Engine, ReplyOptions
from chatcore.errors import ChatcoreError, OptionError
from chatcore.models import output_cache
from chatcore.plugin_manager import PluginHost
from chatcore.plugins.pplm import plugin as pplm_plugin
from chatcore.plugins.pplm.attribute import (
    BagOfWords,
    DiscriminatorMismatchError,
    HeadConfig,
    load_head,
    model_shape,
    read_head_config,
    resolve_head,
    save_head,
    tokenizer_fingerprint,
)
from chatcore.plugins.pplm.config import PerturbConfig
from chatcore.plugins.pplm.kv import past_of
from chatcore.plugins.pplm.perturb import apply_deltas, fuse, kl_divergence, window_weights
from chatcore.plugins.pplm.plugin import PPLMSteerer
from chatcore.plugins.pplm.train_discriminator import (
    LabelledText,
    TrainSettings,
    read_labelled_file,
    train_discriminator,
)
from chatcore.steering import Steerer
from chatcore.step import StepOutput, StepState, model_step
from chatcore.testing import decode_steps
from chatcore.text import encode_text

PLUGINS = ("chatcore.plugins.greedy", "chatcore.plugins.top_k", "chatcore.plugins.pplm.plugin")
FOOD = ("pizza", "cheese", "dinner", "hungry", "delicious", "hamburger", "spaghetti")


@pytest.fixture
def pplm_engine(loaded):
    host = PluginHost()
    host.load_modules(PLUGINS)
    assert host.problems == []
    return Engine(loaded, host=host)


class Recorder(Steerer):
    """An inner steerer that records every call PPLM makes through it."""

    name = "recorder"

    def __init__(self) -> None:
        super().__init__(None)
        self.calls: list[dict] = []

    def wrap(self, step):
        def recorded(state: StepState) -> StepOutput:
            length = state.cache.get_seq_length() if state.cache is not None else 0
            self.calls.append(
                {
                    "step": state.step,
                    "cache": state.cache,
                    "cache_length": length,
                    "tokens": state.input_ids.size(1),
                    "rows": state.input_ids.size(0),
                    "sequence_length": state.sequences.size(1),
                }
            )
            return step(state)

        return recorded


def prompt_for(loaded, *turns: str) -> list[int]:
    eos = loaded.eos_token_id
    ids: list[int] = []
    for turn in turns:
        ids += encode_text(loaded.tokenizer, turn) + [eos]
    return ids


def decode(loaded, prompt, steerers, tokens=6, seed=0, rows=1):
    """Run the batched loop with top-k sampling; returns the (rows, tokens) choices."""
    session = GenerationSession(
        model=loaded,
        prompt_ids=prompt,
        steerers=steerers,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        generator=torch.Generator().manual_seed(seed),
        seed=seed,
    )
    for steerer in steerers:
        steerer.prepare(session)

    def select(scores, generator):
        return torch.multinomial(torch.softmax(scores, -1), 1, generator=generator).squeeze(1)

    return torch.stack(list(decode_steps(session, select, rows=rows)), dim=1), session


def pplm(**settings) -> PPLMSteerer:
    settings.setdefault("words", FOOD)
    return PPLMSteerer.from_options(settings)


def first_step(loaded, steerer, prompt, rows=1, prompt_length=None):
    """The steered and the plain outputs of the prompt step, for ``rows`` copies of ``prompt``
    (of which the tokens after ``prompt_length`` count as the reply's beginning)."""
    session = GenerationSession(
        model=loaded,
        prompt_ids=prompt,
        steerers=[steerer],
        max_new_tokens=1,
        generator=torch.Generator().manual_seed(0),
        seed=0,
    )
    steerer.prepare(session)
    ids = torch.tensor([prompt] * rows)
    state = StepState(
        input_ids=ids,
        sequences=ids,
        attention_mask=torch.ones_like(ids),
        position_ids=torch.arange(ids.size(1)).expand(rows, -1),
        cache=None,
        step=0,
        prompt_length=prompt_length or ids.size(1),
    )
    with torch.inference_mode():
        steered = steerer.wrap(model_step(loaded.model))(state)
        plain = model_step(loaded.model)(state)
    return steered, plain


# -- settings ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, "needs an attribute"),
        ({"topic": "food", "stepsize": -1}, "`stepsize` must be between 0 and 10, got -1.0"),
        ({"topic": "food", "num_iterations": 0.5}, "`num_iterations` must be an integer"),
        ({"topic": "food", "gm_scale": 1.5}, "`gm_scale`"),
        ({"topic": "nope"}, "`topic` must be one of"),
        ({"topic": "food", "class_label": "positive"}, "only used with a `discriminator`"),
        ({"topic": "food", "discriminator": "sentiment", "class_label": "positive"}, "not both"),
        ({"discriminator": "sentiment"}, "`class_label` is needed"),
        ({"discriminator": "no-such-head", "class_label": "x"}, "no head file"),
        ({"topic": "food", "steer_every": 0}, "`steer_every`"),
        ({"topic": "food", "layer_share": 0}, "`layer_share` must be in \\(0, 1\\], got 0.0"),
        ({"topic": "food", "layer_share": 1.5}, "`layer_share` must be in \\(0, 1\\], got 1.5"),
    ],
)
def test_settings_are_validated(settings, message):
    with pytest.raises(OptionError, match=message):
        PPLMSteerer.from_options(settings)


@pytest.mark.parametrize(
    ("share", "layers", "first"), [(1.0, 6, 0), (0.5, 6, 3), (0.5, 24, 12), (0.01, 6, 5), (0.5, 1, 0), (0.75, 2, 0)]
)
def test_layer_share_picks_the_top_layers(share, layers, first):
    assert PerturbConfig(layer_share=share).first_perturbed_layer(layers) == first


def test_the_default_step_is_a_share_of_the_past_it_perturbs_on_any_scale():
    from chatcore.plugins.pplm.config import RELATIVE_STEP
    from chatcore.plugins.pplm.loop import Optimiser

    config = PerturbConfig()
    assert config.relative_step(1) == RELATIVE_STEP
    assert config.relative_step(15) == pytest.approx(RELATIVE_STEP / 15**0.5)  # spread as 1/sqrt(layers)
    generator = torch.Generator().manual_seed(0)
    squares = torch.rand((4, 3), generator=generator) + 0.1  # (layers, rows) of |w * g| ** 2
    past = torch.rand((4, 3), generator=generator) + 0.5  # a position's key/value norm per layer and row
    for gradient_scale, past_scale in ((1.0, 1.0), (1e4, 1.0), (1.0, 30.0)):
        optimiser = Optimiser(config, attribute=None, eos_token_id=0, hidden=None, summary={})  # type: ignore[arg-type]
        optimiser.batch_size = 3
        scales, _ = optimiser._scales(squares * gradient_scale, None, past * past_scale)
        step = scales * (squares * gradient_scale).sqrt()  # the first step's size per layer and row
        # The same share of the past, however large the gradient or the keys and values are.
        torch.testing.assert_close(step, config.relative_step(4) * past * past_scale, rtol=1e-4, atol=0)
    # A given stepsize keeps the paper's rule: stepsize / n ** gamma, whatever the past.
    fixed = Optimiser(PerturbConfig(stepsize=0.5), attribute=None, eos_token_id=0, hidden=None, summary={})  # type: ignore[arg-type]
    fixed.batch_size = 3
    scales, _ = fixed._scales(squares, None, None)
    torch.testing.assert_close(scales, 0.5 / squares.sqrt().pow(1.5), rtol=1e-4, atol=0)
    assert not PerturbConfig(stepsize=0.0).optimises(0) and PerturbConfig().optimises(0)


def test_settings_parse_from_strings():
    steerer = PPLMSteerer.from_options({"topic": "food", "stepsize": "0.1", "window_length": "5", "decay": "true"})
    assert steerer.settings.stepsize == 0.1 and steerer.settings.window_length == 5 and steerer.settings.decay is True
    assert steerer.describe()["settings"]["topic"] == "food"


# -- the pieces of the algorithm ----------------------------------------------------------------------


def test_window_covers_the_most_recent_positions():
    past = [(torch.zeros(1, 2, 10, 4), torch.zeros(1, 2, 10, 4)) for _ in range(2)]
    deltas = [torch.ones(1, 2, 3, 4) for _ in range(4)]
    for keys, values in apply_deltas(past, deltas):
        for tensor in (keys, values):
            assert tensor[:, :, :7].abs().sum() == 0  # the oldest positions are untouched
            assert bool((tensor[:, :, 7:] == 1).all())  # the three most recent are perturbed
    weights = window_weights(4, decay=True)
    assert weights.tolist() == [0.25, 0.5, 0.75, 1.0]  # the newest position moves the most
    assert window_weights(3, decay=False).tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("layer_share", [1.0, 0.5])
def test_window_on_a_real_step_perturbs_only_recent_positions(loaded, layer_share):
    prompt = prompt_for(loaded, "hi there, what did you have for dinner yesterday?")
    steerer = pplm(stepsize=0.5, window_length=3, carry=True, layer_share=layer_share)
    first_step(loaded, steerer, prompt)
    length = len(prompt) - 1  # the past of the prompt's last token
    plain_past = past_of(model_step(loaded.model)(_prompt_state(prompt)).cache)
    perturbed = steerer.perturbation.perturbed_past
    first = len(plain_past) - round(layer_share * len(plain_past))
    for index, ((plain_keys, plain_values), (keys, values)) in enumerate(zip(plain_past, perturbed)):
        assert torch.allclose(keys[:, :, : length - 3], plain_keys[:, :, : length - 3], atol=1e-6)
        assert torch.allclose(values[:, :, : length - 3], plain_values[:, :, : length - 3], atol=1e-6)
        recent = slice(length - 3, length)
        moved = not torch.allclose(keys[:, :, recent], plain_keys[:, :, recent])
        assert moved == (index >= first), (index, first)  # only the top layers' past is perturbed


def _prompt_state(prompt):
    ids = torch.tensor([prompt])
    return StepState(
        input_ids=ids,
        sequences=ids,
        attention_mask=torch.ones_like(ids),
        position_ids=torch.arange(ids.size(1)).unsqueeze(0),
        cache=None,
        step=0,
        prompt_length=ids.size(1),
    )


def test_kl_is_zero_for_equal_distributions_and_positive_otherwise():
    log_probs = torch.log_softmax(torch.randn(3, 50), -1)
    assert torch.equal(kl_divergence(log_probs, log_probs), torch.zeros(3))
    other = torch.log_softmax(torch.randn(3, 50), -1)
    assert bool((kl_divergence(log_probs, other) > 0).all())


def test_kl_term_is_zero_before_the_first_step(loaded):
    steerer = pplm(stepsize=0.5)
    prompt = prompt_for(loaded, "what do you like to eat?")
    session = GenerationSession(
        model=loaded,
        prompt_ids=prompt,
        steerers=[steerer],
        max_new_tokens=1,
        generator=torch.Generator().manual_seed(0),
        seed=0,
    )
    steerer.prepare(session)
    steerer.perturbation.trace = []
    with torch.inference_mode():
        steerer.wrap(model_step(loaded.model))(_prompt_state(prompt))
    kl = steerer.perturbation.trace[0]["kl"]
    assert abs(kl[0][0]) < 1e-5  # zero deltas: the perturbed pass is the plain one
    assert kl[-1][0] > kl[0][0]  # then the perturbation moves the distribution


def test_fusion_is_the_identity_for_equal_distributions():
    logits = torch.randn(2, 30)
    log_probs = torch.log_softmax(logits, -1)
    assert torch.equal(fuse(logits, log_probs, log_probs, 0.9), logits)
    shifted = torch.log_softmax(logits + torch.randn(2, 30), -1)
    fused = torch.log_softmax(fuse(logits, log_probs, shifted, 0.75), -1)
    expected = torch.log_softmax(0.75 * shifted + 0.25 * log_probs, -1)
    assert torch.allclose(fused, expected, atol=1e-5)
    banned = logits.clone()
    banned[:, 3] = float("-inf")
    fused = fuse(banned, torch.log_softmax(banned, -1), shifted, 0.9)
    assert bool(torch.isneginf(fused[:, 3]).all()) and not bool(torch.isnan(fused).any())


# -- the perturbation on the tiny model ----------------------------------------------------------------


def test_zero_stepsize_reproduces_unsteered_output_exactly(pplm_engine):
    for decoder, settings in (("top-k", {"top_k": 50, "temperature": 1.0}), ("greedy", {"repetition_penalty": 1.3})):
        options = ReplyOptions(decoder=decoder, decoder_settings=settings, seed=7, max_new_tokens=12, min_new_tokens=12)
        plain = pplm_engine.reply_to(["hi, how are you?"], options)
        plain.text()
        steered = pplm_engine.reply_to(
            ["hi, how are you?"], options, steerers=[("pplm", {"words": ",".join(FOOD), "stepsize": 0})]
        )
        steered.text()
        assert steered.token_ids == plain.token_ids


def traced_greedy_run(loaded, steerer, text: str, tokens: int) -> list[dict]:
    """Greedy-decode ``tokens`` tokens after ``text`` with ``steerer`` alone; its perturbation's trace."""
    session = GenerationSession(
        model=loaded,
        prompt_ids=prompt_for(loaded, text),
        steerers=[steerer],
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        generator=torch.Generator().manual_seed(0),
        seed=0,
    )
    steerer.prepare(session)
    steerer.perturbation.trace = trace = []
    list(decode_steps(session, lambda scores, g: scores.argmax(-1)))
    return trace


def test_gradients_reach_the_deltas_and_the_bow_loss_decreases(loaded):
    trace = traced_greedy_run(loaded, pplm(stepsize=0.05, num_iterations=4), "what should we eat tonight?", 4)
    assert len(trace) == 4
    for record in trace:
        assert all(norm[0] > 0 for norm in record["grad_norm"])  # gradients reach the deltas
        losses = [values[0] for values in record["attribute"]]
        assert losses[-1] < losses[0], losses  # -log p(bag) goes down over the iterations


def test_grad_length_really_stops_optimising(loaded):
    recorder = Recorder()
    steerer = pplm(stepsize=0.1, num_iterations=3, grad_length=2, carry=True)
    prompt = prompt_for(loaded, "hello!")
    decode(loaded, prompt, [recorder, steerer], tokens=5)
    per_step = [sum(1 for call in recorder.calls if call["step"] == step) for step in range(5)]
    # optimised: plain + 3 iterations + perturbed pass; afterwards: plain + perturbed pass
    assert per_step == [5, 5, 2, 2, 2]
    assert steerer.perturbation.summary["optimised_steps"] == 2


def test_without_carry_each_token_perturbs_the_plain_past(loaded):
    recorder = Recorder()
    steerer = pplm(stepsize=0.1, num_iterations=3, grad_length=2, carry=False)
    decode(loaded, prompt_for(loaded, "hello!"), [recorder, steerer], tokens=4)
    per_step = [sum(1 for call in recorder.calls if call["step"] == step) for step in range(4)]
    assert per_step == [5, 5, 1, 1]  # no perturbed past to advance: then the plain pass alone
    assert steerer.perturbation.perturbed_past is None


def test_steer_every_optimises_every_kth_token(loaded):
    recorder = Recorder()
    steerer = pplm(stepsize=0.1, num_iterations=2, steer_every=3, carry=True)
    decode(loaded, prompt_for(loaded, "hello!"), [recorder, steerer], tokens=6)
    per_step = [sum(1 for call in recorder.calls if call["step"] == step) for step in range(6)]
    assert per_step == [4, 2, 2, 4, 2, 2]


def test_each_iteration_gets_a_fresh_cache(loaded):
    recorder = Recorder()
    steerer = pplm(stepsize=0.2, num_iterations=3)
    prompt = prompt_for(loaded, "tell me about your favourite food")
    decode(loaded, prompt, [recorder, steerer], tokens=3)
    for step in (1, 2):
        calls = [call for call in recorder.calls if call["step"] == step]
        past = calls[0]["sequence_length"] - 1
        assert len(calls) == 5  # plain, 3 iterations, perturbed
        # every pass starts from a cache of exactly the past: none saw another pass's token
        assert all(call["cache_length"] == past for call in calls)
        caches = [id(call["cache"]) for call in calls]
        assert len(set(caches)) == len(caches)  # a new cache object for every pass


def test_history_is_never_rewritten(loaded):
    """The cache the steered step hands back is the plain model's cache of the same tokens."""
    steerer = pplm(stepsize=0.5, num_iterations=2, carry=True)
    prompt = prompt_for(loaded, "what do you cook on sundays?")
    session = GenerationSession(
        model=loaded,
        prompt_ids=prompt,
        steerers=[steerer],
        max_new_tokens=4,
        generator=torch.Generator().manual_seed(0),
        seed=0,
    )
    steerer.prepare(session)
    step = steerer.wrap(model_step(loaded.model))
    ids = torch.tensor([prompt])
    state = _prompt_state(prompt)
    with torch.inference_mode():
        for index in range(4):
            output = step(state)
            ids = torch.cat([ids, output.logits.argmax(-1, keepdim=True)], dim=1)
            state = StepState(
                input_ids=ids[:, -1:],
                sequences=ids,
                attention_mask=torch.ones_like(ids),
                position_ids=torch.tensor([[ids.size(1) - 1]]),
                cache=output.cache,
                step=index + 1,
                prompt_length=len(prompt),
            )
        full = output_cache(loaded.model(input_ids=ids[:, :-1], use_cache=True))
    assert steerer.perturbation.perturbed_past is not None  # the steering did change its own past
    for (keys, values), (full_keys, full_values) in zip(past_of(output.cache), past_of(full)):
        assert keys.shape == full_keys.shape
        assert torch.allclose(keys, full_keys, atol=1e-4) and torch.allclose(values, full_values, atol=1e-4)


def test_a_multi_token_word_list_steers(bundled_model):
    tokenizer = bundled_model.tokenizer
    words = ["hamburger", "banana", "ice cream", "peanut butter"]
    ids = {word: encode_text(tokenizer, " " + word) for word in words}
    assert all(len(i) > 1 for i in ids.values()), ids  # every one of them takes several tokens
    bag = BagOfWords.from_words(words, tokenizer, bundled_model.model.config.vocab_size)
    prompt = prompt_for(bundled_model, "what do you want to eat?")
    begun = encode_text(tokenizer, "i really want some")
    for word_ids in ids.values():
        # the first token is a target, and once the reply has begun the word, so is the next
        assert bool(bag.step_targets(torch.tensor([prompt + begun]), len(prompt))[0, word_ids[0]])
        continued = bag.step_targets(torch.tensor([prompt + begun + word_ids[:1]]), len(prompt))
        assert bool(continued[0, word_ids[1]])
    steerer = PPLMSteerer.from_options({"words": ",".join(words), "stepsize": 0.3})
    steered, plain = first_step(bundled_model, steerer, prompt + begun, prompt_length=len(prompt))
    targets = bag.step_targets(torch.tensor([prompt + begun]), len(prompt))[0]
    share = lambda logits: float(torch.softmax(logits[0], -1)[targets].sum())  # noqa: E731
    assert share(steered.logits) > 2 * share(plain.logits)


def test_used_words_leave_the_bag(bundled_model):
    tokenizer = bundled_model.tokenizer
    bag = BagOfWords.from_words(["cheese", "dinner"], tokenizer, bundled_model.model.config.vocab_size)
    prompt = prompt_for(bundled_model, "hi")
    cheese, dinner = encode_text(tokenizer, " cheese"), encode_text(tokenizer, " dinner")
    assert len(cheese) == len(dinner) == 1
    begun = bag.step_targets(torch.tensor([prompt + encode_text(tokenizer, "i like")]), len(prompt))[0]
    assert bool(begun[cheese[0]]) and bool(begun[dinner[0]])
    used = bag.step_targets(torch.tensor([prompt + encode_text(tokenizer, "i like") + cheese]), len(prompt))[0]
    assert not bool(used[cheese[0]]) and bool(used[dinner[0]])


def test_batched_rows_are_steered_independently(loaded):
    first = prompt_for(loaded, "what do you want for dinner?")
    second = prompt_for(loaded, "do you like the rain?")
    length = min(len(first), len(second))  # equal lengths keep the comparison free of padding
    first, second = first[-length:], second[-length:]
    steerer = pplm(stepsize=0.3)
    alone, _ = first_step(loaded, steerer, first)
    session = GenerationSession(
        model=loaded,
        prompt_ids=first,
        steerers=[steerer],
        max_new_tokens=1,
        generator=torch.Generator().manual_seed(0),
        seed=0,
    )
    steerer.prepare(session)
    ids = torch.tensor([first, second])
    state = StepState(
        input_ids=ids,
        sequences=ids,
        attention_mask=torch.ones_like(ids),
        position_ids=torch.arange(length).expand(2, -1),
        cache=None,
        step=0,
        prompt_length=length,
    )
    with torch.inference_mode():
        together = steerer.wrap(model_step(loaded.model))(state)
    # per-row losses, gradient norms and steps: a row's result does not depend on its neighbours
    assert not torch.allclose(alone.logits[0], model_step(loaded.model)(_prompt_state(first)).logits[0], atol=1e-3)
    assert torch.allclose(together.logits[0], alone.logits[0], atol=1e-3)


def test_batched_decoding_with_finished_rows(loaded):
    steerer = pplm(stepsize=0.2, num_iterations=2)
    prompt = prompt_for(loaded, "hi, what's up?")
    session = GenerationSession(
        model=loaded,
        prompt_ids=prompt,
        steerers=[steerer],
        max_new_tokens=8,
        generator=torch.Generator().manual_seed(3),
        seed=3,
    )
    steerer.prepare(session)
    eos = loaded.eos_token_id

    def select(scores, generator):
        tokens = torch.multinomial(torch.softmax(scores, -1), 1, generator=generator).squeeze(1)
        tokens[0] = eos  # the first row finishes at once; the others go on being steered
        return tokens

    steps = list(decode_steps(session, select, rows=4))
    assert len(steps) == 8 and all(step.shape == (4,) for step in steps)
    assert steerer.perturbation.summary["optimised_steps"] == 8


def test_pplm_works_through_the_engine_under_every_decoder(pplm_engine):
    for decoder in ("greedy", "top-k"):
        response = pplm_engine.reply_to(
            ["hi"],
            ReplyOptions(decoder=decoder, seed=1, max_new_tokens=5, steerers=[("pplm", {"words": "pizza,cheese"})]),
        )
        response.text()
        assert response.provenance["steerers"][0]["name"] == "pplm"
        assert response.provenance["details"]["pplm"]["optimised_steps"] >= 1


def test_pplm_raises_the_topic_probability_on_the_bundled_model(bundled_model):
    steerer = PPLMSteerer.from_options({"topic": "food", "stepsize": 0.3})
    prompt = prompt_for(bundled_model, "hi! what did you do today?")
    steered, plain = first_step(bundled_model, steerer, prompt)
    targets = steerer.perturbation.attribute.start_mask
    share = lambda logits: float(torch.softmax(logits[0], -1)[targets].sum())  # noqa: E731
    assert share(steered.logits) > 2 * share(plain.logits)


# -- discriminator heads -----------------------------------------------------------------------------


def _head_config(loaded, **changes) -> HeadConfig:
    hidden, layers = model_shape(loaded.model)
    values = dict(
        classes=["negative", "positive"],
        hidden_size=hidden,
        num_layers=layers,
        layer=layers,
        tokenizer_fingerprint=tokenizer_fingerprint(loaded.tokenizer),
        base_model="tiny",
    )
    values.update(changes)
    return HeadConfig(**values)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_size": 64}, "hidden size 64 \\(this model: 32\\)"),
        ({"num_layers": 12, "layer": 12}, "12 layers"),
        ({"tokenizer_fingerprint": "0123456789abcdef"}, "tokenizer 0123456789abcdef"),
    ],
)
def test_a_mismatched_discriminator_is_refused(loaded, tmp_path, changes, message):
    config = _head_config(loaded, **changes)
    path = save_head(tmp_path / "head.safetensors", torch.zeros(2, config.hidden_size), torch.zeros(2), config)
    steerer = PPLMSteerer.from_options({"discriminator": str(path), "class_label": "positive"})
    session = GenerationSession(
        model=loaded, prompt_ids=[0], steerers=[steerer], max_new_tokens=1, generator=torch.Generator(), seed=0
    )
    with pytest.raises(DiscriminatorMismatchError, match=message) as error:
        steerer.prepare(session)
    assert "chatcore train discriminator" in str(error.value)
    assert isinstance(error.value, ChatcoreError)


def test_a_mismatched_discriminator_is_refused_when_pplm_is_chosen(pplm_engine, loaded, tmp_path):
    """As chat's /steer and every entry point check a reply's options: before any reply."""
    from chatcore.engine import ReplyOptions

    config = _head_config(loaded, hidden_size=64)
    path = save_head(tmp_path / "head.safetensors", torch.zeros(2, config.hidden_size), torch.zeros(2), config)
    options = ReplyOptions(steerers=[("pplm", {"discriminator": str(path), "class_label": "positive"})])
    with pytest.raises(DiscriminatorMismatchError, match="hidden size 64"):
        pplm_engine.check_options(options)
    fitting = _head_config(loaded)
    good = save_head(tmp_path / "good.safetensors", torch.zeros(2, fitting.hidden_size), torch.zeros(2), fitting)
    pplm_engine.check_options(
        ReplyOptions(steerers=[("pplm", {"discriminator": str(good), "class_label": "positive"})])
    )


def test_the_shipped_sentiment_head_fits_the_bundled_model_only(bundled_model, loaded):
    config = read_head_config(resolve_head("sentiment"))
    assert config.base_model == "chatcore-tiny" and set(config.classes) == {"negative", "positive"}
    load_head("sentiment", bundled_model.model, bundled_model.tokenizer, "chatcore-tiny", "positive")
    with pytest.raises(DiscriminatorMismatchError, match="hidden size 384"):
        load_head("sentiment", loaded.model, loaded.tokenizer, "tiny", "positive")


def test_an_unknown_class_label_is_refused(loaded, tmp_path):
    config = _head_config(loaded)
    path = save_head(tmp_path / "head.safetensors", torch.zeros(2, config.hidden_size), torch.zeros(2), config)
    with pytest.raises(OptionError, match="`class_label` must be one of negative, positive"):
        PPLMSteerer.from_options({"discriminator": str(path), "class_label": "happy"})


def synthetic_examples() -> list[LabelledText]:
    food = [
        "i love pizza and cheese",
        "dinner was delicious",
        "i am hungry for pasta",
        "we ate cake and bread",
        "the soup was hot and tasty",
        "breakfast with eggs and toast",
        "let's cook rice tonight",
        "fresh fruit for lunch",
    ]
    weather = [
        "it is raining again",
        "the sun is out today",
        "so cold and windy outside",
        "snow all week",
        "a storm is coming tonight",
        "cloudy skies this morning",
        "the heat is terrible",
        "rain and thunder all day",
    ]
    return [LabelledText("food", t) for t in food] + [LabelledText("weather", t) for t in weather]


def test_a_trained_discriminator_steers_towards_its_class(loaded, tmp_path):
    settings = TrainSettings(per_class=8, epochs=200, learning_rate=0.05, validation_share=0.0)
    result = train_discriminator(loaded, synthetic_examples(), tmp_path / "topic.safetensors", settings, source="test")
    assert result.train_accuracy >= 0.9
    config = read_head_config(result.path)
    assert config.classes == ["food", "weather"] and config.layer == model_shape(loaded.model)[1]

    steerer = PPLMSteerer.from_options(
        {"discriminator": str(result.path), "class_label": "weather", "stepsize": 0.5, "num_iterations": 4}
    )
    trace = traced_greedy_run(loaded, steerer, "what do you think?", 3)
    assert len(trace) == 3
    for record in trace:
        losses = [values[0] for values in record["attribute"]]
        assert all(norm[0] > 0 for norm in record["grad_norm"])
        assert losses[-1] < losses[0], losses  # the head's cross-entropy goes down


# -- training data and the command ---------------------------------------------------------------------


def test_labelled_files_in_both_formats(tmp_path):
    tsv = tmp_path / "data.tsv"
    tsv.write_text("pos\tgreat day\n# comment\nneg\tawful   day\npos\tlovely\nneg\tbad\n", encoding="utf-8")
    examples = read_labelled_file(tsv)
    assert examples[1] == LabelledText("neg", "awful day")
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"label": "a", "text": "x y", "context": ["hi"]},
                {"label": "b", "text": "z"},
                {"label": "a", "text": "w"},
                {"label": "b", "text": "v"},
            ]
        ),
        encoding="utf-8",
    )
    assert read_labelled_file(jsonl)[0] == LabelledText("a", "x y", ("hi",))
    bad = tmp_path / "bad.tsv"
    bad.write_text("only one label\n", encoding="utf-8")
    with pytest.raises(ChatcoreError, match="label<TAB>text"):
        read_labelled_file(bad)
    single = tmp_path / "single.tsv"
    single.write_text("a\tx\na\ty\n", encoding="utf-8")
    with pytest.raises(ChatcoreError, match="at least two labels"):
        read_labelled_file(single)


def test_train_discriminator_command(tiny_model_dir, tmp_path):
    data = tmp_path / "data.tsv"
    data.write_text("\n".join(f"{e.label}\t{e.text}" for e in synthetic_examples()), encoding="utf-8")
    group = click.Group("chatcore")
    pplm_plugin.register_commands(group)
    assert "discriminator" in group.commands["train"].commands
    out = tmp_path / "head.safetensors"
    result = CliRunner().invoke(
        group,
        [
            "train",
            "discriminator",
            "--model",
            str(tiny_model_dir),
            "--data",
            str(data),
            "--out",
            str(out),
            "--epochs",
            "50",
            "--per-class",
            "10",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "head saved to" in result.output
    assert read_head_config(out).tokenizer_fingerprint == tokenizer_fingerprint(
        __import__("transformers").AutoTokenizer.from_pretrained(str(tiny_model_dir))
    )
    result = CliRunner().invoke(group, ["train", "discriminator", "--out", str(out)])
    assert result.exit_code != 0 and "exactly one of --data" in str(result.exception)
    before = out.read_bytes()
    again = ["train", "discriminator", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(out)]
    kept = CliRunner().invoke(group, again)
    assert kept.exit_code != 0 and f"--out {str(out)!r} exists: give --force to replace it" in str(kept.exception)
    assert out.read_bytes() == before  # the trained head is kept
    text = CliRunner().invoke(group, [*again[:-1], str(tmp_path / "h6.txt")])
    assert text.exit_code != 0 and "a head is written as a .safetensors file" in str(text.exception)
    replaced = CliRunner().invoke(group, [*again, "--epochs", "2", "--per-class", "10", "--force"])
    assert replaced.exit_code == 0, replaced.output


def test_the_settings_table_shows_every_knob_with_its_default():
    """docs/pplm.md's settings table lists each PerturbConfig field with the default the code has."""
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[1] / "docs" / "pplm.md").read_text(encoding="utf-8")
    for name, field in PerturbConfig.model_fields.items():
        default = field.default
        shown = str(default).lower() if isinstance(default, bool) else str(default)
        assert f"| `{name}` | {shown} |" in docs, f"docs/pplm.md: no row `{name}` with default {shown}"


# -- Llama-family models ---------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma"])
def llama_family(request, tmp_path_factory):
    """(folder, loaded) of a tiny random Llama-family model: 4 query heads over 2 key/value heads."""
    from chatcore.models import load_model
    from chatcore.testing import build_tiny_model

    folder = build_tiny_model(
        tmp_path_factory.mktemp(request.param), architecture=request.param, heads=4, layers=4, seed=5
    )
    return folder, load_model(str(folder), device="cpu", dtype="float32")


@pytest.mark.parametrize("decoder", ["greedy", "top-k", "mmi"])
def test_pplm_steers_llama_family_models_under_every_decoder(llama_family, decoder):
    """The steerer runs on the lean runner under each decoder (MMI: a batch of candidates,
    reranked by a reverse model) and changes the reply's scores."""
    folder, loaded = llama_family
    host = PluginHost()
    host.load_modules(PLUGINS + ("chatcore.plugins.mmi.plugin",))
    engine = Engine(loaded, host=host)
    settings = {"candidates": 3, "reverse_model": str(folder)} if decoder == "mmi" else {}

    def reply(steerers):
        response = engine.reply_to(
            ["what should we have for dinner?"],
            ReplyOptions(
                decoder=decoder,
                decoder_settings=settings,
                seed=3,
                max_new_tokens=6,
                min_new_tokens=6,
                steerers=steerers,
            ),
        )
        response.text()
        return response

    steered = reply([("pplm", {"words": ",".join(FOOD)})])
    plain = reply([])
    details = steered.provenance["details"]["pplm"]
    assert details["optimised_steps"] >= 6 and details["runner_passes"] > 0  # the lean path ran
    assert len(steered.token_ids) == len(plain.token_ids) == 6
    assert steered.provenance["steerers"][0]["name"] == "pplm"


def test_pplm_raises_the_topic_probability_on_llama_family_models(llama_family):
    _, loaded = llama_family
    steerer = PPLMSteerer.from_options({"words": ",".join(FOOD), "stepsize": 0.5})
    steered, plain = first_step(loaded, steerer, prompt_for(loaded, "hi! what did you do today?"))
    assert steerer.perturbation.runner is not None
    targets = steerer.perturbation.attribute.start_mask
    share = lambda logits: float(torch.softmax(logits[0], -1)[targets].sum())  # noqa: E731
    assert share(steered.logits) > 1.2 * share(plain.logits)


def test_train_discriminator_command_on_a_llama_model(llama_family, tmp_path):
    folder, loaded = llama_family
    data = tmp_path / "data.tsv"
    data.write_text("\n".join(f"{e.label}\t{e.text}" for e in synthetic_examples()), encoding="utf-8")
    group = click.Group("chatcore")
    pplm_plugin.register_commands(group)
    out = tmp_path / "head.safetensors"
    result = CliRunner().invoke(
        group,
        [
            "train",
            "discriminator",
            "--model",
            str(folder),
            "--data",
            str(data),
            "--out",
            str(out),
            "--epochs",
            "50",
            "--per-class",
            "10",
        ],
    )
    assert result.exit_code == 0, result.output
    head = read_head_config(out)
    assert (head.hidden_size, head.num_layers) == model_shape(loaded.model)
    steerer = PPLMSteerer.from_options({"discriminator": str(out), "class_label": head.classes[0], "stepsize": 0.3})
    tokens, session = decode(loaded, prompt_for(loaded, "how was your day?"), [steerer], tokens=3)
    assert tokens.shape == (1, 3) and steerer.perturbation.runner is not None
    assert steerer.perturbation.summary["optimised_steps"] == 3


@pytest.mark.slow
def test_the_defaults_steer_smollm2(smollm2):
    """On a real 30-layer chat model, with nothing but a topic: the bag of words builds for
    its tokenizer, the lean runner takes it, and the first reply token's topic probability
    rises (the default step is a share of each of its 15 perturbed layers' past)."""
    from chatcore.prompting import Message

    engine = Engine(smollm2, host=PluginHost())
    assert engine.prompt_format.name == "chat-template"
    prompt = engine.prompt_format.render([Message("user", "hi! what did you do today?")])
    steerer = PPLMSteerer.from_options({"topic": "food"})
    steered, plain = first_step(smollm2, steerer, prompt)
    perturbation = steerer.perturbation
    assert perturbation.runner is not None and perturbation.config.stepsize is None  # sized by the past
    targets = perturbation.attribute.start_mask
    assert int(targets.sum()) > 20
    share = lambda logits: float(torch.softmax(logits[0].float(), -1)[targets].sum())  # noqa: E731
    assert share(steered.logits) > 2 * share(plain.logits)
