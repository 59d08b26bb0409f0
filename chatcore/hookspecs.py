"""Every hook chatcore calls, with its contract.

A plugin is a module (or object) with functions marked ``@chatcore.hookimpl`` whose
names and argument names match the specifications below. Plugins are found through
the ``chatcore`` entry-point group; the built-in decoders, steerers and commands are
plugins of exactly the same kind.

Every hook is called once per registered implementation. An implementation that
raises is reported with its plugin's name and skipped; the others still run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import click

    from chatcore.conversation import Conversation
    from chatcore.models import LoadedModel
    from chatcore.response import Response
    from chatcore.values import Turn

hookspec = pluggy.HookspecMarker("chatcore")
hookimpl = pluggy.HookimplMarker("chatcore")


@hookspec
def register_decoders(register: Callable[[type], None]) -> None:
    """Register decoder classes by calling ``register(DecoderClass)``.

    Called once, when the registry is built. ``DecoderClass`` subclasses
    :class:`chatcore.decoding.Decoder`: it has a unique ``name``, a ``Settings``
    model, and the rules the runner calls (``rows``, ``prepare``, ``processors``,
    ``select``, ``enough``, ``choose``: docs/hooks.md). Name clashes (chatcore.registry): a
    built-in name stays the built-in's and the other registration is reported; a name two
    other plugins register is reachable only as ``PLUGIN/NAME``.
    The return value is ignored.
    """


@hookspec
def register_steerers(register: Callable[[type], None]) -> None:
    """Register steerer classes by calling ``register(SteererClass)``.

    Called once, when the registry is built. ``SteererClass`` subclasses
    :class:`chatcore.steering.Steerer`: a unique ``name``, a ``Settings`` model
    (:class:`chatcore.options.Settings`, pydantic),
    ``prepare(session)`` (once per response) and ``wrap(step)`` (returns a new step
    function), and ``shares_batch = True`` for a score steerer (its step only edits the
    logits its inner step returns: its replies share the batch) or the default False
    for a step steerer (run beside the batch). What a step sees (rows, tokens, calls per
    token, probes) is written in docs/hooks.md. Name clashes are resolved as for
    :func:`register_decoders`.
    The return value is ignored.
    """


@hookspec
def register_prompt_formats(register: Callable[[type], None]) -> None:
    """Register prompt formats by calling ``register(FormatClass)``.

    Called once, when the registry is built. ``FormatClass`` subclasses
    :class:`chatcore.prompting.PromptFormat`: a unique ``name``, a constructor
    ``(tokenizer, generation_config, model_name)`` that raises ``ChatcoreError`` if the
    model cannot use the format, ``render(messages) -> list[int]`` (the prompt's token
    ids for a list of :class:`chatcore.values.Message`, system first if any, ending
    where the reply starts; message text encoded with ``self.encode_text`` so that it is
    never read as special tokens), optionally ``end_of_turn_ids()`` (tokens besides EOS
    that end a reply) and ``supports(tokenizer)`` (whether ``auto`` may pick it).
    Truncation, stop tokens and banned special tokens come from the base class. Name
    clashes are resolved as for :func:`register_decoders`. The return value is ignored.
    """


@hookspec
def register_commands(cli: click.Group) -> None:
    """Add commands or command groups to the ``chatcore`` command line.

    Called once when the CLI is built, before arguments are parsed, so an
    implementation must not import torch or other heavy modules at this point
    (``chatcore --help`` stays instant): import them inside the command's body.
    Use ``cli.add_command(...)`` or the ``@cli.command()`` decorator; a command can go
    inside chatcore's groups too (``cli.commands["train"]``). A name already taken is
    refused and reported as this plugin's problem; an error the command raises is shown
    as one line naming the plugin. The return value is ignored.
    """


@hookspec
def on_user_message(conversation: Conversation, turn: Turn, model: LoadedModel) -> None:
    """A user turn was added to ``conversation`` (``engine.add_user``).

    Called after ``turn`` is appended to ``conversation.turns`` and before any reply
    is generated. ``model`` is the engine's model that will answer (``model.name``;
    ``model.tokenizer`` counts the turn's tokens). Adapters and the conversation log use
    it to persist or audit the message. Must not modify the conversation. An
    implementation may leave out arguments it does not need. The return value is ignored.
    """


@hookspec
def on_response(conversation: Conversation, response: Response) -> None:
    """A reply finished (completely, or interrupted) and was added to ``conversation``
    (``engine.record``, whichever entry point decoded it).

    Called once per reply, after its text and provenance are final
    (``response.text()``, ``response.provenance``, ``response.interrupted``). Use it to
    log the reply. Must not modify the conversation. The return value is ignored.
    """


@hookspec
def warm_up_steerers(model: LoadedModel) -> list[tuple[str, dict[str, Any]]] | None:
    """Steerers to run once before a server takes requests (``chatcore serve``, the Discord
    bot), so that what they compile or capture on the fast path is ready before a user's
    request needs it.

    Return the steerers as ``ReplyOptions.steerers`` takes them, ``(name, settings)``
    pairs, each for a reply of its own, or None. Called only where the server warms its
    fast path up (see ``chatcore.api.fast_path_mode``), after the batch's own passes are
    ready; return None unless there is something to make (the built-in PPLM returns
    itself under ``CHATCORE_FAST_PATH=compile``, where its layers are compiled at their
    first steered reply). Each runs a reply of a few tokens to a made-up message: logged
    nowhere, counted nowhere, shown to no hook. One that fails is reported in one line,
    and the server starts anyway.
    """


@hookspec
def register_prompt_sets(register: Callable[[str, Callable[[], list[Any]]], None]) -> None:
    """Register prompt sets for ``chatcore eval`` by calling ``register(name, loader)``.

    ``loader()`` returns a list of contexts; each context is a list of turns (str),
    oldest first, ending with the turn to reply to. Loaders are called only when the
    set is used, so they may be slow. Name clashes are resolved as for :func:`register_decoders`.
    The return value is ignored.
    """
