"""A decoding batch that replies join and leave between steps (continuous batching).

Each row is one reply with its own decoder (score processors and ``select``), seeded
generator, steerers, stop tokens and budget. A row joins after its prompt has been run
on its own (the prefill: the same forward pass, through the same steerers, as when the
reply is decoded alone), and its key/value cache is merged into the batch's:

    columns:  [ left padding | row's cached tokens ]      (B, H, T, D) per layer

Every row's cached tokens stay right-aligned, since each step appends one column to
every row; the attention mask hides the padding, and each row's positions count its
own tokens. A row that ends (a stop token, its budget, an error, a cancel) is dropped
from the cache at once, and columns that have become padding for every row are cut.

Then, per step: one forward pass for every row; each row's logits go through its own
steerers (only those that declare ``shares_batch``), the banned and early-stop masks,
its processors (with its own unpadded history) and its ``select`` with its own
generator: the same calls, on the same (1, V) scores, as decoding the reply alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chatcore.decoding import TokenDecoder, restrict_scores
from chatcore.errors import ChatcoreError
from chatcore.models import cache_keyword, output_cache
from chatcore.processors import chain
from chatcore.serving.prefix_cache import Layers, cache_from_layers
from chatcore.steering import compose
from chatcore.step import StepOutput, StepState, model_step

if TYPE_CHECKING:
    import torch

    from chatcore.decoding import GenerationSession
    from chatcore.engine import Engine, PreparedReply
    from chatcore.serving.requests import Handle


def batchable(reply: "PreparedReply") -> bool:
    """Whether ``reply`` can share a batch: a token decoder using the shared loop, and
    only steerers that declare ``shares_batch``."""
    decoder = reply.decoder
    return (
        isinstance(decoder, TokenDecoder)
        and type(decoder).decode is TokenDecoder.decode
        and all(type(s).shares_batch for s in reply.steerers)
    )


def mergeable_cache(cache: Any) -> bool:
    """Whether rows' caches can be padded and stacked: every layer a plain growing
    key/value cache (no sliding window, no recurrent state)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    return isinstance(cache, DynamicCache) and all(type(layer) is DynamicLayer for layer in cache.layers)


@dataclass
class BatchRow:
    """One reply in the batch. ``tokens`` is its own history: prompt, then generated tokens."""

    handle: "Handle"
    reply: "PreparedReply"
    session: "GenerationSession"
    tokens: list[int]
    prompt_length: int
    step: Callable[[StepState], StepOutput] = field(repr=False)
    shared_output: StepOutput | None = None
    generated: int = 0
    cached: int = 0  # tokens of this row in the cache: all but the last chosen one while it runs
    stops: "torch.Tensor | None" = None
    banned: "torch.Tensor | None" = None


class DecodingBatch:
    """The rows being decoded together and their merged key/value cache."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self.model = engine.loaded.model
        self.cache_argument = cache_keyword(self.model)  # what the model's forward calls its cache
        self.device = engine.loaded.device
        self.rows: list[BatchRow] = []
        self.cache: Any = None
        self.width = 0  # columns of the cache

    def __len__(self) -> int:
        return len(self.rows)

    # -- joining -----------------------------------------------------------------------
    def start_row(
        self,
        handle: "Handle",
        reply: "PreparedReply",
        session: "GenerationSession",
        prefix: "tuple[int, Layers | None]" = (0, None),
    ) -> tuple[BatchRow, Any]:
        """Run the row's prompt alone (through all its steerers) and choose its first token.

        ``prefix``: the key/values of the prompt's first tokens (from the prefix cache), so
        that only the rest is run. Returns the row and its cache; the caller pushes the
        token and joins the row unless it already ended.
        """
        import torch

        prompt = reply.plan.token_ids
        reused, layers = prefix
        model = model_step(self.model)

        def inner(state: StepState) -> StepOutput:
            # The prefill runs the model; later steps hand back this row's share of the batch's pass.
            return model(state) if row.shared_output is None else row.shared_output

        row = BatchRow(
            handle=handle,
            reply=reply,
            session=session,
            tokens=list(prompt),
            prompt_length=len(prompt),
            step=compose(inner, reply.steerers),
        )
        row.stops = torch.tensor(sorted(session.stop_ids), dtype=torch.long, device=self.device)
        row.banned = torch.tensor(sorted(session.banned_token_ids), dtype=torch.long, device=self.device)
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        cache = cache_from_layers(layers, self.model.config) if layers is not None else None
        state = StepState(
            input_ids=ids[:, reused:],
            sequences=ids,
            attention_mask=torch.ones_like(ids),
            position_ids=torch.arange(reused, len(prompt), device=self.device)[None],
            cache=cache,
            step=0,
            prompt_length=len(prompt),
        )
        with torch.inference_mode():
            output = row.step(state)
        row.cached = len(prompt)
        row.tokens.append(self.choose(row, output.logits))
        return row, output.cache

    def run_chunk(self, prompt: list[int], done: int, cache: Any, size: int) -> Any:
        """Run ``prompt[done:done + size]`` after the ``done`` tokens held in ``cache`` (None for
        none), alone and without steerers (its scores are not used); returns the grown cache."""
        import torch

        ids = torch.tensor([prompt[: done + size]], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            output = self.model(
                input_ids=ids[:, done:],
                attention_mask=torch.ones_like(ids),
                position_ids=torch.arange(done, done + size, device=self.device)[None],
                **{self.cache_argument: cache},
                use_cache=True,
                logits_to_keep=1,
            )
        return output_cache(output)

    def layers_of(self, row: BatchRow) -> "Layers":
        """The key/values of every token ``row`` has fed the model: (1, H, cached, D) per layer."""
        index = self.rows.index(row)
        start = self.width - row.cached
        return [
            (layer.keys[index : index + 1, :, start:], layer.values[index : index + 1, :, start:])
            for layer in self.cache.layers
        ]

    def join(self, row: BatchRow, cache: Any) -> None:
        """Add a started row and its cache (of its ``cached`` columns) to the batch."""
        import torch
        import torch.nn.functional as F

        if self.cache is None:
            self.cache, self.width = cache, row.cached
            self.rows.append(row)
            return
        width = max(self.width, row.cached)
        for mine, theirs in zip(self.cache.layers, cache.layers):
            for name in ("keys", "values"):
                old, new = getattr(mine, name), getattr(theirs, name)  # (B, H, T, D)
                old = F.pad(old, (0, 0, width - old.shape[2], 0))
                new = F.pad(new, (0, 0, width - new.shape[2], 0))
                setattr(mine, name, torch.cat([old, new], dim=0))
        self.width = width
        self.rows.append(row)

    def drop(self, rows: Sequence[BatchRow]) -> None:
        """Remove ``rows`` from the batch and cut the columns no remaining row uses."""
        import torch

        if not rows:
            return
        keep = [i for i, row in enumerate(self.rows) if row not in rows]
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache, self.width = None, 0
            return
        width = max(row.cached for row in self.rows)
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, self.width - width :]
            layer.values = layer.values[index, :, self.width - width :]
        self.width = width

    # -- one step ----------------------------------------------------------------------
    def forward(self) -> "torch.Tensor":
        """One forward pass for every row's last chosen token: (B, V) logits."""
        import torch

        last = torch.tensor([[row.tokens[-1]] for row in self.rows], dtype=torch.long, device=self.device)
        attention = torch.zeros((len(self.rows), self.width + 1), dtype=torch.long, device=self.device)
        for index, row in enumerate(self.rows):
            attention[index, self.width - row.cached :] = 1
        positions = torch.tensor([[row.cached] for row in self.rows], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            output = self.model(
                input_ids=last,
                attention_mask=attention,
                position_ids=positions,
                **{self.cache_argument: self.cache},
                use_cache=True,
                logits_to_keep=1,
            )
        self.cache = output_cache(output)
        self.width += 1
        for row in self.rows:
            row.cached += 1
        return output.logits[:, -1, :].float()

    def steer(self, row: BatchRow, logits: "torch.Tensor") -> "torch.Tensor":
        """The row's steerers on its (1, V) share of the batch's logits."""
        import torch

        if not row.reply.steerers:
            return logits
        ids = torch.tensor([row.tokens], dtype=torch.long, device=self.device)
        state = StepState(
            input_ids=ids[:, -1:],
            sequences=ids,
            attention_mask=torch.ones_like(ids),
            position_ids=torch.tensor([[row.cached - 1]], device=self.device),
            cache=None,
            step=row.generated,
            prompt_length=row.prompt_length,
        )
        row.shared_output = StepOutput(logits=logits, cache=None)
        with torch.inference_mode():
            return row.step(state).logits

    def choose(self, row: BatchRow, logits: "torch.Tensor") -> int:
        """The row's next token from its (1, V) steered logits: masks, processors, select."""
        import torch

        session = row.session
        decoder = row.reply.decoder
        assert isinstance(decoder, TokenDecoder)
        assert row.banned is not None and row.stops is not None, "the row was not started"
        with torch.inference_mode():
            scores = restrict_scores(logits, row.banned, row.stops, early=row.generated < session.min_new_tokens)
            history = torch.tensor([row.tokens], dtype=torch.long, device=self.device)
            scores = chain(decoder.processors())(history, scores)
            return int(decoder.select(scores, session.generator)[0])


def blame(engine: "Engine", reply: "PreparedReply", error: Exception) -> ChatcoreError:
    """A reply's failure as a one-line error naming the model, steerer or decoder at fault."""
    if isinstance(error, ChatcoreError):
        return error
    return engine.blame(error, reply.decoder)
