"""Quantized weights where the native CPU step does not run (CUDA; a CPU in bfloat16 or with BMC_NATIVE=0): a
matrix's GGUF blocks held on the device as their quants (int8, or the Q4 kinds' packed nibbles) with float32
scales per 16 values and offsets per 32 (quant.Values32), dequantized by torch ops right before each GEMM; and, for
Q4 kinds in bfloat16 on CUDA, torch's int4 GEMM (tinygemm) reading the nibbles as they are.

Exactness of the dequantizing path: d * q is exact in float32 and the offset is added in a separate op (one
rounding, as the `gguf` package's d * q - dm), so the weights a GEMM multiplies by are bit for bit those
quant="none" loads; cast to the model's dtype afterwards, as quant="none" casts them. The GEMM is the model dtype's
cuBLAS call, so quant="gguf" gives quant="none"'s logits within that GEMM's rounding and its greedy tokens. It
saves the weights' memory, not time: each GEMM reads the quants, writes the dequantized matrix and reads it again
(slower than float32 on an H100: docs/performance.md, "Figures behind the code's choices").

The int4 path (`_weight_int4pack_mm`, Q4_0 / Q4_1 / Q4_K in bfloat16 on CUDA): tinygemm computes
w = (q - 8) * s + z with s and z in bfloat16, so a block's fp16 scale d and offset m + 8 d are rounded to bfloat16
(relative error <= 2^-9 each): every weight is within 2^-9 (|d| |q - 8| + |m + 8 d|) + its own bfloat16 rounding of
the exact value, the same order as quant="none"'s bfloat16 cast of it (2^-9 |w|). A stated bound, not quant="none"'s
weights: tests hold the logits to bfloat16's tolerance of quant="none"'s. At M = 1 its GEMMs beat cuBLAS bfloat16's
and the dequantizing path's (figures: docs/performance.md).
torch's `_weight_int8pack_mm` takes one scale per output channel, not per 32 values: GGUF's Q8_0 cannot use it."""
from __future__ import annotations

import numpy as np
import torch

from ..errors import InvalidRequestError
from .quant import QK, QuantWeight, block_kind_of

INT4_GROUP = 32  # values per tinygemm scale and zero point: GGUF's blocks


def int4pack_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch.ops.aten, "_weight_int4pack_mm")


class TorchQuantWeight:
    """An [out N, in K] quantized matrix on `device`, dequantized per call to `dtype` (or multiplied by tinygemm)."""

    def __init__(self, qw: QuantWeight, device: torch.device, dtype: torch.dtype) -> None:
        self.kind, self.shape, self.dtype = qw.kind, qw.shape, dtype
        v = qw.decode()
        qw.done()
        self.scales = torch.from_numpy(np.stack([v.d0, v.d1], axis=-1)).to(device)  # [N, K/32, 2]: rows 0-15, 16-31
        self.offsets = torch.from_numpy(np.ascontiguousarray(v.m)).to(device)  # [N, K/32]
        # Q4 kinds keep their nibbles packed (byte j: value j low, j + 16 high); the others int8 values
        q4 = block_kind_of(qw.kind).nibbles
        self.nibbles = torch.from_numpy(np.ascontiguousarray(v.packed())).to(device) if q4 else None
        self.q = None if q4 else torch.from_numpy(np.ascontiguousarray(v.quants())).to(device)
        self.int4: tuple[torch.Tensor, torch.Tensor] | None = None
        if q4 and int4pack_available(device, dtype) and qw.shape[0] % 8 == 0:  # tinygemm tiles 8 output rows
            self.int4 = _int4pack(v.quants(), v.d0, v.m, device)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.scales, self.offsets, self.nibbles, self.q, *(self.int4 or ())) if t is not None]

    def gemm_only(self) -> None:
        """Drop what only dense() and row lookups read, where the int4 GEMM holds the matrix (not a tied
        embedding's table): half the bytes."""
        if self.int4 is not None:
            self.scales = self.offsets = self.nibbles = None  # type: ignore[assignment]

    def linear(self, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        if self.int4 is None:
            return torch.nn.functional.linear(x, self.dense(), b)
        packed, scales_zeros = self.int4
        y = torch.ops.aten._weight_int4pack_mm(x.reshape(-1, self.shape[1]).to(torch.bfloat16).contiguous(), packed,
                                               INT4_GROUP, scales_zeros)
        y = y.view(*x.shape[:-1], self.shape[0])
        return y + b if b is not None else y

    def dense(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The [N, K] matrix (or its rows `rows`) in `dtype`: (q * d) + m in float32, then cast."""
        if self.scales is None:
            raise InvalidRequestError(
                f"this {self.kind} matrix is held only in torch's int4 GEMM layout (quantized weights in bfloat16 on "
                "CUDA), which cannot be read back: a draft derived from the model's weights (int8-self, layer-"
                "truncated) needs quant='none' or float32")
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


def _int4pack(q: np.ndarray, d: np.ndarray, m: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """tinygemm's layout of Q4 values q (0-15, [N, K/32, 32]) with w = d q + m = (q - 8) d + (m + 8 d): the int4
    tiles (`_convert_weight_to_int4pack`, the largest inner k-tiling this K allows) and scales_and_zeros
    [K/32, N, 2] in bfloat16."""
    N = q.shape[0]
    flat = torch.from_numpy(q.reshape(N, -1).astype(np.int32))
    pairs = (flat[:, ::2] << 4 | flat[:, 1::2]).to(torch.uint8).to(device)  # two values a byte, the first high
    packed = None
    for inner in (8, 4, 2):
        try:
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs, inner)
            break
        except RuntimeError:
            if inner == 2:
                raise
    sd, zero = torch.from_numpy(d), torch.from_numpy(m + 8.0 * d)  # [N, K/32] float32 (Q4_0: zero 0 exactly)
    scales_zeros = torch.stack([sd, zero], dim=-1).transpose(0, 1).contiguous().to(device, torch.bfloat16)
    return packed, scales_zeros
