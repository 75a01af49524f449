"""Attention backends by name: functions of (q, k, v, bias, scale) over a cache view."""
from __future__ import annotations

from typing import Callable

import torch

from .dense import dense_attention, group_bias

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
ATTENTION_BACKENDS: dict[str, AttentionFn] = {"dense": dense_attention}

__all__ = ["ATTENTION_BACKENDS", "AttentionFn", "dense_attention", "group_bias"]
