"""What the server's warm-up compiles, and whether requests after it compile anything more.

    python bench/warm_up.py [--model chatcore-tiny] [--fast compile] [--max-batch 8] [--threads 1]

Under ``CHATCORE_FAST_PATH=compile`` (default here) a scheduler warms the fast path up
(``chatcore.serving.warm_up``, what ``chatcore serve`` and the Discord bot run before they
take requests) and then serves requests of every kind the warm-up stands for: one alone,
one continuing a conversation with a long message, a batch of three, a full batch of
long prompts, a reply growing past the key/value columns allocated so far, prompts longer
than a prefill chunk, sampled replies with log-probabilities, and a PPLM reply. It
prints the graphs torch.compile made (``unique_graphs``) and the seconds taken, for the
warm-up and for the requests after it: the goal is that the requests compile nothing.
With ``--no-warm-up`` the same requests run cold, for the comparison.
"""

from __future__ import annotations

import argparse
import os
import time

from benchlib import add_model_arguments, load_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--fast", default="compile", choices=("on", "compile"))
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--no-warm-up", action="store_true")
    args = parser.parse_args()
    os.environ["CHATCORE_FAST_PATH"] = args.fast

    from torch._dynamo.utils import counters

    from chatcore.engine import ReplyOptions
    from chatcore.prompting import Message
    from chatcore.serving import Scheduler
    from chatcore.serving.warm_up import LONG_MESSAGE, warm_up

    engine = load_engine(args, "chatcore.plugins.pplm.plugin")  # PPLM: a steered reply after the warm-up

    def graphs() -> int:
        return int(counters["stats"]["unique_graphs"])

    def run(scheduler: Scheduler, conversations: list[list[Message]], tokens: int = 6, **settings: object) -> None:
        options = ReplyOptions(decoder="greedy", seed=0, max_new_tokens=tokens, min_new_tokens=tokens)
        options = options.model_copy(update=settings)
        with scheduler.together():
            handles = [scheduler.submit(messages, options) for messages in conversations]
        for handle in handles:
            handle.wait()
            assert handle.error is None, handle.error

    with Scheduler(engine, max_batch=args.max_batch) as scheduler:
        start, before = time.perf_counter(), graphs()
        if not args.no_warm_up:
            warmed = warm_up(scheduler)
            print(
                f"warm-up ({args.fast}, batches {warmed.sizes if warmed else ()}): "
                f"{graphs() - before} graphs compiled in {time.perf_counter() - start:.1f} s",
                flush=True,
            )
        start, before = time.perf_counter(), graphs()
        first = [Message("user", "hi! what are you up to?")]
        run(scheduler, [first])
        run(scheduler, [[*first, Message("assistant", "not much."), Message("user", LONG_MESSAGE + " And you?")]])
        run(scheduler, [[Message("user", f"question {index}: do you like music?")] for index in range(3)])
        run(scheduler, [[Message("user", f"{index}. {LONG_MESSAGE}")] for index in range(args.max_batch)])
        run(scheduler, [[Message("user", "tell me a long story")]], tokens=150)  # past the columns allocated so far
        # Prompts longer than a prefill chunk (one chunk, then several) read before their prompt's pass.
        for repeats in (6, 12):
            run(scheduler, [[Message("user", f"{repeats}: " + " ".join([LONG_MESSAGE] * repeats))]])
        # Sampled, with log-probabilities, beside a greedy reply.
        sampled = {"decoder": "top-k", "decoder_settings": {"top_k": 20}, "logprobs": 3}
        run(scheduler, [[Message("user", "what is your favourite food?")], [Message("user", "and drink?")]], **sampled)
        # A steered reply (PPLM's layers are compiled under ``compile``; its hook warms them up).
        run(scheduler, [[Message("user", "what do you like to cook?")]], steerers=[("pplm", {"topic": "food"})])
        print(
            f"requests after it: {graphs() - before} graphs compiled in {time.perf_counter() - start:.1f} s "
            f"(all graphs {graphs()})",
            flush=True,
        )


if __name__ == "__main__":
    main()
