"""``POST /tokenize`` and ``POST /detokenize``, as llama.cpp's server names them.

    {"content": "hi there", "add_special": false, "with_pieces": false} -> {"tokens": [5, 77]}
    {"tokens": [5, 77]} -> {"content": "hi there"}

``add_special`` adds the tokens the tokenizer puts around a text (a BOS); ``with_pieces``
gives each token as ``{"id", "piece"}``, its piece the token's text (or its bytes, as a list
of integers, when they are not whole UTF-8). Special-token strings in ``content`` become
special tokens, as the tokenizer reads them. Ids outside the vocabulary are a 400, and so is
``content`` with a control character or a lone surrogate, as in the completion endpoints.
"""

from __future__ import annotations

from typing import Any

from chatcore.adapters.http_api.completions import refused_character
from chatcore.adapters.http_api.errors import ApiError
from chatcore.adapters.http_api.logprobs import TokenTexts
from chatcore.adapters.http_api.schema import DetokenizeRequest, TokenizeRequest


def tokenize(tokenizer: Any, texts: TokenTexts, body: Any) -> dict[str, Any]:
    from chatcore.adapters.http_api.app import parse

    request = parse(TokenizeRequest, body)
    problem = refused_character(request.content)
    if problem is not None:
        raise ApiError(400, f"`content` {problem}", "content")
    ids = [int(i) for i in tokenizer(request.content, add_special_tokens=request.add_special)["input_ids"]]
    if not request.with_pieces:
        return {"tokens": ids}
    return {"tokens": [{"id": token_id, "piece": piece(texts, token_id)} for token_id in ids]}


def piece(texts: TokenTexts, token_id: int) -> str | list[int]:
    raw = texts.bytes_of(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def detokenize(tokenizer: Any, body: Any) -> dict[str, Any]:
    from chatcore.adapters.http_api.app import parse

    request = parse(DetokenizeRequest, body)
    size = len(tokenizer)
    bad = next((index for index, token_id in enumerate(request.tokens) if not 0 <= token_id < size), None)
    if bad is not None:
        raise ApiError(
            400, f"tokens[{bad}] is {request.tokens[bad]}: token ids are between 0 and {size - 1}", f"tokens.[{bad}]"
        )
    return {"content": tokenizer.decode(request.tokens, skip_special_tokens=False)}
