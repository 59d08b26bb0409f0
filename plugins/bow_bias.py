"""The ``bow-bias`` steerer: add a bias to the scores of a bag of words.

Every tokenization of each word is covered: with and without a leading space, in
lower case, capitalised and as given. A word of several tokens is biased token by
token: its first token where a word can start, and its k-th token when the reply so
far ends with its first k-1 tokens, so multi-token words are completed rather than
just started. A form with a leading space starts a word anywhere. A form without one
(a reply's first word, or one after a line break or a bracket) starts a word only
where none is under way (the reply's start, or after a space, a line break or
punctuation), and only when it is one token: the first token of a longer one is a
fragment shared by other words ("hug" of "hugging"), and biased it glues fragments into
gibberish; such a form is still completed where the model chose its first token itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

from pydantic import Field, model_validator

import chatcore
from chatcore.api import (
    OnThisMachine,
    OptionError,
    Settings,
    Steerer,
    Step,
    StepOutput,
    StepState,
    builtin_topics,
    check_word_sources,
    collect_words,
    encode_text,
)

__all__ = ["BowBiasSettings", "BowBiasSteerer", "builtin_topics", "word_variants"]

if TYPE_CHECKING:
    import torch

    from chatcore.api import GenerationSession


def word_variants(word: str) -> set[str]:
    forms = {word, word.lower(), word[:1].upper() + word[1:]}
    return {prefix + form for form in forms for prefix in ("", " ")}


class BowBiasSettings(Settings):
    words: tuple[str, ...] = ()
    """Words or phrases (comma list)."""
    topic: str | None = None
    """A built-in word list (food, sports, ...)."""
    file: Annotated[str | None, OnThisMachine("word file")] = None
    """A word file, one word or phrase per line."""
    strength: Annotated[float, Field(ge=-100.0, le=100.0)] = 2.0
    """Added to each word's token scores (negative: avoid the words)."""

    @model_validator(mode="after")
    def _check_sources(self) -> BowBiasSettings:
        check_word_sources(self.topic, self.file)
        return self

    def all_words(self) -> list[str]:
        return collect_words(self.words, self.topic, self.file)


class BowBiasSteerer(Steerer):
    name = "bow-bias"
    description = "adds `strength` to the scores of a bag of words (inline, a topic, or a file)"
    Settings = BowBiasSettings
    shares_batch = True  # only adds a bias to the logits its inner step returns

    @classmethod
    def setting_choices(cls, name: str) -> list[str]:
        return builtin_topics() if name == "topic" else super().setting_choices(name)

    def __init__(self, settings: BowBiasSettings | None = None) -> None:
        super().__init__(settings)
        if not self.settings.all_words():
            raise OptionError("steerer 'bow-bias' needs words: give `words=a,b,c`, `topic=NAME` or `file=PATH`")
        self.sequences: list[tuple[int, ...]] = []
        self.first_tokens: "torch.Tensor | None" = None  # start a word anywhere (a leading space)
        self.bare_first_tokens: "torch.Tensor | None" = None  # start a word where none is under way
        self._ends_word: Callable[[int], bool] = lambda token: False

    def prepare(self, session: "GenerationSession") -> None:
        import torch

        tokenizer = session.model.tokenizer
        unique: set[tuple[int, ...]] = set()
        bare: set[int] = set()
        fragments: set[int] = set()
        for word in self.settings.all_words():
            for form in word_variants(word):
                ids = tuple(encode_text(tokenizer, form))
                if ids:
                    unique.add(ids)
                    if not form.startswith(" "):
                        bare.add(ids[0])
                        if len(ids) > 1:  # a fragment: continued where the model chose it, never started
                            fragments.add(ids[0])
        # A variant like " Word" may tokenize as a bare space then the word; biasing that
        # space token would push every reply towards whitespace. Such sequences keep
        # their continuation (biased after a space the model chose itself) but not
        # their first token.
        self.sequences = sorted(unique)
        starts = {ids[0] for ids in self.sequences if len(ids) == 1 or tokenizer.decode([ids[0]]).strip()}
        device = session.model.device
        self.first_tokens = torch.tensor(sorted(starts - bare), dtype=torch.long, device=device)
        self.bare_first_tokens = torch.tensor(sorted((starts & bare) - fragments), dtype=torch.long, device=device)

        def ends_word(token: int) -> bool:
            text = tokenizer.decode([token])
            return bool(text) and text[-1].isalnum()

        self._ends_word = ends_word

    def bias(self, state: StepState, logits: "torch.Tensor") -> "torch.Tensor":
        assert self.first_tokens is not None and self.bare_first_tokens is not None, "prepare() was not called"
        bias = torch_zeros_like(logits)
        bias[:, self.first_tokens] = self.settings.strength
        generated = state.sequences[:, state.prompt_length :].tolist()
        for row, tokens in enumerate(generated):
            if not tokens or not self._ends_word(tokens[-1]):  # no word under way: a bare form may start one
                bias[row, self.bare_first_tokens] = self.settings.strength
            for ids in self.sequences:
                for k in range(1, len(ids)):
                    if k <= len(tokens) and tuple(tokens[len(tokens) - k :]) == ids[:k]:
                        bias[row, ids[k]] = self.settings.strength
        return bias

    def wrap(self, step: Step) -> Step:
        def steered(state: StepState) -> StepOutput:
            output = step(state)
            return output.replace(logits=output.logits + self.bias(state, output.logits))

        return steered


def torch_zeros_like(tensor: "torch.Tensor") -> "torch.Tensor":
    import torch

    return torch.zeros_like(tensor)


@chatcore.hookimpl(trylast=True)
def register_steerers(register: Callable[[type], None]) -> None:
    register(BowBiasSteerer)
