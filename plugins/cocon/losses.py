"""CoCon's training losses (Lin et al., 2021): self-reconstruction, null content,
cycle and adversarial, with the discriminator the adversarial loss trains against."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from .history import History, beta_after_history, read_history
from .model_split import SplitModel
from .pipeline import CoconCache, CoconPipeline, RowGroup

if TYPE_CHECKING:
    from .training import CoconTrainConfig

# -- the discriminator -------------------------------------------------------------------


class HiddenDiscriminator(nn.Module):
    """Tells real hidden-state sequences (B, L, C) from the block's: convolutions of
    widths 1-3 over positions, max-pooled, then one logit per sequence."""

    def __init__(self, n_embd: int, channels: int = 128, widths: tuple[int, ...] = (1, 2, 3), dropout: float = 0.3):
        super().__init__()
        self.norm = nn.LayerNorm(n_embd)
        self.convolutions = nn.ModuleList(nn.Conv1d(n_embd, channels, width) for width in widths)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(channels * len(widths), 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.norm(hidden).transpose(1, 2)  # (B, C, L)
        pooled = [F.leaky_relu(conv(x).amax(dim=-1), 0.01) for conv in self.convolutions]  # each (B, channels)
        return self.out(self.dropout(torch.cat(pooled, dim=-1))).squeeze(-1)  # (B,)


# -- losses ------------------------------------------------------------------------------


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def weighted_lm_loss(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged with per-position ``weights`` (B, T)."""
    losses = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), reduction="none")
    weights = weights.reshape(-1).to(losses.dtype)
    return (losses * weights).sum() / weights.sum()


def mixed_lm_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    teacher: torch.Tensor,
    teacher_share: torch.Tensor | float,
) -> torch.Tensor:
    """Cross-entropy against a per-position mix of the text's token and a teacher's
    distribution, averaged with per-position ``weights``.

    logits: (B, T, V); targets, weights: (B, T); teacher: (B, T, V) probabilities;
    teacher_share: (B, T), or one share for every position. At a position with share s
    the target is (1 - s) * one-hot(token) + s * teacher; s = 0 everywhere is
    ``weighted_lm_loss``.
    """
    log_probs = F.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    text = -log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T)
    soft = -(teacher.float() * log_probs).sum(dim=-1)  # (B, T)
    share = torch.as_tensor(teacher_share, dtype=text.dtype, device=text.device)
    losses = (1.0 - share) * text + share * soft
    weights = weights.to(losses.dtype)
    return (losses * weights).sum() / weights.sum()


def plain_logits(
    split: SplitModel, alpha_hidden: torch.Tensor, history_length: int, history: History | None = None
) -> torch.Tensor:
    """The plain model's next-token scores (B, Tq, V), float32, at the positions the block
    rewrites (from the last history position on), from LM-alpha's hidden states (B, L, C);
    with the rows' ``history``, LM-beta runs over those positions alone."""
    if history is not None and history.length == history_length - 1:
        return split.head(beta_after_history(split, alpha_hidden[:, history.length :], history)).float()
    return split.head(split.beta(alpha_hidden, split.pass_inputs(alpha_hidden))[:, history_length - 1 :]).float()


def self_token_bias(
    queries: int, content_start: int, content_length: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """(1, Tq, S) bias hiding, from the query that predicts continuation token q, the content
    position that holds token q (content = continuation[content_start : content_start + S])."""
    q = torch.arange(queries, device=device)[:, None]
    j = torch.arange(content_length, device=device)[None, :]
    bias = torch.zeros(queries, content_length, dtype=dtype, device=device)
    bias.masked_fill_(j + content_start == q, torch.finfo(dtype).min)
    return bias.unsqueeze(0)


@dataclass
class BatchLosses:
    losses: dict[str, torch.Tensor]
    fake: torch.Tensor | None = None  # (B, L, C) the block's outputs while generating
    real: torch.Tensor | None = None  # (B, L', C) LM-alpha's hidden states of real continuations


class CoconLosses:
    """The reconstruction losses on one batch of windows (the discriminator's part is
    scored by the loop, which owns the discriminator)."""

    def __init__(
        self, pipeline: CoconPipeline, config: CoconTrainConfig, token_counts: torch.Tensor | None = None
    ) -> None:
        """token_counts: (V,) how often each token occurs in the training text; short
        content spans then favour rare tokens (see ``content_span``)."""
        self.pipeline = pipeline
        self.split = pipeline.split
        self.block = pipeline.block
        self.config = config
        self.content_max_tokens = int(config.content_max_tokens or config.continuation_tokens)
        self.token_weights = None
        if token_counts is not None and config.span_rarity > 0:
            self.token_weights = token_counts.double().clamp(min=1.0) ** -config.span_rarity  # (V,)

    def history_length(self, generator: torch.Generator) -> int:
        """This batch's history length: ``history_tokens``, or with ``min_history_tokens`` a
        length drawn log-uniformly between the two (chat prompts are mostly short)."""
        low, high = int(self.config.min_history_tokens), self.config.history_tokens  # type: ignore[arg-type]
        if low >= high:
            return high
        u = float(torch.rand((), generator=generator))
        return min(high, int(math.exp(math.log(low) + u * (math.log(high + 1) - math.log(low)))))

    def content_span(self, continuation: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, int]:
        """(start (B,), length) of each row's content within its continuation (B, tis).

        The whole continuation (the paper's content), or in ``short_content_share`` of the
        batches a span of 1 to ``short_content_max_tokens`` tokens. A short span starts
        at a rare token more often than at a frequent one: a content word ("guitar"),
        the kind of content people give, rather than "the" or ",", which the model
        predicts well without any content.
        """
        config = self.config
        B, tis = continuation.shape
        if float(torch.rand((), generator=generator)) >= config.short_content_share:
            length = self.content_max_tokens
            starts = torch.full((B,), int(torch.randint(0, tis - length + 1, (), generator=generator)))
            return starts, length
        length = int(torch.randint(1, config.short_content_max_tokens + 1, (), generator=generator))
        candidates = continuation[:, : tis - length + 1].cpu()  # (B, tis - length + 1)
        if self.token_weights is None:
            weights = torch.ones(candidates.shape, dtype=torch.double)
        else:
            weights = self.token_weights[candidates]
        return torch.multinomial(weights, 1, generator=generator).squeeze(1), length

    def content_kv(self, content_hidden: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        hide = None
        if self.block.training and self.config.content_mask_prob > 0:
            probabilities = torch.full(content_hidden.shape[:2], self.config.content_mask_prob)
            hide = torch.bernoulli(probabilities, generator=generator).bool().to(content_hidden.device)
        return self.block.content_keys_values(content_hidden, hide)

    def __call__(
        self, windows: torch.Tensor, generator: torch.Generator, with_cycle: bool, with_adv: bool
    ) -> BatchLosses:
        """windows: (B, history + continuation) token ids."""
        config, split = self.config, self.split
        hs = self.history_length(generator)
        windows = windows[:, config.history_tokens - hs :]
        if float(torch.rand((), generator=generator)) < config.no_history_share:
            # The start vector stands in for the history: the block reads [start, h_0 ..].
            windows, hs = windows[:, hs:], 0
            inputs = targets = windows
        else:
            inputs, targets = windows[:, :-1], windows[:, hs:]
        continuation = windows[:, hs:]  # (B, tis)
        starts, length = self.content_span(continuation, generator)
        span = starts.to(continuation.device)[:, None] + torch.arange(length, device=continuation.device)  # (B, S)
        # LM-alpha's states (B, L, C), and the model's keys/values over the history every pass reads unchanged
        alpha_hidden, history = read_history(split, inputs, hs)
        with torch.no_grad():
            content_hidden = split.hidden_at_split(continuation.gather(1, span))  # (B, S, C)
        keys, values = self.content_kv(content_hidden, generator)
        bias = None
        if config.self_token_mask and length == self.content_max_tokens:
            # Only the whole continuation is self-token masked: a short span (a word, a
            # phrase, the content people give in chat) would have its one useful token hidden.
            bias = self_token_bias(continuation.size(1), int(starts[0]), length, keys.dtype, keys.device)
        result = BatchLosses({})
        teacher = None
        if config.plain_target > 0 and hs > 0:
            with torch.no_grad():
                teacher = torch.softmax(plain_logits(split, alpha_hidden, hs, history), dim=-1)  # (B, Tq, V)
        # The self, null and cycle passes run as one (RowGroup): one launch of each kernel for all three.
        groups = [RowGroup(alpha_hidden, keys, values, bias)]
        if config.null_weight > 0:
            groups.append(RowGroup(alpha_hidden))
        if (with_cycle or with_adv) and hs > 0:
            reconstruction = self.cycle(windows, hs, alpha_hidden, with_cycle, with_adv, result, history)
            if reconstruction is not None:
                groups.append(reconstruction)
        logits, *others = self.pipeline.full_forward_groups(groups, hs, history)
        weights = torch.ones(targets.shape, device=targets.device)
        if bias is None:
            # A short content: weigh the positions that predict its own tokens, where
            # following the content pays, against the rest (targets = the continuation).
            weights.scatter_(1, span, config.span_weight)
        if teacher is None or bias is not None:
            # (the whole continuation as the content: every token is due, the text is the target)
            result.losses["self"] = weighted_lm_loss(logits, targets, weights)
        else:
            # The plain target only where no content token is due: off the span.
            share = torch.full(targets.shape, config.plain_target, device=targets.device).scatter_(1, span, 0.0)
            result.losses["self"] = mixed_lm_loss(logits, targets, weights, teacher, share)
        if config.null_weight > 0:
            logits = others.pop(0)
            if teacher is None:
                result.losses["null"] = lm_loss(logits, targets)
            else:
                result.losses["null"] = mixed_lm_loss(
                    logits, targets, torch.ones_like(weights), teacher, config.plain_target
                )
        if others:
            (logits,) = others
            result.losses["cycle"] = lm_loss(logits, targets[: logits.size(0)])
        return result

    def generate_soft(
        self,
        history_ids: torch.Tensor,
        content_keys: torch.Tensor,
        content_values: torch.Tensor,
        tokens: int,
        read: tuple[torch.Tensor, History] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Continue ``history_ids`` (B, hs) for ``tokens`` steps with the content, feeding back
        the expected embedding under each step's distribution, through the same cached steps
        as in chat.

        The embeddings are differentiable (the reconstruction reads them); the next step's
        LM-alpha reads each as a constant, as the paper's training does (it detaches the
        generated tokens' states before the block reads them), so no gradient runs back
        through LM-alpha's layers at every generated token. The block and LM-beta keep
        theirs, through the steps' caches.

        read: LM-alpha's states (B, hs - 1, C) and the model's keys/values (a History) of the
        first hs - 1 positions, already computed: only the last history token is run then.

        Returns (soft token embeddings (B, tokens, C), the block's outputs (B, tokens, C))."""
        from .pipeline import ContentMemory

        B, hs = history_ids.shape
        device = history_ids.device
        content = ContentMemory(
            content_keys,
            content_values,
            torch.zeros(1, 1, content_keys.size(2), dtype=content_keys.dtype, device=device),
            (content_keys.size(2),),
        )
        key_valid = torch.ones(B, hs + tokens, dtype=torch.long, device=device)
        if read is None:
            positions = torch.arange(hs, device=device).expand(B, hs)
            output = self.pipeline.forward(key_valid[:, :hs], positions, hs, content, input_ids=history_ids)
        else:
            earlier, history = read  # (B, q, C), q = hs - 1: the block adds their keys/values (no output)
            _, keys, values = self.block(
                earlier,
                key_valid[:, : history.length].bool(),
                content.keys.expand(B, -1, -1, -1),
                content.values.expand(B, -1, -1, -1),
                content.length,
                queries_from=history.length,
            )
            cache = CoconCache(history.cache(self.split), keys, values, content.length)
            position = torch.full((B, 1), history.length, device=device)
            output = self.pipeline.forward(
                key_valid[:, :hs], position, hs, content, input_ids=history_ids[:, history.length :], cache=cache
            )
        assert output.steered is not None
        embeddings, steered = [], [output.steered[:, -1:]]
        for t in range(tokens):
            embedding = self.split.soft_embed(torch.softmax(output.logits, dim=-1)).unsqueeze(1)  # (B, 1, C)
            embeddings.append(embedding)
            if t == tokens - 1:
                break
            position = torch.full((B, 1), hs + t, device=device)
            output = self.pipeline.forward(
                key_valid[:, : hs + t + 1],
                position,
                hs,
                content,
                inputs_embeds=embedding,
                cache=output.cache,
                detach_alpha=True,
            )
            assert output.steered is not None
            steered.append(output.steered)
        return torch.cat(embeddings, dim=1), torch.cat(steered, dim=1)

    def cycle(
        self,
        windows: torch.Tensor,
        hs: int,
        alpha_hidden: torch.Tensor,
        with_cycle: bool,
        with_adv: bool,
        result: BatchLosses,
        history: History | None = None,
    ) -> RowGroup | None:
        """Sample i's content after sample i-1's history -> a soft generation y; then y as
        the content must reconstruct sample i's continuation after its own history (hs tokens):
        the rows of that reconstruction's pass (``with_cycle``), to run with the batch's others.
        ``history``: the batch's (chatcore.plugins.cocon.history), reused for the generation."""
        config, split, block = self.config, self.split, self.block
        rows = min(config.cycle_batch_size, windows.size(0))
        windows, alpha_hidden = windows[:rows], alpha_hidden[:rows]
        with torch.no_grad():
            content_hidden = split.hidden_at_split(windows[:, hs : hs + self.content_max_tokens])
        keys, values = block.content_keys_values(content_hidden)
        # Row r generates after its own history with row r + 1's content; rolled by one, row i
        # then holds the generation after row i - 1's history with its own content.
        read = None
        if history is not None:
            history = history.first(rows)
            read = (alpha_hidden[:, : history.length], history)
        embeddings, steered = self.generate_soft(
            windows[:, :hs], keys.roll(-1, dims=0), values.roll(-1, dims=0), config.cycle_tokens, read
        )
        embeddings, steered = embeddings.roll(1, dims=0), steered.roll(1, dims=0)
        if with_adv:
            result.fake = steered
            result.real = alpha_hidden[:, hs:]
        if not with_cycle:
            return None
        length = embeddings.size(1)
        positions = torch.arange(length, device=embeddings.device).expand(rows, -1)
        generated = split.embed(positions, inputs_embeds=embeddings)
        generated_hidden = split.alpha(generated, split.pass_inputs(generated, positions))  # (rows, L, C)
        cycle_keys, cycle_values = block.content_keys_values(generated_hidden)
        return RowGroup(alpha_hidden, cycle_keys, cycle_values)
