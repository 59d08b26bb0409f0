"""The discriminator's input: the mean hidden state of the reply, with a soft horizon.

A discriminator head reads the mean over the reply of one layer's hidden states. For the
step being optimised that mean covers the reply's earlier positions (the plain passes'
states, summed as the reply goes), the fed token (the perturbed pass's state, through
which the gradients flow) and ``horizon_length`` soft tokens: expected embeddings under
the predicted distribution, run from the plain past by the step's runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .kv import select_rows

if TYPE_CHECKING:
    from chatcore.api import StepOutput, StepState

    from .attribute import AttributeModel
    from .kv import Past
    from .passes import PassOutput, PassRunner


@dataclass
class HiddenContext:
    """What the mean of one optimised step starts from, for its rows.

    past:      the plain past including the fed token (the horizon starts there);
    previous:  (b, C) sum of the plain hidden states of the reply's earlier positions, or None;
    count:     how many positions that sum covers.
    """

    past: Past
    previous: torch.Tensor | None
    count: int


class ReplyHidden:
    """The running sum of the reply's plain hidden states (of the attribute's layer), and
    the mean the discriminator's loss reads."""

    def __init__(self, attribute: AttributeModel, model: Any, horizon_length: int) -> None:
        self.attribute = attribute
        self.model = model
        self.horizon_length = horizon_length
        self.reset()

    def reset(self) -> None:
        self.total: torch.Tensor | None = None  # (B, C) plain hidden states of the reply so far
        self.count = 0

    def note(self, plain: StepOutput) -> None:
        """Add the plain pass's hidden state of the fed token to the reply's running sum."""
        if not self.attribute.needs_hidden:
            return
        assert plain.hidden_states is not None, "the inner step did not return hidden states"
        hidden = plain.hidden_states[self.attribute.layer][:, -1].float()  # (B, C)
        self.total = hidden if self.total is None else self.total + hidden
        self.count += 1

    def context(self, past: Past, rows: torch.Tensor | None) -> HiddenContext:
        """``past``: the plain past including the fed token; ``rows``: the rows optimised (None: all)."""
        previous = self.total
        if rows is not None:
            past = select_rows(past, rows)
            previous = previous[rows] if previous is not None else None
        return HiddenContext(past, previous, self.count)

    def mean(
        self,
        output: PassOutput,
        log_probs: torch.Tensor,
        fed: StepState,
        context: HiddenContext,
        runner: PassRunner[Any, Any],
    ) -> torch.Tensor:
        """(b, C) mean over the reply's earlier positions (plain), the fed token (the pass
        ``output``, perturbed) and the horizon's soft tokens (gradients reach the deltas
        through them)."""
        assert output.hidden_states is not None
        layer = self.attribute.layer
        total = output.hidden_states[layer][:, -1].float()
        if context.previous is not None:
            total = total + context.previous
        horizon = self.horizon_length
        if horizon:
            embeddings = self.model.get_input_embeddings().weight.detach()  # (V', C)
            vocab = min(embeddings.size(0), log_probs.size(-1))
            probs = log_probs[:, :vocab].exp()
            mask, position = fed.attention_mask, fed.position_ids[:, -1:]
            start = runner.horizon_start(context.past)
            for index in range(horizon):
                soft = (probs.to(embeddings.dtype) @ embeddings[:vocab]).unsqueeze(1)  # (b, 1, C)
                mask = torch.cat([mask, mask.new_ones((mask.size(0), 1))], dim=1)
                position = position + 1
                hidden, logits, start = runner.soft_pass(start, soft, mask, position, layer, index + 1 < horizon)
                total = total + hidden.float()
                probs = torch.softmax(logits[:, :vocab].float(), dim=-1)
        return total / (context.count + 1 + horizon)
