"""Turning dialogues into token streams for causal-LM training.

Forward: ``turn_1 EOS turn_2 EOS ... turn_n EOS``, the DialoGPT format, so the model
learns P(reply | history). Reverse (for MMI): the same dialogue with its turns in
reverse order, so the reverse model learns P(source | reply).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from chatcore.training.corpus import Dialogue

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase


def encode_dialogues(
    dialogues: Sequence[Dialogue], tokenizer: "PreTrainedTokenizerBase", reverse: bool = False
) -> "torch.Tensor":
    """One flat stream of token ids (int64) for the whole corpus."""
    import torch

    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token; chatcore separates turns with it")
    texts = [turn for dialogue in dialogues for turn in (reversed(dialogue.turns) if reverse else dialogue.turns)]
    # split_special_tokens: corpus text that looks like "<|endoftext|>" stays text.
    # Whole dialogues are longer than the model's positions; they are cut into blocks below,
    # so transformers' "sequence length is longer than the maximum" warning does not apply.
    encoded = tokenizer(texts, add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"]
    stream: list[int] = []
    for ids in encoded:
        stream.extend(ids)
        stream.append(eos)
    return torch.tensor(stream, dtype=torch.long)


def make_blocks(stream: "torch.Tensor", block_size: int, offset: int = 0) -> "torch.Tensor":
    """Cut a stream into (N, block_size + 1) rows: inputs are row[:-1], targets row[1:]."""
    usable = stream[offset:]
    count = (usable.numel() - 1) // block_size
    if count < 1:
        raise ValueError(f"the corpus has {stream.numel()} tokens, fewer than one block of {block_size}")
    starts = [i * block_size for i in range(count)]
    import torch

    return torch.stack([usable[s : s + block_size + 1] for s in starts])
