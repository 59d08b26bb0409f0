"""One step of the shared batch, alone: what a long-history row costs the other rows.

    python bench/batch_step.py [--model chatcore-tiny] [--short 30] [--long 445] [--rows 8] [--repeats 30]

Times the batch's forward pass (the slot cache of chatcore.serving.slots, one token per
row) for --rows short rows; one more short row; the short rows beside one --long-token
row with the step's attention split by row length; and the same without the split
(every row reads the long row's columns, masked). Medians of --repeats alternating runs,
with each one's ratio to the short rows alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchlib import add_model_arguments, load_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--short", type=int, default=30)
    parser.add_argument("--long", type=int, default=445)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()

    import torch

    from chatcore.models import cache_keyword, output_cache
    from chatcore.serving.slots import RaggedPlan, SlotCache, ragged_pass

    engine = load_engine(args)
    model, device = engine.loaded.model, engine.loaded.device
    argument = cache_keyword(model)

    def prompt_layers(length: int) -> list:
        ids = torch.randint(1, 1000, (1, length), device=device)
        with torch.inference_mode():
            cache = output_cache(model(input_ids=ids, use_cache=True))
        return [(layer.keys, layer.values) for layer in cache.layers]

    short, long = prompt_layers(args.short), prompt_layers(args.long)
    layers = len(short)

    def batch(lengths: list[int]) -> SlotCache:
        cache = SlotCache(layers)
        for length in lengths:
            cache.append(short if length == args.short else long, 1)
        return cache

    def step(cache: SlotCache, split: bool) -> float:
        ids = torch.zeros((cache.rows, 1), dtype=torch.long, device=device)
        positions, mask, plan = cache.begin_step(device)
        if not split:
            plan = RaggedPlan(max(cache.lengths) + 1, ())
        start = time.perf_counter()
        with torch.inference_mode(), ragged_pass(model, plan) as extra:
            model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **{argument: cache},
                **extra,
            )
        elapsed = time.perf_counter() - start
        cache.end_step()
        cache.lengths = [length - 1 for length in cache.lengths]  # the next run writes the same column again
        return elapsed

    n = args.rows
    cases = {
        f"{n} short rows": ([args.short] * n, True),
        f"{n + 1} short rows": ([args.short] * (n + 1), True),
        f"{n} short + 1 long, split": ([args.short] * n + [args.long], True),
        f"{n} short + 1 long, padded": ([args.short] * n + [args.long], False),
    }
    caches = {label: batch(lengths) for label, (lengths, _) in cases.items()}
    times: dict[str, list[float]] = {label: [] for label in cases}
    for round_ in range(args.repeats + 1):
        for label, (_, split) in cases.items():
            seconds = step(caches[label], split)
            if round_:  # the first round warms up
                times[label].append(seconds)
    print(f"model {args.model}, threads {torch.get_num_threads()}, short rows {args.short} tokens, long {args.long}")
    base = statistics.median(next(iter(times.values())))
    for label, values in times.items():
        median = statistics.median(values)
        print(f"{label:28s} {median * 1000:8.2f} ms   {median / base:.2f}x")


if __name__ == "__main__":
    main()
