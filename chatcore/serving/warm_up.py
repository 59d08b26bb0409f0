"""Warming the fast path up before a server takes requests.

On the fast path (:mod:`chatcore.serving.static_step`) the shared batch's step is captured
as a CUDA graph the first time the batch holds each bucket's number of rows, and under
``CHATCORE_FAST_PATH=compile`` the step and the prompt's pass are compiled first: at
SmolLM2-1.7B's shape on an H200 the first reply of a process waited 103 s for its two
compilations, and the first batch of several rows waits for the step's second one (its
number of rows made symbolic). Left to the first requests, that wait falls on users, and
their clients time out.

:func:`warm_up` runs short replies to made-up messages through the scheduler before it
serves: one alone, then batches of 2, 4, ... rows up to ``max_batch``, so that every
bucket a batch can reach is compiled and captured. Nothing of them stays: they are
nobody's conversation, the log and the plugins' hooks never see them (those belong to
the adapters), and the prefix cache is emptied after them. Plugins name steerers to warm
up too (the ``warm_up_steerers`` hook): PPLM's layers, compiled under ``compile``. Off the
fast path (the CPU's default) there is nothing to warm up and nothing runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chatcore.errors import ChatcoreError
from chatcore.fast_path_setting import fast_path_mode
from chatcore.serving.static_step import BUCKETS

if TYPE_CHECKING:
    from chatcore.serving.scheduler import Scheduler

log = logging.getLogger(__name__)

# A reply's first token comes from its prompt's pass, the rest from the step. A prompt that
# shares its start with another of its batch may wait a step to reuse its keys: with four
# tokens each, the batch's rows still meet in the step.
WARM_UP_TOKENS = 4
WAIT_NOTE = {
    False: "capturing its step at each batch size",
    True: "CHATCORE_FAST_PATH=compile: compiling first, a minute or more for a large model",
}
# Longer than a first allocation of key/value columns (64) in any tokenizer.
LONG_MESSAGE = " ".join(["Tell me about the weather, the mountains and the sea."] * 10)


def _say_problem(say: Callable[[str], None] | None, problem: str) -> None:
    """A plugin's warm-up problem, on the server's console (else in the log): it starts anyway."""
    if say is not None:
        say(problem)
    else:
        log.warning("%s", problem)


def _steerers_of(plugin: str, steerers: Any, say: Callable[[str], None] | None) -> list[tuple[str, dict[str, Any]]]:
    """What a plugin's ``warm_up_steerers`` returned, as ``(name, settings)`` pairs; anything
    else is reported and left out."""
    if steerers is None:
        return []
    pairs = list(steerers) if isinstance(steerers, (list, tuple)) else None
    if pairs is None or not all(
        isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str) and isinstance(pair[1], dict)
        for pair in pairs
    ):
        _say_problem(say, f"plugin {plugin}: warm_up_steerers must return (name, settings) pairs, got {steerers!r:.80}")
        return []
    return pairs


@dataclass(frozen=True)
class WarmedUp:
    """What :func:`warm_up` ran: the batch sizes, and how long it took."""

    sizes: tuple[int, ...]
    seconds: float


def warm_up_sizes(max_batch: int) -> tuple[int, ...]:
    """The batch sizes that reach every bucket a batch of at most ``max_batch`` rows uses."""
    largest = min(max_batch, BUCKETS[-1])
    return (*(bucket for bucket in BUCKETS if bucket < largest), largest)


def warm_up(scheduler: Scheduler, say: Callable[[str], None] | None = None) -> WarmedUp | None:
    """Compile and capture the fast path's passes for what ``scheduler`` can run (see the
    module's docstring); None, running nothing, off the fast path. A reply that fails
    raises its error as a one-line ChatcoreError: the first request would meet it too.
    ``say``, if given, is told what is happening before and after (for a server's console).

    The replies, in order, each kind of pass a compiled graph specializes on:

    1. one row, a short prompt: the prompt's pass, and the step at one row (a row count of
       one is its own graph);
    2. one row continuing that conversation with a long message: the prompt's pass after a
       prefix from the prefix cache, and the step over more key/value columns than the
       first allocation holds (the columns made symbolic);
    3. batches of 2, 4, ... rows up to ``max_batch``: the step at several rows (their count
       symbolic), captured at each bucket;
    4. one row again, in the slot buffers the batches grew (their slots symbolic for one
       row's step too);
    5. one row with each steerer a plugin's ``warm_up_steerers`` hook names (PPLM's
       compiled layers under ``compile``); one that fails is told to ``say`` (else logged)
       and the warm-up goes on.
    """
    from chatcore.engine import ReplyOptions
    from chatcore.prompting import Message

    if not scheduler.runner.batch.fast_path:
        return None
    sizes = warm_up_sizes(scheduler.max_batch)
    if say is not None:
        say(f"warming up the fast path for batches of up to {sizes[-1]} ({WAIT_NOTE[fast_path_mode() == 'compile']})")
    start = time.perf_counter()
    options = ReplyOptions(
        decoder="greedy", seed=0, max_new_tokens=WARM_UP_TOKENS, min_new_tokens=WARM_UP_TOKENS, steerers=[]
    )

    def replies(*conversations: list[Message], steerers: list[tuple[str, dict[str, Any]]] | None = None) -> None:
        chosen = options if steerers is None else options.model_copy(update={"steerers": steerers})
        with scheduler.together():  # admitted at one step: one batch of that many rows
            handles = [scheduler.submit(messages, chosen) for messages in conversations]
        for handle in handles:
            handle.wait()
            if handle.error is not None:
                raise handle.error

    def run(*conversations: list[Message]) -> None:
        try:
            replies(*conversations)
        except ChatcoreError as error:
            raise ChatcoreError(f"warming the fast path up failed: {error}") from error

    first = [Message("user", "Hello! How are you today?")]
    run(first)
    run([*first, Message("assistant", "I am well, thank you."), Message("user", LONG_MESSAGE)])
    for size in sizes[1:]:
        run(*([Message("user", f"Hello! This is message {index} of {size}.")] for index in range(size)))
    if len(sizes) > 1:
        run(first)  # one row again, in the slot buffers the batches grew
    for plugin, steerers in scheduler.engine.host.call_each("warm_up_steerers", model=scheduler.engine.loaded):
        for name, settings in _steerers_of(plugin, steerers, say):
            try:
                replies(first, steerers=[(name, settings)])
            except ChatcoreError as error:  # the plugin's problem: its steerer fails for users too
                _say_problem(say, f"warming steerer {name!r} up (plugin {plugin}) failed: {error}")
    scheduler.prefix_cache.clear()  # nobody's prompts
    warmed = WarmedUp(sizes, time.perf_counter() - start)
    if say is not None:
        say(f"warmed up in {warmed.seconds:.1f} s")
    return warmed
