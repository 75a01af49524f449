"""One layer's KV update + attention on the kernel the runtime runs here, for the T sweeps (bench/sweep_T.py,
bench/spec.py's Table I): the native CPU step's attention on a CPU in float32, PyTorch's SDPA elsewhere."""
from __future__ import annotations

from typing import Callable

import torch

from ..analytic.profile import attention_kernel
from ..attention import dense_attention, group_bias
from ..kernels.native import native_attention
from ..kv import KVCache

Attend = Callable[[int], None]  # attend(t): t query rows over the cache as it is now (keys already written)


def layer_attention(cache: KVCache, heads: int, max_t: int = 1) -> Attend:
    """attend(t) for a one-layer cache; queries are random (the values do not change the time)."""
    batch, kvh, d = cache.kv.shape[2], cache.kv.shape[3], cache.kv.shape[5]
    scale = d**-0.5
    if attention_kernel(cache.device, cache.dtype) == "native-cpu":
        dec = native_attention(heads, kvh, d)
        qn = torch.randn(batch, max_t, heads * d, dtype=cache.dtype)

        def native(t: int) -> None:  # reads cache.kv / bias at call time: the cache reallocates as it grows
            dec.attention_step(qn[:, :t], cache.kv, 0, cache.attention_bias(t), [], [], [])
        return native
    q = torch.randn(batch, heads, max_t, d, dtype=cache.dtype, device=cache.device)

    def sdpa(t: int) -> None:
        bias = group_bias(cache.attention_bias(t), heads // kvh)
        dense_attention(q[:, :, :t], cache.kv[0, 0], cache.kv[0, 1], bias, scale)
    return sdpa
