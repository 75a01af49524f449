"""KV cache strategies behind one interface, chosen by name."""
from __future__ import annotations

from .base import KVCache
from .strategies import BMCCache, IterativeCache, UpfrontCache, r_from_T

KV_STRATEGIES: dict[str, type[KVCache]] = {cls.name: cls for cls in (BMCCache, IterativeCache, UpfrontCache)}

__all__ = ["KVCache", "BMCCache", "IterativeCache", "UpfrontCache", "KV_STRATEGIES", "r_from_T"]
