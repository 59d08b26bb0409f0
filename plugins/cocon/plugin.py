"""The ``cocon`` steerer: content-conditioned replies through a trained CoCon block.

The steerer replaces the model's forward pass: each step runs LM-alpha, the CoCon
block (attending over the content's hidden states) and LM-beta, each with its own
cache (see chatcore.cocon). Because it *is* the model step, it must come first in the
steerer order (innermost): every steerer after it wraps its step as it would wrap
the model's, so logit steerers (bow-bias) and decoders compose with it unchanged.
``prepare`` refuses any other position with a clear error.

Also adds ``chatcore train cocon`` to the ``train`` command group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import click
from pydantic import Field, StringConstraints, field_validator, model_validator

import chatcore
from chatcore.api import ChatcoreError, OptionError, Settings, Steerer, Step, StepOutput, StepState, encode_text

if TYPE_CHECKING:
    from chatcore.api import GenerationSession, LoadedModel

    from .pipeline import CoconPipeline, ContentMemory
    from .training import CoconPrecision

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
    block: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)] | None = None
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
    name = "cocon"
    description = (
        "steers replies towards content texts with a trained CoCon block (`content`, `tau`); "
        "replaces the model step, so it must come first among the steerers"
    )
    Settings = CoconSettings
    replaces_model = True

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


# -- chatcore train cocon ---------------------------------------------------------------------


@click.command("cocon")
@click.option(
    "-m",
    "--model",
    default="chatcore-tiny",
    show_default=True,
    help="The frozen base model (bundled name, folder or hub id; GPT-2 or Llama family).",
)
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Run folder: checkpoint/, and block/ (the block to load with block=OUT/block).",
)
@click.option("--corpus", default="chitchat", show_default=True, help='"chitchat" or a JSONL file of dialogues.')
@click.option("--heldout", type=click.FloatRange(0, 0.5), default=0.05, show_default=True)
@click.option(
    "--format",
    "prompt_format",
    default="auto",
    show_default=True,
    help="Prompt format the dialogues are rendered in, as chat renders prompts: auto (the model's chat "
    "template if it has one), chat-template, dialogpt, ...",
)
@click.option(
    "--split-layer",
    type=click.IntRange(1, 1000),
    default=None,
    help="LM-alpha is blocks [0, split). Default: a third of the depth.",
)
@click.option("--steps", type=click.IntRange(1, 10**9), default=2000, show_default=True)
@click.option("--batch-size", type=click.IntRange(1, 65536), default=16, show_default=True)
@click.option(
    "--history-tokens",
    type=click.IntRange(1, 8192),
    default=32,
    show_default=True,
    help="The longest history (prompt) before a continuation.",
)
@click.option(
    "--min-history-tokens",
    type=click.IntRange(1, 8192),
    default=None,
    help="Draw each batch's history length log-uniformly from [this, --history-tokens] "
    "(default: every history --history-tokens long).",
)
@click.option("--continuation-tokens", type=click.IntRange(2, 8192), default=24, show_default=True)
@click.option(
    "--content-max-tokens",
    type=click.IntRange(1, 8192),
    default=None,
    help="Longest content (default: the whole continuation).",
)
@click.option(
    "--short-content-share",
    type=click.FloatRange(0, 1),
    default=0.5,
    show_default=True,
    help="Share of batches whose content is a short span (a word, a phrase) of the continuation.",
)
@click.option(
    "--short-content-max-tokens",
    type=click.IntRange(1, 8192),
    default=4,
    show_default=True,
    help="Longest short content span.",
)
@click.option(
    "--span-weight",
    type=click.FloatRange(0),
    default=1.0,
    show_default=True,
    help="Weight, relative to the other positions, of the self loss at the positions a short content holds.",
)
@click.option(
    "--plain-target",
    type=click.FloatRange(0, 1),
    default=0.0,
    show_default=True,
    help="Share of the target taken from the plain model's next-token distribution instead of the "
    "text, where no content token is due (the null loss; outside a short content's span).",
)
@click.option(
    "--init-block",
    default=None,
    help="Start from this block's weights (a block folder or bundled name for the same model): fine-tune it.",
)
@click.option(
    "--self-weight",
    type=click.FloatRange(0),
    default=1.0,
    show_default=True,
    help="Weight of the self-reconstruction loss.",
)
@click.option(
    "--null-weight",
    type=click.FloatRange(0),
    default=1.0,
    show_default=True,
    help="Weight of the null-content (plain LM) loss.",
)
@click.option(
    "--cycle-weight",
    type=click.FloatRange(0),
    default=1.0,
    show_default=True,
    help="Weight of the cycle-reconstruction loss.",
)
@click.option(
    "--adv-weight", type=click.FloatRange(0), default=0.2, show_default=True, help="Weight of the adversarial loss."
)
@click.option("--cycle-from-step", type=click.IntRange(0), default=500, show_default=True)
@click.option("--adv-from-step", type=click.IntRange(0), default=500, show_default=True)
@click.option(
    "--cycle-tokens",
    type=click.IntRange(1, 512),
    default=8,
    show_default=True,
    help="Tokens generated for the cycle and adversarial losses.",
)
@click.option("--lr", "learning_rate", type=click.FloatRange(1e-8, 1.0), default=5e-4, show_default=True)
@click.option("--warmup-steps", type=click.IntRange(0), default=100, show_default=True)
@click.option(
    "--eval-every",
    type=click.IntRange(1),
    default=200,
    show_default=True,
    help="Steps between held-out evaluations (each also writes the checkpoint and the block).",
)
@click.option(
    "--eval-windows",
    type=click.IntRange(1),
    default=128,
    show_default=True,
    help="Held-out windows each evaluation scores.",
)
@click.option("--seed", type=int, default=1234, show_default=True)
@click.option("--device", default=None, help="cpu, cuda ... (default: cuda when present).")
@click.option(
    "--precision",
    type=click.Choice(["auto", "fp32", "bf16"]),
    default="auto",
    show_default=True,
    help="auto: bf16 autocast on CUDA, fp32 elsewhere.",
)
@click.option(
    "--threads", type=click.IntRange(1, 1024), default=None, help="torch CPU threads (default: torch's own choice)."
)
@click.option("--resume", is_flag=True, help="Continue from OUT/checkpoint/.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def cocon_command(
    model: str,
    out_dir: str,
    corpus: str,
    heldout: float,
    prompt_format: str,
    split_layer: int | None,
    steps: int,
    batch_size: int,
    history_tokens: int,
    min_history_tokens: int | None,
    continuation_tokens: int,
    content_max_tokens: int | None,
    short_content_share: float,
    short_content_max_tokens: int,
    span_weight: float,
    plain_target: float,
    init_block: str | None,
    self_weight: float,
    null_weight: float,
    cycle_weight: float,
    adv_weight: float,
    cycle_from_step: int,
    adv_from_step: int,
    cycle_tokens: int,
    learning_rate: float,
    warmup_steps: int,
    eval_every: int,
    eval_windows: int,
    seed: int,
    device: str | None,
    precision: "CoconPrecision",
    threads: int | None,
    resume: bool,
    quiet: bool,
) -> None:
    """Train a CoCon block for a frozen base model on dialogue text.

    Losses: self-reconstruction and null content from the start; cycle reconstruction
    and adversarial from --cycle-from-step / --adv-from-step. Load the result with
    --steer "cocon content=WORD block=OUT/block".
    """
    from chatcore.api import validate_format_name

    from .training import CoconTrainConfig, train_cocon

    validate_format_name(prompt_format)  # an unknown name fails before the model loads
    try:
        config = CoconTrainConfig(
            out_dir=out_dir,
            model=model,
            corpus=corpus,
            heldout=heldout,
            prompt_format=prompt_format,
            split_layer=split_layer,
            steps=steps,
            batch_size=batch_size,
            history_tokens=history_tokens,
            min_history_tokens=min_history_tokens,
            continuation_tokens=continuation_tokens,
            content_max_tokens=content_max_tokens,
            short_content_share=short_content_share,
            short_content_max_tokens=short_content_max_tokens,
            span_weight=span_weight,
            plain_target=plain_target,
            init_block=init_block,
            self_weight=self_weight,
            null_weight=null_weight,
            cycle_weight=cycle_weight,
            adv_weight=adv_weight,
            cycle_from_step=cycle_from_step,
            adv_from_step=adv_from_step,
            cycle_tokens=cycle_tokens,
            learning_rate=learning_rate,
            warmup_steps=warmup_steps,
            eval_every=eval_every,
            eval_windows=eval_windows,
            seed=seed,
            device=device,
            precision=precision,
            threads=threads,
        )
    except ValueError as error:
        raise OptionError(str(error)) from None
    result = train_cocon(config, resume=resume, progress=not quiet)
    losses = ", ".join(f"{name} {value:.4f}" for name, value in result.heldout.items())
    click.echo(
        f"{result.steps} steps in {result.seconds:.0f} s; held-out loss: {losses}; "
        f"{result.parameters:,} block parameters; block in {result.block_dir}"
    )


@chatcore.hookimpl(trylast=True)
def register_commands(cli: Any) -> None:
    from chatcore.api import train_group

    train_group(cli).add_command(cocon_command)
