"""Dialogues as a model reads them, for the trainers of plugins' parts (a CoCon block, a
PPLM discriminator head): the prompt format a reply is decoded in, outside an engine."""

from __future__ import annotations

from typing import Any

from chatcore.conversation import build_prompt
from chatcore.prompting import AUTO, PromptFormat

__all__ = ["build_prompt", "prompt_format_for"]


def prompt_format_for(name: str, model: Any, tokenizer: Any, model_name: str) -> PromptFormat:
    """The prompt format ``name`` (``auto``: the chat template if the tokenizer has one) for
    the model, from the installed plugins' formats, as an engine would choose it."""
    from chatcore.plugin_manager import get_plugin_host
    from chatcore.prompting import choose_format
    from chatcore.registry import Registry

    cls = choose_format(Registry.build(get_plugin_host()), tokenizer, name or AUTO)
    return cls(tokenizer, getattr(model, "generation_config", None), model_name)
