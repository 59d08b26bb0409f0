"""``chatcore serve``: the click command. Only click is imported here, so ``--help`` is instant."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import click
from click.core import ParameterSource

from chatcore.cli.options import (
    Seconds,
    device_option,
    max_new_tokens_option,
    model_option,
    persona_option,
    prompt_options,
    sampling_options,
    threads_option,
)

if TYPE_CHECKING:
    import socket

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def bind_listener(host: str, port: int) -> "socket.socket":
    """A listening socket on ``host:port``, or one line saying why there cannot be one."""
    import socket

    from chatcore.errors import ChatcoreError

    try:
        family, kind, protocol, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, protocol)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(2048)
    except OSError as error:
        raise ChatcoreError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return listener


def listening_url(host: str, listener: "socket.socket") -> str:
    """The API's base URL on ``listener``: the port it is bound to (port 0 takes a free one)."""
    port = listener.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host  # an IPv6 address, as URLs write it
    return f"http://{shown}:{port}/v1"


def browser_origins(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    """``--cors-origin``'s values as a browser's ``Origin`` header spells them, or ``*``."""
    return tuple(value if value == "*" else browser_origin(value, ctx, param) for value in values)


def browser_origin(value: str, ctx: click.Context | None = None, param: click.Parameter | None = None) -> str:
    """``value`` as ``scheme://host[:port]``, lower case and without its scheme's default port
    (as browsers send it, and as it is compared); anything else would match no request: refused."""
    from urllib.parse import urlsplit

    shape = "give scheme://host[:port], e.g. https://chat.example.com, or *"
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:  # a port that is not a number, or past 65535
        raise click.BadParameter(f"{value!r} is not an origin: {shape}", ctx, param) from None
    if not parts.scheme or not parts.hostname or parts.username is not None or any(c.isspace() for c in value):
        raise click.BadParameter(f"{value!r} is not an origin: {shape}", ctx, param)
    if parts.path or parts.query or parts.fragment or value.endswith(("?", "#")):
        raise click.BadParameter(
            f"{value!r} is not an origin: it ends after the host and port (no path, not even /)", ctx, param
        )
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    default_port = {"http": 80, "https": 443}.get(parts.scheme)
    return f"{parts.scheme}://{host}" + (f":{port}" if port not in (None, default_port) else "")


@click.command("serve")
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on (0.0.0.0 listens on every interface: set --api-key then).",
)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port (0: a free one).")
@model_option
@click.option(
    "--api-key",
    envvar="CHATCORE_API_KEY",
    default=None,
    help="Require `Authorization: Bearer KEY` on every request (or set CHATCORE_API_KEY).",
)
@click.option(
    "--served-model-name",
    "served_model_names",
    multiple=True,
    metavar="NAME",
    help="The model's id in the API; repeatable: aliases a request may name, the first listed first [--model's name].",
)
@click.option(
    "--cors-origin",
    "cors_origins",
    multiple=True,
    metavar="ORIGIN",
    callback=browser_origins,
    help='A browser origin allowed to call the API, e.g. "https://chat.example.com" or "*" (repeatable) [none].',
)
@prompt_options("System prompt of requests that bring none.")
@persona_option
@sampling_options
@max_new_tokens_option(64, per_model=True)
@click.option("--max-batch", type=click.IntRange(1, 256), default=8, show_default=True, help="Replies decoded at once.")
@click.option(
    "--max-waiting",
    type=click.IntRange(0, 10_000),
    default=64,
    show_default=True,
    help="Requests queued beyond those; past it requests get 429 (busy).",
)
@click.option(
    "--max-n",
    type=click.IntRange(1, 64),
    default=8,
    show_default=True,
    help="The most choices (`n`) one request may ask for; each is a reply in the batch, so at most "
    "--max-batch + --max-waiting.",
)
@click.option(
    "--max-queue-wait",
    type=Seconds(0, min_open=True),
    default=None,
    help="Seconds a request may wait for a batch slot; past it, 503 with Retry-After [no limit].",
)
@click.option(
    "--request-timeout",
    type=Seconds(0, min_open=True),
    default=None,
    help="Seconds a reply may take in all; past it, it is cut (504, or an error event when streaming) [no limit].",
)
@click.option(
    "--shutdown-grace",
    type=Seconds(0),
    default=30.0,
    show_default=True,
    help="On SIGTERM or Ctrl-C, seconds running replies get to finish before they are cut (a second signal: at once).",
)
@click.option(
    "--prefix-cache-mb",
    type=click.IntRange(0, 1_000_000),
    default=256,
    show_default=True,
    help="Memory for the key/values of earlier prompts that new ones start with (0: off).",
)
@click.option(
    "--log/--no-log",
    "log",
    default=None,
    help="Keep the conversations served in the conversation log [off; on when --db is given].",
)
@click.option("--db", default=None, help="Conversation log: SQLAlchemy URL or SQLite file [$CHATCORE_DB or user data].")
@click.option(
    "--allow-local-files",
    is_flag=True,
    help="Let requests name files, folders and models on this machine in decoder and steerer settings "
    "(`file=`, `path=`, `block=`, `discriminator=`, `reverse_model=`) [off: only the bundled names].",
)
@click.option(
    "--warm-up/--no-warm-up",
    default=True,
    show_default=True,
    help="On the fast path (CUDA, or CHATCORE_FAST_PATH=on/compile), capture (and compile) its step for "
    "every batch size before listening, so that no request waits for it.",
)
@device_option
@threads_option
@click.option(
    "--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto", show_default=True
)
def serve(
    host: str,
    port: int,
    model: str,
    api_key: str | None,
    served_model_names: tuple[str, ...],
    cors_origins: tuple[str, ...],
    system_text: str | None,
    system_file: str | None,
    prompt_format: str,
    persona: str | None,
    temperature: float | None,
    top_p: float | None,
    max_new_tokens: int | None,
    max_batch: int,
    max_waiting: int,
    max_n: int,
    max_queue_wait: float | None,
    request_timeout: float | None,
    shutdown_grace: float,
    prefix_cache_mb: int,
    log: bool | None,
    db: str | None,
    allow_local_files: bool,
    warm_up: bool,
    device: str | None,
    threads: int | None,
    dtype: str,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API.

    GET /v1/models, POST /v1/chat/completions and POST /v1/completions (raw prompts)
    (streaming or not, `n` choices, `logprobs`), with chatcore's own `decoder` and `steer`
    fields; POST /tokenize and /detokenize; GET /v1/plugins lists the decoders and steerers
    with the JSON schema of their settings; GET /health and GET /metrics (Prometheus) need
    no key. Concurrent requests are decoded together in one batch. With --log (or --db), the
    conversations served are kept in the conversation log (`chatcore logs`). SIGTERM or
    Ctrl-C lets running replies finish for --shutdown-grace seconds, then cuts them and
    exits 0. --temperature, --top-p and --max-tokens are the defaults of requests that
    bring none. See docs/serving.md.
    """
    from chatcore.adapters.http_api.app import ServeConfig, build_app
    from chatcore.adapters.http_api.server import make_server
    from chatcore.cli import plugin_problems_note
    from chatcore.cli.options import reply_budget, with_sampling_shortcuts
    from chatcore.cli.specs import parse_spec
    from chatcore.cpu import use_threads
    from chatcore.engine import DEFAULT_DECODER, Engine, ReplyOptions, validate_options
    from chatcore.errors import OptionError
    from chatcore.personas import system_prompt_with_persona
    from chatcore.prompting import validate_format_name
    from chatcore.registry import registry_of
    from chatcore.serving import Scheduler

    if api_key is not None and not api_key.strip():
        raise OptionError("`--api-key` is empty")
    if api_key is None and os.environ.get("CHATCORE_API_KEY") is not None:  # click reads an empty one as unset
        raise OptionError("CHATCORE_API_KEY is set but empty: give the key, or unset it to serve without one")
    validate_format_name(prompt_format, registry_of())
    if any(not name.strip() for name in served_model_names):
        raise OptionError("`--served-model-name` is empty")
    system = system_prompt_with_persona(system_text, system_file, persona)
    if temperature == 0:
        # The flags are the defaults of the sampling decoder a request gets; greedy is a request's own choice.
        raise OptionError(
            "`--temperature 0` would be greedy decoding, which the server does per request: a request sends "
            '`temperature: 0` (or `decoder: "greedy"`); the server\'s default must sample (above 0)'
        )
    sampling = {name: value for name, value in (("temperature", temperature), ("top_p", top_p)) if value is not None}
    # A value the default decoder would refuse fails now, not at the first request.
    decoder_name, decoder_settings = parse_spec(with_sampling_shortcuts(DEFAULT_DECODER, **sampling))
    validate_options(ReplyOptions(decoder=decoder_name, decoder_settings=decoder_settings))
    if log is False and db is not None:
        raise OptionError("give --db or --no-log, not both")
    held = max_batch + max_waiting
    if max_n > held and click.get_current_context().get_parameter_source("max_n") != ParameterSource.DEFAULT:
        # A request with that many choices would get 429 for ever. Under the default --max-n, such a
        # request gets a 400 naming the limit instead (see build_app).
        raise OptionError(
            f"`--max-n {max_n}` is more replies than the server holds at once: --max-batch {max_batch} "
            f"+ --max-waiting {max_waiting} = {held}; give --max-n {held} or less, or raise those"
        )
    listener = bind_listener(host, port)  # a port in use fails now, not after the model has loaded
    if api_key is None and host not in LOOPBACK:
        click.echo(
            f"chatcore: warning: listening on {host} without --api-key: anyone who can reach this "
            "address can use the model",
            err=True,
        )
    request_log = None
    if log or db is not None:  # a log that cannot be opened fails now too
        from chatcore.adapters.http_api.request_log import RequestLog

        request_log = RequestLog(db)
    try:
        use_threads(threads)
        engine = Engine(model, device=device, dtype=dtype, prompt_format=prompt_format)
        note = plugin_problems_note(engine.host)
        if note is not None:  # the operator's to know: clients only see names missing
            click.echo(f"chatcore: {note}", err=True)
        # The server's sampling: what a request brings, else these flags, else the model's own.
        engine.sampling_defaults.update(sampling)
        if request_log is not None:
            request_log.engine = engine
            click.echo(f"chatcore: logging conversations to {request_log.display_url}", err=True)
        with Scheduler(
            engine, max_batch=max_batch, max_waiting=max_waiting, prefix_cache_bytes=prefix_cache_mb * 2**20
        ) as scheduler:
            if warm_up:
                from chatcore.serving.warm_up import warm_up as warm_the_fast_path_up

                warm_the_fast_path_up(scheduler, say=lambda line: click.echo(f"chatcore: {line}", err=True))
            config = ServeConfig(
                api_key=api_key,
                system=system,
                log=request_log,
                max_queue_wait=max_queue_wait,
                request_timeout=request_timeout,
                served_model_names=served_model_names,
                cors_origins=cors_origins,
                max_n=max_n,
                max_new_tokens=reply_budget(max_new_tokens, model, 64),
                allow_local_files=allow_local_files,
            )
            app = build_app(scheduler, config)
            click.echo(f"chatcore: serving {model} on {listening_url(host, listener)} (Ctrl-C stops)", err=True)
            try:
                make_server(app, shutdown_grace).run(sockets=[listener])
            finally:
                if app.state.hooks is not None:
                    if request_log is not None:
                        request_log.flush()  # it fires the hooks of what it writes
                    app.state.hooks.close()  # the plugins see every reply that went out
            click.echo("chatcore: stopped", err=True)
    finally:
        if request_log is not None:
            request_log.close()
