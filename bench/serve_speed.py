"""Serving speed: the scheduler's batching and prefix caching against their peers, same model, same run.

    python bench/serve_speed.py [--model chatcore-tiny] [--conversations 16] [--tokens 32] [--threads 1]
    python bench/serve_speed.py --compare-threads torch,default,1 --conversations 1,16

1. Throughput: --conversations conversations each ask for a --tokens reply at the same
   moment (exactly that many tokens: stop tokens are banned until then). Served by the
   scheduler in one batch vs one at a time (``engine.respond``, as before the
   scheduler): replies per second and the ratio.
2. Time to the first token of the next turn of a conversation whose history is about
   0, 200 and 400 tokens: the scheduler with prefix caching (the previous turn's
   key/values are reused) vs without (the whole prompt is run) vs
   ``transformers.generate`` on the whole prompt. Medians of --repeats runs, and each
   one's ratio to its own time at the shortest history.
3. A long row's cost to the others (``--only long-row``): --conversations short
   conversations decode --tokens tokens each, alone in the batch, then beside one row
   whose history is --long-history tokens (admitted first; its prompt has been read
   before the short ones start). Prints the short rows' time per token both ways and
   the ratio (rows padded to the longest made it about 3.5x; the target is 1.3x).
4. Prompts that start together on a shared cached history (``--only shared-start``):
   --conversations prompts whose --shared-turns-turn history an earlier reply left in the
   prefix cache, each with another last message, added at once: the CPU time of the step
   that reads them (the runner's packed pass) against one pass per prompt (the same runner
   with its packed pass turned off), medians of --repeats rounds.
5. With --compare-threads: the batched throughput of part 1 at each thread count in turn
   (``torch``: torch's own default, one per core; ``default``: chatcore's, see chatcore.cpu),
   alternated within one process for --repeats rounds, so that every count sees the same
   load on a shared machine; medians in tokens/s for each --conversations count.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchlib import add_model_arguments, load_engine, long_conversation

QUESTIONS = (
    "what did you do this weekend?",
    "do you like cooking?",
    "what music do you listen to?",
    "where would you like to travel?",
    "what is your favourite film?",
    "do you have any pets?",
    "what do you do for work?",
    "what games do you play?",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--conversations", default="16", help="With --compare-threads: a comma-separated list.")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--histories", default="0,200,400", help="History lengths in tokens, comma-separated.")
    parser.add_argument("--long-history", type=int, default=1544, help="The long row's history in tokens (long-row).")
    parser.add_argument("--shared-turns", type=int, default=24, help="The shared history's turns (shared-start).")
    parser.add_argument(
        "--only", choices=["throughput", "first-token", "long-row", "shared-start"], default=None, help="Run one part."
    )
    parser.add_argument("--compare-threads", default=None, help="Thread counts to alternate: torch, default or N.")
    args = parser.parse_args()
    if args.compare_threads:
        compare_threads(args)
        return

    import torch
    import transformers

    from chatcore.serving import Scheduler

    engine = load_engine(args)
    print(
        f"model {args.model} on {engine.loaded.device}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, threads {torch.get_num_threads()}"
    )
    if args.only in (None, "throughput"):
        throughput(engine, args)
    if args.only in (None, "first-token"):
        first_token(engine, args, Scheduler)
    if args.only in (None, "long-row"):
        long_row(engine, args)
    if args.only in (None, "shared-start"):
        shared_start(engine, args)


def shared_start(engine, args) -> None:
    """CPU time of the step that reads prompts starting together on a cached shared history:
    the packed pass against one pass per prompt."""
    from chatcore.engine import ReplyOptions
    from chatcore.prompting import Message
    from chatcore.serving.prefix_cache import PrefixCache
    from chatcore.serving.requests import Handle
    from chatcore.serving.runner import Runner

    n = int(args.conversations)
    lines = ("i went hiking with my friends last weekend and it was a lot of fun", "that sounds great, where to?")
    history = [Message("user" if i % 2 == 0 else "assistant", lines[i % 2]) for i in range(args.shared_turns)]
    options = ReplyOptions(decoder="greedy", max_new_tokens=1)

    def first_step(packed: bool, round_: int) -> tuple[float, int]:
        runner = Runner(engine.loaded, engine, PrefixCache(2**28))
        if not packed:
            runner._prefill_together = lambda: None  # every prompt in a pass of its own

        def add(last: str) -> Handle:
            reply = engine.prepare_reply([*history, Message("user", last)], options)
            handle = Handle()
            handle.provenance = reply.provenance
            runner.add(handle, engine.start_session(reply), reply.decoder, reply.provenance)
            return handle

        add("hi")
        while runner.jobs:
            runner.step()
        handles = [add(f"question {i} of round {round_}: what did you eat?") for i in range(n)]
        start = time.thread_time()
        runner.step()
        return time.thread_time() - start, handles[0].provenance["prefix_cached_tokens"]

    times: dict[bool, list[float]] = {True: [], False: []}
    for round_ in range(args.repeats + 1):
        for packed in (True, False):
            seconds, cached = first_step(packed, round_)
            if round_:  # the first round warms up
                times[packed].append(seconds)
    together, apart = statistics.median(times[True]), statistics.median(times[False])
    print(
        f"{n} prompts starting together on a cached {args.shared_turns}-turn history ({cached} tokens cached each): "
        f"their first step {together * 1000:.1f} ms CPU packed, {apart * 1000:.1f} ms one pass each, "
        f"ratio {together / apart:.2f}x"
    )


def long_row(engine, args) -> None:
    """The short rows' time per token without and with one long-history row beside them."""
    from chatcore.engine import ReplyOptions
    from chatcore.serving import Scheduler
    from chatcore.serving.requests import End

    n, tokens = int(args.conversations), args.tokens
    shorts = []
    for index in range(n):
        conversation = engine.conversation()
        engine.add_user(conversation, f"hi, I am number {index}. {QUESTIONS[index % len(QUESTIONS)]}")
        shorts.append(conversation)
    budget = min(args.long_history, engine.loaded.max_positions - 4 * tokens - 8)
    long = long_conversation(engine, budget, 4 * tokens)
    history = len(engine.prompt(long, 4 * tokens).token_ids)
    options = [ReplyOptions(decoder="greedy", max_new_tokens=tokens, min_new_tokens=tokens) for _ in range(n)]
    long_options = ReplyOptions(decoder="greedy", max_new_tokens=4 * tokens, min_new_tokens=4 * tokens)

    def per_token(scheduler: Scheduler, beside_long: bool) -> float:
        """Seconds per token of the short rows, from their first token to their end."""
        long_handle = None
        if beside_long:
            long_handle = scheduler.submit(long, long_options)
            long_tokens = long_handle.tokens()  # held: dropping the iterator would cancel the reply
            next(long_tokens)  # its prompt has been read: it decodes from here on
        ends: dict[int, float] = {}
        handles = []
        for index, (conversation, option) in enumerate(zip(shorts, options)):

            def ended(event, index=index) -> None:
                if isinstance(event, End):
                    ends[index] = time.perf_counter()

            handles.append(scheduler.submit(conversation.messages(), option, listener=ended))
        for handle in handles:
            handle.wait()
            assert handle.error is None and len(handle.token_ids) == tokens, handle.error
        if long_handle is not None:
            assert not long_handle.finished.is_set(), "the long row ended before the short ones"
            long_handle.cancel()
            long_handle.wait()
        return statistics.median((ends[i] - h.first_token) / (tokens - 1) for i, h in enumerate(handles))

    with Scheduler(engine, max_batch=n + 1, max_waiting=n + 1, prefix_cache_bytes=0) as scheduler:
        times: dict[bool, list[float]] = {False: [], True: []}
        for round_ in range(args.repeats + 1):
            for beside in (False, True):
                seconds = per_token(scheduler, beside)
                if round_:  # the first round warms up
                    times[beside].append(seconds)
    alone, beside = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"long row: {n} short rows x {tokens} tokens, ms per token alone {alone * 1000:.1f}   beside a "
        f"{history}-token history {beside * 1000:.1f}   ratio {beside / alone:.2f}x"
    )


def throughput(engine, args) -> None:
    from chatcore.engine import ReplyOptions
    from chatcore.serving import Scheduler

    n, tokens = int(args.conversations), args.tokens
    conversations = []
    for index in range(n):
        conversation = engine.conversation()
        engine.add_user(conversation, f"hi, I am number {index}. {QUESTIONS[index % len(QUESTIONS)]}")
        conversations.append(conversation)
    options = [
        ReplyOptions(decoder="top-k", seed=index, max_new_tokens=tokens, min_new_tokens=tokens) for index in range(n)
    ]

    replies: dict[str, list[list[int]]] = {}

    def one_at_a_time() -> float:
        start = time.perf_counter()
        replies["alone"] = []
        for conversation, option in zip(conversations, options):
            response = engine.respond(conversation, option)
            response.text()
            assert len(response.token_ids) == tokens
            replies["alone"].append(response.token_ids)
            conversation.turns.pop()
        return time.perf_counter() - start

    def batched(scheduler: Scheduler) -> float:
        start = time.perf_counter()
        handles = [
            scheduler.submit(conversation.messages(), option) for conversation, option in zip(conversations, options)
        ]
        for handle in handles:
            handle.wait()
            assert handle.error is None and len(handle.token_ids) == tokens, handle.error
        replies["batched"] = [handle.token_ids for handle in handles]
        return time.perf_counter() - start

    with Scheduler(engine, max_batch=n, max_waiting=n, prefix_cache_bytes=0) as scheduler:
        one_at_a_time(), batched(scheduler)  # warm-up
        alone_times, batch_times = [], []
        for _ in range(args.repeats):
            alone_times.append(one_at_a_time())
            batch_times.append(batched(scheduler))
    alone_rate = n / statistics.median(alone_times)
    batch_rate = n / statistics.median(batch_times)
    print(
        f"throughput, {n} conversations x {tokens} tokens: one at a time {alone_rate:.2f} replies/s   "
        f"batched {batch_rate:.2f} replies/s   ratio {batch_rate / alone_rate:.2f}x"
    )
    same = sum(a == b for a, b in zip(replies["alone"], replies["batched"]))
    print(f"  batched replies token for token equal to the same replies decoded alone: {same}/{n}")


def compare_threads(args) -> None:
    import torch

    from chatcore.cpu import default_threads
    from chatcore.engine import ReplyOptions
    from chatcore.serving import Scheduler

    torch_default = torch.get_num_threads()  # before anything sets it
    counts = {"torch": torch_default, "default": default_threads()}
    labels = args.compare_threads.split(",")
    threads = {label: counts[label] if label in counts else int(label) for label in labels}
    engine = load_engine(args)
    print(f"model {args.model} on {engine.loaded.device}, torch {torch.__version__}, threads {threads}")
    for n in (int(c) for c in str(args.conversations).split(",")):
        conversations = []
        for index in range(n):
            conversation = engine.conversation()
            engine.add_user(conversation, f"hi, I am number {index}. {QUESTIONS[index % len(QUESTIONS)]}")
            conversations.append(conversation)
        options = [
            ReplyOptions(decoder="top-k", seed=i, max_new_tokens=args.tokens, min_new_tokens=args.tokens)
            for i in range(n)
        ]
        rates: dict[str, list[float]] = {label: [] for label in labels}
        with Scheduler(engine, max_batch=n, max_waiting=n, prefix_cache_bytes=0) as scheduler:
            for round_ in range(args.repeats + 1):
                for label in labels:
                    torch.set_num_threads(threads[label])
                    start = time.perf_counter()
                    handles = [scheduler.submit(c.messages(), o) for c, o in zip(conversations, options)]
                    for handle in handles:
                        handle.wait()
                    if round_:  # the first round warms up
                        rates[label].append(n * args.tokens / (time.perf_counter() - start))
        print(
            f"{n} conversations x {args.tokens} tokens, batched, tokens/s (median of {args.repeats}): "
            + "   ".join(f"{label} ({threads[label]}) {statistics.median(rates[label]):.1f}" for label in labels)
        )


def first_token(engine, args, Scheduler) -> None:
    import torch

    from chatcore.engine import ReplyOptions

    model, device, eos = engine.loaded.model, engine.loaded.device, engine.eos_token_id
    turn = ReplyOptions(decoder="greedy", max_new_tokens=args.tokens, seed=0)
    first = ReplyOptions(decoder="greedy", max_new_tokens=1, seed=0)

    def next_turn_ttft(scheduler, history: int) -> tuple[float, int, int]:
        """Reply to a conversation (filling the prefix cache if on), then time the next turn's first token."""
        scheduler.prefix_cache.clear()  # only the previous turn may be reused, not an earlier run of this one
        conversation = long_conversation(engine, history, args.tokens) if history else engine.conversation()
        if not history:
            engine.add_user(conversation, QUESTIONS[0])
        scheduler.respond(conversation, turn).text()
        engine.add_user(conversation, QUESTIONS[1])
        handle = scheduler.submit(conversation, first)
        handle.wait()
        reused = handle.provenance.get("prefix_cached_tokens", 0)
        return handle.first_token - handle.submitted, reused, handle.provenance["prompt_tokens"]

    def generate_ttft(history: int) -> float:
        conversation = long_conversation(engine, history, args.tokens) if history else engine.conversation()
        if not history:
            engine.add_user(conversation, QUESTIONS[0])
        conversation.add_bot_text("i like it a lot.")
        engine.add_user(conversation, QUESTIONS[1])
        ids = torch.tensor([engine.prompt(conversation, 1).token_ids], device=device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, pad_token_id=eos
            )
        return time.perf_counter() - start

    histories = [int(h) for h in args.histories.split(",")]
    rows = []
    with Scheduler(engine) as cached, Scheduler(engine, prefix_cache_bytes=0) as uncached:
        next_turn_ttft(cached, histories[-1]), next_turn_ttft(uncached, histories[-1]), generate_ttft(0)  # warm-up
        for history in histories:
            with_cache, without, generate = [], [], []
            for _ in range(args.repeats):
                seconds, reused, prompt = next_turn_ttft(cached, history)
                with_cache.append(seconds)
                without.append(next_turn_ttft(uncached, history)[0])
                generate.append(generate_ttft(history))
            rows.append(
                (
                    history,
                    prompt,
                    reused,
                    statistics.median(with_cache),
                    statistics.median(without),
                    statistics.median(generate),
                )
            )
    base = rows[0]
    print("time to first token of the next turn (ms; in brackets: the ratio to the shortest history)")
    for history, prompt, reused, with_cache, without, generate in rows:
        print(
            f"  history ~{history:4d} ({prompt:4d}-token prompt, {reused:4d} cached): "
            f"prefix cache {with_cache * 1000:7.1f} [{with_cache / base[3]:.2f}x]   "
            f"no cache {without * 1000:7.1f} [{without / base[4]:.2f}x]   "
            f"transformers.generate {generate * 1000:7.1f} [{generate / base[5]:.2f}x]"
        )


if __name__ == "__main__":
    main()
