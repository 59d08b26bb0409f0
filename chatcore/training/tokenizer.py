"""A byte-level BPE tokenizer trained on a dialogue corpus, GPT-2 / DialoGPT style.

The single special token ``<|endoftext|>`` is BOS, EOS, UNK and PAD at once, and EOS
separates turns, as in DialoGPT.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2) -> "PreTrainedTokenizerFast":
    """Train a byte-level BPE tokenizer and wrap it as a transformers GPT-2 tokenizer."""
    if vocab_size < 300:
        raise ValueError(f"`vocab_size` must be at least 300 (256 bytes + merges), got {vocab_size}")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GPT2Tokenizer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    wrapped = GPT2Tokenizer(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        add_prefix_space=False,
    )
    wrapped.model_max_length = 1024
    return wrapped
