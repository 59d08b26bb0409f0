"""The conversation log: the store on real SQLite files, the hooks through a real engine, `chatcore logs`."""

from __future__ import annotations

import json
import sqlite3

import pytest
from click.testing import CliRunner

import chatcore.plugin_manager as plugin_manager
from chatcore.log import ConversationLogPlugin, LogError, UnknownConversationError
from chatcore.log import schema as schema_module
from chatcore.log.formatting import (
    conversation_markdown,
    conversation_text,
    display_safe,
    summary_table,
)
from chatcore.log.location import resolve_url, sqlite_url
from chatcore.log.store import ConversationStore
from chatcore.text import encode_text

LOG_MODULE = "chatcore.log"


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "log.sqlite3"


@pytest.fixture
def store(db_path):
    opened = ConversationStore(sqlite_url(db_path))
    yield opened
    opened.close()


@pytest.fixture
def notices():
    return []


@pytest.fixture
def log_plugin(engine, store, notices):
    plugin = ConversationLogPlugin(store, notify=notices.append)
    assert engine.host.register(plugin, "conversation-log")
    engine.host.check_pending()
    return plugin


def raw_rows(db_path, sql, *params):
    """Read through a separate SQLite connection: only committed data is visible."""
    connection = sqlite3.connect(str(db_path))
    try:
        return connection.execute(sql, params).fetchall()
    finally:
        connection.close()


# -- the store ---------------------------------------------------------------------------
def test_a_new_log_is_wal_with_indexes_and_a_schema_version(store, db_path):
    assert store.journal_mode() == "wal"
    assert raw_rows(db_path, "PRAGMA journal_mode") == [("wal",)]
    indexes = {name for (name,) in raw_rows(db_path, "SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {
        "ix_conversations_updated",
        "ix_conversations_channel_updated",
        "ix_conversations_created",
        "ix_messages_conversation_id",
    } <= indexes
    assert raw_rows(db_path, "SELECT version FROM chatcore_schema") == [(3,)]
    assert raw_rows(db_path, "SELECT version_num FROM alembic_version") == [("0003",)]
    plan = " ".join(
        str(row)
        for row in raw_rows(
            db_path, "EXPLAIN QUERY PLAN SELECT id FROM conversations WHERE channel_key = 'x' ORDER BY updated DESC"
        )
    )
    assert "ix_conversations_channel_updated" in plan
    if sqlite3.sqlite_version_info >= (3, 34):
        assert store.fts


def test_every_write_is_committed_when_it_returns(store, db_path):
    store.ensure_conversation("c1", adapter="repl", title="first")
    assert raw_rows(db_path, "SELECT id, adapter, title FROM conversations") == [("c1", "repl", "first")]
    for number in range(3):
        store.add_message("c1", "user", f"message {number}")
        assert raw_rows(db_path, "SELECT count(*) FROM messages") == [(number + 1,)]
    assert store.ensure_conversation("c1") is False  # already there: nothing changes
    assert raw_rows(db_path, "SELECT title FROM conversations") == [("first",)]


def test_list_show_search_and_delete(store):
    store.ensure_conversation("aa11", adapter="repl", title="about food")
    store.ensure_conversation("aa22", adapter="discord", channel_key="guild/1", title="music")
    store.ensure_conversation("bb33", adapter="discord", channel_key="guild/2")
    store.add_message("aa11", "user", "I like PIZZA a lot")
    store.add_message("aa11", "bot", "pizza is great 100% of the time")
    store.add_message("aa22", "user", "play some jazz")
    store.add_message("bb33", "user", "ok")
    store.add_message("aa22", "bot", 'say "hi" to jazz fans')

    listed = store.list_conversations()
    assert [s.id for s in listed] == ["aa22", "bb33", "aa11"]  # most recently active first
    assert {s.id: s.message_count for s in listed} == {"aa22": 2, "bb33": 1, "aa11": 2}
    assert [s.id for s in store.list_conversations(channel_key="guild/2")] == ["bb33"]
    assert [s.id for s in store.list_conversations(adapter="discord", limit=1)] == ["aa22"]
    assert [s.id for s in store.list_conversations(limit=1, offset=1)] == ["bb33"]
    assert store.latest_conversation_id(adapter="repl") == "aa11"

    record = store.get_conversation("aa1")  # a unique prefix is enough
    assert record.id == "aa11" and [m.text for m in record.messages] == [
        "I like PIZZA a lot",
        "pizza is great 100% of the time",
    ]
    with pytest.raises(UnknownConversationError, match="starts several"):
        store.get_conversation("aa")
    with pytest.raises(UnknownConversationError, match="no conversation 'zz'"):
        store.get_conversation("zz")

    assert [h.message.text for h in store.search("pizza")] == ["pizza is great 100% of the time", "I like PIZZA a lot"]
    assert [h.message.text for h in store.search("ok")] == ["ok"]  # shorter than a trigram: LIKE
    assert [h.message.text for h in store.search("100%")] == ["pizza is great 100% of the time"]
    assert [h.conversation_id for h in store.search('"hi"')] == ["aa22"]  # quotes are text, not FTS syntax
    assert store.search("AND OR NEAR(") == []
    with pytest.raises(LogError, match="empty"):
        store.search("  ")

    assert store.delete_conversation("aa11") == 2
    assert store.search("pizza") == []  # the search index forgets deleted messages too
    assert store.count_messages() == 3
    with pytest.raises(UnknownConversationError):
        store.delete_conversation("aa11")


def make_version_1_log(db_path):
    """A log as chatcore wrote it before Alembic: schema 1, no alembic_version, a half-made search index."""
    import sqlalchemy as sa
    from alembic import command

    with sa.create_engine(sqlite_url(db_path)).begin() as connection:
        config = schema_module._alembic_config(connection)
        command.upgrade(config, "0001")
        connection.exec_driver_sql("DROP TABLE alembic_version")
        connection.exec_driver_sql(
            "INSERT INTO conversations VALUES ('old', '2024-01-01 00:00:00', "
            "'2024-01-01 00:00:00', 'repl', NULL, NULL, 'old chat', '{}')"
        )
        connection.exec_driver_sql(
            "INSERT INTO messages (conversation_id, role, text, created, interrupted, "
            "superseded) VALUES ('old', 'user', 'an old pizza message', "
            "'2024-01-01 00:00:00', 0, 0)"
        )
        # Killed between two statements of the old, untransacted search set-up.
        connection.exec_driver_sql(
            "CREATE VIRTUAL TABLE messages_fts USING fts5(text, content='messages', "
            "content_rowid='id', tokenize='trigram')"
        )


def test_a_version_1_log_is_upgraded_in_place(db_path):
    make_version_1_log(db_path)
    with ConversationStore(sqlite_url(db_path)) as upgraded:
        upgraded.add_message("old", "bot", "new pizza reply")
        assert [h.message.text for h in upgraded.search("pizza")] == ["new pizza reply", "an old pizza message"]
        assert upgraded.get_conversation("old").system is None
    assert raw_rows(db_path, "SELECT version FROM chatcore_schema") == [(3,)]
    assert raw_rows(db_path, "SELECT version_num FROM alembic_version") == [("0003",)]
    names = {name for (name,) in raw_rows(db_path, "SELECT name FROM sqlite_master")}
    assert {"messages_fts_insert", "messages_fts_delete", "messages_fts_update", "ux_messages_write_key"} <= names


def test_newer_damaged_and_restored_schema_versions(db_path):
    ConversationStore(sqlite_url(db_path)).close()

    def set_sql(sql):
        connection = sqlite3.connect(str(db_path))
        with connection:
            connection.execute(sql)
        connection.close()

    set_sql("UPDATE chatcore_schema SET version = 4")
    with pytest.raises(LogError, match="newer chatcore"):
        ConversationStore(sqlite_url(db_path))
    set_sql("UPDATE chatcore_schema SET version = 0")
    with pytest.raises(LogError, match="damaged: schema version"):
        ConversationStore(sqlite_url(db_path))
    set_sql("DELETE FROM chatcore_schema")
    ConversationStore(sqlite_url(db_path)).close()
    assert raw_rows(db_path, "SELECT version FROM chatcore_schema") == [(3,)]  # restored
    set_sql("UPDATE alembic_version SET version_num = '0099'")
    with pytest.raises(LogError, match="newer chatcore"):
        ConversationStore(sqlite_url(db_path))


def test_a_corrupt_file_gives_one_clear_error(tmp_path):
    path = tmp_path / "broken.sqlite3"
    path.write_bytes(b"this is not a database, just text\n" * 200)
    with pytest.raises(LogError, match="not a database"):
        ConversationStore(sqlite_url(path))


def test_the_url_comes_from_the_option_the_environment_or_the_data_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.delenv("CHATCORE_DB", raising=False)
    assert resolve_url() == f"sqlite:///{tmp_path / 'data' / 'chatcore' / 'conversations.sqlite3'}"
    monkeypatch.setenv("CHATCORE_DB", "postgresql://bot@db/chat")
    assert resolve_url() == "postgresql://bot@db/chat"
    assert resolve_url(str(tmp_path / "x.db")) == f"sqlite:///{tmp_path / 'x.db'}"
    with pytest.raises(LogError, match="not a database URL"):
        ConversationStore("not a url://")


def test_a_folder_given_by_hand_must_exist_and_only_the_user_data_folder_is_made(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.delenv("CHATCORE_DB", raising=False)
    missing = tmp_path / "no" / "such"
    for given in (str(missing / "log.sqlite3"), f"sqlite:///{missing}/log.sqlite3"):
        with pytest.raises(LogError) as refused:
            ConversationStore(resolve_url(given))
        assert f"no folder {missing} " in str(refused.value) and "\n" not in str(refused.value)
        monkeypatch.setenv("CHATCORE_DB", given)
        with pytest.raises(LogError, match=f"no folder {missing} "):
            ConversationStore(resolve_url())
        monkeypatch.delenv("CHATCORE_DB")
    assert not (tmp_path / "no").exists()  # no folder tree made for a mistyped path
    with ConversationStore(resolve_url()) as store:  # the default place: made as needed, private
        assert store.file_path == tmp_path / "data" / "chatcore" / "conversations.sqlite3"
        assert store.file_path.parent.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("given", [":memory:", "sqlite:///:memory:", "sqlite://"])
def test_memory_is_a_log_kept_in_memory_while_the_process_runs(engine, tmp_path, monkeypatch, logs_cli, given):
    """`--db :memory:` on a chat or the server: SQLite's memory, not a file named `:memory:`; the
    log's thread writes it and the chat's reads it (SQLAlchemy's own `:memory:` is one per thread)."""
    monkeypatch.chdir(tmp_path)
    store = ConversationStore(resolve_url(given))
    assert store.file_path is None and store.display_url.startswith(":memory: (kept in memory only")
    plugin = ConversationLogPlugin(store, journal_dir=tmp_path / "journal")
    assert engine.host.register(plugin, "conversation-log")
    conversation = engine.conversation()
    engine.send(conversation, "kept in memory", decoder="greedy", max_new_tokens=2).text()
    plugin.close()
    engine.host.unregister("conversation-log")
    assert [m.text for m in store.get_conversation(conversation.id).messages][0] == "kept in memory"
    with ConversationStore(store.url) as same:  # another store in this process reaches the same log
        assert same.count_conversations() == 1
    store.close()
    with ConversationStore(resolve_url(given)) as fresh:  # each one starts empty
        assert fresh.count_conversations() == 0
    assert list(tmp_path.iterdir()) == []  # no file, no journal

    refused = logs_cli("list", "--db", given)  # nothing to read there
    assert refused.exit_code == 1 and refused.stderr.strip().splitlines() == [
        "Error: :memory: is SQLite's in-memory database: it holds no conversation log to read (a chat, a bot or "
        "the server given --db :memory: keeps its log there only while it runs)"
    ]
    assert logs_cli("where", "--db", given).exit_code == 1
    assert list(tmp_path.iterdir()) == []


# -- the hooks, through a real engine -------------------------------------------------------
@pytest.mark.parametrize("given", ["/", "sqlite://///", "{tmp}"])
def test_a_folder_named_as_the_log_is_refused_in_one_line_by_every_subcommand(tmp_path, logs_cli, given):
    given = given.format(tmp=tmp_path)
    for subcommand in ("where", "list"):
        refused = logs_cli(subcommand, "--db", given)
        assert refused.exit_code == 1 and refused.stdout == "", refused.output
        assert refused.stderr.strip().endswith("is a folder, not a conversation log file (name the file in it)")


def test_the_hooks_write_every_turn_with_its_provenance(engine, store, log_plugin, db_path, notices):
    conversation = engine.conversation(adapter="test", channel_key="room-1")
    response = engine.send(conversation, "hello there, how are you?", decoder="greedy", max_new_tokens=5, seed=3)
    assert raw_rows(db_path, "SELECT role FROM messages") == [("user",)]  # committed before the reply
    text = response.text()

    record = store.get_conversation(conversation.id)
    assert (record.adapter, record.channel_key, record.model) == ("test", "room-1", engine.loaded.name)
    assert record.title == "hello there, how are you?"
    user, bot = record.messages
    assert (user.role, user.text) == ("user", "hello there, how are you?")
    assert user.token_count == len(encode_text(engine.tokenizer, user.text))
    assert (bot.role, bot.text, bot.interrupted, bot.superseded) == ("bot", text, False, False)
    assert bot.token_count == len(response.token_ids)
    assert bot.decoder == {"name": "greedy", "settings": response.provenance["decoder"]["settings"]}
    assert bot.steerers == [] and bot.candidates is None and bot.seed == 3
    assert bot.latency_s == response.provenance["timings"]["total_s"]
    assert bot.prompt_tokens == response.provenance["prompt_tokens"]
    assert bot.created == conversation.turns[-1].created
    assert notices == [] and log_plugin.pending == 0


def test_steerers_and_their_settings_are_logged(engine, store, log_plugin):
    conversation = engine.conversation()
    engine.send(
        conversation,
        "what should we eat?",
        decoder="greedy",
        max_new_tokens=3,
        steerers=[("bow-bias", {"words": "pizza,pasta", "strength": "3"})],
    ).text()
    bot = store.get_conversation(conversation.id).messages[-1]
    assert bot.steerers[0]["name"] == "bow-bias"
    assert bot.steerers[0]["settings"]["words"] == ["pizza", "pasta"]
    assert bot.steerers[0]["settings"]["strength"] == 3.0


def test_an_interrupted_reply_is_logged_as_interrupted(engine, store, log_plugin):
    conversation = engine.conversation()
    response = engine.send(conversation, "tell me a long story", decoder="greedy", max_new_tokens=40, min_new_tokens=40)
    from chatcore.cutting import whole_words

    stream = iter(response)
    partial = next(stream)
    while not whole_words(partial):
        partial += next(stream)
    response.interrupt()
    bot = store.get_conversation(conversation.id).messages[-1]
    assert bot.interrupted is True and conversation.turns[-1].interrupted is True
    assert bot.text == conversation.turns[-1].text == whole_words(partial)  # never half a word
    assert bot.token_count == len(response.token_ids) < 40


def test_a_regenerated_reply_supersedes_the_old_one_and_resume_matches(engine, store, log_plugin):
    conversation = engine.conversation(adapter="repl")
    engine.send(conversation, "hi", decoder="greedy", max_new_tokens=4).text()
    engine.send(conversation, "how are you?", decoder="top-k", max_new_tokens=4, seed=1).text()
    conversation.turns.pop()  # what /retry does before asking again
    engine.respond(conversation, decoder="top-k", max_new_tokens=4, seed=2).text()
    engine.respond(conversation, decoder="greedy", max_new_tokens=3).text()  # a second reply in a row is a real turn

    record = store.get_conversation(conversation.id)
    assert [(m.role, m.superseded) for m in record.messages] == [
        ("user", False),
        ("bot", False),
        ("user", False),
        ("bot", True),
        ("bot", False),
        ("bot", False),
    ]
    # Counts (`logs list`, /conversations) are of the turns a reader sees.
    assert record.message_count == len(conversation.turns) == 5
    (summary,) = store.list_conversations()
    assert summary.message_count == 5

    resumed = store.resume(conversation.id[:10])
    assert resumed.id == conversation.id and resumed.meta["adapter"] == "repl"
    assert [(t.role, t.text, t.created, t.interrupted) for t in resumed.turns] == [
        (t.role, t.text, t.created, t.interrupted) for t in conversation.turns
    ]
    assert resumed.turns[-1].meta["provenance"]["decoder"]["name"] == "greedy"

    # The resumed conversation goes on in the same row.
    engine.send(resumed, "and now?", decoder="greedy", max_new_tokens=3).text()
    assert len(store.load_turns(conversation.id)) == len(conversation.turns) + 2
    assert store.count_conversations() == 1


def test_the_system_prompt_is_stored_and_restored_on_resume(engine, store, log_plugin):
    conversation = engine.conversation(system="You are a terse pirate.", adapter="repl")
    engine.send(conversation, "hello", decoder="greedy", max_new_tokens=3).text()
    record = store.get_conversation(conversation.id)
    assert record.system == "You are a terse pirate."
    assert record.prompt_format == engine.prompt_format.name
    resumed = store.resume(conversation.id)
    assert resumed.system == "You are a terse pirate."
    assert resumed.messages() == conversation.messages()  # the same prompt, system prompt first

    plain = engine.conversation()
    engine.send(plain, "no persona", decoder="greedy", max_new_tokens=2).text()
    assert store.resume(plain.id).system is None

    # Changed mid-conversation: the log holds the prompt as it is now, each reply the one it was made with.
    conversation.system = "You are a calm librarian."
    engine.send(conversation, "and now?", decoder="greedy", max_new_tokens=2).text()
    record = store.get_conversation(conversation.id)
    assert record.system == "You are a calm librarian."
    assert store.resume(conversation.id).system == "You are a calm librarian."
    replies = [m for m in record.messages if m.role == "bot"]
    assert [m.provenance.get("system") for m in replies] == ["You are a terse pirate.", "You are a calm librarian."]

    # Resumed (no format of its own: the engine's) and continued: the logged format stays.
    again = store.resume(conversation.id)
    engine.send(again, "still there?", decoder="greedy", max_new_tokens=2).text()
    assert store.get_conversation(conversation.id).prompt_format == engine.prompt_format.name


def test_a_locked_database_keeps_the_chat_going_and_catches_up(engine, db_path):
    store = ConversationStore(sqlite_url(db_path), timeout_s=0.05)
    told = []
    plugin = ConversationLogPlugin(store, notify=told.append, retry_after_s=0.0)
    engine.host.register(plugin, "conversation-log")
    blocker = sqlite3.connect(str(db_path), isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # another process holding the write lock
    try:
        conversation = engine.conversation()
        engine.send(conversation, "first", decoder="greedy", max_new_tokens=3).text()
        engine.send(conversation, "second", decoder="greedy", max_new_tokens=3).text()
        assert [t.text for t in conversation.turns if t.role == "user"] == ["first", "second"]
        assert len(told) == 1 and "locked" in told[0]  # told once, not once per turn
        assert plugin.failing and plugin.pending == 4  # four messages, each carrying its conversation
    finally:
        blocker.rollback()
        blocker.close()
    engine.send(conversation, "third", decoder="greedy", max_new_tokens=3).text()
    assert plugin.pending == 0 and plugin.failing is None and "available again" in told[-1]
    assert [(t.role, t.text) for t in store.load_turns(conversation.id)] == [
        (t.role, t.text) for t in conversation.turns
    ]
    store.close()


def test_a_read_only_log_is_readable_and_writes_are_reported(engine, db_path):
    with ConversationStore(sqlite_url(db_path)) as writable:
        writable.ensure_conversation("kept", title="old")
        writable.add_message("kept", "user", "an old message")
    read_only = ConversationStore(f"sqlite:///file:{db_path}?mode=ro&uri=true")
    assert [s.id for s in read_only.list_conversations()] == ["kept"]
    told = []
    engine.host.register(ConversationLogPlugin(read_only, notify=told.append), "conversation-log")
    conversation = engine.conversation()
    reply = engine.send(conversation, "hello", decoder="greedy", max_new_tokens=3).text()
    assert conversation.turns[-1].text == reply
    assert len(told) == 1 and "readonly" in told[0].replace("-", "").replace(" ", "")
    read_only.close()


# -- views -----------------------------------------------------------------------------------
def test_escape_sequences_are_shown_not_obeyed(store):
    store.ensure_conversation("esc", title="\x1b[2Jcleared?")
    store.add_message("esc", "bot", "red \x1b[31mtext\x07 <|endoftext|>")
    record = store.get_conversation("esc")
    shown = conversation_text(record)
    assert "\x1b" not in shown and "\x07" not in shown and "\\x1b[31m" in shown
    markdown = conversation_markdown(record)
    assert "\x1b" not in markdown and "&lt;|endoftext|>" in markdown
    assert display_safe("tab\tand\nnewline") == "tab\tand\nnewline"


# -- `chatcore logs` -------------------------------------------------------------------------
@pytest.fixture
def logs_cli(tmp_path, monkeypatch):
    from chatcore.cli import build_cli

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))  # the journal and the input history the commands reach

    host = plugin_manager.PluginHost()
    host.load_modules((LOG_MODULE,))
    assert host.problems == []
    plugin_manager.set_plugin_host(host)
    runner = CliRunner()
    group = build_cli()

    def invoke(*args, input=None, env=None):
        return runner.invoke(group, ["logs", *args], input=input, env=env, catch_exceptions=False)

    return invoke


@pytest.fixture
def filled(store):
    store.ensure_conversation("0123456789abcdef", adapter="repl", title="pizza talk")
    store.add_message("0123456789abcdef", "user", "do you like pizza?")
    store.add_message(
        "0123456789abcdef",
        "bot",
        "I love pizza",
        decoder={"name": "greedy", "settings": {}},
        token_count=4,
        latency_s=0.25,
        seed=7,
        interrupted=True,
    )
    store.ensure_conversation("fedcba9876543210", adapter="discord", channel_key="g/1", title="weather")
    store.add_message("fedcba9876543210", "user", "is it raining?")
    return store


def test_logs_list_show_and_search(logs_cli, filled):
    url = filled.url
    listed = logs_cli("list", "--db", url)
    assert listed.exit_code == 0, listed.output
    lines = listed.stdout.splitlines()
    assert lines[0].split()[:4] == ["ID", "LAST", "ACTIVE", "ADAPTER"]
    assert lines[1].startswith("fedcba987654 ") and lines[2].startswith("0123456789ab ")
    assert "pizza talk" in lines[2] and " 2 " in lines[2]

    as_json = json.loads(logs_cli("--db", url, "list", "--json").stdout)  # --db on the group works too
    assert [(c["id"], c["message_count"]) for c in as_json] == [("fedcba9876543210", 1), ("0123456789abcdef", 2)]

    shown = logs_cli("show", "0123", "--db", url)
    assert shown.exit_code == 0
    assert "conversation 0123456789abcdef" in shown.stdout
    assert "you> do you like pizza?" in shown.stdout
    assert "bot> I love pizza  [greedy, 4 tokens, 0.25 s, seed 7, interrupted]" in shown.stdout
    record = json.loads(logs_cli("show", "0123", "--json", "--db", url).stdout)
    assert record["messages"][1]["interrupted"] is True and record["messages"][1]["seed"] == 7

    found = logs_cli("search", "PIZZA", "--db", url, "--json")
    assert [hit["message"]["text"] for hit in json.loads(found.stdout)] == ["I love pizza", "do you like pizza?"]
    assert "0123456789ab" in logs_cli("search", "pizza", env={"CHATCORE_DB": url}).stdout  # from the environment


def test_logs_export_jsonl_and_markdown(logs_cli, filled, tmp_path):
    exported = logs_cli("export", "--db", filled.url)
    records = [json.loads(line) for line in exported.stdout.splitlines()]
    assert [r["id"] for r in records] == ["0123456789abcdef", "fedcba9876543210"]
    assert [m["text"] for m in records[0]["messages"]] == ["do you like pizza?", "I love pizza"]
    twice = logs_cli("export", "0123", "0123456789abcdef", "--db", filled.url)
    assert [json.loads(line)["id"] for line in twice.stdout.splitlines()] == ["0123456789abcdef"]

    target = tmp_path / "one.md"
    written = logs_cli("export", "fedc", "--format", "markdown", "-o", str(target), "--db", filled.url)
    assert written.exit_code == 0 and "exported 1 conversation" in written.stderr
    markdown = target.read_text()
    assert markdown.startswith("# weather") and "**you**" in markdown and "is it raining?" in markdown


def test_logs_delete_asks_first(logs_cli, filled):
    refused = logs_cli("delete", "0123", "--db", filled.url, input="n\n")
    assert refused.exit_code != 0 and filled.count_conversations() == 2
    deleted = logs_cli("delete", "0123", "--db", filled.url, "--yes")
    assert deleted.exit_code == 0 and "deleted conversation 0123456789abcdef and its 2 message(s)" in deleted.stdout
    assert [s.id for s in filled.list_conversations()] == ["fedcba9876543210"]


@pytest.mark.parametrize(
    "args, needle",
    [
        (("show", "nope"), "no conversation 'nope'"),
        (("delete", "nope", "--yes"), "no conversation 'nope'"),
        (("export", "nope"), "no conversation 'nope'"),
        (("search", " "), "the search text is empty"),
    ],
)
def test_logs_errors_are_one_line(logs_cli, filled, args, needle):
    result = logs_cli(*args, "--db", filled.url)
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [f"Error: {result.stderr.strip()[7:]}"]
    assert needle in result.stderr and "Traceback" not in result.output


def test_logs_on_a_corrupt_file_is_one_line(logs_cli, tmp_path):
    path = tmp_path / "corrupt.sqlite3"
    path.write_bytes(b"\x00garbage" * 500)
    result = logs_cli("list", "--db", str(path))
    assert result.exit_code == 1
    assert len(result.stderr.strip().splitlines()) == 1 and "not a database" in result.stderr


def test_listing_uses_indexes_not_a_scan_of_the_messages(store):
    """`chatcore logs list` stays fast on a big log (bench: python bench/log_list_speed.py)."""
    import sqlalchemy as sa

    from chatcore.log.models import ConversationRow

    query = (
        sa.select(*store._summary_columns())
        .order_by(ConversationRow.updated.desc(), ConversationRow.id.desc())
        .limit(20)
    )
    compiled = str(query.compile(store.db, compile_kwargs={"literal_binds": True}))
    with store.db.connect() as connection:
        plan = " | ".join(row[-1] for row in connection.exec_driver_sql(f"EXPLAIN QUERY PLAN {compiled}"))
    assert "ix_messages_conversation_id" in plan and "SCAN messages" not in plan, plan


def test_logs_never_create_a_log_for_a_mistyped_path(logs_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for where in ("sqlite//x.db", "missing/log.sqlite3", "sqlite:///:memory:", ":memory:"):
        result = logs_cli("list", "--db", where)
        assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, where
        assert "no conversation log at" in result.stderr or "in-memory" in result.stderr
    assert list(tmp_path.iterdir()) == []  # nothing was created


def test_an_authors_messages_are_exported_and_deleted(logs_cli, store):
    store.add_message("room", "user", "alice one", author_id="111", conversation={"title": "alice one"})
    store.add_message("room", "bot", "a reply", conversation={})
    store.add_message("room", "user", "bob speaks", author_id="222", conversation={})
    store.add_message("alone", "user", "alice alone", author_id="111", conversation={"adapter": "discord"})
    exported = [
        json.loads(line) for line in logs_cli("export", "--author", "111", "--db", store.url).stdout.splitlines()
    ]
    assert sorted((r["id"], [m["text"] for m in r["messages"]]) for r in exported) == [
        ("alone", ["alice alone"]),
        ("room", ["alice one"]),
    ]
    result = logs_cli("delete", "--author", "111", "--yes", "--db", store.url)
    assert result.exit_code == 0 and "deleted 2 message(s)" in result.stdout
    assert [m.text for m in store.get_conversation("room").messages] == ["a reply", "bob speaks"]
    assert store.get_conversation("room").title == "bob speaks"  # her first message titled it: what remains does
    assert store.count_conversations() == 1  # a conversation left with no message goes too
    assert logs_cli("delete", "--db", store.url).exit_code == 2  # an ID or --author is needed


def test_a_conversation_titled_by_a_deleted_authors_message_is_titled_by_what_remains(logs_cli, store):
    """`logs delete --author` of the message that titled a conversation left it with no title: an empty
    TITLE in `logs list`. The first message that remains titles it now (a user's, else a reply); a
    title that was not the author's message stays."""
    store.add_message("room", "user", "alice opens", author_id="111", conversation={"title": "alice opens"})
    store.add_message("room", "bot", "welcome", conversation={})
    store.add_message("room", "user", "bob joins in", author_id="222", conversation={})
    store.add_message("asked", "user", "alice asks", author_id="111", conversation={"title": "alice asks"})
    store.add_message("asked", "bot", "an answer", conversation={})
    store.add_message("named", "user", "alice names it", author_id="111", conversation={"title": "the channel"})
    store.add_message("named", "user", "bob too", author_id="222", conversation={})
    assert logs_cli("delete", "--author", "111", "--yes", "--db", store.url).exit_code == 0

    listed = json.loads(logs_cli("list", "--json", "--db", store.url).stdout)
    titles = {c["id"]: c["title"] for c in listed}
    assert titles == {"room": "bob joins in", "asked": "an answer", "named": "the channel"}
    rows = logs_cli("list", "--db", store.url).stdout.splitlines()[1:]
    assert sorted(row.rsplit("  ", 1)[1] for row in rows) == ["an answer", "bob joins in", "the channel"]
    assert "title:    bob joins in" in logs_cli("show", "room", "--db", store.url).stdout


def test_logs_delete_counts_the_turns_logs_list_shows_and_names_superseded_replies(
    engine, store, log_plugin, logs_cli, db_path
):
    """A reply replaced by /retry stays in the log, superseded, and `logs list` does not count it:
    `logs delete` said 5 message(s) of a conversation listed with 4 turns. It counts the turns the list
    shows and names the superseded reply apart; every row goes, the superseded reply's too."""
    conversation = engine.conversation(adapter="repl")
    engine.send(conversation, "hi", decoder="greedy", max_new_tokens=4).text()
    engine.send(conversation, "how are you?", decoder="greedy", max_new_tokens=4).text()
    conversation.turns.pop()  # what /retry does before asking again
    engine.respond(conversation, decoder="greedy", max_new_tokens=3).text()
    (listed,) = json.loads(logs_cli("list", "--json", "--db", store.url).stdout)
    assert listed["message_count"] == 4 and raw_rows(db_path, "SELECT count(*) FROM messages") == [(5,)]

    asked = logs_cli("delete", conversation.id[:12], "--db", store.url, input="n\n")
    assert "('hi', 4 messages, and 1 reply superseded by a retry)?" in asked.output
    deleted = logs_cli("delete", conversation.id[:12], "--yes", "--db", store.url)
    assert deleted.exit_code == 0, deleted.output
    assert deleted.stdout.strip() == (
        f"deleted conversation {conversation.id} and its 4 message(s), and 1 reply superseded by a retry"
    )
    assert raw_rows(db_path, "SELECT count(*) FROM messages") == [(0,)]


def test_authors_whose_long_ids_share_their_first_64_characters_stay_apart(logs_cli, store):
    """An id longer than the column (an HTTP `user`) is stored as its digest, not cut: cut, the two
    merged, and `--author` given the full id found nothing."""
    shared = "tenant-42/" + "x" * 60
    alice, bob = shared + "/alice", shared + "/bob"
    store.add_message("a", "user", "alice speaks", author_id=alice, conversation={"adapter": "http"})
    store.add_message("b", "user", "bob speaks", author_id=bob, conversation={"adapter": "http"})
    store.add_message("c", "user", "a short id", author_id=shared[:64], conversation={"adapter": "http"})
    stored = {r.id: r.messages[0].author_id for r in store.iter_conversations()}
    assert len(set(stored.values())) == 3 and stored["c"] == shared[:64]
    assert all(len(author) == 64 and author.startswith("sha256:") for author in (stored["a"], stored["b"]))
    note = store.get_conversation("a").messages[0].provenance["normalised"]
    assert note == [f"author_id: stored as its SHA-256 digest ({len(alice)} characters)"]

    exported = logs_cli("export", "--author", alice, "--db", store.url).stdout.splitlines()
    assert [[m["text"] for m in json.loads(line)["messages"]] for line in exported] == [["alice speaks"]]
    result = logs_cli("delete", "--author", alice, "--yes", "--db", store.url)
    assert result.exit_code == 0 and "deleted 1 message(s)" in result.stdout
    assert sorted(s.id for s in store.list_conversations()) == ["b", "c"]
    assert store.delete_author(stored["b"]) == 0  # the digest as given is an id of its own, not bob's
    assert store.delete_author(bob) == 1 and [s.id for s in store.list_conversations()] == ["c"]


def test_every_printed_field_is_escaped(store):
    store.ensure_conversation(
        "\x1b]0;id", adapter="\x1b[31mrepl", model="m\u202egpt", title="t", system="be \x1b[2J kind"
    )
    store.add_message("\x1b]0;id", "bot", "hi", decoder={"name": "\x1b[5mgreedy"}, steerers=[{"name": "\x07s"}])
    record = store.get_conversation("\x1b]0;id")
    for shown in (conversation_text(record), conversation_markdown(record), summary_table(store.list_conversations())):
        assert "\x1b" not in shown and "\x07" not in shown and "\u202e" not in shown


def damage_pages(path, first_fraction=0.4, pages=3, page_size=4096):
    """Overwrite a few pages in the middle of an SQLite file, as a failing disk would."""
    data = bytearray(path.read_bytes())
    start = int(len(data) // page_size * first_fraction) * page_size
    data[start : start + pages * page_size] = b"\xde\xad" * (pages * page_size // 2)
    path.write_bytes(bytes(data))


def test_a_damaged_file_is_salvaged_and_never_written_into(logs_cli, engine, db_path, tmp_path):
    with ConversationStore(sqlite_url(db_path)) as filling:
        for number in range(60):
            for turn in range(8):
                filling.add_message(
                    f"c{number:03d}",
                    "user",
                    f"conversation {number} turn {turn} " + "x" * 300,
                    conversation={"title": f"number {number}"},
                )
    damage_pages(db_path)
    assert logs_cli("export", "--db", str(db_path)).exit_code == 1  # a plain export stops at the damage

    salvaged = logs_cli("export", "--salvage", "--db", str(db_path))
    assert salvaged.exit_code == 0 and "recovered" in salvaged.stderr
    records = [json.loads(line) for line in salvaged.stdout.splitlines()]
    messages = sum(len(r["messages"]) for r in records)
    assert len(records) >= 50 and 400 <= messages < 480  # all but what the damaged pages held

    told = []
    damaged = ConversationStore(sqlite_url(db_path))
    plugin = ConversationLogPlugin(damaged, notify=told.append, journal_dir=tmp_path / "journal")
    engine.host.register(plugin, "conversation-log")
    before = db_path.read_bytes()
    engine.send(engine.conversation(), "hello", decoder="greedy", max_new_tokens=3).text()
    assert len(told) == 1 and "damaged" in told[0] and "--salvage" in told[0]
    wal = db_path.with_name(db_path.name + "-wal")
    assert plugin.journaled == 2  # kept aside, and the file (with its write-ahead log) untouched
    assert db_path.read_bytes() == before and (not wal.exists() or wal.stat().st_size == 0)
    damaged.close()


def test_a_log_file_deleted_mid_chat_is_said_once_and_the_conversation_written_anew(
    engine, store, log_plugin, notices, db_path
):
    conversation = engine.conversation(adapter="repl")
    engine.send(conversation, "my name is ada", decoder="greedy", max_new_tokens=4).text()
    for path in db_path.parent.glob(db_path.name + "*"):  # the file and its -wal / -shm
        path.unlink()
    engine.send(conversation, "what is my name?", decoder="greedy", max_new_tokens=4).text()
    engine.send(conversation, "thanks", decoder="greedy", max_new_tokens=4).text()

    assert len(notices) == 1 and "was deleted: a new one was created there" in notices[0]
    assert db_path.exists()
    with ConversationStore(sqlite_url(db_path)) as fresh:
        messages = fresh.get_conversation(conversation.id).messages
    # Nothing of this conversation is lost, nothing doubled.
    assert [(m.role, m.text) for m in messages] == [(t.role, t.text) for t in conversation.turns]
    assert len(messages) == 6


def test_synchronous_full_is_asked_for_in_the_url(db_path):
    """The durability setting behind docs/conversation-log.md: NORMAL unless the URL asks for FULL."""

    def level(store):
        with store.db.connect() as connection:
            return connection.exec_driver_sql("PRAGMA synchronous").scalar()

    with ConversationStore(sqlite_url(db_path)) as default:
        assert default.synchronous == "normal" and level(default) == 1  # SQLite's NORMAL
    with ConversationStore(sqlite_url(db_path) + "?synchronous=FULL") as full:
        full.add_message("c", "user", "kept through a power cut", conversation={"title": "c"})
        assert full.synchronous == "full" and level(full) == 2  # SQLite's FULL
        assert full.file_path == db_path
    with pytest.raises(LogError, match="`synchronous` must be one of normal, full, got 'sometimes'"):
        ConversationStore(sqlite_url(db_path) + "?synchronous=sometimes")


def test_a_journal_folder_that_fails_a_deletion_is_one_line_and_says_what_happened(store, monkeypatch):
    """Recording the deletion comes first: when it fails nothing is deleted; scrubbing comes
    after: when it fails the rows are gone and the message says the journal still holds them."""
    from chatcore.log import store as store_module
    from chatcore.log.errors import LogError

    store.ensure_conversation("cc11", adapter="repl", title="kept")
    store.add_message("cc11", "user", "a secret")

    def full(*arguments, **keywords):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_module, "record_deletion", full)
    with pytest.raises(LogError) as caught:
        store.delete_conversation("cc11")
    message = str(caught.value)
    assert "nothing was deleted" in message and "No space left on device" in message and "\n" not in message
    assert [m.text for m in store.get_conversation("cc11").messages] == ["a secret"]

    monkeypatch.undo()
    monkeypatch.setattr(store_module, "scrub_deletion", full)
    with pytest.raises(LogError) as caught:
        store.delete_conversation("cc11")
    message = str(caught.value)
    assert "deleted from the database, but not from the journal folder" in message and "\n" not in message
    with pytest.raises(UnknownConversationError):
        store.get_conversation("cc11")
