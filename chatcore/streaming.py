"""Incremental detokenization for streaming replies.

Byte-level BPE splits multi-byte characters (an emoji, an accented letter) across
tokens; decoding a prefix then ends in U+FFFD. The detokenizer holds such a tail back
until the character is complete, so no broken character is ever streamed, and the
concatenated deltas equal the decoding of all tokens at once. A reply that ends before
the character does (cut by its token budget in the middle of an emoji) drops it: the
text ends on its last whole character, and its token ids stay as they are.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class TokenBytes:
    """Each token id's bytes, as the tokenizer writes them (cached per id).

    A byte-level BPE token (GPT-2, SmolLM2) maps back to its exact bytes, which may be part
    of one UTF-8 character. SentencePiece byte tokens (``<0xE2>``) are that byte; ``▁`` is a
    space; any other token is its text's UTF-8."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}
        self._byte_level: dict[str, int] | None = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and type(backend.decoder).__name__ == "ByteLevel":
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self._byte_level = {char: byte for byte, char in bytes_to_unicode().items()}

    @property
    def byte_level(self) -> bool:
        """Whether the tokenizer decodes its tokens' bytes all together (one U+FFFD for each
        broken sequence), rather than SentencePiece's way (one U+FFFD for each broken byte)."""
        return self._byte_level is not None

    def __call__(self, token_id: int) -> bytes:
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


# A UTF-8 lead byte: (the character's length in bytes, the range its second byte is in), after
# the Unicode standard's table of well-formed byte sequences (3-7): E0 A0, ED 9F, F0 90 and F4 8F
# bound the second byte so that no character is written long, is a surrogate or is past U+10FFFF.
_LEADS: dict[int, tuple[int, range]] = {
    **{lead: (2, range(0x80, 0xC0)) for lead in range(0xC2, 0xE0)},
    0xE0: (3, range(0xA0, 0xC0)),
    **{lead: (3, range(0x80, 0xC0)) for lead in (*range(0xE1, 0xED), 0xEE, 0xEF)},
    0xED: (3, range(0x80, 0xA0)),
    0xF0: (4, range(0x90, 0xC0)),
    **{lead: (4, range(0x80, 0xC0)) for lead in range(0xF1, 0xF4)},
    0xF4: (4, range(0x80, 0x90)),
}
_CONTINUATION = range(0x80, 0xC0)


def unfinished_bytes(raw: bytes) -> int:
    """How many bytes at the end of ``raw`` begin a UTF-8 character without finishing it: 0
    when ``raw`` ends on a whole character, or on bytes that no following byte could make one."""
    for start in range(len(raw) - 1, max(len(raw) - 4, -1), -1):
        if raw[start] in _CONTINUATION:
            continue
        length, second = _LEADS.get(raw[start], (0, range(0)))
        begun = raw[start + 1 :]
        if len(raw) - start >= length:  # not a lead byte, or all its bytes are there
            return 0
        if begun and (begun[0] not in second or any(byte not in _CONTINUATION for byte in begun[1:])):
            return 0
        return len(raw) - start
    return 0


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = 0  # tokens before this have been emitted
        self._token_bytes: TokenBytes | None = None  # made when a reply ends in U+FFFD

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
        """The held-back tail at the end of a reply, less a character its last tokens began
        and did not finish. Bytes that no token could have completed stay, as U+FFFD; so does
        a U+FFFD the model wrote as a character."""
        emitted = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        current = self._decode(self.token_ids[self.prefix_offset :])
        held = self.token_ids[self.read_offset :]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        tail = current[len(emitted) :]
        return tail[: len(tail) - self._unfinished_marks(held, tail)]

    def _unfinished_marks(self, held: list[int], tail: str) -> int:
        """How many U+FFFD at the end of ``tail`` (the text of ``held``) stand for a character
        begun and not finished."""
        if not tail.endswith(REPLACEMENT):
            return 0
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.tokenizer)
        token_bytes = self._token_bytes
        unfinished = unfinished_bytes(b"".join(token_bytes(token_id) for token_id in held))
        if not unfinished:
            return 0
        marks = 1 if token_bytes.byte_level else unfinished
        return min(marks, len(tail) - len(tail.rstrip(REPLACEMENT)))
