"""Drafters propose token trees for the rows of a batch: one small base class and the prompt-lookup drafter
(draft models live in draft_model.py, the name registry in registry.py)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..sampling import Sampler
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


@dataclass
class Proposal:
    """One row's draft tree: tokens and parents (parents before children, -1 = the root; siblings in the order they
    were drafted). q maps a node (-1 = the root) to the distribution its children were sampled from without
    replacement; children of a node absent from q are fixed choices (point masses). Only sampling reads q."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    q: dict[int, torch.Tensor] = field(default_factory=dict)


class Drafter(ABC):
    name: ClassVar[str]
    # proposing costs next to nothing (no model forward): tree="auto" may draft a token for a row it does not
    # verify, to see whether the drafter would have been right (spec/auto.py)
    cheap: ClassVar[bool] = False

    @abstractmethod
    def start(self, row: int, context: list[int], sampler: Sampler | None = None) -> None:
        """A new row (its prompt tokens; its tokens follow through `extend`), which may start at any step: rows join
        and leave as the engine's batch does. `sampler`: the row's sampling (a drafter that draws children draws
        them by its parameters, with its generator); None: the drafter's default."""

    @abstractmethod
    def extend(self, row: int, tokens: list[int]) -> None:
        """Tokens accepted for a row since the last call (the accepted drafts and the target's next token)."""

    @abstractmethod
    def propose_batch(self, rows: list[int], specs: list[TreeSpec | None]) -> list[Proposal]:
        """A draft tree for each row of the batch, in batch order (None: no draft for that row; its id need not be
        a started row)."""

    def forget(self, row: int) -> None:
        """A row left for good: drop what the drafter keeps for it."""


class NGramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrences of the row's last n tokens (n = max_n .. 1) and propose
    what followed them. No second model; pays off when the output copies from the context (extraction, edits,
    code). Incremental n-gram index per row, so a proposal costs O(width * depth), not O(context)."""

    name = "ngram"
    cheap = True

    def __init__(self, max_n: int = 3) -> None:
        self.max_n = max_n
        self.ctx: dict[int, list[int]] = {}
        self.index: dict[int, dict[tuple[int, ...], list[int]]] = {}

    def start(self, row: int, context: list[int], sampler: Sampler | None = None) -> None:
        self.ctx[row], self.index[row] = [], {}
        self.extend(row, context)

    def extend(self, row: int, tokens: list[int]) -> None:
        ctx, idx = self.ctx[row], self.index[row]
        for x in tokens:
            ctx.append(x)
            end = len(ctx)
            for n in range(1, min(self.max_n, end) + 1):
                idx.setdefault(tuple(ctx[end - n : end]), []).append(end)  # continuation starts at `end`

    def forget(self, row: int) -> None:
        self.ctx.pop(row, None)
        self.index.pop(row, None)

    def propose_batch(self, rows: list[int], specs: list[TreeSpec | None]) -> list[Proposal]:
        return [Proposal(*self.propose(row, spec)) if spec is not None else Proposal() for row, spec in zip(rows, specs)]

    def propose(self, row: int, spec: TreeSpec) -> tuple[list[int], list[int]]:
        """A trie of what followed the row's suffix, as (tokens, parents)."""
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

