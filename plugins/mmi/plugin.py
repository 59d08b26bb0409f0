"""The ``mmi`` decoder: sample N candidate replies in one batch, rerank them by the reverse model.

Maximum mutual information reranking as in the DialoGPT paper: the reply that makes
what the user said most predictable, log P(source | reply) under a reverse model,
wins over the bland replies that fit any context. Candidates come from the top-k
sampler (steerers apply as in any other decoder) in one batched decoding pass; the
reverse model scores all of them in one batched forward pass.

Each candidate's forward score, log P(reply EOS | prompt), is summed during that same
pass from the scores the model and its steerers give (before temperature and top-k),
so it costs no second forward pass; with no steerer it is the plain model's
log-probability. A candidate cut off at ``max_new_tokens`` has no stop-token term.

The reverse model reads ``EOS candidate EOS source_1 EOS ... source_n EOS`` (its own
EOS; source turns newest first, from the conversation's messages as text), as
``chatcore train model --reverse`` trains it, so it works beside any prompt format.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, PositiveInt, StringConstraints

import chatcore
from chatcore.api import (
    DEFAULT_REVERSE_MODEL,
    Candidate,
    CandidateDecoder,
    CandidateSettings,
    GenerationSession,
    OnThisMachine,
    OptionError,
    Sampled,
    bundled_reverse_models,
)

if TYPE_CHECKING:
    import torch

    from chatcore.api import LoadedModel


AUTO_REVERSE = "auto"


class MMISettings(CandidateSettings):
    """Candidate sampling (see CandidateSettings), the reverse model, and the selection rule."""

    reverse_model: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1), OnThisMachine("model")] = (
        AUTO_REVERSE
    )
    """`auto`: the bundled reverse model that shares the model's tokenizer (chatcore-tiny-reverse,
    smollm2-reverse); else a bundled name, local folder or hub id."""
    source_turns: PositiveInt = 1
    """How many of the latest turns form the source (1: the user's turn)."""
    weight: Annotated[float, Field(ge=0, le=1e100)] = 0.0
    """score = reverse + weight * forward (0: pure MMI, as in DialoGPT). At most 1e100: the
    log-probabilities are far below 1e9 in size, so a score divided by the smallest
    `selection_temperature` stays below 1e210, inside float64 (1.8e308); past it a score
    could overflow and leave no candidate to draw."""
    length_normalize: bool = True
    """Use the forward log-probability per token instead of its sum."""
    selection: Literal["argmax", "sample"] = "argmax"
    """The argmax of the scores, or a draw from softmax(scores / selection_temperature)."""
    selection_temperature: Annotated[float, Field(ge=1e-100)] = 1.0
    """The temperature of `selection=sample`. At least 1e-100: the scores divided by it
    stay far inside float64 (see `weight`)."""
    allow_retokenize: bool = False
    """Rerank with a reverse model whose tokenizer differs from the model's, by re-encoding
    the candidates as text (off: such a reverse model is refused, as it was trained on
    other text and judges another model's replies poorly)."""


def combined_scores(forward: Sequence[float], reverse: Sequence[float], weight: float) -> list[float]:
    """The reranking score of each candidate: reverse + weight * forward."""
    return [r + weight * f if weight else r for f, r in zip(forward, reverse)]


def choose(
    scores: Sequence[float],
    eligible: Sequence[bool],
    selection: str = "argmax",
    temperature: float = 1.0,
    generator: "torch.Generator | None" = None,
) -> int:
    """Index of the winning candidate among the eligible ones (all of them if none is).

    ``argmax`` takes the best score (the first on ties); ``sample`` draws from
    softmax(scores / temperature) over the eligible candidates.
    """
    if not scores:
        raise ValueError("there are no candidates to choose from")
    pool = [i for i, ok in enumerate(eligible) if ok] or list(range(len(scores)))
    if selection == "argmax":
        return max(pool, key=lambda i: (scores[i], -i))
    import torch

    logits = torch.tensor([scores[i] for i in pool], dtype=torch.float64) / temperature
    probabilities = torch.softmax(logits, dim=0).float()
    if generator is not None:
        probabilities = probabilities.to(generator.device)  # draw on the generator's device
    draw = torch.multinomial(probabilities, 1, generator=generator)
    return pool[int(draw)]


def train_hint(model: str) -> str:
    """How to get a reverse model that shares ``model``'s tokenizer, and how to do without."""
    return (
        f"train one that matches with `chatcore train model --reverse --tokenizer {model} --out DIR` "
        f"(a small model on its tokenizer; `--init-from {model}` fine-tunes the model itself) and give "
        f"`reverse_model=DIR/best`, or rerank through text with `allow_retokenize=true`"
    )


def mismatch_message(reverse_model: str, model: str, bundled_match: str | None = None) -> str:
    """The one line that refuses a reverse model with another tokenizer than ``model``'s,
    naming the bundled one that shares it when there is one."""
    if bundled_match:
        return (
            f"the MMI reverse model {reverse_model!r} uses another tokenizer than {model!r}; the bundled "
            f"{bundled_match!r} shares it: give `reverse_model={bundled_match}` or `reverse_model=auto` "
            "(the default)"
        )
    return f"the MMI reverse model {reverse_model!r} uses another tokenizer than {model!r}: {train_hint(model)}"


def no_match_message(model: str) -> str:
    """The one line that refuses ``reverse_model=auto`` when no bundled reverse model fits."""
    return f"no bundled MMI reverse model shares the tokenizer of {model!r}: {train_hint(model)}"


class MMIDecoder(CandidateDecoder):
    name = "mmi"
    description = "samples N replies in one batch and keeps the one the reverse model finds most specific"
    Settings = MMISettings

    @classmethod
    def setting_choices(cls, name: str) -> list[str]:
        if name == "reverse_model":
            return [AUTO_REVERSE, *bundled_reverse_models()]
        return super().setting_choices(name)

    @classmethod
    def setup(cls, model: "LoadedModel", settings: MMISettings) -> "LoadedModel":
        """The reverse model, loaded once per engine (and kept with its other setups).

        ``auto`` picks the bundled reverse model that shares the model's tokenizer. A reverse
        model with another tokenizer than the model's is refused here, when the decoder is
        configured, unless ``allow_retokenize`` is set (then ``auto`` with no match takes
        chatcore-tiny-reverse, through text).
        """
        from . import reranking

        name = settings.reverse_model
        if name == AUTO_REVERSE:
            name = reranking.matching_reverse_model(model.tokenizer) or ""
            if not name:
                if not settings.allow_retokenize:
                    raise OptionError(no_match_message(model.name))
                name = DEFAULT_REVERSE_MODEL
        if not settings.allow_retokenize and name in bundled_reverse_models():
            # A bundled reverse model's tokenizer is read without its weights: a mismatch is
            # refused before the model loads.
            if not reranking.same_tokenizer(model.tokenizer, reranking.bundled_tokenizer(name)):
                raise OptionError(mismatch_message(name, model.name, reranking.matching_reverse_model(model.tokenizer)))
        reverse = reranking.load_reverse_model(name, device=model.device)
        if not settings.allow_retokenize and not reranking.same_tokenizer(model.tokenizer, reverse.tokenizer):
            raise OptionError(mismatch_message(name, model.name, reranking.matching_reverse_model(model.tokenizer)))
        return reverse

    def prepare(self, session: GenerationSession) -> None:
        self.sampling_started = time.perf_counter()

    def choose(self, session: GenerationSession, rows: Sequence[Sampled]) -> int:
        from . import reranking

        settings = self.settings
        forward_model = session.model
        reverse_model = self.shared
        timings = {"candidates_s": time.perf_counter() - self.sampling_started}
        token_ids = [row.token_ids for row in rows]
        forward = self.forward_scores(rows)
        ended = [row.ended for row in rows]

        started = time.perf_counter()
        retokenized = not reranking.same_tokenizer(forward_model.tokenizer, reverse_model.tokenizer)
        if session.messages:
            # Newest first, as the reverse model reads; encoded as text, so the prompt
            # format (DialoGPT turns, a chat template's headers) does not matter.
            source = reranking.encode_source(
                reverse_model, reranking.source_texts(session.messages, settings.source_turns)
            )
        else:
            history = reranking.split_turns(session.prompt_ids, session.eos_token_id)
            source = list(reversed(history[-settings.source_turns :]))
            if retokenized:
                source = reranking.retokenize(forward_model.tokenizer, reverse_model.tokenizer, source)
        if retokenized:
            token_ids_for_reverse = reranking.retokenize(forward_model.tokenizer, reverse_model.tokenizer, token_ids)
        else:
            token_ids_for_reverse = token_ids
        reverse = reranking.reverse_scores(reverse_model, token_ids_for_reverse, source)
        timings["reverse_s"] = time.perf_counter() - started

        forward_values = [s.mean if settings.length_normalize else s.total for s in forward]
        scores = combined_scores(forward_values, [s.total for s in reverse], settings.weight)
        # An empty reply never wins while there is anything else to say, nor a cut-off
        # one while some candidate ended.
        eligible = [bool(ids) and done for ids, done in zip(token_ids, ended)]
        if not any(eligible):
            eligible = [bool(ids) for ids in token_ids]
        winner = choose(scores, eligible, settings.selection, settings.selection_temperature, session.generator)

        tokenizer = forward_model.tokenizer
        for index, ids in enumerate(token_ids):
            session.candidates.append(
                Candidate(
                    token_ids=list(ids),
                    text=tokenizer.decode(ids),
                    scores={
                        "forward": forward[index].total,
                        "forward_mean": forward[index].mean,
                        "reverse": reverse[index].total,
                        "reverse_mean": reverse[index].mean,
                        "score": scores[index],
                        "ended": float(ended[index]),
                    },
                    chosen=index == winner,
                )
            )
        session.details["mmi"] = {
            "reverse_model": reverse_model.name,
            "retokenized": retokenized,  # early: /why shortens this line to 200 characters
            "source_turns": len(source),
            "ended": sum(ended),
            "quorum": settings.quorum_rows(),
            "forward_score": "log P(reply EOS | prompt) under the model and its steerers, before sampling filters",
            "reverse_score": "log P(source | reply) under the reverse model",
            "timings": {key: round(value, 4) for key, value in timings.items()},
        }
        return winner


@chatcore.hookimpl(trylast=True)
def register_decoders(register: Callable[[type], None]) -> None:
    register(MMIDecoder)
