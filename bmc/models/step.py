"""One forward of the engine's step as the model runs it: a batch of rows (a `StepPart`), and what the native CPU
step needs to compute its attention (the shared segments' lists). Above the kernels: the parts name attention
backends (attention/), the kernels only take tensors."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..attention import SharedPrefix, causal_attention, dense_attention
from ..kernels.native import NATIVE_MAX_T

Segments = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]
NO_SEGMENTS: Segments = ([], [], [])


def native_segments(attention: Any) -> Segments | None:
    """What the native step needs to compute `attention`: no shared segments for dense attention, the shared
    prefixes' (kv, bias, group) lists for SharedPrefix.attention, None for other backends (SparQ, window: eager).
    causal_attention is dense attention whose bias is causal: the native step reads that bias."""
    if attention is dense_attention or attention is causal_attention:
        return NO_SEGMENTS
    owner = getattr(attention, "__self__", None)
    if isinstance(owner, SharedPrefix) and attention.__func__ is SharedPrefix.attention:
        return owner.native_segments()
    return None


@dataclass
class StepPart:
    """One batch of a fused step (`forward_parts`): tokens and positions [B, t], a cache that has reserved t
    columns, its bias (cache.attention_bias(t)) and the attention it would run alone."""

    tokens: torch.Tensor
    positions: torch.Tensor
    cache: Any  # a KVCache
    bias: torch.Tensor
    attention: Any
    prompt_len: torch.Tensor | None = None  # [B]: the rows' whole prompt lengths, for a prompt chunk (longrope)
    all_logits: bool = False  # the logits of every position (a prompt scored token by token), run as its own forward
    # all_logits: what the step keeps of them, taken right after this part's forward (its last position's logits):
    # a step of several scored chunks holds one chunk's [t, V] logits at a time, not all of them
    score: Any = None

    def native_ready(self) -> bool:
        """Whether the native step computes this part as its own forward would: t within NATIVE_MAX_T, dense,
        causal or shared-prefix attention (no SparQ or window function) and a cache written at its length."""
        return (self.tokens.shape[1] <= NATIVE_MAX_T and self.cache.write_at is None
                and native_segments(self.attention) is not None)
