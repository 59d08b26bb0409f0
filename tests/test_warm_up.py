"""Warming the fast path up before serving (chatcore.serving.warm_up), on the CPU where the
fast path runs eagerly: the batches it runs, what it leaves behind, and its failures."""

from __future__ import annotations

import pytest

from chatcore.engine import ReplyOptions
from chatcore.errors import ChatcoreError
from chatcore.prompting import Message
from chatcore.serving import Scheduler, static_step
from chatcore.serving.static_step import BUCKETS, FAST_PATH_ENV, bucket_for
from chatcore.serving.warm_up import warm_up, warm_up_sizes
from chatcore.testing import make_engine


@pytest.fixture(scope="module")
def llama_engine(tiny_chat_model_dir):
    return make_engine(tiny_chat_model_dir("llama"))


@pytest.fixture
def steps_seen(monkeypatch):
    """(rows, longest row's columns) of every pass of the fast path's step."""
    seen: list[tuple[int, int]] = []
    forward = static_step.StaticStep.forward

    def spy(self, tokens, cache):
        seen.append((cache.rows, max(cache.lengths)))
        return forward(self, tokens, cache)

    monkeypatch.setattr(static_step.StaticStep, "forward", spy)
    return seen


def test_sizes_reach_every_bucket_up_to_the_batch_limit():
    assert warm_up_sizes(1) == (1,)
    assert warm_up_sizes(3) == (1, 2, 3)
    assert warm_up_sizes(8) == (1, 2, 4, 8)
    assert warm_up_sizes(32) == warm_up_sizes(256) == BUCKETS  # past the largest bucket: eager rows
    for limit in range(1, 40):
        buckets = {bucket_for(size) for size in warm_up_sizes(limit)}
        assert buckets == {bucket for bucket in BUCKETS if bucket <= (bucket_for(limit) or BUCKETS[-1])}


def test_warm_up_runs_every_bucket_and_longer_columns_then_leaves_nothing(llama_engine, monkeypatch, steps_seen):
    monkeypatch.setenv(FAST_PATH_ENV, "on")
    question = [Message("user", "what do you like to eat?")]
    options = ReplyOptions(decoder="greedy", max_new_tokens=8)
    with Scheduler(llama_engine, max_batch=6) as cold:
        expected = cold.submit(question, options)
        assert expected.wait(60) and expected.error is None
    steps_seen.clear()
    lines: list[str] = []
    with Scheduler(llama_engine, max_batch=6) as scheduler:
        warmed = warm_up(scheduler, say=lines.append)
        assert warmed is not None and warmed.sizes == (1, 2, 4, 6)
        rows = {rows for rows, _ in steps_seen}
        assert rows == {1, 2, 4, 6}
        # One step reads more columns than a first allocation holds (64): they are symbolic when compiled.
        assert max(columns for _, columns in steps_seen) > 64
        assert len(scheduler.prefix_cache) == 0 and scheduler.runner.jobs == []
        assert lines[0].startswith("warming up the fast path for batches of up to 6 (")
        assert lines[-1].startswith("warmed up in ")
        after = scheduler.submit(question, options)
        assert after.wait(60) and after.error is None
    assert after.token_ids == expected.token_ids


def test_off_the_fast_path_nothing_runs(llama_engine, monkeypatch, steps_seen):
    monkeypatch.setenv(FAST_PATH_ENV, "off")
    lines: list[str] = []
    with Scheduler(llama_engine, max_batch=4) as scheduler:
        assert warm_up(scheduler, say=lines.append) is None
        assert scheduler.runner.steps == 0 and steps_seen == [] and lines == []


def test_a_step_that_fails_is_one_line(llama_engine, monkeypatch):
    monkeypatch.setenv(FAST_PATH_ENV, "on")

    def broken(self, tokens, cache):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(static_step.StaticStep, "forward", broken)
    with Scheduler(llama_engine, max_batch=2) as scheduler:
        with pytest.raises(ChatcoreError) as caught:
            warm_up(scheduler)
    message = str(caught.value)
    assert message.startswith("warming the fast path up failed: ") and "out of memory" in message
    assert "\n" not in message


@pytest.mark.slow
def test_after_a_compiled_warm_up_requests_compile_nothing_and_equal_generate(llama_engine, monkeypatch):
    """``compile``: the warm-up compiles every graph the step and the prompt's pass need (one row,
    several, a cached prefix, buffers grown in slots and columns); replies after it (four rows
    at once, one growing past the columns the warm-up left, two sharing their history) compile
    nothing more and equal transformers' generate."""
    import shutil

    from test_architectures import hf_greedy
    from torch._dynamo.utils import counters

    from chatcore.serving import prompt_pass as prompt_pass_module

    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("torch.compile on the CPU needs a C++ compiler")
    monkeypatch.setenv(FAST_PATH_ENV, "compile")
    model = llama_engine.loaded.model
    monkeypatch.delitem(prompt_pass_module._passes, model, raising=False)
    sea = ["hello there", "hi!", "tell me about the sea " * 12]
    conversations = [["what do you like to eat?"], sea, ["why?"], [*sea[:2], sea[2] + "and the sky"]]
    # The last two share their history: one reuses the other's prompt from the prefix cache,
    # kept from a first pass (the model's transposed keys, not the step's buffers).
    lengths = [6, 6, 80, 6]  # the third one's columns grow past the warm-up's longest
    expected = [
        hf_greedy(llama_engine, llama_engine.scripted(turns).messages(), n) for turns, n in zip(conversations, lengths)
    ]
    with Scheduler(llama_engine, max_batch=4) as scheduler:
        warm_up(scheduler)
        step = scheduler.runner.batch.static_step or static_step.idle_static_step(model, llama_engine.loaded.device)
        if step is None or not step.compiled:
            pytest.skip("torch.compile could not compile the step on this machine")
        compiled = counters["stats"]["unique_graphs"]
        with scheduler.together():
            handles = [
                scheduler.submit(
                    llama_engine.scripted(turns).messages(),
                    ReplyOptions(decoder="greedy", max_new_tokens=n, min_new_tokens=n),
                )
                for turns, n in zip(conversations, lengths)
            ]
        for handle in handles:
            assert handle.wait(600) and handle.error is None
    assert [handle.token_ids for handle in handles] == expected
    assert counters["stats"]["unique_graphs"] == compiled


def test_steerers_plugins_name_are_warmed_up_and_one_that_fails_is_one_line(llama_engine, monkeypatch):
    """Under ``compile`` the warm-up runs a reply with each steerer a plugin's
    ``warm_up_steerers`` names: PPLM's compiled layers are made then, not at a user's first
    steered reply. A steerer that fails is told in one line, and the warm-up goes on.
    (torch.compile is replaced by the function itself: what is compiled is checked, not
    compiled, which takes minutes on the CPU.)"""
    import torch

    from chatcore import hookimpl
    from chatcore.plugins.pplm import compiled as pplm_compiled
    from chatcore.plugins.pplm import plugin as pplm_plugin

    class Broken:
        @hookimpl
        def warm_up_steerers(self, model):
            return [("no-such-steerer", {})]

    monkeypatch.setenv(FAST_PATH_ENV, "compile")
    monkeypatch.setattr(torch, "compile", lambda function, **settings: function)
    monkeypatch.setattr(pplm_compiled, "_compiled", {})
    monkeypatch.setattr(pplm_compiled, "_failed", False)
    engine = make_engine(llama_engine.loaded, pplm_plugin, Broken())
    said: list[str] = []
    with Scheduler(engine, max_batch=2) as scheduler:
        warmed = warm_up(scheduler, said.append)
        assert len(scheduler.prefix_cache) == 0
    assert warmed is not None
    assert {name for _, name in pplm_compiled._compiled} == {"project", "finish"}
    problems = [line for line in said if "no-such-steerer" in line]
    assert len(problems) == 1 and "plugin Broken" in problems[0] and "\n" not in problems[0]
    assert said[-1].startswith("warmed up in")


def test_off_compile_no_steerer_is_warmed_up(llama_engine, monkeypatch, steps_seen):
    """PPLM compiles nothing under ``on``: its hook names nothing, and the warm-up runs no steered reply."""
    from chatcore.plugins.pplm.plugin import warm_up_steerers

    monkeypatch.setenv(FAST_PATH_ENV, "on")
    assert warm_up_steerers(llama_engine.loaded) is None
    monkeypatch.setenv(FAST_PATH_ENV, "compile")
    assert warm_up_steerers(llama_engine.loaded) == [("pplm", {"topic": "food"})]
