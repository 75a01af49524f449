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

