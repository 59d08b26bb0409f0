"""The ``rank`` decoder: sample N candidates in one batch, keep a fluent one that is on topic.

PPLM's ranking step (Dathathri et al., 2020, the "R" of their BCR setting): several
replies are sampled, with or without steerers, and the one the attribute favours wins.
Here the attribute is a bag of words (``topic=``, ``words=``, ``file=``, as for
``bow-bias`` and ``pplm``). The choice, among candidates that ended and are not
degenerate (a repeated n-gram or trigram, as ``chatcore eval`` counts them):

1. those that contain a word (or phrase) of the bag, if any;
2. of those, the most fluent: the highest forward log-probability per token (the
   model's and its steerers' scores, summed during the sampling pass).

Candidates come from the same batched, quorum-stopped pass as ``mmi``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated

from pydantic import model_validator

import chatcore
from chatcore.api import (
    Candidate,
    CandidateDecoder,
    CandidateSettings,
    GenerationSession,
    OnThisMachine,
    Sampled,
    check_word_sources,
    collect_words,
)


class RankSettings(CandidateSettings):
    """Candidate sampling (see chatcore.sampling.CandidateSettings) and the bag of words."""

    topic: str | None = None
    """A built-in word list (food, sports, ...)."""
    words: tuple[str, ...] = ()
    """Words or phrases (comma list)."""
    file: Annotated[str | None, OnThisMachine("word file")] = None
    """A word file, one word or phrase per line."""

    @model_validator(mode="after")
    def _needs_words(self) -> RankSettings:
        check_word_sources(self.topic, self.file)
        if not self.all_words():
            raise ValueError("rank needs words to rank by: `topic=NAME`, `words=a,b,c` or `file=PATH`")
        return self

    def all_words(self) -> list[str]:
        return collect_words(self.words, self.topic, self.file)


def choose_on_topic(fluency: list[float], on_topic: list[bool], usable: list[bool]) -> int:
    """Index of the winner: the most fluent usable candidate on topic, else the most
    fluent usable one, else the most fluent of all (the first on ties)."""
    if not fluency:
        raise ValueError("there are no candidates to choose from")
    indices = range(len(fluency))
    pool = [i for i in indices if usable[i] and on_topic[i]] or [i for i in indices if usable[i]] or list(indices)
    return max(pool, key=lambda i: (fluency[i], -i))


class RankDecoder(CandidateDecoder):
    name = "rank"
    description = "samples N replies in one batch and keeps the most fluent one that contains a word of a list"
    Settings = RankSettings

    def choose(self, session: GenerationSession, rows: Sequence[Sampled]) -> int:
        from chatcore.api import contains_any, is_degenerate

        vocabulary = set(self.settings.all_words())
        token_ids = [row.token_ids for row in rows]
        forward = self.forward_scores(rows)
        ended = [row.ended for row in rows]
        tokenizer = session.model.tokenizer
        texts = [tokenizer.decode(ids) for ids in token_ids]
        on_topic = [contains_any(text, vocabulary) for text in texts]
        usable = [bool(ids) and done and not is_degenerate(text) for ids, done, text in zip(token_ids, ended, texts)]
        fluency = [score.mean for score in forward]
        winner = choose_on_topic(fluency, on_topic, usable)
        for index, ids in enumerate(token_ids):
            session.candidates.append(
                Candidate(
                    token_ids=list(ids),
                    text=texts[index],
                    scores={
                        "forward": forward[index].total,
                        "forward_mean": forward[index].mean,
                        "on_topic": float(on_topic[index]),
                        "usable": float(usable[index]),
                        "ended": float(ended[index]),
                    },
                    chosen=index == winner,
                )
            )
        session.details["rank"] = {
            "on_topic": sum(on_topic),
            "usable": sum(usable),
            "ended": sum(ended),
            "quorum": self.settings.quorum_rows(),
        }
        return winner


@chatcore.hookimpl(trylast=True)
def register_decoders(register: Callable[[type], None]) -> None:
    register(RankDecoder)
