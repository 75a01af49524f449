"""Sweep the number of allocations T: the seed paper's Fig. 7/8 on this machine, with bmc-calibrate's prediction.

Part 1 (attention block, one layer, SmolLM2 shapes): N decode steps of KV update + attention through the
runtime's own cache and attention, for T = 1, 2, 4, ... up to T = N (iterative).
Part 2 (--e2e): end-to-end greedy decode of the real model over the same T values (slow: minutes per point).

Points whose predicted time exceeds --budget-s are skipped and listed as such (the iterative end at large N*B
copies hundreds of GB). Writes bench/out/sweep_T.json and bench/out/sweep_T.png.

    python bench/sweep_T.py                        # N in {512, 2048, 8192}, B in {1, 8, 32}
    python bench/sweep_T.py --N 512 2048 --B 8 --e2e
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

import bmc
from bmc.analytic import Shape, best_T, default_profile_path, load_profile, predicted_time
from bmc.attention import dense_attention
from bmc.kv import BMCCache, IterativeCache, r_from_T

OUT = Path(__file__).resolve().parent / "out"
SMOLLM2 = dict(heads=9, kv_heads=3, head_dim=64)


def attention_block_seconds(n: int, batch: int, T: int, dtype: torch.dtype) -> float:
    """N decode steps of one layer: reserve (allocate + copy at chunk boundaries), write k/v, attend."""
    h, kvh, d = SMOLLM2["heads"], SMOLLM2["kv_heads"], SMOLLM2["head_dim"]
    kw = dict(num_layers=1, batch_size=batch, num_kv_heads=kvh, head_dim=d, max_length=n, dtype=dtype)
    cache = IterativeCache(**kw) if T >= n else BMCCache(r=r_from_T(n, T), **kw)
    q = torch.randn(batch, h, 1, d, dtype=dtype)
    k = torch.randn(batch, kvh, 1, d, dtype=dtype)
    with torch.inference_mode():
        t0 = time.perf_counter()
        for _ in range(n):
            cache.reserve(1)
            K, V = cache.update(0, k, k)
            dense_attention(q, K, V, cache.bias, d**-0.5)
            cache.commit(1)
        return time.perf_counter() - t0


def e2e_seconds(model, n: int, batch: int, T: int) -> float:
    prompt = n // 4
    ids = [[(97 * b + 13 * i) % 10000 + 100 for i in range(prompt)] for b in range(batch)]
    kv = dict(kv="iterative") if T >= n else dict(kv="bmc", T=T)
    out = bmc.generate(model, ids, max_new_tokens=n - prompt, ignore_eos=True, **kv)
    return out.stats.decode_seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--N", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--B", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--budget-s", type=float, default=30.0, help="skip points predicted to take longer")
    ap.add_argument("--e2e", action="store_true", help="also time end-to-end decode of the real model")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype, device = torch.float32, torch.device("cpu")
    consts = load_profile(default_profile_path(device, dtype), device, dtype)
    if consts is None:
        sys.exit("no calibration profile for this machine: run bmc-calibrate first")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = bmc.load() if args.e2e else None
    L = model.config.num_layers if model else 1
    results = []
    for n in args.N:
        for b in args.B:
            shape = Shape(batch=b, layers=1, **SMOLLM2)
            pred = best_T(n, shape, consts)
            Ts = [2**i for i in range(int(math.log2(n)) + 1)]
            row = {"N": n, "B": b, "predicted_T": pred, "points": []}
            for T in Ts:
                est = predicted_time(T, n, shape, consts)
                point = {"T": T, "predicted_s": est}
                if est > args.budget_s:
                    point["skipped"] = f"predicted {est:.0f}s > budget"
                else:
                    point["attention_block_s"] = attention_block_seconds(n, b, T, dtype)
                    if model is not None and n <= model.max_context:
                        est_e2e = est * L
                        if est_e2e <= 10 * args.budget_s:
                            point["e2e_decode_s"] = e2e_seconds(model, n, b, T)
                row["points"].append(point)
                print(f"N={n:5d} B={b:3d} T={T:5d} " + "  ".join(
                    f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in point.items() if k != "T"),
                    flush=True)
            for key in ("attention_block_s", "e2e_decode_s"):
                timed = [p for p in row["points"] if key in p]
                if timed:
                    best = min(timed, key=lambda p: p[key])
                    at_pred = next((p for p in timed if p["T"] == pred), None)
                    row[key.replace("_s", "")] = {
                        "best_T": best["T"],
                        "ratio_at_predicted": at_pred[key] / best[key] if at_pred else None,
                        "within_one_pow2": abs(math.log2(pred) - math.log2(best["T"])) <= 1,
                    }
            results.append(row)
    report = {"machine": {"threads": args.threads, "dtype": "float32", "device": "cpu", "torch": torch.__version__},
              "shapes": SMOLLM2, "constants": vars(consts), "results": results}
    (out_dir / "sweep_T.json").write_text(json.dumps(report, indent=2))
    plot(results, out_dir / "sweep_T.png")
    print(f"wrote {out_dir / 'sweep_T.json'} and {out_dir / 'sweep_T.png'}")
    print(f"{'N':>6} {'B':>4} {'best T':>7} {'pred T':>7} {'latency at pred / best':>24}")
    for r in results:
        a = r.get("attention_block") or {}
        ratio = a.get("ratio_at_predicted")
        print(f"{r['N']:>6} {r['B']:>4} {a.get('best_T', '-')!s:>7} {r['predicted_T']:>7} "
              f"{(f'{ratio:.3f}' if ratio else '-'):>24}")


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted({r["N"] for r in results})
    fig, axes = plt.subplots(1, len(ns), figsize=(5 * len(ns), 4), squeeze=False)
    for ax, n in zip(axes[0], ns):
        for r in [r for r in results if r["N"] == n]:
            pts = [p for p in r["points"] if "attention_block_s" in p]
            if not pts:
                continue
            best = min(p["attention_block_s"] for p in pts)
            line, = ax.plot([p["T"] for p in pts], [p["attention_block_s"] / best for p in pts], "o-",
                            label=f"B={r['B']}")
            ax.axvline(r["predicted_T"], color=line.get_color(), ls=":", alpha=0.7)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("allocations T (T = N is iterative)")
        ax.set_ylabel("attention-block latency / best")
        ax.set_title(f"N = {n} (dotted: predicted T)")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("BMC: one layer, SmolLM2 shapes (H=9, H_kv=3, d=64), fp32, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
