"""Scoring candidate replies for reranking: forward and reverse (MMI) log-probabilities.

The reverse model is a causal LM trained on dialogues with their turns in reverse
order (``chatcore train model --reverse``, from scratch or from any causal LM), each
turn ended by the reverse model's EOS, so after ``EOS reply EOS`` it predicts the turn
that came before the reply. It reads plain turns whatever prompt format the forward
model uses: the source is taken from the conversation's messages as text (never by
cutting a chat template's ids), and the candidates are the replies' tokens without
their stop token. Its log-probability of the source given a candidate,
log P(source | candidate), is the MMI score of the DialoGPT paper: it rewards replies
that are specific to what was said and penalises replies that fit anything.

Everything here is batched: one forward pass scores every candidate.
"""

from __future__ import annotations

import functools
import hashlib
import json
import weakref
from collections.abc import Sequence
from typing import Any

from chatcore.api import (
    DEFAULT_REVERSE_MODEL,
    ContinuationScore,
    LoadedModel,
    Message,
    ModelLoadError,
    bundled_reverse_models,
    encode_text,
    load_model,
    load_tokenizer,
)


def score_continuations(
    loaded: LoadedModel, rows: Sequence[tuple[Sequence[int], Sequence[int]]]
) -> list[ContinuationScore]:
    """log P(target | prefix) for each ``(prefix_ids, target_ids)`` row, in one forward pass.

    Rows are left-padded (attention mask, positions counted from each row's first real
    token), so every row ends in the same column and the targets sit in the last
    columns: the output layer and the softmax run only there. For the reverse model
    every row has the same source as its target, so that is a few columns, not the
    whole batch. A prefix must have at least one token; an empty target scores 0.
    """
    import torch

    if not rows:
        return []
    for prefix, _target in rows:
        if not prefix:
            raise ValueError("each scored row needs a non-empty prefix")
    # The last target token is predicted, never fed in.
    inputs = [list(prefix) + list(target[:-1]) for prefix, target in rows]
    width = max(len(ids) for ids in inputs)
    if width > loaded.max_positions:
        raise ValueError(f"a scored row has {width} tokens; model {loaded.name!r} takes {loaded.max_positions}")
    keep = max(1, max(len(target) for _, target in rows))  # the columns that predict a target token
    batch = len(rows)
    input_ids = torch.full((batch, width), loaded.eos_token_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    targets = torch.full((batch, keep), -1, dtype=torch.long)  # -1: not scored
    for row, ((_, target), ids) in enumerate(zip(rows, inputs)):
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention[row, width - len(ids) :] = 1
        if target:
            # The logits in the last len(target) columns predict the target tokens.
            targets[row, keep - len(target) :] = torch.tensor(list(target), dtype=torch.long)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    device = loaded.device
    input_ids, attention, positions, targets = (t.to(device) for t in (input_ids, attention, positions, targets))
    with torch.inference_mode():
        output = loaded.model(
            input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=False, logits_to_keep=keep
        )
        log_probs = torch.log_softmax(output.logits[:, -keep:].float(), dim=-1)  # (B, keep, V)
        scored = targets >= 0  # (B, keep)
        picked = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, keep)
        totals = torch.where(scored, picked, torch.zeros_like(picked)).sum(-1)  # (B,)
        counts = scored.sum(-1)
    return [ContinuationScore(float(t), int(c)) for t, c in zip(totals.tolist(), counts.tolist())]


def forward_scores(
    loaded: LoadedModel, prompt_ids: Sequence[int], candidates: Sequence[Sequence[int]]
) -> list[ContinuationScore]:
    """log P(candidate EOS | prompt) under the plain forward model (no steering, no sampling filters)."""
    eos = loaded.eos_token_id
    return score_continuations(loaded, [(prompt_ids, list(c) + [eos]) for c in candidates])


def reverse_rows(
    candidates: Sequence[Sequence[int]], source_turns: Sequence[Sequence[int]], eos: int, max_positions: int
) -> list[tuple[list[int], list[int]]]:
    """Reverse-model rows ``(EOS candidate EOS, source)`` for every candidate.

    ``source_turns`` are the turns the reply answers, newest first (the order the
    reverse model was trained on), and the source is each followed by EOS. The
    leading EOS marks the start of a turn, as it does everywhere in the training
    stream (GPT-2 also uses EOS as its start token).

    Everything must fit the reverse model's positions: a candidate longer than half
    of them keeps its last tokens (those next to the source), and then every
    candidate scores the same source tokens, cut from the oldest end if needed.
    """
    source: list[int] = []
    for turn in source_turns:
        source.extend(turn)
        source.append(eos)
    limit = max(1, max_positions // 2 - 2)
    candidates = [list(c[-limit:]) if len(c) > limit else list(c) for c in candidates]
    longest = max((len(c) for c in candidates), default=0)
    room = max_positions + 1 - (longest + 2)  # the last source token is never fed in
    source = source[:room]
    return [([eos, *candidate, eos], source) for candidate in candidates]


def source_texts(messages: Sequence[Message], count: int) -> list[str]:
    """The texts of the latest ``count`` user and assistant turns, newest first: what the
    reverse model is asked to predict after a candidate. The system prompt is not part
    of it (the reverse model is trained on dialogue turns alone)."""
    turns = [message.text for message in messages if message.role != "system"]
    return list(reversed(turns[-count:])) if count > 0 else []


def encode_source(reverse: LoadedModel, texts: Sequence[str]) -> list[list[int]]:
    """Source turns as the reverse model's token ids; text that looks like a special
    token stays text, as it does everywhere a user's words are encoded."""
    return [encode_text(reverse.tokenizer, text) for text in texts]


def reverse_scores(
    reverse: LoadedModel, candidates: Sequence[Sequence[int]], source_turns: Sequence[Sequence[int]]
) -> list[ContinuationScore]:
    """log P(source | candidate) under the reverse model, all candidates in one batch.

    Token ids must already be in the reverse model's vocabulary (see :func:`same_tokenizer`).
    """
    rows = reverse_rows(candidates, source_turns, reverse.eos_token_id, reverse.max_positions)
    return score_continuations(reverse, rows)


# -- the reverse model and its tokenizer ------------------------------------------------


def load_reverse_model(name: str = DEFAULT_REVERSE_MODEL, device: str = "cpu") -> LoadedModel:
    """Load a reverse model (the ``mmi`` decoder's ``setup`` does it once per engine and settings)."""
    try:
        return load_model(name, device=device)
    except ModelLoadError as error:
        raise ModelLoadError(f"the MMI reverse model could not be loaded: {error}") from error


def matching_reverse_model(tokenizer: Any) -> str | None:
    """The first bundled reverse model that turns text into the same ids as ``tokenizer``
    (``reverse_model=auto``), or None when no bundled one shares it."""
    for name in bundled_reverse_models():
        if same_tokenizer(tokenizer, bundled_tokenizer(name)):
            return name
    return None


@functools.cache
def bundled_tokenizer(name: str) -> Any:
    # Bundled folders never change while chatcore runs; a tokenizer is read once.
    return load_tokenizer(name)


# Signatures by tokenizer object: serialising a tokenizer costs far more than a reply's
# reverse pass, and the MMI decoder compares the same two tokenizers on every reply.
_signatures: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def _tokenizer_signature(tokenizer: Any) -> str:
    """A sha256 of how ``tokenizer`` turns text into ids (computed once per object)."""
    try:
        return _signatures[tokenizer]
    except (KeyError, TypeError):
        pass
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        # Padding and truncation are runtime settings, not part of how text becomes ids.
        spec.pop("padding", None)
        spec.pop("truncation", None)
        text = json.dumps(spec, sort_keys=True)
    else:
        text = json.dumps(sorted(tokenizer.get_vocab().items()))
    signature = hashlib.sha256(text.encode("utf-8")).hexdigest()
    try:
        _signatures[tokenizer] = signature
    except TypeError:  # an object that takes no weak references: not cached
        pass
    return signature


def same_tokenizer(first: Any, second: Any) -> bool:
    """Whether two tokenizers turn text into the same ids (by content, not by name)."""
    if first is second:
        return True
    if first.eos_token_id != second.eos_token_id:
        return False
    return _tokenizer_signature(first) == _tokenizer_signature(second)


def retokenize(source: Any, target: Any, sequences: Sequence[Sequence[int]]) -> list[list[int]]:
    """Token ids under ``source``'s tokenizer re-encoded by text for ``target``'s."""
    return [encode_text(target, source.decode(list(ids))) if ids else [] for ids in sequences]


def split_turns(prompt_ids: Sequence[int], eos: int) -> list[list[int]]:
    """The turns of a DialoGPT prompt (each followed by EOS), oldest first: the source
    of a session that carries no messages (one built from prompt ids alone)."""
    turns: list[list[int]] = []
    current: list[int] = []
    for token in prompt_ids:
        if token == eos:
            turns.append(current)
            current = []
        else:
            current.append(int(token))
    if current:  # a prompt that does not end with EOS: its tail is still a turn
        turns.append(current)
    return turns
