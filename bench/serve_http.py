"""The HTTP adapter under load: concurrent streaming clients (the openai client) against ``chatcore serve``'s app.

    python bench/serve_http.py [--model chatcore-tiny] [--clients 32] [--tokens 32] [--max-batch 16] [--threads 1]

--clients streaming requests start at once, each for up to --tokens tokens; then the
same requests are sent one after another (the peer). Prints p50/p99 time to the first
content chunk and to the end, total throughput and its ratio to the one-after-another
run, and checks that every request was answered exactly once with its whole reply.
The server (uvicorn on a thread) and the clients share this process and its cores.
With --shared-history N it only times the first token of a request whose N-turn history an
earlier request sent (with another last message) against a short request's.
Otherwise it then scrapes GET /metrics, checks its reply and token counts against what the clients
received, and prints the scrape (with --metrics, the histograms' buckets too).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import time
import urllib.request

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--metrics", action="store_true", help="Print the whole /metrics scrape.")
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

        def ask(index: int) -> dict:
            start = time.perf_counter()
            first = None
            text, ids, usage = [], set(), None
            stream = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"hi, I am client {index}. how are you?"}],
                max_tokens=args.tokens,
                seed=index,
                stream=True,
                stream_options={"include_usage": True},
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

        if args.shared_history:
            try:
                shared_history(client, model, args.shared_history, repeats=5)
            finally:
                server.stop()
            return
        try:
            warm_up = ask(0)
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
                results = list(pool.map(ask, range(args.clients)))
            together = time.perf_counter() - start
            start = time.perf_counter()
            sequential = [ask(index) for index in range(args.clients)]
            one_by_one = time.perf_counter() - start
            with urllib.request.urlopen(server.url.removesuffix("/v1") + "/metrics") as response:
                scrape = response.read().decode()
        finally:
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
