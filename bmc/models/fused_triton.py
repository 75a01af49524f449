"""Triton kernels for the CUDA decode step's glue between GEMMs (decode_cuda.py): a graphed batch-1 step of a
Llama-7B shape ran ~1050 kernels, ~33 a layer, of which 28 were norms, RoPE, the KV write, residual adds, SiLU and
copies of 1-2 µs each (docs/performance.md, "Batch-1 decode step on CUDA"). These make them 3 a layer.

- `add_rms_norm`: x + r (the residual, stored) and RMSNorm of the sum, one program a row.
- `rope_write`: the QKV GEMM's output rotated (queries and keys), queries out, keys and values into the cache at
  the step's column (a device index under a CUDA graph).
- `silu_mul`: silu(gate) * up of the gate|up GEMM's output.

Every elementwise step rounds where the torch ops round (bf16 / fp16 results of each op), with no FMA contraction
(`enable_fp_fusion=False`), silu's exp and division IEEE as torch's: RoPE, the KV write, the residual add and
silu_mul are bit for bit the torch path's. The norm's sum of squares is a tree sum in another order than torch's
mean: its bound is in `add_rms_norm` (tests/test_gpu.py holds both)."""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import gdc
from .gdc import wait_and_release
from .quant_i8x import ASM, Int8Rows, empty_rows, quantize_blocks, store_blocks


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, D, stride_x, stride_r, stride_y, stride_s, eps,
                         xw_ptr, dx_ptr, sx_ptr, HAS_R: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr,
                         QUANT: tl.constexpr, ASM: tl.constexpr, GDC: tl.constexpr):
    wait_and_release(GDC)
    row = tl.program_id(0)
    off = tl.arange(0, BLOCK)
    mask = off < D
    x = tl.load(x_ptr + row * stride_x + off, mask=mask, other=0)
    if HAS_R:  # the residual add, rounded to the model's dtype as torch's add is, and stored
        x = (x.to(tl.float32) + tl.load(r_ptr + row * stride_r + off, mask=mask, other=0).to(tl.float32)).to(x.dtype)
        tl.store(s_ptr + row * stride_s + off, x, mask=mask)
    h = x.to(tl.float32)
    inv = libdevice.rsqrt(tl.sum(h * h, axis=0) / D + eps)
    w = tl.load(w_ptr + off, mask=mask, other=0).to(tl.float32)
    if ROUND:  # 16-bit: weight * (x_hat rounded to the dtype), as rms_norm's 16-bit path
        y = w * (h * inv).to(x.dtype).to(tl.float32)
    else:
        y = h * inv * w
    y = y.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + off, y, mask=mask)
    if QUANT:  # y as the next GEMM's int8 rows (activations="int8"), from the values stored
        words, d, sx = quantize_blocks(tl.reshape(y.to(tl.float32), (BLOCK // 32, 4, 8)), ASM)
        store_blocks(xw_ptr, dx_ptr, sx_ptr, row, tl.arange(0, BLOCK // 32), D // 32, words, d, sx)


def add_rms_norm(x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s, w, eps)) with s = x + r (x itself where r is None): [..., D], any leading shape.

    Bound: s is torch's x + r bit for bit; the norm sums the squares in float32 in another order than torch's
    mean, so its 1/rms differs by a few float32 ulps, and y by at most one rounding of the dtype (16-bit) or a
    relative 2^-20 (float32) from ops.rms_norm's."""
    s, y, _ = _add_rms_norm(x, r, w, eps, False)
    return s, y


def add_rms_norm_int8(x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, Int8Rows]:
    """add_rms_norm, and its output's rows rounded to int8 blocks as quant_i8x.quantize_x rounds them (bit for
    bit): one kernel instead of two before an int8-activation GEMM."""
    s, y, rows = _add_rms_norm(x, r, w, eps, True)
    assert rows is not None
    return s, y, rows


def _add_rms_norm(x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, eps: float,
                  quant: bool) -> tuple[torch.Tensor, torch.Tensor, Int8Rows | None]:
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    rows = x2.shape[0]
    s2 = x2
    r2 = x2
    if r is not None:
        r2 = r.reshape(-1, D)
        s2 = torch.empty_like(x2)
    y2 = torch.empty_like(x2)
    block = triton.next_power_of_2(D)
    q = empty_rows(rows, D, x.device) if quant else (y2, y2, y2)
    on, kw = gdc.launch(x.device)
    _add_rms_norm_kernel[(rows,)](x2, r2, w, y2, s2, D, x2.stride(0), r2.stride(0), y2.stride(0), s2.stride(0), eps,
                                  *q, HAS_R=r is not None, ROUND=x.dtype != torch.float32, BLOCK=block, QUANT=quant,
                                  ASM=ASM, GDC=on, num_warps=min(16, max(4, block // 512)), **kw)
    return s2.view(x.shape), y2.view(x.shape), q if quant else None


@triton.jit(do_not_specialize=["col"])
def _rope_write_kernel(a_ptr, cos_ptr, sin_ptr, q_ptr, kv_ptr, col_ptr, col, stride_a, stride_cs,
                       s_kv, s_row, s_head, s_col, H, KVH,
                       HD: tl.constexpr, BD: tl.constexpr, HB: tl.constexpr, COL_PTR: tl.constexpr,
                       GDC: tl.constexpr):
    """Program (row, group of HB heads) of [q heads | k heads | v heads]: q and k rotated as
    x*cos + roll(x, HD/2)*sin_signed (each product and the sum rounded to the dtype, as apply_rope), q stored
    [B, H, 1, HD], k and v stored in the cache at the column. BD: HD rounded up to a power of two."""
    wait_and_release(GDC)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * HB + tl.arange(0, HB)[:, None]  # [HB, 1]
    d = tl.arange(0, BD)[None, :]  # [1, BD]
    dmask = d < HD
    hmask = (head < H + 2 * KVH) & dmask
    x = tl.load(a_ptr + row * stride_a + head * HD + d, mask=hmask, other=0)
    xr = tl.load(a_ptr + row * stride_a + head * HD + (d + HD // 2) % HD, mask=hmask, other=0)
    c = tl.load(cos_ptr + row * stride_cs + d, mask=dmask, other=0).to(tl.float32)
    s = tl.load(sin_ptr + row * stride_cs + d, mask=dmask, other=0).to(tl.float32)
    t1 = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
    t2 = (xr.to(tl.float32) * s).to(x.dtype).to(tl.float32)
    rot = (t1 + t2).to(x.dtype)
    tl.store(q_ptr + (row * H + head) * HD + d, rot, mask=(head < H) & dmask)
    if COL_PTR:
        c0 = tl.load(col_ptr).to(tl.int64)
    else:
        c0 = col.to(tl.int64)
    is_k = head < H + KVH
    kvh = tl.where(is_k, head - H, head - H - KVH).to(tl.int64)
    dst = kv_ptr + tl.where(is_k, 0, s_kv) + row * s_row + kvh * s_head + c0 * s_col + d
    tl.store(dst, tl.where(is_k, rot, x), mask=hmask & (head >= H))


def rope_write(a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, heads: int, kv_heads: int,
               col: int | torch.Tensor) -> torch.Tensor:
    """a [B, 1, (H + 2 H_kv) * hd] (one token a row: decode); cos, sin [B, 1, 1, hd] (rope_tables'); kv: one
    layer's cache [2, B, H_kv, capacity, hd] in a's dtype (any strides, the last 1); col: the column to write, an int
    or a device tensor of one element (read by the kernel: a CUDA graph replays it). Returns q [B, H, 1, hd]."""
    B = a.shape[0]
    hd = kv.shape[-1]
    assert a.shape[1] == 1 and a.stride(-1) == 1 and kv.stride(-1) == 1 and cos.stride(-1) == 1
    a2 = a.reshape(B, -1)
    cs = cos.reshape(B, hd)
    ss = sin.reshape(B, hd)
    assert cs.stride(0) == ss.stride(0)
    q = torch.empty(B, heads, 1, hd, dtype=a.dtype, device=a.device)
    hb = 4
    on_device = isinstance(col, torch.Tensor)
    on, kw = gdc.launch(a.device)
    _rope_write_kernel[(B, triton.cdiv(heads + 2 * kv_heads, hb))](
        a2, cs, ss, q, kv, col if on_device else q, 0 if on_device else col, a2.stride(0), cs.stride(0),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), heads, kv_heads,
        HD=hd, BD=triton.next_power_of_2(hd), HB=hb, COL_PTR=on_device, GDC=on, num_warps=2,
        enable_fp_fusion=False, **kw)
    return q


@triton.jit
def _silu_mul_kernel(gu_ptr, y_ptr, I, stride_gu, stride_y, xw_ptr, dx_ptr, sx_ptr, BLOCK: tl.constexpr,
                     QUANT: tl.constexpr, ASM: tl.constexpr, GDC: tl.constexpr):
    wait_and_release(GDC)
    row = tl.program_id(0)
    off = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = off < I
    g = tl.load(gu_ptr + row * stride_gu + off, mask=mask, other=0)
    u = tl.load(gu_ptr + row * stride_gu + I + off, mask=mask, other=0).to(tl.float32)
    gf = g.to(tl.float32)
    act = libdevice.div_rn(gf, 1.0 + libdevice.exp(-gf)).to(g.dtype).to(tl.float32)  # torch's silu, rounded
    y = (act * u).to(g.dtype)
    if QUANT:  # only the int8 rows the down GEMM reads (BLOCK a multiple of 32, and I: whole blocks a program)
        words, d, sx = quantize_blocks(tl.reshape(y.to(tl.float32), (BLOCK // 32, 4, 8)), ASM)
        store_blocks(xw_ptr, dx_ptr, sx_ptr, row, tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32),
                     I // 32, words, d, sx)
    else:
        tl.store(y_ptr + row * stride_y + off, y, mask=mask)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gu = [gate | up] ([..., 2 I]): [..., I], bit for bit F.silu(gate) * up."""
    I = gu.shape[-1] // 2
    g2 = gu.reshape(-1, 2 * I)
    rows = g2.shape[0]
    y = torch.empty(rows, I, dtype=gu.dtype, device=gu.device)
    block = 1024
    on, kw = gdc.launch(gu.device)
    _silu_mul_kernel[(rows, triton.cdiv(I, block))](g2, y, I, g2.stride(0), y.stride(0), y, y, y, BLOCK=block,
                                                    QUANT=False, ASM=ASM, GDC=on, num_warps=4,
                                                    enable_fp_fusion=False, **kw)
    return y.view(*gu.shape[:-1], I)


def silu_mul_int8(gu: torch.Tensor) -> Int8Rows:
    """silu_mul(gu)'s rows rounded to int8 blocks, bit for bit quant_i8x.quantize_x(silu_mul(gu)) (its float
    output not written): the down GEMM's input under activations="int8". gu [M, 2 I], I a multiple of 32."""
    I = gu.shape[-1] // 2
    g2 = gu.reshape(-1, 2 * I)
    rows = g2.shape[0]
    q = empty_rows(rows, I, gu.device)
    block = 1024
    on, kw = gdc.launch(gu.device)
    _silu_mul_kernel[(rows, triton.cdiv(I, block))](g2, q[1], I, g2.stride(0), 0, *q, BLOCK=block, QUANT=True,
                                                    ASM=ASM, GDC=on, num_warps=4, enable_fp_fusion=False, **kw)
    return q



@triton.jit
def _o_rows(o_ptr, out_off, omask, xw_ptr, dx_ptr, sx_ptr, b, kvh, G, KVH, BG: tl.constexpr, BD: tl.constexpr,
            ASM: tl.constexpr):
    """The program's G heads of output row b, as stored, read back and rounded to the o GEMM's int8 blocks (a head's
    BD = D values are whole blocks). Read back rather than rounded from registers: the compiler may lay out the
    split fold's sums otherwise when they also feed the rounding, which moved float32 outputs by an ulp."""
    tl.debug_barrier()  # the program's stores before its loads
    o = tl.load(o_ptr + out_off, mask=omask, other=0, cache_modifier=".cg").to(tl.float32)
    DB: tl.constexpr = BD // 32  # blocks a head
    words, dq, sq = quantize_blocks(tl.reshape(o, (BG * DB, 4, 8)), ASM)
    i = tl.arange(0, BG * DB)
    blk = tl.where(i // DB < G, (kvh * G + i // DB) * DB + i % DB, KVH * G * DB)  # heads past G: masked
    store_blocks(xw_ptr, dx_ptr, sx_ptr, b, blk, KVH * G * DB, words, dq, sq)


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, b_ptr, o_ptr, part_ptr, ml_ptr, cnt_ptr, S, CHUNK, scale, KVH, G,
                             NS, sq_b, sq_h, sk_b, sk_h, sk_s, sb_b, so_b, so_h, xw_ptr, dx_ptr, sx_ptr,
                             D: tl.constexpr, BD: tl.constexpr,
                             BG: tl.constexpr, BS: tl.constexpr, DOT: tl.constexpr,
                             PREC: tl.constexpr, PV_PREC: tl.constexpr, STAGES: tl.constexpr,
                             NSP: tl.constexpr, QUANT: tl.constexpr, ASM: tl.constexpr, GDC: tl.constexpr):
    """Program (row b, KV head, split): the G query heads of one KV head against columns [split * CHUNK, +CHUNK),
    a float32 online softmax; K and V are read once for the G heads. With one split it writes the output; with
    several it stores its unnormalised state, and the split that finishes last (a counter a (row, KV head), reset
    by that split) folds the NS states (NS <= NSP) in a fixed order: the same sums whichever split comes last.
    QUANT: the output also written as the o GEMM's int8 rows (quant_i8x.py; a row's [H * D] values, D = BD a
    multiple of 32, so a block of 32 lies in one head)."""
    wait_and_release(GDC)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // KVH).to(tl.int64)
    kvh = (pid % KVH).to(tl.int64)
    g = tl.arange(0, BG)
    gmask = g < G
    d = tl.arange(0, BD)
    dmask = d < D
    heads = kvh * G + g
    q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=gmask[:, None] & dmask[None, :],
                other=0)
    m = tl.full([BG], float("-inf"), tl.float32)
    l = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BD], tl.float32)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, S)
    base = b * sk_b + kvh * sk_h
    for s0 in tl.range(start, end, BS, num_stages=STAGES):
        s = s0 + tl.arange(0, BS)
        smask = s < end
        kv_off = base + s[:, None].to(tl.int64) * sk_s + d[None, :]
        kvmask = smask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + kv_off, mask=kvmask, other=0)
        v = tl.load(v_ptr + kv_off, mask=kvmask, other=0).to(tl.float32)  # both loads in flight
        if DOT:  # products of 16-bit values are exact in float32; float32 operands take the IEEE (FMA) product
            sc = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PREC)
        else:
            sc = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        sc = sc * scale + tl.load(b_ptr + b * sb_b + s, mask=smask, other=0).to(tl.float32)[None, :]
        sc = tl.where(smask[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        p = tl.exp(sc - m_new[:, None])
        alpha = tl.exp(m - m_new)
        if DOT:
            pv = tl.dot(p, v, input_precision=PV_PREC)
        else:
            pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
    out_off = b * so_b + heads[:, None] * so_h + d[None, :]
    omask = gmask[:, None] & dmask[None, :]
    if NS == 1:
        tl.store(o_ptr + out_off, (acc / l[:, None]).to(o_ptr.dtype.element_ty), mask=omask)
        if QUANT:
            _o_rows(o_ptr, out_off, omask, xw_ptr, dx_ptr, sx_ptr, b, kvh, G, KVH, BG, BD, ASM)
    else:
        w = (pid.to(tl.int64) * NS + split) * BG + g
        tl.store(part_ptr + w[:, None] * BD + d[None, :], acc, mask=gmask[:, None])
        tl.store(ml_ptr + w * 2, m, mask=gmask)
        tl.store(ml_ptr + w * 2 + 1, l, mask=gmask)
        tl.debug_barrier()  # every thread's stores before the release below
        ticket = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if ticket == NS - 1:  # the last split: each head's NS states at once, a fixed tree over the splits
            n = tl.arange(0, NSP)
            nmask = n < NS
            for gi in tl.static_range(BG):
                if gi < G:
                    wn = (pid.to(tl.int64) * NS + n) * BG + gi
                    mn = tl.load(ml_ptr + wn * 2, mask=nmask, other=float("-inf"), cache_modifier=".cg")
                    ln = tl.load(ml_ptr + wn * 2 + 1, mask=nmask, other=0, cache_modifier=".cg")
                    an = tl.load(part_ptr + wn[:, None] * BD + d[None, :], mask=nmask[:, None], other=0,
                                 cache_modifier=".cg")
                    f = tl.exp(mn - tl.max(mn, axis=0))
                    o = tl.sum(an * f[:, None], axis=0) / tl.sum(ln * f, axis=0)
                    tl.store(o_ptr + b * so_b + (kvh * G + gi) * so_h + d, o.to(o_ptr.dtype.element_ty), mask=dmask)
            if QUANT:
                _o_rows(o_ptr, out_off, omask, xw_ptr, dx_ptr, sx_ptr, b, kvh, G, KVH, BG, BD, ASM)
            tl.atomic_xchg(cnt_ptr + pid, 0)  # ready for the next call (or graph replay)


_counters: dict[torch.device, torch.Tensor] = {}


def _counter(device: torch.device, n: int) -> torch.Tensor:
    """The merge counters, zero between calls (each call's last split puts them back): one buffer a device,
    made outside a CUDA graph's capture so every graph shares it. Calls on a device must run one after another
    (bmc's steps, graphs and their warm-ups are ordered on one stream): two at once would share counters."""
    have = _counters.get(device)
    if have is None or have.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decode_attention's counters must be made before a CUDA graph is captured")
        have = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
        _counters[device] = have
    return have


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


MAX_SPLITS = 16  # the last split folds them in one pass


def decode_splits(rows: int, S: int, block: int, programs: int) -> int:
    """Column splits for rows x KV heads programs: about `programs` in all, at least one block of columns each."""
    return max(1, min(triton.cdiv(S, block), triton.cdiv(programs, rows), MAX_SPLITS))


def int8_rows_fit(head_dim: int) -> bool:
    """Whether decode_attention_int8 takes this head size (a power of two, whole blocks of 32)."""
    return head_dim >= 32 and head_dim & (head_dim - 1) == 0


def decode_attention_int8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                          scale: float) -> Int8Rows:
    """decode_attention's output [B, H, 1, d] as the o GEMM reads it under activations="int8": its rows [B, H d]
    rounded to int8 blocks, bit for bit quant_i8x.quantize_x of them, by the attention kernel itself (one kernel
    fewer a layer). d: int8_rows_fit."""
    rows = _decode_attention(q, k, v, bias, scale, int8_rows=True, **LAUNCH._asdict())
    assert not isinstance(rows, torch.Tensor)
    return rows


class Launch(NamedTuple):
    """decode_attention's launch choices (the defaults: bench/gpu_attn_configs.py measured them)."""
    block: int = 0
    dot: bool = True
    warps: int = 4
    stages: int = 3
    per_sm: int = 2


LAUNCH = Launch()


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float,
                     layer: int = 0, *, block: int = LAUNCH.block, dot: bool = LAUNCH.dot, warps: int = LAUNCH.warps,
                     stages: int = LAUNCH.stages, per_sm: int = LAUNCH.per_sm) -> torch.Tensor:
    """dense_attention for one query a row (decode), one kernel: q [B, H, 1, d]; k, v [B, H_kv, S, d] (the cache's
    views, any strides but the last, the same for k and v); bias [B, 1, 1, S]. Returns [B, H, 1, d].

    Each program reads its KV head's columns once for the G query heads on it (padded to 16 rows: tensor-core
    products, also for one head a KV head), in blocks of 32 columns (64 where rows x KV heads are fewer than the
    SMs), three blocks in flight; the columns are split (up to 16 ways) so that about two programs run an SM
    (flash-decoding), and the splits' states are folded in a fixed order by the split that finishes last, so a
    call's bits do not depend on which program ran when. The keywords are bench/gpu_attn_configs.py's (docs/performance.md, "Decode attention
    on CUDA"). Bound against SDPA (which rounds
    scores, sums and the output in its own order; tests/test_gpu.py): |o' - o| <= eps(dtype) max|v| in 16-bit
    dtypes, 2^-17 max|v| in float32."""
    out = _decode_attention(q, k, v, bias, scale, block=block, dot=dot, warps=warps, stages=stages, per_sm=per_sm,
                            int8_rows=False)
    assert isinstance(out, torch.Tensor)
    return out


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float, *,
                      block: int, dot: bool, warps: int, stages: int, per_sm: int,
                      int8_rows: bool) -> torch.Tensor | Int8Rows:
    B, H, t, D = q.shape
    KVH, S = k.shape[1], k.shape[2]
    G = H // KVH
    assert t == 1 and k.stride() == v.stride() and k.stride(-1) == 1 and bias.stride(-1) == 1 and q.stride(-1) == 1
    use_dot = G > 1 or dot  # one query head a KV head may take either
    BG = max(16, triton.next_power_of_2(G)) if use_dot else 1
    BD = max(16, triton.next_power_of_2(D)) if use_dot else triton.next_power_of_2(D)  # tl.dot: 16 and up
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    sms = _sms(index)
    BS = block or (16 if BD > 128 else 32 if B * KVH >= sms else 64)
    ns = decode_splits(B * KVH, S, BS, per_sm * sms)
    chunk = triton.cdiv(triton.cdiv(S, ns), BS) * BS
    ns = triton.cdiv(S, chunk)
    # 16-bit q and k are exact in tf32 (its 10-bit significand), so their products go to the tensor cores as they
    # are; P rounds to tf32 for its product with V (2^-11, inside the bound). ROCm's Triton takes IEEE only
    exact = q.dtype == torch.float32
    prec = "ieee" if exact or torch.version.hip else "tf32"
    out = torch.empty(B, H, 1, D, dtype=q.dtype, device=q.device)
    if int8_rows:
        assert int8_rows_fit(D) and BD == D, D
        rows = empty_rows(B, H * D, q.device)
    else:
        rows = (out, out, out)
    if ns > 1:
        part = torch.empty(B * KVH * ns * BG, BD, dtype=torch.float32, device=q.device)
        ml = torch.empty(B * KVH * ns * BG, 2, dtype=torch.float32, device=q.device)
        cnt = _counter(q.device, B * KVH)
    else:
        part = ml = cnt = out
    on, kw = gdc.launch(q.device)
    _decode_attention_kernel[(B * KVH, ns)](
        q, k, v, bias, out, part, ml, cnt, S, chunk, scale, KVH, G, ns, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), k.stride(2), bias.stride(0), out.stride(0), out.stride(1), *rows,
        D=D, BD=BD, BG=BG, BS=BS, DOT=use_dot, PREC=prec, PV_PREC="ieee" if exact else prec, STAGES=stages,
        NSP=triton.next_power_of_2(ns), QUANT=int8_rows, ASM=ASM, GDC=on, num_warps=warps, **kw)
    return rows if int8_rows else out
