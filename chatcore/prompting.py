"""Prompt formats: from a conversation (system prompt and turns) to the prompt's token ids.

A prompt format renders a list of :class:`Message` into token ids that end where the
reply starts, and says which tokens end a reply (:attr:`PromptFormat.stop_token_ids`)
and which special tokens a reply must never contain
(:attr:`PromptFormat.banned_token_ids`). Formats are plugins: the built-in ``dialogpt``
and ``chat-template`` are registered by ``chatcore.plugins.prompt_formats`` through the
``register_prompt_formats`` hook, and ``auto`` (:func:`choose_format`) takes the
tokenizer's chat template when it has one, else ``dialogpt``.

What holds for every format (the base class does it, so a plugin gets it for free):

- :meth:`PromptFormat.fit` drops the oldest whole turns until the prompt fits the
  budget, never the system prompt; a kept history starts with a user turn where the
  format asks for it (chat templates may refuse an assistant turn first); if the
  newest turn alone is too long, only its most recent tokens are kept; a system
  prompt that leaves no room is an error.
- User text is never turned into special tokens: a subclass encodes message text with
  :meth:`PromptFormat.encode_text`, which keeps ``<|im_start|>`` typed by a user as
  the characters it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any, ClassVar

from chatcore.errors import ChatcoreError

# The types prompt formats take and give, re-exported where format authors look for them.
from chatcore.values import ROLES as ROLES
from chatcore.values import Message as Message
from chatcore.values import PromptPlan as PromptPlan
from chatcore.values import Role as Role

AUTO = "auto"
MAX_SYSTEM_CHARS = 32_000


class PromptFormat:
    """Base class for prompt formats. Subclasses set ``name`` and implement ``render``.

    A format is built once per model (``Format(tokenizer, generation_config, model_name)``)
    and raises :class:`ChatcoreError` there if the model cannot use it.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    # Whether a kept history may start with an assistant turn after truncation.
    history_may_start_with_assistant: ClassVar[bool] = False
    # Whether a whole conversation whose first turn is the assistant's (a scripted one, a
    # client's) is rendered as it is; False: it starts at its first user turn. A format may
    # decide it per model.
    assistant_may_open: bool = True

    def __init__(self, tokenizer: Any, generation_config: Any = None, model_name: str = "the model") -> None:
        self.tokenizer = tokenizer
        self.generation_config = generation_config
        self.model_name = model_name
        # The system prompt the format puts in by itself when a conversation has none
        # (SmolLM2's template does), for adapters to show; None if it adds nothing.
        self.default_system: str | None = None

    @classmethod
    def supports(cls, tokenizer: Any) -> bool:
        """Whether ``auto`` may pick this format for ``tokenizer``."""
        return True

    # -- what a subclass implements ---------------------------------------------------
    def render(self, messages: Sequence[Message]) -> list[int]:
        """The prompt's token ids for ``messages`` (system first if any), ending where the reply starts."""
        raise NotImplementedError

    def end_of_turn_ids(self) -> set[int]:
        """Tokens the format itself ends a turn with (besides the model's EOS tokens)."""
        return set()

    # -- shared -------------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        """Token ids of message text, special-token strings kept as text."""
        from chatcore.text import encode_text

        return encode_text(self.tokenizer, text)

    @cached_property
    def stop_token_ids(self) -> frozenset[int]:
        """Every token that ends a reply: EOS, the generation config's list, the format's end of turn."""
        ids: set[int] = set()
        for value in (self.tokenizer.eos_token_id, getattr(self.generation_config, "eos_token_id", None)):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        ids |= self.end_of_turn_ids()
        return frozenset(ids)

    @property
    def end_of_reply_id(self) -> int:
        """The token a finished reply ends with in this format (to score a known reply)."""
        own = self.end_of_turn_ids()
        return min(own) if own else int(self.tokenizer.eos_token_id)

    @cached_property
    def banned_token_ids(self) -> frozenset[int]:
        """Special tokens that are not stop tokens: a reply never contains one."""
        return frozenset(special_token_ids(self.tokenizer)) - self.stop_token_ids

    def fit(self, messages: Sequence[Message], budget: int) -> PromptPlan:
        """Render ``messages``, dropping the oldest whole turns (never the system prompt) to fit ``budget``."""
        if budget < 2:
            raise ChatcoreError(f"the context budget is {budget} tokens: too small for any prompt")
        system = [m for m in messages[:1] if m.role == "system"]
        turns = list(messages[len(system) :])
        if not turns:
            raise ChatcoreError("the conversation has no turns to reply to")
        starts = [
            i
            for i, m in enumerate(turns)
            if self.history_may_start_with_assistant or m.role != "assistant" or (i == 0 and self.assistant_may_open)
        ]
        if not starts:
            starts = [len(turns) - 1]
        # Fewer turns never make a longer prompt: binary search the oldest start that fits.
        low, high, best = 0, len(starts) - 1, None
        while low <= high:
            middle = (low + high) // 2
            ids = self.render(system + turns[starts[middle] :])
            if len(ids) <= budget:
                best, high = (middle, ids), middle - 1
            else:
                low = middle + 1
        if best is not None:
            start, ids = starts[best[0]], best[1]
            kept = system + turns[start:]
            return PromptPlan(ids, len(turns) - start, start, 0, kept)
        return self._fit_newest(system, turns, starts[-1], budget)

    def _fit_newest(self, system: list[Message], turns: list[Message], start: int, budget: int) -> PromptPlan:
        """Keep only the most recent tokens of the oldest kept turn, or fail if the system prompt fills the context."""
        first, rest = turns[start], turns[start + 1 :]
        bare = self.render(system + [Message(first.role, "")] + rest)
        if len(bare) > budget - 1:
            what = "the system prompt" if system else "the prompt's fixed part"
            raise ChatcoreError(
                f"{what} takes {len(bare)} tokens, but the context leaves {budget} for the prompt: "
                "shorten it or give fewer new tokens"
            )
        tokens = self.encode_text(first.text)
        keep = min(len(tokens), budget - len(bare))
        while keep > 0:
            text = self.tokenizer.decode(tokens[-keep:], skip_special_tokens=False).lstrip()
            ids = self.render(system + [Message(first.role, text)] + rest)
            if len(ids) <= budget:
                return PromptPlan(
                    ids, len(turns) - start, start, len(tokens) - keep, system + [Message(first.role, text)] + rest
                )
            keep -= max(1, len(ids) - budget)
        return PromptPlan(bare, len(turns) - start, start, len(tokens), system + [Message(first.role, "")] + rest)


def scripted_messages(turns: Sequence[str], system: str | None = None) -> list[Message]:
    """Messages of a scripted context: turns alternate so that the last one is the user's."""
    messages = [Message("system", system)] if system else []
    messages += [
        Message("user" if (len(turns) - index) % 2 == 1 else "assistant", text) for index, text in enumerate(turns)
    ]
    return messages


def prompt_budget(max_positions: int, max_new_tokens: int) -> int:
    """Tokens the prompt may take: the context minus the reply's budget, but at least half the context.

    A reply budget larger than half the context (``-n 1000`` on a 512-position model)
    does not starve the prompt: the reply is then capped by the room the prompt leaves.
    """
    return max(max_positions - max_new_tokens, max_positions // 2)


def check_system_fits(prompt_format: PromptFormat, system: str | None, max_positions: int, max_new_tokens: int) -> None:
    """Fail (ChatcoreError: "the system prompt takes N tokens ...") if ``system`` leaves no room
    for a message and a reply of ``max_new_tokens``.

    Adapters check a system prompt when it is set, so that the error comes then and not
    with the next message (whose turn would be left without a reply).
    """
    if system:
        prompt_format.fit(
            [Message("system", system), Message("user", "")], prompt_budget(max_positions, max_new_tokens)
        )


def special_token_ids(tokenizer: Any) -> set[int]:
    """Ids of the tokenizer's special tokens (named ones and added tokens marked special)."""
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", []) if i is not None}
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(int(i) for i, token in decoder.items() if getattr(token, "special", False))
    return ids


def special_token_texts(tokenizer: Any) -> list[str]:
    """The text of every special token, longest first."""
    texts = set(getattr(tokenizer, "all_special_tokens", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    texts.update(str(token) for token in decoder.values() if getattr(token, "special", False))
    return sorted((t for t in texts if t), key=len, reverse=True)


def clean_system_prompt(text: Any) -> str | None:
    """A system prompt as given (line breaks kept), or None for empty; ChatcoreError if unusable."""
    import unicodedata

    from chatcore.text import checked_text, remove_escape_sequences, undecodable_at

    if text is None:
        return None
    text = checked_text(text, "system prompt", MAX_SYSTEM_CHARS)
    bad = undecodable_at(text)  # a command line's byte that was not UTF-8: refused, as in a message
    if bad is not None:
        raise ChatcoreError(f"the system prompt is not UTF-8 text (bad byte at position {bad})")
    text = remove_escape_sequences(text)
    kept = "".join(
        char
        for char in text.replace("\r\n", "\n").replace("\t", " ")
        if char == "\n" or unicodedata.category(char) not in ("Cc", "Cs")
    )
    lines = [" ".join(line.split()) for line in kept.split("\n")]
    cleaned = "\n".join(lines).strip()
    return cleaned or None


def read_system_file(path: str) -> str:
    """A system prompt from a UTF-8 text file, or ChatcoreError saying what is wrong with the file."""
    from pathlib import Path

    file = Path(path)
    if not file.exists():
        raise ChatcoreError(f"system prompt file {path!r} does not exist")
    if not file.is_file():
        raise ChatcoreError(f"system prompt file {path!r} is not a file")
    data = file.read_bytes()
    if len(data) > 4 * MAX_SYSTEM_CHARS:
        raise ChatcoreError(f"system prompt file {path!r} is longer than the limit of {MAX_SYSTEM_CHARS:,} characters")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ChatcoreError(
            f"system prompt file {path!r} is not UTF-8 text (bad byte at position {error.start})"
        ) from None
    cleaned = clean_system_prompt(text)
    if cleaned is None:
        raise ChatcoreError(f"system prompt file {path!r} is empty")
    return cleaned


def system_prompt_option(text: str | None, path: str | None) -> str | None:
    """The system prompt from a command line's ``--system TEXT`` or ``--system-file PATH`` (not both)."""
    if text is not None and path is not None:
        raise ChatcoreError("give --system or --system-file, not both")
    if path is not None:
        return read_system_file(path)
    return clean_system_prompt(text)


def validate_format_name(name: str, registry: Any) -> None:
    """Fail on a prompt format name no plugin registered (no model needed); ``registry``:
    the host's :class:`chatcore.registry.Registry` (``registry_of(host)``). An unknown name's
    error lists the same names wherever it is given (here, :func:`choose_format`), ``auto`` first."""
    if name != AUTO:
        registry.prompt_format(name, also=(AUTO,))


def choose_format(registry: Any, tokenizer: Any, name: str = AUTO) -> type[PromptFormat]:
    """The format class for ``name``; ``auto``: the chat template if the tokenizer has one, else dialogpt."""
    if name != AUTO:
        return registry.prompt_format(name, also=(AUTO,))
    for candidate in ("chat-template", "dialogpt"):
        if candidate in registry.prompt_formats:
            cls = registry.prompt_format(candidate)
            if cls.supports(tokenizer):
                return cls
    supported = [e.value for e in registry.prompt_formats.values() if e.value.supports(tokenizer)]
    if not supported:
        raise ChatcoreError("no prompt format supports this model's tokenizer")
    return supported[0]
