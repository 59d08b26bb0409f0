"""Greedy replies on the fast path against the eager step and ``transformers.generate``.

    python bench/fast_path_parity.py [--model chatcore-tiny] [--device cuda] [--dtype float32] [--tokens 24]
                                     [--fast on|compile]

For each of a few conversations (one to five turns), the greedy reply of ``engine.respond``
with the fast path on (on CUDA: its decode step captured as graphs and replayed), with it
off, and of ``transformers.generate`` on the same prompt ids; then every conversation at
once through the scheduler (one shared batch of mixed lengths, a bucket with padding rows),
fast path on. Prints each reply that differs, how many steps were replays of a captured
graph, and a summary line; exits 1 when any reply differs.

In float32 the three agree token for token; in bfloat16, attention kernels that differ
between the sides can flip a near tie, so compare there with care.
"""

from __future__ import annotations

import argparse
import os
import sys

CONVERSATIONS = [
    ["hi, how are you?"],
    ["what do you do for fun? i like to cook a lot and go hiking with my dog on weekends"],
    ["hello there", "hey! how are you?", "pretty good, just got back from the lake"],
    ["ok"],
    ["do you like pizza or pasta more?", "pasta, always", "why is that?", "it is softer", "fair enough"],
    ["tell me about your dog", "he is a big lab", "how old is he?"],
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="chatcore-tiny")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--fast", default="on", choices=("on", "compile"), help="the fast path's setting")
    args = parser.parse_args()

    import torch
    import transformers

    from chatcore.engine import Engine, ReplyOptions
    from chatcore.serving import Scheduler
    from chatcore.serving.static_step import FAST_PATH_ENV, idle_static_step
    from chatcore.testing import plugin_host

    transformers.logging.set_verbosity_error()
    engine = Engine(args.model, device=args.device, dtype=args.dtype, host=plugin_host())
    model, device = engine.loaded.model, engine.loaded.device
    options = ReplyOptions(decoder="greedy", max_new_tokens=args.tokens)
    stops = sorted(engine.prompt_format.stop_token_ids)
    banned = [[token] for token in sorted(engine.prompt_format.banned_token_ids)]

    def respond(turns: list[str], mode: str) -> list[int]:
        os.environ[FAST_PATH_ENV] = mode
        response = engine.respond(engine.scripted(turns), options)
        response.text()
        return list(response.token_ids)

    def generate(turns: list[str]) -> list[int]:
        prompt = engine.prompt(engine.scripted(turns), args.tokens).token_ids
        input_ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            output = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=args.tokens,
                min_new_tokens=options.min_new_tokens,  # stops banned before it, as chatcore does
                eos_token_id=stops,
                pad_token_id=stops[0],
                bad_words_ids=banned or None,
            )
        new = output[0, len(prompt) :].tolist()
        return next((new[:index] for index, token in enumerate(new) if token in stops), new)

    def batched(mode: str) -> list[list[int]]:
        os.environ[FAST_PATH_ENV] = mode
        with Scheduler(engine, max_batch=len(CONVERSATIONS), prefix_cache_bytes=0) as scheduler:
            handles = [scheduler.submit(engine.scripted(turns).messages(), options) for turns in CONVERSATIONS]
            for handle in handles:
                handle.wait()
                if handle.error is not None:
                    raise SystemExit(f"batched reply failed: {handle.error}")
        return [list(handle.token_ids) for handle in handles]

    print(f"model {args.model} on {device} ({engine.loaded.dtype}), torch {torch.__version__}, {args.tokens} tokens")
    differ = 0

    def compare(label: str, got: list[int], expected: list[int], turns: list[str]) -> None:
        nonlocal differ
        if got != expected:
            differ += 1
            at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
            seen, wanted = got[at : at + 6], expected[at : at + 6]
            print(f"  DIFFERS {label} ({len(turns)} turns), from token {at}: {seen} vs {wanted}")

    expected = [generate(turns) for turns in CONVERSATIONS]
    for turns, reference in zip(CONVERSATIONS, expected):
        compare(f"fast path {args.fast} vs generate", respond(turns, args.fast), reference, turns)
        compare("fast path off vs generate", respond(turns, "off"), reference, turns)
    step = idle_static_step(model, device)
    alone_replays = step.replays if step is not None else 0
    for turns, got, reference in zip(CONVERSATIONS, batched(args.fast), expected):
        compare(f"batched, fast path {args.fast} vs generate", got, reference, turns)
    step = idle_static_step(model, device)
    replays = (step.replays if step is not None else 0) - alone_replays
    print(f"  replays of a captured step: {alone_replays} alone, {replays} batched")
    if step is not None and step.compiled:
        from torch._dynamo.utils import counters

        print(f"  compiled pass: {dict(counters['stats'])}")
    checked = 3 * len(CONVERSATIONS)
    print(f"{checked - differ} of {checked} replies equal generate's" + ("" if differ else " (all)"))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
