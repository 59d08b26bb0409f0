"""The numbers that shape a PPLM perturbation (validated; no torch here)."""

from __future__ import annotations

from dataclasses import dataclass

# The default step, summed over the perturbed layers (PerturbConfig.step_size): chatcore-tiny's
# measured 1.0 per layer on its top 3 layers.
LAYER_STEPS = 3.0


@dataclass
class PerturbConfig:
    """PPLM's knobs (Dathathri et al., 2020), named as in the paper's code.

    stepsize:        size of each normalised gradient step on the past of each perturbed
                     layer (0 = no steering); unset: 3 / the number of perturbed layers
                     (see :meth:`step_size`).
    num_iterations:  gradient steps per token.
    window_length:   perturb only the most recent this-many positions of the past (0 = all).
    decay:           within the window, scale updates from 1/window (oldest) up to 1 (newest).
    gamma:           gradient normalisation exponent: step = stepsize * g / |g| ** gamma.
    kl_scale:        weight of KL(perturbed || unperturbed) next-token distributions.
    gm_scale:        fusion: log p = gm * log p_perturbed + (1 - gm) * log p_unperturbed.
    grad_length:     optimise only the first this-many reply tokens (the steered past
                     still shapes later ones).
    horizon_length:  discriminator only: soft future tokens fed through the model so the
                     head sees where the text is going.
    steer_every:     optimise only every k-th token (latency knob; 1 = every token).
    carry:           keep each token's perturbation in a perturbed past that the next
                     token starts from (the paper's behaviour); false: perturb the plain
                     past afresh at every token (steering stays local to each token).
    layer_share:     perturb the past of only the top this-share of the model's layers
                     (at least one; 1.0 = all, the paper's behaviour). The layers below
                     are then the same in every pass: each iteration runs, and
                     differentiates, only the perturbed layers and the output head.
    """

    # Defaults measured on the bundled chatcore-tiny (docs/pplm.md, "Measured"): the
    # paper's stepsize (0.02, for GPT-2 medium) barely moves a model this small (the
    # default step, 1.0 on each of its 3 perturbed layers, scales with the depth); a strong
    # KL term with a large step keeps the perturbed distribution close to the plain one
    # except where the attribute pulls, and a perturbation carried over the reply costs
    # more perplexity for the same topic share.
    stepsize: float | None = None
    num_iterations: int = 3
    window_length: int = 0
    decay: bool = False
    gamma: float = 1.5
    kl_scale: float = 2.0
    gm_scale: float = 0.75
    grad_length: int = 10000
    horizon_length: int = 1
    steer_every: int = 1
    carry: bool = False
    # Half the layers: on chatcore-tiny the same topic share as all six at lower
    # perplexity, and each iteration runs half the model (docs/pplm.md, "Layers").
    layer_share: float = 0.5

    def __post_init__(self) -> None:
        def integer(name: str, low: int, high: int) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"`{name}` must be an integer between {low} and {high}, got {value!r}")

        def number(name: str, low: float, high: float) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise ValueError(f"`{name}` must be a number between {low} and {high}, got {value!r}")

        if self.stepsize is not None:
            number("stepsize", 0.0, 10.0)
        integer("num_iterations", 0, 100)
        integer("window_length", 0, 1_000_000)
        if not isinstance(self.decay, bool):
            raise ValueError(f"`decay` must be true or false, got {self.decay!r}")
        number("gamma", 0.0, 10.0)
        number("kl_scale", 0.0, 1000.0)
        number("gm_scale", 0.0, 1.0)
        integer("grad_length", 0, 1_000_000)
        integer("horizon_length", 0, 16)
        integer("steer_every", 1, 1_000_000)
        if not isinstance(self.carry, bool):
            raise ValueError(f"`carry` must be true or false, got {self.carry!r}")
        number("layer_share", 0.0, 1.0)
        if self.layer_share == 0.0:
            raise ValueError("`layer_share` must be above 0 (1.0 perturbs every layer)")

    def first_perturbed_layer(self, layers: int) -> int:
        """Index of the lowest layer whose past is perturbed, in a model of ``layers`` layers:
        the top ``layer_share`` of them, rounded, and at least the top one."""
        perturbed = min(layers, max(1, round(self.layer_share * layers)))
        return layers - perturbed

    def step_size(self, perturbed_layers: int) -> float:
        """The step size for a perturbation of ``perturbed_layers`` layers: ``stepsize`` if set,
        else ``LAYER_STEPS / perturbed_layers``.

        Every perturbed layer takes its own normalised step, and their effects on the next
        token add up: a model with five times the perturbed layers moves five times as far
        for the same step per layer. On SmolLM2-135M (15 perturbed layers of 30) a step of
        1.0 per layer overshoots (the attribute loss and the KL term swing from one iteration
        to the next); a total of 3 spread over the layers makes its iterations go down as
        1.0 on each of chatcore-tiny's 3 perturbed layers does there (docs/pplm.md,
        "Across models").
        """
        if self.stepsize is not None:
            return self.stepsize
        return LAYER_STEPS / max(1, perturbed_layers)

    def optimises(self, step: int) -> bool:
        """Whether the perturbation is optimised at decoding step ``step`` (0 = first reply token)."""
        return (
            self.num_iterations > 0 and self.stepsize != 0 and step < self.grad_length and step % self.steer_every == 0
        )
