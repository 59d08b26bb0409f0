"""A request's ``n`` choices, and OpenAI's shapes for them: chunks, the final body, usage.

Each choice is a reply of its own (:class:`.completions.Completion`) submitted to the
scheduler, so the ``n`` choices are rows of the shared batch like any other replies (the
first one's prompt is kept in the prefix cache, so the others do not read it again). Choice
``i`` is seeded with ``seed + i`` when the request gives a seed. Two shapes: ``chat``
(``POST /v1/chat/completions``) and ``text`` (``POST /v1/completions``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from chatcore.adapters.http_api.completions import Completion, Piece, provenance_summary
from chatcore.adapters.http_api.errors import ApiError
from chatcore.adapters.http_api.logprobs import TokenTexts

if TYPE_CHECKING:
    from chatcore.engine import ReplyOptions
    from chatcore.prompting import Message, PromptFormat
    from chatcore.serving import Scheduler

Kind = Literal["chat", "text"]


@dataclass(eq=False)
class Choices:
    """The replies of one request, read together."""

    completions: list[Completion]
    kind: Kind
    model: str
    texts: TokenTexts
    logprobs: bool  # whether the request asked for log-probabilities
    echo: str = ""  # the prompt, sent before a text completion's own text (``echo``)
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        for completion in self.completions:
            completion.id = self.id if len(self.completions) == 1 else f"{self.id}/{completion.index}"

    @classmethod
    def submit(
        cls,
        scheduler: "Scheduler",
        messages: list["Message"],
        options: "ReplyOptions",
        stops: list[str],
        model: str,
        n: int,
        kind: Kind,
        texts: TokenTexts,
        prompt_format: "PromptFormat | None" = None,
        echo: str = "",
    ) -> "Choices":
        """Submit ``n`` replies; a 429 when the scheduler cannot take them all (none is kept then)."""
        completions: list[Completion] = []
        try:
            for index in range(n):
                seeded = options if options.seed is None else options.model_copy(update={"seed": options.seed + index})
                completions.append(Completion.submit(scheduler, messages, seeded, stops, model, index, prompt_format))
        except ApiError:
            for completion in completions:
                completion.handle.cancel()
            raise
        return cls(completions, kind, model, texts, options.logprobs is not None, echo)

    def cancel(self) -> None:
        """The client went away."""
        for completion in self.completions:
            completion.cancel()

    def cancel_handles(self) -> None:
        for completion in self.completions:
            completion.handle.cancel()

    async def started(self) -> None:
        """Wait until every choice has its first token (or has ended); the first failure is raised."""
        results = await asyncio.gather(*(c.started() for c in self.completions), return_exceptions=True)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            raise failure

    async def pieces(self) -> AsyncIterator[tuple[int, Piece]]:
        """(choice index, piece) as each choice writes; a choice that fails raises its ApiError
        (and the others are cancelled)."""
        if len(self.completions) == 1:
            async for piece in self.completions[0].deltas():
                yield 0, piece
            return
        queue: asyncio.Queue[tuple[int, Piece | None | BaseException]] = asyncio.Queue()

        async def pump(completion: Completion) -> None:
            try:
                async for piece in completion.deltas():
                    queue.put_nowait((completion.index, piece))
            except Exception as error:
                queue.put_nowait((completion.index, error))
            else:
                queue.put_nowait((completion.index, None))

        tasks = [asyncio.create_task(pump(completion)) for completion in self.completions]
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    running -= 1
                    continue
                yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- OpenAI's shapes ---------------------------------------------------------------------
    def _envelope(self, choices: list[dict[str, Any]], usage: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage:
            body["usage"] = None
        return body

    def opening_chunks(self, usage: bool) -> list[dict[str, Any]]:
        """A chat stream's role chunk per choice; a text stream's echoed prompt per choice."""
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""}
            return [self._envelope([self._chat_choice(c.index, delta, None)], usage) for c in self.completions]
        if self.echo:
            return [self._envelope([self._text_choice(c.index, self.echo, None)], usage) for c in self.completions]
        return []

    def piece_chunk(self, index: int, piece: Piece, usage: bool, offset: int) -> dict[str, Any]:
        """``offset``: where the piece starts in the choice's text (legacy logprobs' ``text_offset``)."""
        logprobs = self._logprobs(piece.tokens, offset)
        if self.kind == "chat":
            return self._envelope([self._chat_choice(index, {"content": piece.text}, logprobs)], usage)
        return self._envelope([self._text_choice(index, piece.text, logprobs)], usage)

    def finish_chunks(self, usage: bool) -> list[dict[str, Any]]:
        chunks = []
        for completion in self.completions:
            if self.kind == "chat":
                choice = self._chat_choice(completion.index, {}, None, completion.finish_reason)
            else:
                choice = self._text_choice(completion.index, "", None, completion.finish_reason)
            chunks.append(self._envelope([choice], usage))
        return chunks

    def usage(self) -> dict[str, int]:
        prompt = self.completions[0].prompt_tokens
        written = sum(c.completion_tokens for c in self.completions)
        return {"prompt_tokens": prompt, "completion_tokens": written, "total_tokens": prompt + written}

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._envelope([], False), "usage": self.usage()}

    async def body(self) -> dict[str, Any]:
        """The whole reply of every choice (``stream`` false)."""
        texts: dict[int, list[str]] = {c.index: [] for c in self.completions}
        tokens: dict[int, list[Any]] = {c.index: [] for c in self.completions}
        async for index, piece in self.pieces():
            texts[index].append(piece.text)
            tokens[index].extend(piece.tokens)
        choices = []
        for completion in self.completions:
            text = "".join(texts[completion.index])
            logprobs = self._logprobs(tokens[completion.index], len(self.echo))
            if self.kind == "chat":
                message = {"role": "assistant", "content": text, "refusal": None}
                choices.append(
                    {
                        "index": completion.index,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": completion.finish_reason,
                    }
                )
            else:
                choices.append(
                    self._text_choice(completion.index, self.echo + text, logprobs, completion.finish_reason)
                )
        return {
            "id": self.id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
            "chatcore": provenance_summary(self.completions[0].handle.provenance),
        }

    def _logprobs(self, tokens: list[Any], offset: int) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return self.texts.chat(tokens) if self.kind == "chat" else self.texts.legacy(tokens, offset)

    @staticmethod
    def _chat_choice(
        index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None, finish_reason: str | None = None
    ) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    @staticmethod
    def _text_choice(
        index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None = None
    ) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
