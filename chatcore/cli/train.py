"""The ``chatcore train`` command group, shared by the plugins that add training commands.

The built-in ``train_commands`` plugin adds ``tokenizer``, ``filter`` and ``model``;
``cocon`` adds ``cocon`` and ``pplm`` adds ``discriminator``. Each calls
:func:`train_group` from its ``register_commands`` hook, which puts the group on the CLI
the first time, so no plugin depends on another having registered first.
"""

from __future__ import annotations

import click


@click.group()
def train() -> None:
    """Train a tokenizer or a dialogue model (forward, or reverse for MMI).

    Corpora: "chitchat" (built in) or a JSONL file of dialogues
    ({"id": "...", "turns": ["hi", "hello, how are you?", ...]}), of thread-tree
    messages ({"id", "parent_id", "text", "community"}) or of chat-log messages
    ({"channel", "author", "text", "time"}). The held-out split is by thread and the
    same for every command; the training split is filtered DialoGPT-style unless
    --no-filter is given.
    """


def train_group(cli: click.Group) -> click.Group:
    """The ``train`` group, added to ``cli`` if it is not there yet."""
    if "train" not in cli.commands:
        cli.add_command(train)
    return train
