"""SparQ decode attention step time vs dense over context length and batch (the SparQ paper's Fig. 8 analog, on
this CPU), at the default model's head shapes (9 query heads, 3 KV heads, d = 64).

One "step" is one decode query per row through `layers` distinct layers' caches (so the KV is not cache-resident,
as in a real model), each a BMC buffer with masked padding rows beyond the context. SparQ reads its
dimension-major K copy (kept by the runtime) for step 1, and runs in one fused C++ call per layer when it builds
(bmc/kernels/cpu/sparq.cpp). Dense is the kernel a dense decode step runs here (the native CPU step's attention;
SDPA is reported beside it). Output is checked against dense at r = d, k = S first.

`--kv-dtypes float32,int8` measures each KV format (bmc/kv/formats.py): both dense and SparQ read the rows as
stored (SparQ's mirror holds the stored values, an int8 one with its columns' scales), and each SparQ row's
speedup is over dense attention of the same format; `speedup_vs_float32_dense` compares with float32 dense.

    python bench/sparq_speed.py             # writes bench/out/sparq_speed.json and .png
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from bmc.attention import dense_attention, sparq_attention, sparq_budget
from bmc.kernels.native import native_attention
from bmc.kv.formats import KV_FORMATS

OUT = Path(__file__).resolve().parent / "out"
H, KVH, D = 9, 3, 64


def median_ms(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e3 * sorted(ts)[len(ts) // 2]


@torch.inference_mode()
def measure(batch: int, S: int, layers: int, repeats: int, compressions: list[float], kv_dtype: str) -> list[dict]:
    torch.manual_seed(0)
    fmt = KV_FORMATS[kv_dtype]
    cap = S + 64  # the BMC chunk's padding rows: masked, never read by SparQ
    kv = [fmt.encode(torch.randn(2, batch, KVH, cap, D)) for _ in range(layers)]  # rows as the cache stores them
    mirrors = [fmt.split(x[0]) for x in kv]
    Kt = [values.transpose(-1, -2).contiguous() for values, _ in mirrors]
    Kt_scale = [None if sc is None else sc.contiguous() for _, sc in mirrors]
    q = torch.randn(batch, H, 1, D)
    bias = torch.zeros(batch, 1, 1, cap)
    bias[..., S:] = torch.finfo(torch.float32).min
    scale = D**-0.5
    ref = dense_attention(q, fmt.decode(kv[0][0], q.dtype), fmt.decode(kv[0][1], q.dtype), bias, scale)
    full, _ = sparq_attention(q, kv[0][0][:, :, :S], kv[0][1][:, :, :S], bias[..., :S], scale, D, S, Kt[0][..., :S],
                              fmt=fmt, kt_scale=None if Kt_scale[0] is None else Kt_scale[0][..., :S])
    torch.testing.assert_close(full, ref, rtol=1e-4, atol=1e-4)  # r = d, k = S is dense over the same rows

    # dense reads the chunk's whole capacity (as the runtime's dense path does: padding is masked, not skipped),
    # on the kernel a dense decode step runs here (the native step's attention on CPU float32), and on SDPA
    t_sdpa = median_ms(lambda: [dense_attention(q, fmt.decode(x[0], q.dtype), fmt.decode(x[1], q.dtype), bias, scale)
                                for x in kv], repeats) / layers
    dec = native_attention(H, KVH, D)
    t_dense = t_sdpa
    if dec is not None:
        qn, kv6 = q.reshape(batch, 1, H * D), [x[None] for x in kv]  # [1 layer, 2, B, kvh, cap, d]
        t_dense = median_ms(lambda: [dec.attention_step(qn, x, 0, bias, [], [], []) for x in kv6], repeats) / layers
    rows = []
    for c in compressions:
        r, k = sparq_budget(c, S, D)

        def step() -> None:
            for x, kt, ks in zip(kv, Kt, Kt_scale):
                sparq_attention(q, x[0][:, :, :S], x[1][:, :, :S], bias[..., :S], scale, r, k, kt[..., :S],
                                window=k // 4, fmt=fmt, kt_scale=None if ks is None else ks[..., :S])

        t = median_ms(step, repeats) / layers
        rows.append({"kv_dtype": kv_dtype, "batch": batch, "context": S, "compression": c, "r": r, "k": k,
                     "dense_ms": t_dense, "dense_sdpa_ms": t_sdpa, "sparq_ms": t, "speedup": t_dense / t,
                     "ideal_speedup": 1 / c})
        print(f"{kv_dtype:8s} B={batch:3d} S={S:5d} 1/{round(1 / c)}: r={r:2d} k={k:3d} dense {t_dense:7.3f} ms  "
              f"sparq {t:7.3f} ms  {t_dense / t:5.2f}x", flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    kv_dtypes = list(dict.fromkeys(r["kv_dtype"] for r in rows))
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), sharey=True)
    axes = list(axes) if len(batches) > 1 else [axes]
    for ax, b in zip(axes, batches):
        for ci, c in enumerate(sorted({r["compression"] for r in rows}, reverse=True)):
            for kv_dtype, ls in zip(kv_dtypes, styles):
                pts = sorted((r["context"], r["speedup_vs_float32_dense"]) for r in rows
                             if r["batch"] == b and r["compression"] == c and r["kv_dtype"] == kv_dtype)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", ls=ls, color=f"C{ci}",
                        label=f"1/{round(1 / c)} transfers, {kv_dtype} KV")
        ax.axhline(1.0, color="k", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length S")
        ax.set_title(f"batch {b}")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("attention step speedup over float32 dense")
    fig.suptitle(f"SparQ attention step vs dense (9 q / 3 kv heads, d=64, fp32 queries, "
                 f"{torch.get_num_threads()} threads, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,2048,4096,8192")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--compressions", default="0.5,0.25,0.125")
    ap.add_argument("--layers", type=int, default=8, help="distinct layer caches per step (defeats the CPU cache)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv-dtypes", default="float32", help="comma-separated KV formats: float32, bfloat16, "
                    "float16, int8")
    ap.add_argument("--out", default=str(OUT / "sparq_speed.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    comps = [float(c) for c in args.compressions.split(",")]
    rows = [row for kv_dtype in args.kv_dtypes.split(",") for b in map(int, args.batches.split(","))
            for S in map(int, args.contexts.split(","))
            for row in measure(b, S, args.layers, args.repeats, comps, kv_dtype)]
    float_dense = {(r["batch"], r["context"]): r["dense_ms"] for r in rows if r["kv_dtype"] == "float32"}
    for r in rows:  # against float32 dense where it was measured, else against the same format's dense
        r["speedup_vs_float32_dense"] = float_dense.get((r["batch"], r["context"]), r["dense_ms"]) / r["sparq_ms"]
    from bmc.kernels.sparq import fused_decode

    meta = {"heads": H, "kv_heads": KVH, "head_dim": D, "dtype": "float32", "kv_dtypes": args.kv_dtypes.split(","),
            "device": "cpu", "host": platform.node(),
            "sparq": "fused C++ kernel (steps 1-3)" if fused_decode() is not None else "PyTorch ops",
            "dense": "native CPU step's attention" if native_attention(H, KVH, D) is not None else "SDPA",
            "threads": torch.get_num_threads(), "layers_per_step": args.layers, "torch": torch.__version__}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
