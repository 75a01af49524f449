"""Attention backends by name. A backend is made once per generation from the generation's KV cache and options
(`make(cache, options, group_size)`) and is then a function of (q, k, v, bias, scale, layer) over the cache view.
Stateful backends (SparQ keeps a dimension-major K copy and a sum of values) rebuild their state from the cache when
its `layout` changes (rows joining, leaving, regrouped; accepted drafts). A
backend with `reads_stored = True` (SparQ, the window baseline) gets K and V as the cache stores them (a narrow
kv_dtype's rows, formats.py) and reads only what it needs; every other backend gets the decoded values."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .dense import causal_attention, dense_attention, group_bias, softcapped_attention
from .shared_prefix import SharedPrefix, attention_with_lse, merge_by_lse
from .sparq import (SparQAttention, SparQOptions, WindowAttention, sparq_attention, sparq_budget, sparq_select,
                    sparq_transfers, window_budget)

AttentionFn = Callable[..., torch.Tensor]  # (q, k, v, bias, scale, layer=i) -> out


@dataclass(frozen=True)
class AttentionOptions:
    sparq: SparQOptions = field(default_factory=SparQOptions)
    window_k: int = 256  # positions the local-window baseline keeps (16 first + the most recent)


def _dense(cache: Any, opts: AttentionOptions, group_size: int) -> AttentionFn:
    return dense_attention


ATTENTION_BACKENDS: dict[str, Callable[[Any, AttentionOptions, int], AttentionFn]] = {
    "dense": _dense,
    "sparq": lambda cache, opts, g: SparQAttention(cache, opts.sparq, g),
    "window": lambda cache, opts, g: WindowAttention(cache, opts.window_k),
}

__all__ = ["ATTENTION_BACKENDS", "AttentionFn", "AttentionOptions", "causal_attention", "dense_attention", "group_bias",
           "softcapped_attention",
           "SharedPrefix", "attention_with_lse", "merge_by_lse", "SparQAttention", "SparQOptions", "WindowAttention",
           "sparq_attention", "sparq_select", "sparq_transfers", "sparq_budget", "window_budget"]
