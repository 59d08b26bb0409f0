"""The GPU suite: decode, serving, PPLM and CoCon training at real model shapes, bounded, in one run.

    python bench/gpu_suite.py [--shapes 135m,1.7b] [--tokens 64] [--bandwidth 4.8e12]
                              [--tokenizer .whl/smoltok] [--no-compile] [--compile-batches 1,32]
                              [--step-timeout 240] [--cocon-history 256] [--corpus chitchat]
                              [--workdir DIR] [--profile] [--batches 1,32] [--modes on,off]

For each shape, a Llama model with random weights (the time per token does not depend on
them) is built from a LlamaConfig at that shape, in bf16 on CUDA (float32 on the CPU), and
saved with a tokenizer into a temporary folder that chatcore loads. Then, with EOS banned
so every side decodes exactly --tokens tokens:

- decode, batch 1: chatcore alone (``engine.respond``) and in the scheduler's shared batch
  with the fast path on and off (``CHATCORE_FAST_PATH``; on it, with the next pass run
  ahead of reading a step's tokens, and with the tokens read first), against
  ``transformers.generate`` eager and generate with its static cache + ``torch.compile``;
  the batch-1 bandwidth limit (weight bytes / --bandwidth) and each side's share of it;
  whether the fast path captured its step, and what one replay of the captured step costs
  against a whole step of the loop (--profile: where the rest of a step goes, by function;
  --kernels: the kernels of one replay);
- decode, batch 32: 32 conversations through the scheduler against generate on a batch of 32;
- PPLM (3 iterations) against plain decoding and one CoCon training step against a plain
  forward and backward: ``bench/pplm_speed.py`` (under each of --pplm-modes: against plain
  decoding on the fast path, off it, and with both compiled: PPLM's layers and the plain
  step) and ``bench/cocon_speed.py --train`` (batch 64, --cocon-history tokens on
  CUDA) on the same folder, each bounded by --step-timeout seconds.

Without CUDA the same runs at a tiny shape (``--shapes tiny``, the default there) with the
bundled chatcore-tiny's tokenizer, so the suite is checked on any machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import load_engine

HERE = Path(__file__).resolve().parent
SHAPES: dict[str, dict[str, Any]] = {
    # SmolLM2-135M's own config supplies every other field; these are the differences.
    "tiny": dict(
        hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    # SmolLM2-135M's 30 layers at tiny's width: on the CPU a pass costs about what its operators'
    # dispatch costs, as on a GPU it costs about its launches (what compiling saves shows).
    "deep": dict(
        hidden_size=64, intermediate_size=256, num_hidden_layers=30, num_attention_heads=4, num_key_value_heads=2
    ),
    "135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3
    ),
    "1.7b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32
    ),
}


def build_model(shape: str, tokenizer_dir: str, folder: Path, cuda: bool) -> int:
    """Save a random-weight Llama at ``shape`` with the tokenizer into ``folder``; its weight bytes."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **SHAPES[shape],
    )
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16 if cuda else torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    return weight_bytes


def decode(folder: Path, args: argparse.Namespace, cuda: bool, weight_bytes: int) -> None:
    import torch

    from chatcore.engine import ReplyOptions
    from chatcore.serving import Scheduler, static_step
    from chatcore.serving.requests import End
    from chatcore.serving.static_step import FAST_PATH_ENV, idle_static_step

    engine = load_engine(argparse.Namespace(model=str(folder), device="cuda" if cuda else "cpu", threads=args.threads))
    model, device, n = engine.loaded.model, engine.loaded.device, args.tokens

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def conversations(count: int) -> list[Any]:
        made = []
        for index in range(count):
            conversation = engine.conversation()
            engine.add_user(conversation, f"hi, I am number {index}. what did you do this weekend?")
            made.append(conversation)
        return made

    options = ReplyOptions(decoder="greedy", seed=0, max_new_tokens=n, min_new_tokens=n)

    def alone() -> float:
        (conversation,) = conversations(1)
        sync()
        start = time.perf_counter()
        response = engine.respond(conversation, options)
        response.text()
        sync()
        assert len(response.token_ids) == n
        return n / (time.perf_counter() - start)

    last_run: dict[str, float] = {}

    def shared(scheduler: Scheduler, count: int) -> float:
        """Whole replies' tokens/s, from the first request to the last reply's end; noted for
        the last run: the rate after each reply's first token (its prompt read and its first
        token chosen: what decoding alone costs) and the loop's steps."""
        batch = conversations(count)
        ends: list[float] = []
        steps, ahead = scheduler.runner.steps, scheduler.runner.ahead_steps

        def ended(event: Any) -> None:
            if isinstance(event, End):
                ends.append(time.perf_counter())

        sync()
        start = time.perf_counter()
        handles = [scheduler.submit(conversation.messages(), options, ended) for conversation in batch]
        for handle in handles:
            handle.wait()
            assert handle.error is None and len(handle.token_ids) == n, handle.error
        sync()
        stop = time.perf_counter()
        first = min(handle.first_token or stop for handle in handles)
        last_run.update(
            after_first=count * (n - 1) / (max(ends) - first),
            first_ms=1000 * statistics.mean((handle.first_token or stop) - start for handle in handles),
            steps=scheduler.runner.steps - steps,
            ahead=scheduler.runner.ahead_steps - ahead,
        )
        return count * n / (stop - start)

    def generate(count: int, **kwargs: Any) -> float:
        prompt = engine.prompt(conversations(1)[0], n).token_ids
        input_ids = torch.tensor([prompt] * count, device=device)
        sync()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=engine.eos_token_id,
                **kwargs,
            )
        sync()
        assert out.shape[1] - input_ids.shape[1] == n
        return count * n / (time.perf_counter() - start)

    def median(measure: Any, *arguments: Any, **keywords: Any) -> tuple[float, float]:
        """The median rate of --repeats runs, and the seconds of the warm-up run before them
        (for the compiled and captured sides, their compilation and capture)."""
        start = time.perf_counter()
        measure(*arguments, **keywords)
        warm = time.perf_counter() - start
        return statistics.median(measure(*arguments, **keywords) for _ in range(args.repeats)), warm

    limit = args.bandwidth / weight_bytes
    print(f"  weights {weight_bytes / 1e6:.1f} MB; batch-1 bandwidth limit {limit:,.0f} tok/s")
    from transformers import CompileConfig

    # generate compiles its static-cache forward by itself on CUDA; elsewhere only when asked to.
    compile_config = CompileConfig(fullgraph=False, dynamic=False)
    compile_config._compile_all_devices = True

    def row(
        count: int, eager: float | None, label: str, measure: Any, *arguments: Any, **keywords: Any
    ) -> float | None:
        """Measure and print one side of ``count`` conversations (a failure is printed and the suite goes on)."""
        try:
            rate, warm = median(measure, *arguments, **keywords)
        except Exception as error:
            print(f"  batch {count:2d}  {label:50s} failed: {type(error).__name__}: {str(error)[:300]}")
            return None
        share = f"   {100 * rate / limit:5.1f} % of the limit" if count == 1 else ""
        versus = f"   {rate / eager:5.2f}x eager generate" if eager else ""
        print(f"  batch {count:2d}  {label:50s} {rate:9.1f} tok/s{versus}{share}   (first run {warm:.1f} s)")
        return rate

    for count in args.batches:
        eager = row(count, None, "transformers.generate eager", generate, count)
        if count == 1:
            row(count, eager, "chatcore alone (engine.respond)", alone)
        for mode, sizes in args.modes:  # the runner reads the setting when the scheduler starts
            if sizes and count not in sizes:
                continue
            previous = os.environ.get(FAST_PATH_ENV)
            setting, unfrozen = mode.removesuffix("-unfrozen"), mode.endswith("-unfrozen")
            os.environ[FAST_PATH_ENV] = setting
            static_step.FREEZE = not unfrozen
            if setting == "compile":  # dynamo would reuse the other variant's code for the same model
                torch._dynamo.reset()
            try:
                # With the fast path, the runner queues each step's next pass before reading its
                # tokens (chatcore.serving.ahead); the second row reads them first, for the peer.
                for ahead in (True, False) if setting != "off" else (True,):
                    with Scheduler(engine, max_batch=count, max_waiting=count, prefix_cache_bytes=0) as scheduler:
                        scheduler.runner.run_ahead = ahead
                        label = f"chatcore shared batch, fast path {mode}{'' if ahead else ', read first'}"
                        rate = row(count, eager, label, shared, scheduler, count)
                        if rate and last_run:
                            after = last_run["after_first"]
                            share = f" ({100 * after / limit:.1f} % of the limit)" if count == 1 else ""
                            print(
                                f"    first token after {last_run['first_ms']:.1f} ms (mean); "
                                f"after each reply's first token {after:,.1f} tok/s{share}; a run took "
                                f"{last_run['steps']:.0f} steps, {last_run['ahead']:.0f} of them run ahead"
                            )
                    if setting != "off" and rate and ahead:
                        report_fast_path(idle_static_step(model, device), count, rate, sync, args.kernels and cuda)
            finally:
                static_step.FREEZE = True
                if previous is None:
                    del os.environ[FAST_PATH_ENV]
                else:
                    os.environ[FAST_PATH_ENV] = previous
        if not args.no_compile and count in args.compile_batches:
            # compilation needs a C compiler and can fail on a bare machine: row() prints that
            static = dict(cache_implementation="static", compile_config=compile_config)
            row(count, eager, "generate static cache + compile", generate, count, **static)
    if args.profile:
        profile(alone)


def replay_kernels(graph: Any, replays: int = 20) -> None:
    """The kernels of one replay of a captured step, by their device time (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    events = [event for event in profiler.key_averages() if str(getattr(event, "device_type", "")).endswith("CUDA")]
    total = sum(event.self_device_time_total for event in events) / replays
    launches = sum(event.count for event in events) / replays
    print(f"    kernels of one replay: {launches:.0f}, {total / 1000:.2f} ms of device time; the largest:")
    for event in sorted(events, key=lambda event: -event.self_device_time_total)[:12]:
        share = event.self_device_time_total / replays
        print(f"      {share / 1000:6.3f} ms  x{event.count / replays:4.0f}  {event.key[:110]}")


def report_fast_path(step: Any, count: int, rate: float, sync: Any, kernels: bool = False) -> None:
    """Whether the fast path captured its step for ``count`` rows, and one replay's cost
    against a whole step of the loop (``count`` rows at ``rate`` tokens/s)."""
    if step is None:
        print(f"    fast path: no step in the pool after the batch of {count}")
        return
    captured = sorted(bucket for bucket, inputs in step.inputs.items() if inputs.graph is not None)
    print(f"    fast path: {step.steps} steps, {step.replays} replays; captured buckets {captured or 'none'}")
    inputs = step.inputs.get(count)
    if inputs is None or inputs.graph is None:
        return
    replays = 50  # the batch has ended: its slots are free, so replaying writes nowhere in use
    sync()
    start = time.perf_counter()
    for _ in range(replays):
        inputs.graph.replay()
    sync()
    replay_ms = 1000 * (time.perf_counter() - start) / replays
    step_ms = 1000 * count / rate
    print(f"    one replay {replay_ms:.2f} ms; one step of the loop {step_ms:.2f} ms ({replay_ms / step_ms:.0%} of it)")
    if kernels:
        try:
            replay_kernels(inputs.graph)
        except Exception as error:  # the profiler is a bonus: the suite goes on
            print(f"    kernels of one replay: not profiled: {type(error).__name__}: {error}")
    import torch

    if torch.cuda.is_available():
        print(f"    device memory allocated {torch.cuda.memory_allocated() / 1e9:.2f} GB")


def profile(alone: Any) -> None:
    """Where one reply's time goes, by function (fast path as configured)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    alone()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    print("  profile of one reply (engine.respond), by own time:")
    for line in text.getvalue().splitlines()[4:]:
        if line.strip():
            print(f"    {line[:150]}")


def run_bench(script: str, extra: list[str], timeout: int, environment: dict[str, str] | None = None) -> None:
    """Run another benchmark on the same folder, bounded; print its output indented."""
    command = [sys.executable, str(HERE / script), *extra]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(environment or {})}
        )
        text = done.stdout + (done.stderr[-600:] if done.returncode else "")
    except subprocess.TimeoutExpired as stopped:  # keep what it printed before the limit
        partial = stopped.stdout or b""
        text = (partial.decode(errors="replace") if isinstance(partial, bytes) else partial) + (
            f"\n(stopped after {timeout} s)"
        )
    for line in text.strip().splitlines():
        print(f"    {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shapes", default=None, help="comma-separated: tiny, deep, 135m, 1.7b (default: 135m,1.7b on CUDA)"
    )
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bandwidth", type=float, default=None, help="bytes/s (default: 4.8e12, an H200; CPU 2e10)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: .whl/smoltok on CUDA)")
    parser.add_argument("--no-compile", action="store_true", help="skip generate with static cache + torch.compile")
    parser.add_argument("--compile-batches", default="1,32", help="batch sizes that run generate static + compile")
    parser.add_argument("--batches", default="1,32", help="batch sizes to decode")
    parser.add_argument(
        "--modes",
        default="on,off",
        help="fast path settings of the shared batch: on, compile, compile-unfrozen (weights not read as "
        "constants), off; MODE@1+32 runs one at those batch sizes only",
    )
    parser.add_argument("--profile", action="store_true", help="profile one batch-1 reply by function")
    parser.add_argument("--kernels", action="store_true", help="CUDA: kernels of a captured step's replay")
    parser.add_argument("--cocon-history", type=int, default=None, help="CoCon windows' history (CUDA: 256, else 32)")
    parser.add_argument("--corpus", default="chitchat", help="dialogues of the CoCon step: chitchat or a JSONL file")
    parser.add_argument("--workdir", default=None, help="build the models here and keep them (default: a temp folder)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: decode, pplm, cocon")
    parser.add_argument(
        "--pplm-modes",
        default="on,off,compile",
        help="CHATCORE_FAST_PATH settings PPLM runs under (compile: its layers compiled too)",
    )
    parser.add_argument(
        "--cocon-compile", action="store_true", help="CoCon compiled too off CUDA (on CUDA it always runs)"
    )
    parser.add_argument("--step-timeout", type=int, default=240, help="seconds for each of pplm and cocon")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    args.compile_batches = {int(size) for size in args.compile_batches.split(",") if size}
    args.batches = [int(size) for size in args.batches.split(",") if size]
    # "mode@1+32": that mode at those batch sizes only
    args.modes = [
        (mode, {int(size) for size in sizes.split("+")} if sizes else set())
        for mode, _, sizes in (entry.partition("@") for entry in args.modes.split(",") if entry)
    ]
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 64  # several compiled variants of one model in one process

    import torch

    from chatcore.models import BUNDLED_DIR
    from chatcore.serving.static_step import FAST_PATH_ENV

    cuda = torch.cuda.is_available()
    shapes = (args.shapes or ("135m,1.7b" if cuda else "tiny")).split(",")
    args.bandwidth = args.bandwidth or (4.8e12 if cuda else 2e10)
    tokenizer = args.tokenizer or (".whl/smoltok" if cuda else str(BUNDLED_DIR / "chatcore-tiny"))
    skip = set(args.skip.split(","))
    device = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"device {device}, torch {torch.__version__}, fast path {os.environ.get('CHATCORE_FAST_PATH', 'auto')}")
    cocon_history = args.cocon_history or (256 if cuda else 32)
    with tempfile.TemporaryDirectory() as scratch:
        for shape in shapes:
            folder = Path(args.workdir or scratch) / shape
            weight_bytes = build_model(shape, tokenizer, folder, cuda)  # rebuilt each run: the same seed
            print(f"shape {shape}: {weight_bytes // (2 if cuda else 4) / 1e6:.2f}M parameters")
            if "decode" not in skip:
                decode(folder, args, cuda, weight_bytes)
            common = ["--model", str(folder), *(["--threads", str(args.threads)] if args.threads else [])]
            if "pplm" not in skip:
                for mode in args.pplm_modes.split(","):
                    print(f"  PPLM (3 iterations) vs plain top-k, fast path {mode}:")
                    run_bench(
                        "pplm_speed.py",
                        [*common, "--lengths", "20", "--history", "64", "--repeats", "2"],
                        args.step_timeout * (2 if mode == "compile" else 1),  # and the compilation
                        {FAST_PATH_ENV: mode},
                    )
            if "cocon" not in skip:
                for compiled in (False, True) if cuda or args.cocon_compile else (False,):
                    print(f"  CoCon training step vs a plain forward and backward{', compiled' if compiled else ''}:")
                    run_bench(
                        "cocon_speed.py",
                        [
                            *common,
                            *["--train", "--history", str(cocon_history), "--repeats", "2", "--corpus", args.corpus],
                            *(["--batch", "64"] if cuda else []),
                            *(["--compile"] if compiled else []),
                        ],
                        args.step_timeout * (2 if compiled else 1),  # and the compilation
                    )


if __name__ == "__main__":
    main()
