"""The entry-point x plugin matrix, for the release note: every decoder and steerer combination
through every entry point, on each model, as pass / refused / FAIL / - (not run there).

    python bench/matrix_report.py [--markdown] [--from REPORT.jsonl] [-k PYTEST_EXPRESSION]

Runs tests/test_matrix.py (what each cell means and which entry point runs which cells is in
its docstring) with CHATCORE_MATRIX_REPORT set, then prints one table per model and the counts
per entry point. ``--from`` prints a report written earlier instead of running the tests.
Exits 1 if any cell failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from matrix_cells import ENTRY_POINTS, REPORT_ENV  # noqa: E402

VERDICTS = ("pass", "refused", "FAIL", "-")


def run_matrix(report: Path, expression: str | None) -> None:
    command = [sys.executable, "-m", "pytest", "-q", str(ROOT / "tests" / "test_matrix.py")]
    if expression:
        command += ["-k", expression]
    environment = dict(os.environ, **{REPORT_ENV: str(report)})
    environment.setdefault("OMP_NUM_THREADS", "1")
    # The tests fail when a cell does: the table below says which, so their exit status is not ours.
    subprocess.run(command, cwd=ROOT, env=environment, check=False, stdout=subprocess.DEVNULL)


def read_rows(report: Path) -> list[dict[str, str]]:
    if not report.is_file():
        raise SystemExit(f"no matrix report at {report}: did the tests run?")
    return [json.loads(line) for line in report.read_text(encoding="utf-8").splitlines() if line.strip()]


def table(rows: list[dict[str, str]], model: str, markdown: bool) -> list[str]:
    entries = [entry for entry in ENTRY_POINTS if any(r["entry"] == entry for r in rows if r["model"] == model)]
    cells: dict[tuple[str, str], dict[str, str]] = {}
    for row in rows:
        if row["model"] == model:
            cells.setdefault((row["decoder"], row["steerers"]), {})[row["entry"]] = row["verdict"]
    header = ["decoder", "steerers", *entries]
    body = [[decoder, steerers, *(got.get(e, "") for e in entries)] for (decoder, steerers), got in cells.items()]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        return lines + ["| " + " | ".join(line) + " |" for line in body]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    return ["  ".join(value.ljust(width) for value, width in zip(line, widths)).rstrip() for line in [header, *body]]


def counts(rows: list[dict[str, str]]) -> list[str]:
    lines = []
    for model in dict.fromkeys(row["model"] for row in rows):
        for entry in ENTRY_POINTS:
            counted = Counter(r["verdict"] for r in rows if r["model"] == model and r["entry"] == entry)
            if counted:
                shown = ", ".join(f"{counted[v]} {v}" for v in VERDICTS if counted[v])
                lines.append(f"{model:14} {entry:9} {shown}")
    total = Counter(row["verdict"] for row in rows)
    lines.append("all: " + ", ".join(f"{total[v]} {v}" for v in VERDICTS if total[v]))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--markdown", action="store_true", help="Markdown tables (for the release note).")
    parser.add_argument("--from", dest="source", type=Path, default=None, help="Print this report; run nothing.")
    parser.add_argument("-k", dest="expression", default=None, help="Only the tests pytest's -k selects.")
    args = parser.parse_args()
    if args.source is not None:
        rows = read_rows(args.source)
    else:
        with tempfile.TemporaryDirectory() as folder:
            report = Path(folder) / "matrix.jsonl"
            run_matrix(report, args.expression)
            rows = read_rows(report)
    for model in dict.fromkeys(row["model"] for row in rows):
        print(f"\n{model}\n")
        print("\n".join(table(rows, model, args.markdown)))
    print()
    print("\n".join(counts(rows)))
    failed = [row for row in rows if row["verdict"] == "FAIL"]
    if failed:
        print(f"\n{len(failed)} cell(s) FAIL:")
        for row in failed:
            print(f"  {row['model']} | {row['entry']} | {row['decoder']} | {row['steerers']}: {row['got']}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
