"""The ``top-k`` decoder: sampling with temperature, top-k and top-p (nucleus) filtering."""

from __future__ import annotations

from collections.abc import Callable

import chatcore
from chatcore.api import TopKDecoder, TopKSettings

__all__ = ["TopKDecoder", "TopKSettings"]


@chatcore.hookimpl(trylast=True)
def register_decoders(register: Callable[[type], None]) -> None:
    register(TopKDecoder)
