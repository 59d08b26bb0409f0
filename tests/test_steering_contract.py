"""The steering contract (docs/hooks.md, "What a steerer sees"), checked by recording steerers
under every wrapper: alone, as MMI's candidates, inside PPLM, outside CoCon, in the shared batch.

The recorders keep state of their own per row, as a steerer with its own key/value cache
would: the tokens each row has fed so far, advanced only on calls that are not probes and
indexed by ``state.rows``. Every call must agree with that state, and exactly one call per
step must not be a probe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

import chatcore
from chatcore.engine import Engine, ReplyOptions
from chatcore.prompting import Message
from chatcore.serving import Scheduler
from chatcore.steering import Steerer
from chatcore.step import Step, StepOutput, StepState


@dataclass
class Calls:
    """What one recorder saw over one reply."""

    steps: list[int] = field(default_factory=list)  # the step of each call that was not a probe
    probes: int = 0
    rows_seen: set[tuple[int, ...]] = field(default_factory=set)
    fed: dict[int, list[int]] = field(default_factory=dict)  # row id -> tokens that row has fed


RECORDS: list[Calls] = []


class StepRecorder(Steerer):
    """A step steerer that checks each state against its own per-row record."""

    name = "record-steps"

    def prepare(self, session: Any) -> None:
        self.calls = Calls()
        RECORDS.append(self.calls)

    def check(self, state: StepState) -> None:
        calls = self.calls
        rows = state.rows
        batch = state.input_ids.size(0)
        assert len(rows) == batch == state.sequences.size(0) == state.attention_mask.size(0)
        assert list(rows) == sorted(set(rows))
        t_in = state.input_ids.size(1)
        assert state.sequences[:, -t_in:].tolist() == state.input_ids.tolist()
        assert state.sequences.size(1) == state.prompt_length + state.step
        if state.step == 0:
            assert state.sequences.size(1) == state.prompt_length
        else:
            assert t_in == 1
        calls.rows_seen.add(tuple(rows))
        if state.probe:
            calls.probes += 1
            for index, row in enumerate(rows):  # a probe looks at the same tokens the row has fed
                assert calls.fed[row] == state.sequences[index].tolist()
            return
        assert state.step == len(calls.steps), "one call per step is not a probe"
        calls.steps.append(state.step)
        for index, row in enumerate(rows):
            if state.step == 0:
                assert row not in calls.fed
                calls.fed[row] = state.sequences[index].tolist()
            else:
                calls.fed[row].append(int(state.input_ids[index, 0]))
                assert calls.fed[row] == state.sequences[index].tolist()

    def wrap(self, step: Step) -> Step:
        def recording(state: StepState) -> StepOutput:
            self.check(state)
            output = step(state)
            assert output.logits.shape[0] == state.input_ids.size(0)
            return output

        return recording


class ScoreRecorder(StepRecorder):
    """The same checks as a score steerer, which shares the batch with other replies."""

    name = "record-scores"
    shares_batch = True


class RecorderPlugin:
    @chatcore.hookimpl
    def register_steerers(self, register: Any) -> None:
        register(StepRecorder)
        register(ScoreRecorder)


@pytest.fixture(scope="module")
def engine() -> Engine:
    from chatcore.plugin_manager import PluginHost

    host = PluginHost()
    host.load_entry_points()
    host.register(RecorderPlugin(), "recorders")
    return Engine(host=host)


MAX_NEW_TOKENS = 8


def reply(engine: Engine, decoder: str, steerers: list[tuple[str, dict[str, Any]]], **settings: Any) -> list[int]:
    RECORDS.clear()
    options = ReplyOptions(
        decoder=decoder, decoder_settings=settings, steerers=steerers, seed=3, max_new_tokens=MAX_NEW_TOKENS
    )
    response = engine.reply_to(["what do you like to eat?"], options)
    response.text()
    return response.token_ids


def steps_taken(calls: Calls) -> int:
    assert calls.steps == list(range(len(calls.steps)))
    return len(calls.steps)


PPLM = ("pplm", {"topic": "food", "num_iterations": 2})
CANDIDATES = {"candidates": 3, "quorum": 1.0}


@pytest.mark.parametrize("recorder", ["record-steps", "record-scores"])
@pytest.mark.parametrize(
    "decoder, settings, rows",
    [("greedy", {}, 1), ("top-k", {}, 1), ("mmi", CANDIDATES, 3), ("rank", {**CANDIDATES, "topic": "food"}, 3)],
)
def test_a_reply_alone_and_as_candidates(engine, recorder, decoder, settings, rows):
    tokens = reply(engine, decoder, [(recorder, {})], **settings)
    (calls,) = RECORDS
    assert calls.probes == 0
    assert calls.rows_seen == {tuple(range(rows))}
    assert len(tokens) <= steps_taken(calls) <= len(tokens) + 1


@pytest.mark.parametrize("decoder, settings, rows", [("greedy", {}, 1), ("mmi", CANDIDATES, 3)])
def test_inside_pplm_one_call_per_step_is_not_a_probe_and_subsets_carry_row_ids(engine, decoder, settings, rows):
    tokens = reply(engine, decoder, [("record-steps", {}), PPLM], **settings)
    (calls,) = RECORDS
    steps = steps_taken(calls)
    # A reply of one row steps once per token (and once more for its stop token); a reply of
    # several candidates steps until its longest candidate ends, which the chosen one may not be.
    assert len(tokens) <= steps <= (len(tokens) if rows == 1 else MAX_NEW_TOKENS) + 1
    assert calls.probes >= 2 * (steps - 1)  # num_iterations gradient passes, at least, per optimised step
    assert tuple(range(rows)) in calls.rows_seen
    assert all(set(seen) <= set(range(rows)) for seen in calls.rows_seen)


def test_outside_cocon(engine):
    tokens = reply(engine, "greedy", [("cocon", {"content": "pizza"}), ("record-steps", {})])
    (calls,) = RECORDS
    assert calls.probes == 0 and calls.rows_seen == {(0,)}
    assert len(tokens) <= steps_taken(calls) <= len(tokens) + 1


def test_in_the_shared_batch_and_beside_it(engine):
    """Score steerers share the batch with other replies; a step steerer runs beside it:
    each reply's recorder sees its own rows only, and the replies equal the same alone."""
    texts = ["hi there", "what do you like to eat?", "tell me about your weekend"]
    options = [
        ReplyOptions(decoder="greedy", steerers=[("record-scores", {})], max_new_tokens=8),
        ReplyOptions(decoder="mmi", decoder_settings=CANDIDATES, steerers=[("record-scores", {})], seed=1),
        ReplyOptions(decoder="greedy", steerers=[("record-steps", {})], max_new_tokens=8),
    ]
    alone = []
    for text, option in zip(texts, options):
        RECORDS.clear()
        response = engine.reply_to([text], option)
        response.text()
        alone.append(response.token_ids)
    RECORDS.clear()
    with Scheduler(engine) as scheduler:
        handles = [scheduler.submit([Message("user", t)], o) for t, o in zip(texts, options)]
        for handle in handles:
            assert handle.wait(60) and handle.error is None
    assert [h.token_ids for h in handles] == alone
    assert len(RECORDS) == 3
    assert sorted(tuple(sorted(calls.rows_seen)) for calls in RECORDS) == [((0,),), ((0,),), ((0, 1, 2),)]
    for calls in RECORDS:
        assert calls.probes == 0
        steps_taken(calls)
