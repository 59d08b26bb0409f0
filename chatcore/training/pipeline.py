"""End-to-end training runs behind ``chatcore train``: corpus -> filter -> tokenizer -> model.

The held-out split comes first and only the training split is filtered, so the
held-out dialogues, and the perplexity measured on them, are the same with and without
filtering (and the same as ``chatcore eval``'s chitchat held-out prompts).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatcore.errors import ChatcoreError, ModelLoadError
from chatcore.training.accelerated import check_precision, checkpoint_to_resume, distributed_context, process_state
from chatcore.training.corpus import Dialogue
from chatcore.training.filtering import FilterConfig, FilterReport
from chatcore.training.threads import load_dialogues, split_heldout_by_thread
from chatcore.training.trainer import (
    ModelShape,
    TrainConfig,
    TrainResult,
    build_model,
    check_block_size,
    check_trainable,
    train,
)

if TYPE_CHECKING:
    from torch import nn

DEFAULT_FILTER = FilterConfig()
ReportCallback = Callable[[FilterReport], None]


def training_dialogues(
    corpus: str,
    heldout: float,
    filter_config: FilterConfig | None = DEFAULT_FILTER,
    on_filter_report: ReportCallback | None = None,
) -> tuple[list[Dialogue], list[Dialogue], FilterReport | None]:
    """Load a corpus, split off the held-out dialogues, filter the rest (unless
    ``filter_config`` is None). Returns (train, held-out, the filter report)."""
    from chatcore.training.filtering import filter_dialogues

    train_set, heldout_set = split_heldout_by_thread(load_dialogues(corpus), heldout)
    report = None
    if filter_config is not None:
        result = filter_dialogues(train_set, filter_config)
        train_set, report = result.dialogues, result.report
        if on_filter_report is not None:
            on_filter_report(report)
    return train_set, heldout_set, report


def train_tokenizer_command(
    corpus: str,
    out_dir: str,
    vocab_size: int,
    heldout: float,
    filter_config: FilterConfig | None = DEFAULT_FILTER,
    on_filter_report: ReportCallback | None = None,
) -> Path:
    from chatcore.training.tokenizer import train_tokenizer

    train_set, _, _ = training_dialogues(corpus, heldout, filter_config, on_filter_report)
    if not train_set:
        raise ChatcoreError("no training dialogue is left: lower the held-out fraction or relax the filter")
    tokenizer = train_tokenizer((turn for d in train_set for turn in d.turns), vocab_size=vocab_size)
    tokenizer.save_pretrained(out_dir)
    return Path(out_dir)


def _load_tokenizer(name: str) -> Any:
    """A tokenizer folder, or any model's name as ``--model`` takes it (``smollm2``, a GGUF file ...)."""
    from chatcore.models import load_tokenizer

    return load_tokenizer(name)


def _fine_tuned(init_from: str, tokenizer_path: str | None, block_size: int) -> tuple[Any, nn.Module]:
    """The tokenizer (``tokenizer_path``'s, else the model's own) and the model ``init_from``
    names, loaded to fine-tune; refused in one line where the model cannot train blocks of
    ``block_size`` or the tokenizer has ids the model has no embedding for."""
    from chatcore.models import load_causal_lm, quiet_loading, resolve_model_path

    source = resolve_model_path(init_from)
    tokenizer = _load_tokenizer(tokenizer_path or source)
    try:
        with quiet_loading():
            model = load_causal_lm(source, "float32")
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot load {init_from!r} to fine-tune: {error}") from error
    check_trainable(model, block_size)
    if tokenizer_path:
        check_vocabulary(len(tokenizer), model)
    return tokenizer, model


def check_vocabulary(size: int, model: Any) -> None:
    """Refuse, in one line, a ``--tokenizer`` with more ids than the model to fine-tune has
    embeddings: its higher ids would index past them in the middle of training."""
    embeddings = model.get_input_embeddings()
    rows = getattr(embeddings, "num_embeddings", None)
    if isinstance(rows, int) and size > rows:
        raise ChatcoreError(
            f"--tokenizer's vocabulary ({size:,}) is larger than --init-from's embeddings ({rows:,}): "
            "give the tokenizer the model was trained with (or leave --tokenizer out)"
        )


def _corpus_tokenizer(train_set: list[Dialogue], out_path: Path, device: str | None, vocab_size: int) -> Any:
    """A tokenizer trained on the training split; under torchrun rank 0 trains and saves it
    in ``out_path``/tokenizer and the other ranks load it from there."""
    from chatcore.training.tokenizer import train_tokenizer

    context = distributed_context()
    if not context.enabled:
        return train_tokenizer((t for d in train_set for t in d.turns), vocab_size=vocab_size)
    processes = process_state(device)
    shared_path = out_path / "tokenizer"
    if context.is_main:
        train_tokenizer((t for d in train_set for t in d.turns), vocab_size=vocab_size).save_pretrained(
            str(shared_path)
        )
    processes.wait_for_everyone()
    return _load_tokenizer(str(shared_path))


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
    filter_config: FilterConfig | None = DEFAULT_FILTER,
    on_filter_report: ReportCallback | None = None,
) -> TrainResult:
    """Train a forward (or, with ``reverse``, an MMI reverse) dialogue model.

    Under torchrun every rank loads and filters the corpus itself (both are
    deterministic); a tokenizer trained from scratch is trained by rank 0 alone and
    loaded by the others, so all ranks share one vocabulary.
    """
    from chatcore.training.data import encode_dialogues

    context = distributed_context()
    check_precision(config.precision, config.device)  # before the corpus loads
    if resume:
        checkpoint_to_resume(Path(config.out_dir))  # refuses a missing or old checkpoint before any work
    # The tokenizer and the model to fine-tune load before the corpus is filtered, so that a
    # bad --tokenizer, --init-from or --block-size is refused before any work.
    tokenizer: Any = None
    model: nn.Module | None = None
    if init_from:
        tokenizer, model = _fine_tuned(init_from, tokenizer_path, config.block_size)
    else:
        check_block_size(config.block_size, shape.n_positions)
        if tokenizer_path:
            tokenizer = _load_tokenizer(tokenizer_path)
    train_set, heldout_set, report = training_dialogues(
        corpus, heldout, filter_config, on_filter_report if context.is_main else None
    )
    if not train_set:
        raise ChatcoreError(
            "the training split is empty: lower the held-out fraction, add dialogues or relax the filter"
        )
    out_path = Path(config.out_dir)
    if context.is_main:
        out_path.mkdir(parents=True, exist_ok=True)
        if report is not None:
            (out_path / "filter_report.json").write_text(json.dumps(report.to_dict(), indent=2))
    if model is None:
        if tokenizer is None:
            tokenizer = _corpus_tokenizer(train_set, out_path, config.device, vocab_size)
        import torch

        torch.manual_seed(config.seed)  # the initial weights: --seed makes a run from scratch repeatable
        model = build_model(tokenizer, shape)
    train_stream = encode_dialogues(train_set, tokenizer, reverse=reverse)
    heldout_stream = encode_dialogues(heldout_set, tokenizer, reverse=reverse) if heldout_set else train_stream[:0]
    filter_settings = None if filter_config is None else _changed_settings(filter_config)
    config.extra.update(
        {
            "corpus": corpus,
            "reverse": reverse,
            "heldout_fraction": heldout,
            "init_from": init_from,
            "filter": filter_settings,
        }
    )
    # best/'s training record, written into best/ with each best model (its step, loss and
    # the seconds trained until then are added there).
    record = {
        "corpus": corpus,
        "direction": "reverse" if reverse else "forward",
        "tokenizer": tokenizer_path or init_from or "trained on the corpus",
        "heldout_fraction": heldout,
        "filter": _filter_summary(filter_settings, report),
        "train_tokens": int(train_stream.numel()),
        "heldout_tokens": int(heldout_stream.numel()),
    }
    with contextlib.nullcontext() if progress else quiet_training():
        return train(
            model, tokenizer, train_stream, heldout_stream, config, resume=resume, progress=progress, record=record
        )


def _changed_settings(config: FilterConfig) -> dict[str, Any]:
    """The filter settings that differ from the defaults ({} for the default filter)."""
    defaults = DEFAULT_FILTER.model_dump()
    return {key: value for key, value in config.model_dump().items() if defaults[key] != value}


def _filter_summary(settings: dict[str, Any] | None, report: FilterReport | None) -> dict[str, Any] | str:
    if settings is None or report is None:
        return "off"
    return {
        "settings": settings,
        "exchanges_in": report.exchanges_in,
        "exchanges_kept": report.exchanges_out,
        "removed_by_rule": {rule.name: rule.removed for rule in report.rules if rule.status == "on"},
    }


@contextlib.contextmanager
def quiet_training() -> Iterator[None]:
    """``--quiet``: transformers' progress bars (writing the model's shards) and its warnings
    (the padding mask a training batch never needs) held back; errors still show."""
    from transformers.utils import logging as hf_logging

    from chatcore.models import quiet_loading

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with quiet_loading():
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
