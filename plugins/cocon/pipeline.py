"""LM-alpha -> CoCon block -> LM-beta, with a cache for each, one step at a time.

Which positions the block rewrites (the same in training and in chat): every position
from the last prompt token on, that is the one that predicts the reply's first token
and every reply token after it. Earlier prompt positions reach LM-beta as LM-alpha
left them, but still give the block their keys and values, so the reply is steered
with the whole history in view while the history itself is read as the plain model
reads it. This is the paper's training setup (history hidden states pass through
unchanged, the transformed sequence starts at the last history position).

Caches (in :class:`CoconCache`): the model's ``DynamicCache`` (alpha's layers and
beta's layers, see chatcore.plugins.cocon.model_split), and the block's keys/values: the
content's (computed once per reply) followed by one entry per sequence position.
Each step feeds only the new tokens; nothing re-runs the sequence.

Shapes: B rows, T new positions, P cached positions, S content positions, C width, V vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .block import CoconBlock
from .history import History, beta_after_history
from .model_split import SplitModel


@dataclass
class ContentMemory:
    """The content's block keys/values and its attention bias, ready for every step.

    keys, values: (1 or B, H, S, D); bias: (1 or B, 1, S), tau at each content position.
    lengths: the token count of each content input, in order.
    """

    keys: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor
    lengths: tuple[int, ...]

    @property
    def length(self) -> int:
        return int(self.keys.size(2))


@dataclass
class RowGroup:
    """Rows of a training pass with one content, for :meth:`CoconPipeline.full_forward_groups`.

    alpha_hidden: (b, L, C); keys, values: (b, H, S, D) the content's, or None for none;
    bias: (b or 1, Tq or 1, S) added at the content positions (the self-token mask), or None.
    """

    alpha_hidden: torch.Tensor
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.alpha_hidden.size(0))


@dataclass
class CoconCache:
    """Everything a CoCon step caches.

    model:        the base model's DynamicCache (alpha layers [0, split), beta layers [split, n)).
    block_keys:   (B, H, S + P, D) the content's keys, then one per cached sequence position.
    block_values: (B, H, S + P, D)
    content_length: S.
    """

    model: Any
    block_keys: torch.Tensor
    block_values: torch.Tensor
    content_length: int

    @property
    def length(self) -> int:
        """P: sequence positions cached."""
        return int(self.block_keys.size(2)) - self.content_length


@dataclass
class CoconOutput:
    logits: torch.Tensor  # (B, V) for the last position, or (B, Tq, V) with all_logits
    cache: CoconCache | None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    steered: torch.Tensor | None = None  # (B, Tq, C) the block's outputs (for training)


class CoconPipeline:
    def __init__(self, split: SplitModel, block: CoconBlock) -> None:
        assert block.config.n_embd == split.n_embd, "block and model widths differ"
        self.split = split
        self.block = block

    # -- content ------------------------------------------------------------------------
    def encode_content(self, contents: Sequence[Sequence[int]], taus: Sequence[float]) -> ContentMemory | None:
        """Run each content text (token ids) through LM-alpha alone, positions from 0, and
        project it to block keys/values; tau[i] biases the positions of content i.
        None when there is no content (the block then attends over the sequence only)."""
        assert len(contents) == len(taus), "one tau per content"
        device = self.split.device
        keys, values, biases, lengths = [], [], [], []
        for ids, tau in zip(contents, taus):
            if not ids:
                continue
            tokens = torch.tensor([list(ids)], dtype=torch.long, device=device)  # (1, S_i)
            hidden = self.split.hidden_at_split(tokens)  # (1, S_i, C)
            k, v = self.block.content_keys_values(hidden)
            keys.append(k)
            values.append(v)
            biases.append(torch.full((len(ids),), float(tau), device=device))
            lengths.append(len(ids))
        if not keys:
            return None
        bias = torch.cat(biases).view(1, 1, -1).to(self.split.dtype)
        return ContentMemory(torch.cat(keys, dim=2), torch.cat(values, dim=2), bias, tuple(lengths))

    # -- one step -----------------------------------------------------------------------
    def forward(
        self,
        key_valid: torch.Tensor,
        position_ids: torch.Tensor,
        prompt_length: int,
        content: ContentMemory | None,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cache: CoconCache | None = None,
        use_cache: bool = True,
        content_bias: torch.Tensor | None = None,
        all_logits: bool = False,
        output_hidden_states: bool = False,
        detach_alpha: bool = False,
    ) -> CoconOutput:
        """Feed T new positions (token ids or embeddings) after the cached ones.

        key_valid:     (B, P + T) 1 for real tokens, 0 for left padding (the whole sequence so far).
        position_ids:  (B, T) positions of the new tokens.
        prompt_length: positions before ``prompt_length - 1`` pass the block unchanged.
        content_bias:  (B, Tq, S) replaces the content's tau bias (training's self-token mask).
        all_logits:    logits for every rewritten new position (B, Tq, V), else the last (B, V).
        detach_alpha:  LM-alpha runs without gradients: the block reads its states as constants
                       (training's cycle generation, see CoconLosses.generate_soft).
        """
        split, block = self.split, self.block
        alpha_grad = torch.no_grad() if detach_alpha else contextlib.nullcontext()
        with alpha_grad:
            embeddings = split.embed(position_ids, input_ids=input_ids, inputs_embeds=inputs_embeds)  # (B, T, C)
        B, T, _ = embeddings.shape
        past = cache.length if cache is not None else 0
        assert key_valid.shape == (B, past + T), f"key_valid {tuple(key_valid.shape)} != {(B, past + T)}"
        model_cache = cache.model if cache is not None else (split.new_cache() if use_cache else None)
        inputs = split.pass_inputs(embeddings, position_ids, key_valid, model_cache)  # masks, rotary: both halves
        collect: list[torch.Tensor] | None = [embeddings] if output_hidden_states else None

        with alpha_grad:
            hidden = split.alpha(embeddings, inputs, collect)  # (B, T, C)

        past_keys: torch.Tensor | None
        past_values: torch.Tensor | None
        if cache is not None:
            past_keys, past_values, content_length = cache.block_keys, cache.block_values, cache.content_length
        elif content is not None:
            past_keys = content.keys.expand(B, -1, -1, -1)
            past_values = content.values.expand(B, -1, -1, -1)
            content_length = content.length
        else:
            past_keys = past_values = None
            content_length = 0
        if content_bias is None and content is not None and content_length:
            content_bias = content.bias
        steer_from = min(max(prompt_length - 1 - past, 0), T)
        steered, keys, values = block(
            hidden, key_valid.bool(), past_keys, past_values, content_length, content_bias, queries_from=steer_from
        )  # (B, Tq, C)
        beta_input = torch.cat([hidden[:, :steer_from], steered], dim=1) if steer_from else steered
        if collect is not None:
            collect[-1] = beta_input  # the residual stream the upper layers actually read

        final = split.beta(beta_input, inputs, collect)  # (B, T, C)
        if all_logits:
            logits = split.head(final[:, steer_from:]).float()  # (B, Tq, V)
        else:
            logits = split.head(final[:, -1]).float()  # (B, V)
        new_cache = CoconCache(model_cache, keys, values, content_length) if use_cache else None
        return CoconOutput(logits, new_cache, tuple(collect) if collect is not None else None, steered)

    # -- whole sequences (training, and the reference the cached steps are tested against) --
    def full_forward_groups(
        self, groups: Sequence[RowGroup], history_length: int, history: History | None = None
    ) -> list[torch.Tensor]:
        """:meth:`full_forward`'s logits for several groups of rows, each with its own content
        or none, in one pass: the groups' rows are stacked, their contents padded to the
        longest, and the padding (a group without content: every content position) hidden
        from their queries, which is what the block computes without it. The same logits and
        gradients as one pass per group (up to the order of floating-point sums), with the
        model's kernels launched once instead of once per group.

        history: the keys/values of the rows of the largest group (chatcore.plugins.cocon.history);
        each group's rows are the first of the batch. Returns each group's (b, Tq, V) logits."""
        if history is not None:
            history = History.stacked([history.first(group.rows) for group in groups])
        sequence = torch.cat([group.alpha_hidden for group in groups]) if len(groups) > 1 else groups[0].alpha_hidden
        queries = sequence.size(1) - history_length + 1 if history_length else sequence.size(1)
        keys, values, bias = _stacked_contents(groups, queries)
        logits, _ = self.full_forward(sequence, history_length, keys, values, bias, history)
        return list(logits.split([group.rows for group in groups]))

    def full_forward(
        self,
        alpha_hidden: torch.Tensor,
        history_length: int,
        content_keys: torch.Tensor | None = None,
        content_values: torch.Tensor | None = None,
        content_bias: torch.Tensor | None = None,
        history: History | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits for every rewritten position of whole, unpadded sequences, no cache.

        alpha_hidden:  (B, L, C) LM-alpha's hidden states of the input tokens (positions from 0).
        history_length: hs. With hs >= 1, positions [hs - 1, L) are rewritten (Tq = L - hs + 1);
                       with hs = 0 the learned start vector stands in for the history and
                       the block reads [start, h_0 .. h_{L-2}] (Tq = L), so that output q
                       always predicts continuation token q.
        content_keys/values: (B, H, S, D) from ``block.content_keys_values``; None for no content.
        content_bias:  (B or 1, Tq or 1, S), e.g. the self-token mask.
        history:       the model's keys/values over positions [0, hs - 1) of these rows
                       (chatcore.plugins.cocon.history): LM-beta then runs over the
                       rewritten positions alone. The same logits and gradients.

        Returns (logits (B, Tq, V) float32, steered (B, Tq, C)).
        """
        split, block = self.split, self.block
        B, L, _ = alpha_hidden.shape
        if history_length == 0:
            sequence = torch.cat([block.start_vector(B).to(alpha_hidden.dtype), alpha_hidden[:, :-1]], dim=1)
            queries_from = 0
        else:
            sequence = alpha_hidden
            queries_from = history_length - 1
        T = sequence.size(1)
        key_valid = torch.ones(B, T, dtype=torch.bool, device=sequence.device)
        S = content_keys.size(2) if content_keys is not None else 0
        steered, _, _ = block(sequence, key_valid, content_keys, content_values, S, content_bias, queries_from)
        if history is not None and queries_from == history.length:
            return split.head(beta_after_history(split, steered, history)).float(), steered
        beta_input = torch.cat([sequence[:, :queries_from], steered], dim=1) if queries_from else steered
        final = split.beta(beta_input, split.pass_inputs(beta_input))
        return split.head(final[:, queries_from:]).float(), steered


def _stacked_contents(
    groups: Sequence[RowGroup], queries: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The groups' contents as one batch's: keys and values (N, H, S, D) padded with zeros to
    the longest, and the bias (N, Tq, S) that keeps each group's own (or none) and hides its
    padding from its queries, as the block hides masked keys. (None, None, None) when no
    group has a content; one group's own when it is the only group."""
    contents = [group for group in groups if group.keys is not None]
    if not contents:
        return None, None, None
    if len(groups) == 1:
        return groups[0].keys, groups[0].values, groups[0].bias
    first = contents[0].keys
    assert first is not None
    _, heads, _, width = first.shape
    longest = max(int(group.keys.size(2)) for group in contents if group.keys is not None)
    blocked = torch.finfo(first.dtype).min
    keys, values, biases = [], [], []
    for group in groups:
        length = 0 if group.keys is None else int(group.keys.size(2))
        bias = first.new_zeros((group.rows, queries, longest))
        if group.bias is not None:
            bias[:, :, :length] = group.bias.to(bias.dtype)
        bias[:, :, length:] = blocked
        biases.append(bias)
        padding = first.new_zeros((group.rows, heads, longest - length, width))
        if group.keys is None or group.values is None:
            keys.append(padding)
            values.append(padding)
        else:
            keys.append(torch.cat([group.keys, padding], dim=2) if length < longest else group.keys)
            values.append(torch.cat([group.values, padding], dim=2) if length < longest else group.values)
    return torch.cat(keys), torch.cat(values), torch.cat(biases)
