"""What the log writes for a turn: the message's fields, its conversation's row and its key.

Pure functions of a conversation and its turns (no store, no thread), so that every path
that writes a turn (the hooks, a conversation written again, the journal's replay) builds
the same write for it.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatcore.conversation import Conversation, Turn
    from chatcore.models import LoadedModel
    from chatcore.response import Response

TITLE_CHARS = 80
_CONVERSATION_COLUMNS = ("adapter", "channel_key", "title")

Write = dict[str, Any]
"""One message write: ``conversation_id``, ``role``, ``text``, ``key`` (its write key) and
``fields`` (the rest of :meth:`ConversationStore.add_message`'s arguments, the
conversation's row included). Plain data, so that it can be journaled."""


def json_safe(value: Any) -> Any:
    """``value`` as plain JSON types (tuples become lists, unknown objects their str)."""
    return json.loads(json.dumps(value, default=str))


def title_from(text: str) -> str:
    return text if len(text) <= TITLE_CHARS else text[: TITLE_CHARS - 1].rstrip() + "…"


def count_tokens(model: "LoadedModel | None", text: str) -> int | None:
    if model is None:
        return None
    try:
        from chatcore.text import encode_text

        return len(encode_text(model.tokenizer, text))
    except Exception:  # a count is nice to have; never worth losing the message
        return None


def replies_kept(conversation: "Conversation") -> int:
    """Bot turns after the newest user turn, not counting the one just added.

    A regenerated reply (/retry) replaces the previous one in memory; the log keeps the
    old one but marks it superseded, so resuming gives the same turns.
    """
    kept = 0
    for turn in reversed(conversation.turns[:-1]):
        if turn.role != "bot":
            break
        kept += 1
    return kept


def write_key(conversation_id: str, turn: "Turn") -> str:
    """The key of a turn's write: the same for every write of that turn (a hook, a conversation
    written again into a new file, an adapter handing it over twice), so it is stored once."""
    digest = hashlib.sha256(f"{conversation_id}\0{turn.role}\0{turn.created.isoformat()}\0".encode())
    digest.update(turn.text.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:32]


def response_fields(conversation: "Conversation", response: "Response") -> tuple[dict[str, Any], str | None]:
    """A reply's fields from its response (the one just recorded as the conversation's last
    turn), and the model that wrote it."""
    provenance = json_safe(response.provenance)
    timings = provenance.get("timings") or {}
    fields = {
        "token_count": len(response.token_ids),
        "prompt_tokens": provenance.get("prompt_tokens"),
        "latency_s": timings.get("total_s"),
        "first_token_s": timings.get("first_token_s"),
        "decoder": provenance.get("decoder"),
        "steerers": provenance.get("steerers"),
        "candidates": provenance.pop("candidates", None),
        "seed": provenance.get("seed"),
        "provenance": provenance,
        "keep_replies": replies_kept(conversation),
    }
    return fields, provenance.get("model")


def turn_fields(turn: "Turn", model: "LoadedModel | None") -> tuple[dict[str, Any], str | None]:
    """A turn's fields from the turn alone (a conversation written again, from its turns'
    provenance), and the model that wrote it."""
    if turn.role == "user":
        fields: dict[str, Any] = {"token_count": count_tokens(model, turn.text)}
    else:
        provenance = json_safe(turn.meta.get("provenance") or {})
        timings = provenance.get("timings") or {}
        fields = {
            "provenance": provenance,
            "decoder": provenance.get("decoder"),
            "steerers": provenance.get("steerers"),
            "seed": provenance.get("seed"),
            "prompt_tokens": provenance.get("prompt_tokens"),
            "candidates": provenance.pop("candidates", None),
            "token_count": timings.get("new_tokens"),
            "latency_s": timings.get("total_s"),
            "first_token_s": timings.get("first_token_s"),
        }
    model_name = fields.get("provenance", {}).get("model") or (model.name if model is not None else None)
    return fields, model_name


def conversation_fields(conversation: "Conversation", model_name: str | None) -> dict[str, Any]:
    """The conversation's row, as each of its message writes carries it."""
    meta = json_safe(conversation.meta)
    columns = {key: meta.pop(key, None) for key in _CONVERSATION_COLUMNS}
    first_user = next((t for t in conversation.turns if t.role == "user"), None)
    return {
        "created": conversation.turns[0].created if conversation.turns else None,
        "adapter": columns["adapter"],
        "channel_key": columns["channel_key"],
        "model": model_name,
        "title": columns["title"] or (title_from(first_user.text) if first_user else None),
        "system": getattr(conversation, "system", None),
        "prompt_format": conversation.prompt_format,
        "meta": meta,
    }
