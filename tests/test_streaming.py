"""Incremental detokenization and streamed responses."""

from __future__ import annotations

import pytest

from chatcore.engine import ReplyOptions
from chatcore.response import Response
from chatcore.streaming import REPLACEMENT, IncrementalDetokenizer
from chatcore.text import encode_text

TEXTS = [
    "hello there, how are you?",
    "café naïve résumé Ærø Straße",
    "I love pizza 🍕🍕 and 😀!",
    "日本語のテキストです。中文也可以。",
    "한국어 문장 and Ελληνικά and русский",
    "family: 👨‍👩‍👧‍👦 flag: 🇫🇷 skin: 👍🏽",
    "mixed: é😀日 é😀日 ñ",
    "   leading and trailing spaces   ",
    "tabs\tand\nnewlines are text too",
    "<|endoftext|> is just text here",
    "\ufffd is a valid character too",
]


def full_decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def stream(tokenizer, ids):
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.push(token) for token in ids]
    deltas.append(detokenizer.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decoding(tokenizer, text):
    ids = encode_text(tokenizer, text)
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == full_decode(tokenizer, ids) == tokenizer.decode(ids)
    assert "".join(deltas) == text


@pytest.mark.parametrize("text", [t for t in TEXTS if REPLACEMENT not in t])
def test_no_delta_contains_a_broken_character(tokenizer, text):
    ids = encode_text(tokenizer, text)
    for delta in stream(tokenizer, ids):
        assert REPLACEMENT not in delta


def test_the_texts_really_split_characters_across_tokens(tokenizer):
    """Guard for the test above: the tiny vocabulary splits multi-byte characters."""
    split = 0
    for text in TEXTS:
        ids = encode_text(tokenizer, text)
        split += sum(full_decode(tokenizer, ids[:i]).endswith(REPLACEMENT) for i in range(1, len(ids)))
    assert split > 10


def test_a_split_character_is_held_back_until_complete(tokenizer):
    ids = encode_text(tokenizer, "😀")
    assert len(ids) > 1  # four bytes, not a merge in a 400-token vocabulary
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.push(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detokenizer.push(ids[-1]) == "😀"
    assert detokenizer.flush() == ""


def test_flush_returns_a_truly_invalid_tail(tokenizer):
    ids = encode_text(tokenizer, "ok 😀")
    detokenizer = IncrementalDetokenizer(tokenizer)
    emitted = "".join(detokenizer.push(t) for t in ids[:-1])
    assert emitted == "ok "
    assert detokenizer.flush().endswith(REPLACEMENT)


def test_every_delta_is_emitted_as_soon_as_it_is_certain(tokenizer):
    ids = encode_text(tokenizer, "plain ascii words only")
    detokenizer = IncrementalDetokenizer(tokenizer)
    for index, token in enumerate(ids):
        detokenizer.push(token)
        assert detokenizer.read_offset == index + 1  # ASCII never needs holding back


@pytest.mark.parametrize("text", TEXTS[1:7])
def test_response_deltas_join_to_its_text(tokenizer, text):
    ids = encode_text(tokenizer, text)
    response = Response(lambda: iter(ids), tokenizer, {})
    deltas = list(response)
    assert response.done and not response.interrupted
    assert all(deltas)
    assert "".join(deltas) == response.text() == text
    assert response.token_ids == ids
    assert list(response) == deltas  # iterating again replays the same deltas
    assert response.provenance["timings"]["new_tokens"] == len(ids)


def test_engine_reply_deltas_join_to_its_text(engine, tokenizer):
    for seed in range(4):
        response = engine.conversation().send(
            "café 😀 日本",
            ReplyOptions(
                decoder="top-k",
                seed=seed,
                min_new_tokens=20,
                max_new_tokens=20,
                decoder_settings={"top_k": 400, "temperature": 1.5},
            ),
        )
        deltas = list(response)
        assert "".join(deltas) == response.text()
        assert response.text() == full_decode(tokenizer, response.token_ids)
        assert len(response.token_ids) == 20


def test_on_done_callbacks_run_once_in_order(tokenizer):
    ids = encode_text(tokenizer, "hi there")
    calls = []
    response = Response(lambda: iter(ids), tokenizer, {})
    response.on_done(lambda r: calls.append(("first", r.text())))
    response.on_done(lambda r: calls.append(("second", r.done)))
    response.text()
    response.text()
    assert calls == [("first", "hi there"), ("second", True)]
    response.on_done(lambda r: calls.append(("late", r.done)))  # already done: runs at once
    assert calls[-1] == ("late", True)


def test_nothing_is_generated_until_iterated(tokenizer):
    started = []

    def source():
        started.append(True)
        yield from encode_text(tokenizer, "lazy")

    response = Response(source, tokenizer, {})
    assert started == [] and not response.done
    assert response.text() == "lazy"
    assert started == [True]
