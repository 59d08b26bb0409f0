"""Attribute models: what PPLM steers towards, and the loss it descends.

The contract (:class:`AttributeModel`): once per decoding step the perturbation asks
``step_targets(sequences, prompt_length)`` for whatever the loss needs about the text so
far, then, in each gradient iteration, ``loss(inputs)`` gives one loss per row from the
perturbed next-token log-probabilities and, if ``needs_hidden``, the mean hidden state
at ``layer``. Two kinds ship:

- :class:`BagOfWords`: ``-log`` of the probability that the next token starts (or
  continues) a word of the list;
- :class:`DiscriminatorHead`: cross-entropy of a linear classification head on the mean
  hidden state of the reply. A head is saved (safetensors) with the base model's hidden
  size, layer count, the layer it reads, and a fingerprint of the tokenizer, and is
  refused with a clear message by a model that does not match.
"""

from __future__ import annotations

import json
import struct
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import NonNegativeInt, PositiveInt, model_validator

from chatcore.api import OptionError, Settings, vocabulary_sha256

if TYPE_CHECKING:
    import torch

HEADS_DIR = Path(__file__).with_name("heads")
HEAD_FORMAT = "chatcore-discriminator/1"


class DiscriminatorMismatchError(OptionError):
    """A discriminator head was trained for another model (hidden size, layers or tokenizer):
    a setting that does not fit this model."""


@dataclass
class AttributeInputs:
    """What one loss evaluation sees, for the rows being optimised (b of them).

    log_probs:    (b, V) perturbed next-token log-probabilities.
    mean_hidden:  (b, C) mean hidden state of the reply so far, the new position and the
                  soft horizon (only for models with ``needs_hidden``).
    targets:      what ``step_targets`` returned for these rows.
    """

    log_probs: "torch.Tensor"
    mean_hidden: "torch.Tensor | None" = None
    targets: Any = None


class AttributeModel(ABC):
    needs_hidden: bool = False
    layer: int = -1  # index into the model's hidden_states tuple (0: embeddings)

    def step_targets(self, sequences: "torch.Tensor", prompt_length: int) -> Any:
        """Per-step preparation from the (b, T) tokens so far; the result reaches ``loss``."""
        return None

    @abstractmethod
    def loss(self, inputs: AttributeInputs) -> "torch.Tensor":
        """(b,) loss per row; lower means more of the attribute."""

    def describe(self) -> dict[str, Any]:
        return {}


# -- bag of words ---------------------------------------------------------------------------------


def reply_start_forms(word: str) -> set[str]:
    """How a word is written as the first word of a reply (turn text has no leading space)."""
    return {word, word.lower(), word[:1].upper() + word[1:]}


def in_reply_forms(word: str) -> set[str]:
    return {" " + form for form in reply_start_forms(word)}


class BagOfWords(AttributeModel):
    """Loss ``-log sum p(t)`` over the tokens ``t`` that begin a word of the list here, or
    continue one the reply has begun.

    A word of several tokens contributes its first token, and its k-th token once the
    reply ends with its first k-1 tokens, so multi-token words are completed and not
    dropped. A word's first token leaves the bag once the reply contains it, so the
    reply is pushed towards the topic rather than towards repeating one word. A first
    token that is a short generic piece of the word (under half of it:
    "p" of "pizza" at the start of a reply, "we" of "weather") is left out of the bag:
    raising it would mostly start other words ("we", "people"); such a word is still
    steered to completion once its first piece appears. A word whose every first token
    is such a piece (a small vocabulary) keeps them.
    """

    def __init__(
        self,
        words: Sequence[str],
        start_mask: "torch.Tensor",
        inner_mask: "torch.Tensor",
        continuations: dict[tuple[int, ...], tuple[int, ...]],
    ) -> None:
        self.words = list(words)
        self.start_mask = start_mask  # (V,) bool: next-token targets at the start of the reply
        self.inner_mask = inner_mask  # (V,) bool: ... inside the reply
        self.continuations = continuations  # token prefix -> the tokens that continue a word
        self.max_prefix = max((len(prefix) for prefix in continuations), default=0)

    @classmethod
    def from_words(cls, words: Iterable[str], tokenizer: Any, vocab_size: int, device: Any = "cpu") -> "BagOfWords":
        import torch

        from chatcore.api import encode_text

        words = [w.strip() for w in words if w.strip()]
        start: set[int] = set()
        inner: set[int] = set()
        continuations: dict[tuple[int, ...], set[int]] = {}
        for word in words:
            first_word = word.split()[0]
            strong: list[tuple[set[int], int]] = []
            weak: list[tuple[set[int], int]] = []
            for forms, bag in ((reply_start_forms(word), start), (in_reply_forms(word), inner)):
                for form in forms:
                    ids = [i for i in encode_text(tokenizer, form) if i < vocab_size]
                    if not ids:
                        continue
                    piece = tokenizer.decode([ids[0]]).strip()
                    is_strong = len(ids) == 1 or 2 * len(piece) >= len(first_word)
                    (strong if is_strong else weak).append((bag, ids[0]))
                    for k in range(1, len(ids)):
                        continuations.setdefault(tuple(ids[:k]), set()).add(ids[k])
            # A word that only has generic first pieces (a small vocabulary) keeps them:
            # better a loose target than a word that is never steered.
            for bag, token in strong or weak:
                bag.add(token)
        if not start and not inner:
            raise OptionError(
                "pplm: none of the words can be steered with this tokenizer "
                f"(words: {', '.join(words[:5])}{', ...' if len(words) > 5 else ''})"
            )
        # One position without targets would give an infinite loss: borrow the other's.
        start, inner = start or inner, inner or start

        def mask(ids: set[int]) -> "torch.Tensor":
            out = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            out[sorted(ids)] = True
            return out

        frozen = {prefix: tuple(sorted(nxt)) for prefix, nxt in continuations.items()}
        return cls(words, mask(start), mask(inner), frozen)

    def step_targets(self, sequences: "torch.Tensor", prompt_length: int) -> "torch.Tensor":
        """(b, V) bool: the tokens whose probability the loss sums for each row."""
        import torch

        rows, vocab = sequences.size(0), self.start_mask.numel()
        generated = sequences.size(1) - prompt_length
        base = self.start_mask if generated == 0 else self.inner_mask
        targets = base.expand(rows, vocab).clone()
        if generated > 0:
            # A word counts once: its first token leaves the bag when the reply has used it
            # (unless nothing would be left), which keeps PPLM from repeating one word.
            used = torch.zeros_like(targets).scatter_(1, sequences[:, prompt_length:], True)
            targets &= ~used
            emptied = ~targets.any(dim=1)
            if bool(emptied.any()):
                targets[emptied] = base
        if generated > 0 and self.max_prefix:
            tails = sequences[:, -min(generated, self.max_prefix) :].tolist()
            for row, tokens in enumerate(tails):
                for k in range(1, len(tokens) + 1):
                    following = self.continuations.get(tuple(tokens[-k:]))
                    if following:
                        targets[row, list(following)] = True
        return targets

    def loss(self, inputs: AttributeInputs) -> "torch.Tensor":
        import torch

        targets = inputs.targets
        assert targets is not None and targets.shape == inputs.log_probs.shape, "step_targets() result expected"
        in_bag = inputs.log_probs.masked_fill(~targets, float("-inf"))
        return -torch.logsumexp(in_bag, dim=-1)  # (b,)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "bag-of-words",
            "words": len(self.words),
            "start_tokens": int(self.start_mask.sum()),
            "inner_tokens": int(self.inner_mask.sum()),
        }


# -- discriminator heads -----------------------------------------------------------------------------


class HeadConfig(Settings):
    """What a head was trained on; saved in the file's metadata."""

    classes: list[str]
    hidden_size: PositiveInt
    num_layers: PositiveInt
    layer: NonNegativeInt
    """Index into the model's hidden_states tuple (0 = embeddings, num_layers = the last,
    after the final layer norm), never negative once saved."""
    tokenizer_fingerprint: str
    base_model: str
    training: dict[str, Any] = {}

    @model_validator(mode="after")
    def _consistent(self) -> HeadConfig:
        if len(self.classes) < 2 or len(set(self.classes)) != len(self.classes):
            raise ValueError(f"`classes` must be at least two distinct labels, got {self.classes!r}")
        if self.layer > self.num_layers:
            raise ValueError(f"`layer` must be between 0 and {self.num_layers}, got {self.layer}")
        return self

    def class_index(self, label: str) -> int:
        if label in self.classes:
            return self.classes.index(label)
        raise OptionError(f"`class_label` must be one of {', '.join(self.classes)}, got {label!r}")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of the tokenizer's vocabulary (token -> id) and its EOS id."""
    return vocabulary_sha256(tokenizer, tokenizer.eos_token_id)[:16]


def model_shape(model: Any) -> tuple[int, int]:
    """(hidden size, number of layers) of a Hugging Face model."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.hidden_size), int(config.num_hidden_layers)


def builtin_heads() -> list[str]:
    return sorted(p.stem for p in HEADS_DIR.glob("*.safetensors"))


def resolve_head(name_or_path: str) -> Path:
    """A shipped head by name (``sentiment``; first, so that a shipped name always means
    the shipped head) or a head file."""
    shipped = HEADS_DIR / f"{name_or_path}.safetensors"
    if "/" not in name_or_path and "\\" not in name_or_path and shipped.is_file():
        return shipped
    path = Path(name_or_path)
    if path.is_file():
        return path
    known = ", ".join(builtin_heads()) or "none shipped"
    raise OptionError(f"`discriminator`: no head file {name_or_path!r} and no shipped head of that name ({known})")


def read_head_config(path: str | Path) -> HeadConfig:
    """Read a head's metadata without loading torch (the safetensors header is JSON)."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            if size > 10_000_000:
                raise ValueError("header too large")
            header = json.loads(handle.read(size))
        metadata = header.get("__metadata__") or {}
        if metadata.get("format") != HEAD_FORMAT:
            raise ValueError(f"not a {HEAD_FORMAT} file")
        return HeadConfig(**json.loads(metadata["config"]))
    except (OSError, ValueError, KeyError, TypeError, struct.error) as error:
        raise OptionError(f"`discriminator`: {str(path)!r} is not a chatcore discriminator head ({error})") from None


def save_head(path: str | Path, weight: "torch.Tensor", bias: "torch.Tensor", config: HeadConfig) -> Path:
    """Write a head: weight (K, C), bias (K,) and its config, as one safetensors file."""
    from safetensors.torch import save_file

    assert weight.shape == (len(config.classes), config.hidden_size), weight.shape
    assert bias.shape == (len(config.classes),), bias.shape
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"weight": weight.detach().float().cpu().contiguous(), "bias": bias.detach().float().cpu().contiguous()}
    save_file(tensors, str(path), metadata={"format": HEAD_FORMAT, "config": json.dumps(config.model_dump())})
    return path


class DiscriminatorHead(AttributeModel):
    """A linear classification head on the mean hidden state at ``layer``.

    Loss: cross-entropy towards ``class_index`` (Dathathri et al., 2020, section 3.3).
    """

    needs_hidden = True

    def __init__(self, weight: "torch.Tensor", bias: "torch.Tensor", config: HeadConfig, class_index: int = 0) -> None:
        self.weight = weight  # (K, C)
        self.bias = bias  # (K,)
        self.config = config
        self.layer = config.layer
        self.class_index = class_index

    def logits(self, mean_hidden: "torch.Tensor") -> "torch.Tensor":
        """(b, C) -> (b, K) class scores."""
        return mean_hidden.float() @ self.weight.t() + self.bias

    def loss(self, inputs: AttributeInputs) -> "torch.Tensor":
        import torch

        assert inputs.mean_hidden is not None, "the discriminator needs the mean hidden state"
        scores = self.logits(inputs.mean_hidden)
        labels = torch.full((scores.size(0),), self.class_index, dtype=torch.long, device=scores.device)
        return torch.nn.functional.cross_entropy(scores, labels, reduction="none")

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "discriminator",
            "classes": self.config.classes,
            "class": self.config.classes[self.class_index],
            "layer": self.layer,
        }


def check_head_fits(config: HeadConfig, model: Any, tokenizer: Any, model_name: str, head_name: str) -> None:
    """Raise DiscriminatorMismatchError unless the head was trained for this model."""
    hidden_size, num_layers = model_shape(model)
    fingerprint = tokenizer_fingerprint(tokenizer)
    problems = []
    if config.hidden_size != hidden_size:
        problems.append(f"hidden size {config.hidden_size} (this model: {hidden_size})")
    if config.num_layers != num_layers:
        problems.append(f"{config.num_layers} layers (this model: {num_layers})")
    if config.tokenizer_fingerprint != fingerprint:
        problems.append(f"tokenizer {config.tokenizer_fingerprint} (this model's: {fingerprint})")
    if problems:
        raise DiscriminatorMismatchError(
            f"discriminator {head_name!r} was trained for model {config.base_model!r} and does not fit "
            f"{model_name!r}: {'; '.join(problems)}. Train a head for this model with "
            f"`chatcore train discriminator --model {model_name} ...`"
        )


def load_head(
    name_or_path: str, model: Any, tokenizer: Any, model_name: str, class_label: str, device: Any = "cpu"
) -> DiscriminatorHead:
    """Load a head for ``model``; refuse it if it was trained for another model."""
    from safetensors.torch import load_file

    path = resolve_head(name_or_path)
    config = read_head_config(path)
    check_head_fits(config, model, tokenizer, model_name, name_or_path)
    tensors = load_file(str(path), device=str(device))
    return DiscriminatorHead(tensors["weight"], tensors["bias"], config, config.class_index(class_label))
