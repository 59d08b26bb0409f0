"""One decoding step, the unit that steerers wrap.

``Step = Callable[[StepState], StepOutput]``. The innermost step runs the model on
``state.input_ids`` with ``state.cache``; a steerer receives a step and returns a new
one (``steerer.wrap(step)``) that may change the state it passes in (a perturbed
cache, a request for hidden states), call the inner step any number of times, and
change what comes out (logits, cache, hidden states).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chatcore.models import cache_keyword, output_cache

if TYPE_CHECKING:
    import torch


@dataclass
class StepState:
    """What one step sees.

    input_ids:       (B, T_in)  tokens to feed now: the whole prompt at step 0, then one.
    sequences:       (B, T)     every token so far, one row per reply being decoded
                                together (MMI's candidates, a batch): the prompt,
                                left-padded to the longest row, then the tokens
                                generated so far; it ends with ``input_ids``. Read it to
                                see what was written (``sequences[:, prompt_length:]``
                                is the reply so far).
    attention_mask:  (B, T)     over ``sequences``: 1 for real tokens, 0 for the left
                                padding of shorter prompts. Pass it on unchanged to a
                                model forward of your own.
    position_ids:    (B, T_in)  positions of ``input_ids`` (padding not counted).
    cache:           the model's key/value cache for ``sequences[:, :-T_in]``
                     (None at step 0). Model forward passes update a cache in place.
    step:            0 for the prompt, then 1, 2, ...
    prompt_length:   T of the padded prompt: the number of columns of ``sequences``
                     that belong to the prompt (the same for every row).
    output_hidden_states: ask the model for hidden states (a steerer that needs them
                     sets it on the state it passes inward).
    """

    input_ids: "torch.Tensor"
    sequences: "torch.Tensor"
    attention_mask: "torch.Tensor"
    position_ids: "torch.Tensor"
    cache: Any
    step: int
    prompt_length: int
    output_hidden_states: bool = False
    rows: tuple[int, ...] = ()

    def replace(self, **changes: Any) -> "StepState":
        return dataclasses.replace(self, **changes)


@dataclass
class StepOutput:
    """What one step returns.

    logits:         (B, V) float32 next-token scores in log space: the model's raw
                    logits, or log-probabilities from a steerer that normalises (PPLM).
                    The two differ by a constant per row, which the softmax ignores, so
                    an additive edit means one thing either way: adding ``b`` to a
                    token's score multiplies its probability by ``e**b`` relative to
                    the other tokens. ``-inf`` bans a token.
    cache:          the cache to use for the next step.
    hidden_states:  per layer (embeddings first), each (B, T_in, C), when asked for.
    """

    logits: "torch.Tensor"
    cache: Any
    hidden_states: "tuple[torch.Tensor, ...] | None" = None

    def replace(self, **changes: Any) -> "StepOutput":
        return dataclasses.replace(self, **changes)


Step = Callable[[StepState], StepOutput]


def model_step(model: Any) -> Step:
    """The innermost step: one cached forward pass of a Hugging Face causal LM."""
    cache_argument = cache_keyword(model)

    def step(state: StepState) -> StepOutput:
        output = model(
            input_ids=state.input_ids,
            attention_mask=state.attention_mask,
            position_ids=state.position_ids,
            **{cache_argument: state.cache},
            use_cache=True,
            output_hidden_states=state.output_hidden_states,
            logits_to_keep=1,  # only the last position's scores are needed
        )
        return StepOutput(
            logits=output.logits[:, -1, :].float(),
            cache=output_cache(output),
            hidden_states=output.hidden_states if state.output_hidden_states else None,
        )

    return step
