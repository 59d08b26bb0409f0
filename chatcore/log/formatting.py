"""Text views of logged conversations: tables, transcripts, Markdown and JSON lines.

Everything shown on a terminal goes through :func:`display_safe` (or :func:`one_line`),
message text and every other field alike (titles, adapter, model, decoder and steerer
names, channel keys, system prompts): any of them may hold escape sequences that
would otherwise drive the terminal, or bidi controls that would reorder what it shows.
JSON output escapes the same characters (``\\u009b``), and a transcript never lets a
message's own lines pose as lines of the transcript: each line of a message after its
first is marked (``logs show``) or kept on the message's line (Markdown).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from chatcore.text import BIDI_CONTROLS, display_safe, one_line

__all__ = ["BIDI_CONTROLS", "display_safe", "one_line"]  # shared with the REPL and the "why"

if TYPE_CHECKING:
    from chatcore.log.records import (
        ConversationRecord,
        ConversationSummary,
        MessageRecord,
        SearchHit,
    )

SHORT_ID = 12
ROLE_LABELS = {"user": "you", "bot": "bot"}
CONTINUATION = "\n        | "  # a message's later lines: never the time a transcript line starts with
SEARCH_CONTEXT = 100  # characters of a search hit shown around the match
# C1 controls, bidi controls, lone surrogates and the line separators: printed raw by
# ``json.dumps(ensure_ascii=False)``, escaped here (JSON's structure is ASCII, so each
# of them can only stand inside a string, where ``\\uXXXX`` means the same character).
_JSON_UNSAFE = re.compile("[\x80-\x9f\ud800-\udfff\u2028\u2029" + "".join(sorted(BIDI_CONTROLS)) + "]")
_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]])")


def field_text(value: object) -> str:
    """A short field (a name, an id) on one line, safe to print; ``-`` when empty."""
    return one_line(str(value)) if value not in (None, "") else "-"


def local_time(moment: datetime, seconds: bool = False) -> str:
    return moment.astimezone().strftime("%Y-%m-%d %H:%M:%S" if seconds else "%Y-%m-%d %H:%M")


def summary_table(summaries: Sequence["ConversationSummary"]) -> str:
    rows = [("ID", "LAST ACTIVE", "ADAPTER", "TURNS", "TITLE")]  # turns: superseded replies not counted
    for summary in summaries:
        rows.append(
            (
                field_text(summary.id[:SHORT_ID]),
                local_time(summary.updated),
                field_text(summary.adapter),
                str(summary.message_count),
                one_line(summary.title or "", 60),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths)) + "  " + row[4] for row in rows
    )


def message_notes(message: "MessageRecord") -> str:
    notes: list[str] = []
    if message.role == "bot":
        decoder = (message.decoder or {}).get("name")
        steerers = [field_text(s.get("name", "?")) for s in message.steerers or [] if isinstance(s, dict)]
        if decoder:
            notes.append(" + ".join([field_text(decoder), *steerers]))
        if message.token_count is not None:
            notes.append(f"{message.token_count} token{'' if message.token_count == 1 else 's'}")
        if message.latency_s is not None:
            notes.append(f"{message.latency_s:.2f} s")
        if message.seed is not None:
            notes.append(f"seed {message.seed}")
    if message.interrupted:
        notes.append("interrupted")
    if message.superseded:
        notes.append("superseded by a retry")
    return f"  [{', '.join(notes)}]" if notes else ""


def conversation_header(record: "ConversationSummary") -> list[str]:
    lines = [f"conversation {field_text(record.id)}"]
    if record.title:
        lines.append(f"title:    {one_line(record.title)}")
    system = getattr(record, "system", None)
    if system:
        lines.append(f"system:   {one_line(system, 200)}")
    lines.append(f"started:  {local_time(record.created, seconds=True)}")
    details = [f"adapter {field_text(record.adapter)}", f"model {field_text(record.model)}"]
    if record.channel_key:
        details.append(f"channel {one_line(record.channel_key)}")
    lines.append("          " + ", ".join(details))
    return lines


def conversation_text(record: "ConversationRecord") -> str:
    lines = conversation_header(record) + [""]
    for message in record.messages:
        label = ROLE_LABELS.get(message.role) or field_text(message.role)
        stamp = message.created.astimezone().strftime("%H:%M:%S")
        text = display_safe(message.text).replace("\n", CONTINUATION)
        lines.append(f"{stamp} {label}> {text}{message_notes(message)}")
    return "\n".join(lines)


def markdown_text(text: str) -> str:
    """``text`` as inline Markdown on one line: '<' would start an HTML tag in most renderers
    (and hide text such as <|endoftext|>); emphasis and code marks are shown, not applied; a
    newline is a ``<br>``, so no line of a message can pose as the next turn."""
    escaped = _MARKDOWN_SPECIAL.sub(r"\\\1", display_safe(text).replace("&", "&amp;").replace("<", "&lt;"))
    return escaped.replace("\n", "<br>")


def conversation_markdown(record: "ConversationRecord") -> str:
    title = markdown_text(one_line(record.title or "")) or f"Conversation {record.id[:SHORT_ID]}"
    lines = [f"# {title}", ""]
    lines.append(f"- id: `{field_text(record.id)}`")
    lines.append(f"- started: {record.created.isoformat()}")
    lines.append(
        f"- adapter: {markdown_text(field_text(record.adapter))}; model: {markdown_text(field_text(record.model))}"
    )
    if record.system:
        lines.append(f"- system prompt: {markdown_text(one_line(record.system))}")
    if record.channel_key:
        lines.append(f"- channel: {one_line(record.channel_key)}")
    lines.append("")
    for message in record.messages:
        label = "**you**" if message.role == "user" else "**bot**"
        notes = message_notes(message).strip()
        suffix = f" _{notes}_" if notes else ""
        text = markdown_text(message.text)
        if message.superseded:
            text = f"~~{text}~~"
        lines.append(f"{label} ({message.created.astimezone().strftime('%H:%M:%S')}): {text}{suffix}")
        lines.append("")
    return "\n".join(lines)


def json_safe_text(encoded: str) -> str:
    """JSON text with the characters that act on a terminal (C1, bidi) as ``\\uXXXX`` escapes."""
    return _JSON_UNSAFE.sub(lambda match: f"\\u{ord(match.group()):04x}", encoded)


def conversation_jsonl(record: "ConversationRecord") -> str:
    return json_safe_text(json.dumps(record.to_dict(), ensure_ascii=False))


def around_match(text: str, wanted: str | None, width: int = SEARCH_CONTEXT) -> str:
    """At most about ``width`` characters of ``text`` around its first match of ``wanted``
    (ignoring case), cut before anything else is done to it: a 10 MB message costs no more
    to show than a short one."""
    start = 0
    if wanted:
        lowered = text.lower()
        if len(lowered) == len(text):  # the usual case: lower() kept every index
            at = lowered.find(wanted.lower())
        else:
            found = re.search(re.escape(wanted), text, re.IGNORECASE)
            at = -1 if found is None else found.start()
        if at + len(wanted) > width:
            start = max(0, at - width // 3)
    # Twice the width: whitespace runs collapse and escapes grow, then one_line cuts to width.
    piece = text[start : start + 2 * width]
    return ("…" if start else "") + piece


def search_lines(hits: Sequence["SearchHit"], wanted: str | None = None) -> str:
    lines = []
    for hit in hits:
        message = hit.message
        label = ROLE_LABELS.get(message.role) or field_text(message.role)
        lines.append(
            f"{field_text(hit.conversation_id[:SHORT_ID])}  {local_time(message.created)}  {label}> "
            f"{one_line(around_match(message.text, wanted), SEARCH_CONTEXT)}"
        )
    return "\n".join(lines)


def to_json(value: Any) -> str:
    return json_safe_text(json.dumps(value, indent=2, ensure_ascii=False))
