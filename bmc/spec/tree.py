"""Draft token trees and their verification masks.

A verify forward feeds t = 1 + n tokens per row: the root (the last accepted token, whose K/V is not cached yet)
followed by n draft nodes. Node i's parent is parents[b, i] (-1 = the root); nodes are ordered so that a parent
always comes before its children, so cutting the tail of the list leaves a valid (smaller) tree. Rows may hold
different trees: the mask is per row, and rows with fewer proposals are padded with invalid nodes that hang off
the root and are never accepted."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import InvalidRequestError

MAX_TREE = 256  # draft nodes per row and step


@dataclass(frozen=True)
class TreeSpec:
    """How many continuations (width) of how many tokens (depth) a drafter proposes, capped at `size` nodes."""

    width: int
    depth: int
    size: int
    parents: tuple[int, ...] | None = None  # a static tree's shape (level by level, siblings in rank order)
    auto: bool = False  # tree="auto": proposals of this shape, cut each step to the measured best (spec/auto.py)

    @staticmethod
    def parse(spec: str) -> "TreeSpec":
        """`chain:K` (one continuation of K tokens), `dynamic:KxD` (up to K branches of depth D, a trie / beam) or
        `static:SIZE[xDEPTH][:p0,p1,...]` (Sequoia's best shape of SIZE nodes and at most DEPTH levels for the
        acceptance rates p by child rank; defaults in static_tree.py)."""
        if spec == "auto":
            from .auto import AUTO_PROPOSAL

            return dataclasses.replace(AUTO_PROPOSAL, auto=True)
        if spec == "static" or spec.startswith("static:"):
            return TreeSpec._parse_static(spec)
        m = re.fullmatch(r"chain:(\d+)", spec) or re.fullmatch(r"dynamic:(\d+)x(\d+)", spec)
        if m is None:
            raise InvalidRequestError(f"unknown tree {spec!r}: use auto, chain:K, dynamic:KxDEPTH or static:SIZE")
        nums = [int(g) for g in m.groups()]
        width, depth = (1, nums[0]) if len(nums) == 1 else (nums[0], nums[1])
        if width < 1 or depth < 1 or width * depth > MAX_TREE:
            raise InvalidRequestError(f"tree {spec!r}: width and depth must be >= 1 and width*depth <= {MAX_TREE}")
        return TreeSpec(width, depth, width * depth)

    @staticmethod
    def _parse_static(spec: str) -> "TreeSpec":
        from .static_tree import DEFAULT_ACCEPTANCE, DEFAULT_DEPTH, DEFAULT_SIZE, static_tree

        m = re.fullmatch(r"static(?::(\d+)(?:x(\d+))?(?::([0-9.eE+-]+(?:,[0-9.eE+-]+)*))?)?", spec)
        if m is None:
            raise InvalidRequestError(f"tree {spec!r}: use static:SIZE, static:SIZExDEPTH or static:SIZE:p0,p1,... "
                                      "(acceptance rates by child rank)")
        size = int(m.group(1)) if m.group(1) else DEFAULT_SIZE
        max_depth = int(m.group(2)) if m.group(2) else DEFAULT_DEPTH
        try:
            rates = tuple(float(x) for x in m.group(3).split(",")) if m.group(3) else DEFAULT_ACCEPTANCE
        except ValueError:
            raise InvalidRequestError(f"tree {spec!r}: acceptance rates must be numbers") from None
        if not 1 <= size <= MAX_TREE:
            raise InvalidRequestError(f"tree {spec!r}: SIZE must be in 1..{MAX_TREE}")
        if any(not 0.0 <= r <= 1.0 for r in rates) or sum(rates) > 1.0 + 1e-6 or rates[0] <= 0.0:
            raise InvalidRequestError(f"tree {spec!r}: rates must be in [0, 1], sum to at most 1, the first > 0")
        try:
            parents = static_tree(size, rates, max_depth)
        except ValueError as e:
            raise InvalidRequestError(f"tree {spec!r}: {e}") from None
        depths = node_depths(parents)
        width = max(sum(1 for p in parents if p == q) for q in set(parents))
        return TreeSpec(width, max(depths), size, parents)

    def capped(self, depth: int) -> "TreeSpec | None":
        """The same shape at most `depth` deep (None when depth < 1: nothing to draft)."""
        if depth < 1:
            return None
        if depth >= self.depth:
            return self
        if self.parents is None:
            return TreeSpec(self.width, depth, self.width * depth, auto=self.auto)
        keep = tuple(p for p, d in zip(self.parents, node_depths(self.parents)) if d <= depth)  # a prefix
        return TreeSpec(self.width, depth, len(keep), keep)

    def static_levels(self) -> list[list[tuple[int, int]]] | None:
        """A static tree level by level: each node as (its parent's index in the previous level, its rank among its
        siblings); the root is level -1 with one slot. None for chain / dynamic trees."""
        if self.parents is None:
            return None
        depths = node_depths(self.parents)
        levels: list[list[tuple[int, int]]] = []
        slot: dict[int, int] = {-1: 0}  # node -> index within its level
        rank: dict[int, int] = {}  # parent -> children so far
        for i, (p, d) in enumerate(zip(self.parents, depths)):
            if d > len(levels) + 1 or d < len(levels):
                raise ValueError("a static tree lists its nodes level by level")
            if d > len(levels):
                levels.append([])
            slot[i] = len(levels[d - 1])
            levels[d - 1].append((slot[p], rank.get(p, 0)))
            rank[p] = rank.get(p, 0) + 1
        return levels


def node_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node (children of the root: 1); parents come before children."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [B, n] long
    parents: torch.Tensor  # [B, n] long, -1 = root
    valid: torch.Tensor  # [B, n] bool

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def truncate(self, n: int) -> "DraftTree":
        """Keep the first n nodes (parents come first, so this is still a tree)."""
        return DraftTree(self.tokens[:, :n], self.parents[:, :n], self.valid[:, :n])

    @staticmethod
    def from_lists(rows: list[tuple[list[int], list[int]]], device: torch.device) -> "DraftTree":
        """rows[b] = (tokens, parents); padded to the longest row with invalid root children."""
        n = max((len(t) for t, _ in rows), default=0)
        tokens = torch.zeros(len(rows), n, dtype=torch.long)
        parents = torch.full((len(rows), n), -1, dtype=torch.long)
        valid = torch.zeros(len(rows), n, dtype=torch.bool)
        for b, (tok, par) in enumerate(rows):
            tokens[b, : len(tok)] = torch.tensor(tok, dtype=torch.long)
            parents[b, : len(par)] = torch.tensor(par, dtype=torch.long)
            valid[b, : len(tok)] = True
        return DraftTree(tokens.to(device), parents.to(device), valid.to(device))


def tree_visibility(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For the t = 1 + n verify tokens (root first): visible [B, t, t] bool (each token sees itself, the root and
    its ancestors) and depth [B, t] (root 0), the position offset of each token."""
    B, n = parents.shape
    t = n + 1
    par = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=parents.device), parents + 1], dim=1)  # root = 0
    par[:, 0] = 0  # the root is its own parent: the walk below stops there
    visible = torch.eye(t, dtype=torch.bool, device=parents.device).expand(B, t, t).clone()
    depth = torch.zeros(B, t, dtype=torch.long, device=parents.device)
    cur = torch.arange(t, device=parents.device).expand(B, t).clone()
    rows = torch.arange(B, device=parents.device)[:, None].expand(B, t)
    qs = torch.arange(t, device=parents.device).expand(B, t)
    for _ in range(t):  # walk every node up to the root, marking ancestors; depth <= n
        nxt = par.gather(1, cur)
        moved = nxt != cur
        if not moved.any():
            break
        depth += moved.long()
        cur = nxt
        visible[rows, qs, cur] = True
    return visible, depth


def greedy_accept(tokens: list[list[int]], parents: list[list[int]], valid: list[list[bool]],
                  preds: list[list[int]]) -> list[list[int]]:
    """Greedy verification: from the root, follow the child whose token equals the target's argmax at the current
    node. Returns, per row, the accepted verify positions (0 = root, node i = i + 1); the next token is then
    preds[b][path[-1]] (the target's own choice after the last accepted node)."""
    paths = []
    for tok, par, ok, pred in zip(tokens, parents, valid, preds):
        children: dict[int, dict[int, int]] = {}
        for i, (x, p, v) in enumerate(zip(tok, par, ok)):
            if v:
                children.setdefault(p + 1, {}).setdefault(x, i + 1)
        path, cur = [0], 0
        while True:
            nxt = children.get(cur, {}).get(pred[cur])
            if nxt is None:
                break
            path.append(nxt)
            cur = nxt
        paths.append(path)
    return paths


def rank_counts(parents: list[list[int]], valid: list[list[bool]], paths: list[list[int]]
                ) -> tuple[list[int], list[int]]:
    """Per child rank r (0 = a node's first child): how many accepted nodes had an r-th child (visits) and how
    often that child was the accepted one. accepted[r] / visits[r] estimates Sequoia's positional acceptance p_r."""
    visits: list[int] = []
    accepted: list[int] = []
    for par, ok, path in zip(parents, valid, paths):
        kids: dict[int, list[int]] = {}
        for i, (p, v) in enumerate(zip(par, ok)):
            if v:
                kids.setdefault(p + 1, []).append(i + 1)
        for step, cur in enumerate(path):
            nxt = path[step + 1] if step + 1 < len(path) else None
            for r, child in enumerate(kids.get(cur, [])):
                if r == len(visits):
                    visits.append(0)
                    accepted.append(0)
                visits[r] += 1
                accepted[r] += child == nxt
    return visits, accepted
