"""Decoding speed: chatcore's decoders vs transformers' generate, same model, same run.

    python bench/decode_speed.py [--model chatcore-tiny] [--tokens 64] [--repeats 7]

Both sides decode exactly --tokens new tokens (EOS banned until then) from the same
prompt; the median of --repeats alternating runs is reported, with the ratio
ours / generate in tokens per second (above 1.0 means chatcore is faster). Also the
time to the first token for a conversation whose history is about 400 tokens.

    python bench/decode_speed.py --fast-path-batch 8 [--tokens 32] [--repeats 3]

Instead: the fast path (chatcore/serving/static_step.py) against the ragged step, in one
run: --fast-path-batch conversations of different lengths decode --tokens greedy tokens
each through the scheduler, with CHATCORE_FAST_PATH=on and =off alternated; medians in
tokens/s and their ratio (on the CPU the fixed step runs eagerly: the ratio says whether
`auto` is right to leave it off there).
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchlib import add_model_arguments, load_engine, long_conversation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--fast-path-batch", type=int, default=0, help="compare the fast path (see above)")
    args = parser.parse_args()
    if args.fast_path_batch:
        fast_path(args)
        return

    import torch
    import transformers

    from chatcore.engine import ReplyOptions

    engine = load_engine(args)
    model = engine.loaded.model
    device = engine.loaded.device
    eos = engine.eos_token_id
    n = args.tokens
    print(
        f"model {args.model} ({sum(p.numel() for p in model.parameters()):,} parameters) on {device}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, threads {torch.get_num_threads()}"
    )

    conversation = engine.conversation()
    engine.add_user(conversation, "hi, how are you doing today? what did you do this weekend?")
    prompt = engine.prompt(conversation, n).token_ids
    input_ids = torch.tensor([prompt], device=device)
    mask = torch.ones_like(input_ids)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def ours(decoder: str, settings: dict) -> float:
        options = ReplyOptions(decoder=decoder, decoder_settings=settings, seed=0, max_new_tokens=n, min_new_tokens=n)
        sync()
        start = time.perf_counter()
        response = engine.respond(conversation, options)
        response.text()
        sync()
        elapsed = time.perf_counter() - start
        assert len(response.token_ids) == n, len(response.token_ids)
        conversation.turns.pop()  # keep the same prompt for every run
        return elapsed

    def theirs(**kwargs: object) -> float:
        torch.manual_seed(0)
        sync()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, pad_token_id=eos, **kwargs
            )
        sync()
        elapsed = time.perf_counter() - start
        assert out.shape[1] - input_ids.shape[1] == n
        return elapsed

    cases = [
        ("greedy", ("greedy", {}), {"do_sample": False}),
        (
            "top-k (k=40, T=0.8)",
            ("top-k", {"top_k": 40, "temperature": 0.8}),
            {"do_sample": True, "top_k": 40, "temperature": 0.8, "top_p": 1.0},
        ),
    ]
    for label, (decoder, settings), hf_kwargs in cases:
        ours(decoder, settings), theirs(**hf_kwargs)  # warm-up
        ours_times, hf_times = [], []
        for _ in range(args.repeats):
            ours_times.append(ours(decoder, settings))
            hf_times.append(theirs(**hf_kwargs))
        ours_tps = n / statistics.median(ours_times)
        hf_tps = n / statistics.median(hf_times)
        print(
            f"{label:22s} chatcore {ours_tps:8.1f} tok/s   transformers.generate {hf_tps:8.1f} tok/s   "
            f"ratio {ours_tps / hf_tps:.2f}x"
        )

    # Time to first token with a ~400-token history.
    chat = long_conversation(engine, 400, n)
    history_tokens = len(engine.prompt(chat, n).token_ids)
    long_ids = torch.tensor([engine.prompt(chat, n).token_ids], device=device)

    def first_token_ours() -> float:
        sync()
        start = time.perf_counter()
        response = engine.respond(chat, ReplyOptions(decoder="greedy", max_new_tokens=1, seed=0))
        next(iter(response), None)
        response.text()
        sync()
        elapsed = time.perf_counter() - start
        chat.turns.pop()
        return elapsed

    def first_token_theirs() -> float:
        sync()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                long_ids, attention_mask=torch.ones_like(long_ids), max_new_tokens=1, do_sample=False, pad_token_id=eos
            )
        sync()
        return time.perf_counter() - start

    first_token_ours(), first_token_theirs()
    ours_ttft = statistics.median(first_token_ours() for _ in range(args.repeats))
    hf_ttft = statistics.median(first_token_theirs() for _ in range(args.repeats))
    print(
        f"time to first token, {history_tokens}-token history: chatcore {ours_ttft * 1000:.1f} ms   "
        f"transformers.generate {hf_ttft * 1000:.1f} ms   ratio {hf_ttft / ours_ttft:.2f}x"
    )


def fast_path(args: argparse.Namespace) -> None:
    import os

    import torch

    from chatcore.engine import ReplyOptions
    from chatcore.prompting import Message
    from chatcore.serving import Scheduler
    from chatcore.serving.static_step import FAST_PATH_ENV

    engine = load_engine(args)
    n, rows = args.tokens, args.fast_path_batch
    options = ReplyOptions(decoder="greedy", max_new_tokens=n, min_new_tokens=n)
    line = "what did you do this weekend? i went hiking with my dog. "
    prompts = [line * (1 + index % 4) for index in range(rows)]  # rows of different lengths

    def served(mode: str) -> float:
        os.environ[FAST_PATH_ENV] = mode  # read when the scheduler's runner starts
        start = time.perf_counter()
        with Scheduler(engine, max_batch=rows, prefix_cache_bytes=0) as scheduler:
            handles = [scheduler.submit([Message("user", prompt)], options) for prompt in prompts]
            for handle in handles:
                assert handle.wait(600) and len(handle.token_ids) == n, handle.error
            steps = scheduler.runner.batch.static_step
            assert (steps is not None) == (mode == "on")
        if engine.loaded.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    served("on"), served("off")  # warm-up
    times: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(args.repeats):
        for mode in times:
            times[mode].append(served(mode))
    rate = {mode: rows * n / statistics.median(seconds) for mode, seconds in times.items()}
    print(
        f"model {args.model} on {engine.loaded.device}, threads {torch.get_num_threads()}, {rows} conversations x "
        f"{n} tokens: fast path {rate['on']:.1f} tok/s   ragged step {rate['off']:.1f} tok/s   "
        f"ratio {rate['on'] / rate['off']:.2f}x"
    )


if __name__ == "__main__":
    main()
