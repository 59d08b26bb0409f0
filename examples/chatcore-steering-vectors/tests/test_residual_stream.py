"""How activation addition acts on the residual stream: the vector it reads, what it adds
where, and that batching and the key/value cache change nothing."""

from __future__ import annotations

import pytest
import torch

from chatcore.api import GenerationSession, Steerer, StepState, encode_text, model_step
from chatcore.testing import decode_steps
from chatcore_steering_vectors.residual import find_blocks
from chatcore_steering_vectors.steerer import split_prompts

FOOD = {
    "positive": "I love cooking dinner|let us talk about food|pizza and pasta are delicious"
    "|I am hungry, what should I eat?",
    "negative": "I love playing soccer|let us talk about movies|my job is boring|I am tired, what should I do?",
}


def session_for(loaded, steerers, prompt_ids=(1, 2, 3), max_new_tokens=4):
    return GenerationSession(
        model=loaded,
        prompt_ids=list(prompt_ids),
        steerers=list(steerers),
        max_new_tokens=max_new_tokens,
        generator=torch.Generator().manual_seed(0),
        seed=0,
    )


def prepared(engine, **settings):
    steerer = engine.make_steerer("activation-addition", {**FOOD, **settings})
    steerer.prepare(session_for(engine.loaded, [steerer]))
    return steerer


def prompt_state(ids):
    input_ids = torch.tensor([ids])
    return StepState(
        input_ids=input_ids,
        sequences=input_ids,
        attention_mask=torch.ones_like(input_ids),
        position_ids=torch.arange(len(ids)).unsqueeze(0),
        cache=None,
        step=0,
        prompt_length=len(ids),
    )


def block_inputs(model, index, run):
    """What block ``index`` received (= the output of block ``index - 1``) while ``run()`` ran."""
    seen = []
    handle = find_blocks(model)[index].register_forward_pre_hook(lambda module, args: seen.append(args[0].clone()))
    try:
        run()
    finally:
        handle.remove()
    return seen[0]


class LogitsRecorder(Steerer):
    """Listed last, so it sees the scores every other steerer produced."""

    name = "record-logits"

    def __init__(self) -> None:
        super().__init__(settings=object())
        self.logits: list[torch.Tensor] = []

    def wrap(self, step):
        def recorded(state):
            output = step(state)
            self.logits.append(output.logits.clone())
            return output

        return recorded


def test_prompts_are_separated_by_bars() -> None:
    assert split_prompts(" I love food | pizza is great||") == ["I love food", "pizza is great"]


@pytest.mark.parametrize("pool", ["mean", "last"])
def test_the_vector_is_the_mean_difference_of_the_layers_hidden_states(chatcore_engine, pool) -> None:
    loaded = chatcore_engine.loaded
    steerer = prepared(chatcore_engine, layer=0, strength=3, pool=pool)

    def mean_state(prompts: str) -> torch.Tensor:
        states = []
        for prompt in split_prompts(prompts):
            ids = torch.tensor([encode_text(loaded.tokenizer, prompt) + [loaded.eos_token_id]])
            with torch.no_grad():
                hidden = loaded.model(input_ids=ids, output_hidden_states=True).hidden_states[1][0]  # block 0's output
            states.append(hidden.mean(dim=0) if pool == "mean" else hidden[-1])
        return torch.stack(states).mean(dim=0)

    expected = 3 * (mean_state(FOOD["positive"]) - mean_state(FOOD["negative"]))
    assert expected.norm() > 0
    torch.testing.assert_close(steerer.addition, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("positions", ["all", "new"])
def test_the_step_adds_the_vector_to_the_layers_output(chatcore_engine, positions) -> None:
    model = chatcore_engine.loaded.model
    steerer = prepared(chatcore_engine, layer=0, positions=positions)
    state = prompt_state([5, 6, 7, 8])
    with torch.no_grad():
        plain = block_inputs(model, 1, lambda: model_step(model)(state))
        steered = block_inputs(model, 1, lambda: steerer.wrap(model_step(model))(state))
    change = steered - plain  # (1, T, C)
    addition = steerer.addition.expand_as(change)
    if positions == "all":
        torch.testing.assert_close(change, addition)
    else:  # the prompt is left alone; only the position the reply starts from moves
        torch.testing.assert_close(change[:, :-1], torch.zeros_like(change[:, :-1]))
        torch.testing.assert_close(change[:, -1:], addition[:, -1:])


def test_the_model_is_unsteered_after_a_step_even_one_that_raises(chatcore_engine) -> None:
    model = chatcore_engine.loaded.model
    steerer = prepared(chatcore_engine, strength=5)
    state = prompt_state([5, 6, 7])
    with torch.no_grad():
        before = model_step(model)(state).logits
        during = steerer.wrap(model_step(model))(state).logits

        def failing(state):
            model_step(model)(state)
            raise RuntimeError("inner step failed")

        with pytest.raises(RuntimeError, match="inner step failed"):
            steerer.wrap(failing)(state)
        after = model_step(model)(state).logits
    assert not torch.allclose(before, during)
    torch.testing.assert_close(after, before)


@pytest.mark.parametrize("positions", ["all", "new"])
def test_batched_cached_decoding_matches_a_full_forward_per_row(chatcore_engine, positions) -> None:
    loaded = chatcore_engine.loaded
    steerer = chatcore_engine.make_steerer("activation-addition", {**FOOD, "positions": positions, "strength": 4})
    greedy = chatcore_engine.make_decoder("greedy")
    for prompt in ([11, 12, 13, 14, 0], [21, 22, 0]):
        recorder = LogitsRecorder()
        session = session_for(loaded, [steerer, recorder], max_new_tokens=5, prompt_ids=prompt)
        steerer.prepare(session)
        generated = torch.stack(list(decode_steps(session, greedy.select)), dim=1)  # (1, steps)
        assert generated.size(1) >= 2
        row = 0
        tokens = generated[row].tolist()
        # A finished row is fed EOS that its attention mask hides: compare up to its end.
        steps = tokens.index(loaded.eos_token_id) + 1 if loaded.eos_token_id in tokens else len(tokens)
        ids = torch.tensor([prompt + tokens[: steps - 1]])

        start = len(prompt) - 1 if positions == "new" else 0

        def add(module, args, output, start=start):
            hidden = output[0] if isinstance(output, tuple) else output
            steered = torch.cat([hidden[:, :start], hidden[:, start:] + steerer.addition], dim=1)
            return (steered, *output[1:]) if isinstance(output, tuple) else steered

        handle = steerer.block.register_forward_hook(add)
        try:
            with torch.no_grad():
                full = loaded.model(input_ids=ids).logits[0, len(prompt) - 1 :]  # (steps, V)
        finally:
            handle.remove()
        cached = torch.stack([logits[row] for logits in recorder.logits[:steps]])  # (steps, V)
        torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-4)


def test_llama_style_models_are_steered_at_their_decoder_layers(chatcore_tiny_model) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from chatcore.api import LoadedModel
    from chatcore_steering_vectors import ActivationAddition

    torch.manual_seed(0)
    tokenizer = chatcore_tiny_model.tokenizer
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    assert find_blocks(model) is model.model.layers
    loaded = LoadedModel(
        name="tiny-llama", path="", model=model, tokenizer=tokenizer, device="cpu", dtype=torch.float32
    )
    steerer = ActivationAddition.from_options(FOOD)
    steerer.prepare(session_for(loaded, [steerer]))
    assert steerer.block is model.model.layers[1]  # a third of three layers
    state = prompt_state([5, 6, 7])
    with torch.no_grad():
        plain = block_inputs(model, 2, lambda: model_step(model)(state))
        steered = block_inputs(model, 2, lambda: steerer.wrap(model_step(model))(state))
    torch.testing.assert_close(steered - plain, steerer.addition.expand_as(plain))


def test_a_model_without_recognisable_blocks_is_reported() -> None:
    from chatcore.api import ChatcoreError

    class Odd(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = type("Config", (), {"num_hidden_layers": 4})()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])

    with pytest.raises(ChatcoreError, match="cannot find the transformer blocks of a Odd"):
        find_blocks(Odd())
