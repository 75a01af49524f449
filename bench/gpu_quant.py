"""Weight-only int8 / int4 GEMMs on CUDA (issue 48, item 2): what torch gives, what the dequantizing path gives and
what bmc's Triton kernels on GGUF-style blocks of 32 give, on the Llama-2-7B shapes, at M = 1, 8, 32, in one run.

    python bench/gpu_quant.py --out bench/results/h100/gpu-quant       # JSON + PNG there

Shapes (N out, K in): the fused q|k|v (12288 x 4096), o (4096 x 4096), the fused gate|up (22016 x 4096), up alone
(11008 x 4096), down (4096 x 11008) and the LM head (32000 x 4096). Methods, each against bf16 cuBLAS in the same
run: torch `_weight_int8pack_mm` (int8, one bf16 scale per output row), `_weight_int4pack_mm` (tinygemm: int4,
bf16 scale and zero per 32 or 128 values), the dequantizing path (quant_torch.py before issue 48: the blocks'
values times their scales in float32 torch ops, cast to bf16, then cuBLAS), and the Triton kernels (quant_triton.py)
on Q8_0 (int8 + fp16 scale per 32: 34 bytes a block), Q4_0 (nibbles + fp16 scale: 18 bytes) and Q4_1 (+ fp16
offset: 20): `gemv` (FMA, one read of each byte, up to 8 rows of x a program) over a sweep of block shapes, and
`dequantize` to bf16 followed by cuBLAS. The GEMV reads a bf16 x as it is at M = 1; at M > 1 x is widened to
float32 by a kernel of its own inside the timed graph (as quant_torch.py calls it). (The first round's kernels, a GEMV converting each quant with I2F and a
tl.dot GEMM, are in bench/results/h100/gpu-quant/round1/.)

Timing: each call is captured R times in a CUDA graph over R copies of the weights (R copies hold >= 400 MB, so
that the 50 MB L2 holds none of them between reads), the replay timed with CUDA events (triton's do_bench,
median), divided by R. GB/s counts the bytes of the weights' own format (a bf16 matrix 2 bytes a value, Q8_0 34 per
32 values, ...) plus x and y. The "decode step" figure sums 32 layers' q|k|v, o, gate|up and down plus the head:
the GEMM part of one batch-M decode step of a Llama-2-7B-shaped model."""
from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "up": (11008, 4096),
          "down": (4096, 11008), "head": (32000, 4096)}
STEP = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "head": 1}  # GEMMs of one decode step
ROTATE_BYTES = 400 << 20
# the GEMV's (BN rows, NB blocks of 32 a loop step, warps, MB rows of x a program), swept per M
GEMV_CONFIGS = [(8, 32, 2, 1, 1), (4, 32, 2, 1, 1), (8, 16, 2, 1, 1), (4, 16, 1, 1, 1), (8, 64, 4, 1, 1),
                (4, 16, 2, 1, 2), (4, 16, 2, 1, 3), (8, 16, 2, 1, 3), (4, 8, 2, 1, 4), (8, 8, 2, 1, 4),
                (4, 32, 2, 1, 2), (8, 16, 4, 1, 3), (16, 8, 4, 1, 4)]  # the last: software-pipelining depth
GEMV_CONFIGS_M4 = [(4, 16, 1, 4), (4, 32, 2, 4), (8, 16, 2, 4), (2, 32, 1, 4)]
GEMV_CONFIGS_M8 = [(4, 16, 1, 8), (2, 32, 1, 8), (4, 16, 1, 4), (8, 16, 2, 4), (2, 16, 1, 8)]
DEQ_CONFIGS = [(16, 8, 4), (32, 4, 4), (8, 16, 4)]  # the dequantizing kernel's (BN, NB, warps)


def time_graph(calls: list[Callable[[], Any]]) -> float:
    """ms per call: the calls captured in one CUDA graph, its replay's median."""
    import triton

    if not torch.cuda.is_available():  # a smoke test of the script (TRITON_INTERPRET=1 on a CPU): no timing
        calls[0]()
        return 1.0

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    ms = triton.testing.do_bench(g.replay, warmup=20, rep=150, return_mode="median")
    del g
    return ms / len(calls)


def q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> int8 quants [N, K], fp16 scales [N, K/32] (llama.cpp's rule, on the GPU)."""
    N, K = w.shape
    g = w.float().view(N, K // 32, 32)
    d = (g.abs().amax(-1) / 127).half()
    q = torch.round(g / d.float().clamp(min=1e-30)[..., None]).clamp(-127, 127).to(torch.int8)
    return q.view(N, K), d


def q4(w: torch.Tensor, offset: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """[N, K] float -> GGUF-ordered nibbles [N, K/2], fp16 d [N, K/32], and for Q4_1 fp16 m (Q4_0: w = d (q - 8))."""
    N, K = w.shape
    g = w.float().view(N, K // 32, 32)
    if offset:
        lo, hi = g.amin(-1), g.amax(-1)
        d, m = ((hi - lo) / 15).half(), lo.half()
        q = torch.round((g - m.float()[..., None]) / d.float().clamp(min=1e-30)[..., None]).clamp(0, 15)
    else:
        idx = g.abs().argmax(-1, keepdim=True)
        d, m = (g.gather(-1, idx)[..., 0] / -8).half(), None
        q = torch.trunc(g / d.float().clamp(min=1e-30)[..., None] + 8.5).clamp(0, 15)
    q = q.to(torch.uint8)
    nib = q[..., :16] | (q[..., 16:] << 4)
    return nib.reshape(N, K // 2).contiguous(), d, m


def dense_of(kind: str, t: tuple) -> torch.Tensor:
    """The exact float32 weights of a Triton-format matrix."""
    if kind == "q8_0":
        q, d = t
        N, K = q.shape
        return (q.view(N, K // 32, 32).float() * d.float()[..., None]).view(N, K)
    nib, d, m = t
    N, K = nib.shape[0], nib.shape[1] * 2
    b = nib.view(N, K // 32, 16)
    v = torch.cat([b & 15, b >> 4], -1).float()
    w = (v - 8) * d.float()[..., None] if m is None else v * d.float()[..., None] + m.float()[..., None]
    return w.view(N, K)


def attempt(res: dict[str, Any], what: str, fn: Callable[[], Any]) -> Any:
    """fn(), or None with the error recorded (a block shape this Triton cannot build, an op this torch lacks)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 (any failure of one method is recorded, the run goes on)
        res.setdefault("errors", []).append(f"{what}: {type(e).__name__}: {e}"[:400])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return None


def nbytes(*ts: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def bench_shape(name: str, N: int, K: int, Ms: list[int], quick: bool) -> dict[str, Any]:
    from bmc.models import quant_triton as qt

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=dev).manual_seed(N * 7 + K)
    w32 = torch.randn(N, K, device=dev, generator=gen) * 0.02
    res: dict[str, Any] = {"N": N, "K": K, "methods": {}}

    def copies(make: Callable[[], tuple], size: int) -> list[tuple]:
        r = max(2, math.ceil(ROTATE_BYTES / size))
        first = make()
        return [first] + [tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in first) for _ in range(r - 1)]

    def record(method: str, M: int, ms: float, wbytes: int, err: float | None = None, **extra: Any) -> None:
        io = (M * K + M * N) * 2
        row = {"ms": ms, "GBps": (wbytes + io) / ms / 1e6, "weight_bytes": wbytes, "rel_err": err, **extra}
        res["methods"].setdefault(method, {})[str(M)] = row

    xs = {M: torch.randn(M, K, device=dev, generator=gen).bfloat16() for M in Ms}
    exact_x = {M: xs[M].double() for M in Ms}

    def rel(y: torch.Tensor, w: torch.Tensor, M: int) -> float:
        ref = exact_x[M] @ w.double().t()
        return ((y.double() - ref).norm() / ref.norm()).item()

    # bf16 cuBLAS
    wb = w32.bfloat16()
    sets = copies(lambda: (wb,), nbytes(wb))
    for M in Ms:
        x = xs[M]
        record("bf16 cuBLAS", M, time_graph([lambda w=s[0]: F.linear(x, w) for s in sets]), nbytes(wb),
               rel(F.linear(x, wb), wb.float(), M))
    del sets, wb
    # torch int8 weight-only, one scale per output row
    scale = (w32.abs().amax(1) / 127).clamp(min=1e-8)
    q8 = torch.round(w32 / scale[:, None]).to(torch.int8)
    s8 = scale.bfloat16()
    w8 = q8.float() * s8.float()[:, None]
    sets = copies(lambda: (q8, s8), nbytes(q8, s8))
    for M in Ms:
        x = xs[M]
        op = torch.ops.aten._weight_int8pack_mm
        ok = attempt(res, "int8pack", lambda: (time_graph([lambda s=s: op(x, s[0], s[1]) for s in sets]),
                                               rel(op(x, q8, s8), w8, M)))
        if ok:
            record("torch int8pack (per row)", M, ok[0], nbytes(q8, s8), ok[1])
    del sets, q8, s8, w8
    # tinygemm int4, group 32 and 128
    for group in (32, 128):
        g = w32.view(N, K // group, group)
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        sc = ((hi - lo) / 15).clamp(min=1e-8)
        qv = ((g - lo) / sc).round().clamp(0, 15).to(torch.int32).view(N, K)
        zero = lo + 8 * sc
        packed = attempt(res, f"int4pack g{group}", lambda: torch.ops.aten._convert_weight_to_int4pack(
            (qv[:, ::2] << 4 | qv[:, 1::2]).to(torch.uint8), 8))
        if packed is None:
            continue
        sz = torch.stack([sc, zero], -1).squeeze(2).transpose(0, 1).contiguous().bfloat16()
        wq = ((qv.view(N, K // group, group).float() - 8) * sz[..., 0].t().float()[..., None]
              + sz[..., 1].t().float()[..., None]).view(N, K)
        sets = copies(lambda: (packed, sz), nbytes(packed, sz))
        op4 = torch.ops.aten._weight_int4pack_mm
        for M in Ms:
            x = xs[M]
            ok = attempt(res, f"int4pack g{group}", lambda: (
                time_graph([lambda s=s: op4(x, s[0], group, s[1]) for s in sets]), rel(op4(x, packed, group, sz), wq, M)))
            if ok:
                record(f"torch int4pack g{group} (tinygemm)", M, ok[0], nbytes(packed, sz), ok[1])
        del sets, packed, sz, wq
    # the GGUF-style formats: the torch-ops dequantizing path, and the Triton kernels on the re-laid words
    fmts = {"q8_0": q8_0(w32), "q4_0": q4(w32, False), "q4_1": q4(w32, True)}
    del w32
    KB = K // 32
    for kind, t in fmts.items():
        exact = dense_of(kind, t)
        nib = kind != "q8_0"
        d, m = t[1], (t[2] if nib else None)
        shift = 8 if kind == "q4_0" else 0
        if nib:
            b = t[0].view(N, KB, 16)
            values = torch.cat([b & 15, b >> 4], -1)
        else:
            values = t[0].view(N, KB, 32)
        words = qt.relayout(values, nib)
        wbytes = nbytes(*t)
        assert nbytes(words, d, m) == wbytes
        if kind != "q4_1":  # quant_torch.py before issue 48: float32 values times scales, cast, cuBLAS
            sets = copies(lambda: tuple(t), wbytes)
            for M in Ms[:1]:
                x = xs[M]
                ok = attempt(res, f"dequant {kind}", lambda: (
                    time_graph([lambda s=s: F.linear(x, dense_of(kind, s).bfloat16()) for s in sets]),
                    rel(F.linear(x, dense_of(kind, t).bfloat16()), exact, M)))
                if ok:
                    record(f"{kind} dequant+cuBLAS (torch ops)", M, ok[0], wbytes, ok[1])
            del sets
        sets = copies(lambda: (words, d, m), wbytes)

        def sweep(label: str, M: int, cfgs: list[tuple], make: Callable[..., Callable[[tuple], torch.Tensor]]) -> Any:
            best = None
            for cfg in cfgs:
                call = make(*cfg)
                ok = attempt(res, f"{label} {kind} {cfg}", lambda: (
                    rel(call((words, d, m)), exact, M), time_graph([lambda s=s: call(s) for s in sets])))
                if ok is None:
                    continue
                err, ms = ok
                if len(cfgs) > 1:
                    record(f"{kind} {label} {'x'.join(map(str, cfg))}", M, ms, wbytes, err)
                if best is None or ms < best[0]:
                    best = (ms, err, cfg)
            if best:
                record(f"{kind} {label} (best)", M, best[0], wbytes, best[1], config=best[2])
            return best[2] if best else None

        for M in Ms:
            x = xs[M]
            if M == 1:  # x widened to float32 in the timed graph (a kernel of its own), and 16-bit x read as it is
                cfgs = GEMV_CONFIGS
            else:
                cfgs = GEMV_CONFIGS_M4 if M <= 4 else GEMV_CONFIGS_M8
            if quick:
                cfgs = cfgs[:2]

            def gv(bn: int, nb: int, warps: int, mb: int, stages: int = 1, x=x) -> Callable[[tuple], torch.Tensor]:
                return lambda s: qt.gemv(x if M == 1 else x.float(), s[0], s[1], s[2], shift, nib, N, K,
                                         torch.bfloat16, bn=bn, nb=nb, warps=warps, mb=mb, stages=stages)

            sweep("triton gemv", M, cfgs, gv)

            def dq(bn: int, nb: int, warps: int, x=x) -> Callable[[tuple], torch.Tensor]:
                return lambda s: F.linear(x, qt.dequantize(s[0], s[1], s[2], shift, nib, N, K, torch.bfloat16, bn=bn,
                                                           nb=nb, warps=warps))

            if M >= 8:
                sweep("triton dequant+cuBLAS", M, DEQ_CONFIGS[:1], dq)
        del sets, exact, words
    torch.cuda.empty_cache()
    return res


def ceilings() -> dict[str, float]:
    """Device-to-device copy (bytes read + written) and a read-only reduction, GB/s."""
    import triton

    a = torch.randn(1 << 28, device="cuda")  # 1 GiB
    b = torch.empty_like(a)
    copy_ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=20, rep=200, return_mode="median")
    sum_ms = triton.testing.do_bench(lambda: a.sum(), warmup=20, rep=200, return_mode="median")
    n = a.numel() * 4
    del a, b
    torch.cuda.empty_cache()
    return {"copy_GBps": 2 * n / copy_ms / 1e6, "sum_read_GBps": n / sum_ms / 1e6}


def step_table(shapes: dict[str, Any], Ms: list[int]) -> dict[str, dict[str, float]]:
    """ms of one decode step's GEMMs per method and M (32 layers of qkv, o, gate_up, down, and the head)."""
    out: dict[str, dict[str, float]] = {}
    methods = set.intersection(*(set(shapes[s]["methods"]) for s in STEP))
    for meth in sorted(methods):
        for M in Ms:
            try:
                ms = sum(k * shapes[s]["methods"][meth][str(M)]["ms"] for s, k in STEP.items())
                wb = sum(k * shapes[s]["methods"][meth][str(M)]["weight_bytes"] for s, k in STEP.items())
            except KeyError:
                continue
            out.setdefault(meth, {})[str(M)] = ms
            out[meth][f"GBps_{M}"] = wb / ms / 1e6
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keep = ["bf16 cuBLAS", "torch int8pack (per row)", "torch int4pack g32 (tinygemm)", "torch int4pack g128 (tinygemm)",
            "q8_0 dequant+cuBLAS (torch ops)", "q4_0 dequant+cuBLAS (torch ops)", "q8_0 triton gemv (best)",
            "q4_0 triton gemv (best)", "q4_1 triton gemv (best)", "q8_0 triton dequant+cuBLAS (best)",
            "q4_0 triton dequant+cuBLAS (best)", "q4_1 triton dequant+cuBLAS (best)"]
    step = report["decode_step_gemms_ms"]
    Ms = report["config"]["Ms"]
    fig, axes = plt.subplots(1, 2, figsize=(16, 6))
    names = [k for k in keep if k in step]
    base = step["bf16 cuBLAS"]
    w = 0.8 / len(Ms)
    for i, M in enumerate(Ms):
        vals = [base[str(M)] / step[k][str(M)] if str(M) in step[k] else 0 for k in names]
        axes[0].barh([j + i * w for j in range(len(names))], vals, w, label=f"M={M}")
    axes[0].set_yticks([j + w * (len(Ms) - 1) / 2 for j in range(len(names))], names, fontsize=8)
    axes[0].axvline(1.0, color="k", lw=0.8)
    axes[0].set_xlabel("speed-up over bf16 cuBLAS, one decode step's GEMMs (32 layers + head)")
    axes[0].legend()
    shapes = report["shapes"]
    labels = list(shapes)
    m1 = [k for k in names if "1" in shapes[labels[0]]["methods"].get(k, {})]
    w2 = 0.8 / len(m1)
    for i, k in enumerate(m1):
        axes[1].bar([j + i * w2 for j in range(len(labels))],
                    [shapes[s]["methods"].get(k, {}).get("1", {}).get("GBps", 0) for s in labels], w2, label=k)
    axes[1].set_xticks([j + 0.4 - w2 / 2 for j in range(len(labels))],
                       [f"{s}\n{shapes[s]['N']}x{shapes[s]['K']}" for s in labels], fontsize=8)
    axes[1].axhline(report["ceilings"]["copy_GBps"] / 2, color="k", ls="--", lw=0.8)
    axes[1].set_ylabel("GB/s at M = 1 (dashed: half the copy's read+write)")
    axes[1].legend(fontsize=6)
    c = report["config"]
    fig.suptitle(f"weight-only int8/int4 GEMMs, Llama-2-7B shapes, bf16 activations, {c['gpu']}, torch {c['torch']}, "
                 f"triton {c['triton']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/out/gpu-quant")
    ap.add_argument("--Ms", default="1,4,8,32")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--quick", action="store_true", help="fewer Triton block shapes")
    ap.add_argument("--scale", type=int, default=1, help="shapes divided by this (a smoke test on a CPU)")
    args = ap.parse_args()
    import triton

    torch.backends.cuda.matmul.allow_tf32 = False
    Ms = [int(m) for m in args.Ms.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    report: dict[str, Any] = {
        "config": {"Ms": Ms, "dtype": "bfloat16", "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
                   "triton": triton.__version__, "host": platform.node(), "rotate_bytes": ROTATE_BYTES},
        "ceilings": ceilings() if args.scale == 1 else {"copy_GBps": 1.0}, "shapes": {}}
    print("ceilings", report["ceilings"], flush=True)
    for name in args.shapes.split(","):
        N, K = (v // args.scale for v in SHAPES[name])
        report["shapes"][name] = bench_shape(name, N, K, Ms, args.quick)
        for meth, rows in report["shapes"][name]["methods"].items():
            if "x" in meth.split()[-1] and "(best)" not in meth:
                continue  # the sweep's points: JSON only
            print(f"{name:8s} {meth:34s} " + "  ".join(
                f"M={M}: {r['ms'] * 1e3:7.1f} us {r['GBps']:6.0f} GB/s err {r['rel_err'] or 0:.1e}" for M, r in rows.items()),
                  flush=True)
        for e in report["shapes"][name].get("errors", [])[:4]:
            print("  error:", e)
        (out / "gpu-quant.json").write_text(json.dumps(report, indent=1))  # partial results survive a timeout
    if all(s in report["shapes"] for s in STEP):
        report["decode_step_gemms_ms"] = step_table(report["shapes"], Ms)
        base = report["decode_step_gemms_ms"]["bf16 cuBLAS"]
        print("decode step's GEMMs (32 layers + head), ms and x over bf16 cuBLAS:")
        for meth, row in report["decode_step_gemms_ms"].items():
            if "(best)" in meth or "triton" not in meth:
                print(f"  {meth:34s} " + "  ".join(f"M={M}: {row[str(M)]:6.3f} ms x{base[str(M)] / row[str(M)]:.2f} "
                                                   f"{row[f'GBps_{M}']:5.0f} GB/s" for M in Ms if str(M) in row))
    report["wall_s"] = time.time() - t0
    (out / "gpu-quant.json").write_text(json.dumps(report, indent=1))
    if "decode_step_gemms_ms" in report:
        plot(report, out / "gpu-quant.png")
    print(f"wrote {out}/gpu-quant.json ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
