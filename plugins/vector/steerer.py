"""The ``vector`` steerer: adds a steering vector to the residual stream, scaled to the model.

``strength`` is the added vector's norm as a share of the residual stream's mean norm at its
layer (measured on the contrast texts when the vector is made, and stored with it), so one
strength means the same push on a 14M model whose residual is ~30 long and on a 135M one whose
residual is ~150 long.

The vector comes from a file (``path=``, made by ``chatcore train vector``) or from a
built-in contrast set read on the model when first used (``pairs=happy``, ``pairs=food``).
It is added after block ``layer`` at every position the reply's passes feed (the prompt,
then each new token), so every later block reads the steered stream.

It is a step steerer, not a score steerer: the edit happens inside the model's forward pass,
so its replies decode beside the shared batch with a cache of their own. Sharing the batch
would need the shared pass to add a different vector to each reply's rows, and the prefix
cache would then hold steered keys and values under plain token ids and hand them to
unsteered replies; a reply of its own keeps both exact. Its rows (a decoder's candidates)
still run together, one pass per step.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field, model_validator

from chatcore.api import OnThisMachine, OptionError, Settings, Steerer, Step, StepOutput, StepState, anatomy_of

from .vectors import (
    BUILTIN_PAIRS,
    build_vector,
    builtin_pair_files,
    check_layer,
    check_model,
    load_vector,
    read_texts,
    residual_norm,
)

if TYPE_CHECKING:
    import torch

    from chatcore.api import GenerationSession, LoadedModel

MAX_STRENGTH = 4.0
# Measured on SmolLM2-135M-Instruct on held-out openers (docs/measurements.md, "The vector
# steerer scaled to the model"): from about 0.4 of the residual norm its replies break down.
DEFAULT_STRENGTH = 0.15


class VectorSettings(Settings):
    path: Annotated[str | None, OnThisMachine("vector file")] = None
    """A vector from `chatcore train vector` (NAME, NAME.safetensors or NAME.json)."""
    pairs: str | None = None
    """A built-in contrast set, read on the model when first used: happy (happy - sad), food
    (food - plain), sports (sports - plain)."""
    strength: Annotated[float, Field(ge=-MAX_STRENGTH, le=MAX_STRENGTH)] = DEFAULT_STRENGTH
    """The added vector's norm as a share of the residual stream's mean norm at the layer
    (negative steers away)."""
    layer: Annotated[int, Field(ge=0, le=1023)] | None = None
    """The block after which the vector is added (default: the layer it was read at)."""

    @model_validator(mode="after")
    def _one_source(self) -> VectorSettings:
        if (self.path is None) == (self.pairs is None):
            raise ValueError(
                f"vector needs one source: `path=FILE` (chatcore train vector) or `pairs=NAME` "
                f"({', '.join(sorted(BUILTIN_PAIRS))})"
            )
        if self.pairs is not None and self.pairs not in BUILTIN_PAIRS:
            raise ValueError(f"`pairs` must be one of {', '.join(sorted(BUILTIN_PAIRS))}, got {self.pairs!r}")
        return self


class Prepared:
    """What :meth:`VectorSteerer.setup` keeps per model and settings."""

    def __init__(self, layer: int, vector: "torch.Tensor", source: str, norm: float, residual_norm: float) -> None:
        self.layer = layer
        self.vector = vector  # (C,) on the model's device, in its dtype
        self.source = source
        self.norm = norm
        self.residual_norm = residual_norm

    def addition(self, strength: float) -> "torch.Tensor":
        """What is added to each position: the vector's direction, ``strength`` times the
        residual's mean norm long (zero for a vector of zero length)."""
        if self.norm <= 0.0:
            return self.vector * 0.0
        return self.vector * (strength * self.residual_norm / self.norm)


class VectorSteerer(Steerer):
    runs_beside = True  # its hook edits only the passes of the thread that runs its step
    name = "vector"
    description = (
        "adds a steering vector (contrast pairs' mean difference) to the residual stream, "
        "strength x the residual norm long"
    )
    Settings = VectorSettings

    @classmethod
    def setting_choices(cls, name: str) -> list[str]:
        return sorted(BUILTIN_PAIRS) if name == "pairs" else super().setting_choices(name)

    def __init__(self, settings: VectorSettings | None = None) -> None:
        super().__init__(settings)
        self.addition: "torch.Tensor | None" = None  # (C,) the vector scaled to strength x residual norm
        self.layer = 0
        self.model: Any = None

    @classmethod
    def setup(cls, model: "LoadedModel", settings: VectorSettings) -> Prepared:
        """Read the vector (refused in one line if it was made for another model) or build it from
        the built-in pairs; check the layer against the model."""
        n_layer = anatomy_of(model.model).n_layer
        if settings.layer is not None:  # before a built-in set's vector is made at that layer
            cls.check_layer(settings.layer, n_layer)
        if settings.path is not None:
            found = load_vector(settings.path)
            check_model(found, model, settings.path)
            source = settings.path
        else:
            assert settings.pairs is not None
            positive, negative = builtin_pair_files(settings.pairs)
            found = build_vector(
                model, read_texts(positive), read_texts(negative), settings.layer, (positive.name, negative.name)
            )
            source = f"pairs:{settings.pairs}"
        layer = found.info.layer if settings.layer is None else settings.layer
        cls.check_layer(layer, n_layer)
        measured = found.info.residual_norm
        if measured is None or layer != found.info.layer:
            measured = residual_norm(model, layer)
        vector = found.vector.to(model.device, model.dtype)
        return Prepared(layer, vector, source, found.info.norm, measured)

    @classmethod
    def check_layer(cls, layer: int, n_layer: int) -> None:
        """:func:`check_layer`, its error named with the steerer as the other setting errors are."""
        try:
            check_layer(layer, n_layer)
        except OptionError as error:
            raise OptionError(f"steerer {cls.name!r}: {error}") from None

    def prepare(self, session: "GenerationSession") -> None:
        prepared = self.shared if isinstance(self.shared, Prepared) else self.setup(session.model, self.settings)
        self.shared = prepared
        self.layer = prepared.layer
        self.model = session.model.model
        self.addition = prepared.addition(self.settings.strength)
        self.note(
            session,
            {
                "layer": prepared.layer,
                "strength": self.settings.strength,
                "source": prepared.source,
                "vector_norm": round(prepared.norm, 4),
                "residual_norm": round(prepared.residual_norm, 4),
            },
        )

    def wrap(self, step: Step) -> Step:
        if self.addition is None:
            from chatcore.api import OptionError

            raise OptionError("steerer 'vector' was used before prepare(session)")
        addition, layer, anatomy = self.addition, self.layer, anatomy_of(self.model)

        def steered(state: StepState) -> StepOutput:
            owner = threading.get_ident()

            def add(hidden: "torch.Tensor") -> "torch.Tensor | None":  # (B, T, C)
                # Only this step's passes: another thread may be decoding with the same model.
                return hidden + addition if threading.get_ident() == owner else None

            # The hook lives only while this step runs, so the model is never left steered,
            # even when the inner step raises.
            with anatomy.residual_hook(layer, add):
                return step(state)

        return steered
