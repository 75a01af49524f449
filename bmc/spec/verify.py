"""Lossless verification of a draft tree under sampling: multi-candidate rejection sampling (SpecInfer, Sequoia).

At an accepted node the target's distribution p (Sampler.probs of the verify logits there: temperature, top-k,
top-p) is sampled exactly by trying the node's children in order:

- a child x drawn from a draft distribution q is accepted with probability min(1, p(x) / q(x)); on rejection
  p <- normalize(max(p - q, 0)) and, because siblings are drawn without replacement, q <- normalize(q without x);
- a child chosen deterministically (prompt lookup, the draft's top-k) has q = the point mass on x: it is accepted
  with probability p(x), and a rejection zeroes x in p;
- when every child is rejected, the next token is drawn from the residual p.

Each step is the classic rejection-sampling identity (accept or fall back to the residual gives exactly p), so
the emitted sequence has the target's distribution whatever the drafter proposes; only the acceptance rate
depends on the drafter. Every random draw comes from the Sampler's seeded generator (reproducible runs)."""
from __future__ import annotations

import torch

from ..sampling import Sampler, draw


class NodeResidual:
    """The target distribution at one tree node, updated as the node's candidate children are rejected."""

    def __init__(self, p: torch.Tensor, q: torch.Tensor | None) -> None:
        """p [V]: the target's distribution at the node. q [V]: the distribution the node's children were sampled
        from (without replacement), or None when they were fixed choices (point masses)."""
        self.p, self.q = p, q

    def accept_prob(self, x: int) -> float:
        px = float(self.p[x])
        if self.q is None:
            return px  # min(1, p(x) / 1)
        qx = float(self.q[x])
        if qx <= 0.0:
            raise ValueError(f"candidate {x} has draft probability 0: it cannot have been sampled from q")
        return 1.0 if px >= qx else px / qx

    def reject(self, x: int) -> None:
        sampled = self.q is not None
        if not sampled:
            p = self.p.clone()
            p[x] = 0.0  # max(p - onehot(x), 0): p(x) <= 1
        else:
            p = (self.p - self.q).clamp_(min=0.0)
            q = self.q.clone()
            q[x] = 0.0
            total = q.sum()
            self.q = q / total if total > 0 else None  # None: q is spent, no sampled sibling can follow
        total = p.sum()
        if total <= 0 and sampled:
            # max(p - q, 0) has positive mass whenever a rejection had probability > 0 (p != q); a zero sum is float
            # round-off of p == q. Fall back to removing only x, the exact update in that case's limit.
            p = self.p.clone()
            p[x] = 0.0
            total = p.sum()
        if total > 0:
            self.p = p / total
        # else x held all of p's mass, so rejecting it had probability 0 (round-off got here): p stays as it is


def sample_paths(tokens: list[list[int]], parents: list[list[int]], valid: list[list[bool]], logits: torch.Tensor,
                 q: list[dict[int, torch.Tensor]], sampler: Sampler, probs: torch.Tensor | None = None
                 ) -> tuple[list[list[int]], list[int]]:
    """Walk every row's tree by rejection sampling. logits [B, t, V]: the verify forward's logits (position 0 = the
    root, node i = i + 1); q[b]: node index (-1 = root) -> the distribution its children were sampled from;
    probs: Sampler.probs of every position's logits [B, t, V] where the caller made them at once (several requests
    with the same parameters), else made here level by level, one call for all rows. Returns per row the accepted
    verify positions (root first, as greedy_accept) and the next token drawn after the last accepted node; every
    draw comes from `sampler`'s generator."""
    B = len(tokens)
    children: list[dict[int, list[int]]] = []
    for par, ok in zip(parents, valid):
        ch: dict[int, list[int]] = {}
        for i, (p, v) in enumerate(zip(par, ok)):
            if v:
                ch.setdefault(p + 1, []).append(i + 1)  # verify positions, in node order (= draft order)
        children.append(ch)
    paths = [[0] for _ in range(B)]
    bonus = [0] * B
    active = list(range(B))
    gen = sampler.generator
    while active:
        at = torch.tensor([paths[b][-1] for b in active], device=logits.device)
        rows = torch.tensor(active, device=logits.device)
        level = probs[rows, at] if probs is not None else sampler.probs(logits[rows, at].float())
        still: list[int] = []
        for a, b in enumerate(active):
            cur = paths[b][-1]
            node = NodeResidual(level[a], q[b].get(cur - 1))
            nxt = None
            for c in children[b].get(cur, []):
                x = tokens[b][c - 1]
                if torch.rand((), generator=gen, device=probs.device).item() < node.accept_prob(x):
                    nxt = c
                    break
                node.reject(x)
            if nxt is None:
                bonus[b] = int(draw(node.p[None], gen))
            else:
                paths[b].append(nxt)
                still.append(b)
        active = still
    return paths, bonus
