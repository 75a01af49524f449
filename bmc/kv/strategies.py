"""The three allocation strategies: they differ only in the capacity they allocate when full."""
from __future__ import annotations

import math

import torch

from .base import KVCache


class IterativeCache(KVCache):
    """Allocate exactly what is needed: a new tensor and a full copy every token (HF DynamicCache's concat)."""

    name = "iterative"
    keeps_padding = False

    def reserve(self, num_new: int, positions: torch.Tensor | None = None) -> None:
        if self.capacity > self.length:  # rows a verify step rejected: crop them, then concatenate (HF crop + cat)
            self._reallocate(self.length + num_new)
        super().reserve(num_new, positions)

    def _grow_to(self, needed: int) -> int:
        return needed


class UpfrontCache(KVCache):
    """One buffer of the maximum length (HF StaticCache); attention always runs over all of it."""

    name = "upfront"

    def _grow_to(self, needed: int) -> int:
        return max(self.max_length, needed)


class BMCCache(KVCache):
    """Balanced between Memory and Compute: grow by r rows at a time, so one allocation + copy every r tokens
    and at most r - 1 masked padding rows of wasted attention compute in between (seed paper, section V)."""

    name = "bmc"

    def __init__(self, *, r: int, **kwargs) -> None:
        if r < 1:
            raise ValueError(f"r must be >= 1, got {r}")
        super().__init__(**kwargs)
        self.r = r

    def _grow_to(self, needed: int) -> int:
        chunked = math.ceil(needed / self.r) * self.r
        return max(needed, min(chunked, self.max_length))  # never past the run's maximum length N


SCORE_BLOCK = 16  # keys the native CPU step scores together (kernels/cpu/attend_float.h, scores<NV> and sum16)


def whole_score_blocks(r: int, max_length: int) -> int:
    """r rounded up to whole score blocks of the native CPU step (at most max_length), so that every capacity is a
    multiple of 16 keys and each key's score is summed as at any larger capacity. A partial last block's keys are
    reduced in another order: the scores' bits differ by ~1e-7, which int8 activations' rounding turned into 0.05
    logits and other greedy tokens on a random OPT-1.3B between r = 7 or 8 and the upfront buffer (r = 16, 32, 48:
    bit-identical logits)."""
    return min(max_length, -(-r // SCORE_BLOCK) * SCORE_BLOCK)


def r_from_T(max_length: int, T: int) -> int:
    """Chunk size for T allocations over N = max_length tokens: r = ceil(N / T)."""
    if T < 1:
        raise ValueError(f"T must be >= 1, got {T}")
    return max(1, math.ceil(max_length / T))
