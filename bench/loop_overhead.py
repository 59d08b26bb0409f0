"""The decoding loop's own cost: the runner with the model's pass replaced by fixed logits.

    python bench/loop_overhead.py [--model chatcore-tiny] [--batches 1,32] [--tokens 64]
                                  [--repeats 3] [--prefix-cache-mb 0] [--threads 1]

On a GPU the model's pass is one replay of a captured graph; what the host does around
it (choosing, recording, streaming, admitting, joining, leaving) decides how much of the
card's time is used. This runs the scheduler's loop on the fast path (fixed-shape step,
next pass run ahead, as on a GPU) with that pass replaced by fixed logits, so what is
left is the loop alone, on any machine: per batch size, the steps a run of --tokens
tokens takes (its replies joining and leaving included), the median host time of a
steady step (every reply in the batch, none starting or ending) and the torch operators
such a step runs (views included: on a GPU each is a dispatch, and each non-view one a
kernel launch). A greedy reply of --tokens tokens per conversation, EOS banned.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from benchlib import add_model_arguments, load_engine, operators


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefix-cache-mb", type=int, default=0, help="the scheduler's prefix cache (0: off)")
    args = parser.parse_args()
    os.environ["CHATCORE_FAST_PATH"] = "on"

    import torch

    from chatcore.engine import ReplyOptions
    from chatcore.prompting import Message
    from chatcore.serving import Scheduler, static_step
    from chatcore.serving.runner import Runner

    engine = load_engine(args)
    width = engine.loaded.model.get_output_embeddings().weight.shape[0]
    fixed: dict[int, torch.Tensor] = {}

    def fixed_pass(self: Any, inputs: Any) -> torch.Tensor:  # the model's pass, replaced
        bucket = inputs.staged.shape[1]
        if bucket not in fixed:
            fixed[bucket] = torch.randn(bucket, 1, width, generator=torch.Generator().manual_seed(bucket))
        return fixed[bucket]

    static_step.StaticStep._run = fixed_pass  # type: ignore[method-assign]

    steady: list[float] = []
    counts: list[int] = []
    plain_step = Runner.step

    def timed_step(runner: Runner) -> None:
        """One step; a steady one's host time (and, one in four, its operators) noted."""
        count = getattr(runner, "measured_rows", 0)
        is_steady = (
            count > 0
            and len(runner.jobs) == len(runner.batch.jobs) == count
            and all(0 < job.generated < args.tokens - 1 for job in runner.jobs)
        )
        if is_steady and (len(steady) + len(counts)) % 4 == 3:
            counts.append(operators(lambda: plain_step(runner), views=True))
            return
        start = time.perf_counter()
        plain_step(runner)
        if is_steady:
            steady.append(time.perf_counter() - start)

    Runner.step = timed_step  # type: ignore[method-assign]
    options = ReplyOptions(decoder="greedy", seed=0, max_new_tokens=args.tokens, min_new_tokens=args.tokens)
    print(f"model {args.model}, the model's pass replaced by fixed logits, {args.tokens} tokens a reply")
    for count in [int(size) for size in args.batches.split(",") if size]:
        steady.clear()
        counts.clear()
        with Scheduler(
            engine, max_batch=count, max_waiting=count, prefix_cache_bytes=args.prefix_cache_mb * 2**20
        ) as scheduler:
            runner = scheduler.runner
            runner.run_ahead = True

            def run(count: int = count) -> None:
                handles = [
                    scheduler.submit([Message("user", f"hi, I am number {index}. what did you do?")], options)
                    for index in range(count)
                ]
                for handle in handles:
                    handle.wait()
                    assert handle.error is None and len(handle.token_ids) == args.tokens, handle.error

            run()  # warm-up
            runner.measured_rows = count  # type: ignore[attr-defined]
            before = runner.steps
            start = time.perf_counter()
            for _ in range(args.repeats):
                run()
            seconds = time.perf_counter() - start
            steps = (runner.steps - before) / args.repeats
        print(
            f"  batch {count:2d}: {steps:.0f} steps a run, {1000 * seconds / args.repeats:.1f} ms a run; "
            f"a steady step {1000 * statistics.median(steady):.3f} ms (median of {len(steady)}), "
            f"{statistics.median(counts):.0f} operators"
        )


if __name__ == "__main__":
    main()
