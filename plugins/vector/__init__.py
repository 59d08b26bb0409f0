"""Built-in activation steering: the ``vector`` steerer and ``chatcore train vector``.

A steering vector is the mean difference of the residual stream between positive and
negative texts at one block (CAA, repeng); the steerer adds ``strength`` times it after
that block while a reply is generated. It works on every architecture chatcore's anatomy
module reads (GPT-2, the Llama family, GPT-NeoX, OPT). See docs/steering-vectors.md.
"""

from __future__ import annotations

from collections.abc import Callable

import click

import chatcore


@chatcore.hookimpl(trylast=True)
def register_steerers(register: Callable[[type], None]) -> None:
    from .steerer import VectorSteerer

    register(VectorSteerer)


@chatcore.hookimpl(trylast=True)
def register_commands(cli: click.Group) -> None:
    from chatcore.api import train_group

    from .command import train_vector_command

    train_group(cli).add_command(train_vector_command)
