"""Attention backends by name: functions of (q, k, v, bias, scale, layer) over a cache view."""
from __future__ import annotations

from typing import Callable

import torch

from .dense import dense_attention, group_bias
from .shared_prefix import SharedPrefix, attention_with_lse, merge_by_lse

AttentionFn = Callable[..., torch.Tensor]  # (q, k, v, bias, scale, layer=i) -> out
ATTENTION_BACKENDS: dict[str, AttentionFn] = {"dense": dense_attention}

__all__ = ["ATTENTION_BACKENDS", "AttentionFn", "dense_attention", "group_bias", "SharedPrefix", "attention_with_lse",
           "merge_by_lse"]
