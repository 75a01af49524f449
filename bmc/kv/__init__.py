"""KV cache strategies behind one interface, chosen by name."""
from __future__ import annotations

from .base import KVCache
from .formats import KV_DTYPES, KV_FORMATS, KVFormat, kv_format
from .strategies import BMCCache, IterativeCache, UpfrontCache, r_from_T, whole_score_blocks

KV_STRATEGIES: dict[str, type[KVCache]] = {cls.name: cls for cls in (BMCCache, IterativeCache, UpfrontCache)}

__all__ = ["KV_DTYPES", "KV_FORMATS", "KVFormat", "kv_format", "KVCache", "BMCCache", "IterativeCache", "UpfrontCache", "KV_STRATEGIES", "r_from_T",
           "whole_score_blocks"]
