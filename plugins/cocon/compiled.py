"""The frozen model's two halves compiled, for ``chatcore train cocon --compile``.

A CoCon training step runs the frozen model many times over: the self, null and cycle
passes, and for the cycle loss one token at a time (``cycle_tokens`` of them), each
through every block forward and LM-beta's blocks backward. On a GPU such a step is bound
by launching kernels, not by the card (docs/measurements.md). Compiled by
``torch.compile``, LM-alpha and LM-beta (:class:`chatcore.plugins.cocon.model_split.SplitModel`)
each run as a few fused kernels per block, forward and backward, with their lengths
symbolic (``dynamic=True``), so that the window passes and the cycle's one-token steps
over a growing cache share a handful of graphs. The CoCon block, the losses and the
discriminator stay as they are.

A compile that fails logs one warning and the halves run uncompiled from then on; a
failure the uncompiled half has too is the input's, raised as it is. The backward pass's
kernels compile at the first backward, after a forward that worked: a failure there is
caught by the training step, which turns the halves uncompiled (:func:`uncompile_halves`)
and runs the step again from its start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from chatcore.api import compile_failure

if TYPE_CHECKING:
    from .model_split import SplitModel

log = logging.getLogger(__name__)

COMPILING = "cocon: compiling the frozen model's halves (--compile); the first steps wait for it"


class CompiledHalf:
    """One half's method (``alpha`` or ``beta``) through torch.compile, uncompiled once that fails."""

    def __init__(self, eager: Callable[..., Any], warned: list[bool] | None = None) -> None:
        import torch

        self.eager = eager
        self.compiled: Callable[..., Any] | None = torch.compile(eager, dynamic=True)
        self.calls = 0  # through the compiled half (for tests)
        self.warned = [False] if warned is None else warned  # shared by a model's two halves: one warning

    def __call__(self, *arguments: Any, **keywords: Any) -> Any:
        if self.compiled is None:
            return self.eager(*arguments, **keywords)
        try:
            output = self.compiled(*arguments, **keywords)
        except Exception as error:
            output = self.eager(*arguments, **keywords)  # fails too where the input is at fault
            self.give_up(error)
            return output
        self.calls += 1
        return output

    def give_up(self, error: BaseException) -> None:
        """Run uncompiled from now on; the first half of a model to give up warns."""
        if not self.warned[0]:
            log.warning(
                "cocon: compiling the frozen model's halves failed, running them uncompiled: %s", compile_failure(error)
            )
        self.warned[0] = True
        self.compiled = None


def compile_halves(split: SplitModel) -> None:
    """Run ``split``'s LM-alpha and LM-beta compiled from now on (see the module's docstring)."""
    log.warning(COMPILING)
    warned = [False]
    split.alpha = CompiledHalf(split.alpha, warned)  # type: ignore[method-assign]
    split.beta = CompiledHalf(split.beta, warned)  # type: ignore[method-assign]


def uncompile_halves(split: SplitModel, error: BaseException) -> bool:
    """After ``error`` in a training step's pass or backward: where ``split``'s halves still run
    compiled, run them uncompiled from now on (one warning) and say True, so that the step runs
    again; False where nothing was compiled (the error is not the compiler's)."""
    halves = [half for half in (split.alpha, split.beta) if isinstance(half, CompiledHalf) and half.compiled]
    for half in halves:
        half.give_up(error)
    return bool(halves)
