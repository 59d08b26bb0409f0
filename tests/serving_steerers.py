"""Steerers for the serving tests: one that fails at a chosen step, one that cannot share a
batch, one that is slow enough for a test to act while a reply runs, one that blocks until the
test opens its gate; and an engine with them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest

import chatcore
from chatcore.steering import Steerer
from chatcore.step import Step, StepOutput, StepState


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


class ServingTestPlugin:
    @chatcore.hookimpl
    def register_steerers(self, register: Callable[[type], None]) -> None:
        register(FailingShared)
        register(NegateAlone)
        register(Slow)
        register(Blocking)


@pytest.fixture
def serving_engine(loaded, host):
    from chatcore.engine import Engine

    host.register(ServingTestPlugin(), "test-serving")
    return Engine(loaded, host=host)


@dataclass
class Gate:
    """What a test holds to control a Blocking steerer: ``entered`` is set when a reply reaches
    the step, which then waits until the test sets ``release``."""

    entered: threading.Event
    release: threading.Event


GATES: dict[str, Gate] = {}


def gate(name: str) -> Gate:
    """The gate ``blocking gate=NAME`` waits on (created on first use)."""
    return GATES.setdefault(name, Gate(threading.Event(), threading.Event()))


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
        held = gate(self.settings.gate)

        def blocking(state: StepState) -> StepOutput:
            if state.step == self.settings.at_step:
                held.entered.set()
                held.release.wait(timeout=120)  # a failed test must not hang the suite
            return step(state)

        return blocking
