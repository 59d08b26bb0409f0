"""The built-in prompt formats: ``dialogpt`` and ``chat-template``.

``dialogpt``: every message's text followed by the EOS token, oldest first, as DialoGPT
was trained; the reply ends at EOS. A system prompt is sent as a first turn. BOS comes
first where the tokenizer adds one to every text (Llama-family tokenizers do).

``chat-template``: the tokenizer's own ``chat_template``, rendered with
``add_generation_prompt=True``, exactly as ``tokenizer.apply_chat_template`` does (and
so token for token the prompt ``model.generate`` would be given). Message text that
contains a special token's characters is encoded on its own, as text, so that a user
typing ``<|im_start|>system`` never opens a system turn. The template's end-of-turn
token (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``) ends a reply. A template that
refuses a system message gets the system prompt at the head of the first user message.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import chatcore
from chatcore.api import ChatcoreError, Message, PromptFormat, special_token_texts

# Stand-ins for message text while the template renders: private-use characters that no
# template edits (``trim`` and friends leave them be) and no user text contains after
# chatcore's cleaning.
_HOLE = "\ue000{}\ue001"
_HOLE_PATTERN = re.compile("\ue000(\\d+)\ue001")


class DialoGPTFormat(PromptFormat):
    name = "dialogpt"
    description = "turns joined by EOS, as DialoGPT (the system prompt is a first turn)"
    history_may_start_with_assistant = True

    def __init__(self, tokenizer: Any, generation_config: Any = None, model_name: str = "the model") -> None:
        super().__init__(tokenizer, generation_config, model_name)
        if tokenizer.eos_token_id is None:
            raise ChatcoreError(
                f"model {model_name!r} has no chat template and its tokenizer has no EOS token, "
                "which the dialogpt format ends every turn with"
            )
        self.eos = int(tokenizer.eos_token_id)
        bos = tokenizer.bos_token_id
        adds_bos = bos is not None and tokenizer("a", add_special_tokens=True)["input_ids"][:1] == [bos]
        self.prefix = [int(bos)] if adds_bos and bos != self.eos else []
        self._cache: OrderedDict[str, list[int]] = OrderedDict()

    def _ids(self, text: str) -> list[int]:
        ids = self._cache.get(text)
        if ids is None:
            ids = self._cache[text] = self.encode_text(text)
            if len(self._cache) > 4096:
                self._cache.popitem(last=False)
        return ids

    def render(self, messages: Sequence[Message]) -> list[int]:
        ids = list(self.prefix)
        for message in messages:
            ids.extend(self._ids(message.text))
            ids.append(self.eos)
        return ids


class ChatTemplateFormat(PromptFormat):
    name = "chat-template"
    description = "the tokenizer's own chat template (instruction-tuned models)"

    def __init__(self, tokenizer: Any, generation_config: Any = None, model_name: str = "the model") -> None:
        super().__init__(tokenizer, generation_config, model_name)
        if not self.supports(tokenizer):
            raise ChatcoreError(f"model {model_name!r} has no chat template; use the dialogpt format")
        self.specials = special_token_texts(tokenizer)
        probe = [{"role": "user", "content": "hi"}]
        self.folds_system = self._system_refused()
        self._template(probe)  # a template that cannot render a plain user turn fails here, naming the model
        self._end_of_turn = self._find_end_of_turn()
        self.default_system = None if self.folds_system else self._find_default_system()
        self.assistant_may_open = self._assistant_may_open()

    @classmethod
    def supports(cls, tokenizer: Any) -> bool:
        return bool(getattr(tokenizer, "chat_template", None))

    def _template(self, messages: list[dict[str, str]], generation_prompt: bool = True) -> str:
        try:
            return str(
                self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
            )
        except Exception as error:
            raise ChatcoreError(
                f"the chat template of model {self.model_name!r} failed: {type(error).__name__}: {error}"
            ) from None

    def _fold(self, messages: Sequence[Message]) -> list[Message]:
        """The system prompt at the head of the first user message, for templates without a system role."""
        if not (self.folds_system and messages and messages[0].role == "system"):
            return list(messages)
        system, rest = messages[0].text, list(messages[1:])
        if rest and rest[0].role == "user":
            return [Message("user", f"{system}\n\n{rest[0].text}")] + rest[1:]
        return [Message("user", system)] + rest

    def _system_refused(self) -> bool:
        try:
            self.tokenizer.apply_chat_template(
                [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}],
                add_generation_prompt=True,
                tokenize=False,
            )
            return False
        except Exception:
            return True

    def _assistant_may_open(self) -> bool:
        """Whether the template renders a history whose first turn is the assistant's; many
        templates check that turns alternate from a user turn and raise otherwise, and then
        such a history starts at its first user turn."""
        opening = [{"role": "assistant", "content": _HOLE.format(0)}, {"role": "user", "content": _HOLE.format(1)}]
        try:
            text = self._template(opening)
        except ChatcoreError:
            return False
        return _HOLE.format(0) in text and _HOLE.format(1) in text

    def _find_end_of_turn(self) -> set[int]:
        """The first special token after an assistant message's text, in a rendered conversation."""
        messages = [{"role": "user", "content": _HOLE.format(0)}, {"role": "assistant", "content": _HOLE.format(1)}]
        try:
            text = self._template(messages, generation_prompt=False)
        except ChatcoreError:
            return set()
        tail = text.split(_HOLE.format(1), 1)[1] if _HOLE.format(1) in text else ""
        for token in self.tokenizer(tail, add_special_tokens=False)["input_ids"]:
            if self.tokenizer.convert_ids_to_tokens(int(token)) in self.specials:
                return {int(token)}
        return set()

    def _find_default_system(self) -> str | None:
        """The system text the template writes when given none: what stands where a given one would."""
        user = {"role": "user", "content": _HOLE.format(0)}
        try:
            bare = self._template([user])
            given = self._template([{"role": "system", "content": _HOLE.format(1)}, user])
        except ChatcoreError:
            return None
        prefix, _, suffix = given.partition(_HOLE.format(1))
        if len(bare) > len(prefix) + len(suffix) and bare.startswith(prefix) and bare.endswith(suffix):
            return bare[len(prefix) : len(bare) - len(suffix)].strip() or None
        return None

    def end_of_turn_ids(self) -> set[int]:
        return set(self._end_of_turn)

    def render(self, messages: Sequence[Message]) -> list[int]:
        messages = self._fold(messages)
        if not any(special in m.text for m in messages for special in self.specials):
            text = self._template([{"role": m.role, "content": m.text} for m in messages])
            return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        # Some text carries a special token's characters: render around stand-ins, then
        # encode the template's own parts with their special tokens and each text as text.
        text = self._template([{"role": m.role, "content": _HOLE.format(i)} for i, m in enumerate(messages)])
        ids: list[int] = []
        position = 0
        for match in _HOLE_PATTERN.finditer(text):
            ids.extend(self.tokenizer(text[position : match.start()], add_special_tokens=False)["input_ids"])
            ids.extend(self.encode_text(messages[int(match.group(1))].text))
            position = match.end()
        ids.extend(self.tokenizer(text[position:], add_special_tokens=False)["input_ids"])
        return [int(i) for i in ids]


@chatcore.hookimpl(trylast=True)
def register_prompt_formats(register: Callable[[type], None]) -> None:
    register(DialoGPTFormat)
    register(ChatTemplateFormat)
