"""Static Sequoia trees: the DP's shape against exhaustive search, chain and balanced trees, and its use in runs."""
from __future__ import annotations

import itertools

import pytest

from bmc.errors import InvalidRequestError
from bmc.spec import TreeSpec
from bmc.spec.static_tree import DEFAULT_ACCEPTANCE, expected_accepted, static_tree
from bmc.spec.tree import node_depths, rank_counts

RATES = [DEFAULT_ACCEPTANCE, (0.6, 0.15, 0.05, 0.03), (0.3, 0.25, 0.2, 0.15), (0.9,), (0.45, 0.45)]


def chain(n: int) -> list[int]:
    return [i - 1 for i in range(n)]


def balanced(n: int, k: int) -> list[int]:
    """The first n nodes of the complete k-ary tree below the root, level by level."""
    return [-1 if i < k else i // k - 1 for i in range(n)]


def check_shape(parents: tuple[int, ...], size: int, depth: int) -> None:
    assert len(parents) == size
    assert all(-1 <= p < i for i, p in enumerate(parents))  # parents before children
    depths = node_depths(parents)
    assert depths == sorted(depths) and max(depths) <= depth  # level by level, within the depth bound
    spec = TreeSpec(1, max(depths), size, parents)
    assert sum(len(level) for level in spec.static_levels()) == size


@pytest.mark.parametrize("rates", RATES)
@pytest.mark.parametrize("size", [1, 5, 12, 26, 40])
def test_static_tree_beats_chain_and_balanced_trees(rates, size):
    tree = static_tree(size, rates, size)  # no depth bound
    check_shape(tree, size, size)
    best = expected_accepted(tree, rates)
    assert best >= expected_accepted(chain(size), rates) - 1e-12
    for k in (2, 3, 4):
        assert best >= expected_accepted(balanced(size, k), rates) - 1e-12
    if size <= sum(len(rates) ** d for d in range(1, 5)):  # fits 4 levels of len(rates) ranked children
        bounded = static_tree(size, rates, 4)
        check_shape(bounded, size, 4)
        value = expected_accepted(bounded, rates)
        assert value <= best + 1e-12  # a depth bound never helps
        for k in (2, 3, 4):
            if max(node_depths(balanced(size, k))) <= 4:
                assert value >= expected_accepted(balanced(size, k), rates) - 1e-12


@pytest.mark.parametrize("rates", RATES)
def test_static_tree_is_optimal_by_exhaustive_search(rates):
    for size in range(1, 7):
        for depth in (2, size):
            try:
                tree = static_tree(size, rates, depth)
            except ValueError:  # too many nodes for `depth` levels of len(rates) children
                assert size > sum(len(rates) ** d for d in range(1, depth + 1))
                continue
            check_shape(tree, size, depth)
            best = 0.0  # every tree as a parent sequence (siblings ranked by order of appearance)
            for parents in itertools.product(*[range(-1, i) for i in range(size)]):
                if max(node_depths(parents)) <= depth:
                    best = max(best, expected_accepted(parents, rates))
            assert expected_accepted(tree, rates) == pytest.approx(best, abs=1e-12), (size, depth)


def test_expected_accepted_by_hand():
    # root -> a (rank 0) -> c (rank 0); root -> b (rank 1): p0 + p0*p0 + p1
    assert expected_accepted([-1, -1, 0], (0.5, 0.25)) == pytest.approx(0.5 + 0.25 + 0.25)
    assert expected_accepted([-1, -1, -1], (0.5, 0.25)) == pytest.approx(0.75)  # a third rank is never accepted


def test_static_tree_spec_parsing_and_capping():
    spec = TreeSpec.parse("static:26")
    assert spec.size == 26 and len(spec.parents) == 26 and spec.depth <= 8
    assert TreeSpec.parse("static") == spec
    small = TreeSpec.parse("static:10x3:0.5,0.2")
    assert small.parents == static_tree(10, (0.5, 0.2), 3) and small.depth <= 3
    capped = spec.capped(2)
    assert capped.parents == spec.parents[: capped.size] and max(node_depths(capped.parents)) == 2
    for bad in ("static:0", "static:26:1.5", "static:26:0.7,0.7", "static:26:x", "static:300", "static:40x1:0.5"):
        with pytest.raises(InvalidRequestError):
            TreeSpec.parse(bad)


def test_rank_counts_measure_acceptance_by_child_rank():
    # root has children n0 (rank 0), n1 (rank 1); n1 has child n2. Row 0 accepted n1 then n2, row 1 nothing.
    parents, valid = [[-1, -1, 1]] * 2, [[True] * 3] * 2
    visits, accepted = rank_counts(parents, valid, [[0, 2, 3], [0]])
    assert visits == [3, 2] and accepted == [1, 1]  # rank 0: root twice + n1 once; rank 1: root twice
