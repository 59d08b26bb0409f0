"""The fast path (chatcore.serving.static_step) run eagerly on the CPU: its fixed shapes, per-row
positions and masks give the replies of the ragged step and of transformers' ``generate``."""

from __future__ import annotations

import pytest
from test_architectures import hf_greedy
from test_serving import OPTIONS, PROMPTS, alone

from chatcore.engine import ReplyOptions
from chatcore.errors import ChatcoreError
from chatcore.prompting import Message
from chatcore.serving import Scheduler
from chatcore.serving import prompt_pass as prompt_pass_module
from chatcore.serving.prompt_pass import COMPILING as PROMPT_COMPILING
from chatcore.serving.static_step import (
    COMPILING,
    FAST_PATH_ENV,
    bucket_for,
    fast_path_on,
    idle_static_step,
    take_static_step,
)
from chatcore.testing import make_engine


@pytest.fixture(scope="module")
def llama_engine(tiny_chat_model_dir):
    return make_engine(tiny_chat_model_dir("llama"), "chatcore.plugins.bow_bias")


def batched(engine, prompts, options):
    with Scheduler(engine, max_batch=8) as scheduler:
        handles = [scheduler.submit([Message("user", p)], o) for p, o in zip(prompts, options)]
        for handle in handles:
            assert handle.wait(60) and handle.error is None
        fast = scheduler.runner.batch.static_step
    return [handle.token_ids for handle in handles], fast


def test_greedy_on_the_fast_path_equals_generate(llama_engine, monkeypatch):
    monkeypatch.setenv(FAST_PATH_ENV, "on")
    conversation = llama_engine.scripted(["hello there", "hey! how are you?", "pretty good, just got back"])
    expected = hf_greedy(llama_engine, conversation.messages(), 12)
    response = llama_engine.respond(conversation, decoder="greedy", max_new_tokens=12)
    response.text()
    assert response.token_ids == expected


@pytest.mark.parametrize("engine_name", [pytest.param("serving_engine", marks=pytest.mark.slow), "llama_engine"])
def test_batched_rows_on_the_fast_path_equal_the_ragged_step(engine_name, request, monkeypatch):
    """Six replies of different lengths (a bucket of 8: two padding rows) equal the same replies
    decoded alone on the ragged step, sampled ones and a steered one included."""
    engine = request.getfixturevalue(engine_name)
    prompts = [*PROMPTS, PROMPTS[1] * 3]
    options = [*OPTIONS, ReplyOptions(decoder="greedy", max_new_tokens=9)]
    monkeypatch.setenv(FAST_PATH_ENV, "off")
    expected = [alone(engine, p, o) for p, o in zip(prompts, options)]
    monkeypatch.setenv(FAST_PATH_ENV, "on")
    replies, fast = batched(engine, prompts, options)
    assert replies == expected
    assert fast is not None and fast.steps > 0 and fast.replays == 0  # eager on the CPU: nothing captured
    assert bucket_for(len(prompts)) == 8 and bucket_for(33) is None


def test_the_next_reply_on_a_model_takes_the_step_and_buffers_the_last_batch_handed_back(llama_engine, monkeypatch):
    """engine.respond builds a runner per reply; its batch hands the fast path (on a GPU, its
    captured graphs) and slot buffers back when it empties, and the next reply takes them:
    same step, same fixed inputs, same buffers, and replies equal to the ragged step's."""
    model, device = llama_engine.loaded.model, llama_engine.loaded.device
    conversations = [llama_engine.scripted(["hello there"]), llama_engine.scripted(["what do you like to eat?"])]
    monkeypatch.setenv(FAST_PATH_ENV, "off")
    expected = [hf_greedy(llama_engine, c.messages(), 8) for c in conversations]
    monkeypatch.setenv(FAST_PATH_ENV, "on")
    seen = []
    for conversation, reply in zip(conversations, expected):
        response = llama_engine.respond(conversation, decoder="greedy", max_new_tokens=8)
        response.text()
        assert response.token_ids == reply
        step = idle_static_step(model, device)
        assert step is not None and step.slots is not None and step.slots.rows == 0
        seen.append((step, step.steps, step.inputs[1], step.slots.slots[0].keys.data_ptr()))
    (first, first_steps, first_inputs, first_buffer), (again, steps, inputs, buffer) = seen
    assert again is first and steps > first_steps  # the second reply stepped on the same step
    assert inputs is first_inputs and buffer == first_buffer  # no new buffers: a captured graph stays valid


def test_two_batches_at_once_on_one_model_each_get_a_step(llama_engine, monkeypatch):
    from chatcore.serving.shared_batch import SharedBatch
    from chatcore.serving.static_step import take_static_step

    monkeypatch.setenv(FAST_PATH_ENV, "on")
    loaded = llama_engine.loaded
    first = take_static_step(loaded.model, loaded.device, "past_key_values")
    second = take_static_step(loaded.model, loaded.device, "past_key_values")
    assert first is not second
    assert SharedBatch(loaded.model, loaded.device).fast_path


def slot_cache(model, prompts):
    """A slot cache holding each prompt's key/values, a row each, as the shared batch builds it."""
    import torch

    from chatcore.models import output_cache
    from chatcore.serving.slots import SlotCache

    cache = None
    for ids in prompts:
        output = model(input_ids=torch.tensor([ids]), use_cache=True)
        layers = [(layer.keys, layer.values) for layer in output_cache(output).layers]
        cache = cache or SlotCache(len(layers))
        cache.append(layers, 1)
    return cache


@pytest.mark.parametrize("model_name", ["loaded", "tiny_llama"])
def test_the_fixed_step_gives_the_ragged_steps_logits(model_name, request):
    """Rows of 3, 40 and 11 tokens (a bucket of 4: one padding row), three steps: each row's
    logits on the fixed step equal those of the ragged step, row by row."""
    import torch

    from chatcore.models import cache_keyword
    from chatcore.serving.static_step import StaticStep

    model = request.getfixturevalue(model_name).model
    prompts = [[5, 6, 7], list(range(10, 50)), list(range(60, 71))]
    argument = cache_keyword(model)
    with torch.inference_mode():
        ragged, fixed = slot_cache(model, prompts), slot_cache(model, prompts)
        step = StaticStep(model, argument, capture=False)
        tokens = torch.tensor([[1], [2], [3]])
        for _ in range(3):
            positions, mask, _ = ragged.begin_step("cpu")
            output = model(
                input_ids=tokens, attention_mask=mask, position_ids=positions, **{argument: ragged}, use_cache=True
            )
            ragged.end_step()
            expected = output.logits[:, -1].float()
            logits = step.forward(tokens, fixed)
            fixed.end_step()
            assert logits is not None and torch.allclose(logits, expected, atol=1e-5)
            tokens = expected.argmax(-1, keepdim=True)
    assert step.steps == 3 and step.replays == 0


def test_the_setting_selects_the_path(loaded, monkeypatch):
    monkeypatch.setenv(FAST_PATH_ENV, "auto")
    assert fast_path_on(loaded.model, "cpu") is False  # the CPU keeps the ragged step
    monkeypatch.setenv(FAST_PATH_ENV, "on")
    assert fast_path_on(loaded.model, "cpu") is True
    assert not take_static_step(loaded.model, "cpu", "past_key_values").capture
    monkeypatch.setenv(FAST_PATH_ENV, "fast")
    with pytest.raises(ChatcoreError, match=f"^{FAST_PATH_ENV} must be one of auto, on, compile, off, got 'fast'$"):
        fast_path_on(loaded.model, "cpu")


def test_a_failed_capture_falls_back_to_the_eager_step(loaded, caplog):
    """Asked to capture where it cannot (no CUDA here), the step logs one debug line, stops trying
    and gives the eager step's logits."""
    import logging

    import torch

    from chatcore.models import cache_keyword
    from chatcore.serving.static_step import StaticStep

    model, argument = loaded.model, cache_keyword(loaded.model)
    prompts = [[5, 6, 7], list(range(10, 30))]
    tokens = torch.tensor([[1], [2]])
    with torch.inference_mode(), caplog.at_level(logging.DEBUG, logger="chatcore.serving.static_step"):
        expected = StaticStep(model, argument, capture=False).forward(tokens, slot_cache(model, prompts))
        step = StaticStep(model, argument, capture=True)
        logits = step.forward(tokens, slot_cache(model, prompts))
    assert not step.capture and step.replays == 0
    assert logits is not None and expected is not None and torch.equal(logits, expected)
    lines = [record.getMessage() for record in caplog.records if record.name == "chatcore.serving.static_step"]
    assert len(lines) == 1 and lines[0].startswith("fast path: capturing the decode step failed")


def test_a_compiled_step_gives_the_replies_of_generate(llama_engine, monkeypatch):
    """``compile``: the step's pass and the prompt's go through torch.compile (here without CUDA
    graphs), and the greedy replies equal transformers' generate: alone, batched, and after a
    prefix the prefix cache held (the prompt's second graph, with a cache to start from)."""
    import shutil

    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("torch.compile on the CPU needs a C++ compiler")
    monkeypatch.setenv(FAST_PATH_ENV, "compile")
    monkeypatch.delitem(prompt_pass_module._passes, llama_engine.loaded.model, raising=False)  # a fresh count
    conversations = [["what do you like to eat?"], ["what do you like to eat?", "pasta", "why?"], ["hello there"]]
    expected = [hf_greedy(llama_engine, llama_engine.scripted(turns).messages(), 8) for turns in conversations]
    options = ReplyOptions(decoder="greedy", max_new_tokens=8)
    with Scheduler(llama_engine) as scheduler:
        handles = []
        for turns in conversations:  # one after another: the second finds the first's prompt kept
            handle = scheduler.submit(llama_engine.scripted(turns).messages(), options)
            assert handle.wait(600) and handle.error is None
            handles.append(handle)
    assert [handle.token_ids for handle in handles] == expected
    assert handles[1].provenance["prefix_cached_tokens"] > 0
    response = llama_engine.respond(llama_engine.scripted(conversations[2]), decoder="greedy", max_new_tokens=8)
    response.text()
    assert response.token_ids == expected[2]
    step = idle_static_step(llama_engine.loaded.model, llama_engine.loaded.device)
    prompts = prompt_pass_module.prompt_pass(llama_engine.loaded.model)
    assert step is not None and step.wanted_compiled and step.steps > 0
    assert prompts is not None and prompts.passes == 4
    if not (step.compiled and prompts.compiled):  # it fell back (its warning is tested below)
        pytest.skip("torch.compile could not compile the passes on this machine")
    assert step._pass is not None and prompts.compiled_passes == 4


def test_a_prompt_the_model_refuses_leaves_the_prompt_pass_compiled(llama_engine, monkeypatch):
    """A prompt pass that fails compiled and uncompiled alike is the prompt's fault: its error
    is raised and the compiled pass is kept for the next prompt."""
    import torch

    from chatcore.serving.prompt_pass import PromptPass

    def compiled(model, **settings):
        return model  # the compiled pass fails where the model fails

    monkeypatch.setattr(torch, "compile", compiled)
    model = llama_engine.loaded.model
    prompts = PromptPass(model)
    too_far = torch.tensor([[model.config.vocab_size + 5]])  # no such token
    with torch.inference_mode(), pytest.raises(IndexError):
        prompts(input_ids=too_far, use_cache=False)
    assert prompts.compiled and prompts.passes == 1 and prompts.compiled_passes == 0
    with torch.inference_mode():
        prompts(input_ids=torch.tensor([[5, 6, 7]]), use_cache=False)
    assert prompts.compiled and prompts.compiled_passes == 1


def test_a_compile_that_fails_leaves_the_step_uncompiled(llama_engine, monkeypatch, caplog):
    """When torch.compile cannot make the pass (no compiler, an unsupported model), one warning
    says so and the step runs uncompiled: the reply is the one generate gives."""
    import logging

    import torch

    def broken(model, **settings):
        def run(**arguments):
            raise RuntimeError(
                "no working C++ compiler\n\nSet TORCHDYNAMO_VERBOSE=1 for the internal stack trace"
            )  # torch's advice: left out

        return run

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setenv(FAST_PATH_ENV, "compile")
    take_static_step(llama_engine.loaded.model, llama_engine.loaded.device, "past_key_values")  # a fresh step next
    monkeypatch.delitem(prompt_pass_module._passes, llama_engine.loaded.model, raising=False)  # and prompt pass
    conversation = llama_engine.scripted(["tell me about your dog"])
    expected = hf_greedy(llama_engine, conversation.messages(), 8)
    with caplog.at_level(logging.WARNING, logger="chatcore.serving"):
        response = llama_engine.respond(conversation, decoder="greedy", max_new_tokens=8)
        response.text()
    assert response.token_ids == expected
    lines = [record.getMessage() for record in caplog.records if record.name.startswith("chatcore.serving")]
    assert lines == [
        PROMPT_COMPILING,
        "fast path: compiling the prompt pass failed, running it uncompiled: RuntimeError: no working C++ compiler",
        COMPILING,
        "fast path: compiling the decode step failed, running it uncompiled: RuntimeError: no working C++ compiler",
    ]
    step = idle_static_step(llama_engine.loaded.model, llama_engine.loaded.device)
    assert step is not None and not step.compiled and step.wanted_compiled


def test_the_command_line_refuses_a_bad_setting_before_loading_a_model():
    """One line, exit status 1, and neither torch nor a model loaded."""
    import os
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from chatcore.cli import main\n"
        "try:\n"
        "    main(['generate', '--model', 'chatcore-tiny', 'hi'])\n"
        "except SystemExit as done:\n"
        "    print('exit', done.code, 'torch' in sys.modules, file=sys.stderr)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, FAST_PATH_ENV: "bogus"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = result.stderr.strip().splitlines()
    assert lines == [f"Error: {FAST_PATH_ENV} must be one of auto, on, compile, off, got 'bogus'", "exit 1 False"]


def runner_reply(runner, engine, prompt, options):
    """Add one reply to ``runner`` directly (as the scheduler admits it): its handle."""
    from chatcore.serving.requests import Handle

    reply = engine.prepare_reply([Message("user", prompt)], options)
    handle = Handle()
    runner.add(handle, engine.start_session(reply), reply.decoder, reply.provenance)
    return handle


def test_passes_run_ahead_keep_every_reply_as_rows_end_join_and_cancel(llama_engine, monkeypatch):
    """On the fast path the runner queues each step's next pass on the chosen tokens before
    reading them (chatcore.serving.ahead). Replies that end at different steps, one that joins
    while the batch runs ahead and one cancelled mid-reply leave every other reply as the
    ragged step gives it alone; the cancelled one got a prefix of its reply."""
    from chatcore.serving.runner import Runner

    specs = [
        ("hello there", ReplyOptions(decoder="greedy", max_new_tokens=14, min_new_tokens=14)),
        ("tell me about your dog", ReplyOptions(decoder="greedy", max_new_tokens=5, min_new_tokens=5)),
        ("what do you like to eat?", ReplyOptions(decoder="top-k", seed=4, max_new_tokens=12, min_new_tokens=12)),
        ("ok", ReplyOptions(decoder="top-k", seed=9, max_new_tokens=9, min_new_tokens=9)),
    ]
    monkeypatch.setenv(FAST_PATH_ENV, "off")
    expected = [alone(llama_engine, prompt, options) for prompt, options in specs]
    monkeypatch.setenv(FAST_PATH_ENV, "on")
    runner = Runner(llama_engine.loaded, llama_engine)
    runner.run_ahead = True  # a GPU's default; on the CPU it gains nothing but runs the same
    handles = [runner_reply(runner, llama_engine, prompt, options) for prompt, options in specs[:3]]
    while len(handles[0].token_ids) < 4:
        runner.step()
    ahead_before_join = runner.ahead_steps
    handles.append(runner_reply(runner, llama_engine, *specs[3]))  # joins a batch that ran ahead
    while len(handles[2].token_ids) < 6:
        runner.step()
    handles[2].cancel()
    while runner.jobs:
        runner.step()
    assert ahead_before_join > 0 and runner.ahead_steps > ahead_before_join
    for index in (0, 1, 3):
        assert handles[index].error is None and handles[index].token_ids == expected[index]
    cancelled = handles[2].token_ids
    assert 6 <= len(cancelled) < len(expected[2]) and cancelled == expected[2][: len(cancelled)]


def test_a_reply_run_ahead_leaves_the_prefix_its_next_turn_reuses(llama_engine, monkeypatch):
    """A pass run ahead feeds a reply's last token before the reply is seen to end: the prefix
    cache keeps it with its key/values, and the next turn, reusing it, equals the ragged step's
    reply without any cache."""
    conversation = [Message("system", "Be brief."), Message("user", "what do you like to eat?")]
    options = ReplyOptions(decoder="greedy", max_new_tokens=8, min_new_tokens=8)
    monkeypatch.setenv(FAST_PATH_ENV, "off")
    first = list(llama_engine.reply_tokens(llama_engine.prepare_reply(conversation, options)))
    follow = [*conversation, Message("assistant", llama_engine.tokenizer.decode(first)), Message("user", "why?")]
    second = list(llama_engine.reply_tokens(llama_engine.prepare_reply(follow, options)))
    monkeypatch.setenv(FAST_PATH_ENV, "on")
    with Scheduler(llama_engine) as scheduler:
        scheduler.runner.run_ahead = True
        handle = scheduler.submit(conversation, options)
        assert handle.wait(60) and handle.error is None and handle.token_ids == first
        again = scheduler.submit(follow, options)
        assert again.wait(60) and again.error is None
        ahead = scheduler.runner.ahead_steps
    assert again.token_ids == second
    assert ahead > 0 and again.provenance["prefix_cached_tokens"] > len(first)


@pytest.mark.parametrize("fast", ["off", "on"])
def test_replies_that_end_at_one_step_leave_the_others_rows_intact(llama_engine, monkeypatch, fast):
    """Two replies end at the same step, between and before rows that go on: their rows are
    dropped together before the next pass (one move of the rows kept), and every reply equals
    the one decoded alone."""
    from chatcore.serving.runner import Runner

    lengths = [5, 11, 5, 8, 5]
    prompts = ["hello there", "tell me about your dog", "ok", "what do you like to eat?", "why?"]
    options = [ReplyOptions(decoder="greedy", max_new_tokens=n, min_new_tokens=n) for n in lengths]
    monkeypatch.setenv(FAST_PATH_ENV, "off")
    expected = [alone(llama_engine, p, o) for p, o in zip(prompts, options)]
    monkeypatch.setenv(FAST_PATH_ENV, fast)
    runner = Runner(llama_engine.loaded, llama_engine)
    handles = [runner_reply(runner, llama_engine, p, o) for p, o in zip(prompts, options)]
    rows_seen = []
    while runner.jobs:
        runner.step()
        if runner.batch.cache is not None:
            rows_seen.append(runner.batch.cache.rows)
    assert [h.token_ids for h in handles] == expected
    assert 5 in rows_seen and 2 in rows_seen and 3 not in rows_seen[rows_seen.index(2) :]


def test_a_slot_cache_keeps_the_rows_asked_for_in_order():
    import torch

    from chatcore.serving.slots import SlotCache

    cache = SlotCache(2)
    rows = []
    for row, length in enumerate([3, 7, 2, 5]):
        layers = [
            (torch.full((1, 2, length, 4), 10.0 * layer + row), torch.full((1, 2, length, 4), -row))
            for layer in range(2)
        ]
        cache.append(layers, 1)
        rows.append(layers)
    cache.keep([1, 3])
    assert cache.lengths == [7, 5]
    for index, row in enumerate([1, 3]):
        for (keys, values), (expected_keys, expected_values) in zip(cache.row(index), rows[row]):
            assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    cache.keep([0])
    assert cache.lengths == [7]
    cache.keep([])
    assert cache.rows == 0
