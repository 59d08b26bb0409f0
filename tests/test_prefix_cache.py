"""The prefix cache's radix tree on small tensors whose keys spell their token ids."""

from __future__ import annotations

import pytest
import torch

from chatcore.serving.prefix_cache import PrefixCache, common_length

TOKEN_BYTES = 2 * 2 * 4 * 4  # keys and values, 2 heads x 4 dims of float32, one layer


def layers_of(tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One layer's (1, 2, T, 4) keys and values, each column filled with its token id."""
    column = torch.tensor(tokens, dtype=torch.float32)[None, None, :, None]
    keys = column.expand(1, 2, len(tokens), 4).clone()
    return [(keys, -keys)]


def spelled(layers) -> list[int]:
    keys, values = layers[0]
    assert torch.equal(values, -keys)
    return [int(x) for x in keys[0, 0, :, 0]]


def test_requests_that_share_a_history_reuse_it_whichever_came_first():
    system = list(range(100, 120))
    history = system + list(range(200, 260))  # a long shared history
    cache = PrefixCache(budget_bytes=2**20, min_tokens=4)
    first = [*history, 1, 2, 3]
    cache.store(first, layers_of(first))
    second = [*history, 7, 8, 9]  # the same history, another last message
    length, layers = cache.lookup(second)
    assert length == len(history) and spelled(layers) == history
    cache.store(second, layers_of(second))
    # The shared run is held once: the tree split where the two part.
    assert cache.tokens == len(history) + 3 + 3 and len(cache) == 3
    assert cache.used == cache.tokens * TOKEN_BYTES
    # A third conversation with the same system prompt only: its run is found too.
    third = [*system, 5, 5, 5]
    length, layers = cache.lookup(third)
    assert length == len(system) and spelled(layers) == system
    # Whole stored sequences, across the split, keep their own tokens.
    for stored in (first, second):
        length, layers = cache.lookup([*stored, 0])
        assert length == len(stored) and spelled(layers) == stored
    assert cache.hits == 4


def test_a_lookup_leaves_the_last_token_to_run_and_ignores_short_runs():
    cache = PrefixCache(budget_bytes=2**20, min_tokens=4)
    tokens = list(range(10))
    cache.store(tokens, layers_of(tokens))
    assert cache.lookup(tokens)[0] == 9
    assert cache.lookup([0, 1, 2, 99]) == (0, None)  # under min_tokens
    assert cache.peek([0, 1, 2, 3, 4, 99]) == 5 and cache.hits == 1
    cache.store([0, 1, 2], layers_of([0, 1, 2]))  # too short to keep
    cache.store(tokens[:6], layers_of(tokens[:6]))  # held already, inside a longer run
    assert len(cache) == 1 and cache.tokens == 10


def test_least_recently_used_leaves_go_first_and_shared_runs_outlive_them():
    stem = list(range(10))
    branches = [[*stem, *range(100 * b, 100 * b + 10)] for b in (1, 2, 3)]
    cache = PrefixCache(budget_bytes=(10 + 3 * 10) * TOKEN_BYTES, min_tokens=2)
    for branch in branches:
        cache.store(branch, layers_of(branch))
    assert cache.tokens == 40 and cache.used == cache.budget
    cache.lookup([*branches[0], 0])  # the first branch is used again: the second is now the oldest
    fourth = [*stem, *range(400, 410)]
    cache.store(fourth, layers_of(fourth))
    assert cache.used <= cache.budget and cache.evicted_tokens == 10
    assert cache.lookup([*branches[1], 0])[0] == len(stem)  # its own tokens went, the stem stayed
    for kept in (branches[0], branches[2], fourth):
        length, layers = cache.lookup([*kept, 0])
        assert length == 20 and spelled(layers) == kept
    # A run bigger than the whole budget is not kept; one that only fits alone evicts the rest.
    big = list(range(1000, 1100))
    cache.store(big, layers_of(big))
    assert cache.lookup([*big, 0]) == (0, None)
    whole = list(range(2000, 2040))
    cache.store(whole, layers_of(whole))
    assert cache.lookup([*whole, 0])[0] == 40 and cache.tokens == 40 and len(cache) == 1


def test_prefix_cache_settings_and_clear():
    with pytest.raises(ValueError, match="budget_bytes"):
        PrefixCache(budget_bytes=-1)
    with pytest.raises(ValueError, match="min_tokens"):
        PrefixCache(budget_bytes=10, min_tokens=0)
    cache = PrefixCache(budget_bytes=0)
    cache.store(list(range(20)), layers_of(list(range(20))))
    assert len(cache) == 0
    cache = PrefixCache(budget_bytes=2**20, min_tokens=2)
    cache.store(list(range(20)), layers_of(list(range(20))))
    cache.clear()
    assert len(cache) == 0 and cache.used == 0 and cache.lookup(list(range(21))) == (0, None)
    assert common_length([1, 2, 3], (1, 2, 4)) == 2 and common_length([1, 2], [1, 2, 3]) == 2


def test_what_a_lookup_gives_is_one_layout_and_kind_whatever_was_stored():
    """A model's first pass leaves its keys as a transposed view of the projection (GPT-2's
    and Llama's (1, T, H, D) seen as (1, H, T, D)), and a long prompt's chunks are inference
    tensors; the compiled prompt pass guards on its inputs' strides and kind, so every lookup
    gives contiguous inference tensors, for a whole node, part of one and a path across a split."""
    tokens = list(range(40))
    keys, values = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in layers_of(tokens)[0])
    transposed = [(keys, values)]
    assert not transposed[0][0].is_contiguous()
    cache = PrefixCache(budget_bytes=2**20, min_tokens=4)
    cache.store(tokens, transposed)
    other = [*tokens[:20], 99, 98, 97]
    cache.store(other, transposed)  # splits the node at 20
    for prompt, reused in (([*tokens, 1], 40), (tokens[:30], 29), ([*tokens[:10], 5], 10), ([*other, 1], 23)):
        length, layers = cache.lookup(prompt)
        assert length == reused and layers is not None
        assert all(t.is_contiguous() and t.is_inference() for layer in layers for t in layer)
    assert spelled(cache.lookup(tokens[:30])[1]) == tokens[:29]


def test_a_lookup_can_leave_more_than_the_last_token():
    """Where the prompt pass is compiled the runner leaves two tokens to run (one would be a
    graph of its own)."""
    cache = PrefixCache(budget_bytes=2**20, min_tokens=4)
    tokens = list(range(10))
    cache.store(tokens, layers_of(tokens))
    assert cache.lookup(tokens, leave=2)[0] == 8 and cache.lookup(tokens, leave=0)[0] == 9
    assert spelled(cache.lookup([*tokens, 5], leave=2)[1]) == tokens[:9]
