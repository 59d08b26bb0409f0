"""Damaged SQLite logs, made for real in each test: flipped bytes, a cut-off tail, a changed
index page, randomised search-index blocks. What is found, what is rebuilt, what the
salvage recovers, and that a file whose rows are damaged is never written into."""

from __future__ import annotations

import json
import os
import random
import sqlite3
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

import chatcore.plugin_manager as plugin_manager
from chatcore.log import ConversationLogPlugin, LogError
from chatcore.log.location import sqlite_url
from chatcore.log.models import ConversationRow, MessageRow
from chatcore.log.salvage import salvage
from chatcore.log.store import ConversationStore

INDEX = "ix_messages_conversation_id"
WORDS = ("pizza", "music", "chess", "rain", "trains", "poetry", "coffee", "films", "cats", "bread")


@pytest.fixture
def logs_cli():
    from chatcore.cli import build_cli

    host = plugin_manager.PluginHost()
    host.load_modules(("chatcore.log",))
    assert host.problems == []
    plugin_manager.set_plugin_host(host)
    runner = CliRunner()
    group = build_cli()

    def invoke(*args):
        return runner.invoke(group, ["logs", *args], catch_exceptions=False)

    return invoke


def conversation_id(number):
    return f"{number:032x}"


def fill(path, conversations, per_conversation):
    """A log of ``conversations`` x ``per_conversation`` messages, written in bulk, then checkpointed
    into the file itself (as a chat that ended leaves it), so damage to the file is damage to the log."""
    start = datetime(2025, 1, 1, tzinfo=timezone.utc)
    with ConversationStore(sqlite_url(path)) as store, store.db.begin() as connection:
        connection.execute(
            sa.insert(ConversationRow),
            [
                {
                    "id": conversation_id(number),
                    "created": start + timedelta(minutes=number),
                    "updated": start + timedelta(minutes=number, seconds=per_conversation),
                    "adapter": "repl",
                    "title": f"chat {number}",
                    "meta": {},
                }
                for number in range(conversations)
            ],
        )
        connection.execute(
            sa.insert(MessageRow),
            [
                {
                    "conversation_id": conversation_id(number),
                    "role": "user" if turn % 2 == 0 else "bot",
                    "text": f"turn {turn} of chat {number} about {WORDS[(number + turn) % len(WORDS)]}",
                    "created": start + timedelta(minutes=number, seconds=turn),
                    "interrupted": False,
                    "superseded": False,
                }
                for number in range(conversations)
                for turn in range(per_conversation)
            ],
        )
    connection = sqlite3.connect(path)
    connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    connection.close()
    return conversations * per_conversation


def rows(path, sql, *params):
    connection = sqlite3.connect(path)
    try:
        return connection.execute(sql, params).fetchall()
    finally:
        connection.close()


def salvaged(path, tmp_path):
    into = ConversationStore(sqlite_url(tmp_path / "salvaged.sqlite3"))
    report = salvage(path, into)
    messages = {(m.conversation_id, m.id): m.text for r in into.iter_conversations() for m in r.messages}
    into.close()
    return report, messages


@pytest.mark.slow
def test_flipped_bytes_salvage_recovers_all_conversations_and_the_file_is_never_written(logs_cli, engine, tmp_path):
    path = tmp_path / "log.sqlite3"
    written = fill(path, conversations=40, per_conversation=100)
    original = dict(((c, i), t) for c, i, t in rows(path, "SELECT conversation_id, id, text FROM messages"))
    data = bytearray(path.read_bytes())
    for position in random.Random(26).sample(range(100, len(data)), 300):  # the header: next test
        data[position] ^= 0xFF
    path.write_bytes(bytes(data))

    report, messages = salvaged(path, tmp_path)
    assert {c for c, _ in messages} == {conversation_id(n) for n in range(40)}  # all conversations
    assert len(messages) >= 0.98 * written  # the flips fall on different pages from run to run (timestamps move them)
    intact = sum(messages.get(key) == text for key, text in original.items())
    assert intact >= 0.97 * written  # a flipped byte inside a message's text changes only that text
    assert report.messages == len(messages) and report.lines()[0].startswith("recovered 40 conversation(s)")

    exported = logs_cli("export", "--salvage", "--db", str(path))
    assert exported.exit_code == 0 and "salvage: recovered 40 conversation(s)" in exported.stderr
    assert sum(len(json.loads(line)["messages"]) for line in exported.stdout.splitlines()) == len(messages)

    checked = logs_cli("check", "--db", str(path))
    said = checked.stdout + checked.stderr  # rows damaged, or a file SQLite cannot open at all
    assert checked.exit_code == 1 and "--salvage" in said and "Traceback" not in said

    before = path.read_bytes()
    told = []
    try:
        store = ConversationStore(sqlite_url(path))
    except LogError:
        return  # so damaged it does not open: a chat then runs without the log and says so
    plugin = ConversationLogPlugin(store, notify=told.append, journal_dir=tmp_path / "journal")
    engine.host.register(plugin, "conversation-log")
    engine.send(engine.conversation(), "hello", decoder="greedy", max_new_tokens=3).text()
    assert plugin.journaled == 2 and len(told) == 1 and "--salvage" in told[0]
    assert path.read_bytes() == before
    store.close()


@pytest.mark.slow
def test_a_damaged_header_and_a_file_cut_in_half_give_back_every_row_before_the_cut(tmp_path):
    path = tmp_path / "log.sqlite3"
    fill(path, conversations=30, per_conversation=100)
    data = path.read_bytes()
    cut = len(data) // 2 // 4096 * 4096
    # What the pages before the cut hold, by SQLite's own account of each page.
    kept = rows(
        path,
        "SELECT sum(ncell) FROM dbstat WHERE name = 'messages' AND pagetype = 'leaf' AND pageno <= ?",
        cut // 4096,
    )[0][0]
    assert 0 < kept < rows(path, "SELECT count(*) FROM messages")[0][0]
    damaged = bytearray(data[:cut])
    damaged[:16] = b"\x00" * 16  # the header's magic too: SQLite no longer opens it at all
    path.write_bytes(bytes(damaged))
    with pytest.raises(LogError):
        ConversationStore(sqlite_url(path), create=False)

    report, messages = salvaged(path, tmp_path)
    assert len(messages) == kept
    assert any("cut short" in line for line in report.lines())


def change_index_page(path, index="ix_messages_conversation_id"):
    """4 changed bytes in the middle of one leaf page of an index: its structure still sound."""
    pages = [page for (page,) in rows(path, "SELECT pageno FROM dbstat WHERE name = ? AND pagetype = 'leaf'", index)]
    data = bytearray(path.read_bytes())
    offset = (pages[len(pages) // 2] - 1) * 4096 + 2000
    data[offset : offset + 4] = b"\x00\x11\x22\x33"
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_a_changed_index_page_passes_quick_check_and_is_rebuilt_when_a_chat_opens_the_log(engine, tmp_path):
    path = tmp_path / "log.sqlite3"
    written = fill(path, conversations=30, per_conversation=100)
    change_index_page(path)
    assert rows(path, "PRAGMA quick_check") == [("ok",)]
    with ConversationStore(sqlite_url(path), create=False) as reader:
        try:  # what `logs show` printed: rows missing, silently, or an error, by where the bytes fell
            shown = sum(len(reader.get_conversation(conversation_id(n)).messages) for n in range(30))
        except LogError:
            shown = None
        assert shown is None or shown < written
        assert reader.find_damage().indexes == ["ix_messages_conversation_id"]

    told = []
    store = ConversationStore(sqlite_url(path))
    plugin = ConversationLogPlugin(store, notify=told.append, journal_dir=tmp_path / "journal")
    assert len(told) == 1 and "rebuilt index ix_messages_conversation_id" in told[0]
    assert sum(len(store.get_conversation(conversation_id(n)).messages) for n in range(30)) == written
    engine.host.register(plugin, "conversation-log")
    engine.send(engine.conversation(), "hello", decoder="greedy", max_new_tokens=3).text()
    assert plugin.journaled == 0 and store.count_messages() == written + 2  # written into the file again
    assert not store.find_damage(full=True).found
    store.close()


def randomise_search_blocks(path, seed):
    connection = sqlite3.connect(path)
    rng = random.Random(seed)
    blocks = connection.execute("SELECT id, length(block) FROM messages_fts_data WHERE id > 1").fetchall()
    for block_id, size in blocks:
        connection.execute("UPDATE messages_fts_data SET block = ? WHERE id = ?", (rng.randbytes(size), block_id))
    connection.commit()
    connection.close()


# Seeded, so a failure can be replayed. On SQLite 3.4x seed 33 makes FTS5's own check ask for an
# absurd allocation (Python's sqlite3 raises MemoryError for SQLITE_NOMEM); seed 0 fails its constructor.
@pytest.mark.parametrize("seed", [0, 33])
def test_randomised_search_blocks_are_found_and_rebuilt_by_logs_check_repair(logs_cli, tmp_path, seed):
    path = tmp_path / "log.sqlite3"
    fill(path, conversations=20, per_conversation=50)
    randomise_search_blocks(path, seed)
    with ConversationStore(sqlite_url(path), create=False) as reader, pytest.raises(LogError):
        reader.search("chess")

    checked = logs_cli("check", "--db", str(path))
    assert checked.exit_code == 1 and "search index" in checked.stdout and "--repair" in checked.stdout
    repaired = logs_cli("check", "--repair", "--db", str(path))
    assert repaired.exit_code == 0 and "rebuilt the search index" in repaired.stdout
    with ConversationStore(sqlite_url(path), create=False) as reader:
        assert len(reader.search("about chess", limit=1000)) == 100  # one message in ten, of 1,000
    assert logs_cli("check", "--db", str(path)).stdout.startswith("ok: ")


class HeldCheckStore(ConversationStore):
    """A real store whose check on open starts only when the test lets it, so the turns sent
    before are known to arrive while it runs."""

    def __init__(self, *args, **kwargs):
        self.go = __import__("threading").Event()
        super().__init__(*args, **kwargs)

    def check_on_open(self):
        assert self.go.wait(120)
        super().check_on_open()


@pytest.mark.slow
def test_the_check_on_open_runs_in_the_background_while_the_first_turns_go_to_the_journal(engine, tmp_path):
    path = tmp_path / "log.sqlite3"
    written = fill(path, conversations=30, per_conversation=100)
    change_index_page(path)
    told = []
    store = HeldCheckStore(sqlite_url(path), defer_check=True)
    plugin = ConversationLogPlugin(store, notify=told.append, journal_dir=tmp_path / "journal")
    engine.host.register(plugin, "conversation-log")
    try:
        engine.send(engine.conversation(), "hello", decoder="greedy", max_new_tokens=3).text()
        assert plugin.checking and plugin.journaled == 2 and told == []  # held in the journal, not yet checked
        store.go.set()
        assert plugin.checked.wait(120)
        assert len(told) == 1 and "rebuilt index ix_messages_conversation_id" in told[0]
        assert plugin.journaled == 0 and store.count_messages() == written + 2  # written once it passed
        assert not store.find_damage(full=True).found
    finally:
        engine.host.unregister("conversation-log")
        plugin.close()
        store.close()


def read_only_log(path, how):
    """``--db`` for a log that cannot be written: a read-only file in a read-only folder, as a
    read-only mount shows it, or the file through SQLite's own read-only URI (root writes
    through file modes, so that is how it is read only as root)."""
    if how == "mode=ro URI":
        return f"sqlite:///file:{path}?mode=ro&uri=true"
    path.chmod(0o400)
    path.parent.chmod(0o500)
    if os.access(path.parent, os.W_OK):
        path.parent.chmod(0o700)
        pytest.skip("this user (root) writes through file modes; the mode=ro URI case reads the log read-only")
    return str(path)


@pytest.mark.parametrize("how", ["read-only file and folder", "mode=ro URI"])
def test_a_sound_read_only_log_is_checked_sound_and_said_to_be_read_only(logs_cli, tmp_path, how):
    path = tmp_path / "logs" / "log.sqlite3"
    path.parent.mkdir()
    fill(path, conversations=5, per_conversation=10)
    before = path.read_bytes()
    db = read_only_log(path, how)
    try:
        for args in (["check"], ["check", "--repair"]):
            checked = logs_cli(*args, "--db", db)
            assert checked.exit_code == 0, checked.output
            assert checked.stdout.startswith("ok: ") and "5 conversation(s), 50 message(s)" in checked.stdout
            assert "read-only" in checked.stdout and "damaged" not in checked.stdout
    finally:
        path.parent.chmod(0o700)
        path.chmod(0o600)
    assert path.read_bytes() == before


def test_a_damaged_read_only_log_is_reported_and_left_as_it_is_by_repair(logs_cli, tmp_path):
    path = tmp_path / "log.sqlite3"
    fill(path, conversations=20, per_conversation=50)
    randomise_search_blocks(path, seed=0)
    before = path.read_bytes()
    db = read_only_log(path, "mode=ro URI")
    checked = logs_cli("check", "--db", db)
    assert checked.exit_code == 1 and checked.stdout.startswith("damaged: ") and "search index" in checked.stdout
    repaired = logs_cli("check", "--repair", "--db", db)
    assert repaired.exit_code == 1 and "nothing was rebuilt" in repaired.stdout, repaired.output
    assert "readonly" in repaired.stdout and "cannot rebuild it in place" not in repaired.stdout
    assert path.read_bytes() == before


def test_a_plugin_that_does_not_wait_hands_out_a_future_that_resolves_once_the_turn_is_held(engine, tmp_path):
    store = ConversationStore(sqlite_url(tmp_path / "log.sqlite3"))
    plugin = ConversationLogPlugin(store, notify=lambda message: None, journal_dir=tmp_path / "journal", wait=False)
    engine.host.register(plugin, "conversation-log")
    try:
        conversation = engine.conversation()
        engine.send(conversation, "hello", decoder="greedy", max_new_tokens=3).text()
        assert plugin.held(conversation.id).result(timeout=120) is None
        assert store.count_messages() == 2
    finally:
        engine.host.unregister("conversation-log")
        plugin.close()
        store.close()


def test_read_commands_never_write_into_a_file_that_is_no_chatcore_log(logs_cli, tmp_path):
    other = tmp_path / "other.sqlite3"
    connection = sqlite3.connect(other)
    connection.execute("CREATE TABLE notes (body TEXT)")
    connection.execute("INSERT INTO notes VALUES ('keep me')")
    connection.commit()
    connection.close()
    empty = tmp_path / "empty.sqlite3"
    empty.touch()
    for path, message in (
        (other, "is not a chatcore conversation log: it holds other tables ('notes')"),
        (empty, "holds no chatcore conversation log"),
    ):
        before = path.read_bytes()
        for command in (["check"], ["check", "--repair"], ["list"], ["search", "keep"]):
            result = logs_cli(*command, "--db", str(path))
            assert result.exit_code == 1 and message in result.output and "--salvage" not in result.output, (
                result.output
            )
        assert path.read_bytes() == before  # not a byte written, the journal mode included
        assert not path.with_name(path.name + "-wal").exists()


def test_a_log_whose_header_is_damaged_is_pointed_at_the_salvage_of_that_very_file(logs_cli, tmp_path):
    path = tmp_path / "my log.sqlite3"
    fill(path, conversations=2, per_conversation=4)
    with open(path, "r+b") as file:
        file.write(b"X" * 100)
    checked = logs_cli("check", "--db", str(path))
    assert checked.exit_code == 1 and "file is not a database" in checked.output
    assert f"logs export --salvage --db '{path}' -o saved.jsonl" in checked.output


@pytest.mark.parametrize("damage", ["cut short", "junk over the header"])
def test_a_log_too_damaged_to_open_points_a_chat_the_server_and_logs_at_its_salvage(logs_cli, tmp_path, damage):
    """`chatcore serve --db FILE` (and a chat, the bot) on a file SQLite cannot open: the one line
    names the salvage of that very file, as `logs check` does."""
    path = tmp_path / "my log.sqlite3"
    fill(path, conversations=2, per_conversation=4)
    if damage == "cut short":
        with open(path, "r+b") as file:
            file.truncate(2000)  # half of the first page
    else:
        with open(path, "r+b") as file:
            file.write(b"X" * 100)
    before = path.read_bytes()
    salvage_command = f"`chatcore logs export --salvage --db '{path}' -o saved.jsonl` recovers what it holds"
    with pytest.raises(LogError) as refused:
        ConversationStore(sqlite_url(path))  # opened for writing, as a chat, the bot and the server open it
    message = str(refused.value)
    assert message.startswith(f"conversation log {sqlite_url(path)}: cannot open: ") and "\n" not in message
    assert message.endswith(salvage_command)
    for args in (("list",), ("show", "0"), ("check",)):
        result = logs_cli(*args, "--db", str(path))
        assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
        assert result.output.count(salvage_command) == 1, result.output
    assert path.read_bytes() == before


def test_a_broken_index_page_is_told_apart_from_damaged_rows_and_left_to_the_salvage(logs_cli, tmp_path):
    """Random bytes over an index page's header: SQLite cannot check the file, nor REINDEX or drop
    the index; every table still reads without it, so the rows are not blamed, and salvage has them all."""
    path = tmp_path / "log.sqlite3"
    written = fill(path, conversations=20, per_conversation=5)
    connection = sqlite3.connect(path)
    pages = [
        page
        for page, name in connection.execute("SELECT pageno, name FROM dbstat")
        if name == "ix_messages_conversation_id"
    ]
    connection.close()
    with open(path, "r+b") as file:
        file.seek((pages[-1] - 1) * 4096)
        file.write(random.Random(0).randbytes(64))
    before = path.read_bytes()
    for args in (["check"], ["check", "--repair"]):
        result = logs_cli(*args, "--db", str(path))
        assert result.exit_code == 1, result.output
        assert "its structure: database disk image is malformed" in result.output
        assert "every row still reads" in result.output and "its rows are damaged" not in result.output
        assert "logs export --salvage --db" in result.output
    assert path.read_bytes() == before  # nothing written into it
    saved = tmp_path / "saved.jsonl"
    exported = logs_cli("export", "--salvage", "--db", str(path), "-o", str(saved))
    assert exported.exit_code == 0, exported.output
    lines = [json.loads(line) for line in saved.read_text().splitlines()]
    assert sum(len(conversation["messages"]) for conversation in lines) == written


def test_an_index_past_rebuilding_in_place_is_reported_in_one_answer_and_not_written_into(logs_cli, tmp_path):
    path = tmp_path / "log.sqlite3"
    fill(path, conversations=20, per_conversation=50)
    connection = sqlite3.connect(path)
    pages = [page for page, name in connection.execute("SELECT pageno, name FROM dbstat") if name == INDEX]
    connection.close()
    with open(path, "r+b") as file:  # inside an index page's cells: integrity_check names the index
        file.seek((pages[len(pages) // 2] - 1) * 4096 + 100)
        file.write(random.Random(1).randbytes(64))
    checked = logs_cli("check", "--db", str(path))
    assert checked.exit_code == 1 and f"index {INDEX}" in checked.output and "--repair" in checked.output
    before = path.read_bytes()
    repaired = logs_cli("check", "--repair", "--db", str(path))
    assert repaired.exit_code == 1 and "the rebuild failed" in repaired.output, repaired.output
    assert "recovers every conversation" in repaired.output
    assert path.read_bytes() == before


@pytest.mark.parametrize("left", ["nothing", "conversations without messages", "half a page"])
def test_a_salvage_that_finds_little_or_nothing_says_so_in_one_line(logs_cli, tmp_path, left):
    path = tmp_path / "log.sqlite3"
    if left == "half a page":
        fill(path, conversations=4, per_conversation=4)
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    else:
        with ConversationStore(sqlite_url(path)) as store:
            if left == "conversations without messages":
                store.ensure_conversation("empty", title="nothing said")
    exported = logs_cli("export", "--salvage", "--db", str(path))
    said = exported.stdout + exported.stderr
    assert "Traceback" not in said and "Error" not in said.replace("Error:", ""), said
    assert "salvage: recovered" in exported.stderr or exported.exit_code == 1, said
    if exported.exit_code == 1:
        assert len(exported.stderr.strip().splitlines()) == 1, said


def test_salvage_reads_the_pages_a_wal_adds_past_the_files_end(tmp_path):
    """A log left as a crash leaves it: its newest committed messages only in pages the -wal
    adds beyond the file's header count. Salvage recovers them too."""
    live = tmp_path / "live.sqlite3"
    written = fill(live, conversations=2, per_conversation=10)
    writer = sqlite3.connect(live)
    writer.execute("PRAGMA wal_autocheckpoint=0")  # the file's pages stay as they are: all goes to the -wal
    writer.executemany(
        "INSERT INTO messages (conversation_id, role, text, created, interrupted, superseded) "
        "VALUES (?, 'user', ?, '2025-01-02 00:00:00', 0, 0)",
        [(conversation_id(0), f"late message {n} " + "x" * 400) for n in range(40)],
    )
    writer.commit()
    path = tmp_path / "log.sqlite3"
    for suffix in ("", "-wal"):  # copied while the writer still holds them: nothing folded in
        path.with_name(path.name + suffix).write_bytes(live.with_name(live.name + suffix).read_bytes())
    writer.close()
    assert path.with_name(path.name + "-wal").stat().st_size > 0

    report, messages = salvaged(path, tmp_path)
    assert len(messages) == written + 40 and report.messages == written + 40
    assert sum(text.startswith("late message") for text in messages.values()) == 40
