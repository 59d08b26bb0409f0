"""A plain reply beside an eager one: what a slow step steerer (PPLM) costs the other rows.

    python bench/eager_beside.py [--model chatcore-tiny] [--threads 1] [--iterations 10] [--tokens 60] [--repeats 2]

The scheduler is driven directly. A plain top-k reply of exactly --tokens tokens is timed
alone, then again with a 40-token PPLM reply (``topic=food``, --iterations gradient steps
per token) admitted just before it; prints the two times, their ratio (1.0: the PPLM
reply costs the plain one nothing) and whether the plain reply's tokens were the same.
"""

from __future__ import annotations

import argparse
import threading
import time

from benchlib import add_model_arguments, load_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--iterations", type=int, default=10, help="PPLM's gradient steps per token")
    parser.add_argument("--tokens", type=int, default=60, help="the plain reply's length")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    from chatcore.engine import ReplyOptions
    from chatcore.prompting import Message
    from chatcore.serving import Scheduler

    engine = load_engine(args, "chatcore.plugins.pplm.plugin")
    plain = ReplyOptions(decoder="top-k", seed=3, max_new_tokens=args.tokens, min_new_tokens=args.tokens)
    pplm = ReplyOptions(
        decoder="top-k",
        seed=4,
        max_new_tokens=40,
        min_new_tokens=40,
        steerers=[("pplm", {"topic": "food", "num_iterations": args.iterations})],
    )

    def plain_reply(beside: bool) -> tuple[float, list[int]]:
        with Scheduler(engine) as scheduler:
            scheduler.submit([Message("user", "warm up")], ReplyOptions(decoder="greedy", max_new_tokens=2)).wait()
            steered = None
            if beside:
                started = threading.Event()
                steered = scheduler.submit(
                    [Message("user", "what did you cook today?")], pplm, listener=lambda event: started.set()
                )
                started.wait()  # its first token is out: it is decoding
            start = time.perf_counter()
            handle = scheduler.submit([Message("user", "hi, how was your weekend?")], plain)
            handle.wait()
            seconds = time.perf_counter() - start
            if steered is not None:
                steered.wait()
            return seconds, handle.token_ids

    print(f"model {args.model}, a {args.tokens}-token top-k reply beside a PPLM reply ({args.iterations} iterations)")
    for _ in range(args.repeats):
        alone, alone_ids = plain_reply(beside=False)
        beside, beside_ids = plain_reply(beside=True)
        print(
            f"alone {alone:.2f} s   beside PPLM {beside:.2f} s   ratio {beside / alone:.2f}x   "
            f"same tokens {alone_ids == beside_ids}"
        )


if __name__ == "__main__":
    main()
