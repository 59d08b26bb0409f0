"""Steerers for the serving tests: one that fails at a chosen step, one that cannot share a
batch, one that is slow enough for a test to act while a reply runs; and an engine with them."""

from __future__ import annotations

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


@pytest.fixture
def serving_engine(loaded, host):
    from chatcore.engine import Engine

    host.register(ServingTestPlugin(), "test-serving")
    return Engine(loaded, host=host)
