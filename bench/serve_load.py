"""``chatcore serve`` under streaming load, checkout against checkout and thread setting against thread setting.

    python bench/serve_load.py --checkout main=/path/to/a --checkout base=/path/to/b \\
        [--model chatcore-tiny:32:1,4,16,32] [--model smollm2:16:1,4,16] [--deadline 900]

For each checkout (a source tree with its own ``.venv``), each model (NAME:TOKENS:LEVELS)
and each thread setting (the server's default, and one thread: ``--threads 1`` where the
checkout has the option, else ``OMP_NUM_THREADS=1``), starts ``chatcore serve`` in a
process of its own, then at each level sends that many streaming requests at once (the
official openai client, ``max_tokens`` TOKENS, each its own seed) and prints a row:
replies, completion tokens per second over the level, and the p50/p99 time to the first
content chunk. Each row's throughput is also given as a ratio to the first row of its model
and level (the peer measured in the same run). A level past the deadline is skipped and says so.
After the load, the last server's ``/metrics`` scrape is printed (counters and sums).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass


@dataclass
class Row:
    checkout: str
    model: str
    threads: str
    clients: int
    replies: int
    tokens: int
    seconds: float
    first_p50: float
    first_p99: float

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))] if ordered else float("nan")


def has_threads_option(checkout: str) -> bool:
    help_text = subprocess.run(
        [f"{checkout}/.venv/bin/chatcore", "serve", "--help"], capture_output=True, text=True, cwd=checkout
    ).stdout
    return "--threads" in help_text


def start_server(checkout: str, model: str, one_thread: bool, threads_option: bool) -> tuple[subprocess.Popen, int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {key: value for key, value in os.environ.items() if key not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    command = [f"{checkout}/.venv/bin/chatcore", "serve", "--model", model, "--port", str(port), "--max-batch", "32"]
    if one_thread:
        if threads_option:
            command += ["--threads", "1"]
        else:
            env["OMP_NUM_THREADS"] = "1"
    server = subprocess.Popen(command, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert server.stdout is not None
    for line in server.stdout:  # it says so once it listens
        if b"serving" in line:
            break
    else:
        raise SystemExit(f"the server in {checkout} did not start")
    return server, port


def load(port: int, clients: int, tokens: int, timeout: float) -> tuple[int, int, float, list[float]]:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=timeout)
    model = client.models.list().data[0].id

    def ask(index: int) -> tuple[int, float | None]:
        start = time.perf_counter()
        first, usage = None, 0
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"hi, I am client {index}. how are you?"}],
            max_tokens=tokens,
            seed=index,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - start
        return usage, first

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(ask, range(clients)))
    seconds = time.perf_counter() - start
    firsts = [first for _, first in results if first is not None]
    return len(results), sum(count for count, _ in results), seconds, firsts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", action="append", required=True, help="LABEL=PATH (a tree with .venv)")
    parser.add_argument("--model", action="append", help="NAME:TOKENS:LEVELS, e.g. chatcore-tiny:32:1,4,16,32")
    parser.add_argument("--deadline", type=float, default=900.0, help="Seconds for the whole run.")
    args = parser.parse_args()
    models = args.model or ["chatcore-tiny:32:1,4,16,32"]
    checkouts = [tuple(item.split("=", 1)) for item in args.checkout]
    began = time.monotonic()
    rows: list[Row] = []
    scrape = ""
    print("| checkout | model | threads | clients | replies | tok/s | ratio | first token p50 | p99 |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for spec in models:
        name, tokens, levels = spec.split(":")
        for label, checkout in checkouts:
            option = has_threads_option(checkout)
            for one_thread in (False, True):
                threads = ("--threads 1" if option else "OMP_NUM_THREADS=1") if one_thread else "default"
                server, port = start_server(checkout, name, one_thread, option)
                try:
                    for clients in (int(level) for level in levels.split(",")):
                        left = args.deadline - (time.monotonic() - began)
                        if left < 30:
                            print(f"| {label} | {name} | {threads} | {clients} | skipped: past the deadline |||||")
                            continue
                        replies, count, seconds, firsts = load(port, clients, int(tokens), left)
                        row = Row(label, name, threads, clients, replies, count, seconds, 0, 0)
                        row.first_p50, row.first_p99 = percentile(firsts, 0.5), percentile(firsts, 0.99)
                        peer = next(r for r in [*rows, row] if r.model == name and r.clients == clients)
                        rows.append(row)
                        print(
                            f"| {label} | {name} | {threads} | {clients} | {replies} | {row.rate:.1f} | "
                            f"{row.rate / peer.rate if peer.rate else float('nan'):.2f}x | "
                            f"{row.first_p50:.2f} s | {row.first_p99:.2f} s |",
                            flush=True,
                        )
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
                            scrape = f"{label} {name} {threads}:\n" + response.read().decode()
                    except OSError:
                        pass  # a checkout without /metrics
                finally:
                    server.terminate()
                    server.wait(60)
    print(f"\nwhole run {time.monotonic() - began:.0f} s; the last /metrics scrape (counters and sums):")
    for line in scrape.splitlines():
        if not line.startswith("#") and "_bucket" not in line and "_created" not in line:
            print(f"  {line}")


if __name__ == "__main__":
    main()
