"""The entry-point x plugin matrix: its combinations, what one cell gave, and how a cell is judged.

A cell is a decoder with no steerer, one steerer, or a pair of steerers (in the order of
``STEERERS``), each with cheap settings. Through every entry point it must give the reply the
Python API gives, or be refused at configuration with the same one-line message.
``tests/test_matrix.py`` runs the cells; ``bench/matrix_report.py`` prints the whole matrix.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from chatcore.engine import ReplyOptions

PROMPT = "what should we eat tonight?"
SEED = 7
MAX_NEW_TOKENS = 6
# Cheap settings: two candidates, one gradient step, words the bundled lists have. The
# bundled reverse model reads the tiny Llama's chat-template replies through text.
DECODERS = {
    "greedy": "greedy",
    "top-k": "top-k",
    "mmi": "mmi candidates=2 allow_retokenize=true",
    "rank": "rank candidates=2 topic=food",
}
STEERERS = {
    "bow-bias": "bow-bias topic=food",
    "pplm": "pplm topic=food num_iterations=1",
    "cocon": "cocon content=pizza",
    "activation-addition": "activation-addition positive=delicious negative=boring",
}
ENTRY_POINTS = ("api", "generate", "eval", "repl", "http", "discord")
MODELS = ("chatcore-tiny", "tiny-llama")
# Where the matrix's rows are appended as JSON lines (bench/matrix_report.py sets it).
REPORT_ENV = "CHATCORE_MATRIX_REPORT"


@dataclass(frozen=True)
class Cell:
    decoder: str
    steerers: tuple[str, ...] = ()

    @property
    def decoder_spec(self) -> str:
        return DECODERS[self.decoder]

    @property
    def steer_specs(self) -> list[str]:
        return [STEERERS[name] for name in self.steerers]

    @property
    def sampled(self) -> bool:
        """Whether the reply depends on the seed (greedy's never does)."""
        return self.decoder != "greedy"

    @property
    def label(self) -> str:
        return "+".join(self.steerers) or "-"

    def options(self) -> "ReplyOptions":
        from chatcore.cli.specs import parse_spec
        from chatcore.engine import ReplyOptions

        decoder, decoder_settings = parse_spec(self.decoder_spec)
        return ReplyOptions(
            decoder=decoder,
            decoder_settings=decoder_settings,
            steerers=[parse_spec(spec) for spec in self.steer_specs],
            seed=SEED,
            max_new_tokens=MAX_NEW_TOKENS,
        )


def steerer_sets() -> list[tuple[str, ...]]:
    """No steerer, each steerer, each unordered pair (in ``STEERERS``' order)."""
    names = list(STEERERS)
    return [(), *((name,) for name in names), *itertools.combinations(names, 2)]


def all_cells() -> list[Cell]:
    return [Cell(decoder, steerers) for decoder in DECODERS for steerers in steerer_sets()]


# The pairs the command line runs (under top-k, seeded): two steerers on the scores and the past,
# one refused for its order, and CoCon's replaced model step under a residual-stream hook.
COMMAND_LINE_PAIRS = (("bow-bias", "pplm"), ("bow-bias", "cocon"), ("cocon", "activation-addition"))


def command_line_cells() -> list[Cell]:
    """The cells ``chatcore generate`` and ``chatcore eval`` run (each run loads the model anew):
    every decoder alone, every steerer under greedy, and ``COMMAND_LINE_PAIRS`` under top-k."""
    alone = [Cell(decoder) for decoder in DECODERS]
    steered = [Cell("greedy", (name,)) for name in STEERERS]
    pairs = [Cell("top-k", pair) for pair in COMMAND_LINE_PAIRS]
    return alone + steered + pairs


Kind = Literal["reply", "refused", "error"]


@dataclass(frozen=True)
class Outcome:
    """What a cell gave: a reply (its text as the entry point shows it, and its token ids or
    their number where the entry point tells them), a refusal or an error (the message)."""

    kind: Kind
    text: str
    token_ids: tuple[int, ...] | None = None
    token_count: int | None = None

    def __str__(self) -> str:
        shown = json.dumps(self.text, ensure_ascii=False)
        if len(shown) > 90:
            shown = shown[:89] + '…"'
        return shown if self.kind == "reply" else f"{self.kind}: {shown}"

    @property
    def tokens(self) -> int | None:
        return len(self.token_ids) if self.token_ids is not None else self.token_count


def failure(message: str) -> Outcome:
    """An error an entry point printed without saying when it came: an error while generating
    (Engine.blame's messages say so), else a refusal."""
    kind: Kind = "error" if "while generating" in message else "refused"
    return Outcome(kind, message)


def verdict(expected: Outcome, got: Outcome | None) -> str:
    """``pass``, ``refused`` (the same one-line refusal), ``FAIL``, or ``-`` (not run)."""
    if got is None:
        return "-"
    if expected.kind == "error" or got.kind != expected.kind:
        return "FAIL"
    if expected.kind == "refused":
        return "refused" if expected.text in got.text and "\n" not in got.text else "FAIL"
    if got.text != expected.text:
        return "FAIL"
    if got.token_ids is not None and expected.token_ids is not None and got.token_ids != expected.token_ids:
        return "FAIL"
    if got.tokens is not None and expected.tokens is not None and got.tokens != expected.tokens:
        return "FAIL"
    return "pass"


@dataclass(frozen=True)
class Row:
    model: str
    entry: str
    decoder: str
    steerers: str
    verdict: str
    expected: str
    got: str


def judge(model: str, entry: str, expected: dict[Cell, Outcome], got: dict[Cell, Outcome]) -> list[Row]:
    """One row per cell of ``expected``; cells the entry point did not run are ``-``."""
    rows = []
    for cell, outcome in expected.items():
        result = got.get(cell)
        rows.append(
            Row(
                model,
                entry,
                cell.decoder,
                cell.label,
                verdict(outcome, result),
                str(outcome),
                "" if result is None else str(result),
            )
        )
    return rows


def mismatch_table(rows: Iterable[Row]) -> str:
    failed = [row for row in rows if row.verdict == "FAIL"]
    lines = [f"{len(failed)} cell(s) differ from the Python API:"]
    for row in failed:
        lines.append(f"  {row.model} | {row.entry} | {row.decoder} | {row.steerers}")
        lines.append(f"      expected {row.expected}")
        lines.append(f"      got      {row.got}")
    return "\n".join(lines)


def record(rows: Iterable[Row]) -> None:
    """Append the rows to the report file named by ``CHATCORE_MATRIX_REPORT``, if set."""
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    with open(path, "a", encoding="utf-8") as stream:
        for row in rows:
            stream.write(json.dumps(asdict(row), ensure_ascii=False) + "\n")
