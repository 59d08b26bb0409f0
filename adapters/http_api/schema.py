"""The request bodies as pydantic models: types, ranges and unknown fields checked in one place.

``POST /v1/chat/completions``, ``POST /v1/completions`` (raw prompts) and the
``/tokenize`` / ``/detokenize`` pair. OpenAI's fields that chatcore supports, plus its own
``decoder`` (a decoder spec, as ``--decoder`` takes) and ``steer`` (steerer specs, as
``--steer`` takes). A field chatcore does not support is refused by name rather than
silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from chatcore.serving.logprobs import MAX_TOP_LOGPROBS

MAX_MESSAGES = 512
MAX_STOPS = 4
MAX_STOP_CHARS = 200
MAX_TOKENS_LIMIT = 4096
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class OtherPart(BaseModel):
    """A content part that is not text (``image_url``, ``input_audio``, ``file`` ...): parsed so
    that the refusal can name it (see ``completions.to_messages``)."""

    model_config = ConfigDict(extra="allow")
    type: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    # An assistant turn may be empty (or null): a reply cut by a stop string at its start.
    content: str | list[TextPart | OtherPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def other_parts(self) -> list[str]:
        """The types of the parts that are not text."""
        if not isinstance(self.content, list):
            return []
        return [part.type for part in self.content if not isinstance(part, TextPart)]


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    """What both completion endpoints take: the model, the budget, sampling, stops, ``n`` and chatcore's fields."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    user: str | None = None
    # chatcore's own fields: the same spec strings as the command line's --decoder and --steer.
    decoder: str | None = Field(default=None, description='A decoder spec, e.g. "top-k top_k=20".')
    min_tokens: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOKENS_LIMIT,
        description="The fewest tokens the reply has: its stop tokens are banned until then (as vLLM's).",
    )
    steer: list[str] = Field(
        default_factory=list,
        max_length=8,
        description='Steerer specs, e.g. ["bow-bias topic=food strength=4"]; one spec may be given as a string.',
    )

    @field_validator("steer", mode="before")
    @classmethod
    def _one_spec(cls, steer: Any) -> Any:
        return [steer] if isinstance(steer, str) else steer

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def budget(self) -> int | None:
        """The reply's token budget as asked (None: the server's default)."""
        return self.max_tokens

    def top_logprobs_asked(self) -> int | None:
        """How many alternatives each token's log-probability comes with (None: no log-probabilities)."""
        return None


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # OpenAI's own keeping of the exchange (its dashboard, distillation): accepted and checked as
    # OpenAI checks them, not acted on; what this server keeps is its conversation log's business.
    store: bool | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=MAX_METADATA_PAIRS)

    @field_validator("metadata")
    @classmethod
    def _short_metadata(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        for key, value in (metadata or {}).items():
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise ValueError(
                    f"`metadata` keys take at most {MAX_METADATA_KEY} characters and values "
                    f"{MAX_METADATA_VALUE}; {key[:MAX_METADATA_KEY]!r} is longer"
                )
        return metadata

    @model_validator(mode="after")
    def _one_budget(self) -> Self:
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise ValueError(
                f"`max_tokens` ({self.max_tokens}) and `max_completion_tokens` ({self.max_completion_tokens}) "
                "disagree: give one (`max_tokens` is the older name)"
            )
        return self

    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(Sampling):
    """``POST /v1/completions``: a raw prompt, continued without the chat template."""

    prompt: str | list[str]
    # OpenAI's default budget for this endpoint.
    max_tokens: int | None = Field(default=16, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            from chatcore.adapters.http_api.errors import ApiError

            raise ApiError(
                400, f"`prompt` takes one string (or a list of one), got a list of {len(self.prompt)}", "prompt"
            )
        return self.prompt[0]


class TokenizeRequest(Strict):
    """``POST /tokenize``, as llama.cpp's server names it."""

    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(Strict):
    """``POST /detokenize``, as llama.cpp's server names it."""

    tokens: list[int] = Field(max_length=100_000)
