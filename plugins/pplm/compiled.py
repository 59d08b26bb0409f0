"""The runner's blocks compiled, under ``CHATCORE_FAST_PATH=compile``.

Eagerly, a perturbed layer's one-token forward dispatches some 43 operators and its
backward 63, most of them the norms', the rotary embedding's and the MLP's small ones; a
PPLM token runs 75 layer forwards and 45 layer backwards at SmolLM2-135M's depth
(docs/measurements.md, "PPLM's operators per token"). On a GPU each operator is a kernel
launch, and launches, not arithmetic, bound the step there. Compiled by ``torch.compile``,
a block's projection (norm, query/key/value product, rotary embedding) and its finish
(output projection, residuals, norm, MLP) are each a few fused kernels, forward and
backward. The single-query attention between them, whose backward is written out
(:mod:`chatcore.plugins.pplm.attention`) and whose past grows by a position each token,
stays as it is.

Each layer class's two functions are compiled once per process with the weights as
inputs, so every layer of every model of that class shares their graphs (one per width,
with gradients or without, for one row and for several: the rows are read as a symbolic
size once a second count comes, so that MMI's candidates do not compile a graph each). A
compile that fails (no compiler on the machine, a module torch.compile cannot take) logs
one warning, and every layer runs
uncompiled from then on; a failure the uncompiled layer has too is the input's, raised
as it is.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from chatcore.api import compile_failure

if TYPE_CHECKING:
    import torch

    from .layers import Layer, Projections, Rotary

log = logging.getLogger(__name__)

COMPILING = "pplm: compiling the perturbed passes' layers (CHATCORE_FAST_PATH=compile); the first steered reply waits"

_compiled: dict[tuple[type, str], Callable[..., Any]] = {}
_lock = threading.Lock()
_failed = False  # compiling failed once: every layer runs uncompiled


def _call(layer: Layer, name: str, *arguments: Any) -> Any:
    """``type(layer).name(layer, *arguments)``, compiled where it can be."""
    global _failed
    eager = getattr(type(layer), name)
    if _failed:
        return eager(layer, *arguments)
    key = (type(layer), name)
    with _lock:
        compiled = _compiled.get(key)
        if compiled is None:
            import torch

            if not _compiled:
                log.warning(COMPILING)  # the first steered reply waits for it: say why
            compiled = _compiled[key] = torch.compile(eager, dynamic=None)  # rows symbolic once a second count comes
    try:
        return compiled(layer, *arguments)
    except Exception as error:
        result = eager(layer, *arguments)  # fails too where the input is at fault: raised as it is
        if not _failed:
            log.warning(
                "pplm: compiling the perturbed passes' layers failed, running them uncompiled: %s",
                compile_failure(error),
            )
        _failed = True
        return result


class CompiledLayer:
    """A runner's layer (:class:`chatcore.plugins.pplm.layers.Layer`) whose two halves run compiled."""

    def __init__(self, layer: Layer) -> None:
        self.layer = layer

    def project(self, x: torch.Tensor, rotary: Rotary | None) -> Projections:
        projections: Projections = _call(self.layer, "project", x, rotary)
        return projections

    def finish(self, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = _call(self.layer, "finish", x, attention)
        return output


def compiled_layers(layers: list[Layer]) -> list[Layer]:
    """``layers``, each running compiled (see the module's docstring)."""
    return [CompiledLayer(layer) for layer in layers]
