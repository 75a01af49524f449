"""Sweep the number of allocations T: the seed paper's Fig. 7/8 on this machine, with bmc-calibrate's prediction.

Part 1 (attention block, one layer, SmolLM2 shapes): N decode steps of KV update + attention through the
runtime's own cache and attention kernel (the native CPU step's attention on a CPU in float32, else SDPA), for
T = 1, 2, 4, ... up to T = N (iterative).
Part 2 (--e2e): end-to-end greedy decode of the real model (prompt N/4, generating to N) over T in a window of
powers of two around the predicted T (--e2e-window each side), widened while the fastest point is at an edge, so
that the measured best is bracketed. A full T range end to end takes hours at large N*B on 2 cores. With
--e2e-repeats K the window runs in K alternating rounds; each T keeps its fastest run, and the spread of the runs
says which T this machine's noise cannot tell apart from the best.

Points whose predicted time exceeds --budget-s are skipped and listed as such (the iterative end at large N*B
copies hundreds of GB); end-to-end points predicted over --e2e-budget-s likewise. Writes sweep_T.json and
sweep_T.png under --out (bench/out by default).

    python bench/sweep_T.py                        # N in {512, 2048, 8192}, B in {1, 8, 32}
    python bench/sweep_T.py --N 512 2048 --B 8 --e2e
    python bench/sweep_T.py --N 512 --B 1 8 --e2e --e2e-repeats 3
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
from bmc.analytic.profile import attention_kernel
from bmc.bench.layer import layer_attention
from bmc.kv import BMCCache, IterativeCache, r_from_T

OUT = Path(__file__).resolve().parent / "out"
SMOLLM2 = dict(heads=9, kv_heads=3, head_dim=64)


def attention_block_seconds(n: int, batch: int, T: int, dtype: torch.dtype) -> float:
    """N decode steps of one layer: reserve (allocate + copy at chunk boundaries), write k/v, attend."""
    h, kvh, d = SMOLLM2["heads"], SMOLLM2["kv_heads"], SMOLLM2["head_dim"]
    kw = dict(num_layers=1, batch_size=batch, num_kv_heads=kvh, head_dim=d, max_length=n, dtype=dtype)
    cache = IterativeCache(**kw) if T >= n else BMCCache(r=r_from_T(n, T), **kw)
    attend = layer_attention(cache, h)
    k = torch.randn(batch, kvh, 1, d, dtype=dtype)
    with torch.inference_mode():
        t0 = time.perf_counter()
        for _ in range(n):
            cache.reserve(1)
            cache.update(0, k, k)
            attend(1)
            cache.commit(1)
        return time.perf_counter() - t0


def e2e_seconds(model, n: int, batch: int, T: int) -> float:
    prompt = n // 4
    ids = [[(97 * b + 13 * i) % 10000 + 100 for i in range(prompt)] for b in range(batch)]
    kv = dict(kv="iterative") if T >= n else dict(kv="bmc", T=T)
    out = bmc.generate(model, ids, max_new_tokens=n - prompt, ignore_eos=True, **kv)
    return out.stats.decode_seconds


def e2e_window(model, n: int, b: int, pred: int, window: int, budget_s: float, repeats: int, row: dict) -> None:
    """End-to-end decode at powers of two around the predicted T, widened (up to 3 more steps) while the fastest
    point sits on an edge of the window that is not T = 1 or T = N. With repeats > 1 the window is run in that
    many rounds (each round visits every T, in an order that turns each round) and each T keeps its fastest run."""
    top = int(math.log2(n))
    lo, hi = max(0, int(math.log2(pred)) - window), min(top, int(math.log2(pred)) + window)
    times: dict[int, list[float]] = {}

    def run(i: int) -> bool:
        T = 2**i
        times.setdefault(T, []).append(e2e_seconds(model, n, b, T))
        print(f"N={n:5d} B={b:3d} T={T:5d} e2e_decode_s={times[T][-1]:.2f}", flush=True)
        return times[T][-1] <= budget_s

    def best() -> int:
        return min(times, key=lambda T: min(times[T]))

    if not run(int(math.log2(pred))):
        row["e2e_skipped"] = f"one point took {times[pred][0]:.0f}s > --e2e-budget-s"
        row["e2e_points"] = points(times)
        return
    span = list(range(lo, hi + 1))
    for k in range(repeats):
        turned = span[k % len(span):] + span[:k % len(span)]
        for i in (turned if k % 2 == 0 else turned[::-1]):
            if len(times.get(2**i, [])) <= k:
                run(i)
    for _ in range(3):
        if best() == 2**lo and lo > 0:
            lo -= 1
            edge = lo
        elif best() == 2**hi and hi < top:
            hi += 1
            edge = hi
        else:
            break
        for _ in range(repeats):
            run(edge)
    row["e2e_points"] = points(times)


def points(times: dict[int, list[float]]) -> list[dict]:
    return [{"T": T, "e2e_decode_s": min(v), "e2e_runs_s": v} for T, v in sorted(times.items())]


def summarise(row: dict, points: list[dict], key: str, runs_key: str | None = None) -> dict | None:
    """Best T and the time at the predicted T over the best. Where each T was run more than once (its times
    under `runs_key`), the spread of its runs (slowest / fastest - 1, the median over T) is this machine's noise, and `T_within_noise` lists the T
    whose fastest run is within that much of the best: the curve cannot tell them apart."""
    timed = [p for p in points if key in p]
    if not timed:
        return None
    pred = row["predicted_T"]
    best = min(timed, key=lambda p: p[key])
    at_pred = next((p for p in timed if p["T"] == pred), None)
    out = {"best_T": best["T"], "ratio_at_predicted": at_pred[key] / best[key] if at_pred else None,
           "within_one_pow2": abs(math.log2(pred) - math.log2(best["T"])) <= 1}
    runs = [p[runs_key] for p in timed if runs_key is not None and len(p.get(runs_key, [])) > 1]
    spreads = sorted(max(r) / min(r) - 1 for r in runs)
    if spreads:
        noise = spreads[len(spreads) // 2]
        out["noise"] = noise
        out["T_within_noise"] = [p["T"] for p in timed if p[key] <= best[key] * (1 + noise)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--N", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--B", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--budget-s", type=float, default=30.0, help="skip attention-block points predicted longer")
    ap.add_argument("--e2e", action="store_true", help="also time end-to-end decode of the real model")
    ap.add_argument("--e2e-window", type=int, default=2, help="powers of two each side of the predicted T")
    ap.add_argument("--e2e-budget-s", type=float, default=240.0, help="skip a configuration whose first point is longer")
    ap.add_argument("--e2e-repeats", type=int, default=1, help="rounds over the window; each T keeps its fastest")
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
    model = bmc.load(quant="none") if args.e2e else None
    if model is not None:
        e2e_seconds(model, 64, 1, 1)  # warm-up: first-call costs stay out of the first point
    results = []
    for n in args.N:
        for b in args.B:
            shape = Shape(batch=b, layers=1, **SMOLLM2)
            pred = best_T(n, shape, consts)
            row = {"N": n, "B": b, "predicted_T": pred, "points": []}
            for T in [2**i for i in range(int(math.log2(n)) + 1)]:
                est = predicted_time(T, n, shape, consts)
                point = {"T": T, "predicted_s": est}
                if est > args.budget_s:
                    point["skipped"] = f"predicted {est:.0f}s > budget"
                else:
                    point["attention_block_s"] = attention_block_seconds(n, b, T, dtype)
                row["points"].append(point)
                print(f"N={n:5d} B={b:3d} T={T:5d} " + "  ".join(
                    f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in point.items() if k != "T"),
                    flush=True)
            row["attention_block"] = summarise(row, row["points"], "attention_block_s")
            if model is not None and n <= model.max_context:
                e2e_window(model, n, b, pred, args.e2e_window, args.e2e_budget_s, args.e2e_repeats, row)
                row["e2e_decode"] = summarise(row, row["e2e_points"], "e2e_decode_s", "e2e_runs_s")
            results.append(row)
            (out_dir / "sweep_T.json").write_text(json.dumps(report(args, consts, results), indent=2))  # so far
    (out_dir / "sweep_T.json").write_text(json.dumps(report(args, consts, results), indent=2))
    plot(results, out_dir / "sweep_T.png")
    print(f"wrote {out_dir / 'sweep_T.json'} and {out_dir / 'sweep_T.png'}")
    print(f"{'N':>6} {'B':>4} {'pred T':>7} {'block best T':>13} {'block pred/best':>16} {'e2e best T':>11} "
          f"{'e2e pred/best':>14}  e2e T within noise")
    for r in results:
        a, e = r.get("attention_block") or {}, r.get("e2e_decode") or {}
        fmt = lambda x: f"{x:.3f}" if x else "-"  # noqa: E731
        print(f"{r['N']:>6} {r['B']:>4} {r['predicted_T']:>7} {a.get('best_T', '-')!s:>13} "
              f"{fmt(a.get('ratio_at_predicted')):>16} {e.get('best_T', '-')!s:>11} {fmt(e.get('ratio_at_predicted')):>14}  "
              + (f"{e['T_within_noise']} (noise {100 * e['noise']:.1f}%)" if "noise" in e else "-"))


def report(args: argparse.Namespace, consts, results: list[dict]) -> dict:
    return {"machine": {"threads": args.threads, "dtype": "float32", "device": "cpu", "torch": torch.__version__,
                        "attention_kernel": attention_kernel(torch.device("cpu"), torch.float32)},
            "shapes": SMOLLM2, "constants": vars(consts), "results": results}


def plot(results: list[dict], path: Path) -> None:
    """Latency / best vs T per N (columns): the attention block on top, end-to-end decode below when measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted({r["N"] for r in results})
    parts = [(field, key, what) for field, key, what in (
        ("points", "attention_block_s", "attention block (one layer)"),
        ("e2e_points", "e2e_decode_s", "end-to-end decode (real model)"))
        if any(key in p for r in results for p in r.get(field, []))]
    fig, axes = plt.subplots(len(parts), len(ns), figsize=(max(6, 5 * len(ns)), 4 * len(parts)), squeeze=False)
    for row_axes, (field, key, what) in zip(axes, parts):
        for ax, n in zip(row_axes, ns):
            for r in [r for r in results if r["N"] == n]:
                pts = [p for p in r.get(field, []) if key in p]
                if not pts:
                    continue
                best = min(p[key] for p in pts)
                line, = ax.plot([p["T"] for p in pts], [p[key] / best for p in pts], "o-", label=f"B={r['B']}")
                ax.axvline(r["predicted_T"], color=line.get_color(), ls=":", alpha=0.7)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("allocations T (T = N is iterative)")
            ax.set_ylabel("latency / best")
            ax.set_title(f"{what}, N = {n} (dotted: predicted T)", fontsize=9)
            ax.legend()
            ax.grid(alpha=0.3)
    fig.suptitle("BMC's T on this CPU: SmolLM2 shapes (H=9, H_kv=3, d=64), fp32", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
