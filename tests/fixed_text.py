"""A test decoder registered like any plugin: it says a fixed text (its tokens), whatever
the model scores, so that a test chooses a reply's exact characters (mass pings, control
characters, a long line). conftest's ``chat_engine`` has it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import chatcore
from chatcore.decoding import GenerationSession
from chatcore.testing import ScriptedDecoder
from chatcore.text import encode_text

MASS_PING = "hello @everyone and @here and <@&123456789012345678>!"


@dataclass
class FixedTextSettings:
    text: str = MASS_PING
    repeat: int = 1


class FixedTextDecoder(ScriptedDecoder):
    name = "fixed-text"
    description = "says the tokens of a fixed text (tests)"
    Settings = FixedTextSettings

    def script(self, session: GenerationSession) -> list[int]:
        return encode_text(session.model.tokenizer, self.settings.text * self.settings.repeat)


class FixedTextPlugin:
    @chatcore.hookimpl
    def register_decoders(self, register: Any) -> None:
        register(FixedTextDecoder)
