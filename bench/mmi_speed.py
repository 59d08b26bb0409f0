"""MMI reranking speed: ``mmi`` with N candidates vs one top-k reply vs N top-k replies in a loop.

    python bench/mmi_speed.py [--model chatcore-tiny] [--candidates 8] [--repeats 5] [--prompts 8]

All three configurations answer the same prompts with the same sampling settings
(top_k=40, temperature=0.8). Each round runs every prompt once per configuration,
interleaved so that other load on the machine hits all three alike; the round's
total is one measurement and the median over rounds is reported. The loop of N
replies is how the DialoGPT scripts rerank; the target is mmi <= 3x a single reply.

Two settings, one run: replies that end at EOS as in a chat (the batch runs until
the decoder's quorum of candidates has ended, half of them by default, or with
--quorum 1 until the longest ends, so the sampled lengths matter), and every reply
exactly --fixed-tokens long (the cost of batching alone).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

PROMPTS = [
    "hi, how are you?",
    "what do you do for fun?",
    "i just got a new puppy!",
    "do you like pizza?",
    "what kind of music do you listen to?",
    "i am so tired today, work was brutal",
    "have you ever been to new york?",
    "what are you doing this weekend?",
    "my favorite movie is the matrix",
    "i think it is going to rain tomorrow",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="chatcore-tiny")
    parser.add_argument("--reverse-model", default="chatcore-tiny-reverse")
    parser.add_argument("--candidates", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="rounds over all prompts")
    parser.add_argument("--prompts", type=int, default=8, help=f"how many of the {len(PROMPTS)} built-in prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--fixed-tokens", type=int, default=32, help="reply length of the equal-length comparison")
    parser.add_argument("--quorum", type=float, default=None, help="mmi's quorum setting (default: the decoder's own)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    args = parser.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from chatcore.engine import Engine, ReplyOptions
    from chatcore.plugin_manager import PluginHost

    host = PluginHost()
    host.load_modules(("chatcore.plugins.top_k", "chatcore.plugins.mmi.plugin"))
    engine = Engine(args.model, device=args.device, host=host)
    n = args.candidates
    sampling = {"top_k": 40, "temperature": 0.8}
    mmi_settings = {**sampling, "candidates": n, "reverse_model": args.reverse_model}
    if args.quorum is not None:
        mmi_settings["quorum"] = args.quorum
    prompts = PROMPTS[: args.prompts]
    print(
        f"model {args.model} + reverse {args.reverse_model} on {engine.loaded.device}, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, {len(prompts)} prompts x {args.repeats} rounds, "
        f"load average at start {os.getloadavg()[0]:.2f}"
    )

    def sync() -> None:
        if engine.loaded.device.startswith("cuda"):
            torch.cuda.synchronize()

    def measure(title: str, min_new_tokens: int, max_new_tokens: int) -> float:
        def reply(prompt: str, decoder: str, settings: dict, seed: int) -> tuple[float, dict]:
            options = ReplyOptions(
                decoder=decoder,
                decoder_settings=settings,
                seed=seed,
                min_new_tokens=min_new_tokens,
                max_new_tokens=max_new_tokens,
            )
            sync()
            start = time.perf_counter()
            response = engine.reply_to([prompt], options)
            response.text()
            sync()
            return time.perf_counter() - start, response.provenance

        def run_mmi(prompt: str, seed: int) -> tuple[float, dict]:
            return reply(prompt, "mmi", mmi_settings, seed)

        def run_single(prompt: str, seed: int) -> tuple[float, dict]:
            return reply(prompt, "top-k", sampling, seed)

        def run_loop(prompt: str, seed: int) -> tuple[float, dict]:
            # The DialoGPT scripts' way: N independent replies, then rerank (the reranking
            # itself is left out here, which only favours the loop).
            total = 0.0
            for offset in range(n):
                elapsed, _ = reply(prompt, "top-k", sampling, seed * n + offset)
                total += elapsed
            return total, {}

        loop_name = f"top-k x{n} loop"
        configurations = {"mmi": run_mmi, "top-k x1": run_single, loop_name: run_loop}
        for prompt in prompts[:2]:  # warm-up: loads the reverse model, fills caches
            for run in configurations.values():
                run(prompt, 10_000)

        rounds: dict[str, list[float]] = {name: [] for name in configurations}
        mmi_parts: dict[str, list[float]] = {}
        candidate_steps: list[int] = []
        single_tokens: list[int] = []
        for round_index in range(args.repeats):
            totals = dict.fromkeys(configurations, 0.0)
            for prompt_index, prompt in enumerate(prompts):
                names = list(configurations)
                shift = (round_index + prompt_index) % len(names)  # rotate the order
                for name in names[shift:] + names[:shift]:
                    elapsed, provenance = configurations[name](prompt, round_index)
                    totals[name] += elapsed
                    if name == "mmi":
                        for part, seconds in provenance["details"]["mmi"]["timings"].items():
                            mmi_parts.setdefault(part, []).append(seconds)
                        candidate_steps.append(
                            min(max_new_tokens, max(len(c["token_ids"]) for c in provenance["candidates"]) + 1)
                        )
                    elif name == "top-k x1":
                        single_tokens.append(min(max_new_tokens, provenance["timings"]["new_tokens"] + 1))
            for name, total in totals.items():
                rounds[name].append(total)

        medians = {name: statistics.median(times) for name, times in rounds.items()}
        single = medians["top-k x1"]
        print(f"\n{title}")
        for name, median in medians.items():
            print(
                f"  {name:16s} {median / len(prompts) * 1000:8.1f} ms per reply (median of {args.repeats} rounds)   "
                f"{median / single:5.2f}x a single top-k reply"
            )
        print(f"  mmi vs the loop of {n}: {medians[loop_name] / medians['mmi']:.2f}x faster")
        parts = ", ".join(f"{part} {statistics.mean(values) * 1000:.1f} ms" for part, values in mmi_parts.items())
        print(f"  mmi breakdown (mean per reply): {parts}")
        print(
            f"  decoding steps: mmi batch {statistics.mean(candidate_steps):.1f} "
            "(until its quorum of candidates ended), "
            f"single top-k reply {statistics.mean(single_tokens):.1f}"
        )
        return medians["mmi"] / single

    natural = measure(
        f"replies end at EOS (as in a chat), max_new_tokens {args.max_new_tokens}", 1, args.max_new_tokens
    )
    fixed = measure(
        f"every reply and candidate exactly {args.fixed_tokens} tokens (batching cost alone)",
        args.fixed_tokens,
        args.fixed_tokens,
    )
    print(
        f"\ntarget mmi <= 3x a single reply: {'met' if natural <= 3 else 'NOT met'} with replies ending at EOS "
        f"({natural:.2f}x), {'met' if fixed <= 3 else 'NOT met'} at equal length ({fixed:.2f}x); "
        f"load average at end {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
