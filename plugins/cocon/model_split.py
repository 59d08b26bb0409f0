"""A Hugging Face causal LM run in two halves: LM-alpha and LM-beta.

LM-alpha is the embeddings and blocks ``[0, split)``; LM-beta is blocks ``[split, n)``,
the final norm and the LM head. Both run the model's own modules, found and called
through :mod:`chatcore.anatomy`, so GPT-2 checkpoints (chatcore-tiny, DialoGPT) and
Llama-family models (Llama, SmolLM2, Qwen2, Mistral, Gemma, Phi) work unchanged.

One pass (alpha, then beta, on the same new positions) shares one
:class:`~chatcore.anatomy.BlockInputs`: the attention masks, built with transformers' own
mask utilities before alpha's first block extends the cache, and, for rotary models,
the ``(cos, sin)`` of the new positions. Keys and values live in one
``transformers.DynamicCache`` per sequence batch: each block writes to the cache layer of
its own index, so alpha's layers ``[0, split)`` and beta's layers ``[split, n)`` are kept
apart in it, and each half only ever touches its own.

Shapes: B batch rows, T new positions, P cached positions, C width, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch

from chatcore.api import BlockInputs, UnsupportedModelError, anatomy_of

__all__ = ["SplitModel", "UnsupportedModelError"]


class SplitModel:
    """A frozen causal LM, split at ``split_layer``."""

    def __init__(self, model: Any, split_layer: int) -> None:
        self.anatomy = anatomy_of(model)
        n_layer = self.anatomy.n_layer
        if not 1 <= split_layer < n_layer:
            raise UnsupportedModelError(
                f"the CoCon split layer must be between 1 and {n_layer - 1} for a {n_layer}-layer model, "
                f"got {split_layer}"
            )
        self.model = model
        self.split_layer = split_layer
        self.n_layer = n_layer

    # -- facts -----------------------------------------------------------------------
    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def n_embd(self) -> int:
        return self.anatomy.width

    @property
    def n_head(self) -> int:
        return self.anatomy.n_head

    @property
    def dtype(self) -> torch.dtype:
        return self.anatomy.dtype

    @property
    def device(self) -> torch.device:
        return self.anatomy.device

    def new_cache(self) -> Any:
        return self.anatomy.new_cache()

    # -- one pass ----------------------------------------------------------------------
    def embed(
        self,
        position_ids: torch.Tensor,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token (or given) embeddings, plus learned position embeddings where the model has them: (B, T, C)."""
        return self.anatomy.embed(position_ids, input_ids=input_ids, inputs_embeds=inputs_embeds)

    def soft_embed(self, probabilities: torch.Tensor) -> torch.Tensor:
        """The expected token embedding (B, T, C) under next-token probabilities (B, T, V), as
        ``embed`` would scale a token's (Gemma multiplies by sqrt(width))."""
        return self.anatomy.soft_embed(probabilities)

    def pass_inputs(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        key_valid: torch.Tensor | None = None,
        cache: Any = None,
    ) -> BlockInputs:
        """Masks and rotary embeddings for T new positions (``hidden`` (B, T, C)), shared by
        alpha and beta; build it before alpha runs on ``cache``.

        position_ids: (B, T), default 0 .. T - 1. key_valid: (B, P + T), 1 for real tokens,
        0 for left padding; None for no padding.
        """
        if position_ids is None:
            B, T, _ = hidden.shape
            position_ids = torch.arange(T, device=hidden.device).expand(B, T)
        if key_valid is not None:
            key_valid = key_valid.long()
        return self.anatomy.block_inputs(hidden, position_ids, key_valid, cache)

    # -- the halves --------------------------------------------------------------------
    def alpha(
        self, hidden: torch.Tensor, inputs: BlockInputs, collect: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Blocks [0, split): (B, T, C) embeddings -> (B, T, C) hidden states at the split."""
        return self.anatomy.run_blocks(hidden, range(0, self.split_layer), inputs, collect)

    def beta(
        self, hidden: torch.Tensor, inputs: BlockInputs, collect: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Blocks [split, n) then the final norm: (B, T, C) -> (B, T, C)."""
        hidden = self.anatomy.run_blocks(hidden, range(self.split_layer, self.n_layer), inputs, collect)
        hidden = self.anatomy.final(hidden)
        if collect is not None:
            collect[-1] = hidden  # as transformers reports it: the last entry after the final norm
        return hidden

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, C) final hidden states -> (B, T, V) logits."""
        return self.anatomy.logits(hidden)

    def hidden_at_split(self, input_ids: torch.Tensor, key_valid: torch.Tensor | None = None) -> torch.Tensor:
        """LM-alpha's hidden states (B, T, C) of whole sequences, positions from 0, no cache."""
        B, T = input_ids.shape
        if key_valid is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        else:  # left padding: each row's first real token is position 0
            positions = (key_valid.long().cumsum(-1) - 1).clamp(min=0)
        embeddings = self.embed(positions, input_ids=input_ids)
        return self.alpha(embeddings, self.pass_inputs(embeddings, positions, key_valid))
