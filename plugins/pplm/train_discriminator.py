"""Training a PPLM discriminator head on a frozen model.

The head sees what the steerer will give it: the mean hidden state, at one layer, over
"EOS + text" (a reply starts right after the EOS that closes the previous turn), run
after the example's context turns when it has them, as a reply runs after its
conversation (hidden states depend on what came before). The
base model never changes, so the features are computed once and a linear classifier
is fitted on them (full batch, AdamW, cross-entropy), with a held-out share for the
accuracy it reports.

Labelled data: a ``label<TAB>text`` file, a JSONL file of ``{"label": ..., "text": ...}``,
(optionally with ``"context": [turns before it]``), or the built-in sentiment labels:
chitchat utterances (training split only) that VADER scores clearly positive or clearly
negative, each with the two turns before it.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field, NonNegativeFloat, PositiveInt

from chatcore.api import CorpusError, OptionError, Settings

if TYPE_CHECKING:
    import torch

    from chatcore.api import LoadedModel


@dataclass(frozen=True)
class LabelledText:
    label: str
    text: str
    context: tuple[str, ...] = ()  # the turns before it, oldest first


class TrainSettings(Settings):
    """How a discriminator head is trained (`chatcore train discriminator`)."""

    layer: int = -1
    """Hidden-state layer the head reads (-1: the last, after the final norm; negative counts from the end)."""
    per_class: Annotated[int, Field(ge=2, le=10**7)] = 3000
    """At most this many examples per class (classes are balanced)."""
    epochs: Annotated[int, Field(ge=1, le=100_000)] = 300
    learning_rate: Annotated[float, Field(ge=1e-6, le=10.0)] = 0.01
    weight_decay: NonNegativeFloat = 1e-3
    validation_share: Annotated[float, Field(ge=0.0, lt=0.9)] = 0.1
    batch_size: PositiveInt = 64
    max_tokens: PositiveInt = 64
    seed: int = 0


@dataclass
class TrainResult:
    path: Path
    classes: list[str]
    counts: dict[str, int]
    train_accuracy: float
    validation_accuracy: float | None
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        counts = ", ".join(f"{label} {count}" for label, count in self.counts.items())
        validation = f"{self.validation_accuracy:.1%}" if self.validation_accuracy is not None else "-"
        return (
            f"head saved to {self.path} (classes: {counts}); accuracy {self.train_accuracy:.1%} on training "
            f"examples, {validation} held out; {self.seconds:.0f} s"
        )


# -- labelled data --------------------------------------------------------------------------------


def read_labelled_file(path: str | Path) -> list[LabelledText]:
    """``label<TAB>text`` lines, or (``.jsonl``) one ``{"label": ..., "text": ...}`` per line."""
    from chatcore.training.corpus import data_lines, json_line

    path = Path(path)
    examples = []
    for number, line in data_lines(path, "labelled file"):
        if path.suffix == ".jsonl":
            record = json_line(path, number, line)
            label = record.get("label") if isinstance(record, dict) else None
            text = record.get("text") if isinstance(record, dict) else None
            context = record.get("context", []) if isinstance(record, dict) else []
            if not isinstance(context, list) or not all(isinstance(turn, str) for turn in context):
                raise CorpusError(f"{path}:{number}: `context` must be a list of turns")
        else:
            context = []
            label, sep, text = line.partition("\t")
            if not sep:
                raise CorpusError(f"{path}:{number}: expected label<TAB>text")
        if not isinstance(label, (str, int)) or not isinstance(text, str) or not str(label).strip() or not text.strip():
            raise CorpusError(f"{path}:{number}: expected a non-empty label and text")
        examples.append(
            LabelledText(
                str(label).strip(),
                " ".join(text.split()),
                tuple(" ".join(turn.split()) for turn in context if turn.strip()),
            )
        )
    check_classes(examples, str(path))
    return examples


def check_classes(examples: Sequence[LabelledText], source: str) -> None:
    counts = Counter(example.label for example in examples)
    if len(counts) < 2:
        raise CorpusError(f"{source}: a discriminator needs at least two labels, found {sorted(counts) or 'none'}")
    small = [label for label, count in counts.items() if count < 2]
    if small:
        raise CorpusError(f"{source}: label(s) {', '.join(small)} have fewer than 2 examples")


def sentiment_examples(
    positive_from: float = 0.5, negative_from: float = -0.4, context_turns: int = 2
) -> list[LabelledText]:
    """Chitchat utterances of the training split that VADER scores at least
    ``positive_from`` (positive) or at most ``negative_from`` (negative), each with up
    to ``context_turns`` turns before it."""
    try:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
    except ImportError:
        raise OptionError(
            "the built-in sentiment labels need the vaderSentiment package "
            '(pip install "chatcore[sentiment]"), or give --data FILE'
        ) from None
    from chatcore.training.corpus import load_chitchat, split_heldout

    train, _ = split_heldout(load_chitchat())
    analyzer = SentimentIntensityAnalyzer()
    seen: set[str] = set()
    examples = []
    for dialogue in train:
        for index, turn in enumerate(dialogue.turns):
            if turn in seen or len(turn) < 8:
                continue
            seen.add(turn)
            score = analyzer.polarity_scores(turn)["compound"]
            label = "positive" if score >= positive_from else "negative" if score <= negative_from else None
            if label is not None:
                context = dialogue.turns[max(0, index - context_turns) : index]
                examples.append(LabelledText(label, turn, tuple(context)))
    return examples


def balance(examples: Sequence[LabelledText], per_class: int, seed: int) -> list[LabelledText]:
    """The same number of examples of every class: at most ``per_class``, at most the rarest's count."""
    by_label: dict[str, list[LabelledText]] = {}
    for example in examples:
        by_label.setdefault(example.label, []).append(example)
    size = min(per_class, *(len(items) for items in by_label.values()))
    rng = random.Random(seed)
    chosen = []
    for label in sorted(by_label):
        chosen += rng.sample(by_label[label], size)
    rng.shuffle(chosen)
    return chosen


# -- features and the head ------------------------------------------------------------------------


def resolve_layer(layer: int, num_layers: int) -> int:
    """A hidden_states index in [0, num_layers] (negative counts from the end)."""
    resolved = layer + num_layers + 1 if layer < 0 else layer
    if not 0 <= resolved <= num_layers:
        raise OptionError(f"`layer` must be between {-(num_layers + 1)} and {num_layers}, got {layer}")
    return resolved


def extract_features(
    loaded: "LoadedModel",
    examples: Sequence[LabelledText],
    layer: int,
    batch_size: int = 64,
    max_tokens: int = 64,
    context_tokens: int = 96,
) -> "torch.Tensor":
    """(N, C) float32: per example, the mean hidden state at ``layer`` over the EOS that
    closes its context (or a lone EOS) and its text's tokens."""
    import torch

    from chatcore.api import encode_text
    from chatcore.training.formats import build_prompt

    from .attribute import model_shape

    eos = loaded.eos_token_id
    sequences: list[tuple[list[int], int]] = []  # (ids, index of the EOS where the reply starts)
    for example in examples:
        text = encode_text(loaded.tokenizer, example.text)[:max_tokens]
        prefix = [eos]
        if example.context:
            turns = [encode_text(loaded.tokenizer, turn) for turn in example.context]
            prefix = build_prompt(turns, eos, context_tokens).token_ids
        sequences.append((prefix + text, len(prefix) - 1))
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]))  # similar lengths batch well
    features = torch.zeros((len(sequences), model_shape(loaded.model)[0]), dtype=torch.float32)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            width = max(len(sequences[i][0]) for i in batch)
            ids = torch.full((len(batch), width), eos, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            span = torch.zeros((len(batch), width), dtype=torch.float32)  # 1 on the positions averaged
            for row, index in enumerate(batch):
                tokens, reply_start = sequences[index]
                ids[row, : len(tokens)] = torch.tensor(tokens)
                mask[row, : len(tokens)] = 1
                span[row, reply_start : len(tokens)] = 1.0
            output = loaded.model(
                input_ids=ids.to(loaded.device),
                attention_mask=mask.to(loaded.device),
                output_hidden_states=True,
                logits_to_keep=1,
            )
            hidden = output.hidden_states[layer].float()  # (b, T, C)
            weights = span.to(hidden.device).unsqueeze(-1)
            mean = (hidden * weights).sum(1) / weights.sum(1)
            features[torch.tensor(batch)] = mean.cpu()
    return features


def fit_head(
    features: "torch.Tensor", labels: "torch.Tensor", num_classes: int, settings: TrainSettings
) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Fit weight (K, C) and bias (K,) of a linear classifier by full-batch AdamW."""
    import torch

    generator = torch.Generator().manual_seed(settings.seed)
    head = torch.nn.Linear(features.size(1), num_classes)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * 0.01)
        head.bias.zero_()
    optimizer = torch.optim.AdamW(head.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay)
    with torch.enable_grad():
        for _ in range(settings.epochs):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(head(features), labels)
            loss.backward()
            optimizer.step()
    return head.weight.detach().clone(), head.bias.detach().clone()


def accuracy(weight: "torch.Tensor", bias: "torch.Tensor", features: "torch.Tensor", labels: "torch.Tensor") -> float:
    if labels.numel() == 0:
        return float("nan")
    predictions = (features @ weight.t() + bias).argmax(-1)
    return float((predictions == labels).float().mean())


def train_discriminator(
    loaded: "LoadedModel",
    examples: Sequence[LabelledText],
    out: str | Path,
    settings: TrainSettings | None = None,
    source: str = "",
    progress: Callable[[str], None] | None = None,
) -> TrainResult:
    """Fit a head on ``loaded``'s frozen features of ``examples`` and save it to ``out``."""
    import torch

    from .attribute import HeadConfig, model_shape, save_head, tokenizer_fingerprint

    settings = settings or TrainSettings()
    say = progress or (lambda message: None)
    started = time.perf_counter()
    check_classes(examples, source or "examples")
    hidden_size, num_layers = model_shape(loaded.model)
    layer = resolve_layer(settings.layer, num_layers)
    chosen = balance(examples, settings.per_class, settings.seed)
    classes = sorted({example.label for example in chosen})
    counts = dict(Counter(example.label for example in chosen))
    say(
        f"{len(chosen)} examples ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}); "
        f"features from layer {layer} of {loaded.name} ..."
    )
    features = extract_features(loaded, chosen, layer, settings.batch_size, settings.max_tokens)
    labels = torch.tensor([classes.index(e.label) for e in chosen], dtype=torch.long)
    held = int(len(chosen) * settings.validation_share)
    train_x, train_y, val_x, val_y = features[held:], labels[held:], features[:held], labels[:held]
    say(f"fitting the head on {len(train_y)} examples, {held} held out ...")
    weight, bias = fit_head(train_x, train_y, len(classes), settings)
    train_accuracy = accuracy(weight, bias, train_x, train_y)
    validation_accuracy = accuracy(weight, bias, val_x, val_y) if held else None
    config = HeadConfig(
        classes=classes,
        hidden_size=hidden_size,
        num_layers=num_layers,
        layer=layer,
        tokenizer_fingerprint=tokenizer_fingerprint(loaded.tokenizer),
        base_model=loaded.name,
        training={
            "source": source,
            "examples": counts,
            "epochs": settings.epochs,
            "train_accuracy": round(train_accuracy, 4),
            "validation_accuracy": round(validation_accuracy, 4) if validation_accuracy is not None else None,
        },
    )
    path = save_head(out, weight, bias, config)
    return TrainResult(path, classes, counts, train_accuracy, validation_accuracy, time.perf_counter() - started)
