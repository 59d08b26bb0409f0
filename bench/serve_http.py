"""The HTTP adapter under load: concurrent streaming clients (the openai client) against ``chatcore serve``'s app.

    python bench/serve_http.py [--model chatcore-tiny] [--clients 32] [--tokens 32] [--max-batch 16] [--threads 1]

--clients streaming requests start at once, each for up to --tokens tokens (at least
--min-tokens, when given); then the same requests are sent one after another (the peer).
Prints p50/p99 time to the first content chunk and to the end, total throughput and its
ratio to the one-after-another run, and checks that every request was answered exactly
once with its whole reply.
The server (uvicorn on a thread) runs in this process; the clients run in a process of their
own (--same-process: on threads of this one, where their stream parsing competes with the
server for the interpreter), both halves alike, on the same cores.
With --shared-history N it only times the first token of a request whose N-turn history an
earlier request sent (with another last message) against a short request's.
Otherwise it then scrapes GET /metrics, checks its reply and token counts against what the clients
received, and prints the scrape (with --metrics, the histograms' buckets too).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import statistics
import time
import urllib.request
from typing import Any

from benchlib import add_model_arguments, load_engine


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def shared_history(client, model: str, turns: int, repeats: int) -> None:
    """First token of a request whose ``turns``-turn history an earlier request sent (with
    another last message) against a short request's, medians of ``repeats``."""
    lines = ("i went hiking with my friends last weekend and it was a lot of fun", "that sounds great, where to?")

    def first_token(messages: list[dict]) -> float:
        start = time.perf_counter()
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=4, seed=0, stream=True)
        first = None
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - start
        return first if first is not None else time.perf_counter() - start

    shared, short = [], []
    for repeat in range(repeats + 1):
        history = [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"{lines[i % 2]} ({repeat})"}
            for i in range(turns)
        ]
        first_token([*history, {"role": "user", "content": "what did you eat there?"}])  # fills the prefix cache
        seconds = first_token([*history, {"role": "user", "content": "and who drove?"}])
        alone = first_token([{"role": "user", "content": f"hi, how are you? ({repeat})"}])
        if repeat:  # the first round warms up
            shared.append(seconds)
            short.append(alone)
    s, a = statistics.median(shared), statistics.median(short)
    print(
        f"first token, {turns}-turn history another request sent: {s * 1000:.1f} ms   "
        f"a short request: {a * 1000:.1f} ms   ratio {s / a:.2f}x"
    )


PROMPT = "hi, I am client {}. how are you?"


def direct(scheduler: Any, engine: Any, count: int, tokens: int, min_tokens: int | None) -> tuple[float, float, list]:
    """The same requests submitted to the scheduler directly (no HTTP, no clients): all at once,
    then one after another; the seconds of each, and the replies' token ids."""
    from chatcore.engine import ReplyOptions
    from chatcore.prompting import Message

    def submit(index: int) -> Any:
        options = ReplyOptions(seed=index, max_new_tokens=tokens, min_new_tokens=min_tokens or 1)
        return scheduler.submit([Message("user", PROMPT.format(index))], options)

    start = time.perf_counter()
    handles = [submit(index) for index in range(count)]
    for handle in handles:
        handle.wait()
    together = time.perf_counter() - start
    start = time.perf_counter()
    for index in range(count):
        submit(index).wait()
    return together, time.perf_counter() - start, [handle.token_ids for handle in handles]


@functools.cache
def client_for(url: str) -> Any:
    """One openai client per process and server, shared by the threads (its connection pool),
    as an application would hold one: building one per request costs more than a short reply."""
    import openai

    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)


def ask_once(url: str, model: str, tokens: int, index: int, min_tokens: int | None = None) -> dict:
    """One streaming chat request through the openai client: its timings, ids, text and usage."""
    client = client_for(url)
    start = time.perf_counter()
    first = None
    text, ids, usage = [], set(), None
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT.format(index)}],
        max_tokens=tokens,
        seed=index,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={} if min_tokens is None else {"min_tokens": min_tokens},
    )
    for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - start
            text.append(chunk.choices[0].delta.content)
    return {
        "index": index,
        "first": first,
        "total": time.perf_counter() - start,
        "ids": ids,
        "tokens": usage.completion_tokens if usage else 0,
        "text": "".join(text),
    }


def ask_all(
    url: str, model: str, tokens: int, min_tokens: int | None, indexes: list[int], together: bool
) -> tuple[list[dict], float]:
    """Every request at once (one thread each) or one after another; and the seconds it took."""
    ask = functools.partial(ask_once, url, model, tokens, min_tokens=min_tokens)
    start = time.perf_counter()
    if together:
        with concurrent.futures.ThreadPoolExecutor(len(indexes)) as pool:
            results = list(pool.map(ask, indexes))
    else:
        results = [ask(index) for index in indexes]
    return results, time.perf_counter() - start


class ClientProcess:
    """Runs the clients in a process of their own (spawned once), or on this one's threads."""

    def __init__(self, url: str, model: str, tokens: int, min_tokens: int | None, same_process: bool) -> None:
        self.call = functools.partial(ask_all, url, model, tokens, min_tokens)
        self.pool = None
        if not same_process:
            import multiprocessing

            self.pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))

    def timed(self, indexes: range | list[int], together: bool) -> tuple[list[dict], float]:
        if self.pool is None:
            return self.call(list(indexes), together)
        return self.pool.submit(self.call, list(indexes), together).result()

    def run(self, indexes: list[int], together: bool) -> list[dict]:
        return self.timed(indexes, together)[0]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--metrics", action="store_true", help="Print the whole /metrics scrape.")
    parser.add_argument(
        "--min-tokens",
        type=int,
        default=None,
        help="Ask every reply for at least this many tokens (min_tokens); = --tokens: replies of one length, "
        "as bench/serve_speed.py's scheduler measure decodes them.",
    )
    parser.add_argument(
        "--same-process",
        action="store_true",
        help="Run the clients on threads of the server's process instead of a process of their own.",
    )
    parser.add_argument(
        "--shared-history",
        type=int,
        default=0,
        help="Only time the first token of a request whose N-turn history another request sent before "
        "(with another last message) against a short request's.",
    )
    args = parser.parse_args()

    import openai
    import torch

    from chatcore.adapters.http_api.app import build_app
    from chatcore.adapters.http_api.server import start_in_thread
    from chatcore.serving import Scheduler

    engine = load_engine(args)
    print(
        f"model {args.model} on {engine.loaded.device}, threads {torch.get_num_threads()}, "
        f"{args.clients} streaming clients x {args.tokens} tokens, max batch {args.max_batch}"
    )
    with Scheduler(engine, max_batch=args.max_batch, max_waiting=args.clients) as scheduler:
        server = start_in_thread(build_app(scheduler))
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id

        if args.shared_history:
            try:
                shared_history(client, model, args.shared_history, repeats=5)
            finally:
                server.stop()
            return
        clients = ClientProcess(server.url, model, args.tokens, args.min_tokens, same_process=args.same_process)
        try:
            warm_up = clients.run([0], together=False)[0]
            results, together = clients.timed(range(args.clients), together=True)
            sequential, one_by_one = clients.timed(range(args.clients), together=False)
            with urllib.request.urlopen(server.url.removesuffix("/v1") + "/metrics") as response:
                scrape = response.read().decode()
            direct_together, direct_one_by_one, direct_ids = direct(
                scheduler, engine, args.clients, args.tokens, args.min_tokens
            )
        finally:
            clients.close()
            server.stop()

    answered = sorted(r["index"] for r in results)
    assert answered == list(range(args.clients)), answered
    assert all(len(r["ids"]) == 1 for r in results), "a stream mixed two completions"
    assert len({next(iter(r["ids"])) for r in results}) == args.clients, "two requests got the same completion"
    same = sum(r["text"] == s["text"] for r, s in zip(results, sequential))
    tokens = sum(r["tokens"] for r in results)
    for label, values in (
        ("first token", [r["first"] for r in results if r["first"] is not None]),
        ("whole reply", [r["total"] for r in results]),
    ):
        p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
        print(f"{label:12s} p50 {p50 * 1000:8.1f} ms   p99 {p99 * 1000:8.1f} ms")
    print(
        f"every request answered exactly once: {len(answered)}/{args.clients}; "
        f"{same}/{args.clients} replies equal to the same request sent alone; {tokens} tokens"
    )
    print(
        f"throughput: concurrent {args.clients / together:.2f} replies/s   one after another "
        f"{args.clients / one_by_one:.2f} replies/s   ratio {one_by_one / together:.2f}x"
    )
    print(f"median whole reply alone: {statistics.median(s['total'] for s in sequential) * 1000:.1f} ms")
    matching = sum(engine.tokenizer.decode(ids) == r["text"] for ids, r in zip(direct_ids, results))
    print(
        f"the same requests to the scheduler directly (no HTTP): together {args.clients / direct_together:.2f} "
        f"replies/s   one after another {args.clients / direct_one_by_one:.2f} replies/s   ratio "
        f"{direct_one_by_one / direct_together:.2f}x; {matching}/{args.clients} replies equal to the HTTP ones"
    )
    everything = [warm_up, *results, *sequential]
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in scrape.splitlines()
        if line.startswith("chatcore_") and "_bucket" not in line
    }
    replies = sum(v for k, v in values.items() if k.startswith("chatcore_replies_total"))
    print(
        f"/metrics against the clients: replies {replies:.0f} / {len(everything)}, completion tokens "
        f"{values['chatcore_completion_tokens_total']:.0f} / {sum(r['tokens'] for r in everything)}"
    )
    for line in scrape.splitlines():
        if line.startswith("chatcore_") and "_created" not in line and (args.metrics or "_bucket" not in line):
            print(f"  {line}")


if __name__ == "__main__":
    main()
