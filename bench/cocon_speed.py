"""CoCon decoding speed: plain top-k vs top-k steered by ``cocon``, same model, same run.

    python bench/cocon_speed.py [--model chatcore-tiny] [--history 200] [--tokens 60] [--repeats 5]

Both decode exactly --tokens new tokens (EOS banned until then) after a conversation
whose prompt is about --history tokens; the median of --repeats alternating runs is
reported as tokens per second, with the cost per token of cocon relative to plain
(cocon seconds per token / plain seconds per token; the target is at most 1.5x).
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchlib import add_model_arguments, load_engine, long_conversation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--block", default=None, help="CoCon block (default: the bundled one for the model)")
    parser.add_argument("--content", default="music")
    parser.add_argument("--history", type=int, default=200, help="prompt length in tokens (about)")
    parser.add_argument("--tokens", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch
    import transformers

    from chatcore.engine import ReplyOptions

    engine = load_engine(args, "chatcore.plugins.cocon.plugin")
    device = engine.loaded.device
    n = args.tokens

    conversation = long_conversation(engine, args.history, n)
    history_tokens = len(conversation.prompt(n).token_ids)

    cocon_settings = {"content": args.content}
    if args.block:
        cocon_settings["block"] = args.block
    configurations = {
        "plain top-k": [],
        f"top-k + cocon content={args.content}": [("cocon", cocon_settings)],
    }

    def sync() -> None:
        if str(device).startswith("cuda"):
            torch.cuda.synchronize()

    def run(steerers: list) -> float:
        options = ReplyOptions(
            decoder="top-k",
            decoder_settings={"top_k": 40, "temperature": 0.8},
            seed=0,
            steerers=steerers,
            max_new_tokens=n,
            min_new_tokens=n,
        )
        sync()
        start = time.perf_counter()
        response = conversation.reply(options)
        response.text()
        sync()
        elapsed = time.perf_counter() - start
        assert len(response.token_ids) == n, len(response.token_ids)
        conversation.turns.pop()  # the same history for every run
        return elapsed

    print(
        f"model {args.model} on {device}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"threads {torch.get_num_threads()}; {history_tokens}-token history, {n} new tokens"
    )
    for steerers in configurations.values():
        run(steerers)  # warm-up (loads the block, fills caches of the allocator)
    times: dict[str, list[float]] = {label: [] for label in configurations}
    for _ in range(args.repeats):
        for label, steerers in configurations.items():
            times[label].append(run(steerers))
    medians = {label: statistics.median(values) for label, values in times.items()}
    plain_label = next(iter(configurations))
    for label, seconds in medians.items():
        print(f"{label:34s} {n / seconds:8.1f} tok/s   {1000 * seconds / n:6.2f} ms/token")
    for label, seconds in medians.items():
        if label != plain_label:
            print(f"cost per token, {label} / {plain_label}: {seconds / medians[plain_label]:.2f}x")


if __name__ == "__main__":
    main()
