"""Triton kernels for the CUDA decode step's glue between GEMMs (decode_cuda.py): a graphed batch-1 step of a
Llama-7B shape ran ~1050 kernels, ~33 a layer, of which 28 were norms, RoPE, the KV write, residual adds, SiLU and
copies of 1-2 µs each (docs/performance.md, "Batch-1 decode step on CUDA"). These make them 3 a layer.

- `add_rms_norm`: x + r (the residual, stored) and RMSNorm of the sum, one program a row.
- `rope_write`: the QKV GEMM's output rotated (queries and keys), queries out, keys and values into the cache at
  the step's column (a device index under a CUDA graph).
- `silu_mul`: silu(gate) * up of the gate|up GEMM's output.
- `decode_attention`: dense attention of one query a row over the cache's columns, split across the SMs.

Every elementwise step rounds where the torch ops round (bf16 / fp16 results of each op), with no FMA contraction
(`enable_fp_fusion=False`), silu's exp and division IEEE as torch's: RoPE, the KV write, the residual add and
silu_mul are bit for bit the torch path's. The norm's sum of squares is a tree sum in another order than torch's
mean: its bound is in `add_rms_norm` (tests/test_gpu.py holds both)."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, D, stride_x, stride_r, stride_y, stride_s, eps,
                         HAS_R: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr):
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
    tl.store(y_ptr + row * stride_y + off, y.to(y_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s, w, eps)) with s = x + r (x itself where r is None): [..., D], any leading shape.

    Bound: s is torch's x + r bit for bit; the norm sums the squares in float32 in another order than torch's
    mean, so its 1/rms differs by a few float32 ulps, and y by at most one rounding of the dtype (16-bit) or a
    relative 2^-20 (float32) from ops.rms_norm's."""
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
    _add_rms_norm_kernel[(rows,)](x2, r2, w, y2, s2, D, x2.stride(0), r2.stride(0), y2.stride(0), s2.stride(0), eps,
                                  HAS_R=r is not None, ROUND=x.dtype != torch.float32, BLOCK=block,
                                  num_warps=min(16, max(4, block // 512)))
    return s2.view(x.shape), y2.view(x.shape)


@triton.jit(do_not_specialize=["col"])
def _rope_write_kernel(a_ptr, cos_ptr, sin_ptr, q_ptr, kv_ptr, col_ptr, col, stride_a, stride_cs,
                       s_kv, s_row, s_head, s_col, H, KVH,
                       HD: tl.constexpr, BD: tl.constexpr, HB: tl.constexpr, COL_PTR: tl.constexpr):
    """Program (row, group of HB heads) of [q heads | k heads | v heads]: q and k rotated as
    x*cos + roll(x, HD/2)*sin_signed (each product and the sum rounded to the dtype, as apply_rope), q stored
    [B, H, 1, HD], k and v stored in the cache at the column. BD: HD rounded up to a power of two."""
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
    _rope_write_kernel[(B, triton.cdiv(heads + 2 * kv_heads, hb))](
        a2, cs, ss, q, kv, col if on_device else q, 0 if on_device else col, a2.stride(0), cs.stride(0),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), heads, kv_heads,
        HD=hd, BD=triton.next_power_of_2(hd), HB=hb, COL_PTR=on_device, num_warps=2, enable_fp_fusion=False)
    return q


@triton.jit
def _silu_mul_kernel(gu_ptr, y_ptr, I, stride_gu, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    off = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = off < I
    g = tl.load(gu_ptr + row * stride_gu + off, mask=mask, other=0)
    u = tl.load(gu_ptr + row * stride_gu + I + off, mask=mask, other=0).to(tl.float32)
    gf = g.to(tl.float32)
    act = libdevice.div_rn(gf, 1.0 + libdevice.exp(-gf)).to(g.dtype).to(tl.float32)  # torch's silu, rounded
    tl.store(y_ptr + row * stride_y + off, (act * u).to(g.dtype), mask=mask)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gu = [gate | up] ([..., 2 I]): [..., I], bit for bit F.silu(gate) * up."""
    I = gu.shape[-1] // 2
    g2 = gu.reshape(-1, 2 * I)
    rows = g2.shape[0]
    y = torch.empty(rows, I, dtype=gu.dtype, device=gu.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(I, block))](g2, y, I, g2.stride(0), y.stride(0), BLOCK=block, num_warps=4,
                                                    enable_fp_fusion=False)
    return y.view(*gu.shape[:-1], I)


@triton.jit
def _decode_attn_split(q_ptr, k_ptr, v_ptr, b_ptr, acc_ptr, ml_ptr, S, CHUNK, scale, H, G, NS,
                       sk_b, sk_h, sk_s, sb_b, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr):
    """Program (row b, query head h, split): softmax(q.k * scale + bias) v over columns [split * CHUNK, +CHUNK) of
    KV head h // G, unnormalised, with its max and sum (float32), for _decode_attn_merge."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    kvh = ((bh % H) // G).to(tl.int64)
    d = tl.arange(0, BD)
    dmask = d < D
    q = tl.load(q_ptr + bh.to(tl.int64) * D + d, mask=dmask, other=0).to(tl.float32)
    m = tl.full([1], float("-inf"), tl.float32)
    l = tl.zeros([1], tl.float32)
    acc = tl.zeros([BD], tl.float32)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, S)
    base = b * sk_b + kvh * sk_h
    for s0 in range(start, end, BS):
        s = s0 + tl.arange(0, BS)
        smask = s < end
        kv_off = base + s[:, None].to(tl.int64) * sk_s + d[None, :]
        k = tl.load(k_ptr + kv_off, mask=smask[:, None] & dmask[None, :], other=0).to(tl.float32)
        v = tl.load(v_ptr + kv_off, mask=smask[:, None] & dmask[None, :], other=0).to(tl.float32)  # both in flight
        sc = tl.sum(q[None, :] * k, axis=1) * scale
        sc += tl.load(b_ptr + b * sb_b + s, mask=smask, other=0).to(tl.float32)
        sc = tl.where(smask, sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=0))
        p = tl.exp(sc - m_new)
        alpha = tl.exp(m - m_new)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l = l * alpha + tl.sum(p, axis=0)
        m = m_new
    w = bh.to(tl.int64) * NS + split
    tl.store(acc_ptr + w * BD + d, acc)
    one = tl.arange(0, 1)
    tl.store(ml_ptr + w * 2 + one, m)
    tl.store(ml_ptr + w * 2 + 1 + one, l)


@triton.jit
def _decode_attn_merge(acc_ptr, ml_ptr, o_ptr, NS, D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BN)
    nmask = n < NS
    d = tl.arange(0, BD)
    m = tl.load(ml_ptr + (bh * NS + n) * 2, mask=nmask, other=float("-inf"))
    l = tl.load(ml_ptr + (bh * NS + n) * 2 + 1, mask=nmask, other=0)
    acc = tl.load(acc_ptr + (bh * NS + n)[:, None] * BD + d[None, :], mask=nmask[:, None], other=0)
    mx = tl.max(m, axis=0)
    f = tl.where(nmask, tl.exp(m - mx), 0)
    out = tl.sum(acc * f[:, None], axis=0) / tl.sum(l * f, axis=0)
    tl.store(o_ptr + bh * D + d, out.to(o_ptr.dtype.element_ty), mask=d < D)


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float,
                     layer: int = 0) -> torch.Tensor:
    """dense_attention for one query a row (decode): q [B, H, 1, d]; k, v [B, H_kv, S, d] (the cache's views, any
    strides but the last, the same for k and v); bias [B, 1, 1, S]. Returns [B, H, 1, d], contiguous.

    The columns are split so that about four programs run per SM (flash-decoding), each a float32 online softmax
    over its columns, merged by a second kernel. Bound (against SDPA, which rounds the scores, sums and output in
    its own order; tests/test_gpu.py): |o' - o| <= eps(dtype) max|v| in 16-bit dtypes, 2^-17 max|v| in float32."""
    B, H, t, D = q.shape
    KVH, S = k.shape[1], k.shape[2]
    assert t == 1 and k.stride() == v.stride() and k.stride(-1) == 1 and bias.stride(-1) == 1
    qc = q.contiguous()
    BD = triton.next_power_of_2(D)
    BS = max(16, min(64, 4096 // BD))
    sms = _sms(q.device.index if q.device.index is not None else torch.cuda.current_device())
    splits = max(1, min(triton.cdiv(S, BS), triton.cdiv(4 * sms, B * H)))
    chunk = triton.cdiv(triton.cdiv(S, splits), BS) * BS
    splits = triton.cdiv(S, chunk)
    acc = torch.empty(B * H * splits, BD, dtype=torch.float32, device=q.device)
    ml = torch.empty(B * H * splits, 2, dtype=torch.float32, device=q.device)
    out = torch.empty(B, H, 1, D, dtype=q.dtype, device=q.device)
    _decode_attn_split[(B * H, splits)](qc, k, v, bias, acc, ml, S, chunk, scale, H, H // KVH, splits,
                                        k.stride(0), k.stride(1), k.stride(2), bias.stride(0),
                                        D=D, BD=BD, BS=BS, num_warps=4)
    _decode_attn_merge[(B * H,)](acc, ml, out, splits, D=D, BD=BD, BN=triton.next_power_of_2(splits), num_warps=4)
    return out
