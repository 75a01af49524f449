"""The CUDA decode attention, three ways: bmc's Triton kernel (fused_triton.decode_attention, the default), SDPA
with the backends bmc allows (flash, memory-efficient, math) and SDPA with cuDNN first (BMC_CUDA_SDPA=cudnn's
order; cuDNN is not deterministic run to run, bench/gpu_determinism.py). One process, one Llama-2-7B-shaped bf16
model (random weights); per batch the bmc engine decodes with each, interleaved, graphs captured again for each.

    python bench/gpu_sdpa.py --out DIR             # JSON and PNG under DIR
    python bench/gpu_sdpa.py --plot DIR/gpu-sdpa.json   # the PNG again from a run's JSON

Also one layer's decode attention alone, [B, H, 1, 128] against H_kv heads of a capacity of `--caps` (a quarter
of it masked), µs a call: 50 calls captured in one CUDA graph, median of 20 replays, divided by 50."""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import bmc.attention.dense as dense

import bmc.models.decode_cuda as decode_cuda

# name: (decode_cuda.ATTENTION, dense.CUDNN_FIRST)
ORDERS = {"triton (default)": ("triton", False), "sdpa no-cudnn": ("sdpa", False), "sdpa cudnn first": ("sdpa", True)}


def attention_us(B: int, H: int, KVH: int, cap: int) -> dict[str, float]:
    from bmc.bench.engines import graph_call_us
    from bmc.models.fused_triton import decode_attention

    q = torch.randn(B, H, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, KVH, cap, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    bias = torch.zeros(B, 1, 1, cap, device="cuda", dtype=torch.bfloat16)
    bias[..., cap * 3 // 4:] = torch.finfo(torch.bfloat16).min
    out = {}
    for name, (kind, order) in ORDERS.items():
        dense.CUDNN_FIRST = order
        fn = decode_attention if kind == "triton" else dense.dense_attention
        out[name] = graph_call_us(lambda: fn(q, k, v, bias, 128**-0.5))
    return out


def plot(report: dict, path: Path) -> None:
    """Decode tok/s by batch (each attention, over cuDNN's) and one layer's attention alone, µs by shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bmc.bench.plots import engine_bars, save_titled

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [1, 2.4]})
    decode = {k: {name: {"tok/s": v} for name, v in r["median"].items()} for k, r in report["decode"].items()}
    engine_bars(a, decode, list(decode), "tok/s", f"decode, {report['layers']}-layer 7B shape (tok/s)")
    a.legend(fontsize=7)
    alone = {k.replace("-cap", "\ncap "): {name: {"us": v} for name, v in r.items()}
             for k, r in report["attention_us"].items()}
    engine_bars(b, alone, list(alone), "us", "one layer's decode attention alone (µs, lower is better)")
    b.tick_params(axis="x", labelsize=6)
    b.set_yscale("log")  # 7 to 1000 µs: small shapes stay readable
    save_titled(fig, f"{report['device']}, torch {report['torch']}, {report['dtype']}, prompt {report['prompt']}, "
                f"{report['gen']} generated", str(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/out/gpu-sdpa")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--caps", default="384,1024,4096")
    ap.add_argument("--heads", default="32/32,32/8,16/2", help="H/H_kv pairs for the attention alone")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--plot", help="only write the PNG of this JSON (beside it)")
    args = ap.parse_args()
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), Path(args.plot).with_suffix(".png"))
        return
    from bmc.bench.engines import random_llama_7b, run_bmc
    from bmc.graphs import graph_store

    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
                    "prompt": args.prompt, "gen": args.gen, "dtype": "bfloat16", "attention_us": {}, "decode": {}}
    for B in map(int, args.batches.split(",")):
        for hk in args.heads.split(","):
            H, KVH = map(int, hk.split("/"))
            for cap in map(int, args.caps.split(",")):
                r = attention_us(B, H, KVH, cap)
                report["attention_us"][f"B{B}-H{H}-KV{KVH}-cap{cap}"] = r
                print(f"attention B={B} H={H}/{KVH} cap={cap}: " + ", ".join(f"{k} {v:.1f} us" for k, v in r.items()),
                      flush=True)
    model = random_llama_7b(args.layers)
    for B in map(int, args.batches.split(",")):
        prompts = [[(13 * b + 7 * i) % 31990 + 5 for i in range(args.prompt)] for b in range(B)]
        tps: dict[str, list[float]] = {k: [] for k in ORDERS}
        for _ in range(args.rounds):
            for name, (kind, order) in ORDERS.items():
                decode_cuda.ATTENTION, dense.CUDNN_FIRST = kind, order
                graph_store(model).arena.free()  # graphs hold the kernels they were captured with
                run_bmc(model, prompts, 8, kv="bmc", graph_warmup=True)  # captures this order's graphs
                r = run_bmc(model, prompts, args.gen, kv="bmc", graph_warmup=True)
                tps[name].append(r.summary(B)["decode_tokens_per_s"])
        med = {k: statistics.median(v) for k, v in tps.items()}
        ratios = {k: med[k] / med["sdpa cudnn first"] for k in ORDERS}
        report["decode"][f"B{B}"] = {"tokens_per_s": tps, "median": med, "over_cudnn": ratios}
        print(f"decode B={B}: " + ", ".join(f"{k} {v:.1f} tok/s (x{ratios[k]:.3f} cudnn)" for k, v in med.items())
              + f"; runs {tps}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-sdpa.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "gpu-sdpa.png")


if __name__ == "__main__":
    main()
