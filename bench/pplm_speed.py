"""PPLM's cost per token against plain top-k decoding, in one run on one model.

    python bench/pplm_speed.py [--model chatcore-tiny] [--history 200] [--lengths 20,60]
                               [--iterations 3] [--repeats 3] [--threads N] [--pplm "carry=false"]

For each reply length, both configurations decode exactly that many tokens (EOS banned
until then) after a conversation history of about --history tokens; the median of
--repeats alternating runs is reported as tokens/s, with the ratio "pplm costs X times
plain decoding" and the target of (iterations + 2) times. A second, short history shows
whether the cost per token is flat in the history's length.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchlib import long_conversation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="chatcore-tiny")
    parser.add_argument("--history", type=int, default=200, help="tokens of conversation history")
    parser.add_argument("--lengths", default="20,60", help="reply lengths, comma-separated")
    parser.add_argument("--iterations", type=int, default=3, help="pplm num_iterations")
    parser.add_argument("--topic", default="food")
    parser.add_argument("--pplm", default="", help='extra pplm settings, e.g. "carry=false window_length=5"')
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()

    import torch
    import transformers

    from chatcore.engine import Engine, ReplyOptions
    from chatcore.options import parse_key_values
    from chatcore.plugin_manager import PluginHost

    if args.threads:
        torch.set_num_threads(args.threads)
    host = PluginHost()
    host.load_modules(("chatcore.plugins.top_k", "chatcore.plugins.pplm.plugin"))
    engine = Engine(args.model, device=args.device, host=host)
    device = engine.loaded.device
    parameters = sum(p.numel() for p in engine.loaded.model.parameters())
    print(
        f"model {args.model} ({parameters:,} parameters) on {device}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, threads {torch.get_num_threads()}"
    )

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def timed(conversation, steerers: list, n: int) -> float:
        options = ReplyOptions(decoder="top-k", seed=0, max_new_tokens=n, min_new_tokens=n, steerers=steerers)
        sync()
        start = time.perf_counter()
        response = engine.respond(conversation, options)
        response.text()
        sync()
        elapsed = time.perf_counter() - start
        assert len(response.token_ids) == n, (len(response.token_ids), n)
        conversation.turns.pop()  # the same prompt for every run
        return elapsed

    settings = {"topic": args.topic, "num_iterations": args.iterations, **parse_key_values(args.pplm.split())}
    pplm = [("pplm", settings)]
    print("pplm settings: " + " ".join(f"{key}={value}" for key, value in settings.items()))
    target = args.iterations + 2
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    for history in (args.history, 20):
        for n in lengths:
            conversation = long_conversation(engine, history, n)
            prompt_tokens = len(engine.prompt(conversation, n).token_ids)
            timed(conversation, [], n), timed(conversation, pplm, n)  # warm-up
            plain_times, pplm_times = [], []
            for _ in range(args.repeats):
                plain_times.append(timed(conversation, [], n))
                pplm_times.append(timed(conversation, pplm, n))
            plain_tps = n / statistics.median(plain_times)
            pplm_tps = n / statistics.median(pplm_times)
            ratio = plain_tps / pplm_tps
            verdict = "met" if ratio <= target else "not met"
            print(
                f"history {prompt_tokens:4d} tokens, reply {n:3d}: top-k {plain_tps:7.1f} tok/s   "
                f"pplm ({args.iterations} iterations) {pplm_tps:6.1f} tok/s   "
                f"pplm costs {ratio:.2f} times plain decoding (target <= {target}: {verdict})"
            )


if __name__ == "__main__":
    main()
