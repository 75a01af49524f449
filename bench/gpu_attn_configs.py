"""The Triton decode attention's launch choices, measured (fused_triton.decode_attention's keywords): columns a
loop step, tensor-core products for one query head a KV head (padded to 16 rows) or not, warps, software pipeline
stages, programs an SM. Each configuration on each shape: one layer's attention, bf16, [B, H, 1, 128] against H_kv
heads of a capacity (a quarter masked), 50 calls captured in one CUDA graph, median of 10 replays divided by 50,
µs and GB/s of K and V read; checked against SDPA within the kernel's bound first.

    python bench/gpu_attn_configs.py --out DIR       # DIR/gpu-attn-configs.json and .png
    python bench/gpu_attn_configs.py --plot DIR/gpu-attn-configs.json   # the PNG again from a run's JSON"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from bmc.attention.dense import dense_attention
from bmc.bench.engines import graph_call_us

SHAPES = [(1, 32, 32, 384), (1, 32, 32, 4096), (32, 32, 32, 384), (32, 32, 32, 4096),
          (1, 32, 8, 4096), (32, 32, 8, 1024), (1, 16, 2, 4096), (32, 16, 2, 1024)]  # B, H, H_kv, capacity


def plot(report: dict, path: Path) -> None:
    """Per shape: SDPA (without cuDNN), the best configuration, and the rule the code took from these runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bmc.bench.plots import engine_bars, save_titled

    rows = {}
    for name, sh in report["shapes"].items():
        ok = [c for c in sh["configs"] if c["ok"]]
        B, _, kvh, _ = (int(part.lstrip("BHKVcap")) for part in name.split("-"))
        many = B * kvh >= 132  # rows x KV heads fill the H200's SMs: 32 columns a block, else 64
        rule = [c for c in ok if c["dot"] and c["block"] == (32 if many else 64) and c["warps"] == 4
                and c["stages"] == 3 and c["per_sm"] == 2]
        rows[name.replace("-cap", "\ncap ")] = {"SDPA without cuDNN": {"us": sh["sdpa_us"]},
                                                "best configuration": {"us": ok[0]["us"]},
                                                "the rule (32/64 columns, 3 stages)": {"us": rule[0]["us"] if rule else 0}}
    fig, ax = plt.subplots(figsize=(13, 4.5))
    engine_bars(ax, rows, list(rows), "us", "one layer's decode attention alone (µs, lower is better)")
    ax.tick_params(axis="x", labelsize=7)
    ax.set_yscale("log")  # 8 to 950 µs: small shapes stay readable
    ax.legend(fontsize=7)
    save_titled(fig, f"decode attention launch choices (a sweep before the splits were folded in one pass), "
                f"{report['device']}, torch {report['torch']}, bf16, head_dim "
                "128, a quarter of the capacity masked", str(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/out/gpu-attn-configs")
    ap.add_argument("--plot", help="only write the PNG of this JSON (beside it)")
    args = ap.parse_args()
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), Path(args.plot).with_suffix(".png"))
        return
    from bmc.models.fused_triton import decode_attention

    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    for B, H, KVH, S in SHAPES:
        q = torch.randn(B, H, 1, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, KVH, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        bias = torch.zeros(B, 1, 1, S, device="cuda", dtype=torch.bfloat16)
        bias[..., S * 3 // 4:] = torch.finfo(torch.bfloat16).min
        want = dense_attention(q, k, v, bias, 128**-0.5)
        tol = torch.finfo(torch.bfloat16).eps * v.float().abs().max()
        gbytes = 2 * k.numel() * 2 / 1e9
        rows = []
        dots = [False, True] if H == KVH else [True]
        for dot, block, warps, stages, per_sm in itertools.product(dots, (32, 64, 128), (4, 8), (1, 3), (2, 4, 8)):
            kw = dict(dot=dot, block=block, warps=warps, stages=stages, per_sm=per_sm)
            try:
                got = decode_attention(q, k, v, bias, 128**-0.5, **kw)
                ok = bool((got.float() - want.float()).abs().max() <= tol)
                us = float("nan")
                if ok:
                    us = graph_call_us(lambda: decode_attention(q, k, v, bias, 128**-0.5, **kw), replays=10)
            except Exception as e:  # a configuration the compiler refuses (shared memory, registers)
                ok, us = False, float("nan")
                kw["error"] = str(e).splitlines()[0][:120]
            rows.append({**kw, "ok": ok, "us": us, "GB/s": gbytes / us * 1e6 if ok else None})
        sdpa = graph_call_us(lambda: dense_attention(q, k, v, bias, 128**-0.5), replays=10)
        rows.sort(key=lambda r: (not r["ok"], r["us"]))
        name = f"B{B}-H{H}-KV{KVH}-cap{S}"
        report["shapes"][name] = {"sdpa_us": sdpa, "configs": rows}
        best = rows[0]
        print(f"{name}: sdpa {sdpa:.1f} us; best {best['us']:.1f} us ({best['GB/s']:.0f} GB/s) "
              f"{ {k: best[k] for k in ('dot', 'block', 'warps', 'stages', 'per_sm')} }; next "
              + "; ".join(f"{r['us']:.1f} {r['dot']:d}/{r['block']}/{r['warps']}/{r['stages']}/{r['per_sm']}"
                          for r in rows[1:6]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-attn-configs.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "gpu-attn-configs.png")


if __name__ == "__main__":
    main()
