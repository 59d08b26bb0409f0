"""Log-probabilities in OpenAI's shapes: each token's text and bytes, for chat and for legacy completions.

The numbers come from the runner (:mod:`chatcore.serving.logprobs`): the scores the decoder
chose from, after steering and processors. JSON has no infinity, so a token the decoder's
filters removed (``-inf``) is sent as -9999.0, as OpenAI sends an impossible token.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

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
        self._bytes: dict[int, bytes] = {}
        self._byte_level: dict[str, int] | None = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and type(backend.decoder).__name__ == "ByteLevel":
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self._byte_level = {char: byte for byte, char in bytes_to_unicode().items()}

    def bytes_of(self, token_id: int) -> bytes:
        known = self._bytes.get(token_id)
        if known is not None:
            return known
        piece = str(self.tokenizer.convert_ids_to_tokens(token_id) or "")
        if self._byte_level is not None and piece and all(char in self._byte_level for char in piece):
            raw = bytes(self._byte_level[char] for char in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            raw = bytes([int(piece[3:5], 16)])
        else:
            raw = piece.replace("\u2581", " ").encode("utf-8")
        self._bytes[token_id] = raw
        return raw

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
