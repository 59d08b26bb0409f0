"""Every built-in decoder and steerer, alone and in pairs, through every entry point, on two models.

The cells (tests/matrix_cells.py): the decoders greedy, top-k, mmi and rank, each with no
steerer, each of bow-bias, pplm, cocon and the example package's activation-addition, and
each unordered pair of them; 44 cells per model, on the bundled chatcore-tiny and on a tiny
random Llama with a chat template (no CoCon block fits it, so cocon must be refused).
Every cell uses the seed ``SEED`` where the entry point takes one.

The reference is the Python API: ``Conversation.send`` streamed. Every other entry point must
give the same reply (the same text; the same token ids or count where it tells them) or be
refused at configuration with the Python API's message, in one line:

- ``chatcore generate --json`` and ``chatcore eval --json`` (CliRunner, in process): each run
  loads the model anew, so they run a subset, ``command_line_cells()``: every decoder alone,
  every steerer under greedy, and three pairs under top-k (``COMMAND_LINE_PAIRS``);
- ``chatcore chat`` (CliRunner, stdin not a terminal): one chat per model, fed every cell as
  slash commands (/new, /decoder, /steer, /seed) and a message;
- HTTP: one ``chatcore serve`` app per model on a real uvicorn server, through the ``openai``
  client, every cell;
- Discord: one bot per model on dpytest, configured per cell with /chat reset, decoder and
  steer in a DM. Discord takes no seed, so it runs the greedy cells and the cells the API
  refuses; the sampled replies are not run there (``-`` in the report).

A test per (entry point, model) fails with the table of the cells that differ; those of
generate and eval are marked slow.
``python bench/matrix_report.py`` prints the whole matrix with counts.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from matrix_cells import (
    ENTRY_POINTS,
    MAX_NEW_TOKENS,
    MODELS,
    PROMPT,
    SEED,
    Cell,
    Outcome,
    all_cells,
    command_line_cells,
    failure,
    judge,
    mismatch_table,
    record,
)

import chatcore.plugin_manager as plugin_manager
from chatcore.errors import ChatcoreError

EXAMPLE_MODULE = "chatcore_steering_vectors"
EXAMPLE_SRC = Path(__file__).resolve().parents[1] / "examples" / "chatcore-steering-vectors" / "src"


class Matrix:
    """What the tests share: one plugin host, one engine and one reference per model."""

    def __init__(self, request: pytest.FixtureRequest, host: plugin_manager.PluginHost) -> None:
        self.request = request
        self.host = host
        self.engines: dict[str, Any] = {}
        self.references: dict[str, dict[Cell, Outcome]] = {}

    def model_path(self, model: str) -> str:
        return "chatcore-tiny" if model == "chatcore-tiny" else str(self.request.getfixturevalue("tiny_llama_dir"))

    def engine(self, model: str) -> Any:
        if model not in self.engines:
            from chatcore.engine import Engine

            fixture = "bundled_model" if model == "chatcore-tiny" else "tiny_llama"
            self.engines[model] = Engine(self.request.getfixturevalue(fixture), host=self.host)
        return self.engines[model]

    def reference(self, model: str) -> dict[Cell, Outcome]:
        if model not in self.references:
            engine = self.engine(model)
            self.references[model] = {cell: api_outcome(engine, cell) for cell in all_cells()}
        return self.references[model]


@pytest.fixture(scope="module")
def matrix(request: pytest.FixtureRequest) -> Matrix:
    """The built-ins and the example package's steerer, loaded the way the entry points load them."""
    import importlib.util
    import sys

    if importlib.util.find_spec(EXAMPLE_MODULE) is None:  # `make venv` installs it; a bare checkout may not
        sys.path.insert(0, str(EXAMPLE_SRC))
    host = plugin_manager.PluginHost()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(plugin_manager.ENV_PLUGINS, "")  # the built-ins only, whatever is installed
        host.load_entry_points()
    host.load_modules((EXAMPLE_MODULE,))
    assert host.problems == []
    return Matrix(request, host)


@pytest.fixture
def cli(matrix: Matrix) -> Callable[..., Result]:
    """``chatcore ARGS`` in process, on the matrix's plugin host."""
    from chatcore.cli import build_cli

    plugin_manager.set_plugin_host(matrix.host)
    runner, group = CliRunner(), build_cli()

    def invoke(*args: str, input: str | None = None) -> Result:
        return runner.invoke(group, list(args), input=input)

    return invoke


# -- the Python API: the reference ---------------------------------------------------------------
def api_outcome(engine: Any, cell: Cell) -> Outcome:
    """Refused when ``send`` raises; a reply (lazy) that fails once iterated is an error, even
    one that fails before its first token: it was not refused at configuration."""
    conversation = engine.conversation()
    try:
        response = engine.send(conversation, PROMPT, cell.options())
    except ChatcoreError as error:
        return Outcome("refused", str(error))
    try:
        text = "".join(response)
    except ChatcoreError as error:
        return Outcome("error", str(error))
    return Outcome("reply", text, tuple(response.token_ids))


# -- the command line --------------------------------------------------------------------------
def command_failure(result: Result) -> Outcome:
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return Outcome("error", f"unexpected {type(result.exception).__name__}: {result.exception}")
    message = result.stderr.strip()
    return failure(message.removeprefix("Error: ") if message.count("\n") == 0 else message)


def plugin_args(cell: Cell) -> list[str]:
    return ["--decoder", cell.decoder_spec, *(arg for spec in cell.steer_specs for arg in ("--steer", spec))]


def run_generate(cli: Callable[..., Result], model: str, cells: list[Cell], tmp_path: Path) -> dict[Cell, Outcome]:
    outcomes = {}
    for cell in cells:
        result = cli(
            "generate",
            "--model",
            model,
            *plugin_args(cell),
            "--seed",
            str(SEED),
            "-n",
            str(MAX_NEW_TOKENS),
            "--json",
            PROMPT,
        )
        if result.exit_code == 0:
            shown = json.loads(result.stdout)
            outcomes[cell] = Outcome("reply", shown["text"], tuple(shown["token_ids"]))
        else:
            outcomes[cell] = command_failure(result)
    return outcomes


def run_eval(cli: Callable[..., Result], model: str, cells: list[Cell], tmp_path: Path) -> dict[Cell, Outcome]:
    """``chatcore eval`` on a prompt file of one prompt; its replies come from ``--json``."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPT + "\n", encoding="utf-8")
    report = tmp_path / "report.json"
    outcomes = {}
    for cell in cells:
        report.unlink(missing_ok=True)
        result = cli(
            "eval",
            "--model",
            model,
            *plugin_args(cell),
            "--prompts",
            str(prompts),
            "--limit",
            "1",
            "--seed",
            str(SEED),
            "-n",
            str(MAX_NEW_TOKENS),
            "--samples",
            "0",
            "--json",
            str(report),
        )
        if result.exit_code == 0:
            (sample,) = json.loads(report.read_text(encoding="utf-8"))["samples"]
            outcomes[cell] = Outcome("reply", sample["reply"])
        else:
            outcomes[cell] = command_failure(result)
    return outcomes


# -- the REPL -----------------------------------------------------------------------------------
NEW_CONVERSATION = "new conversation "
REPLY_PREFIX = "bot> "


def repl_script(cells: list[Cell]) -> str:
    lines = []
    for cell in cells:
        lines += ["/new", f"/decoder {cell.decoder_spec}", "/steer off"]
        lines += [f"/steer {spec}" for spec in cell.steer_specs]
        lines += [f"/seed {SEED}", PROMPT]
    return "\n".join(lines) + "\n/quit\n"


BUDGET_MARK = re.compile(r" ?\[cut at \d+ tokens?: /max to raise\]$")


def repl_outcome(segment: str) -> Outcome:
    """One cell's part of the transcript: the commands' output, then ``bot> `` and the reply
    (and an ``error:`` line if it failed while generating)."""
    before, found, reply = segment.partition(REPLY_PREFIX)
    refusals = [line for line in before.splitlines() if line.startswith("error: ")]
    if refusals:
        return Outcome("refused", refusals[0].removeprefix("error: "))
    if not found:
        return Outcome("error", f"no reply in {segment!r}")
    reply = reply.removesuffix("\n")
    # The REPL marks a reply that used its whole budget; the mark is the terminal's, not the reply's.
    reply = BUDGET_MARK.sub("", reply)
    text, newline, last = reply.rpartition("\n")
    if newline and last.startswith("error: "):  # the reply began: whatever stopped it, it was not refused
        return Outcome("error", last.removeprefix("error: "))
    return Outcome("reply", reply)


def run_repl(cli: Callable[..., Result], model: str, cells: list[Cell], tmp_path: Path) -> dict[Cell, Outcome]:
    result = cli(
        "chat", "--model", model, "--no-log", "-n", str(MAX_NEW_TOKENS), "--decoder", "greedy", input=repl_script(cells)
    )
    assert result.exit_code == 0, result.output
    # A cell's part starts after the line its /new printed; the split takes the newline that ended
    # the part before (the reply's, which the last part keeps). Without a terminal the chat writes
    # its errors to stderr: the output read is both streams, in the order they were written.
    parts = ("\n" + result.output).split("\n" + NEW_CONVERSATION)[1:]
    segments = [part.partition("\n")[2] + "\n" for part in parts[:-1]] + [
        part.partition("\n")[2] for part in parts[-1:]
    ]
    assert len(segments) == len(cells), result.output
    return dict(zip(cells, (repl_outcome(segment) for segment in segments), strict=True))


def shown_in_terminal(outcome: Outcome) -> Outcome:
    """What the terminal shows of a reply: after ``bot> `` its leading whitespace is dropped."""
    from chatcore.text import display_safe

    return Outcome("reply", display_safe(outcome.text.lstrip())) if outcome.kind == "reply" else outcome


# -- HTTP -------------------------------------------------------------------------------------
API_KEY = "matrix-key"


def run_http(engine: Any, cells: list[Cell]) -> dict[Cell, Outcome]:
    import openai

    from chatcore.adapters.http_api.app import ServeConfig, build_app
    from chatcore.adapters.http_api.server import start_in_thread
    from chatcore.serving import Scheduler

    outcomes = {}
    with Scheduler(engine) as scheduler:
        server = start_in_thread(build_app(scheduler, ServeConfig(api_key=API_KEY)))
        try:
            client = openai.OpenAI(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)
            model = client.models.list().data[0].id
            for cell in cells:
                try:
                    reply = client.chat.completions.create(
                        model=model,
                        messages=[{"role": "user", "content": PROMPT}],
                        max_tokens=MAX_NEW_TOKENS,
                        seed=SEED,
                        extra_body={"decoder": cell.decoder_spec, "steer": cell.steer_specs},
                    )
                except openai.APIStatusError as error:
                    message = error_message(error.body) or error.message
                    kind = "refused" if error.status_code == 400 else "error"
                    outcomes[cell] = Outcome(kind, message)
                    continue
                text = reply.choices[0].message.content or ""
                count = reply.usage.completion_tokens if reply.usage is not None else None
                outcomes[cell] = Outcome("reply", text, token_count=count)
        finally:
            server.stop()
    return outcomes


def error_message(body: object) -> str | None:
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return inner["message"]
    return None


# -- Discord ------------------------------------------------------------------------------------
SORRY = "Sorry, I can't answer that: "
LATE = "/chat took it, the reply failed: "


async def discord_cells(engine: Any, cells: list[Cell]) -> dict[Cell, Outcome]:
    from discord_harness import answers, slash, start_harness

    from chatcore.adapters.discord_bot.config import DiscordSettings

    settings = DiscordSettings(cooldown_s=0, max_new_tokens=MAX_NEW_TOKENS, log=False, shutdown_grace_s=5)
    harness = await start_harness(engine, settings)
    outcomes = {}
    try:
        member = harness.member(0)
        dm = await member.create_dm()

        async def configure(command: str, spec: str, accepted: str) -> str | None:
            (answer,) = answers(await slash(harness, command, member, dm, spec=spec))
            return None if answer.startswith(accepted) else answer

        for cell in cells:
            await slash(harness, "reset", member, dm)
            await configure("steer", "off", "Steering in this channel: off")
            refusal = await configure("decoder", cell.decoder_spec, "Decoder in this channel:")
            for spec in cell.steer_specs:
                refusal = refusal or await configure("steer", spec, "Steering in this channel:")
            if refusal is not None:
                outcomes[cell] = Outcome("refused", refusal)
                continue
            sent = "\n".join(message.content for message in await harness.say(PROMPT, dm, member))
            if sent.startswith(SORRY):  # /chat decoder and /chat steer took it: not refused at configuration
                outcomes[cell] = Outcome("error", f"{LATE}{sent.removeprefix(SORRY)}")
            else:
                outcomes[cell] = Outcome("reply", sent)
    finally:
        await harness.close()
    return outcomes


def discord_runs(cell: Cell, expected: Outcome) -> bool:
    """Discord takes no seed: a sampled reply cannot be compared there, a refusal can."""
    return not cell.sampled or expected.kind != "reply"


def shown_in_discord(outcome: Outcome) -> Outcome:
    from chatcore.adapters.discord_bot.bot import EMPTY_REPLY

    return Outcome("reply", outcome.text.strip() or EMPTY_REPLY) if outcome.kind == "reply" else outcome


# -- the matrix --------------------------------------------------------------------------------
# The whole matrix is slow-marked (generate and eval load the model for every cell): it runs
# once in `make test`, not again in the run on the oldest transformers release.


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_combination_gives_the_python_apis_reply_or_refusal(
    entry: str, model: str, matrix: Matrix, cli: Callable[..., Result], tmp_path: Path
) -> None:
    expected = matrix.reference(model)
    path = matrix.model_path(model)
    if entry == "api":
        got = dict(expected)  # the reference itself: a reply or a refusal passes, an error fails
    elif entry == "generate":
        got = run_generate(cli, path, command_line_cells(), tmp_path)
    elif entry == "eval":
        got = run_eval(cli, path, command_line_cells(), tmp_path)
    elif entry == "repl":
        got = run_repl(cli, path, all_cells(), tmp_path)
        expected = {cell: shown_in_terminal(outcome) for cell, outcome in expected.items()}
    elif entry == "http":
        got = run_http(matrix.engine(model), all_cells())
    else:
        cells = [cell for cell, outcome in expected.items() if discord_runs(cell, outcome)]
        got = asyncio.run(discord_cells(matrix.engine(model), cells))
        expected = {cell: shown_in_discord(outcome) for cell, outcome in expected.items()}
    rows = judge(model, entry, expected, got)
    record(rows)
    assert not [row for row in rows if row.verdict == "FAIL"], mismatch_table(rows)
