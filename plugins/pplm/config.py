"""The numbers that shape a PPLM perturbation (validated; torch only for type hints)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field

from chatcore.api import Settings

if TYPE_CHECKING:
    from torch import Tensor

# The default step (stepsize unset), in nats: each perturbed layer's gradient step is sized to
# lower the attribute loss by this much to first order (PerturbConfig.layer_scales). 0.52 is
# chatcore-tiny's measured step of 1.0 per layer at its typical gradient norm (0.27: 1.0 *
# 0.27 ** 0.5); SmolLM2-135M's gradients are ~5x larger, and the same 0.52 nats per layer
# gives it a step of ~0.46 (docs/pplm.md, "Across models").
LAYER_NATS = 0.52


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
    steering); unset: scaled to the model, each layer's step lowering the attribute loss by
    0.52 nats to first order."""
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

    def layer_scales(self, norms: "Tensor") -> "Tensor":
        """The factors of the gradient step ``delta -= factor * w * g`` from ``norms``, the
        largest norm of ``w * g`` seen so far per row and layer (any shape).

        A given ``stepsize`` is the paper's ``stepsize / n ** gamma`` on every layer. Unset, the
        step is scaled to the model through its gradient: ``LAYER_NATS / n ** 2``, the step
        along ``g`` that lowers the attribute loss by ``LAYER_NATS`` nats to first order
        (``g . delta = LAYER_NATS * |g| ** 2 / n ** 2``, at most ``LAYER_NATS``). A bigger model's
        larger gradients (SmolLM2-135M's are ~5x chatcore-tiny's) then get a smaller step
        without a constant tuned per model; the paper's fixed ``stepsize`` with ``n ** 1.5``
        barely moves a 14M model or tears a 135M one apart (docs/pplm.md, "Across models").
        """
        if self.stepsize is not None:
            return self.stepsize / norms.pow(self.gamma)
        return LAYER_NATS / norms.pow(2)

    def optimises(self, step: int) -> bool:
        """Whether the perturbation is optimised at decoding step ``step`` (0 = first reply token)."""
        return (
            self.num_iterations > 0 and self.stepsize != 0 and step < self.grad_length and step % self.steer_every == 0
        )
