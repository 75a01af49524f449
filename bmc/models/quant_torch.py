"""Quantized weights where the native CPU step does not run (CUDA): a matrix's GGUF blocks held on the device as
their quants (int8, or the Q4 kinds' packed nibbles) with float32 scales per 16 values and offsets per 32
(quant.Values32), and dequantized by torch ops right before each GEMM.

Exactness: d * q is exact in float32 and the offset is added in a separate op (one rounding, as the `gguf`
package's d * q - dm), so the weights a GEMM multiplies by are bit for bit those quant="none" loads; cast to the
model's dtype afterwards, as quant="none" casts them. The GEMM itself is the model dtype's cuBLAS call, so
quant="gguf" on CUDA gives quant="none"'s logits within that GEMM's rounding and its greedy tokens.

What it buys is memory, not speed: a Q8_0 matrix is resident in 1.375 bytes a weight (Q4 kinds 0.75) instead of
4 (float32) or 2, while each GEMM reads those bytes, writes the dequantized matrix and reads it again. Why not
torch's own low-bit GEMMs: `_weight_int4pack_mm` (tinygemm) takes bfloat16 scales and zero points, which cannot
hold GGUF's fp16 scales exactly, and `_weight_int8pack_mm` one scale per output channel, not per 32 values (see
docs/design.md for what they measured on the H100)."""
from __future__ import annotations

import numpy as np
import torch

from .quant import FORMAT_OF, QK, QuantWeight


class TorchQuantWeight:
    """An [out N, in K] quantized matrix on `device`, dequantized per call to `dtype`."""

    def __init__(self, qw: QuantWeight, device: torch.device, dtype: torch.dtype) -> None:
        self.kind, self.shape, self.dtype = qw.kind, qw.shape, dtype
        N, K = qw.shape
        v = qw.decode()
        qw.done()
        self.scales = torch.from_numpy(np.stack([v.d0, v.d1], axis=-1)).to(device)  # [N, K/32, 2]: rows 0-15, 16-31
        self.offsets = torch.from_numpy(np.ascontiguousarray(v.m)).to(device)  # [N, K/32]
        # Q4 kinds keep their nibbles packed (byte j: value j low, j + 16 high); the others int8 values
        self.nibbles = torch.from_numpy(np.ascontiguousarray(v.packed())).to(device) if FORMAT_OF[qw.kind] == "q4" else None
        self.q = None if self.nibbles is not None else torch.from_numpy(np.ascontiguousarray(v.quants())).to(device)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.scales, self.offsets, self.nibbles, self.q) if t is not None]

    def dense(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The [N, K] matrix (or its rows `rows`) in `dtype`: (q * d) + m in float32, then cast."""
        N, K = self.shape
        take = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
        if self.nibbles is not None:
            nib = take(self.nibbles)
            q = torch.cat([nib & 15, nib >> 4], dim=-1)
        else:
            q = take(self.q)
        n = q.shape[0]
        w = q.view(n, K // QK, 2, QK // 2).float() * take(self.scales)[..., None]
        w = w + take(self.offsets)[..., None, None]
        return w.view(n, K).to(self.dtype)
