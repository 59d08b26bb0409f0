"""The numbers that shape a PPLM perturbation (validated; no torch here)."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import Field

from chatcore.api import Settings

# The default step (``stepsize`` unset) on each perturbed layer, as a share of the size of one
# position's keys and values in that layer's past, for a model with one perturbed layer; with
# L perturbed layers each takes RELATIVE_STEP / sqrt(L) (PerturbConfig.relative_step). 0.081
# is what chatcore-tiny's measured default (a fixed step of 1.0 on each of its top 3 layers)
# made its first steps on average (0.047 of the past per layer, times sqrt(3)).
RELATIVE_STEP = 0.081


def _between(low: float, high: float) -> Any:
    return Field(ge=low, le=high)


class PerturbConfig(Settings):
    """PPLM's knobs (Dathathri et al., 2020), named as in the paper's code."""

    # Defaults measured on the bundled chatcore-tiny (docs/measurements.md): the paper's
    # stepsize (0.02, for GPT-2 medium) barely moves a model this small (the default step,
    # 1.0 on each of its 3 perturbed layers, scales with the depth); a strong KL term with a
    # large step keeps the perturbed distribution close to the plain one except where the
    # attribute pulls, and a perturbation carried over the reply costs more perplexity for
    # the same topic share.
    stepsize: Annotated[float, _between(0.0, 10.0)] | None = None
    """Size of each normalised gradient step on the past of each perturbed layer (0 = no
    steering); unset: sized by each layer's past, the same share of it on every model
    (``relative_step``)."""
    num_iterations: Annotated[int, _between(0, 100)] = 3
    """Gradient steps per token."""
    window_length: Annotated[int, _between(0, 1_000_000)] = 0
    """Perturb only the most recent this-many positions of the past (0 = all)."""
    decay: bool = False
    """Within the window, scale updates from 1/window (oldest) up to 1 (newest)."""
    gamma: Annotated[float, _between(0.0, 10.0)] = 1.5
    """Gradient normalisation exponent: step = stepsize * g / |g| ** gamma."""
    kl_scale: Annotated[float, _between(0.0, 1000.0)] = 2.0
    """Weight of KL(perturbed || unperturbed) next-token distributions."""
    gm_scale: Annotated[float, _between(0.0, 1.0)] = 0.75
    """Fusion: log p = gm * log p_perturbed + (1 - gm) * log p_unperturbed."""
    grad_length: Annotated[int, _between(0, 1_000_000)] = 10000
    """Optimise only the first this-many reply tokens (the steered past still shapes later ones)."""
    horizon_length: Annotated[int, _between(0, 16)] = 1
    """Discriminator only: soft future tokens fed through the model so the head sees where
    the text is going."""
    steer_every: Annotated[int, _between(1, 1_000_000)] = 1
    """Optimise only every k-th token (latency knob; 1 = every token)."""
    carry: bool = False
    """Keep each token's perturbation in a perturbed past that the next token starts from (the
    paper's behaviour); false: perturb the plain past afresh at every token."""
    # Half the layers: on chatcore-tiny the same topic share as all six at lower
    # perplexity, and each iteration runs half the model (docs/measurements.md, "Layers").
    layer_share: Annotated[float, Field(gt=0.0, le=1.0)] = 0.5
    """Perturb the past of only the top this-share of the model's layers (at least one; 1.0 =
    all, the paper's behaviour). Only the perturbed layers and the head run in each iteration."""

    def first_perturbed_layer(self, layers: int) -> int:
        """Index of the lowest layer whose past is perturbed, in a model of ``layers`` layers:
        the top ``layer_share`` of them, rounded, and at least the top one."""
        perturbed = min(layers, max(1, round(self.layer_share * layers)))
        return layers - perturbed

    def step_size(self, perturbed_layers: int) -> float:
        """The fixed step of each perturbed layer when ``stepsize`` is set (the paper's rule:
        step = stepsize * g / n ** gamma); unset, steps are relative (``relative_step``)."""
        return self.stepsize if self.stepsize is not None else self.relative_step(perturbed_layers)

    def relative_step(self, perturbed_layers: int) -> float:
        """With ``stepsize`` unset, the size of each layer's step as a share of that layer's past:
        ``RELATIVE_STEP / sqrt(perturbed_layers)`` times the root-mean-square norm of one
        position's keys and values there (the gradient's direction; smaller as the gradient
        falls below its largest norm so far).

        A fixed step (``stepsize``) moves models of other widths and depths by different
        amounts: the same 1.0 per layer that steers chatcore-tiny is about fourteen times
        smaller, relative to its keys and values, on SmolLM2-135M. Sizing each step by the
        past it perturbs carries the step across scales. Across depths the layers' steps are
        spread as 1/sqrt(layers), as steps in unrelated directions add up: on SmolLM2's 15
        perturbed layers a 1/layers spread (the same total as chatcore-tiny's) moved too little,
        and twice to four times that total steered it at little perplexity (docs/pplm.md,
        "Defaults and the model").
        """
        return RELATIVE_STEP / math.sqrt(max(1, perturbed_layers))

    def optimises(self, step: int) -> bool:
        """Whether the perturbation is optimised at decoding step ``step`` (0 = first reply token)."""
        return (
            self.num_iterations > 0 and self.stepsize != 0 and step < self.grad_length and step % self.steer_every == 0
        )
