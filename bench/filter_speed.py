"""Filtering speed: the DialoGPT-style filter over a whole corpus.

    python bench/filter_speed.py [--corpus chitchat] [--repeats 3] [--disable RULES]

Loads the corpus once, then filters it --repeats times with the default settings (or
with --disable'd rules) and reports the median wall-clock time and the median CPU time
of this process (the CPU time is the steadier number on a shared machine), with the
throughput in words per second and what each rule removed.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default="chitchat", help='"chitchat" or a JSONL corpus')
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--disable", default="", help="comma list of rules to turn off")
    args = parser.parse_args()

    from chatcore.training.filtering import FilterConfig, filter_dialogues
    from chatcore.training.threads import load_dialogues

    started = time.perf_counter()
    dialogues = load_dialogues(args.corpus)
    load_seconds = time.perf_counter() - started
    config = FilterConfig(disable=args.disable)
    walls, cpus = [], []
    result = None
    for _ in range(max(1, args.repeats)):
        wall, cpu = time.perf_counter(), time.process_time()
        result = filter_dialogues(dialogues, config)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    assert result is not None
    report = result.report
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    print(
        f"corpus {args.corpus}: {len(dialogues):,} dialogues, {report.exchanges_in:,} exchanges, "
        f"{report.words_in:,} words (loaded in {load_seconds:.1f} s)"
    )
    print(
        f"filtering: median of {len(walls)}: {wall:.2f} s wall, {cpu:.2f} s CPU "
        f"({report.words_in / max(cpu, 1e-9) / 1e6:.2f} M words per CPU second)"
    )
    print(report.format(examples=0))


if __name__ == "__main__":
    main()
