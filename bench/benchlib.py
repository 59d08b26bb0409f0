"""Pieces the benchmark scripts share (``python bench/NAME.py`` puts this folder on the path)."""

from __future__ import annotations

from typing import Any

LINES = (
    "i went hiking with my friends last weekend and it was a lot of fun",
    "that sounds great, where did you go? i love the mountains in the fall",
)


def long_conversation(engine: Any, history_tokens: int, reply_tokens: int) -> Any:
    """A conversation of alternating user and bot turns whose prompt, leaving room for
    ``reply_tokens``, has at least ``history_tokens`` tokens (or all the model's context
    allows)."""
    conversation = engine.conversation()
    engine.add_user(conversation, LINES[0])
    while True:
        before = len(engine.prompt(conversation, reply_tokens).token_ids)
        if before >= history_tokens:
            return conversation
        if len(conversation.turns) % 2:
            conversation.add_bot_text(LINES[1])
        else:
            engine.add_user(conversation, LINES[0])
        if len(engine.prompt(conversation, reply_tokens).token_ids) <= before:
            return conversation  # the model's context is full


def add_model_arguments(parser: Any) -> None:
    """``--model``, ``--device`` and ``--threads``, as every benchmark takes them."""
    parser.add_argument("--model", default="chatcore-tiny")
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")


def load_engine(args: Any, *plugins: str) -> Any:
    """The engine the arguments name, quiet, on ``--threads`` threads, with greedy, top-k and ``plugins`` only."""
    import torch
    import transformers

    from chatcore.engine import Engine
    from chatcore.testing import plugin_host

    transformers.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    return Engine(args.model, device=args.device, host=plugin_host(*plugins))


def operators(step: Any, views: bool = False) -> int:
    """How many tensor operators one call of ``step`` dispatches (views left out unless
    ``views``: on a GPU each non-view one is about one kernel launch, each one a dispatch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if views or not func.is_view:
                Count.count += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    return Count.count
