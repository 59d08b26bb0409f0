"""The reply metrics of ``chatcore eval`` on texts whose answers are known."""

from __future__ import annotations

import pytest

from chatcore.evaluation.metrics import (
    contains_any,
    content_keywords,
    distinct_n,
    is_degenerate,
    is_variant,
    mentions,
)


def test_distinct_n_counts_unique_ngrams_over_all_replies() -> None:
    assert distinct_n(["a b a b"], 1) == pytest.approx(2 / 4)
    assert distinct_n(["a b a b"], 2) == pytest.approx(2 / 3)
    assert distinct_n(["a b", "a b"], 2) == pytest.approx(1 / 2)
    assert distinct_n([""], 2) == 0.0


def test_degenerate_replies() -> None:
    assert is_degenerate("")
    assert is_degenerate("...")
    assert is_degenerate("no no no")
    assert is_degenerate("i like it i like it i like it")
    assert not is_degenerate("i like pizza, what about you?")


def test_contains_any_words_and_phrases() -> None:
    assert contains_any("I had PIZZA today", {"pizza"})
    assert not contains_any("pizzeria", {"pizza"})
    assert contains_any("it is ice cream time", {"ice cream"})
    assert not contains_any("ice and cream", {"ice cream"})


@pytest.mark.parametrize(
    ("word", "keyword", "expected"),
    [
        ("music", "music", True),
        ("musical", "music", True),
        ("musicians", "music", True),
        ("pizzas", "pizza", True),
        ("horribly", "horrible", True),
        ("perfectly", "perfect", True),
        ("happiness", "happy", True),
        ("dogs", "dog", True),
        ("catch", "cat", False),
        ("category", "cat", False),
        ("dogma", "dog", False),
        ("imperfect", "perfect", False),
    ],
)
def test_close_variants(word: str, keyword: str, expected: bool) -> None:
    assert is_variant(word, keyword) is expected


def test_mentions_needs_every_keyword_of_the_content() -> None:
    assert content_keywords("is perfect") == ["perfect"]
    assert content_keywords("it is") == ["it", "is"]
    assert mentions("That was perfectly fine.", "is perfect")
    assert not mentions("That was fine.", "is perfect")
    assert mentions("my dog loves music", "dog music")
    assert not mentions("my dog is loud", "dog music")
    assert not mentions("anything", "")
