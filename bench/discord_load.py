"""Discord load: N channels message the bot at the same moment, in one process.

    python bench/discord_load.py [--model chatcore-tiny] [--channels 20] [--max-batch 1,8]
                                 [--queue-size 20] [--rounds 3] [--max-new-tokens 32]
                                 [--threads 1] [--db FILE]

The real ChatBot, its worker and the serving scheduler run against dpytest's fake
Discord (no network), once per batch size in ``--max-batch``: 1 decodes one reply at a
time (as the bot did before it used the scheduler), larger sizes batch the channels.
The last line gives each size's replies per second as a ratio to the first size's.
each round, every channel gets one message at once (from its own member, so the
per-user cooldown does not apply). Checked every round: each message gets exactly one
reply, in its own channel; replies that did not fit the queue are the bot's "busy"
answer and are counted. Printed: replies per second (all replies, and model replies),
and the event loop's worst lag, measured by a 10 ms ticker while the model worked.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections import Counter


async def run(args: argparse.Namespace, max_batch: int) -> float:
    import discord.ext.test as dpytest

    from chatcore.adapters.discord_bot.bot import BUSY_REPLY, ChatBot, bot_intents
    from chatcore.adapters.discord_bot.config import DiscordSettings
    from chatcore.adapters.discord_bot.conversations import ChatRuntime
    from chatcore.adapters.discord_bot.persistence import LogPersistence, MemoryPersistence
    from chatcore.adapters.discord_bot.worker import InferenceWorker
    from chatcore.engine import Engine
    from chatcore.plugin_manager import PluginHost

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    host = PluginHost()
    host.load_modules(("chatcore.plugins.greedy", "chatcore.plugins.top_k"))
    engine = Engine(args.model, host=host)
    settings = DiscordSettings(
        model=args.model,
        max_batch=max_batch,
        queue_size=args.queue_size,
        cooldown_s=0,
        max_new_tokens=args.max_new_tokens,
        log=args.db is not None,
        db=args.db,
    )

    def open_runtime() -> ChatRuntime:
        persistence = LogPersistence(engine, args.db) if args.db else MemoryPersistence()
        return ChatRuntime(engine, persistence, max_batch=max_batch, queue_size=args.queue_size)

    worker: InferenceWorker[ChatRuntime] = InferenceWorker(
        open_runtime, queue_size=max_batch + args.queue_size, close_resource=ChatRuntime.close
    )
    worker.start()
    await worker.ready()
    intents = bot_intents()
    intents.members = True  # dpytest fakes message authors from the member cache
    bot = ChatBot(settings, worker, intents=intents)
    dpytest.configure(bot, text_channels=args.channels, voice_channels=0, members=args.channels)
    await bot._async_setup_hook()
    await bot.prepare()
    config = dpytest.get_config()
    channels = config.channels[: args.channels]
    bot.settings = DiscordSettings(**{**settings.__dict__, "channels": tuple(c.id for c in channels)})

    loop = asyncio.get_running_loop()
    lags: list[float] = []
    ticking = True

    async def ticker() -> None:
        while ticking:
            expected = loop.time() + 0.010
            await asyncio.sleep(0.010)
            lags.append(loop.time() - expected)

    print(
        f"model {args.model}, {args.channels} channels at once, batch {max_batch}, queue {args.queue_size}, "
        f"up to {args.max_new_tokens} tokens per reply, {args.rounds} round(s)"
    )
    ticks = asyncio.ensure_future(ticker())
    totals: Counter[str] = Counter()
    rates = []
    for round_index in range(args.rounds):
        busy_before, replies_before = bot.stats.busy, bot.stats.replies
        started = time.perf_counter()
        await asyncio.gather(
            *(
                dpytest.message(
                    f"round {round_index}: hello from channel {index}, how are you?",
                    channel=channel,
                    member=config.members[index],
                )
                for index, channel in enumerate(channels)
            )
        )
        await dpytest.run_all_events()
        elapsed = time.perf_counter() - started
        sent = []
        while not dpytest.sent_queue.empty():
            sent.append(dpytest.sent_queue.get_nowait())
        per_channel = Counter(message.channel.id for message in sent)
        lost = [c.id for c in channels if per_channel[c.id] == 0]
        doubled = [c.id for c in channels if per_channel[c.id] > 1]
        busy = sum(message.content == BUSY_REPLY for message in sent)
        replies = bot.stats.replies - replies_before
        assert not lost and not doubled, f"lost {lost}, more than one reply in {doubled}"
        assert busy == bot.stats.busy - busy_before and replies + busy == len(channels)
        totals.update(replies=replies, busy=busy)
        rates.append(len(sent) / elapsed)
        print(
            f"round {round_index + 1}: {len(sent)} replies ({replies} from the model, {busy} busy) "
            f"in {elapsed:.2f} s = {len(sent) / elapsed:.1f} replies/s, {replies / elapsed:.1f} model replies/s"
        )
    ticking = False
    await ticks
    await worker.stop(5)
    lags.sort()
    print(
        f"all rounds: {totals['replies']} model replies, {totals['busy']} busy replies, none lost; "
        f"median {statistics.median(rates):.1f} replies/s"
    )
    print(
        f"event loop lag over {len(lags)} ticks: max {lags[-1] * 1000:.1f} ms, "
        f"p99 {lags[max(0, int(len(lags) * 0.99) - 1)] * 1000:.1f} ms"
    )
    return statistics.median(rates)


async def run_all(args: argparse.Namespace) -> None:
    sizes = [int(size) for size in args.max_batch.split(",")]
    rates = []
    for size in sizes:
        rates.append(await run(args, size))
        print()
    print(
        "replies/s: "
        + ", ".join(f"batch {size}: {rate:.1f} ({rate / rates[0]:.2f}x)" for size, rate in zip(sizes, rates))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="chatcore-tiny")
    parser.add_argument("--channels", type=int, default=20)
    parser.add_argument("--max-batch", default="1,8", help="batch sizes to compare, the first is the peer")
    parser.add_argument("--queue-size", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--db", default=None, help="log to this SQLite file (default: no log)")
    args = parser.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING)
    asyncio.run(run_all(args))


if __name__ == "__main__":
    main()
