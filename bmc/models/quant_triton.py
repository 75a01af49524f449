"""Triton kernels on GGUF-style blocks of 32 values (CUDA), for quant_torch.py.

A matrix [N, K] is held as words: its quants re-laid at load within each block of 32 so that a kernel reads them
as int32 words and the activations they multiply as contiguous vectors:
- int8 quants (Q8_0 and the kinds whose values fit 8 bits): 8 words a block, byte i of word j = value 8 i + j;
- 4-bit quants (Q4_0, Q4_1, Q4_K): 4 words a block, nibble i of word j (bits 4 i) = value 4 i + j;
and per block a scale d and an offset m (or none: `shift`), quant_torch.py. Each weight is w = fma(q, d, m) in
float32, bit for bit the float32 weight `gguf` dequantizes.

A quant becomes a float without a conversion instruction: the bits at position s are OR-ed into the mantissa of
2^(23 - s) and that power of two subtracted, exactly. Every operand (words, scales, x) is loaded at the weights'
full tile shape, so in their layout: no shuffles through shared memory. The first version (GGUF's byte order, one
I2F a value, x re-laid through shared memory with four barriers a loop step, by its SASS) was 13 % (Q4_0) and 6 %
(Q8_0) slower on an H100; software pipelining of the loads (`stages` > 1) was 2-3x slower.

- `gemv`: small M (decode). A program reads a strip of BN output rows across K once, 16 bytes a load, for up to
  MB rows of x at once, float32 sums: sum_k x_k w_k.
- `dequantize`: the [N, K] matrix in a 16-bit dtype or float32 (for larger M: dequantize, then cuBLAS).

Block shapes, and which M takes which path: measured on an H100 (bench/gpu_quant.py; docs/performance.md,
"Weight-only int8 / int4 on CUDA")."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant_torch import relayout, values_of  # noqa: F401 (the layout, in torch ops: CPUs hold it too)

QK = 32  # values per block
MAGIC = tl.constexpr(0x4B000000)  # the bits of 2^23 in float32


@triton.jit
def _decode(words, i: tl.constexpr, d, m, NIBBLES: tl.constexpr):
    """Weights of value slot i of every word (nibbles: values 4 i + j; int8: 8 i + j) as float32, fma(q, d, m).
    int8 words come XOR-ed with 0x80808080 (each byte q + 128). A quant at bits s (s + width <= 23) is OR-ed into
    the mantissa of 2^(23 - s), which makes the float 2^(23 - s) + q; higher ones are shifted down first."""
    if NIBBLES:
        SH: tl.constexpr = 4 * i
        if SH <= 16:
            f = ((words & (15 << SH)) | ((150 - SH) << 23)).to(tl.float32, bitcast=True) - (1 << (23 - SH))
        else:
            f = (((words >> SH) & 15) | MAGIC).to(tl.float32, bitcast=True) - 8388608.0
    else:
        SB: tl.constexpr = 8 * i
        if SB <= 8:
            f = ((words & (255 << SB)) | ((150 - SB) << 23)).to(tl.float32, bitcast=True) - ((1 << (23 - SB)) + 128)
        else:
            f = (((words >> SB) & 255) | MAGIC).to(tl.float32, bitcast=True) - (8388608.0 + 128.0)
    return tl.fma(f, d, m)


@triton.jit
def _x(x_ptr, r: tl.constexpr, row0, M, stride_xm, off, mask, EVEN: tl.constexpr):
    """Row row0 + r of x at the offsets `off` (the weights' full tile shape: the weights' layout, no shuffles)."""
    if EVEN:
        return tl.load(x_ptr + (row0 + r) * stride_xm + off).to(tl.float32)
    return tl.load(x_ptr + (row0 + r) * stride_xm + off, mask=mask & (row0 + r < M), other=0).to(tl.float32)


@triton.jit
def _gemv_kernel(x_ptr, q_ptr, d_ptr, m_ptr, y_ptr, M, N, KB, stride_xm, stride_ym, stride_qn,
                 NIBBLES: tl.constexpr, SHIFT: tl.constexpr, HAS_M: tl.constexpr,
                 BN: tl.constexpr, NB: tl.constexpr, MB: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr):
    """y[row0 .. row0 + MB) = x w.T for BN output rows: each slot's weights decoded once for the MB rows of x, one
    float32 accumulator per row (written out to 8: Triton carries no lists of tensors through a loop). EVEN: N a
    multiple of BN, K/32 of NB and M of MB (no masks in the loop)."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    row0 = tl.program_id(1) * MB
    WORDS: tl.constexpr = 4 if NIBBLES else 8  # int32 words a block
    SLOTS: tl.constexpr = 8 if NIBBLES else 4  # values a word
    b = tl.arange(0, NB)
    j = tl.arange(0, WORDS)
    zero = tl.zeros((BN, NB, WORDS), dtype=tl.float32)
    a0 = zero
    if MB > 1:
        a1 = zero
    if MB > 2:
        a2 = zero
    if MB > 3:
        a3 = zero
    if MB > 4:
        a4 = zero
    if MB > 5:
        a5 = zero
    if MB > 6:
        a6 = zero
    if MB > 7:
        a7 = zero
    for k0 in tl.range(0, KB, NB, num_stages=STAGES):  # STAGES > 1: the next steps' loads issued ahead
        blk = k0 + b
        mask = (n < N)[:, None, None] & (blk < KB)[None, :, None] & (j < WORDS)[None, None, :]
        woff = n[:, None, None] * stride_qn + blk[None, :, None] * WORDS + j[None, None, :]
        soff = n[:, None, None] * KB + blk[None, :, None] + 0 * j[None, None, :]  # a block's scale at each word
        xoff = 0 * n[:, None, None] + blk[None, :, None] * 32 + j[None, None, :]
        if EVEN:
            words = tl.load(q_ptr + woff)
            d = tl.load(d_ptr + soff).to(tl.float32)
        else:
            words = tl.load(q_ptr + woff, mask=mask, other=0)
            d = tl.load(d_ptr + soff, mask=mask, other=0).to(tl.float32)
        if HAS_M and EVEN:
            m = tl.load(m_ptr + soff).to(tl.float32)
        elif HAS_M:
            m = tl.load(m_ptr + soff, mask=mask, other=0).to(tl.float32)
        elif SHIFT:
            m = d * (-SHIFT)  # Q4_0: d (q - 8) = fma(q, d, -8 d), exact
        else:
            m = 0.0
        if not NIBBLES:
            words = words ^ -2139062144  # 0x80808080: each byte q + 128, 0-255
        for i in tl.static_range(SLOTS):
            w = _decode(words, i, d, m, NIBBLES)
            off = xoff + i * WORDS
            a0 = tl.fma(_x(x_ptr, 0, row0, M, stride_xm, off, mask, EVEN), w, a0)
            if MB > 1:
                a1 = tl.fma(_x(x_ptr, 1, row0, M, stride_xm, off, mask, EVEN), w, a1)
            if MB > 2:
                a2 = tl.fma(_x(x_ptr, 2, row0, M, stride_xm, off, mask, EVEN), w, a2)
            if MB > 3:
                a3 = tl.fma(_x(x_ptr, 3, row0, M, stride_xm, off, mask, EVEN), w, a3)
            if MB > 4:
                a4 = tl.fma(_x(x_ptr, 4, row0, M, stride_xm, off, mask, EVEN), w, a4)
            if MB > 5:
                a5 = tl.fma(_x(x_ptr, 5, row0, M, stride_xm, off, mask, EVEN), w, a5)
            if MB > 6:
                a6 = tl.fma(_x(x_ptr, 6, row0, M, stride_xm, off, mask, EVEN), w, a6)
            if MB > 7:
                a7 = tl.fma(_x(x_ptr, 7, row0, M, stride_xm, off, mask, EVEN), w, a7)
    _store(y_ptr, a0, 0, row0, M, n, N, stride_ym)
    if MB > 1:
        _store(y_ptr, a1, 1, row0, M, n, N, stride_ym)
    if MB > 2:
        _store(y_ptr, a2, 2, row0, M, n, N, stride_ym)
    if MB > 3:
        _store(y_ptr, a3, 3, row0, M, n, N, stride_ym)
    if MB > 4:
        _store(y_ptr, a4, 4, row0, M, n, N, stride_ym)
    if MB > 5:
        _store(y_ptr, a5, 5, row0, M, n, N, stride_ym)
    if MB > 6:
        _store(y_ptr, a6, 6, row0, M, n, N, stride_ym)
    if MB > 7:
        _store(y_ptr, a7, 7, row0, M, n, N, stride_ym)


@triton.jit
def _store(y_ptr, acc, r: tl.constexpr, row0, M, n, N, stride_ym):
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    tl.store(y_ptr + (row0 + r) * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=(n < N) & (row0 + r < M))


@triton.jit
def _dequantize_kernel(q_ptr, d_ptr, m_ptr, w_ptr, N, KB, stride_qn, stride_wn,
                       NIBBLES: tl.constexpr, SHIFT: tl.constexpr, HAS_M: tl.constexpr,
                       BN: tl.constexpr, NB: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    blk = tl.program_id(1) * NB + tl.arange(0, NB)
    WORDS: tl.constexpr = 4 if NIBBLES else 8
    SLOTS: tl.constexpr = 8 if NIBBLES else 4
    j = tl.arange(0, WORDS)
    mask2 = (n < N)[:, None] & (blk < KB)[None, :]
    words = tl.load(q_ptr + n[:, None, None] * stride_qn + blk[None, :, None] * WORDS + j[None, None, :],
                    mask=mask2[:, :, None], other=0)
    if not NIBBLES:
        words = words ^ -2139062144
    d = tl.load(d_ptr + n[:, None] * KB + blk[None, :], mask=mask2, other=0).to(tl.float32)[:, :, None]
    if HAS_M:
        m = tl.load(m_ptr + n[:, None] * KB + blk[None, :], mask=mask2, other=0).to(tl.float32)[:, :, None]
    else:
        m = d * (-SHIFT)
    out = w_ptr + n[:, None, None] * stride_wn + blk[None, :, None] * 32 + j[None, None, :]
    for i in tl.static_range(SLOTS):
        w = _decode(words, i, d, m, NIBBLES)
        tl.store(out + i * WORDS, w.to(w_ptr.dtype.element_ty), mask=mask2[:, :, None])


def gemv(x: torch.Tensor, words: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, shift: int, nibbles: bool,
         N: int, K: int, out_dtype: torch.dtype | None = None, bn: int = 8, nb: int = 32, warps: int = 2,
         mb: int | None = None, stages: int = 1) -> torch.Tensor:
    """x [M, K] (float32, or 16-bit: widened per weight row, slower) @ w.T for w [N, K] held as words (relayout),
    d [N, K/32] and m [N, K/32] or None (then w = d (q - shift)): float32 sums, out in out_dtype (x's by default).
    mb: rows of x a program takes (default min(M, 8))."""
    M = x.shape[0]
    mb = mb or min(M, 8)
    nb = min(nb, triton.next_power_of_2(K // QK))
    y = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)
    even = N % bn == 0 and (K // QK) % nb == 0 and M % mb == 0
    _gemv_kernel[(triton.cdiv(N, bn), triton.cdiv(M, mb))](
        x, words, d, d if m is None else m, y, M, N, K // QK, x.stride(0), y.stride(0), words.stride(0),
        NIBBLES=nibbles, SHIFT=shift, HAS_M=m is not None, BN=bn, NB=nb, MB=mb, EVEN=even, STAGES=stages,
        num_warps=warps)
    return y


def dequantize(words: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, shift: int, nibbles: bool, N: int,
               K: int, dtype: torch.dtype, bn: int = 16, nb: int = 8, warps: int = 4) -> torch.Tensor:
    """The [N, K] weights in `dtype`: fma(q, d, m) in float32, then cast (quant="none"'s weights, cast alike)."""
    w = torch.empty((N, K), dtype=dtype, device=words.device)
    KB = K // QK
    _dequantize_kernel[(triton.cdiv(N, bn), triton.cdiv(KB, nb))](
        words, d, d if m is None else m, w, N, KB, words.stride(0), w.stride(0), NIBBLES=nibbles, SHIFT=shift,
        HAS_M=m is not None, BN=bn, NB=nb, num_warps=warps)
    return w
