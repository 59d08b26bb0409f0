"""PPLM's lean forward and low-rank deltas: the same numbers as the model's own forward, on
chatcore-tiny (GPT-2) and tiny random Llama-family models (rotary positions, grouped-query
attention, RMSNorm)."""

from __future__ import annotations

import pytest
import torch

from chatcore.decoding import GenerationSession
from chatcore.models import cache_keyword, output_cache
from chatcore.plugins.pplm.kv import GrowingPast, fresh_cache, past_of
from chatcore.plugins.pplm.lean_passes import LowRankGradient
from chatcore.plugins.pplm.model_passes import DenseGradient
from chatcore.plugins.pplm.perturb import apply_deltas
from chatcore.plugins.pplm.plugin import PPLMSteerer
from chatcore.plugins.pplm.runner import LowRankDeltas, Runner, supports
from chatcore.steering import Steerer
from chatcore.step import StepOutput, StepState
from chatcore.testing import build_tiny_model, decode_steps
from chatcore.text import encode_text

FOOD = "pizza,cheese,dinner,hungry,delicious,hamburger,spaghetti"
RUNNER_MODELS = ("gpt2", "llama", "qwen2", "gemma", "mistral", "phi3")


@pytest.fixture(scope="module")
def tiny_family(tmp_path_factory):
    """A function: architecture -> a tiny random model of it (4 heads over 2 key/value heads
    for the Llama family), loaded once per module; "gpt2" is the bundled chatcore-tiny."""
    from chatcore.models import load_model

    built = {}

    def get(architecture: str):
        if architecture not in built:
            folder = build_tiny_model(tmp_path_factory.mktemp(architecture), architecture=architecture, heads=4, seed=3)
            built[architecture] = load_model(str(folder), device="cpu", dtype="float32")
        return built[architecture]

    return get


@pytest.fixture(params=RUNNER_MODELS)
def any_model(request, tiny_family):
    return request.getfixturevalue("loaded") if request.param == "gpt2" else tiny_family(request.param)


def padded_batch(loaded, texts: list[str]):
    """Left-padded (B, T) ids, attention mask and position ids of ``texts`` (EOS-closed turns)."""
    eos = loaded.eos_token_id
    rows = [encode_text(loaded.tokenizer, text) + [eos] for text in texts]
    length = max(len(row) for row in rows)
    ids = torch.full((len(rows), length), eos, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, length - len(row) :] = torch.tensor(row)
        mask[index, length - len(row) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def random_low_rank(past, window: int, rank: int, scale: float = 0.3, seed: int = 0) -> LowRankDeltas:
    generator = torch.Generator().manual_seed(seed)
    batch, heads, _, head_dim = past[0][0].shape
    layers = len(past)

    def draw(*shape):
        return torch.randn(*shape, generator=generator) * scale

    return LowRankDeltas(
        draw(layers, batch, heads, window, rank),
        draw(layers, batch, heads, rank, head_dim),
        draw(layers, batch, heads, window, rank),
        draw(layers, batch, heads, rank, head_dim),
    )


def model_pass(model, ids, mask, positions, past, dense=None):
    """The model's own forward of the last column from ``past`` (+ dense deltas), as PPLM's
    generic path runs it."""
    deltas = None if dense is None else list(dense.unbind(0))
    cache = fresh_cache(apply_deltas(past, deltas), model.config)
    return model(
        input_ids=ids[:, -1:],
        attention_mask=mask,
        position_ids=positions[:, -1:],
        **{cache_keyword(model): cache},
        use_cache=True,
        output_hidden_states=True,
    )


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("with_deltas", [False, True])
def test_runner_matches_the_model_forward(any_model, padded, with_deltas):
    loaded = model = any_model
    model = loaded.model
    assert supports(model)
    texts = ["hi, what did you have for dinner?", "do you like rain?" if padded else "do you like the rain today?"]
    ids, mask, positions = padded_batch(loaded, texts)
    if not padded:
        ids, mask, positions = ids[:, -8:], torch.ones_like(mask[:, -8:]), torch.arange(8).expand(2, -1)
    with torch.no_grad():
        past = past_of(
            output_cache(
                model(
                    input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1], use_cache=True
                )
            )
        )
        deltas = random_low_rank(past, window=4, rank=2) if with_deltas else None
        reference = model_pass(model, ids, mask, positions, past, None if deltas is None else deltas.dense())
        mine = Runner(model).forward(
            past,
            positions[:, -1:],
            input_ids=ids[:, -1:],
            key_mask=mask.bool() if padded else None,
            deltas=deltas,
            hidden_states=True,
        )
    assert padded == bool((mask == 0).any())
    assert torch.allclose(mine.logits, reference.logits[:, -1].float(), atol=1e-5)
    assert mine.hidden_states is not None and len(mine.hidden_states) == len(reference.hidden_states)
    for ours, theirs in zip(mine.hidden_states, reference.hidden_states):
        assert ours.shape == theirs[:, -1:].shape
        assert torch.allclose(ours, theirs[:, -1:], atol=1e-5)
    for (keys, values), layer in zip(mine.new, output_cache(reference).layers):
        assert torch.allclose(keys, layer.keys[:, :, -1:], atol=1e-5)
        assert torch.allclose(values, layer.values[:, :, -1:], atol=1e-5)


def test_runner_from_a_layer_reuses_what_lies_below(any_model):
    """Deltas on the top layer only: a pass from that layer, reusing the first pass's start,
    computes what the model's forward does from the past with those deltas."""
    loaded = any_model
    model = loaded.model
    ids, mask, positions = padded_batch(loaded, ["hi, what did you have for dinner?", "do you like rain?"])
    top = model.config.num_hidden_layers - 1
    runner = Runner(model)
    with torch.no_grad():
        past = past_of(
            output_cache(
                model(
                    input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1], use_cache=True
                )
            )
        )
        plain = runner.forward(past, positions[:, -1:], input_ids=ids[:, -1:], key_mask=mask.bool(), from_layer=top)
        full = random_low_rank(past, window=4, rank=2)
        deltas = LowRankDeltas(full.key_a[top:], full.key_b[top:], full.value_a[top:], full.value_b[top:])
        dense = list(deltas.dense().unbind(0))
        reference = model(
            input_ids=ids[:, -1:],
            attention_mask=mask,
            position_ids=positions[:, -1:],
            **{cache_keyword(model): fresh_cache(apply_deltas(past, dense, top), model.config)},
            use_cache=True,
            output_hidden_states=True,
        )
        mine = runner.forward(
            past,
            positions[:, -1:],
            input_ids=ids[:, -1:],
            key_mask=mask.bool(),
            deltas=deltas,
            hidden_states=True,
            start=plain.start,
            from_layer=top,
        )
    assert plain.start is not None and plain.start.layer == top and len(plain.start.new) == top
    assert mine.start is plain.start
    assert torch.allclose(mine.logits, reference.logits[:, -1].float(), atol=1e-5)
    assert not torch.allclose(mine.logits, plain.logits, atol=1e-3)  # the deltas took part
    assert mine.hidden_states is not None and len(mine.hidden_states) == len(reference.hidden_states)
    for ours, theirs in zip(mine.hidden_states, reference.hidden_states):
        assert torch.allclose(ours, theirs[:, -1:], atol=1e-5)
    for (keys, values), layer in zip(mine.new, output_cache(reference).layers):
        assert torch.allclose(keys, layer.keys[:, :, -1:], atol=1e-5)
        assert torch.allclose(values, layer.values[:, :, -1:], atol=1e-5)
    with pytest.raises(ValueError, match="from_layer"):
        runner.forward(past, positions[:, -1:], input_ids=ids[:, -1:], from_layer=top + 1)


def test_probe_gradients_are_the_dense_delta_gradients(any_model):
    """The deltas' gradients from the probes (sums of outer products over the query heads of
    each key/value head) equal autograd's on dense deltas."""
    loaded = any_model
    model = loaded.model
    ids, mask, positions = padded_batch(loaded, ["what should we cook tonight?", "hello there!"])
    with torch.no_grad():
        past = past_of(
            output_cache(
                model(
                    input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1], use_cache=True
                )
            )
        )
    window = 5
    deltas = random_low_rank(past, window=window, rank=1, scale=0.2)
    targets = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    targets[torch.arange(3, model.config.vocab_size, 7)] = True

    def loss_of(logits):
        log_probs = torch.log_softmax(logits.float(), -1)
        return -torch.logsumexp(log_probs.masked_fill(~targets, float("-inf")), -1).sum()

    dense = deltas.dense().clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(
        loss_of(model_pass(model, ids, mask, positions, past, dense).logits[:, -1]), dense
    )
    runner = Runner(model)
    layers, (batch, heads, _, head_dim) = len(past), past[0][0].shape
    probes = (
        torch.zeros((layers, batch, heads, runner.group, window), requires_grad=True),
        torch.zeros((layers, batch, heads, runner.group, head_dim), requires_grad=True),
    )
    output = runner.forward(
        past, positions[:, -1:], input_ids=ids[:, -1:], key_mask=mask.bool(), deltas=deltas, probes=probes
    )
    score_grad, output_grad = torch.autograd.grad(loss_of(output.logits), probes)
    key_grad = score_grad.transpose(-1, -2) @ output.queries  # (layers, B, H_kv, W, D)
    value_grad = output.window_probs.transpose(-1, -2) @ output_grad
    got = torch.stack([key_grad, value_grad], dim=1).flatten(0, 1)
    assert expected.abs().max() > 0
    assert torch.allclose(got, expected, atol=1e-6, rtol=1e-4)


def test_low_rank_and_dense_gradients_take_the_same_step():
    """The two runners' gradients: the low-rank one (factors per key/value head) has the
    norms of, and takes the step of, the dense gradient its factors multiply out to."""
    generator = torch.Generator().manual_seed(0)
    layers, batch, heads, group, window, head_dim = 2, 3, 2, 2, 4, 5

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    score_grad, queries = draw(layers, batch, heads, group, window), draw(layers, batch, heads, group, head_dim)
    window_probs, output_grad = draw(layers, batch, heads, group, window), draw(layers, batch, heads, group, head_dim)
    low_rank = LowRankGradient(score_grad, queries, window_probs, output_grad)
    keys = score_grad.transpose(-1, -2) @ queries  # (layers, B, H_kv, W, D)
    values = window_probs.transpose(-1, -2) @ output_grad
    dense = DenseGradient(torch.stack([keys, values], dim=1).flatten(0, 1))
    assert low_rank.squared_norms().shape == (layers, batch)
    assert torch.allclose(low_rank.squared_norms(), dense.squared_norms())
    scales = draw(layers, batch).abs()
    taken = low_rank.step(None, scales)
    start = torch.zeros(2 * layers, batch, heads, window, head_dim, dtype=torch.float64)
    assert torch.allclose(taken.dense(), dense.step(start.clone(), scales))
    assert torch.allclose(low_rank.step(taken, scales).dense(), dense.step(dense.step(start, scales), scales))


def test_growing_past():
    generator = torch.Generator().manual_seed(0)
    past = [
        (torch.randn(2, 3, 4, 5, generator=generator), torch.randn(2, 3, 4, 5, generator=generator)) for _ in range(2)
    ]
    grown = GrowingPast(past, capacity=5)
    new = [
        (torch.randn(2, 3, 1, 5, generator=generator), torch.randn(2, 3, 1, 5, generator=generator)) for _ in range(2)
    ]
    for _ in range(3):  # past the first capacity: the buffer grows
        grown.append(new)
    assert grown.length == 7
    for (keys, values), (old_keys, old_values), (new_keys, _) in zip(grown.view(), past, new):
        assert torch.equal(keys[:, :, :4], old_keys) and torch.equal(values[:, :, :4], old_values)
        assert torch.equal(keys[:, :, 6:], new_keys)
    before = [tuple(t.clone() for t in layer) for layer in grown.view()]
    deltas = LowRankDeltas(
        *(
            torch.randn(*shape, generator=generator)
            for shape in ((2, 2, 3, 3, 2), (2, 2, 3, 2, 5), (2, 2, 3, 3, 2), (2, 2, 3, 2, 5))
        )
    )
    grown.add_recent_products(deltas.key_a, deltas.key_b, deltas.value_a, deltas.value_b)
    dense = deltas.dense()
    for index, ((keys, values), (old_keys, old_values)) in enumerate(zip(grown.view(), before)):
        assert torch.equal(keys[:, :, :4], old_keys[:, :, :4])  # outside the window: untouched
        assert torch.allclose(keys[:, :, 4:], old_keys[:, :, 4:] + dense[2 * index], atol=1e-6)
        assert torch.allclose(values[:, :, 4:], old_values[:, :, 4:] + dense[2 * index + 1], atol=1e-6)
    second_row = torch.tensor([1])
    grown.add_recent(torch.ones(4, 1, 3, 2, 5), second_row)
    after = grown.view()
    assert torch.allclose(after[0][0][1, :, 5:], before[0][0][1, :, 5:] + dense[0][1, :, 1:] + 1, atol=1e-6)
    assert torch.allclose(after[0][0][0, :, 5:], before[0][0][0, :, 5:] + dense[0][0, :, 1:], atol=1e-6)


class Passthrough(Steerer):
    """An inner steerer that changes nothing (so that PPLM is not the innermost layer)."""

    name = "passthrough"

    def __init__(self) -> None:
        super().__init__(None)

    def wrap(self, step):
        def same(state: StepState) -> StepOutput:
            return step(state)

        return same


def steered_run(loaded, settings: dict, inner: bool, rows: int = 1, tokens: int = 5, finish_first_at: int = -1):
    """Greedy decoding under pplm; the per-step scores, the chosen tokens and the steerer."""
    eos = loaded.eos_token_id
    prompt = encode_text(loaded.tokenizer, "what do you want to eat tonight?") + [eos]
    steerer = PPLMSteerer.from_options({"words": FOOD, **settings})
    steerers = [Passthrough(), steerer] if inner else [steerer]
    session = GenerationSession(
        model=loaded,
        prompt_ids=prompt,
        steerers=steerers,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        generator=torch.Generator().manual_seed(0),
        seed=0,
    )
    for each in steerers:
        each.prepare(session)
    scores_seen = []

    def select(scores, generator):
        scores_seen.append(scores.clone())
        chosen = scores.argmax(-1)
        if len(scores_seen) - 1 == finish_first_at:
            chosen[0] = eos
        return chosen

    chosen = torch.stack(list(decode_steps(session, select, rows=rows)), dim=1)
    return scores_seen, chosen, steerer


@pytest.mark.parametrize(
    "settings",
    [
        {"stepsize": 0.3, "carry": True},
        {"stepsize": 0.3, "carry": False},
        {"stepsize": 0.3, "carry": True, "layer_share": 1.0},
        {"stepsize": 0.3, "carry": False, "layer_share": 1.0},
        {"stepsize": 0.3, "window_length": 3, "decay": True, "carry": True},
        {"stepsize": 0.2, "grad_length": 2, "num_iterations": 2, "carry": True},
        {"stepsize": 0.4, "gm_scale": 0.6, "steer_every": 2, "carry": False},
    ],
)
def test_the_lean_path_computes_what_the_generic_path_does(loaded, settings):
    check_lean_equals_generic(loaded, settings)


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "gemma"])
@pytest.mark.parametrize(
    "settings", [{"stepsize": 0.3, "carry": True, "window_length": 3, "decay": True}, {"stepsize": 0.3, "carry": False}]
)
def test_the_lean_path_computes_what_the_generic_path_does_on_llama_family(tiny_family, architecture, settings):
    check_lean_equals_generic(tiny_family(architecture), settings)


def check_lean_equals_generic(loaded, settings):
    lean_scores, lean_tokens, lean = steered_run(loaded, settings, inner=False)
    generic_scores, generic_tokens, generic = steered_run(loaded, settings, inner=True)
    assert lean.perturbation.runner is not None and generic.perturbation.runner is None
    assert lean.perturbation.summary["runner_passes"] > 0 and generic.perturbation.summary["runner_passes"] == 0
    assert torch.equal(lean_tokens, generic_tokens)
    for ours, theirs in zip(lean_scores, generic_scores):
        assert torch.allclose(ours, theirs, atol=1e-4)
    plain_scores, _, _ = steered_run(loaded, {"stepsize": 0}, inner=False)
    assert not torch.allclose(lean_scores[1], plain_scores[1], atol=1e-3)  # and it did steer


def test_the_lean_path_stops_finished_rows_like_the_generic_path(loaded):
    runs = [
        steered_run(loaded, {"stepsize": 0.3, "carry": True}, inner=inner, rows=3, tokens=4, finish_first_at=1)
        for inner in (False, True)
    ]
    (lean_scores, lean_tokens, _), (generic_scores, generic_tokens, _) = runs
    assert torch.equal(lean_tokens, generic_tokens)
    assert bool((lean_tokens[0, 1:] == loaded.eos_token_id).all())
    for ours, theirs in zip(lean_scores, generic_scores):
        assert torch.allclose(ours[1:], theirs[1:], atol=1e-4)


def test_the_plain_pass_is_the_first_iteration_without_carry(loaded):
    """Without a carried past, a steered step costs num_iterations + 1 passes: the plain pass
    is the first iteration's forward (its deltas are zero)."""
    counts = {}
    for carry in (False, True):
        _, _, steerer = steered_run(loaded, {"stepsize": 0.3, "carry": carry}, inner=False, tokens=4)
        summary = steerer.perturbation.summary
        counts[carry] = (summary["runner_passes"], summary["inner_calls"])
    # step 0: the prompt pass (the model's own) + 3 iterations + the perturbed pass; then:
    assert counts[False] == (4 + 3 * 4, 1)  # 3 iterations (the first is the plain pass) + perturbed
    assert counts[True] == (4 + 3 * 5, 1)  # plain + 3 iterations + perturbed


def test_the_lean_path_agrees_for_a_discriminator(loaded, tmp_path):
    from chatcore.plugins.pplm.attribute import HeadConfig, model_shape, save_head, tokenizer_fingerprint

    hidden, layers = model_shape(loaded.model)
    config = HeadConfig(
        classes=["negative", "positive"],
        hidden_size=hidden,
        num_layers=layers,
        layer=layers - 1,
        tokenizer_fingerprint=tokenizer_fingerprint(loaded.tokenizer),
        base_model="tiny",
    )
    generator = torch.Generator().manual_seed(1)
    path = save_head(tmp_path / "head.safetensors", torch.randn(2, hidden, generator=generator), torch.zeros(2), config)
    runs = {}
    for inner in (False, True):
        eos = loaded.eos_token_id
        prompt = encode_text(loaded.tokenizer, "how was your day?") + [eos]
        steerer = PPLMSteerer.from_options(
            {"discriminator": str(path), "class_label": "positive", "stepsize": 0.3, "horizon_length": 2}
        )
        steerers = [Passthrough(), steerer] if inner else [steerer]
        session = GenerationSession(
            model=loaded,
            prompt_ids=prompt,
            steerers=steerers,
            max_new_tokens=4,
            min_new_tokens=4,
            generator=torch.Generator().manual_seed(0),
            seed=0,
        )
        for each in steerers:
            each.prepare(session)
        seen: list = []
        tokens = list(
            decode_steps(session, lambda scores, g, seen=seen: seen.append(scores.clone()) or scores.argmax(-1))
        )
        runs[inner] = (seen, tokens, steerer.perturbation)
    (lean_scores, lean_tokens, lean), (generic_scores, generic_tokens, generic) = runs[False], runs[True]
    assert lean.runner is not None and generic.runner is None
    assert [int(t) for t in lean_tokens] == [int(t) for t in generic_tokens]
    for ours, theirs in zip(lean_scores, generic_scores):
        assert torch.allclose(ours, theirs, atol=1e-4)


@pytest.mark.slow
def test_the_compiled_layers_compute_what_the_eager_ones_do(tiny_family, monkeypatch):
    """``CHATCORE_FAST_PATH=compile``: the runner's layers run through torch.compile (forward
    and, for the iterations' gradients, backward) and steer to the eager runner's scores (a
    Llama: GPT-2's layers go through the same wrapper)."""
    import shutil

    from chatcore.plugins.pplm import compiled
    from chatcore.serving.static_step import FAST_PATH_ENV

    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("torch.compile on the CPU needs a C++ compiler")
    model = tiny_family("llama")
    settings = {"stepsize": 0.3, "carry": True, "window_length": 3}
    eager_scores, eager_tokens, eager = steered_run(model, settings, inner=False)
    monkeypatch.setenv(FAST_PATH_ENV, "compile")
    scores, tokens, steered = steered_run(model, settings, inner=False)
    runner = steered.perturbation.runner
    assert runner is not None and all(isinstance(layer, compiled.CompiledLayer) for layer in runner.layers)
    assert not any(isinstance(layer, compiled.CompiledLayer) for layer in eager.perturbation.runner.layers)
    if compiled._failed:
        pytest.skip("torch.compile could not compile the layers on this machine")
    assert {kind.__name__ for kind, _ in compiled._compiled} >= {type(runner.layers[0].layer).__name__}
    assert torch.equal(tokens, eager_tokens)
    for ours, theirs in zip(scores, eager_scores):
        assert torch.allclose(ours, theirs, atol=1e-4)


def test_a_compile_that_fails_leaves_the_layers_uncompiled(loaded, monkeypatch, caplog):
    """Where torch.compile cannot make the layers' functions, one warning says so and the
    runner steers as uncompiled; a failure of the uncompiled layer too is raised as it is."""
    import logging

    from chatcore.plugins.pplm import compiled
    from chatcore.serving.static_step import FAST_PATH_ENV

    def broken(function, **settings):
        def run(*arguments):
            raise RuntimeError(
                "no working C++ compiler\n\nSet TORCHDYNAMO_VERBOSE=1 for the internal stack trace"
            )  # torch's advice: left out

        return run

    settings = {"stepsize": 0.3, "carry": True}
    expected_scores, expected_tokens, _ = steered_run(loaded, settings, inner=False)
    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(compiled, "_compiled", {})
    monkeypatch.setattr(compiled, "_failed", False)
    monkeypatch.setenv(FAST_PATH_ENV, "compile")
    with caplog.at_level(logging.WARNING, logger=compiled.__name__):
        scores, tokens, _ = steered_run(loaded, settings, inner=False)
    assert torch.equal(tokens, expected_tokens)
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(scores, expected_scores))
    lines = [record.getMessage() for record in caplog.records if record.name == compiled.__name__]
    assert lines == [
        compiled.COMPILING,
        "pplm: compiling the perturbed passes' layers failed, running them uncompiled: "
        "RuntimeError: no working C++ compiler",
    ]
    monkeypatch.setattr(compiled, "_failed", False)
    layer = Runner(loaded.model).layers[0]
    with pytest.raises(RuntimeError, match="mat1 and mat2|size|shape"):  # the input's fault, not the compiler's
        layer.project(torch.zeros(1, 3), None)
    assert not compiled._failed
