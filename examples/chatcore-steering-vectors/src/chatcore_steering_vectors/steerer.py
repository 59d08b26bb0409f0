"""The ``activation-addition`` steerer (Turner et al., 2023; Rimsky et al., 2024).

A steering vector is the difference between the mean residual-stream activation of
some positive prompts and that of some negative prompts, read at the output of block
``layer``. While a reply is generated, ``strength`` times that vector is added to the
output of the same block, which moves every later layer toward the positive prompts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, NonNegativeInt, ValidationInfo, field_validator

from chatcore.api import OptionError, Settings, Steerer, Step, StepOutput, StepState, encode_text
from chatcore_steering_vectors.residual import Pool, add_to_output, find_blocks, mean_block_output

if TYPE_CHECKING:
    import torch

    from chatcore.api import GenerationSession, LoadedModel

PROMPT_SEPARATOR = "|"


def split_prompts(text: str) -> list[str]:
    """``"I love food | pizza is great"`` -> ``["I love food", "pizza is great"]``."""
    return [part.strip() for part in text.split(PROMPT_SEPARATOR) if part.strip()]


class ActivationAdditionSettings(Settings):
    # Checked even when not given (validate_default): a steerer without prompts is refused
    # where it is configured, not at its first reply.
    positive: str = Field(default="", validate_default=True)
    """Prompts separated by `|` whose activations the reply is pushed towards."""
    negative: str = Field(default="", validate_default=True)
    """Prompts separated by `|` whose activations the reply is pushed away from (their counts may differ)."""
    layer: NonNegativeInt | None = None
    """The block whose output is steered (default: a third of the way up)."""
    strength: Annotated[float, Field(ge=-100, le=100)] = 2.0
    """How many times the vector is added (negative steers away)."""
    positions: Literal["all", "new"] = "all"
    """"all" steers the prompt and the reply; "new" only the positions the reply is generated
    from (the prompt's final EOS, then each new token)."""
    pool: Pool = "mean"
    """How a prompt's activations become one vector: "mean" over its tokens, or its "last"
    token (the EOS that ends it, where a reply would start)."""

    @field_validator("positive", "negative")
    @classmethod
    def _has_prompts(cls, text: str, info: ValidationInfo) -> str:
        if not split_prompts(text):
            raise ValueError(
                f"`{info.field_name}` must give at least one prompt (separate several with |), got {text!r}"
            )
        return text


class ActivationAddition(Steerer):
    name = "activation-addition"
    description = "adds strength x (positive - negative prompt activations) to the residual stream at one layer"
    Settings = ActivationAdditionSettings

    def __init__(self, settings: ActivationAdditionSettings | None = None) -> None:
        super().__init__(settings)
        self.block: "torch.nn.Module | None" = None
        self.addition: "torch.Tensor | None" = None  # (C,) strength * vector

    @classmethod
    def setup(cls, model: "LoadedModel", settings: ActivationAdditionSettings) -> tuple[int, "torch.Tensor"]:
        """The steering vector, computed once per model and settings (chatcore keeps it and
        hands it to every reply as ``self.shared``): (layer, vector)."""
        blocks = find_blocks(model.model)
        # A third of the way up: early enough that most of the network still acts on
        # the change, late enough that the vector carries meaning rather than spelling.
        layer = settings.layer if settings.layer is not None else len(blocks) // 3
        if layer >= len(blocks):
            raise OptionError(f"`layer` must be below the model's {len(blocks)} layers, got {layer}")
        limit = model.max_positions

        def encode(prompt: str) -> list[int]:
            # Each prompt is formatted as a chat turn: its text, then EOS.
            return (encode_text(model.tokenizer, prompt) + [model.eos_token_id])[-limit:]

        block = blocks[layer]
        positive = [encode(p) for p in split_prompts(settings.positive)]
        negative = [encode(p) for p in split_prompts(settings.negative)]
        vector = mean_block_output(model.model, block, positive, settings.pool) - mean_block_output(
            model.model, block, negative, settings.pool
        )  # (C,)
        return layer, vector

    def prepare(self, session: "GenerationSession") -> None:
        if self.shared is None:  # built by hand, not by an engine: set up here
            self.shared = self.setup(session.model, self.settings)
        layer, vector = self.shared  # type: ignore[misc]
        self.block = find_blocks(session.model.model)[layer]
        self.addition = (self.settings.strength * vector).to(session.model.dtype)
        self.note(session, {"layer": layer, "vector_norm": round(float(vector.norm()), 4)})

    def wrap(self, step: Step) -> Step:
        import torch

        def steered(state: StepState) -> StepOutput:
            assert self.block is not None and self.addition is not None, "prepare() was not called"
            addition = self.addition
            only_last = self.settings.positions == "new" and state.step == 0

            def change(hidden: "torch.Tensor") -> "torch.Tensor":  # (B, T_in, C)
                if not only_last:
                    return hidden + addition
                # The prompt keeps its own activations (and cache); only the position
                # the first reply token comes from is steered.
                return torch.cat([hidden[:, :-1], hidden[:, -1:] + addition], dim=1)

            # The hook lives only while this step runs, so the model is never left
            # steered for anyone else, even when the inner step raises.
            handle = add_to_output(self.block, change)
            try:
                return step(state)
            finally:
                handle.remove()

        return steered
