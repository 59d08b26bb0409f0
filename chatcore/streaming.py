"""Incremental detokenization for streaming replies.

Byte-level BPE splits multi-byte characters (an emoji, an accented letter) across
tokens; decoding a prefix then ends in U+FFFD. The detokenizer holds such a tail back
until the character is complete, so no broken character is ever streamed, and the
concatenated deltas equal the decoding of all tokens at once.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = 0  # tokens before this have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now certain (maybe empty)."""
        self.token_ids.append(int(token_id))
        emitted = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        current = self._decode(self.token_ids[self.prefix_offset :])
        if len(current) > len(emitted) and not current.endswith(REPLACEMENT):
            delta = current[len(emitted) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return delta
        return ""

    def flush(self) -> str:
        """The held-back tail at the end of a reply (may contain U+FFFD if truly invalid)."""
        emitted = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        current = self._decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return current[len(emitted) :]
