"""The held-out losses a CoCon training run reports at each evaluation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.nn import functional as F

from .history import read_history
from .losses import lm_loss, plain_logits, self_token_bias
from .pipeline import CoconPipeline

if TYPE_CHECKING:
    from .training import CoconTrainConfig


def heldout_losses(
    pipeline: CoconPipeline,
    windows: torch.Tensor,
    config: CoconTrainConfig,
    autocast: Any,
    token_counts: torch.Tensor | None = None,
) -> dict[str, float]:
    """Per-token losses on fixed held-out windows: the plain model ("plain"), the block
    with no content ("null"), the whole continuation as content, self-token masked, so
    the number reflects use of the content rather than copying ("self"), and one token
    of the continuation as the content, as a one-word content in chat ("word": the
    continuation's rarest token by ``token_counts``, else a random one)."""
    split, block = pipeline.split, pipeline.block
    hs = config.history_tokens
    content_max = int(config.content_max_tokens or config.continuation_tokens)
    was_training = block.training
    block.eval()
    sums = {"plain": 0.0, "null": 0.0, "self": 0.0, "word": 0.0, "null_kl": 0.0}
    count = 0
    picks = torch.Generator().manual_seed(config.seed + 2)
    counts = token_counts.to(split.device) if token_counts is not None else None
    with torch.no_grad(), autocast():
        for first in range(0, windows.size(0), config.batch_size):
            batch = windows[first : first + config.batch_size].to(split.device)
            inputs, targets = batch[:, :-1], batch[:, hs:]
            B = inputs.size(0)
            alpha_hidden, history = read_history(split, inputs, hs)  # (B, L, C), the history every pass reads
            plain = plain_logits(split, alpha_hidden, hs, history)  # (B, Tq, V)
            continuation = batch[:, hs : hs + content_max]
            keys, values = block.content_keys_values(split.hidden_at_split(continuation))
            bias = self_token_bias(targets.size(1), 0, continuation.size(1), keys.dtype, keys.device)
            if counts is None:
                word_at = torch.randint(0, targets.size(1), (B, 1), generator=picks).to(split.device)
            else:
                word_at = counts[targets].argmin(dim=1, keepdim=True)  # (B, 1)
            word_keys, word_values = block.content_keys_values(split.hidden_at_split(targets.gather(1, word_at)))
            n = targets.numel()
            sums["plain"] += lm_loss(plain, targets).item() * n
            null = pipeline.full_forward(alpha_hidden, hs, history=history)[0]
            sums["null"] += lm_loss(null, targets).item() * n
            plain_log = F.log_softmax(plain, dim=-1)
            kl = (plain_log.exp() * (plain_log - F.log_softmax(null.float(), dim=-1))).sum(dim=-1)  # (B, Tq)
            sums["null_kl"] += kl.sum().item()
            self_logits = pipeline.full_forward(alpha_hidden, hs, keys, values, bias, history)[0]
            sums["self"] += lm_loss(self_logits, targets).item() * n
            word_logits = pipeline.full_forward(alpha_hidden, hs, word_keys, word_values, history=history)[0]
            sums["word"] += lm_loss(word_logits, targets).item() * n
            count += n
    block.train(was_training)
    return {name: value / max(1, count) for name, value in sums.items()}
