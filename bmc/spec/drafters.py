"""Drafters propose token trees for the rows of a batch. One small base class and a name registry."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from .tree import TreeSpec


def build_trie(continuations: list[list[int]], size: int) -> tuple[list[int], list[int]]:
    """Merge continuations into a trie of at most `size` nodes: (tokens, parents) with parents first."""
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for seq in continuations:
        parent = -1
        for x in seq:
            node = index.get((parent, x))
            if node is None:
                if len(tokens) >= size:
                    break
                node = len(tokens)
                tokens.append(x)
                parents.append(parent)
                index[(parent, x)] = node
            parent = node
    return tokens, parents


class Drafter(ABC):
    name: ClassVar[str]

    @abstractmethod
    def start(self, row: int, context: list[int]) -> None:
        """A new row (prompt tokens plus its first generated token)."""

    @abstractmethod
    def extend(self, row: int, tokens: list[int]) -> None:
        """Tokens accepted for a row since the last call."""

    @abstractmethod
    def propose(self, row: int, spec: TreeSpec) -> tuple[list[int], list[int]]:
        """A draft tree for the row as (tokens, parents), parents before children, -1 = the root."""


class NGramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrences of the row's last n tokens (n = max_n .. 1) and propose
    what followed them. No second model; pays off when the output copies from the context (extraction, edits,
    code). Incremental n-gram index per row, so a proposal costs O(width * depth), not O(context)."""

    name = "ngram"

    def __init__(self, max_n: int = 3) -> None:
        self.max_n = max_n
        self.ctx: dict[int, list[int]] = {}
        self.index: dict[int, dict[tuple[int, ...], list[int]]] = {}

    def start(self, row: int, context: list[int]) -> None:
        self.ctx[row], self.index[row] = [], {}
        self.extend(row, context)

    def extend(self, row: int, tokens: list[int]) -> None:
        ctx, idx = self.ctx[row], self.index[row]
        for x in tokens:
            ctx.append(x)
            end = len(ctx)
            for n in range(1, min(self.max_n, end) + 1):
                idx.setdefault(tuple(ctx[end - n : end]), []).append(end)  # continuation starts at `end`

    def propose(self, row: int, spec: TreeSpec) -> tuple[list[int], list[int]]:
        ctx, idx = self.ctx[row], self.index[row]
        conts: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(min(self.max_n, len(ctx)), 0, -1):
            for start in reversed(idx.get(tuple(ctx[-n:]), [])):
                if start >= len(ctx):
                    continue  # the suffix itself
                c = tuple(ctx[start : start + spec.depth])
                if c and c not in seen:
                    seen.add(c)
                    conts.append(list(c))
                if len(conts) >= spec.width:
                    return build_trie(conts, spec.size)
        return build_trie(conts, spec.size)


DRAFTERS: dict[str, type[Drafter]] = {"ngram": NGramDrafter}
