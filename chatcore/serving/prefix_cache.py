"""Prefix caching: the key/values of earlier prompts (and replies), reused by any prompt that starts with them.

The cache is a radix tree over token ids, as SGLang's radix cache: each node holds a run
of tokens and their key/values, and a path from the root spells a token sequence that
was run before. Requests that share a history reuse it whichever came first: a system
prompt or a persona that many conversations start with, the next turn of a conversation
(the scheduler stores every token a reply fed the model, prompt and reply, when it ends),
or two requests with the same 10-turn history that differ only in the last message
(the first one's prompt is stored as soon as it has run). A shared run is kept once: a
new sequence stores only the tokens after the longest run the tree already holds,
splitting a node where the two part.

A lookup takes the longest run of leading tokens the tree holds, always leaving the
prompt's last token to run, since that gives the first reply token's scores (the runner
leaves two where its prompt pass is compiled: a pass over one token would be a graph of
its own).

Nodes are bounded by a memory budget in bytes; least recently used leaves go first (a
node used by a lookup or a store is touched with every node above it, so a shared
system prompt outlives the conversations that branch from it). Only replies that share
the batch use it: their steerers (``shares_batch``) never touch the prompt's cache or
hidden states. PPLM, CoCon and other steerers that do are decoded on their own, from
the whole prompt.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

Layers = list[tuple["torch.Tensor", "torch.Tensor"]]  # per layer: keys, values, each (1, H, T, D)


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    length = min(len(a), len(b))
    if tuple(a[:length]) == tuple(b[:length]):
        return length
    for index in range(length):
        if a[index] != b[index]:
            return index
    return length


def _bytes(layers: Layers) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)


def _cut(layers: Layers, start: int, end: int | None = None) -> Layers:
    """Own copies of tokens [start, end) of ``layers`` (a slice's view would keep the whole tensor
    alive): contiguous inference tensors, whatever they came as. The compiled prompt pass
    (``CHATCORE_FAST_PATH=compile``) guards on its inputs' strides and kind, and a graph
    compiled again in the middle of serving keeps a request waiting (about 50 s at
    SmolLM2-1.7B's shape on an H200): a prompt's first pass leaves a model's keys as a
    transposed view of its projection (GPT-2's, Llama's), a pass after a prefix leaves them contiguous,
    and a long prompt's chunks and the batch's buffers are inference tensors."""
    import torch

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        return tensor[:, :, start:end].clone(memory_format=torch.contiguous_format)

    with torch.inference_mode():
        return [(copy(k), copy(v)) for k, v in layers]


class _Node:
    """A run of tokens after its parent's, with their key/values; children by their first token."""

    __slots__ = ("tokens", "layers", "size", "children", "parent", "used")

    def __init__(self, tokens: tuple[int, ...], layers: Layers, parent: "_Node | None") -> None:
        self.tokens = tokens
        self.layers = layers
        self.size = _bytes(layers)
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.used = 0  # the cache's clock when a lookup or a store last went through it


class PrefixCache:
    """Key/values of token sequences in a radix tree under a byte budget, least recently used leaves evicted first."""

    def __init__(self, budget_bytes: int, min_tokens: int = 8) -> None:
        if not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"`budget_bytes` must be a non-negative integer, got {budget_bytes!r}")
        if not isinstance(min_tokens, int) or min_tokens < 1:
            raise ValueError(f"`min_tokens` must be a positive integer, got {min_tokens!r}")
        self.budget = budget_bytes
        self.min_tokens = min_tokens  # shorter prefixes are not worth a lookup's bookkeeping
        self.root = _Node((), [], None)
        self.used = 0  # bytes held by every node
        self.nodes = 0
        self.tokens = 0  # tokens held by every node (each shared run once)
        self.hits = 0
        self.reused_tokens = 0
        self.evicted_tokens = 0
        self._clock = itertools.count(1)

    def __len__(self) -> int:
        """The number of nodes (runs of tokens) held."""
        return self.nodes

    def _walk(self, tokens: Sequence[int], limit: int) -> list[tuple[_Node, int]]:
        """The nodes that spell the longest run of ``tokens[:limit]`` the tree holds, each
        with how many of its tokens belong to the run (all but maybe the last node's)."""
        path: list[tuple[_Node, int]] = []
        node, matched = self.root, 0
        while matched < limit:
            child = node.children.get(tokens[matched])
            if child is None:
                break
            shared = common_length(child.tokens, tokens[matched : matched + len(child.tokens)])
            shared = min(shared, limit - matched)
            path.append((child, shared))
            matched += shared
            if shared < len(child.tokens):
                break
            node = child
        return path

    def _touch(self, path: list[tuple[_Node, int]]) -> None:
        now = next(self._clock)
        for node, _ in path:
            node.used = now

    def lookup(self, prompt: Sequence[int], leave: int = 1) -> tuple[int, Layers | None]:
        """The longest cached prefix of ``prompt`` that leaves at least its last ``leave`` tokens
        to run (one at least: its pass gives the first reply token's scores): its length and
        key/values, contiguous inference tensors whatever was stored (see :func:`_cut`)."""
        import torch

        path = self._walk(prompt, len(prompt) - max(1, leave))
        length = sum(shared for _, shared in path)
        if length < self.min_tokens:
            return 0, None
        self._touch(path)
        self.hits += 1
        self.reused_tokens += length
        with torch.inference_mode():
            if len(path) == 1:  # a copy only where part of the node is shared
                node, shared = path[0]
                return length, [(k[:, :, :shared].contiguous(), v[:, :, :shared].contiguous()) for k, v in node.layers]
            layers = [
                (
                    torch.cat([node.layers[index][0][:, :, :shared] for node, shared in path], dim=2),
                    torch.cat([node.layers[index][1][:, :, :shared] for node, shared in path], dim=2),
                )
                for index in range(len(path[0][0].layers))
            ]
        return length, layers

    def peek(self, prompt: Sequence[int]) -> int:
        """How many tokens of ``prompt`` a lookup would reuse now (0 under ``min_tokens``), touching nothing."""
        length = sum(shared for _, shared in self._walk(prompt, len(prompt) - 1))
        return length if length >= self.min_tokens else 0

    def store(self, tokens: Sequence[int], layers: Layers) -> None:
        """Keep the key/values of ``tokens`` (each layer's (1, H, len(tokens), D)): only the
        tokens after the longest run the tree holds are copied; evicts as needed."""
        if len(tokens) < self.min_tokens or not self.budget:
            return
        path = self._walk(tokens, len(tokens))
        matched = sum(shared for _, shared in path)
        if path and path[-1][1] < len(path[-1][0].tokens):
            node, shared = path[-1]
            if matched == len(tokens):  # the tree holds these tokens already, and more
                self._touch(path)
                return
            path[-1] = (self._split(node, shared), shared)
        parent = path[-1][0] if path else self.root
        if matched < len(tokens):
            rest = tuple(tokens[matched:])
            if _bytes(layers) * len(rest) // len(tokens) > self.budget:
                return
            leaf = _Node(rest, _cut(layers, matched), parent)
            parent.children[rest[0]] = leaf
            self.used += leaf.size
            self.nodes += 1
            self.tokens += len(rest)
            path.append((leaf, len(rest)))
        self._touch(path)
        self._evict()

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node`` after its first ``at`` tokens: a new node holding them, with ``node`` (the rest) below it."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.tokens)
        head = _Node(node.tokens[:at], _cut(node.layers, 0, at), parent)
        head.used = node.used
        rest = node.tokens[at:]
        node.layers = _cut(node.layers, at)
        node.tokens = rest
        self.used += head.size - node.size
        node.size = _bytes(node.layers)
        self.used += node.size
        node.parent = head
        head.children[rest[0]] = node
        parent.children[head.tokens[0]] = head
        self.nodes += 1
        return head

    def _evict(self) -> None:
        """Drop least recently used leaves (a parent whose last child went becomes one) until within the budget."""
        if self.used <= self.budget:
            return
        order = itertools.count()
        leaves = [(node.used, next(order), node) for node in self._nodes() if not node.children]
        heapq.heapify(leaves)
        while self.used > self.budget and leaves:
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            assert parent is not None
            del parent.children[node.tokens[0]]
            self.used -= node.size
            self.nodes -= 1
            self.tokens -= len(node.tokens)
            self.evicted_tokens += len(node.tokens)
            if parent is not self.root and not parent.children:
                heapq.heappush(leaves, (parent.used, next(order), parent))

    def _nodes(self) -> list[_Node]:
        found, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            found.append(node)
            stack.extend(node.children.values())
        return found

    def clear(self) -> None:
        self.root = _Node((), [], None)
        self.used = self.nodes = self.tokens = 0
