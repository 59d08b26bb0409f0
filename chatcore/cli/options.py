"""Options several commands share (chat, generate, eval, serve, discord): each defined once.

Only click is imported here, so ``--help`` stays instant.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

model_option = click.option(
    "-m",
    "--model",
    default="chatcore-tiny",
    show_default=True,
    help="Bundled name, smollm2, a GGUF file, a local folder or a hub id.",
)

threads_option = click.option(
    "--threads",
    type=click.IntRange(1, 1024),
    default=None,
    envvar="CHATCORE_THREADS",
    help="CPU threads for inference [half the cores, at most 4; $OMP_NUM_THREADS when set].",
)


def max_new_tokens_option(default: int) -> Callable[[F], F]:
    """``-n/--max-new-tokens``: the reply's budget in tokens, with the command's default."""
    return click.option(
        "-n",
        "--max-new-tokens",
        type=click.IntRange(1, 4096),
        default=default,
        show_default=True,
        help="Longest reply, in tokens (capped by the room the prompt leaves in the context).",
    )


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
