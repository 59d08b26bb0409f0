"""The Starlette application: routes, authentication, body limits and the error boundary.

    GET  /v1/models             the one model served
    GET  /v1/plugins            the decoders and steerers a request may name, with the
                                JSON schema of their settings
    POST /v1/chat/completions   a reply (JSON, or server-sent events with ``"stream": true``)

Every error is an OpenAI error object with a 4xx/5xx status, never a traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from chatcore.adapters.http_api.completions import Completion, served_model_name, to_messages, to_options
from chatcore.adapters.http_api.errors import ApiError, error_body
from chatcore.adapters.http_api.schema import ChatCompletionRequest
from chatcore.errors import ChatcoreError

if TYPE_CHECKING:
    from chatcore.adapters.http_api.request_log import RequestLog
    from chatcore.registry import Registry
    from chatcore.serving import Scheduler

DEFAULT_MAX_BODY = 1_000_000  # bytes


@dataclass
class ServeConfig:
    """api_key: required as ``Authorization: Bearer KEY`` when set. system: the system prompt of
    requests that bring none. max_body: the largest request body accepted, in bytes. log: the
    conversation log answered requests go to (see :mod:`.request_log`)."""

    api_key: str | None = None
    system: str | None = None
    max_body: int = DEFAULT_MAX_BODY
    log: "RequestLog | None" = None  # where answered requests are logged; None: nowhere


def build_app(scheduler: "Scheduler", config: ServeConfig | None = None) -> Starlette:
    """The API over ``scheduler`` (which owns the engine)."""
    config = config or ServeConfig()
    model = served_model_name(scheduler.engine)

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        # Constant-time comparison: the time taken tells nothing about the key.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise ApiError(
                401, "Incorrect or missing API key: send `Authorization: Bearer KEY`", None, "invalid_api_key"
            )

    async def models(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": [model_card(model)]})

    async def model_detail(request: Request) -> Response:
        authorize(request)
        if request.path_params["model"] != model:
            raise unknown_model(request.path_params["model"], model)
        return JSONResponse(model_card(model))

    async def plugins(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": plugin_cards(scheduler.engine.registry)})

    async def chat_completions(request: Request) -> Response:
        authorize(request)
        body = await read_json(request, config.max_body)
        try:
            parsed = ChatCompletionRequest.model_validate(body)
        except ValidationError as error:
            raise validation_error(error) from None
        if parsed.model != model:
            raise unknown_model(parsed.model, model)
        messages = to_messages(parsed, config.system)
        options = to_options(parsed, scheduler.engine.registry)
        completion = Completion.submit(scheduler, messages, options, parsed.stop_strings(), model)
        # From here until the reply is sent, a client that goes away cancels it (queued or running).
        watcher = asyncio.create_task(cancel_on_disconnect(request, completion))
        try:
            await completion.started()
            if parsed.stream:
                watcher.cancel()  # the streaming response watches the connection itself
                usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
                return StreamingResponse(
                    events(completion, usage, lambda: log(messages, completion)),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                )
            try:
                text = "".join([delta async for delta in completion.deltas()])
            finally:
                log(messages, completion)
        except BaseException:
            completion.handle.cancel()
            raise
        finally:
            watcher.cancel()
        return JSONResponse(completion.body(text))

    def log(messages: list[Any], completion: Completion) -> None:
        if config.log is not None:
            config.log.record(completion.exchange(messages))

    async def api_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, ApiError)
        headers = {"Retry-After": "1"} if error.status == 429 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    async def http_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        message = "not found" if error.status_code == 404 else str(error.detail)
        return JSONResponse(
            error_body(error.status_code, f"{request.method} {request.url.path}: {message}"),
            status_code=error.status_code,
        )

    async def chatcore_error(request: Request, error: Exception) -> Response:
        return JSONResponse(error_body(400, str(error)), status_code=400)

    async def server_error(request: Request, error: Exception) -> Response:
        return JSONResponse(error_body(500, f"internal error: {type(error).__name__}"), status_code=500)

    return Starlette(
        routes=[
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model_detail, methods=["GET"]),
            Route("/v1/plugins", plugins, methods=["GET"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        ],
        exception_handlers={
            ApiError: api_error,
            HTTPException: http_error,
            ChatcoreError: chatcore_error,
            Exception: server_error,
        },
    )


def model_card(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "chatcore"}


def plugin_cards(registry: "Registry") -> list[dict[str, Any]]:
    """One card per decoder and steerer (see :meth:`chatcore.registry.Entry.card`)."""
    tables = (("decoder", registry.decoders), ("steerer", registry.steerers))
    return [entry.card(kind) for kind, table in tables for _, entry in sorted(table.items())]


def unknown_model(asked: str, model: str) -> ApiError:
    return ApiError(
        404, f"The model {asked!r} does not exist; this server serves {model!r}", "model", "model_not_found"
    )


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON: at most ``limit`` bytes, UTF-8, an object."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {int(declared):,} bytes; the limit is {limit:,}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is over the limit of {limit:,} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ApiError(400, f"the request body is not UTF-8 text (bad byte at position {error.start})") from None
    except json.JSONDecodeError as error:
        raise ApiError(
            400, f"the request body is not valid JSON: {error.msg} (line {error.lineno}, column {error.colno})"
        ) from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def validation_error(error: ValidationError) -> ApiError:
    """The first problem pydantic found, named by its field."""
    first = error.errors()[0]
    # Named as OpenAI names them: messages.[0].role
    param = ".".join(f"[{part}]" if isinstance(part, int) else str(part) for part in first["loc"])
    if first["type"] == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {param}", param)
    if first["type"] == "missing":
        return ApiError(400, f"Missing required parameter: {param!r}", param)
    return ApiError(400, f"Invalid value for {param!r}: {first['msg']}", param)


async def events(completion: Completion, usage: bool, ended: Callable[[], None] | None = None) -> AsyncIterator[str]:
    """Server-sent events as OpenAI sends them: a role chunk, content chunks, a finish chunk,
    the usage chunk when asked for, then ``[DONE]``. A failure mid-reply is an error event.
    ``ended()`` runs once the reply has ended, however it ended."""
    yield sse(completion.chunk({"role": "assistant", "content": ""}, usage=usage))
    failure: ApiError | None = None
    try:
        async for delta in completion.deltas():
            yield sse(completion.chunk({"content": delta}, usage=usage))
    except ApiError as error:
        failure = error
    finally:
        if ended is not None:  # before the last event: a client that has it finds the reply logged
            ended()
    if failure is not None:
        yield sse(failure.body())
        return
    yield sse(completion.chunk({}, completion.finish_reason, usage=usage))
    if usage:
        yield sse(completion.usage_chunk())
    yield "data: [DONE]\n\n"


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def cancel_on_disconnect(request: Request, completion: Completion) -> None:
    """Cancel the reply when the client goes away before it is sent."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            completion.cancel()
            return
