"""The prompt of ``POST /v1/completions``: the client's text as it is, no chat template, no turns.

A prompt format (:class:`chatcore.prompting.PromptFormat`) like the others, so that a raw
prompt goes through the same scheduler and runner as a chat: its text is encoded as text
(special-token strings stay characters, as in every format), after the tokenizer's BOS when
the tokenizer adds one; a prompt too long for the context keeps its newest tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from chatcore.adapters.http_api.completions import refused_character
from chatcore.adapters.http_api.errors import ApiError
from chatcore.prompting import Message, PromptFormat

if TYPE_CHECKING:
    from chatcore.adapters.http_api.schema import CompletionRequest


class RawPrompt(PromptFormat):
    name = "raw"
    description = "the prompt's text as it is (POST /v1/completions)"

    def render(self, messages: Sequence[Message]) -> list[int]:
        ids = self.encode_text("".join(message.text for message in messages if message.role != "system"))
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if bos is not None and getattr(self.tokenizer, "add_bos_token", False):
            ids = [int(bos), *ids]
        return ids


def raw_format(engine: Any) -> RawPrompt:
    loaded = engine.loaded
    return RawPrompt(loaded.tokenizer, getattr(loaded.model, "generation_config", None), str(loaded.name))


def prompt_messages(request: "CompletionRequest") -> list[Message]:
    """The request's prompt as the one message the raw format renders; refusals name their field."""
    text = request.prompt_text()
    if not text:
        raise ApiError(400, "`prompt` is empty: give the text to continue", "prompt")
    problem = refused_character(text)
    if problem is not None:
        raise ApiError(400, f"`prompt` {problem}", "prompt")
    if request.suffix:
        raise ApiError(400, "`suffix` (insertion) is not supported: the models here only continue text", "suffix")
    if request.echo and request.logprobs is not None:
        raise ApiError(
            400, "`echo` with `logprobs` is not supported: the prompt's own log-probabilities are not computed", "echo"
        )
    return [Message("user", text)]
