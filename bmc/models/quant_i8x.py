"""activations="int8" on CUDA: a GEMM's rows of x rounded to int8 per block of 32 and multiplied by a matrix's
quants with integer dot products (`dp4a`), for quant_torch.py (issue 48; measured in docs/performance.md, "Q4_0
with int8 activations on the H200" and "`--activations int8` on CUDA: whole decode steps").

The arithmetic is the CPU mode's (kernels/cpu/vnni.h): per row and block of 32, dx = max|x| / 127 and
qx = rint(x * (127 / max|x|)) (float32, to the bit as the CPU's quantize_rows rounds them), sx = dx sum qx, and
per block of a weight row y += d (dx S) + m sx, S = sum q qx the integer sum (Q4_0: m = -8 d; Q8_0: m = 0). So per
output |y - exact| <= sum_k |w_k| dx / 2 plus float32 rounding: the CPU mode's stated bound (tests/test_gpu.py).

Why it pays: the float GEMV (quant_triton.py) makes each weight an exact float32, ~7.5 instructions a weight in
SASS, and so runs at 55-60 % of its instruction ceiling, far from the bytes'; here two dp4a take a Q4 word's 8
weights (~1.3 instructions a weight).

x's quants are laid out per block in the words' order once a call (`quantize_x`): word 4 h + j of a block holds
values 8 t + 4 h + j in its bytes t = 0..3. A Q4 word j (nibble i = value 4 i + j) gives values 8 t + j in
`w & 0x0F0F0F0F` (x's word j) and 8 t + 4 + j in `(w >> 4) & 0x0F0F0F0F` (x's word 4 + j); a Q8 word j (byte i =
value 8 i + j) meets x's word j.

Every row of x runs the same program code with the same block shape, whatever M is, so a row's output does not
depend on the rows beside it (a served request gets its alone run's bits); the programs of one weight strip are
adjacent in the launch order, so rows past the first read it from L2."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import gdc
from .gdc import wait_and_release

QK = 32
# block shape, measured over the Llama-2-7B shapes at M = 1 on an H200 (bench/gpu_i8x.py --bmc 1): 2 weight rows a
# program, 1 warp, up to 32 blocks a loop step for Q4 words and 64 for int8 ones (the best sum over a step's GEMMs)
BN = 2
NB_MAX = {True: 32, False: 64}  # by nibbles
WARPS = 1


@triton.jit
def quantize_blocks(x, ASM: tl.constexpr):
    """x [NB, 4, 8] float32 (value 8 t + w of each block at [b, t, w]) -> (words [NB, 8] int32 in the GEMV's order,
    dx [NB], sx [NB]): the module's rounding, for quantize_x and the decode step's glue kernels (fused_triton.py)."""
    t = tl.arange(0, 4)
    amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)
    c127 = tl.full(amax.shape, 127.0, tl.float32)
    d = tl.math.div_rn(amax, c127)  # IEEE division, as the CPU's (Triton's `/` is approximate)
    inv = tl.where(amax > 0, tl.math.div_rn(c127, tl.where(amax > 0, amax, c127)), 0.0)
    p = x * inv[:, None, None]
    if ASM:  # to nearest, ties to even (the CPU's cvtps_epi32)
        q = tl.inline_asm_elementwise("cvt.rni.s32.f32 $0, $1;", "=r,f", [p], dtype=tl.int32, is_pure=True, pack=1)
    else:  # the interpreter: 1.5 * 2^23 added and taken away rounds |p| < 2^22 to nearest even (no FMA here)
        q = ((p + 12582912.0) - 12582912.0).to(tl.int32)
    words = tl.sum((q & 255) << (8 * t)[None, :, None], axis=1)  # disjoint bytes: the sum is their OR
    return words, d, d * tl.sum(tl.sum(q, axis=2), axis=1).to(tl.float32)


@triton.jit
def store_blocks(xw_ptr, dx_ptr, sx_ptr, m, blk, KB, words, d, sx):
    """Row m's blocks blk (those below KB) of quantize_blocks' output, where the GEMV reads them."""
    w = tl.arange(0, 8)
    ok = blk < KB
    tl.store(xw_ptr + m * KB * 8 + blk[:, None] * 8 + w[None, :], words, mask=ok[:, None] & (w < 8)[None, :])
    tl.store(dx_ptr + m * KB + blk, d, mask=ok)
    tl.store(sx_ptr + m * KB + blk, sx, mask=ok)


@triton.jit
def _quantize_x_kernel(x_ptr, xw_ptr, dx_ptr, sx_ptr, KB, stride_xm, NB: tl.constexpr, ASM: tl.constexpr,
                       GDC: tl.constexpr):
    """Row program_id(0) of x, NB blocks from program_id(1) * NB."""
    wait_and_release(GDC)
    m = tl.program_id(0)
    blk = tl.program_id(1) * NB + tl.arange(0, NB)
    t = tl.arange(0, 4)
    w = tl.arange(0, 8)
    ok = (blk < KB)[:, None, None] & (t < 4)[None, :, None] & (w < 8)[None, None, :]
    x = tl.load(x_ptr + m * stride_xm + blk[:, None, None] * 32 + t[None, :, None] * 8 + w[None, None, :], mask=ok,
                other=0.0).to(tl.float32)
    words, d, sx = quantize_blocks(x, ASM)
    store_blocks(xw_ptr, dx_ptr, sx_ptr, m, blk, KB, words, d, sx)


@triton.jit
def _dp4a(a, b, c, SIGNED: tl.constexpr, ASM: tl.constexpr):
    """c + the sum over the 4 bytes of a (unsigned, or signed where SIGNED) times b's (signed)."""
    if ASM:
        if SIGNED:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    for i in tl.static_range(4):  # Triton's interpreter has no inline asm
        ab = (a >> (8 * i)) & 255
        if SIGNED:
            ab = ab - ((ab >> 7) << 8)
        bb = (b >> (8 * i)) & 255
        c = c + ab * (bb - ((bb >> 7) << 8))
    return c


@triton.jit
def _row(acc, xw_ptr, dx_ptr, sx_ptr, words, d, m, row, M, KB, n, blk, j,
         NIBBLES: tl.constexpr, SHIFT: tl.constexpr, HAS_M: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr):
    """One row of x against a loop step's words: acc [BN, NB] += d (dx S) + m sx, per block. Rows past M and
    blocks past KB read zeros (S = dx = sx = 0)."""
    if EVEN:
        live = row < M
        live3 = live
    else:
        live = (row < M) & (blk < KB)[None, :]  # [1, NB], for the [BN, NB] loads
        live3 = live[:, :, None]  # for the words' [BN, NB, WORDS]
    xoff = row * KB * 8 + 0 * n[:, None, None] + blk[None, :, None] * 8 + j[None, None, :]
    soff = row * KB + 0 * n[:, None] + blk[None, :]
    if NIBBLES:
        s = _dp4a(words & 0x0F0F0F0F, tl.load(xw_ptr + xoff, mask=live3, other=0), tl.zeros_like(words), False, ASM)
        s = _dp4a((words >> 4) & 0x0F0F0F0F, tl.load(xw_ptr + xoff + 4, mask=live3, other=0), s, False, ASM)
    else:
        s = _dp4a(words, tl.load(xw_ptr + xoff, mask=live3, other=0), tl.zeros_like(words), True, ASM)
    S = tl.sum(s, axis=2).to(tl.float32)
    dx = tl.load(dx_ptr + soff, mask=live, other=0.0)
    if SHIFT:
        return tl.fma(d, tl.fma(dx, S, -SHIFT * tl.load(sx_ptr + soff, mask=live, other=0.0)), acc)
    if HAS_M:
        return tl.fma(d, dx * S, tl.fma(m, tl.load(sx_ptr + soff, mask=live, other=0.0), acc))
    return tl.fma(d, dx * S, acc)


@triton.jit
def _store(y_ptr, acc, row, M, n, N, stride_ym):
    tl.store(y_ptr + row * stride_ym + n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=(n < N) & (row < M))


@triton.jit
def _gemv_i8x_kernel(xw_ptr, dx_ptr, sx_ptr, q_ptr, d_ptr, m_ptr, y_ptr, M, N, KB, stride_qn, stride_ym,
                     NIBBLES: tl.constexpr, SHIFT: tl.constexpr, HAS_M: tl.constexpr, BN: tl.constexpr,
                     NB: tl.constexpr, MB: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr,
                     GDC: tl.constexpr):
    """y[row0 .. row0 + MB) for BN weight rows, NB blocks a loop step (EVEN: NB divides KB, no masks). One
    [BN, NB] float32 accumulator per row of x (written out to 8: Triton carries no lists of tensors through a
    loop), each updated by the same code."""
    row_blocks = tl.cdiv(M, MB)  # one grid axis, the row blocks fastest (the y axis stops at 65535 programs)
    row0 = (tl.program_id(0) % row_blocks) * MB
    n = (tl.program_id(0) // row_blocks) * BN + tl.arange(0, BN)
    nl = tl.minimum(n, N - 1)  # rows past N read the last one's (their outputs are not stored)
    b = tl.arange(0, NB)
    WORDS: tl.constexpr = 4 if NIBBLES else 8
    wait_and_release(GDC)
    j = tl.arange(0, WORDS)
    zero = tl.zeros((BN, NB), dtype=tl.float32)
    a0 = zero
    if MB > 1:
        a1 = zero
    if MB > 2:
        a2 = zero
        a3 = zero
    if MB > 4:
        a4 = zero
        a5 = zero
        a6 = zero
        a7 = zero
    for k0 in range(0, KB, NB):
        blk = k0 + b
        woff = nl[:, None, None] * stride_qn + blk[None, :, None] * WORDS + j[None, None, :]
        soff = nl[:, None] * KB + blk[None, :]
        if EVEN:
            words = tl.load(q_ptr + woff)
            d = tl.load(d_ptr + soff).to(tl.float32)
        else:
            kin = (blk < KB)[None, :]
            words = tl.load(q_ptr + woff, mask=kin[:, :, None], other=0)
            d = tl.load(d_ptr + soff, mask=kin, other=0).to(tl.float32)
        if HAS_M and EVEN:
            m = tl.load(m_ptr + soff).to(tl.float32)
        elif HAS_M:
            m = tl.load(m_ptr + soff, mask=kin, other=0).to(tl.float32)
        else:
            m = d
        a0 = _row(a0, xw_ptr, dx_ptr, sx_ptr, words, d, m, row0, M, KB, nl, blk, j, NIBBLES, SHIFT, HAS_M, EVEN,
                  ASM)
        if MB > 1:
            a1 = _row(a1, xw_ptr, dx_ptr, sx_ptr, words, d, m, row0 + 1, M, KB, nl, blk, j, NIBBLES, SHIFT, HAS_M,
                      EVEN, ASM)
        if MB > 2:
            a2 = _row(a2, xw_ptr, dx_ptr, sx_ptr, words, d, m, row0 + 2, M, KB, nl, blk, j, NIBBLES, SHIFT, HAS_M,
                      EVEN, ASM)
            a3 = _row(a3, xw_ptr, dx_ptr, sx_ptr, words, d, m, row0 + 3, M, KB, nl, blk, j, NIBBLES, SHIFT, HAS_M,
                      EVEN, ASM)
        if MB > 4:
            a4 = _row(a4, xw_ptr, dx_ptr, sx_ptr, words, d, m, row0 + 4, M, KB, nl, blk, j, NIBBLES, SHIFT, HAS_M,
                      EVEN, ASM)
            a5 = _row(a5, xw_ptr, dx_ptr, sx_ptr, words, d, m, row0 + 5, M, KB, nl, blk, j, NIBBLES, SHIFT, HAS_M,
                      EVEN, ASM)
            a6 = _row(a6, xw_ptr, dx_ptr, sx_ptr, words, d, m, row0 + 6, M, KB, nl, blk, j, NIBBLES, SHIFT, HAS_M,
                      EVEN, ASM)
            a7 = _row(a7, xw_ptr, dx_ptr, sx_ptr, words, d, m, row0 + 7, M, KB, nl, blk, j, NIBBLES, SHIFT, HAS_M,
                      EVEN, ASM)
    _store(y_ptr, a0, row0, M, n, N, stride_ym)
    if MB > 1:
        _store(y_ptr, a1, row0 + 1, M, n, N, stride_ym)
    if MB > 2:
        _store(y_ptr, a2, row0 + 2, M, n, N, stride_ym)
        _store(y_ptr, a3, row0 + 3, M, n, N, stride_ym)
    if MB > 4:
        _store(y_ptr, a4, row0 + 4, M, n, N, stride_ym)
        _store(y_ptr, a5, row0 + 5, M, n, N, stride_ym)
        _store(y_ptr, a6, row0 + 6, M, n, N, stride_ym)
        _store(y_ptr, a7, row0 + 7, M, n, N, stride_ym)


# inline PTX (dp4a, cvt.rni), or its emulation under Triton's interpreter (a CPU check of the indexing), which Triton
# itself chooses at import
ASM = os.environ.get("TRITON_INTERPRET") != "1"


Int8Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # x's words [M, K/4] int32, dx and sx [M, K/32] float32


def empty_rows(M: int, K: int, device: torch.device) -> Int8Rows:
    KB = K // QK
    return (torch.empty((M, KB * 8), dtype=torch.int32, device=device),
            torch.empty((M, KB), dtype=torch.float32, device=device),
            torch.empty((M, KB), dtype=torch.float32, device=device))


def quantize_x(x: torch.Tensor) -> Int8Rows:
    """x [M, K] (any float dtype, K a multiple of 32) rounded per block of 32 (the module's docstring)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    KB = K // QK
    xw, dx, sx = empty_rows(M, K, x.device)
    nb = min(16, triton.next_power_of_2(KB))
    on, kw = gdc.launch(x.device)
    _quantize_x_kernel[(M, triton.cdiv(KB, nb))](x, xw, dx, sx, KB, x.stride(0), NB=nb, ASM=ASM, GDC=on,
                                                 num_warps=1, **kw)
    return xw, dx, sx


def blocks_a_step(KB: int, nibbles: bool) -> int:
    """NB_MAX, or the power of two at or above KB below it (a tail masked where NB does not divide KB: the down
    projection's K / 32 = 344 of a 7B shape took 8 blocks a step unmasked, its loads too small to stream)."""
    return min(NB_MAX[nibbles], triton.next_power_of_2(KB))


def gemv_i8x(rows: Int8Rows, words: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, shift: int,
             nibbles: bool, N: int, K: int, out_dtype: torch.dtype) -> torch.Tensor:
    """x~ [M, K] @ w.T for x's rows rounded to int8 per block of 32 (quantize_x, or a glue kernel), w [N, K] held as
    quant_torch's words with d [N, K/32] and m [N, K/32] or None (then w = d (q - shift)): y [M, N] in out_dtype."""
    xw, dx, sx = rows
    M = xw.shape[0]
    y = torch.empty((M, N), dtype=out_dtype, device=xw.device)
    mb = 1 if M == 1 else 2 if M == 2 else 4 if M <= 4 else 8
    nb = blocks_a_step(K // QK, nibbles)
    on, kw = gdc.launch(xw.device)
    _gemv_i8x_kernel[(triton.cdiv(M, mb) * triton.cdiv(N, BN),)](
        xw, dx, sx, words, d, d if m is None else m, y, M, N, K // QK, words.stride(0), y.stride(0),
        NIBBLES=nibbles, SHIFT=shift, HAS_M=m is not None, BN=BN, NB=nb, MB=mb, EVEN=(K // QK) % nb == 0,
        ASM=ASM, GDC=on, num_warps=WARPS, **kw)
    return y
