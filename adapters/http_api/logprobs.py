"""Log-probabilities in OpenAI's shapes: each token's text and bytes, for chat and for legacy completions.

The numbers come from the runner (:mod:`chatcore.serving.logprobs`): the scores the decoder
chose from, after steering and processors. JSON has no infinity, so a token the decoder's
filters removed (``-inf``) is sent as -9999.0, as OpenAI sends an impossible token.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from chatcore.streaming import TokenBytes

if TYPE_CHECKING:
    from chatcore.serving.logprobs import TokenLogprob

IMPOSSIBLE = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) and logprob > IMPOSSIBLE else IMPOSSIBLE


class TokenTexts:
    """Each token id's bytes and text, as the tokenizer writes it (cached per id).

    A byte-level BPE token (GPT-2, SmolLM2) maps back to its exact bytes, which may be part
    of one UTF-8 character: its text then holds U+FFFD and ``bytes`` the truth. SentencePiece
    byte tokens (``<0xE2>``) are that byte; ``▁`` is a space."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.bytes_of = TokenBytes(tokenizer)  # token id -> its bytes

    def text_of(self, token_id: int) -> str:
        return self.bytes_of(token_id).decode("utf-8", errors="replace")

    # -- POST /v1/chat/completions: choices[].logprobs -------------------------------------
    def chat(self, tokens: "list[TokenLogprob]") -> dict[str, Any]:
        return {"content": [self._chat_entry(token) for token in tokens], "refusal": None}

    def _chat_entry(self, token: "TokenLogprob") -> dict[str, Any]:
        entry = self._alternative(token.token_id, token.logprob)
        entry["top_logprobs"] = [self._alternative(token_id, logprob) for token_id, logprob in token.top]
        return entry

    def _alternative(self, token_id: int, logprob: float) -> dict[str, Any]:
        raw = self.bytes_of(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": finite(logprob), "bytes": list(raw)}

    # -- POST /v1/completions: the legacy shape -------------------------------------------------
    def legacy(self, tokens: "list[TokenLogprob]", offset: int) -> dict[str, Any]:
        """``tokens``, ``token_logprobs``, ``top_logprobs`` (token text -> log-probability) and
        ``text_offset`` (each token's start in the choice's text, from ``offset``)."""
        texts, offsets = [], []
        for token in tokens:
            text = self.text_of(token.token_id)
            texts.append(text)
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [finite(token.logprob) for token in tokens],
            "top_logprobs": [{self.text_of(i): finite(value) for i, value in token.top} for token in tokens],
            "text_offset": offsets,
        }
