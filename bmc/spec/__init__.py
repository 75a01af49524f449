"""Speculative decoding: drafters propose token trees, one target forward verifies every node inside the BMC
cache's padding rows, and the accepted path is compacted in place (seed paper, section VI). Greedy verification
keeps the target's argmax path; sampling verification is lossless multi-candidate rejection sampling."""
from .drafters import Drafter, NGramDrafter, Proposal, build_trie
from .registry import DRAFTERS, make_drafter, parse_speculative
from .tree import DraftTree, TreeSpec, greedy_accept, tree_visibility
from .verify import NodeResidual, sample_paths

__all__ = ["DRAFTERS", "Drafter", "NGramDrafter", "Proposal", "build_trie", "make_drafter", "parse_speculative",
           "DraftTree", "TreeSpec", "greedy_accept", "tree_visibility", "NodeResidual", "sample_paths"]
