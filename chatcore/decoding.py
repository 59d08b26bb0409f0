"""Decoders and the shared, KV-cached decoding loop.

A decoder turns a :class:`GenerationSession` into the reply's token ids. Token-level
decoders (greedy, top-k) subclass :class:`TokenDecoder`: they give a list of score
processors and a ``select`` rule, and :meth:`GenerationSession.run` does the loop:

    step (model wrapped by steerers) -> processors -> select -> append -> stop?

Response-level decoders (MMI) call ``session.run`` with several rows and choose among
the finished candidates, recording them in ``session.candidates``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

from pydantic import Field, NonNegativeInt, PositiveFloat

from chatcore.options import Configurable, Settings
from chatcore.processors import (
    ScoreProcessor,
    chain,
    logit_bias,
    no_repeat_ngram,
    occurrence_penalty,
    repetition_penalty,
)
from chatcore.steering import Steerer, compose
from chatcore.step import Step, StepState, model_step

if TYPE_CHECKING:
    import torch

    from chatcore.models import LoadedModel
    from chatcore.prompting import Message

Select = Callable[["torch.Tensor", "torch.Generator"], "torch.Tensor"]


@dataclass
class Candidate:
    """One sampled reply, for decoders that produce several."""

    token_ids: list[int]
    text: str
    scores: dict[str, float] = field(default_factory=dict)
    chosen: bool = False


@dataclass
class GenerationSession:
    """Everything the decoding of one response needs.

    prompt_ids:      the formatted prompt (chatcore.prompting renders it).
    steerers:        in composition order (see chatcore.steering).
    generator:       the seeded random generator every sampling draw uses.
    min_new_tokens:  stop tokens are banned during the first this-many steps.
    stop_token_ids:  a row ends at any of these (default: EOS alone).
    banned_token_ids: never generated (the special tokens that are not stop tokens).
    messages:        the messages the prompt was rendered from (system first if any),
                     for decoders and steerers that read the conversation as text.
    candidates:      filled by decoders that sample several replies.
    details:         free-form notes for provenance (decoders and steerers may add).
    """

    model: "LoadedModel"
    prompt_ids: list[int]
    steerers: Sequence[Steerer]
    max_new_tokens: int
    generator: "torch.Generator"
    seed: int
    min_new_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    banned_token_ids: frozenset[int] = frozenset()
    messages: list["Message"] = field(default_factory=list)
    candidates: list[Candidate] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def eos_token_id(self) -> int:
        """The model's EOS: a stop token, and the filler of rows that have ended."""
        return self.model.eos_token_id

    @property
    def stop_ids(self) -> frozenset[int]:
        """Every token that ends a reply (EOS when no format said otherwise)."""
        return self.stop_token_ids | {self.eos_token_id}

    def build_step(self) -> Step:
        return compose(model_step(self.model.model), self.steerers)

    def run(
        self,
        processors: Sequence[ScoreProcessor],
        select: Select,
        rows: int = 1,
        prompts: Sequence[Sequence[int]] | None = None,
    ) -> Iterator["torch.Tensor"]:
        """Decode ``rows`` sequences in one batch, yielding each step's (B,) new tokens.

        All rows start from ``prompt_ids`` unless ``prompts`` gives one prompt per row
        (left-padded). A row that emitted a stop token keeps receiving EOS and is ignored;
        the loop ends when every row has finished or after ``max_new_tokens`` steps.
        """
        processing = chain(processors)
        import torch

        device = self.model.device
        eos = self.eos_token_id
        stops = torch.tensor(sorted(self.stop_ids), dtype=torch.long, device=device)
        banned = torch.tensor(sorted(self.banned_token_ids), dtype=torch.long, device=device)
        if prompts is None:
            prompts = [self.prompt_ids] * rows
        batch = len(prompts)
        prompt_length = max(len(p) for p in prompts)
        if prompt_length == 0:
            raise ValueError("cannot decode from an empty prompt")
        total = prompt_length + self.max_new_tokens
        sequences = torch.full((batch, total), eos, dtype=torch.long, device=device)
        attention = torch.zeros((batch, total), dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            sequences[row, prompt_length - len(prompt) : prompt_length] = torch.tensor(prompt, dtype=torch.long)
            attention[row, prompt_length - len(prompt) : prompt_length] = 1
        if all(len(p) == prompt_length for p in prompts):
            positions = torch.arange(prompt_length, device=device).expand(batch, -1)
        else:
            positions = (attention[:, :prompt_length].cumsum(-1) - 1).clamp(min=0)
        next_position = attention[:, :prompt_length].sum(-1, keepdim=True)  # (B, 1)

        step_fn = self.build_step()
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        cache = None
        length = prompt_length
        input_ids = sequences[:, :prompt_length]
        with torch.inference_mode():
            for step_index in range(self.max_new_tokens):
                state = StepState(
                    input_ids=input_ids,
                    sequences=sequences[:, :length],
                    attention_mask=attention[:, :length],
                    position_ids=positions,
                    cache=cache,
                    step=step_index,
                    prompt_length=prompt_length,
                )
                output = step_fn(state)
                cache = output.cache
                scores = output.logits
                history = sequences[:, :length]
                scores = restrict_scores(scores, banned, stops, early=step_index < self.min_new_tokens)
                scores = processing(history, scores)
                tokens = select(scores, self.generator)  # (B,)
                tokens = torch.where(finished, torch.full_like(tokens, eos), tokens)
                sequences[:, length] = tokens
                attention[:, length] = (~finished).long()
                length += 1
                yield tokens
                finished |= torch.isin(tokens, stops)
                if bool(finished.all()):
                    break
                input_ids = sequences[:, length - 1 : length]
                positions = next_position
                next_position = next_position + 1


def restrict_scores(
    scores: "torch.Tensor", banned: "torch.Tensor", stops: "torch.Tensor", early: bool
) -> "torch.Tensor":
    """Ban the ``banned`` tokens, and the ``stops`` too while it is ``early`` (before min_new_tokens):
    too early to stop, as an empty reply helps no one."""
    if early or banned.numel():
        scores = scores.clone()
        scores[:, banned[banned < scores.shape[-1]]] = float("-inf")
        if early:
            scores[:, stops[stops < scores.shape[-1]]] = float("-inf")
    return scores


class Decoder(Configurable):
    """Base class for decoders: a ``name``, a ``Settings`` dataclass, ``decode(session)``.

    ``decode`` yields the reply's token ids (without the stop token that ended it). A streaming
    decoder yields them as they are chosen; a reranking one yields them at the end.
    """

    kind: ClassVar[str] = "decoder"

    def decode(self, session: GenerationSession) -> Iterator[int]:
        raise NotImplementedError


class TokenDecoder(Decoder):
    """A decoder that chooses each next token from processed scores."""

    def repetition_processors(self) -> list[ScoreProcessor]:
        processors: list[ScoreProcessor] = []
        bias = getattr(self.settings, "logit_bias", None)
        if bias:
            processors.append(logit_bias(bias))
        penalty = getattr(self.settings, "repetition_penalty", 1.0)
        if penalty != 1.0:
            processors.append(repetition_penalty(penalty))
        presence = getattr(self.settings, "presence_penalty", 0.0)
        frequency = getattr(self.settings, "frequency_penalty", 0.0)
        if presence or frequency:
            # One per reply, kept by its decoder: it counts the reply's tokens from where the reply began.
            if "_occurrence_penalty" not in self.__dict__:
                self.__dict__["_occurrence_penalty"] = occurrence_penalty(presence, frequency)
            processors.append(self.__dict__["_occurrence_penalty"])
        ngram = getattr(self.settings, "no_repeat_ngram_size", 0)
        if ngram:
            processors.append(no_repeat_ngram(ngram))
        return processors

    def processors(self) -> list[ScoreProcessor]:
        return self.repetition_processors()

    def select(self, scores: "torch.Tensor", generator: "torch.Generator") -> "torch.Tensor":
        raise NotImplementedError

    def decode(self, session: GenerationSession) -> Iterator[int]:
        stops = session.stop_ids
        for tokens in session.run(self.processors(), self.select):
            token = int(tokens[0])
            if token in stops:
                return
            yield token


class RepetitionSettings(Settings):
    """Repetition controls shared by the token decoders (0 / 1.0 switch them off)."""

    no_repeat_ngram_size: NonNegativeInt = 0
    """Never repeat an n-gram of this many tokens (0: off)."""
    repetition_penalty: PositiveFloat = 1.0
    """Penalise tokens already in the sequence by this factor, as transformers' repetition
    penalty does (1.0: off)."""
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    """Subtract this from the score of every token the reply already holds (OpenAI's; 0: off)."""
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    """Subtract this times its count in the reply from each token's score (OpenAI's; 0: off)."""
    logit_bias: dict[NonNegativeInt, Annotated[float, Field(ge=-100, le=100)]] = {}
    """Token id -> a bias added to its score, as OpenAI's ``logit_bias`` (-100 bans the token)."""
