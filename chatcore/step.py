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

    A step covers rows of one reply (1, or a decoder's candidates), which all share
    the reply's prompt; docs/hooks.md ("What a steerer sees") is the whole contract.

    input_ids:       (B, T_in)  tokens to feed now: at step 0 the prompt (only the part
                                the cache does not hold yet, when a cached prefix of it
                                was reused), then the one token chosen at the last step.
    sequences:       (B, T)     every token so far: the whole prompt, then the tokens
                                chosen so far; it ends with ``input_ids``
                                (``sequences[:, prompt_length:]`` is the reply so far).
    attention_mask:  (B, T)     over ``sequences``: 1 for the tokens each row attends to;
                                0 for the EOS fed to a row after it ended. Pass it on
                                unchanged to a model forward of your own.
    position_ids:    (B, T_in)  positions of ``input_ids``.
    cache:           the model's key/value cache for ``sequences[:, :-T_in]``
                     (None at step 0 unless a prefix was reused; None for a steerer
                     that shares the batch, whose inner step hands back scores only).
                     Model forward passes update a cache in place.
    step:            0 for the prompt, then 1, 2, ...: the number of tokens chosen so far.
    prompt_length:   the number of columns of ``sequences`` that belong to the prompt.
    output_hidden_states: ask the model for hidden states (a steerer that needs them
                     sets it on the state it passes inward).
    rows:            the reply's row ids that the B rows are, in order: ``(0, ..., N-1)``
                     from the runner; a wrapper that passes a subset inward (PPLM runs
                     its gradient passes on the rows still writing) gives their ids, so
                     a steerer keeping per-row state indexes it by ``rows``.
    probe:           True for an extra pass a wrapper runs to look ahead (PPLM's gradient
                     and perturbed passes): the reply does not continue from it, so a
                     steerer must not advance state of its own on it. Exactly one call
                     per step is not a probe.
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
    probe: bool = False

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


def model_step(model: Any, run: Callable[..., Any] | None = None) -> Step:
    """The innermost step: one cached forward pass of a Hugging Face causal LM (through
    ``run`` where given: a callable taking the model's keyword arguments, such as its
    compiled pass)."""
    cache_argument = cache_keyword(model)
    forward = model if run is None else run

    def step(state: StepState) -> StepOutput:
        output = forward(
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
