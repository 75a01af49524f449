"""Speculative decoding: drafters propose token trees, one target forward verifies every node inside the BMC
cache's padding rows, and the accepted path is compacted in place (seed paper, section VI)."""
from .drafters import DRAFTERS, Drafter, NGramDrafter, build_trie
from .tree import DraftTree, TreeSpec, greedy_accept, tree_visibility

__all__ = ["DRAFTERS", "Drafter", "NGramDrafter", "build_trie", "DraftTree", "TreeSpec", "greedy_accept",
           "tree_visibility"]
