"""``chatcore logs``: list, show, search, export and delete logged conversations.

SQLAlchemy is imported only when a subcommand runs, so ``chatcore --help`` stays fast.
"""

from __future__ import annotations

import errno
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

import click

if TYPE_CHECKING:
    from chatcore.log.store import ConversationStore

F = TypeVar("F", bound=Callable[..., Any])

DB_HELP = (
    "SQLAlchemy URL or SQLite file path of the log "
    "(default: $CHATCORE_DB, else conversations.sqlite3 in the user data folder)."
)


def db_option(function: F) -> F:
    return click.option("--db", "db_url", default=None, metavar="URL", help=DB_HELP)(function)


def open_store(ctx: click.Context, db_url: str | None, reading: bool = False) -> "ConversationStore":
    """The log the command works on; never a new one (a mistyped path creates nothing).
    ``reading``: what the command shows leaves out writes that wait in the journal, so it
    ends with a note of how many there are, if any."""
    from chatcore.log.location import resolve_url
    from chatcore.log.store import ConversationStore

    group_url = (ctx.find_object(dict) or {}).get("db_url")
    store = ConversationStore(resolve_url(db_url or group_url), create=False)
    ctx.call_on_close(store.close)
    waiting = store.waiting_in_journal() if reading else 0
    if waiting:
        ctx.call_on_close(
            lambda: click.echo(
                f"note: {waiting} write(s) wait in the journal (made while the log was locked or down) and are "
                "not shown: the next chat, bot, server or `generate --continue` writes them",
                err=True,
            )
        )
    return store


@click.group("logs")
@db_option
@click.pass_context
def logs(ctx: click.Context, db_url: str | None) -> None:
    """The conversation log: list, show, search, export and delete conversations.

    Every `chatcore chat` conversation is logged (unless --no-log). IDs may be
    shortened to any unique prefix, as `list` prints them.
    """
    ctx.ensure_object(dict)["db_url"] = db_url


@logs.command("list")
@click.option("-n", "--limit", type=click.IntRange(1, 100_000), default=20, show_default=True)
@click.option("--offset", type=click.IntRange(0), default=0, help="Skip this many of the most recent.")
@click.option("--adapter", default=None, help="Only conversations from this adapter (repl, discord, ...).")
@click.option("--channel", "channel_key", default=None, help="Only conversations with this channel key.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@db_option
@click.pass_context
def list_command(
    ctx: click.Context,
    limit: int,
    offset: int,
    adapter: str | None,
    channel_key: str | None,
    as_json: bool,
    db_url: str | None,
) -> None:
    """The most recently active conversations: id, last activity, adapter, messages, title."""
    from chatcore.log import formatting

    store = open_store(ctx, db_url, reading=True)
    summaries = store.list_conversations(limit=limit, offset=offset, adapter=adapter, channel_key=channel_key)
    if as_json:
        click.echo(formatting.to_json([summary.to_dict() for summary in summaries]))
    elif summaries:
        click.echo(formatting.summary_table(summaries))
    else:
        click.echo(f"no conversations in {store.display_url}", err=True)


@logs.command("show")
@click.argument("conversation_id", metavar="ID")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@db_option
@click.pass_context
def show_command(ctx: click.Context, conversation_id: str, as_json: bool, db_url: str | None) -> None:
    """One conversation, every message with its decoder, tokens, latency and flags."""
    from chatcore.log import formatting

    record = open_store(ctx, db_url, reading=True).get_conversation(conversation_id)
    click.echo(formatting.to_json(record.to_dict()) if as_json else formatting.conversation_text(record))


@logs.command("search")
@click.argument("text")
@click.option("-n", "--limit", type=click.IntRange(1, 100_000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@db_option
@click.pass_context
def search_command(ctx: click.Context, text: str, limit: int, as_json: bool, db_url: str | None) -> None:
    """Messages that contain TEXT (case-insensitive), newest first."""
    from chatcore.log import formatting

    hits = open_store(ctx, db_url, reading=True).search(text, limit=limit)
    if as_json:
        click.echo(formatting.to_json([hit.to_dict() for hit in hits]))
    elif hits:
        click.echo(formatting.search_lines(hits, text.strip()))
    else:
        click.echo(f"no message contains {text!r}", err=True)


@logs.command("export")
@click.argument("conversation_ids", metavar="[ID]...", nargs=-1)
@click.option(
    "-f",
    "--format",
    "export_format",
    type=click.Choice(["jsonl", "markdown"]),
    default="jsonl",
    show_default=True,
    help="jsonl: one conversation per line, as JSON; markdown: transcripts.",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write to this new file (created readable by you only) instead of standard output.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace the --output file if it exists, following a symbolic link (never the log's own files).",
)
@click.option(
    "--author",
    "author_id",
    default=None,
    metavar="ID",
    help="Only the messages written by this author (a Discord user id).",
)
@click.option(
    "--salvage",
    is_flag=True,
    help="A damaged SQLite file: export every conversation and message that can still be read.",
)
@db_option
@click.pass_context
def export_command(
    ctx: click.Context,
    conversation_ids: tuple[str, ...],
    export_format: str,
    output: str | None,
    author_id: str | None,
    salvage: bool,
    force: bool,
    db_url: str | None,
) -> None:
    """Export the given conversations (all of them when no ID is given).

    --output never writes onto the log, its -wal/-shm or its journal, and never
    replaces an existing file or follows a symbolic link without --force.
    """
    from chatcore.log import formatting
    from chatcore.log.export_target import open_export
    from chatcore.log.journal import default_journal_folder

    if salvage and (conversation_ids or author_id):
        raise click.UsageError("--salvage exports everything readable; it takes no ID or --author")
    problems: list[str] = []
    log_path: Path | None
    if salvage:
        from chatcore.log.salvage import salvaged_store

        store, log_path = salvaged_store(ctx, db_url or (ctx.find_object(dict) or {}).get("db_url"), problems)
        records = store.iter_conversations()
    else:
        store = open_store(ctx, db_url, reading=True)
        log_path = store.file_path
        records = store.iter_conversations(conversation_ids or None, author_id=author_id)
    render = formatting.conversation_jsonl if export_format == "jsonl" else formatting.conversation_markdown
    separator = "\n" if export_format == "jsonl" else "\n---\n\n"
    stream: TextIO = sys.stdout
    if output:
        stream, notes = open_export(output, force=force, log_path=log_path, journal_folder=default_journal_folder())
        for note in notes:
            click.echo(f"note: {note}", err=True)
    count = 0
    try:
        for record in records:
            stream.write((separator if count and export_format == "markdown" else "") + render(record) + "\n")
            stream.flush()  # what was read is kept even if a later conversation cannot be
            count += 1
        if output:
            stream.close()
    except OSError as error:
        if output is None and error.errno == errno.EPIPE:
            raise  # the reader has gone (`| head`): click ends quietly, as for every other command
        where = output or "standard output"
        raise click.ClickException(
            f"cannot write {where}: {error.strerror or error}; {count} conversation(s) were written before it"
        ) from None
    finally:
        if output and not stream.closed:
            try:
                stream.close()
            except OSError:
                pass  # already reported: the data that could not be written is what close would flush
    for problem in problems:
        click.echo(f"salvage: {formatting.one_line(problem, 200)}", err=True)
    if output or salvage:
        click.echo(f"exported {count} conversation(s)" + (f" to {output}" if output else ""), err=True)


@logs.command("check")
@click.option("--repair", is_flag=True, help="Rebuild damaged indexes and the search index from the rows.")
@db_option
@click.pass_context
def check_command(ctx: click.Context, repair: bool, db_url: str | None) -> None:
    """Check an SQLite log for damage: every page, every index against its table, the search index.

    Damaged indexes and search index are rebuilt with --repair (a chat opening the log
    does it too). Damaged rows are never written into: `logs export --salvage` recovers them.
    """
    from chatcore.log.check import check_report

    store = open_store(ctx, db_url)  # a file too damaged to open: its error names the salvage command
    code = check_report(store, repair, click.echo)
    if code:
        ctx.exit(code)


@logs.command("delete")
@click.argument("conversation_id", metavar="[ID]", required=False)
@click.option(
    "--author",
    "author_id",
    default=None,
    metavar="ID",
    help="Delete every message written by this author (a deletion request) instead, with those still "
    "waiting in the journal.",
)
@click.option(
    "--history-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="The REPL's input history to take the conversation's typed messages out of "
    "(default: repl_history in the user data folder, as `chatcore chat` keeps it).",
)
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@db_option
@click.pass_context
def delete_command(
    ctx: click.Context,
    conversation_id: str | None,
    author_id: str | None,
    history_file: Path | None,
    yes: bool,
    db_url: str | None,
) -> None:
    """Delete one conversation and all its messages, or every message of one author.

    Their writes still waiting in the journal (the database was locked or down) are
    withheld too, so that no later replay brings them back, and those the log refused
    (set aside beside the journal) are removed, in every folder that holds its journal.
    The messages of a conversation the REPL logged are taken out of its input history too.
    """
    from chatcore.log import formatting
    from chatcore.log.input_history import typed_messages

    if (conversation_id is None) == (author_id is None):
        raise click.UsageError("give a conversation ID or --author ID (one of them)")
    store = open_store(ctx, db_url)
    if author_id is not None:
        if not yes:
            click.confirm(f"delete every message by author {formatting.field_text(author_id)}?", abort=True)
        deleted = store.delete_author(author_id)
        click.echo(
            f"deleted {deleted - store.superseded_deleted} message(s) by author {formatting.field_text(author_id)}"
            + _superseded(store.superseded_deleted)
            + _withheld(store)
        )
        return
    assert conversation_id is not None  # one of the two was given (checked above)
    record = store.get_conversation(conversation_id)
    typed = typed_messages(store, record)
    if not yes:
        title = formatting.one_line(record.title or "", 60)
        hidden = len(record.messages) - record.message_count
        click.confirm(
            f"delete conversation {formatting.field_text(record.id)} ({title!r}, {record.message_count} messages"
            + _superseded(hidden)
            + ")?",
            abort=True,
        )
    deleted = store.delete_conversation(record.id)
    click.echo(
        f"deleted conversation {formatting.field_text(record.id)} and its "
        f"{deleted - store.superseded_deleted} message(s)" + _superseded(store.superseded_deleted) + _withheld(store)
    )
    _scrub_history(typed, history_file)


def _superseded(count: int) -> str:
    """The replies superseded by a retry among what is deleted: ``logs list`` does not count them."""
    if not count:
        return ""
    return f", and {count} {'reply' if count == 1 else 'replies'} superseded by a retry"


def _scrub_history(typed: set[str], history_file: Path | None) -> None:
    """Take the deleted conversation's typed messages out of the REPL's input history, and say so;
    a file that cannot be rewritten is a one-line error saying what it still holds."""
    from chatcore.log.input_history import scrub_history
    from chatcore.log.location import history_path

    if not typed:
        return
    path = history_file if history_file is not None else history_path()
    try:
        removed = scrub_history(path, typed)
    except OSError as error:
        raise click.ClickException(
            f"deleted from the log, but the input history {path} still holds what was typed "
            f"(it cannot be rewritten: {error.strerror or error}); delete the file, or those lines in it"
        ) from None
    if removed:
        click.echo(
            f"took {removed} typed message(s) out of the input history {path} "
            "(a chat running now still offers them with Up until it ends)"
        )


def _withheld(store: "ConversationStore") -> str:
    """The writes of what was deleted that wait in the journal, which no replay now writes, and
    those set aside as refused beside it, which are gone too."""
    said = ""
    if store.journal_withheld:
        said += f", and {store.journal_withheld} waiting in the journal, which will not be written"
    if store.rejected_removed:
        said += f", and {store.rejected_removed} set aside as refused"
    return said


@logs.command("where")
@db_option
@click.pass_context
def where_command(ctx: click.Context, db_url: str | None) -> None:
    """Print the URL of the log that the other subcommands use (nothing is opened).

    Files that hold chats (the log, its -wal and -shm, the journal, the input history)
    and that other users may read are reported on standard error, each with the
    command that makes it private.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    from chatcore.log.connection import MEMORY_REFUSED, is_memory, sqlite_file
    from chatcore.log.errors import folder_refused
    from chatcore.log.location import resolve_url

    url = resolve_url(db_url or (ctx.find_object(dict) or {}).get("db_url"))
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise click.ClickException(f"{url!r} is not a database URL") from None
    if is_memory(parsed):
        raise click.ClickException(MEMORY_REFUSED)
    log_path = sqlite_file(parsed)
    if log_path is not None and log_path.is_dir():  # as opening it says
        raise click.ClickException(folder_refused(log_path))
    click.echo(parsed.render_as_string(hide_password=True))
    for line in loose_files(log_path):
        click.echo(f"warning: {line}", err=True)


def loose_files(log_path: "Path | None") -> list[str]:
    """The chat files and folders other users may read, each with the command that fixes it."""
    from chatcore.log.export_target import log_files
    from chatcore.log.journal import JOURNAL_FOLDER
    from chatcore.log.location import HISTORY_FILENAME, user_data_path
    from chatcore.log.private_files import loose_modes

    data = user_data_path()
    journal = data / JOURNAL_FOLDER
    paths = [*log_files(log_path), data, data / HISTORY_FILENAME, journal]
    if journal.is_dir():
        paths.extend(sorted(journal.iterdir()))
    return loose_modes(paths)
