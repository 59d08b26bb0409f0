"""Per-token log-probabilities of a reply: each chosen token's, and the best alternatives'.

Taken from the scores the decoder chose from: the model's, edited by the reply's steerers,
with the banned tokens removed and the decoder's processors applied (repetition controls,
``logit_bias``, temperature, top-k and top-p filters). A token those filters removed has a
log-probability of ``-inf``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One chosen token: its id, its log-probability, and the ``top`` best (id, log-probability), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def chosen_logprobs(scores: "torch.Tensor", tokens: "torch.Tensor", top: int) -> list[TokenLogprob]:
    """Each row's entry for ``tokens`` (rows,) chosen from ``scores`` (rows, V), with ``top`` alternatives."""
    import torch

    logprobs = torch.log_softmax(scores.float(), dim=-1)  # (rows, V)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    ids = tokens.tolist()
    if top:
        values, indices = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)  # (rows, top)
        alternatives = [
            tuple(zip(row_ids, row_values)) for row_ids, row_values in zip(indices.tolist(), values.tolist())
        ]
    else:
        alternatives = [() for _ in ids]
    return [TokenLogprob(token, value, others) for token, value, others in zip(ids, chosen, alternatives)]
