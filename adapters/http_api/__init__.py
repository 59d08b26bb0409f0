"""The HTTP adapter: ``chatcore serve`` answers OpenAI-compatible chat completion requests.

Modules, each with one job: ``command`` (the click command, light), ``schema`` (the
request body as pydantic models, unknown fields refused), ``errors`` (OpenAI-shaped
error responses), ``completions`` (one reply as text deltas with their tokens'
log-probabilities), ``choices`` (a request's ``n`` replies in OpenAI's chunks and bodies),
``logprobs`` (tokens' text and bytes in OpenAI's log-probability shapes), ``raw_prompt``
(the prompt format of ``/v1/completions``), ``tokens`` (``/tokenize``, ``/detokenize``),
``app`` (the Starlette routes, authentication, body limits) and ``server``
(uvicorn, in the foreground or on a thread). Every reply is decoded by the serving
scheduler (chatcore.serving); see docs/serving.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import chatcore

if TYPE_CHECKING:
    import click


@chatcore.hookimpl(trylast=True)
def register_commands(cli: "click.Group") -> None:
    from chatcore.adapters.http_api.command import serve

    cli.add_command(serve)
