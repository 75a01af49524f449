"""Static Sequoia-style draft trees: the shape of `size` nodes that maximizes the expected number of accepted drafts.

Sequoia's positional acceptance model: the r-th ranked child of an accepted node is the accepted one with
probability p[r], whatever the node (at most one child is accepted, so sum(p) <= 1). A node is then accepted with
the product of p over the ranks on its path, and the expected number of accepted drafts of a tree is the sum of that
product over its nodes. The best shape of at most `depth` levels follows from a dynamic program over subtree sizes
n (root included) and heights h:

    G_h(1) = 1,  G_0(n > 1) = -inf                 (a subtree's root counts once it is accepted)
    G_h(n) = 1 + H_h(n - 1, 0)
    H_h(0, r) = 0;  H_h(m, r) = max over s in 1..m of  p[r] * G_{h-1}(s) + H_h(m - s, r + 1)   (ranks r, r+1, ...)

O(depth * size^2 * len(p)). The depth bound is Sequoia's hardware-aware constraint: a draft model runs one forward
per level. p is measured per rank by `SpecStats.acceptance_by_rank` (pass it as `tree="static:SIZE:p0,p1,..."`);
DEFAULT_ACCEPTANCE is the built-in vector."""
from __future__ import annotations

from functools import lru_cache

# Measured: speculative="int8-self", greedy, tree="dynamic:6x1" (every step tries 6 ranked children of the root),
# 6 chat prompts x 96 tokens on the default SmolLM2-135M model: 0.791, 0.105, 0.042, 0.016, 0.012, 0.021 over
# 240-282 visits per rank; the last two ranks pooled here. Ranks beyond the vector are never used.
DEFAULT_ACCEPTANCE: tuple[float, ...] = (0.79, 0.105, 0.042, 0.016, 0.016)
DEFAULT_SIZE = 26  # the seed paper's candidate size (section VIII-F)
DEFAULT_DEPTH = 8  # at most this many draft forwards per step


@lru_cache(maxsize=32)
def static_tree(size: int, acceptance: tuple[float, ...] = DEFAULT_ACCEPTANCE,
                depth: int = DEFAULT_DEPTH) -> tuple[int, ...]:
    """The best tree of exactly `size` draft nodes below the root and at most `depth` levels, as parents (-1 = the
    root), listed level by level with each node's children in rank order."""
    K, N = len(acceptance), size + 1
    if size < 1 or depth < 1 or K < 1:
        raise ValueError("a static tree needs size >= 1, depth >= 1 and at least one acceptance rate")
    NEG = float("-inf")
    G = [NEG, 1.0] + [NEG] * (N - 1)  # height 0: the root alone
    choices: list[list[list[int]]] = []  # per height h: the subtree size given to rank r out of m nodes
    for _ in range(depth):
        H = [[0.0] * (K + 1)] + [[NEG] * (K + 1) for _ in range(N - 1)]
        choice = [[0] * K for _ in range(N)]
        for m in range(1, N):
            for r in range(K - 1, -1, -1):
                for s in range(1, m + 1):
                    if G[s] == NEG or H[m - s][r + 1] == NEG:
                        continue
                    v = acceptance[r] * G[s] + H[m - s][r + 1]
                    if v > H[m][r]:
                        H[m][r], choice[m][r] = v, s
        G = [NEG] + [1.0 + H[n - 1][0] for n in range(1, N + 1)]
        choices.append(choice)
    if G[N] == NEG:
        raise ValueError(f"no tree of {size} nodes fits {depth} levels with {K} ranked children per node")

    def child_sizes(n: int, h: int) -> list[int]:
        sizes, m, r = [], n - 1, 0
        while m > 0:
            s = choices[h - 1][m][r]
            sizes.append(s)
            m, r = m - s, r + 1
        return sizes

    parents: list[int] = []
    frontier = [(-1, N)]  # (node, its subtree size), one level at a time
    for h in range(depth, 0, -1):
        nxt = []
        for node, n in frontier:
            for s in child_sizes(n, h):
                parents.append(node)
                nxt.append((len(parents) - 1, s))
        frontier = nxt
    return tuple(parents)


def expected_accepted(parents: tuple[int, ...] | list[int], acceptance: tuple[float, ...]) -> float:
    """Expected number of accepted drafts of a tree under the positional model (exact: a sum over its nodes)."""
    rank: dict[int, int] = {}
    reach: list[float] = []
    for p in parents:
        r = rank.get(p, 0)
        rank[p] = r + 1
        a = acceptance[r] if r < len(acceptance) else 0.0
        reach.append(a * (reach[p] if p >= 0 else 1.0))
    return sum(reach)
