"""The shutdown sequence of ``chatcore serve``: N running streams, SIGTERM, a grace, the cut.

    python bench/serve_shutdown.py [--model chatcore-tiny] [--streams 4] [--grace 2]

Starts ``chatcore serve --shutdown-grace GRACE`` in a process of its own, starts --streams
streaming requests long enough to outlast the grace (the end token is banned with
``logit_bias``), sends SIGTERM once each has received its first chunk, and prints when each
stream ended and how (its last two events), then the server's log and exit status.
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="chatcore-tiny")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--grace", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "chatcore.cli", "serve", "--model", args.model, "--port", str(port)]
    command += ["--shutdown-grace", str(args.grace), "--threads", str(args.threads)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert server.stdout is not None
    for line in server.stdout:  # it says so once it listens
        if b"serving" in line:
            break
    model = json.loads(get(port, "/v1/models"))["data"][0]["id"]
    streaming = threading.Barrier(args.streams + 1)
    ended: dict[int, tuple[float, int, str, str]] = {}
    signalled = 0.0

    def stream(index: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"tell me a long story, number {index}"}],
            "stream": True,
            "max_tokens": 4096,
            "logit_bias": {"0": -100},
            "seed": index,
        }
        connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        response.readline()  # the role chunk
        response.readline()
        streaming.wait()
        events = [line[6:] for line in response.read().decode().split("\n\n") if line.startswith("data: ")]
        ended[index] = (time.monotonic() - signalled, len(events), events[-2][:110], events[-1])

    threads = [threading.Thread(target=stream, args=(index,)) for index in range(args.streams)]
    for thread in threads:
        thread.start()
    streaming.wait()
    signalled = time.monotonic()
    server.send_signal(signal.SIGTERM)
    print(f"{args.streams} streams running: SIGTERM at 0.00 s (grace {args.grace:g} s)")
    for thread in threads:
        thread.join()
    for index, (seconds, count, last, done) in sorted(ended.items()):
        print(f"  {seconds:5.2f} s  stream {index} ended after {count} events: {last} ... {done}")
    log = server.communicate(timeout=120)[0].decode()
    print(f"  {time.monotonic() - signalled:5.2f} s  server exited with status {server.returncode}; its log:")
    for line in log.splitlines():
        print(f"    {line}")


def get(port: int, path: str) -> str:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request("GET", path)
    return connection.getresponse().read().decode()


if __name__ == "__main__":
    main()
