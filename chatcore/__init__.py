"""chatcore: a plugin-based chatbot framework.

Heavy modules (torch, transformers) are imported only by the functions that need them,
so ``import chatcore`` and ``chatcore --help`` stay fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from chatcore.errors import ChatcoreError
from chatcore.hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = ["ChatcoreError", "Engine", "hookimpl", "__version__"]

if TYPE_CHECKING:
    from chatcore.engine import Engine


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from chatcore.engine import Engine

        return Engine
    raise AttributeError(f"module 'chatcore' has no attribute {name!r}")
