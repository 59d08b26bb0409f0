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


def test_flush_drops_a_character_the_last_tokens_began_and_did_not_finish(tokenizer):
    ids = encode_text(tokenizer, "ok 😀")
    detokenizer = IncrementalDetokenizer(tokenizer)
    emitted = "".join(detokenizer.push(t) for t in ids[:-1])
    assert emitted == "ok " and full_decode(tokenizer, ids[:-1]).endswith(REPLACEMENT)
    assert detokenizer.flush() == ""  # the emoji's last byte would have completed it


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
        response = engine.send(
            engine.conversation(),
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


# -- cutting a reply short at its last whole word ----------------------------------------
@pytest.mark.parametrize(
    "written, kept",
    [
        ("Hello there, my frie", "Hello there, my"),
        ("Hi there", "Hi"),  # "there" may go on as "therefore"
        ("Hi there.", "Hi there."),
        ("Hi there \n", "Hi there"),
        ("w", ""),  # the one-letter fragment: nothing whole
        ("Thisisonelongwordwithnospaces", ""),
        ("pi is 3.1", "pi is"),
        ("say “hello” to", "say “hello”"),
        ("don’", ""),  # an apostrophe, not a closing quote
        ("我们今天去公园。明天", "我们今天去公园。明天"),  # written without spaces: each character is whole
        ("日本\ufffd", "日本"),  # the first byte of a character whose other bytes never came
        ("Great 👍 and", "Great 👍"),
        ("Great 👍", "Great"),  # a skin tone may still follow
        ("👍🏽 ok", "👍🏽"),
        ("🇫🇷🇩", "🇫🇷"),  # half a flag is not whole
        ("👨\u200d👩", ""),  # half a family either
    ],
)
def test_whole_words_cuts_back_to_the_last_whole_word(written, kept):
    from chatcore.cutting import whole_words

    assert whole_words(written) == kept


@pytest.mark.parametrize("text", TEXTS)
def test_a_stream_held_to_whole_words_never_shows_what_a_cut_would_not_keep(text):
    from chatcore.cutting import WholeWords, whole_words

    for size in (1, 2, 3):  # deltas of a few characters, as a tokenizer gives them
        words, shown = WholeWords(), ""
        for start in range(0, len(text), size):
            shown += words.push(text[start : start + size])
            assert whole_words(text[: start + size]).startswith(shown)
        assert shown + words.flush() == text


def test_an_interrupted_response_keeps_its_whole_words(tokenizer):
    ids = encode_text(tokenizer, "Hello there, my frie")
    recorded = []
    response = Response(lambda: iter(ids), tokenizer, {}, finalize=recorded.append, cut_short=lambda: True)
    assert response.text() == "Hello there, my" and response.interrupted
    assert response.provenance["interrupted"] and recorded == [response]
    whole = Response(lambda: iter(ids), tokenizer, {})
    assert whole.text() == "Hello there, my frie" and not whole.interrupted


# -- a reply that ends in the middle of a character ----------------------------------------
def byte_tokens(tokenizer, raw: bytes) -> list[int]:
    """The byte-level tokens of ``raw``, one byte each (whole UTF-8 or not)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    return [tokenizer.convert_tokens_to_ids(byte_chars[byte]) for byte in raw]


def test_a_response_cut_in_the_middle_of_a_character_ends_on_its_last_whole_one(tokenizer):
    ids = encode_text(tokenizer, "ok 😀")
    assert full_decode(tokenizer, ids[:-1]).endswith(REPLACEMENT)
    response = Response(lambda: iter(ids[:-1]), tokenizer, {})
    deltas = list(response)
    assert "".join(deltas) == response.text() == "ok " and REPLACEMENT not in response.text()
    assert response.token_ids == ids[:-1] and response.provenance["timings"]["new_tokens"] == len(ids) - 1


@pytest.mark.parametrize(
    "raw, text",
    [
        (b"ok \xff", "ok \ufffd"),  # no UTF-8 character starts with 0xFF
        (b"ok \x80", "ok \ufffd"),  # a continuation byte with nothing before it
        (b"ok \xf0\x41", "ok \ufffdA"),
        (b"ok \xed\xa0", "ok \ufffd\ufffd"),  # the start of a surrogate, which UTF-8 never holds
        ("ok \ufffd".encode(), "ok \ufffd"),  # U+FFFD written as a character
        ("a\ufffdb".encode(), "a\ufffdb"),
        ("ok \ufffd".encode() + "😀".encode()[:2], "ok \ufffd"),  # the character stays; the half emoji goes
        (b"ok \xff" + "😀".encode()[:3], "ok \ufffd"),
        ("é😀".encode()[:-1], "é"),
        ("€".encode()[:1], ""),
    ],
    ids=[
        "ff",
        "lone-continuation",
        "lead-then-ascii",
        "surrogate-half",
        "u+fffd-at-end",
        "u+fffd-inside",
        "u+fffd-then-half-emoji",
        "ff-then-half-emoji",
        "accent-then-half-emoji",
        "first-byte-only",
    ],
)
def test_only_a_character_a_following_token_would_have_finished_is_dropped(tokenizer, raw, text):
    ids = byte_tokens(tokenizer, raw)
    assert "".join(stream(tokenizer, ids)) == text
    assert Response(lambda: iter(ids), tokenizer, {}).text() == text


def test_a_sentencepiece_byte_fallback_tokenizer_drops_each_byte_of_an_unfinished_character():
    """SentencePiece writes one U+FFFD per broken byte (``<0xF0><0x9F>``: two of them), where a
    byte-level tokenizer writes one for the whole sequence."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<0x{byte:02X}>": byte for byte in range(256)}
    vocab["\u2581ok"] = 256
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    emoji = list("😀".encode())
    assert full_decode(tokenizer, [256, *emoji]) == "ok😀"
    assert full_decode(tokenizer, [256, *emoji[:3]]) == "ok" + REPLACEMENT * 3
    assert "".join(stream(tokenizer, [256, *emoji[:3]])) == "ok"
    assert "".join(stream(tokenizer, [256, 0xFF, *emoji[:2]])) == "ok" + REPLACEMENT  # 0xFF stays
    assert "".join(stream(tokenizer, [256, 0xEF, 0xBF, 0xBD])) == "ok" + REPLACEMENT


def test_a_reply_cut_by_its_budget_in_a_character_keeps_its_tokens_and_drops_the_half_character(chat_engine, tokenizer):
    """Through the Python API: the reply's text and the conversation's turn (what the log
    stores) end on the last whole character; its token ids and count are all the tokens."""
    ids = encode_text(tokenizer, "ok 😀")
    conversation = chat_engine.conversation()
    options = ReplyOptions(decoder="fixed-text", decoder_settings={"text": "ok 😀"}, max_new_tokens=len(ids) - 1)
    response = chat_engine.send(conversation, "hi", options)
    deltas = list(response)
    assert response.provenance["finish_reason"] == "length" and response.cut_by_budget
    assert "".join(deltas) == response.text() == "ok " and conversation.turns[-1].text == "ok "
    assert response.token_ids == ids[:-1]
