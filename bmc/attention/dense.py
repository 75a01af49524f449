"""Dense attention over the cache's full capacity with an additive bias, GQA/MQA without repeated KV heads.

The G query heads that share a KV head are folded into the query-row axis ([B, H_kv, G*t, d]), so every KV
head is read once by one matrix product instead of being copied G times (what repeat_kv does in HF)."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# cuDNN's attention on CUDA is not deterministic run to run (bf16, batch 32 on an H200: every row of two runs of
# the same prompts parted within 2-7 tokens; without cuDNN none did; docs/performance.md, "Run to run"), so it
# is left out unless BMC_CUDA_SDPA=cudnn asks for it
CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
CUDNN_FIRST = os.environ.get("BMC_CUDA_SDPA") == "cudnn"


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """F.scaled_dot_product_attention, on CUDA restricted to the backends that give the same bits every run (a
    backend left out of the list is switched off for the call; torch's own order among the rest)."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, **kw)
    if CUDNN_FIRST:  # set_priority: torch >= 2.6
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION] + CUDA_BACKENDS, set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, **kw)
    with sdpa_kernel(CUDA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, **kw)


def group_bias(bias: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, 1, t, S] -> [B, 1, G*t, S] matching the folded query rows (row g*t + i is query i of head g).
    A single-query bias broadcasts as it is. Call once per forward, not per layer."""
    if groups == 1 or bias.shape[2] == 1:
        return bias
    return bias.repeat(1, 1, groups, 1)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float, layer: int = 0
) -> torch.Tensor:
    """q [B, H, t, d]; k, v [B, H_kv, S, d]; bias from group_bias(). Returns [B, H, t, d]."""
    B, H, t, d = q.shape
    kv_heads = k.shape[1]
    qg = q.reshape(B, kv_heads, (H // kv_heads) * t, d)
    out = sdpa(qg, k, v, attn_mask=bias, scale=scale)
    return out.reshape(B, H, t, d)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float, layer: int = 0
) -> torch.Tensor:
    """dense_attention for a prefill into an empty cache with no left padding, where the bias is exactly causal
    over the t new columns and masks every later one: SDPA runs on those t keys with is_causal instead, so it skips
    the blocks above the diagonal (half the FLOPs) and reads no [G*t, capacity] mask. `bias` is not read. Same
    values (bitwise, on the CPU flash kernel, for SmolLM2's shapes), in about half the time on a CPU and less on
    an H100 (docs/performance.md, "Figures behind the code's choices")."""
    t, groups = q.shape[2], q.shape[1] // k.shape[1]
    k, v = k[:, :, :t], v[:, :, :t]
    if groups > 1 and q.is_cuda and q.dtype == torch.float32:
        # CUDA's flash kernel takes no float32 and its memory-efficient one no GQA, so enable_gqa would run the
        # math path (1.7x slower than the mask on an H100); repeating the t new KV rows is cheap beside it
        k, v, groups = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), 1
    return sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=groups > 1)


def softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float, cap: float
) -> torch.Tensor:
    """dense_attention with Gemma 2's soft-capped scores, cap * tanh(q.k * scale / cap), before the bias: in the
    order HF's eager attention computes them (SDPA has no soft-cap). bias from group_bias()."""
    B, H, t, d = q.shape
    kv_heads = k.shape[1]
    qg = q.reshape(B, kv_heads, (H // kv_heads) * t, d)
    scores = torch.matmul(qg, k.transpose(2, 3)) * scale
    scores = torch.tanh(scores / cap) * cap + bias
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v).reshape(B, H, t, d)
