"""Steerers for the serving tests: one that fails at a chosen step, one that cannot share a
batch, one that is slow enough for a test to act while a reply runs; a decoder that writes a
given text and then waits for the test (``gate``), to cut a reply at a moment the test
chooses; and an engine with them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

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
        register(Slow)

    @chatcore.hookimpl
    def register_decoders(self, register: Callable[[type], None]) -> None:
        register(GatedText)


@pytest.fixture
def serving_engine(loaded, host):
    from chatcore.engine import Engine

    host.register(ServingTestPlugin(), "test-serving")
    return Engine(loaded, host=host)
