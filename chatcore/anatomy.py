"""Where a Hugging Face causal LM keeps its parts, and how to run them one block at a time.

Steerers and trainers that reach inside a model (CoCon's split, PPLM's runner, activation
steering) ask an :class:`Anatomy` for the parts instead of spelling out GPT-2's
``transformer.h`` or Llama's ``model.layers``. It reads the structure generically
(``get_input_embeddings()``, the base model's block list, final norm and rotary module), so
GPT-2, the Llama family (Llama, Qwen2, Mistral, Gemma, Gemma2, Phi, Phi-3), GPT-NeoX and OPT
all work, and a model whose parts cannot be found gets one clear error naming its class.

Running blocks by hand (LM-alpha / LM-beta, a perturbed pass) must give the very numbers the
model's own ``forward`` gives. What differs between families, and is handled here:

- positions: GPT-2 and OPT add a learned position embedding to the token embedding; the
  Llama family and GPT-NeoX rotate queries and keys with ``(cos, sin)`` that the base
  model's ``rotary_emb`` computes once per pass from the position ids and every block takes;
- masks: built once per pass with transformers' own mask utilities (so they are in the form
  the configured attention implementation expects), one per layer kind: full attention, or
  a sliding window (Mistral, and Gemma2's alternate layers);
- the block call: the cache argument is ``past_key_values`` (``layer_past`` in GPT-NeoX),
  and only rotary blocks take ``position_embeddings``;
- the head: Gemma2 soft-caps its logits.

Hook points for steering: :meth:`Anatomy.residual_hook` edits or reads the residual stream
after a block, :meth:`Anatomy.head_hook` the per-head attention outputs of a block (before
the output projection mixes them). Both are torch forward hooks, so they act on every
forward pass of the model, however it is called. See docs/anatomy.md.

Shapes: B batch rows, T new positions, P cached positions, C width, H heads, D head dim,
V vocabulary.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from chatcore.errors import ChatcoreError
from chatcore.models import CACHE, LEGACY_CACHE, cache_keyword
from chatcore.text import shown_argument

if TYPE_CHECKING:
    import torch
    from torch import nn

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# Attribute names, in the order they are tried, for each part.
BLOCK_LISTS = ("layers", "h", "blocks")
FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "final_norm")
POSITION_EMBEDDINGS = ("wpe", "embed_positions")
EMBEDDING_DROPOUTS = ("drop", "emb_dropout", "embed_dropout")
CACHE_ARGUMENTS = (CACHE, LEGACY_CACHE, "layer_past")  # newest name first
ATTENTIONS = ("self_attn", "attn", "attention")
MLPS = ("mlp", "feed_forward")
QUERY_PROJECTIONS = ("q_proj", "query")
KEY_PROJECTIONS = ("k_proj", "key")
VALUE_PROJECTIONS = ("v_proj", "value")
FUSED_PROJECTIONS = ("c_attn", "qkv_proj", "query_key_value", "Wqkv")
OUTPUT_PROJECTIONS = ("o_proj", "c_proj", "dense", "out_proj")


class UnsupportedModelError(ChatcoreError):
    """A model whose parts chatcore cannot find (not GPT-2, Llama-family, GPT-NeoX or OPT)."""


@dataclass(frozen=True)
class AttentionParts:
    """A block's attention module and its projections.

    query, key, value: separate projections (Llama family, OPT); None where the model
                       fuses them into ``fused_qkv`` (GPT-2's ``c_attn``, GPT-NeoX's
                       ``query_key_value``, Phi-3's ``qkv_proj``).
    output:            the projection that mixes the heads back into the residual stream;
                       its input is the heads' outputs side by side, (B, T, H * D).
    """

    module: "nn.Module"
    query: "nn.Module | None"
    key: "nn.Module | None"
    value: "nn.Module | None"
    fused_qkv: "nn.Module | None"
    output: "nn.Module"


@dataclass
class BlockInputs:
    """What every block of one pass shares: built once by :meth:`Anatomy.block_inputs`.

    masks:               the attention mask for each layer kind (None lets SDPA be causal).
    position_ids:        (B, T) positions of the new tokens.
    position_embeddings: (cos, sin) for rotary models, None for learned positions.
    cache:               the DynamicCache every block reads and extends, or None.
    """

    masks: dict[str, Any]
    position_ids: "torch.Tensor"
    position_embeddings: "tuple[torch.Tensor, torch.Tensor] | None"
    cache: Any


def _first(owner: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        part = getattr(owner, name, None)
        if part is not None:
            return part
    return None


class Anatomy:
    """The parts and sizes of one causal LM; get it with :func:`anatomy_of`.

    Parts: ``token_embedding``, ``position_embedding`` (learned, or None), ``rotary`` (the
    rotary module, or None), ``blocks``, ``final_norm``, ``lm_head``; per block
    :meth:`attention` and :meth:`mlp`. Sizes: ``width``, ``n_layer``, ``n_head``,
    ``n_kv_head``, ``head_dim``, ``max_positions``, ``vocab_size``.
    """

    def __init__(self, model: Any) -> None:
        from torch import nn

        self.model = model
        name = type(model).__name__
        if getattr(model, "config", None) is None:
            raise UnsupportedModelError(f"{name} is not a Hugging Face model: it has no config")
        self.config = model.config
        base = getattr(model, "base_model", None)
        if base is None or base is model:
            raise UnsupportedModelError(f"{name} is not a causal LM with a base model and a head")
        inner = base
        if not isinstance(_first(base, BLOCK_LISTS), nn.ModuleList) and getattr(base, "decoder", None) is not None:
            inner = base.decoder  # OPT keeps its decoder stack one level down
        self.inner = inner
        blocks = _first(inner, BLOCK_LISTS)
        if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
            raise UnsupportedModelError(
                f"cannot find the decoder blocks of {name} (looked for "
                f"{', '.join(BLOCK_LISTS)} on {type(inner).__name__})"
            )
        self.blocks: nn.ModuleList = blocks
        self.token_embedding: nn.Module = model.get_input_embeddings()
        lm_head: nn.Module | None = model.get_output_embeddings()
        if lm_head is None:
            raise UnsupportedModelError(f"{name} has no LM head (get_output_embeddings() is None)")
        self.lm_head: nn.Module = lm_head
        self.final_norm: nn.Module | None = _first(inner, FINAL_NORMS)
        if self.final_norm is None and type(inner).__name__ != "OPTDecoder":
            raise UnsupportedModelError(f"cannot find the final norm of {name} (looked for {', '.join(FINAL_NORMS)})")
        self.position_embedding: nn.Module | None = _first(inner, POSITION_EMBEDDINGS)
        self.rotary: nn.Module | None = getattr(inner, "rotary_emb", None)
        if self.position_embedding is None and self.rotary is None:
            raise UnsupportedModelError(
                f"cannot find how {name} encodes positions (no learned position "
                f"embedding, no rotary_emb on {type(inner).__name__})"
            )
        self.embedding_dropout: nn.Module | None = _first(inner, EMBEDDING_DROPOUTS)
        self.project_in: nn.Module | None = getattr(inner, "project_in", None)
        self.project_out: nn.Module | None = getattr(inner, "project_out", None)

        config = self.config
        self.n_layer = len(blocks)
        self.width = int(config.hidden_size)
        self.n_head = int(config.num_attention_heads)
        self.n_kv_head = int(getattr(config, "num_key_value_heads", None) or self.n_head)
        self.head_dim = int(getattr(config, "head_dim", None) or self.width // self.n_head)
        self.max_positions = int(getattr(config, "max_position_embeddings", 0) or 1024)
        self.vocab_size = int(self._embedding_weight.shape[0])
        self.logit_softcap: float | None = getattr(config, "final_logit_softcapping", None)
        self.layer_kinds = self._layer_kinds()

        parameters = inspect.signature(blocks[0].forward).parameters
        # transformers 5.24 renamed the blocks' `past_key_values` to `cache`; older GPT-2 blocks say `layer_past`.
        cache_argument = next(
            (argument for argument in CACHE_ARGUMENTS if argument in parameters),
            None,
        )
        self._takes = {
            argument: argument in parameters for argument in ("position_embeddings", "position_ids", "use_cache")
        }
        if cache_argument is None:
            raise UnsupportedModelError(
                f"the blocks of {name} ({type(blocks[0]).__name__}) take no cache argument "
                f"chatcore knows ({', '.join(CACHE_ARGUMENTS)})"
            )
        self._cache_argument: str = cache_argument

    def __repr__(self) -> str:
        return (
            f"Anatomy({type(self.model).__name__}: {self.n_layer} blocks, width {self.width}, "
            f"{self.n_head} heads / {self.n_kv_head} key-value heads of {self.head_dim}, "
            f"{'rotary' if self.rotary is not None else 'learned'} positions up to {self.max_positions})"
        )

    def _layer_kinds(self) -> tuple[str, ...]:
        """Each block's attention kind, as the model's own forward picks its mask."""
        kinds = getattr(self.config, "layer_types", None)
        if kinds:
            return tuple(kinds[: self.n_layer])
        if getattr(self.config, "sliding_window", None) is not None and self.rotary is not None:
            return (SLIDING_ATTENTION,) * self.n_layer  # Mistral, Phi-3: one window for every layer
        return (FULL_ATTENTION,) * self.n_layer

    # -- parts of a block ---------------------------------------------------------------
    def block(self, layer: int) -> "nn.Module":
        if not -self.n_layer <= layer < self.n_layer:
            raise ChatcoreError(f"layer {layer} is outside the {self.n_layer} blocks of {type(self.model).__name__}")
        return self.blocks[layer]

    def attention(self, layer: int) -> AttentionParts:
        block = self.block(layer)
        module = _first(block, ATTENTIONS)
        if module is None:
            raise UnsupportedModelError(
                f"cannot find the attention of {type(block).__name__} (looked for {', '.join(ATTENTIONS)})"
            )
        output = _first(module, OUTPUT_PROJECTIONS)
        if output is None:
            raise UnsupportedModelError(f"cannot find the output projection of {type(module).__name__}")
        return AttentionParts(
            module,
            _first(module, QUERY_PROJECTIONS),
            _first(module, KEY_PROJECTIONS),
            _first(module, VALUE_PROJECTIONS),
            _first(module, FUSED_PROJECTIONS),
            output,
        )

    def mlp(self, layer: int) -> "nn.Module":
        """The block's MLP (OPT has none of its own: its fc1/fc2 sit on the block, which is returned)."""
        block = self.block(layer)
        return _first(block, MLPS) or block

    # -- running the model in pieces --------------------------------------------------------
    @property
    def _embedding_weight(self) -> "torch.Tensor":
        """The token embedding's (V, C) matrix (torch types a module's attributes as tensor or module)."""
        return cast("torch.Tensor", self.token_embedding.weight)

    @property
    def dtype(self) -> "torch.dtype":
        return self._embedding_weight.dtype

    @property
    def device(self) -> "torch.device":
        return self._embedding_weight.device

    def new_cache(self) -> Any:
        """An empty cache of the kind the model's own forward makes."""
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def embed(
        self,
        position_ids: "torch.Tensor",
        input_ids: "torch.Tensor | None" = None,
        inputs_embeds: "torch.Tensor | None" = None,
    ) -> "torch.Tensor":
        """The residual stream before block 0: (B, T, C).

        Token embeddings (as ``get_input_embeddings()`` gives them: Gemma's are scaled), or
        the given ``inputs_embeds`` taken as they are, as the model's ``forward`` takes them;
        plus learned position embeddings where the model has them.
        """
        if inputs_embeds is None:
            assert input_ids is not None, "give input_ids or inputs_embeds"
            inputs_embeds = self.token_embedding(input_ids)
        if self.project_in is not None:
            inputs_embeds = self.project_in(inputs_embeds)
        hidden = inputs_embeds
        if self.position_embedding is not None:
            if type(self.position_embedding).__name__ == "OPTLearnedPositionalEmbedding":
                positions = self.position_embedding(None, 0, position_ids=position_ids)
            else:
                positions = self.position_embedding(position_ids)
            hidden = hidden + positions.to(hidden.dtype)
        if self.embedding_dropout is not None:
            hidden = self.embedding_dropout(hidden)
        return hidden

    def soft_embed(self, probabilities: "torch.Tensor") -> "torch.Tensor":
        """The expected token embedding (..., C) under a distribution over tokens (..., V),
        scaled as the token embedding scales a token's (Gemma: by sqrt(width)); feed it to
        :meth:`embed` as ``inputs_embeds``. Differentiable: soft tokens for training."""
        weight = self._embedding_weight  # (V, C)
        scale = getattr(self.token_embedding, "embed_scale", None)
        embedded = probabilities.to(weight.dtype) @ weight
        return embedded * scale.to(weight.dtype) if scale is not None else embedded

    def block_inputs(
        self,
        hidden: "torch.Tensor",
        position_ids: "torch.Tensor",
        attention_mask: "torch.Tensor | None" = None,
        cache: Any = None,
    ) -> BlockInputs:
        """Masks and rotary embeddings for one pass over T new positions.

        hidden:         (B, T, C) the new positions' residual stream (for its shape, dtype, device).
        position_ids:   (B, T).
        attention_mask: (B, P + T) 1 for real tokens, 0 for left padding; None for none.
        cache:          the cache holding the P earlier positions, or None.

        Call it before any block of the pass runs: the masks are sized from what the
        cache holds, and the first block extends it.
        """
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        arguments = {
            "config": self.config,
            "inputs_embeds": hidden,
            "attention_mask": attention_mask,
            cache_keyword(create_causal_mask): cache,
            "position_ids": position_ids,
        }
        builders = {FULL_ATTENTION: create_causal_mask, SLIDING_ATTENTION: create_sliding_window_causal_mask}
        masks = {}
        for kind in set(self.layer_kinds):
            if kind not in builders:
                raise UnsupportedModelError(
                    f"{type(self.model).__name__} has layers of kind {kind!r}, which chatcore cannot mask"
                )
            masks[kind] = builders[kind](**arguments)
        rotary = self.rotary(hidden, position_ids) if self.rotary is not None else None
        return BlockInputs(masks, position_ids, rotary, cache)

    def run_block(self, layer: int, hidden: "torch.Tensor", inputs: BlockInputs) -> "torch.Tensor":
        """Block ``layer`` on (B, T, C) -> (B, T, C), reading and extending ``inputs.cache``."""
        arguments: dict[str, Any] = {
            "attention_mask": inputs.masks[self.layer_kinds[layer]],
            self._cache_argument: inputs.cache,
        }
        if self._takes["use_cache"]:
            arguments["use_cache"] = inputs.cache is not None
        if self._takes["position_ids"]:
            arguments["position_ids"] = inputs.position_ids
        if self._takes["position_embeddings"] and inputs.position_embeddings is not None:
            arguments["position_embeddings"] = inputs.position_embeddings
        output = self.blocks[layer](hidden, **arguments)
        return output[0] if isinstance(output, tuple) else output

    def run_blocks(
        self, hidden: "torch.Tensor", layers: range, inputs: BlockInputs, collect: "list[torch.Tensor] | None" = None
    ) -> "torch.Tensor":
        """Blocks ``layers`` in order; each block's output is appended to ``collect`` if given."""
        for layer in layers:
            hidden = self.run_block(layer, hidden, inputs)
            if collect is not None:
                collect.append(hidden)
        return hidden

    def final(self, hidden: "torch.Tensor") -> "torch.Tensor":
        """The final norm (and OPT's output projection): last block's output -> the head's input."""
        if self.final_norm is not None:
            hidden = self.final_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden

    def logits(self, hidden: "torch.Tensor") -> "torch.Tensor":
        """(..., C) final hidden states -> (..., V) logits, soft-capped where the model caps them."""
        import torch

        logits = self.lm_head(hidden)
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    # -- hook points --------------------------------------------------------------------------
    @contextlib.contextmanager
    def residual_hook(self, layer: int, edit: "Callable[[torch.Tensor], torch.Tensor | None]") -> Iterator[None]:
        """Call ``edit`` on the residual stream (B, T, C) after block ``layer`` in every forward
        pass while the context is open; a tensor it returns replaces the stream, None keeps it."""

        def hook(module: Any, args: Any, output: Any) -> Any:
            hidden = output[0] if isinstance(output, tuple) else output
            edited = edit(hidden)
            if edited is None:
                return None
            return (edited, *output[1:]) if isinstance(output, tuple) else edited

        handle = self.block(layer).register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    @contextlib.contextmanager
    def add_to_residual(self, layer: int, vector: "torch.Tensor", positions: slice = slice(None)) -> Iterator[None]:
        """Add ``vector`` (C,) or (B, 1, C) to the residual stream after block ``layer`` at
        ``positions`` of each pass (all by default; ``slice(-1, None)`` for the newest)."""

        def add(hidden: "torch.Tensor") -> "torch.Tensor":
            edited = hidden.clone()
            edited[:, positions] += vector.to(hidden.dtype)
            return edited

        with self.residual_hook(layer, add):
            yield

    @contextlib.contextmanager
    def read_residual(self, layers: "list[int] | range") -> Iterator[dict[int, list["torch.Tensor"]]]:
        """Record the residual stream (B, T, C) after each block in ``layers``: the dict it
        yields gets one tensor per forward pass, per layer, in order."""
        seen: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
        with contextlib.ExitStack() as stack:
            for layer in seen:
                stack.enter_context(self.residual_hook(layer, seen[layer].append))
            yield seen

    @contextlib.contextmanager
    def head_hook(self, layer: int, edit: "Callable[[torch.Tensor], torch.Tensor | None]") -> Iterator[None]:
        """Call ``edit`` on the per-head attention outputs (B, T, H, D) of block ``layer``, before
        the output projection mixes them, in every pass while the context is open; a tensor it
        returns (same shape) replaces them, None keeps them."""

        def hook(module: Any, args: tuple[Any, ...]) -> Any:
            heads = args[0]
            B, T, _ = heads.shape
            edited = edit(heads.view(B, T, self.n_head, self.head_dim))
            if edited is None:
                return None
            return (edited.reshape(B, T, self.n_head * self.head_dim), *args[1:])

        handle = self.attention(layer).output.register_forward_pre_hook(hook)
        try:
            yield
        finally:
            handle.remove()


_anatomies: "weakref.WeakKeyDictionary[Any, Anatomy]" = weakref.WeakKeyDictionary()


def anatomy_of(model: Any) -> Anatomy:
    """The :class:`Anatomy` of a Hugging Face causal LM (read once per model object).

    Raises :class:`UnsupportedModelError`, naming the model's class, when a part is missing
    or ``model`` is no torch module (a :class:`~chatcore.models.LoadedModel`'s is its ``.model``).
    """
    from torch import nn

    if not isinstance(model, nn.Module):
        inner = getattr(model, "model", None)
        hint = ": pass its .model" if isinstance(inner, nn.Module) else ""
        raise UnsupportedModelError(
            f"anatomy_of takes a Hugging Face causal LM (a torch.nn.Module), got {shown_argument(model)}{hint}"
        )
    found = _anatomies.get(model)
    if found is None:
        found = _anatomies[model] = Anatomy(model)
    return found
