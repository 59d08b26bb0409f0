"""A shared reply's prompt pass under ``CHATCORE_FAST_PATH=compile``: compiled, any length.

The fast path's step (:mod:`chatcore.serving.static_step`) makes the decode step cheap; a
reply's first token still waits for its prompt's pass, which runs the model eagerly: on a
GPU a few hundred kernel launches and the Python between them, whatever the prompt's
length (at SmolLM2-1.7B's shape on an H200 about as long as 15 decode steps). Under
``compile`` that pass goes through ``torch.compile`` too, with the prompt's length and
the cached prefix's length symbolic (``dynamic=True``), so that one graph serves every
prompt (one more where a prefix from the prefix cache comes first). It is compiled
without inductor's freezing: the decode step's frozen graph already holds copies of the
folded weights, and a second set would cost their bytes again.

The compiled pass is kept per model (weakly), since a prompt runs before its reply joins
the batch and so before the batch takes its step. A compile that fails logs one warning
and the prompt runs eagerly from then on, as the decode step does.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from chatcore.fast_path_setting import compile_failure, fast_path_mode

log = logging.getLogger(__name__)

COMPILING = "fast path: compiling the prompt pass (CHATCORE_FAST_PATH=compile); the first reply waits for it"


class PromptPass:
    """The model for a shared reply's prompt: ``torch.compile``'s pass once made, the model
    itself once compiling has failed. ``passes`` and ``compiled_passes`` count the calls
    (for tests and benchmarks)."""

    def __init__(self, model: Any) -> None:
        self._model = weakref.ref(model)  # the pool below is keyed by the model: no strong reference
        self.compiled = True  # False once compiling failed
        self._pass: Any = None
        self.passes = 0
        self.compiled_passes = 0
        self._lock = threading.Lock()  # the scheduler's thread and a reply decoded alone may share a model

    def __call__(self, **arguments: Any) -> Any:
        model = self._model()
        assert model is not None, "the prompt pass outlived its model"
        self.passes += 1
        if not self.compiled:
            return model(**arguments)
        try:
            with self._lock:
                if self._pass is None:
                    import torch

                    log.warning(COMPILING)  # the first reply waits for it: say why
                    self._pass = torch.compile(model, dynamic=True, fullgraph=False)
            output = self._pass(**arguments)
        except Exception as error:
            # No compiler on this machine, or a model torch.compile cannot take: compiling
            # fails before the pass runs, so the cache it was given is as it was. Where the
            # model fails uncompiled too, the prompt is at fault (its error is raised), not
            # the compiler, which is kept.
            output = model(**arguments)
            log.warning(
                "fast path: compiling the prompt pass failed, running it uncompiled: %s", compile_failure(error)
            )
            self.compiled, self._pass = False, None
            return output
        self.compiled_passes += 1
        return output


_passes: weakref.WeakKeyDictionary[Any, PromptPass] = weakref.WeakKeyDictionary()
_passes_lock = threading.Lock()


def prompt_pass(model: Any) -> PromptPass | None:
    """The compiled prompt pass of ``model`` where ``CHATCORE_FAST_PATH=compile``, else None
    (the prompt runs on the model itself). Call where the batch takes the fast path."""
    if fast_path_mode() != "compile":
        return None
    with _passes_lock:
        found = _passes.get(model)
        if found is None:
            found = _passes[model] = PromptPass(model)
        return found
