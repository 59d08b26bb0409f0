"""Steerers for the serving tests: one that fails at a chosen step, one that cannot share a
batch, one that is slow enough for a test to act while a reply runs, one that blocks until the
test opens its gate; a decoder that writes a given text and then waits for the test
(``gate``), to cut a reply at a moment the test chooses; and an engine with them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

import chatcore
from chatcore.decoding import GenerationSession
from chatcore.steering import Steerer
from chatcore.step import Step, StepOutput, StepState
from chatcore.testing import ScriptedDecoder


@dataclass
class FailingSettings:
    at_step: int = 2


@dataclass
class NoSettings:
    pass


class FailingShared(Steerer):
    """Raises at one step; shares the batch, so its failure happens inside a shared step."""

    name = "failing-shared"
    Settings = FailingSettings
    shares_batch = True

    def wrap(self, step: Step) -> Step:
        def failing(state: StepState) -> StepOutput:
            if state.step == self.settings.at_step:
                raise RuntimeError("boom")
            return step(state)

        return failing


class NegateAlone(Steerer):
    """Declares nothing, so it is decoded beside the batch: flips the logits' sign."""

    name = "negate"
    Settings = NoSettings

    def wrap(self, step: Step) -> Step:
        def negated(state: StepState) -> StepOutput:
            output = step(state)
            return output.replace(logits=-output.logits)

        return negated


class CutsState(Steerer):
    """From its second step on, passes the model a state with no input ids: the model fails on
    what the steerer gave it."""

    name = "cuts-state"
    Settings = NoSettings

    def wrap(self, step: Step) -> Step:
        def cut(state: StepState) -> StepOutput:
            return step(state if state.step < 2 else state.replace(input_ids=state.input_ids[:, :0]))

        return cut


class NegateBeside(NegateAlone):
    """``negate``, declared safe to run on the runner's worker thread beside the batch's pass."""

    name = "negate-beside"
    runs_beside = True


@dataclass
class SlowSettings:
    seconds: float = 0.05


class Slow(Steerer):
    """Sleeps at every step, so that a reply is still running when the test acts on it."""

    name = "slow"
    Settings = SlowSettings
    shares_batch = True

    def wrap(self, step: Step) -> Step:
        def slow(state: StepState) -> StepOutput:
            time.sleep(self.settings.seconds)
            return step(state)

        return slow


@dataclass
class WrongSettings:
    what: str = "far"


class WrongIds(ScriptedDecoder):
    """Chooses what no decoder should from its second step on: ``far`` an id past the
    vocabulary, ``negative`` -5, ``float`` a float tensor, ``shape`` two ids a row; ``nan``
    the argmax of scores its own processor made NaN."""

    name = "wrong-ids"
    description = "chooses impossible token ids (tests)"
    Settings = WrongSettings

    def script(self, session: GenerationSession) -> list[int]:
        self.width = session.model.model.config.vocab_size
        return [11, 12, 13, 14]

    def select(self, scores, generator):
        import torch

        tokens = super().select(scores, generator)
        if self._position <= 2:  # its first two tokens
            return tokens
        what = self.settings.what
        if what == "nan":  # an argmax does not fail on NaN: it picks one
            return scores.argmax(dim=-1)
        if what == "float":
            return tokens.float() + 0.5
        if what == "shape":
            return torch.stack([tokens, tokens], dim=1)
        return torch.full_like(tokens, self.width + 1000 if what == "far" else -5)

    def processors(self):
        if self.settings.what != "nan":
            return super().processors()
        return [lambda ids, scores: scores * float("nan") if self._position >= 2 else scores]


class WrongScores(Steerer):
    """Returns what no steerer should from its second step on: ``none`` nothing, ``narrow``
    the first 100 scores only, ``nan`` NaN scores, ``banned`` every score -inf,
    ``chatcore-error`` a ChatcoreError, ``integers`` its scores as integers."""

    name = "wrong-scores"
    Settings = WrongSettings
    shares_batch = True

    def wrap(self, step: Step) -> Step:
        import torch

        def wrong(state: StepState) -> StepOutput:
            output = step(state)
            if state.step < 2:
                return output
            what = self.settings.what
            if what == "nan":
                return output.replace(logits=output.logits * float("nan"))
            if what == "chatcore-error":  # as a chatcore function the steerer called would raise
                from chatcore.api import ChatcoreError

                raise ChatcoreError("layer 99 is outside the model's blocks")
            if what == "integers":
                return output.replace(logits=output.logits.to(torch.int64))
            if what == "banned":  # every token banned
                return output.replace(logits=torch.full_like(output.logits, float("-inf")))
            return None if what == "none" else output.replace(logits=output.logits[:, :100])  # type: ignore[return-value]

        return wrong


@dataclass
class Gate:
    """What ``gated-text`` writes, and two events: ``written`` once every token of ``text``
    is out, ``release`` to let the reply end (it ends as soon as it is set)."""

    text: str = "Hello there, my frie"
    written: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


GATE = Gate()


class GatedText(ScriptedDecoder):
    """Writes ``GATE.text`` (a test sets it with the ``gate`` fixture), then holds the
    scheduler's thread until ``GATE.release``: a reply caught in the middle of a word."""

    name = "gated-text"
    description = "writes a test's text, then waits for the test (tests)"
    Settings = NoSettings

    def script(self, session: GenerationSession) -> list[int]:
        from chatcore.text import encode_text

        return encode_text(session.model.tokenizer, GATE.text)

    def next_token(self) -> int:
        if self._position == len(self._tokens) - 1:  # every token of the text is out
            GATE.written.set()
            assert GATE.release.wait(60), "the test never released the gated reply"
        return super().next_token()


@pytest.fixture
def gate() -> Iterator[Gate]:
    """A fresh gate for ``gated-text``; released at the end so the scheduler can stop."""
    global GATE
    GATE = Gate()
    yield GATE
    GATE.release.set()


class ServingTestPlugin:
    @chatcore.hookimpl
    def register_steerers(self, register: Callable[[type], None]) -> None:
        register(FailingShared)
        register(NegateAlone)
        register(NegateBeside)
        register(CutsState)
        register(HeldBeside)
        register(Slow)
        register(Blocking)
        register(HeldSetup)
        register(WrongScores)

    @chatcore.hookimpl
    def register_decoders(self, register: Callable[[type], None]) -> None:
        register(GatedText)
        register(WrongIds)


@pytest.fixture
def serving_engine(loaded, host):
    from chatcore.engine import Engine

    host.register(ServingTestPlugin(), "test-serving")
    return Engine(loaded, host=host)


@dataclass
class StepGate:
    """What a test holds to control a Blocking steerer: ``entered`` is set when a reply reaches
    the step, which then waits until the test sets ``release``."""

    entered: threading.Event
    release: threading.Event


STEP_GATES: dict[str, StepGate] = {}


def step_gate(name: str) -> StepGate:
    """The gate ``blocking gate=NAME`` waits on (created on first use)."""
    return STEP_GATES.setdefault(name, StepGate(threading.Event(), threading.Event()))


@dataclass
class BlockingSettings:
    gate: str = "default"
    at_step: int = 1


class Blocking(Steerer):
    """Stops the scheduler's thread at one step until the test opens its gate: a reply that is
    running (or, behind it, waiting) for exactly as long as the test needs, with no clock."""

    name = "blocking"
    Settings = BlockingSettings
    shares_batch = True

    def wrap(self, step: Step) -> Step:
        held = step_gate(self.settings.gate)

        def blocking(state: StepState) -> StepOutput:
            if state.step == self.settings.at_step:
                held.entered.set()
                held.release.wait(timeout=120)  # a failed test must not hang the suite
            return step(state)

        return blocking


@dataclass
class HeldSetupSettings:
    gate: str = "setup"


class HeldSetup(Steerer):
    """A steerer whose setup (as loading a model would) waits until the test opens its gate;
    its steps change nothing."""

    name = "held-setup"
    Settings = HeldSetupSettings
    shares_batch = True

    @classmethod
    def setup(cls, model: Any, settings: HeldSetupSettings) -> object:
        held = step_gate(settings.gate)
        held.entered.set()
        held.release.wait(timeout=120)  # a failed test must not hang the suite
        return settings.gate

    def wrap(self, step: Step) -> Step:
        return step


class HeldBeside(Blocking):
    """``blocking`` as an eager steerer that runs beside the batch (``runs_beside``): its step
    waits at one step on the runner's worker thread, a slow step (as PPLM's) held exactly as
    long as the test needs, while the scheduler's thread goes on."""

    name = "held-beside"
    shares_batch = False
    runs_beside = True
