"""The ``cocon`` steerer: content-conditioned replies through a trained CoCon block.

The steerer replaces the model's forward pass: each step runs LM-alpha, the CoCon
block (attending over the content's hidden states) and LM-beta, each with its own
cache (see chatcore.cocon). Because it *is* the model step, it must come first in the
steerer order (innermost): every steerer after it wraps its step as it would wrap
the model's, so logit steerers (bow-bias) and decoders compose with it unchanged.
``prepare`` refuses any other position with a clear error.

Also adds ``chatcore train cocon`` (:mod:`chatcore.plugins.cocon.commands`) to the
``train`` command group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field, StringConstraints, field_validator, model_validator

import chatcore
from chatcore.api import (
    ChatcoreError,
    OnThisMachine,
    OptionError,
    Settings,
    Steerer,
    Step,
    StepOutput,
    StepState,
    encode_text,
)

if TYPE_CHECKING:
    from chatcore.api import GenerationSession, LoadedModel

    from .pipeline import CoconPipeline, ContentMemory

TAU_LIMIT = 50.0


class SteererOrderError(ChatcoreError):
    """``cocon`` was not given first among the steerers."""


class CoconSettings(Settings):
    """The ``cocon`` steerer's settings."""

    content: tuple[str, ...] = ()
    """One or more content texts (comma list). Empty: the block without content, which stays
    close to the plain model."""
    tau: tuple[Annotated[float, Field(ge=-TAU_LIMIT, le=TAU_LIMIT)], ...] = ()
    """The content bias: one value for every content, or one per content; none given: the
    block's own default (`default_tau` in its cocon_config.json, 0 if it has none)."""
    block: Annotated[
        Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)] | None, OnThisMachine("block folder")
    ] = None
    """A bundled block name or a block folder; default: the bundled block trained for the
    loaded model."""
    leading_space: bool = True
    """Encode each content as it reads inside a sentence (" pizza"), the form a reply would
    contain it in."""

    @field_validator("content")
    @classmethod
    def _drop_blank(cls, content: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(text.strip() for text in content if text.strip())

    @model_validator(mode="after")
    def _tau_per_content(self) -> CoconSettings:
        if len(self.tau) > 1 and len(self.tau) != len(self.content):
            raise ValueError(f"`tau` must give one value or one per content ({len(self.content)}), got {len(self.tau)}")
        return self

    def taus(self, default: float = 0.0) -> list[float]:
        """One tau per content; ``default`` (the block's) when none was given."""
        values = self.tau or (default,)
        return list(values) * len(self.content) if len(values) == 1 else list(values)


def block_default_tau(info: dict[str, Any]) -> float:
    """The tau a block's config recommends (``default_tau``; 0, the paper's, if none).

    How much bias a block needs to carry a content depends on how well it was trained,
    so the value belongs to the block: its trainer measures it and writes it down.
    """
    value = info.get("default_tau", 0.0)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or abs(value) > TAU_LIMIT
    ):
        raise ChatcoreError(
            f"the CoCon block's default_tau must be a number between -{TAU_LIMIT:g} and {TAU_LIMIT:g}, got {value!r}"
        )
    return float(value)


class CoconSteerer(Steerer):
    runs_beside = True  # runs the model's blocks itself, on a cache of its own
    name = "cocon"
    description = (
        "steers replies towards content texts with a trained CoCon block (`content`, `tau`); "
        "replaces the model step, so it must come first among the steerers"
    )
    Settings = CoconSettings
    replaces_model = True

    @classmethod
    def setting_choices(cls, name: str) -> list[str]:
        if name == "block":
            from .store import bundled_blocks

            return [path.name for path in bundled_blocks()]
        return super().setting_choices(name)

    def __init__(self, settings: CoconSettings | None = None) -> None:
        super().__init__(settings)
        self.pipeline: "CoconPipeline | None" = None
        self.content: "ContentMemory | None" = None

    @classmethod
    def setup(cls, model: "LoadedModel", settings: CoconSettings) -> tuple[Any, Any, dict[str, Any]]:
        """The block (its folder, the loaded block, its info), found and checked against the
        model once per engine: a model no block fits is refused when cocon is chosen."""
        from .store import check_compatible, load_block, model_fingerprint, resolve_block

        fingerprint = model_fingerprint(model.model, model.tokenizer)
        folder = resolve_block(settings.block, fingerprint, model.name)
        block, info = load_block(folder, device=model.device, dtype=model.dtype)
        check_compatible(info, fingerprint, settings.block or folder.name, model.name)
        return folder, block, info

    def prepare(self, session: "GenerationSession") -> None:
        import torch

        from .model_split import SplitModel
        from .pipeline import CoconPipeline

        steerers = list(session.steerers)
        if not steerers or steerers[0] is not self:
            order = ", ".join(s.name for s in steerers) or "none"
            raise SteererOrderError(
                f"steerer 'cocon' must come first in the steerer order, since it replaces the model's forward "
                f"pass and the others wrap it (got: {order})"
            )
        loaded = session.model
        folder, block, info = self.shared if self.shared is not None else self.setup(loaded, self.settings)
        self.pipeline = CoconPipeline(SplitModel(loaded.model, block.config.split_layer), block)
        texts = [(" " + text) if self.settings.leading_space else text for text in self.settings.content]
        contents = [encode_text(loaded.tokenizer, text) for text in texts]
        for text, ids in zip(self.settings.content, contents):
            # Each content is encoded from position 0, so it must fit the model's positions.
            if len(ids) > loaded.max_positions:
                raise OptionError(
                    f"`content` {text[:40]!r}... is {len(ids)} tokens long; model {loaded.name!r} "
                    f"takes at most {loaded.max_positions}: give a shorter content"
                )
        taus = self.settings.taus(block_default_tau(info))
        with torch.inference_mode():
            self.content = self.pipeline.encode_content(contents, taus)
        self.note(
            session,
            {
                "block": str(folder),
                "split_layer": block.config.split_layer,
                "content_tokens": [len(ids) for ids in contents],
                "tau": taus,
            },
        )

    def wrap(self, step: Step) -> Step:
        # ``step`` is the model's own step (prepare() made sure cocon is innermost); the
        # CoCon pipeline runs the same model, split in two, in its place.
        from .pipeline import CoconCache

        pipeline, content = self.pipeline, self.content
        if pipeline is None:
            raise ChatcoreError("steerer 'cocon': prepare() was not called before wrap()")

        def cocon_step(state: StepState) -> StepOutput:
            if state.cache is not None and not isinstance(state.cache, CoconCache):
                raise SteererOrderError(
                    "steerer 'cocon' received a cache it did not make: it must come first in the steerer order"
                )
            output = pipeline.forward(
                key_valid=state.attention_mask,
                position_ids=state.position_ids,
                prompt_length=state.prompt_length,
                content=content,
                input_ids=state.input_ids,
                cache=state.cache,
                output_hidden_states=state.output_hidden_states,
            )
            return StepOutput(logits=output.logits, cache=output.cache, hidden_states=output.hidden_states)

        return cocon_step


@chatcore.hookimpl(trylast=True)
def register_steerers(register: Callable[[type], None]) -> None:
    register(CoconSteerer)


@chatcore.hookimpl(trylast=True)
def register_commands(cli: Any) -> None:
    from chatcore.api import train_group

    from .commands import cocon_command

    train_group(cli).add_command(cocon_command)
