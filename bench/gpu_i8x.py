"""What a Q4_0 GEMV with int8 activations gives on CUDA (issue 48, item 2: a measurement, not a path bmc runs).

bmc's Q4_0 GEMV (quant_triton.py) multiplies float32 activations by each weight made exact in float32: about 7.5
instructions a weight in SASS, and on an H200 it runs at 55-60 % of that instruction ceiling, far from the bytes'
(docs/performance.md, "What bounds the weight-only GEMVs on the H200"). llama.cpp's CUDA path instead rounds the
activations to int8 per block of 32 (q8_1) and sums integer products four at a time (`dp4a`). This script measures
that arithmetic on bmc's own word layout of the blocks (quant_torch.relayout: nibble i of word j is value 4 i + j):
per word, `w & 0x0F0F0F0F` holds values j, 8 + j, 16 + j, 24 + j and `(w >> 4) & 0x0F0F0F0F` values 4 + j, ...,
28 + j, so x's int8 quants are laid out per block in that order once a call, and two dp4a take a word's 8 weights.
A block's sum is then y += d (dx S - 8 sx), S the integer sum, dx x's block scale and sx = dx sum(xq) (Q4_0's
offset -8 d).

The arithmetic is that of `--activations int8` on the CPU (x rounded per block of 32 to max|x| / 127): its bound is
that mode's, not the float GEMV's. Reported per Llama-2-7B shape at M = 1, each against bf16 cuBLAS, bmc's Q4_0
float GEMV and tinygemm (group 32) in the same run, timed as bench/gpu_quant.py times them (each call captured
over weight copies of >= 400 MB in one CUDA graph); plus the error against float64.

    python bench/gpu_i8x.py --out DIR          # on a CUDA device: JSON + PNG
    TRITON_INTERPRET=1 python bench/gpu_i8x.py --smoke   # a CPU check of the kernel's indexing (dp4a emulated)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QK = 32
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):
    """c + sum over the 4 bytes of a (unsigned) times b's (signed)."""
    if ASM:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    for t in tl.static_range(4):  # the interpreter has no inline asm
        ab = (a >> (8 * t)) & 255
        bb = (b >> (8 * t)) & 255
        bb = bb - ((bb >> 7) << 8)
        c = c + ab * bb
    return c


@triton.jit
def _gemv_i8x_kernel(q_ptr, d_ptr, xw_ptr, dx_ptr, sx_ptr, y_ptr, N, KB, stride_qn,
                     BN: tl.constexpr, NB: tl.constexpr, ASM: tl.constexpr):
    """y[n] = sum over blocks d[n, b] (dx[b] S[n, b] - 8 sx[b]) for BN rows n (N a multiple of BN, KB of NB). Every
    operand is loaded at the words' full tile shape [BN, NB, 4] (x, dx, sx and d repeated: L1 hits), so all of them
    sit in the words' layout and nothing moves between threads (quant_triton.py's rule); a block's offset term is
    split over its 4 words (-2 sx each)."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    b = tl.arange(0, NB)
    j = tl.arange(0, 4)
    acc = tl.zeros((BN, NB, 4), dtype=tl.float32)
    for k0 in range(0, KB, NB):
        blk = k0 + b
        woff = n[:, None, None] * stride_qn + blk[None, :, None] * 4 + j[None, None, :]
        xoff = 0 * n[:, None, None] + blk[None, :, None] * 8 + j[None, None, :]
        soff = 0 * n[:, None, None] + blk[None, :, None] + 0 * j[None, None, :]
        words = tl.load(q_ptr + woff)
        s = _dp4a(words & 0x0F0F0F0F, tl.load(xw_ptr + xoff), tl.zeros_like(words), ASM)
        s = _dp4a((words >> 4) & 0x0F0F0F0F, tl.load(xw_ptr + xoff + 4), s, ASM)
        d = tl.load(d_ptr + n[:, None, None] * KB + blk[None, :, None] + 0 * j[None, None, :]).to(tl.float32)
        dx = tl.load(dx_ptr + soff)
        sx = tl.load(sx_ptr + soff)
        acc = tl.fma(d, tl.fma(dx, s.to(tl.float32), -2.0 * sx), acc)
    tl.store(y_ptr + n, tl.sum(tl.sum(acc, axis=2), axis=1).to(y_ptr.dtype.element_ty))


@triton.jit
def _gemv_i8x_sum_kernel(q_ptr, d_ptr, xw_ptr, dx_ptr, sx_ptr, y_ptr, N, KB, stride_qn,
                         BN: tl.constexpr, NB: tl.constexpr, ASM: tl.constexpr):
    """The same sums, each block's integer sum S taken first (in the words' layout), then scaled in the scales'
    layout: one [BN, NB] tensor crosses threads a loop step instead of [BN, NB, 4] floats."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    b = tl.arange(0, NB)
    j = tl.arange(0, 4)
    acc = tl.zeros((BN, NB), dtype=tl.float32)
    for k0 in range(0, KB, NB):
        blk = k0 + b
        woff = n[:, None, None] * stride_qn + blk[None, :, None] * 4 + j[None, None, :]
        xoff = 0 * n[:, None, None] + blk[None, :, None] * 8 + j[None, None, :]
        words = tl.load(q_ptr + woff)
        s = _dp4a(words & 0x0F0F0F0F, tl.load(xw_ptr + xoff), tl.zeros_like(words), ASM)
        s = _dp4a((words >> 4) & 0x0F0F0F0F, tl.load(xw_ptr + xoff + 4), s, ASM)
        S = tl.sum(s, axis=2).to(tl.float32)
        d = tl.load(d_ptr + n[:, None] * KB + blk[None, :]).to(tl.float32)
        dx = tl.load(dx_ptr + 0 * n[:, None] + blk[None, :])
        sx = tl.load(sx_ptr + 0 * n[:, None] + blk[None, :])
        acc = tl.fma(d, tl.fma(dx, S, -8.0 * sx), acc)
    tl.store(y_ptr + n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))


@triton.jit
def _dp4a_ss(a, b, c, ASM: tl.constexpr):
    """c + sum over the 4 bytes of a times b's, both signed."""
    if ASM:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    for t in tl.static_range(4):
        ab = (a >> (8 * t)) & 255
        bb = (b >> (8 * t)) & 255
        c = c + (ab - ((ab >> 7) << 8)) * (bb - ((bb >> 7) << 8))
    return c


@triton.jit
def _gemv_i8x_q8_kernel(q_ptr, d_ptr, xw_ptr, dx_ptr, sx_ptr, y_ptr, N, KB, stride_qn,
                        BN: tl.constexpr, NB: tl.constexpr, ASM: tl.constexpr):
    """Q8_0 (8 words a block, byte i of word j = value 8 i + j: x's words in the same order as for Q4): y[n] = sum
    over blocks d dx S. sx is unused (no offset)."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    b = tl.arange(0, NB)
    j = tl.arange(0, 8)
    acc = tl.zeros((BN, NB), dtype=tl.float32)
    for k0 in range(0, KB, NB):
        blk = k0 + b
        words = tl.load(q_ptr + n[:, None, None] * stride_qn + blk[None, :, None] * 8 + j[None, None, :])
        xw = tl.load(xw_ptr + 0 * n[:, None, None] + blk[None, :, None] * 8 + j[None, None, :])
        S = tl.sum(_dp4a_ss(words, xw, tl.zeros_like(words), ASM), axis=2).to(tl.float32)
        d = tl.load(d_ptr + n[:, None] * KB + blk[None, :]).to(tl.float32)
        dx = tl.load(dx_ptr + 0 * n[:, None] + blk[None, :])
        acc = tl.fma(d, dx * S, acc)
    tl.store(y_ptr + n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))


KERNELS = {"words": _gemv_i8x_kernel, "sum": _gemv_i8x_sum_kernel, "q8": _gemv_i8x_q8_kernel}
Q4_KERNELS = ("words", "sum")


# (kernel, BN rows, NB blocks a loop step, warps); SASS (ptxas for sm_90, here): "sum" 8x32 w2 166 instructions a
# loop step for 128 weights a thread (1.30 a weight), "words" 216 (1.69, its floats through shared memory)
CONFIGS = [("sum", 4, 16, 1), ("sum", 2, 16, 1), ("sum", 4, 8, 1), ("sum", 2, 32, 1), ("sum", 8, 8, 1),
           ("sum", 4, 32, 1), ("sum", 4, 32, 2), ("sum", 8, 16, 2), ("sum", 8, 8, 2), ("sum", 2, 8, 1),
           ("words", 4, 16, 1), ("words", 4, 8, 1)]  # the down projection's K / 32 = 344 takes NB = 8


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [K] -> (words [K/32 * 8] int32 in the kernel's order, dx [K/32], sx [K/32], xq [K/32, 32] int8): per block
    of 32, dx = max|x| / 127 and xq = round(x / dx), as the CPU's int8 activations round them."""
    xb = x.float().view(-1, QK)
    dx = xb.abs().amax(dim=1) / 127.0
    xq = torch.where(dx[:, None] > 0, torch.round(xb / torch.where(dx > 0, dx, 1.0)[:, None]), 0.0).to(torch.int8)
    sx = dx * xq.sum(dim=1, dtype=torch.int32).float()
    v = xq.view(-1, 4, 8)  # value 8 t + 4 h + j at [t, h, j]: word (h, j) holds bytes t = 0..3
    words = v.view(-1, 4, 2, 4).permute(0, 2, 3, 1).contiguous().view(torch.int32).view(-1)
    return words, dx.contiguous(), sx.contiguous(), xq


def gemv_i8x(words_x: torch.Tensor, dx: torch.Tensor, sx: torch.Tensor, q: torch.Tensor, d: torch.Tensor, N: int,
             K: int, bn: int = 8, nb: int = 32, warps: int = 2, out_dtype: torch.dtype = torch.float32,
             kernel: str = "words") -> torch.Tensor:
    KB = K // QK
    nb = min(nb, KB)
    assert N % bn == 0 and KB % nb == 0, (N, K, bn, nb)
    y = torch.empty(N, dtype=out_dtype, device=q.device)
    KERNELS[kernel][(N // bn,)](q, d, words_x, dx, sx, y, N, KB, q.stride(0), BN=bn, NB=nb, ASM=not INTERPRET,
                                 num_warps=warps)
    return y


def q4_0_of(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 of w [N, K] (d = max-magnitude / -8, q = round(w / d) + 8 clamped to 0..15): (words, d [N, K/32] fp16,
    q [N, K/32, 32] uint8)."""
    from bmc.models.quant_torch import relayout

    N, K = w.shape
    wb = w.float().view(N, K // QK, QK)
    idx = wb.abs().argmax(dim=2, keepdim=True)
    d = (wb.gather(2, idx) / -8.0).squeeze(2).half()
    df = d.float()
    q = torch.clamp(torch.round(wb / torch.where(df != 0, df, 1.0)[..., None]) + 8, 0, 15).to(torch.uint8)
    return relayout(q, True), d, q


def q8_0_of(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q8_0 of w [N, K] (d = max|w| / 127, q = round(w / d)): (words, d [N, K/32] fp16, q [N, K/32, 32] int8)."""
    from bmc.models.quant_torch import relayout

    N, K = w.shape
    wb = w.float().view(N, K // QK, QK)
    d = (wb.abs().amax(dim=2) / 127.0).half()
    df = d.float()
    q = torch.clamp(torch.round(wb / torch.where(df != 0, df, 1.0)[..., None]), -127, 127).to(torch.int8)
    return relayout(q, False), d, q


def reference(q: torch.Tensor, d: torch.Tensor, xq: torch.Tensor, dx: torch.Tensor, offset: float = 8.0) -> torch.Tensor:
    """The same arithmetic in float64: sum over blocks d dx sum((q - offset) xq)."""
    S = ((q.double() - offset) * xq.double()[None]).sum(dim=2)  # [N, KB]
    return (d.double() * dx.double()[None] * S).sum(dim=1)


def check(N: int, K: int, device: str) -> float:
    g = torch.Generator(device="cpu").manual_seed(N + K)
    w = torch.randn(N, K, generator=g) * 0.05
    x = torch.randn(K, generator=g)
    words, d, q = q4_0_of(w)
    xw, dx, sx, xq = quantize_x(x)
    ref = reference(q, d, xq, dx)
    err = 0.0
    w8, d8, q8 = q8_0_of(w)
    y8 = gemv_i8x(xw.to(device), dx.to(device), sx.to(device), w8.to(device), d8.to(device), N, K, bn=min(8, N),
                  nb=min(32, K // QK), kernel="q8").cpu().double()
    ref8 = reference(q8, d8, xq, dx, 0.0)
    err = ((y8 - ref8).abs() / (ref8.abs().max() + 1e-30)).max().item()
    for kernel in Q4_KERNELS:
        y = gemv_i8x(xw.to(device), dx.to(device), sx.to(device), words.to(device), d.to(device), N, K,
                     bn=min(8, N), nb=min(32, K // QK), kernel=kernel).cpu().double()
        err = max(err, ((y - ref).abs() / (ref.abs().max() + 1e-30)).max().item())
    assert err < 1e-5, err
    return err


def sweep_bmc(out: Path, rows: int) -> None:
    """--bmc: the path bmc runs (bmc.models.quant_i8x: its rounding kernel, then its GEMV; its one block shape for
    every matrix, and others) over the Llama-2-7B shapes at M = rows, Q4_0 and Q8_0, timed as above."""
    from gpu_quant import ROTATE_BYTES, SHAPES, STEP, time_graph

    import bmc.models.quant_i8x as qi

    configs = [(2, 32, 1), (4, 16, 1), (2, 16, 1), (4, 32, 1), (2, 64, 1), (4, 32, 2)]  # (BN, NB_MAX, warps)
    rows_out = []
    for name, (N, K) in SHAPES.items():
        g = torch.Generator(device="cpu").manual_seed(1)
        w = torch.randn(N, K, generator=g) * 0.02
        x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
        res = {"shape": name, "N": N, "K": K}
        for kind, make, nib, shift in (("q4_0", q4_0_of, True, 8), ("q8_0", q8_0_of, False, 0)):
            words, d, _ = make(w)
            words, d = words.cuda(), d.cuda()
            qbytes = words.numel() * 4 + d.numel() * 2
            sets = [(words.clone(), d.clone()) for _ in range(max(2, -(-ROTATE_BYTES // qbytes)))]
            for bn, nbm, warps in configs:
                qi.BN, qi.NB_MAX, qi.WARPS = bn, {True: nbm, False: nbm}, warps
                res[f"{kind} {bn}x{nbm} w{warps}"] = time_graph(
                    [lambda s=s: qi.gemv_i8x(qi.quantize_x(x), s[0], s[1], None, shift, nib, N, K, torch.bfloat16)
                     for s in sets])
            res[f"{kind} rounding alone"] = time_graph([lambda: qi.quantize_x(x)])
            del sets
        rows_out.append(res)
        print(json.dumps(res), flush=True)
    step = {}
    for key in rows_out[0]:
        if key.startswith("q") and all(key in r for r in rows_out):
            step[key] = sum(r[key] * STEP[r["shape"]] for r in rows_out if r["shape"] in STEP)
    print(f"one 7B decode step's GEMMs at M = {rows}, ms (each with its rounding kernel):", json.dumps(step), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu-i8x-bmc-M{rows}.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "M": rows,
                                                                "shapes": rows_out, "step_ms": step}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/h200/gpu-i8x")
    ap.add_argument("--smoke", action="store_true", help="check the kernel on small shapes only (CPU interpreter)")
    ap.add_argument("--bmc", type=int, default=0, metavar="M",
                    help="time bmc's own int8-x path (quant_i8x.py) at M rows over block shapes, instead")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.bmc:
        sweep_bmc(Path(args.out), args.bmc)
        return
    for N, K in ((8, 64), (16, 256), (64, 2048)):
        print(f"check N={N} K={K}: max error / max|y| {check(N, K, device):.2e}", flush=True)
    if args.smoke or device == "cpu":
        return
    from gpu_quant import ROTATE_BYTES, SHAPES, STEP, time_graph

    import bmc.models.quant_triton as qt

    rows = []
    for name, (N, K) in SHAPES.items():
        g = torch.Generator(device="cpu").manual_seed(1)
        w = (torch.randn(N, K, generator=g) * 0.02).to(device, torch.bfloat16)
        x = torch.randn(1, K, device=device, dtype=torch.bfloat16)
        words, d, q = q4_0_of(w.float().cpu())
        words, d = words.to(device), d.to(device)
        qbytes = words.numel() * 4 + d.numel() * 2
        copies = max(2, -(-ROTATE_BYTES // qbytes))
        wsets = [(words.clone(), d.clone()) for _ in range(copies)]
        xw, dx, sx, _ = quantize_x(x[0])
        res = {"shape": name, "N": N, "K": K, "bytes_q4_0": qbytes}
        best = None
        for kernel, bn, nb, warps in CONFIGS:
            if N % bn or (K // QK) % min(nb, K // QK):
                continue
            ms = time_graph([lambda s=s, k=kernel, bn=bn, nb=nb, warps=warps: gemv_i8x(
                xw, dx, sx, s[0], s[1], N, K, bn, nb, warps, torch.bfloat16, k) for s in wsets])
            res[f"i8x {kernel} {bn}x{nb} w{warps}"] = ms
            best = ms if best is None else min(best, ms)
        if best is None:
            raise SystemExit(f"no configuration fits {name} ({N} x {K})")
        res["i8x best ms"] = best
        res["i8x x prep ms"] = time_graph([lambda: quantize_x(x[0])])  # torch ops here; one small kernel in a path
        # bmc's float GEMV on the same words (its default block shape), tinygemm g32, bf16 cuBLAS
        res["float gemv ms"] = time_graph([lambda s=s: qt.gemv(x, s[0], s[1], None, 8, True, N, K) for s in wsets])
        del wsets
        try:  # tinygemm on the same blocks (w = (q - 8) d; group 32), as quant_torch.py packs Q4 kinds in bf16
            from bmc.models.quant_torch import _int4pack

            df = d.float().cpu().numpy()
            packed, sz = _int4pack(q.numpy(), df, -8.0 * df, torch.device(device))
            nbt = packed.numel() * packed.element_size() + sz.numel() * sz.element_size()
            tsets = [(packed.clone(), sz.clone()) for _ in range(max(2, -(-ROTATE_BYTES // nbt)))]
            res["tinygemm g32 ms"] = time_graph([lambda s=s: torch.ops.aten._weight_int4pack_mm(x, s[0], 32, s[1])
                                                 for s in tsets])
            del tsets, packed, sz
        except Exception as e:  # noqa: BLE001 - recorded, the other columns stand
            res["tinygemm error"] = repr(e)
        # Q8_0: the same x words, 8 words a block
        w8, d8, _ = q8_0_of(w.float().cpu())
        w8, d8 = w8.to(device), d8.to(device)
        q8bytes = w8.numel() * 4 + d8.numel() * 2
        q8sets = [(w8.clone(), d8.clone()) for _ in range(max(2, -(-ROTATE_BYTES // q8bytes)))]
        best8 = None
        for _, bn, nb, warps in CONFIGS:
            if N % bn or (K // QK) % min(nb, K // QK):
                continue
            ms = time_graph([lambda s=s, bn=bn, nb=nb, warps=warps: gemv_i8x(
                xw, dx, sx, s[0], s[1], N, K, bn, nb, warps, torch.bfloat16, "q8") for s in q8sets])
            best8 = ms if best8 is None else min(best8, ms)
        res["q8 i8x best ms"] = best8
        res["q8 float gemv ms"] = time_graph([lambda s=s: qt.gemv(x, s[0], s[1], None, 0, False, N, K)
                                              for s in q8sets])
        res["q8 i8x GB/s"] = q8bytes / best8 / 1e6
        del q8sets
        bsets = [w.clone() for _ in range(max(2, -(-ROTATE_BYTES // (N * K * 2))))]
        res["bf16 cuBLAS ms"] = time_graph([lambda s=s: torch.nn.functional.linear(x, s) for s in bsets])
        del bsets
        res["i8x GB/s"] = qbytes / best / 1e6
        rows.append(res)
        print(json.dumps(res), flush=True)
    step = {k: sum(r[k] * STEP[r["shape"]] for r in rows if r["shape"] in STEP)
            for k in ("i8x best ms", "float gemv ms", "tinygemm g32 ms", "q8 i8x best ms", "q8 float gemv ms",
                      "bf16 cuBLAS ms") if all(k in r for r in rows)}
    print("one 7B decode step's GEMMs, ms:", json.dumps(step), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M"), "M": 1}
    (out / "gpu-i8x.json").write_text(json.dumps({"meta": meta, "shapes": rows, "step_ms": step}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    keys = list(step)
    ax.bar([k.replace(" ms", "").replace("i8x best", "int8-x GEMV").replace(" ", "\n", 1) for k in keys],
           [step[k] for k in keys], color=["C1", "C0", "C2", "C3", "C4", "gray"][: len(keys)])
    for i, k in enumerate(keys):
        ax.text(i, step[k], f"{step[k]:.2f} ms\n{step.get('bf16 cuBLAS ms', step[k]) / step[k]:.2f}x bf16",
                ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("ms (one Llama-2-7B decode step's GEMMs, M = 1)")
    ax.set_title(f"Q4_0 / Q8_0 with int8 activations (dp4a) vs the float GEMVs, tinygemm, bf16 cuBLAS\n{meta['device']}, "
                 f"torch {meta['torch']}, Triton {meta['triton']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "gpu-i8x.png", dpi=120)
    print(f"wrote {out}/gpu-i8x.json and .png")


if __name__ == "__main__":
    main()
