"""The Starlette application: routes, authentication, body limits and the error boundary.

    GET  /health                status, model, queue depth (no key needed; 503 while shutting down)
    GET  /metrics               Prometheus metrics (no key needed; see :mod:`.metrics`)
    GET  /v1/models             the one model served
    GET  /v1/plugins            the decoders and steerers a request may name, with the
                                JSON schema of their settings
    POST /v1/chat/completions   a reply (JSON, or server-sent events with ``"stream": true``)
    POST /v1/completions        a raw prompt continued, without the chat template (legacy shape)
    POST /tokenize              text -> token ids; POST /detokenize: token ids -> text (llama.cpp's names)

Every error is an OpenAI error object with a 4xx/5xx status, never a traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from chatcore.adapters.http_api.choices import Choices, Kind
from chatcore.adapters.http_api.completions import (
    DEFAULT_MAX_N,
    served_model_name,
    to_messages,
    to_options,
)
from chatcore.adapters.http_api.errors import ApiError, error_body
from chatcore.adapters.http_api.exchange_hooks import ExchangeHooks, hooks_implemented
from chatcore.adapters.http_api.logprobs import TokenTexts
from chatcore.adapters.http_api.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from chatcore.adapters.http_api.metrics import CountingRequests, ServeMetrics
from chatcore.adapters.http_api.raw_prompt import prompt_messages, raw_format
from chatcore.adapters.http_api.schema import ChatCompletionRequest, CompletionRequest, Sampling
from chatcore.adapters.http_api.shutdown import LiveReplies
from chatcore.adapters.http_api.tokens import detokenize, tokenize
from chatcore.errors import ChatcoreError

if TYPE_CHECKING:
    from pydantic import BaseModel

    from chatcore.adapters.http_api.request_log import RequestLog
    from chatcore.engine import ReplyOptions
    from chatcore.prompting import Message, PromptFormat
    from chatcore.registry import Registry
    from chatcore.serving import Scheduler

DEFAULT_MAX_BODY = 1_000_000  # bytes
ParsedBody = TypeVar("ParsedBody", bound="BaseModel")
RETRY_AFTER_S = 1  # what 429 and 503 answers tell a client to wait before trying again
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before its answer


@dataclass
class ServeConfig:
    """api_key: required as ``Authorization: Bearer KEY`` when set. system: the system prompt of
    requests that bring none. max_body: the largest request body accepted, in bytes. log: the
    conversation log answered requests go to (see :mod:`.request_log`). max_queue_wait: seconds a
    request may wait for a batch slot before it gets 503 (None: no limit). request_timeout:
    seconds a reply may take in all before it is cut with 504 or an error event (None: no limit).
    served_model_names: the model's ids in the API, the first listed first. cors_origins: see below.
    max_n: the most choices (``n``) one request may ask for. allow_local_files: whether a request's
    decoder and steerer settings may name files and models on this machine (see
    :class:`chatcore.options.OnThisMachine`); off, only their bundled names."""

    api_key: str | None = None
    system: str | None = None
    max_body: int = DEFAULT_MAX_BODY
    log: "RequestLog | None" = None  # where answered requests are logged; None: nowhere
    max_queue_wait: float | None = None
    request_timeout: float | None = None
    served_model_names: tuple[str, ...] = ()  # the ids a request may name; empty: the model's own name
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API; empty: none (no CORS headers)
    max_n: int = DEFAULT_MAX_N
    max_new_tokens: int | None = None  # the budget of requests that give no max_tokens (None: 64)
    allow_local_files: bool = False


def build_app(scheduler: "Scheduler", config: ServeConfig | None = None) -> Starlette:
    """The API over ``scheduler`` (which owns the engine)."""
    config = config or ServeConfig()
    names = config.served_model_names or (served_model_name(scheduler.engine),)
    model = names[0]
    metrics = ServeMetrics(scheduler)
    live = LiveReplies()
    hooks = ExchangeHooks(scheduler.engine) if hooks_implemented(scheduler.engine) else None
    if config.log is not None:
        config.log.hooks = hooks

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
        return JSONResponse({"object": "list", "data": [model_card(name) for name in names]})

    async def model_detail(request: Request) -> Response:
        authorize(request)
        if request.path_params["model"] not in names:
            raise unknown_model(request.path_params["model"], names)
        return JSONResponse(model_card(request.path_params["model"]))

    async def plugins(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": plugin_cards(scheduler.engine.registry)})

    async def health(request: Request) -> Response:
        body = {
            "status": "shutting down" if live.draining else "ok",
            "model": model,
            "model_loaded": True,  # the server listens only once the model has loaded
            "queue_depth": len(scheduler.waiting),
            "setting_up": scheduler.setting_up(),
            "in_flight": scheduler.in_flight(),
            "max_batch": scheduler.max_batch,
        }
        return JSONResponse(body, status_code=503 if live.draining else 200)

    async def prometheus(request: Request) -> Response:
        return Response(metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    engine = scheduler.engine
    texts = TokenTexts(engine.tokenizer)
    raw = raw_format(engine)

    def accepting(request: Request) -> None:
        authorize(request)
        if live.draining:
            raise ApiError(503, "the server is shutting down; send the request to another one", None, "server_shutdown")

    async def chat_completions(request: Request) -> Response:
        accepting(request)
        parsed = parse(ChatCompletionRequest, await read_json(request, config.max_body))
        if parsed.model not in names:
            raise unknown_model(parsed.model, names)
        messages = to_messages(parsed, config.system)
        return await answer(request, parsed, messages, options_of(parsed), "chat")

    def options_of(parsed: Sampling) -> "ReplyOptions":
        """The request's reply options, under this server's limits."""
        # Each choice is a reply the scheduler holds: more than it can ever hold would be 429 for ever.
        held = scheduler.max_batch + scheduler.max_waiting
        if held < min(parsed.n, config.max_n):
            replies = "reply" if scheduler.max_batch == 1 else "replies"
            raise ApiError(
                400,
                f"`n` must be at most {held} on this server, which holds {scheduler.max_batch} {replies} decoding "
                f"and {scheduler.max_waiting} waiting (--max-batch, --max-waiting), got {parsed.n}",
                "n",
            )
        return to_options(
            parsed,
            engine.registry,
            len(engine.tokenizer),
            config.max_n,
            config.max_new_tokens,
            machine_names=config.allow_local_files,
        )

    async def completions(request: Request) -> Response:
        accepting(request)
        parsed = parse(CompletionRequest, await read_json(request, config.max_body))
        if parsed.model not in names:
            raise unknown_model(parsed.model, names)
        messages = prompt_messages(parsed)
        echo = messages[0].text if parsed.echo else ""
        return await answer(request, parsed, messages, options_of(parsed), "text", raw, echo)

    async def answer(
        request: Request,
        parsed: Sampling,
        messages: list["Message"],
        options: "ReplyOptions",
        kind: Kind,
        prompt_format: "PromptFormat | None" = None,
        echo: str = "",
    ) -> Response:
        """Submit the request's choices and send them: JSON, or server-sent events."""
        try:
            group = Choices.submit(
                scheduler, messages, options, parsed.stop_strings(), parsed.model, parsed.n, kind, texts,
                prompt_format, echo,
            )  # fmt: skip
        except ApiError:
            metrics.record_busy()
            raise
        for completion in group.completions:
            completion.interrupt_after("queue-wait", config.max_queue_wait)
            completion.interrupt_after("timeout", config.request_timeout)
            live.add(completion)
        # From here until the reply is sent, a client that goes away cancels it (queued or running).
        watcher = asyncio.create_task(cancel_on_disconnect(request, group))
        streaming = False
        try:
            await group.started()
            if parsed.stream:
                watcher.cancel()  # the streaming response watches the connection itself
                usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
                streaming = True
                return ReplyStream(
                    events(group, usage, lambda: ended(messages, group, parsed.user)),
                    lambda: ended(messages, group, parsed.user),
                )
            body = await group.body()
            for completion in group.completions:
                if completion.client_gone:  # the client left before the body: it never got the text
                    completion.shown = False
            if any(completion.client_gone for completion in group.completions):
                # Nobody reads it; /metrics counts it as what it was, not as a 200 sent.
                return Response(status_code=CLIENT_CLOSED_REQUEST)
        except BaseException:
            group.cancel_handles()
            if not streaming:  # the client gets an error, not the text written so far
                for completion in group.completions:
                    completion.shown = False
            raise
        finally:
            watcher.cancel()
            if not streaming:
                ended(messages, group, parsed.user)
        return JSONResponse(body)

    def ended(messages: list[Any], group: Choices, user: str | None) -> None:
        """Once per choice, however it ended: log it, count it, forget it."""
        for completion in group.completions:
            if completion.recorded:
                continue
            completion.recorded = True
            completion.handle.cancel()  # no-op for a reply that ended; frees the slot of one that did not
            completion.stop_timers()
            live.discard(completion)
            metrics.record_reply(completion)
            exchange = completion.exchange(messages, user)
            # The log keeps what the client got: a reply cut before any of it reached the
            # client (refused, failed, waited too long, cut before its first word, or a JSON
            # body whose client had gone) leaves the conversation as it was, so that the
            # client's retry of the same messages is not logged after an empty reply.
            if exchange.reply or not exchange.interrupted:
                if config.log is not None:
                    config.log.record(exchange)  # and then fires the hooks, with the id it wrote
                elif hooks is not None:
                    hooks.fire(exchange)  # on_user_message, on_response

    async def tokenize_route(request: Request) -> Response:
        authorize(request)
        return JSONResponse(tokenize(engine.tokenizer, texts, await read_json(request, config.max_body)))

    async def detokenize_route(request: Request) -> Response:
        authorize(request)
        return JSONResponse(detokenize(engine.tokenizer, await read_json(request, config.max_body)))

    async def api_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, ApiError)
        headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status in (429, 503) else None
        if error.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        if error.status == 429:  # the operator sees the server turn work away (a timeout says so where it cuts)
            logging.getLogger("chatcore.serve").warning("429 %s %s: %s", request.method, request.url.path, error)
        if not error.retry:  # clients that retry server errors (the openai SDK) read it
            headers = {**(headers or {}), "x-should-retry": "false"}
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    async def http_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        message = "not found" if error.status_code == 404 else str(error.detail)
        return JSONResponse(
            error_body(error.status_code, f"{request.method} {request.url.path}: {message}"),
            status_code=error.status_code,
            headers=error.headers,  # a 405's Allow: the methods the route takes
        )

    async def chatcore_error(request: Request, error: Exception) -> Response:
        return JSONResponse(error_body(400, str(error)), status_code=400)

    async def server_error(request: Request, error: Exception) -> Response:
        return JSONResponse(error_body(500, f"internal error: {type(error).__name__}"), status_code=500)

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/metrics", prometheus, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model_detail, methods=["GET"]),
            Route("/v1/plugins", plugins, methods=["GET"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/tokenize", tokenize_route, methods=["POST"]),
            Route("/detokenize", detokenize_route, methods=["POST"]),
        ],
        middleware=middleware(config, metrics),
        exception_handlers={
            ApiError: api_error,
            HTTPException: http_error,
            ChatcoreError: chatcore_error,
            Exception: server_error,
        },
    )
    app.state.live = live  # the server's shutdown cuts these (see .server.GracefulServer)
    app.state.metrics = metrics
    app.state.hooks = hooks  # closed by the server's command once it has stopped
    return app


def middleware(config: ServeConfig, metrics: ServeMetrics) -> list[Middleware]:
    """Counting every response; CORS only for the origins the operator allowed (off by default:
    a browser page from elsewhere then cannot read the API's answers)."""
    stack = [Middleware(CountingRequests, metrics=metrics)]
    if config.cors_origins:
        stack.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(config.cors_origins),
                allow_methods=["GET", "POST"],
                # Any header the page asks for: client libraries add their own on every request (the
                # openai npm package sends X-Stainless-OS, -Lang, -Arch, -Runtime, -Retry-Count, ...),
                # and a fixed list refuses their preflight. The origins stay the operator's.
                allow_headers=["*"],
                max_age=600,
            )
        )
    return stack


def model_card(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "chatcore"}


def plugin_cards(registry: "Registry") -> list[dict[str, Any]]:
    """One card per decoder and steerer (see :meth:`chatcore.registry.Entry.card`)."""
    tables = (("decoder", registry.decoders), ("steerer", registry.steerers))
    return [entry.card(kind) for kind, table in tables for _, entry in sorted(table.items())]


def unknown_model(asked: str, names: tuple[str, ...]) -> ApiError:
    served = " or ".join(repr(name) for name in names)
    return ApiError(404, f"The model {asked!r} does not exist; this server serves {served}", "model", "model_not_found")


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON: at most ``limit`` bytes, UTF-8, an object."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {int(declared):,} bytes; the limit is {limit:,}")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is over the limit of {limit:,} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # nobody to answer: no traceback in the server's log either
        raise ApiError(400, "the client closed the connection before the request body ended") from None
    raw = b"".join(chunks)
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ApiError(400, f"the request body is not UTF-8 text (bad byte at position {error.start})") from None
    except json.JSONDecodeError as error:
        raise ApiError(
            400, f"the request body is not valid JSON: {error.msg} (line {error.lineno}, column {error.colno})"
        ) from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON here: its arrays or objects nest too deeply") from None
    except ValueError:  # Python's limit on the digits of an integer it converts (CVE-2020-10735)
        raise ApiError(
            400, f"the request body holds an integer of more than {sys.get_int_max_str_digits():,} digits"
        ) from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def parse(schema: "type[ParsedBody]", body: Any) -> "ParsedBody":
    """``body`` as ``schema``; its first problem as a 400 naming the field."""
    try:
        return schema.model_validate(body)
    except ValidationError as error:
        raise validation_error(error) from None


def validation_error(error: ValidationError) -> ApiError:
    """The first problem pydantic found, named by its field."""
    first = error.errors()[0]
    # Named as OpenAI names them: messages.[0].role
    param = ".".join(f"[{part}]" if isinstance(part, int) else str(part) for part in first["loc"])
    if first["type"] == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {param}", param)
    if first["type"] == "missing":
        return ApiError(400, f"Missing required parameter: {param!r}", param)
    if not param:  # a rule over several fields
        return ApiError(400, str(first["msg"]).removeprefix("Value error, "))
    return ApiError(400, f"Invalid value for {param!r}: {first['msg']}", param)


async def events(group: Choices, usage: bool, ended: Callable[[], None] | None = None) -> AsyncIterator[str]:
    """Server-sent events as OpenAI sends them: a role chunk per choice (chat), content chunks
    (each naming its choice's index), a finish chunk per choice, the usage chunk when asked
    for, then ``[DONE]``. A failure mid-reply (or a timeout, or the shutdown cutting it) is an
    error event, then ``[DONE]``. ``ended()`` runs once the replies have ended, however they ended."""
    failure: ApiError | None = None
    offsets = {completion.index: len(group.echo) for completion in group.completions}
    try:
        for chunk in group.opening_chunks(usage):
            yield sse(chunk)
        async for index, piece in group.pieces():
            yield sse(group.piece_chunk(index, piece, usage, offsets[index]))
            offsets[index] += len(piece.text)
    except ApiError as error:
        failure = error
    finally:
        if ended is not None:  # before the last event: a client that has it finds the reply logged
            ended()
    if failure is not None:
        yield sse(failure.body())
        yield "data: [DONE]\n\n"
        return
    for chunk in group.finish_chunks(usage):
        yield sse(chunk)
    if usage:
        yield sse(group.usage_chunk())
    yield "data: [DONE]\n\n"


class ReplyStream(StreamingResponse):
    """Server-sent events whose reply ends with the response, however it ends: a client that
    goes away before the first event is sent never starts the events' generator, so its
    ``finally`` cannot free the reply's slot; ``ended`` here does."""

    def __init__(self, content: AsyncIterator[str], ended: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.ended = ended

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.ended()


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def cancel_on_disconnect(request: Request, group: Choices) -> None:
    """Cancel the replies when the client goes away before they are sent."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            group.cancel()
            return
