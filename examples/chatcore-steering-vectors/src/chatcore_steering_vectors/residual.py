"""The residual stream of a Hugging Face causal LM: its blocks, reading them, adding to them.

Every block of a transformer reads the residual stream and adds its own output to it,
so "the hidden state at layer L" is the output of block L. A forward hook on that block
can read the output (to build a steering vector) or return a changed output (to steer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from chatcore.api import ChatcoreError

if TYPE_CHECKING:
    import torch

Pool = Literal["mean", "last"]

# Where common architectures keep their list of blocks.
BLOCK_PATHS = (
    "transformer.h",  # GPT-2, DialoGPT, GPT-J, GPT-Neo, BLOOM
    "model.layers",  # Llama, Mistral, Qwen, Gemma, Phi-3
    "model.decoder.layers",  # OPT
    "gpt_neox.layers",  # GPT-NeoX, Pythia
    "transformer.blocks",  # MPT
)


def _attribute_path(root: Any, path: str) -> Any:
    for name in path.split("."):
        root = getattr(root, name, None)
        if root is None:
            return None
    return root


def find_blocks(model: "torch.nn.Module") -> "torch.nn.ModuleList":
    """The model's transformer blocks, in order.

    Known layouts first; otherwise the first ``ModuleList`` with as many entries as
    the config has hidden layers (how most causal LMs in transformers are built).
    """
    import torch

    count = getattr(model.config, "num_hidden_layers", None)
    for path in BLOCK_PATHS:
        blocks = _attribute_path(model, path)
        if isinstance(blocks, torch.nn.ModuleList) and len(blocks) > 0:
            return blocks
    for _, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and count and len(module) == count:
            return module
    raise ChatcoreError(
        f"cannot find the transformer blocks of a {type(model).__name__} "
        f"(looked for {', '.join(BLOCK_PATHS)} and a ModuleList of {count} layers)"
    )


def _hidden(output: Any) -> "torch.Tensor":
    # transformers 5 blocks return the hidden states; older ones and some
    # architectures return a tuple whose first item they are.
    return output[0] if isinstance(output, tuple) else output


def _with_hidden(output: Any, hidden: "torch.Tensor") -> Any:
    return (hidden, *output[1:]) if isinstance(output, tuple) else hidden


def add_to_output(block: "torch.nn.Module", change: Callable[["torch.Tensor"], "torch.Tensor"]) -> Any:
    """Register a forward hook that replaces ``block``'s hidden-state output
    ``h`` (B, T, C) by ``change(h)``. Returns the handle; call ``.remove()``."""

    def hook(module: Any, args: Any, output: Any) -> Any:
        return _with_hidden(output, change(_hidden(output)))

    return block.register_forward_hook(hook)


def mean_block_output(
    model: "torch.nn.Module", block: "torch.nn.Module", prompts: Sequence[Sequence[int]], pool: Pool
) -> "torch.Tensor":
    """The output of ``block`` for each prompt, pooled over its tokens ("mean") or taken
    at its last token ("last"), then averaged over the prompts. Returns (C,)."""
    import torch

    assert prompts, "no prompts"
    pooled: list[torch.Tensor] = []

    def read(hidden: torch.Tensor) -> torch.Tensor:
        # (1, T, C) -> (C,); float32 so that averaging in half precision loses nothing
        pooled.append((hidden[0].mean(dim=0) if pool == "mean" else hidden[0, -1]).float())
        return hidden

    device = next(model.parameters()).device
    handle = add_to_output(block, read)
    try:
        with torch.no_grad():
            for ids in prompts:
                input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
                model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    return torch.stack(pooled).mean(dim=0)
