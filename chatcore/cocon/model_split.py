"""A GPT-2-style Hugging Face model run in two halves: LM-alpha and LM-beta.

LM-alpha is the embeddings and blocks ``[0, split)``; LM-beta is blocks ``[split, n)``,
the final layer norm and the LM head. Both run the model's own modules
(``transformer.wte / wpe / h[i] / ln_f`` and ``lm_head`` of a ``GPT2LMHeadModel``),
so any GPT-2-architecture checkpoint (chatcore-tiny, DialoGPT) works unchanged.

Keys and values live in one ``transformers.DynamicCache`` per sequence batch: each
``GPT2Block`` writes to the cache layer of its own index, so alpha's layers
``[0, split)`` and beta's layers ``[split, n)`` are kept apart in it, and each half only
ever touches its own.

Shapes: B batch rows, T new positions, P cached positions, C = n_embd, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch

from chatcore.errors import ChatcoreError


class UnsupportedModelError(ChatcoreError):
    """The model is not a GPT-2-style causal LM that CoCon can split."""


class SplitModel:
    """A frozen GPT-2-style causal LM, split at ``split_layer``."""

    def __init__(self, model: Any, split_layer: int) -> None:
        transformer = getattr(model, "transformer", None)
        parts = ("wte", "wpe", "h", "ln_f")
        if transformer is None or not all(hasattr(transformer, p) for p in parts) or not hasattr(model, "lm_head"):
            raise UnsupportedModelError(
                f"CoCon needs a GPT-2-architecture model (GPT2LMHeadModel, as DialoGPT and chatcore-tiny are); "
                f"got {type(model).__name__}"
            )
        n_layer = len(transformer.h)
        if not 1 <= split_layer < n_layer:
            raise UnsupportedModelError(
                f"the CoCon split layer must be between 1 and {n_layer - 1} for a {n_layer}-layer model, got {split_layer}"
            )
        self.model = model
        self.transformer = transformer
        self.split_layer = split_layer
        self.n_layer = n_layer

    # -- facts -----------------------------------------------------------------------
    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def n_embd(self) -> int:
        return int(self.transformer.wte.weight.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.wte.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.transformer.wte.weight.device

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    # -- masks -----------------------------------------------------------------------
    def causal_mask(self, key_valid: torch.Tensor, new_length: int) -> torch.Tensor:
        """Additive mask (B, 1, T, P + T) for the model's own attention.

        key_valid: (B, P + T), 1/True for real tokens, 0/False for left padding. The T
        queries are the last T positions. A float mask (0 or the dtype's most negative
        number) works for both the eager and the SDPA attention of transformers.
        """
        B, K = key_valid.shape
        T = new_length
        P = K - T
        device = key_valid.device
        query_positions = torch.arange(P, K, device=device)
        key_positions = torch.arange(K, device=device)
        visible = (key_positions[None, :] <= query_positions[:, None])[None] & key_valid[:, None, :].bool()  # (B, T, K)
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=device)
        mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
        return mask.unsqueeze(1)

    # -- the halves --------------------------------------------------------------------
    def embed(
        self,
        position_ids: torch.Tensor,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token (or given) embeddings plus position embeddings: (B, T, C)."""
        if inputs_embeds is None:
            assert input_ids is not None, "give input_ids or inputs_embeds"
            inputs_embeds = self.transformer.wte(input_ids)
        return self.transformer.drop(inputs_embeds + self.transformer.wpe(position_ids))

    def run_layers(
        self,
        hidden: torch.Tensor,
        layers: range,
        mask: torch.Tensor,
        cache: Any = None,
        collect: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        for index in layers:
            hidden = self.transformer.h[index](hidden, past_key_values=cache, attention_mask=mask,
                                               use_cache=cache is not None)
            if collect is not None:
                collect.append(hidden)
        return hidden

    def alpha(self, hidden: torch.Tensor, mask: torch.Tensor, cache: Any = None,
              collect: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Blocks [0, split): (B, T, C) embeddings -> (B, T, C) hidden states at the split."""
        return self.run_layers(hidden, range(0, self.split_layer), mask, cache, collect)

    def beta(self, hidden: torch.Tensor, mask: torch.Tensor, cache: Any = None,
             collect: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Blocks [split, n) then the final layer norm: (B, T, C) -> (B, T, C)."""
        hidden = self.run_layers(hidden, range(self.split_layer, self.n_layer), mask, cache, collect)
        hidden = self.transformer.ln_f(hidden)
        if collect is not None:
            collect[-1] = hidden  # as transformers reports it: the last entry after ln_f
        return hidden

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, C) final hidden states -> (B, T, V) logits."""
        return self.model.lm_head(hidden)

    def hidden_at_split(self, input_ids: torch.Tensor, key_valid: torch.Tensor | None = None) -> torch.Tensor:
        """LM-alpha's hidden states (B, T, C) of whole sequences, positions from 0, no cache."""
        B, T = input_ids.shape
        if key_valid is None:
            key_valid = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        else:  # left padding: each row's first real token is position 0
            positions = (key_valid.long().cumsum(-1) - 1).clamp(min=0)
        return self.alpha(self.embed(positions, input_ids=input_ids), self.causal_mask(key_valid, T))
