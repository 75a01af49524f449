"""The speculative decode step's parts: draft a tree per row, verify it in one target forward inside the cache's
padding rows, keep the accepted path (compacted in place); the scheduler's step runs them.

Greedy verification is exact: the emitted tokens are the target's argmax at each accepted node, so the output
equals plain greedy decoding token for token. Sampling verification (verify.py) is lossless: the emitted tokens
have exactly the distribution plain sampling would give."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..attention import AttentionFn
from ..kv import KVCache
from ..models import Model
from .auto import AutoTree
from .drafters import Drafter, Proposal
from .tree import DraftTree, TreeSpec, rank_counts, tree_visibility


@dataclass
class SpecStats:
    verify_steps: int = 0  # target forwards that verified a tree
    row_steps: int = 0  # sum over verify steps of the rows in the batch
    drafted: int = 0  # draft nodes verified (valid ones)
    accepted: int = 0  # draft nodes accepted
    free_rows: int = 0  # masked padding rows of the current chunk before each verify, summed over steps
    used_rows: int = 0  # of those, rows that held tree tokens
    draft_seconds: float = 0.0  # time spent in the drafter (inside the decode time)
    rank_visits: list[int] = field(default_factory=list)  # [r]: accepted nodes that had an r-th child
    rank_accepted: list[int] = field(default_factory=list)  # [r]: ... whose r-th child was accepted

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per row per verify step (accepted drafts + the target's own next token)."""
        return (self.accepted + self.row_steps) / self.row_steps if self.row_steps else 0.0

    @property
    def acceptance_by_rank(self) -> list[float]:
        """Measured acceptance rate of a node's r-th child (what `tree="static:SIZE:p0,p1,..."` takes)."""
        return [a / v if v else 0.0 for a, v in zip(self.rank_accepted, self.rank_visits)]

    @property
    def padding_use(self) -> float:
        return self.used_rows / self.free_rows if self.free_rows else 0.0


class SpeculativeStep:
    """The drafter, the tree shape and the counts of one engine's speculation; the scheduler drafts (`draft`),
    verifies (`verify_forward`), accepts (greedy_accept, or verify.sample_paths with each request's sampler) and
    records."""

    def __init__(self, drafter: Drafter, spec: TreeSpec, trim_to_chunk: bool, auto: AutoTree | None = None) -> None:
        self.drafter, self.spec, self.trim = drafter, spec, trim_to_chunk
        self.auto = auto  # tree="auto": the measured choice of each step's tree size (spec/auto.py)
        self.stats = SpecStats()

    def draft(self, cache: KVCache, rows: list[int], specs: list[TreeSpec | None]) -> tuple[DraftTree, list[Proposal], int]:
        """Every row's draft tree (specs[b] None: no draft for row b), trimmed to the chunk's free padding rows
        unless the chunk may grow; also the proposals (sampling reads their q) and the free rows."""
        t0 = time.perf_counter()
        proposals = self.drafter.propose_batch(rows, specs)
        seconds = time.perf_counter() - t0
        self.stats.draft_seconds += seconds
        if self.auto is not None:
            self.auto.drafted(seconds)
        tree = DraftTree.from_lists([(p.tokens, p.parents) for p in proposals], cache.device)
        free = cache.capacity - cache.length if cache.keeps_padding else 0
        if self.trim and 0 < free < 1 + tree.num_nodes:  # the paper's choice: the tree fits the chunk, no copy
            tree = tree.truncate(free - 1)
        return tree, proposals, free

    @staticmethod
    def verify_forward(model: Model, cache: KVCache, attention: AttentionFn, tree: DraftTree, next_tok: torch.Tensor,
                       pos: torch.Tensor) -> torch.Tensor:
        """One target forward over every row's root and tree, written into the cache's reserved columns (its
        padding rows when the tree fits them); the logits of every verify token [B, t, V]."""
        t = 1 + tree.num_nodes
        visible, depth = tree_visibility(tree.parents)
        tokens = torch.cat([next_tok[:, None], tree.tokens], dim=1)
        cache.reserve(t, pos[:, None] + depth)
        return model.net(tokens, pos[:, None] + depth, cache, attention, cache.attention_bias(t, visible),
                         all_logits=True)

    def record(self, tree: DraftTree, paths: list[list[int]], free: int) -> None:
        """Count one verify step: drafted and accepted nodes, padding use, acceptance by child rank."""
        s, t = self.stats, 1 + tree.num_nodes
        s.verify_steps += 1
        s.row_steps += len(paths)
        s.drafted += int(tree.valid.sum())
        s.accepted += sum(len(p) - 1 for p in paths)
        s.free_rows += max(free, 0)
        s.used_rows += min(max(free, 0), t)
        visits, accepted = rank_counts(tree.parents.tolist(), tree.valid.tolist(), paths)
        for r, (v, a) in enumerate(zip(visits, accepted)):
            if r == len(s.rank_visits):
                s.rank_visits.append(0)
                s.rank_accepted.append(0)
            s.rank_visits[r] += v
            s.rank_accepted[r] += a
