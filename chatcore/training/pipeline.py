"""End-to-end training runs behind ``chatcore train``: corpus -> tokenizer -> model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from chatcore.errors import ChatcoreError, ModelLoadError
from chatcore.training.corpus import load_corpus, split_heldout
from chatcore.training.trainer import ModelShape, TrainConfig, TrainResult, build_model, train


def train_tokenizer_command(corpus: str, out_dir: str, vocab_size: int, heldout: float) -> Path:
    from chatcore.training.tokenizer import train_tokenizer

    train_set, _ = split_heldout(load_corpus(corpus), heldout)
    tokenizer = train_tokenizer((turn for d in train_set for turn in d.turns), vocab_size=vocab_size)
    tokenizer.save_pretrained(out_dir)
    return Path(out_dir)


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot load a tokenizer from {path!r}: {error}") from error
    if tokenizer.eos_token_id is None:
        raise ModelLoadError(f"the tokenizer at {path!r} has no EOS token")
    return tokenizer


def train_model_command(
    corpus: str,
    config: TrainConfig,
    shape: ModelShape,
    tokenizer_path: str | None = None,
    init_from: str | None = None,
    reverse: bool = False,
    heldout: float = 0.05,
    vocab_size: int = 8192,
    resume: bool = False,
    progress: bool = True,
) -> TrainResult:
    """Train a forward (or, with ``reverse``, an MMI reverse) dialogue model."""
    from chatcore.training.data import encode_dialogues

    train_set, heldout_set = split_heldout(load_corpus(corpus), heldout)
    if not train_set:
        raise ChatcoreError("the training split is empty: lower the held-out fraction or add dialogues")
    if init_from:
        from transformers import AutoModelForCausalLM

        from chatcore.models import resolve_model_path

        source = resolve_model_path(init_from)
        tokenizer = _load_tokenizer(tokenizer_path or source)
        try:
            model = AutoModelForCausalLM.from_pretrained(source, dtype="float32")
        except (OSError, ValueError) as error:
            raise ModelLoadError(f"cannot load {init_from!r} to fine-tune: {error}") from error
    else:
        if tokenizer_path:
            tokenizer = _load_tokenizer(tokenizer_path)
        else:
            from chatcore.training.tokenizer import train_tokenizer

            tokenizer = train_tokenizer((t for d in train_set for t in d.turns), vocab_size=vocab_size)
        model = build_model(tokenizer, shape)
    train_stream = encode_dialogues(train_set, tokenizer, reverse=reverse)
    heldout_stream = encode_dialogues(heldout_set, tokenizer, reverse=reverse) if heldout_set else train_stream[:0]
    config.extra.update({"corpus": corpus, "reverse": reverse, "heldout_fraction": heldout, "init_from": init_from})
    result = train(model, tokenizer, train_stream, heldout_stream, config, resume=resume, progress=progress)
    card = {
        "corpus": corpus,
        "direction": "reverse" if reverse else "forward",
        "heldout_fraction": heldout,
        "train_tokens": int(train_stream.numel()),
        "heldout_tokens": int(heldout_stream.numel()),
        "parameters": result.parameters,
        "best_step": result.best_step,
        "heldout_loss": round(result.best_val_loss, 4),
        "heldout_perplexity": round(result.best_val_perplexity, 2),
        "seconds": round(result.seconds, 1),
    }
    best = Path(config.out_dir) / "best"
    if best.exists():
        (best / "chatcore_training.json").write_text(json.dumps(card, indent=2))
    return result
