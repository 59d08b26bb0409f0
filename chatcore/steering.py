"""The steerer interface: middleware around one decoding step.

A steerer has a ``name``, typed ``Settings``, a ``prepare(session)`` called once per
response (load word lists, encode content), and ``wrap(step) -> step``.

Composition order (written down, and the same everywhere): steerers are applied in
the order they are given. The first wraps the model's own step, the second wraps
that, and so on, so the **last steerer is the outermost**: it sees the state first
and edits the logits last. Logit edits therefore accumulate in the given order, and
a steerer that re-runs its inner step (PPLM) re-runs every steerer listed before it.
After all steerers, the decoder's score processors run (see chatcore.processors).

A steerer instance serves one response at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from chatcore.options import Configurable
from chatcore.step import Step, StepOutput, StepState

if TYPE_CHECKING:
    from chatcore.decoding import GenerationSession


class Steerer(Configurable):
    """Base class for steerers. Subclasses set ``name`` and ``Settings`` and implement ``wrap``."""

    kind: ClassVar[str] = "steerer"
    # Whether one row of a batch shared with other replies may be steered by this steerer
    # (chatcore.serving). True only for a steerer whose wrapped step calls its inner step
    # once, with the state it was given, and changes nothing but the logits that come out:
    # the serving batch then runs the model for every row at once and hands each row's
    # steerers that row's output alone. A steerer that re-runs the model, edits the cache
    # or reads hidden states (PPLM, CoCon, activation steering) keeps the default, and
    # its replies are decoded in a batch of their own.
    shares_batch: ClassVar[bool] = False

    def prepare(self, session: "GenerationSession") -> None:
        """Called once per response, before the first step."""

    def wrap(self, step: Step) -> Step:
        raise NotImplementedError


LAYER_ATTRIBUTE = "chatcore_step_layer"


def _tag_failures(step: Step, layer: str) -> Step:
    """Mark an exception escaping ``step`` with the layer it came from, unless an inner
    layer already did: the innermost layer that raised is the one to blame."""

    def tagged(state: StepState) -> StepOutput:
        try:
            return step(state)
        except Exception as error:
            if not hasattr(error, LAYER_ATTRIBUTE):
                setattr(error, LAYER_ATTRIBUTE, layer)
            raise

    return tagged


def failed_layer(error: BaseException) -> str | None:
    """``"model"``, ``"steerer:NAME"``, or None if the error did not come from a step."""
    return getattr(error, LAYER_ATTRIBUTE, None)


def compose(step: Step, steerers: Sequence[Steerer]) -> Step:
    """Wrap ``step`` by each steerer in order (the last one given is the outermost).

    Every layer is tagged so that a failure names the steerer (or the model) it came from.
    """
    step = _tag_failures(step, "model")
    for steerer in steerers:
        layer = f"steerer:{steerer.name}"
        try:
            wrapped = steerer.wrap(step)
        except Exception as error:  # a failure while wrapping is the steerer's too
            if not hasattr(error, LAYER_ATTRIBUTE):
                setattr(error, LAYER_ATTRIBUTE, layer)
            raise
        step = _tag_failures(wrapped, layer)
    return step
