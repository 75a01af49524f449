"""What leaving cuDNN's attention out costs on CUDA (bmc/attention/dense.py: cuDNN's SDPA is not deterministic run
to run, bench/gpu_determinism.py). One process, one Llama-2-7B-shaped bf16 model (random weights); per batch the
bmc engine decodes with SDPA's backends as bmc runs them (flash, memory-efficient, math) and with cuDNN first
(BMC_CUDA_SDPA=cudnn's order), interleaved, each with its graphs captured again before its runs.

    python bench/gpu_sdpa.py --out DIR             # JSON under DIR

Also one layer's decode attention alone (dense_attention, [B, 32, 1, 128] against a capacity of `--caps`), both
orders, µs (CUDA events, median of 200 after 20 warm-up calls)."""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import bmc.attention.dense as dense

ORDERS = {"no-cudnn (default)": False, "cudnn first": True}  # dense.CUDNN_FIRST


def attention_us(B: int, cap: int) -> dict[str, float]:
    q = torch.randn(B, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, 32, cap, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    bias = torch.zeros(B, 1, 1, cap, device="cuda", dtype=torch.bfloat16)
    bias[..., cap * 3 // 4:] = torch.finfo(torch.bfloat16).min
    out = {}
    for name, order in ORDERS.items():
        dense.CUDNN_FIRST = order
        for _ in range(20):
            dense.dense_attention(q, k, v, bias, 128**-0.5)
        times = []
        for _ in range(200):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dense.dense_attention(q, k, v, bias, 128**-0.5)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        out[name] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/out/gpu-sdpa")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--caps", default="384,1024,4096")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from bmc.bench.engines import random_llama_7b, run_bmc
    from bmc.graphs import graph_store

    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
                    "prompt": args.prompt, "gen": args.gen, "dtype": "bfloat16", "attention_us": {}, "decode": {}}
    for B in map(int, args.batches.split(",")):
        for cap in map(int, args.caps.split(",")):
            r = attention_us(B, cap)
            report["attention_us"][f"B{B}-cap{cap}"] = r
            print(f"attention B={B} cap={cap}: " + ", ".join(f"{k} {v:.1f} us" for k, v in r.items()), flush=True)
    model = random_llama_7b(args.layers)
    for B in map(int, args.batches.split(",")):
        prompts = [[(13 * b + 7 * i) % 31990 + 5 for i in range(args.prompt)] for b in range(B)]
        tps: dict[str, list[float]] = {k: [] for k in ORDERS}
        for _ in range(args.rounds):
            for name, order in ORDERS.items():
                dense.CUDNN_FIRST = order
                graph_store(model).arena.free()  # graphs hold the kernels they were captured with
                run_bmc(model, prompts, 8, kv="bmc", graph_warmup=True)  # captures this order's graphs
                r = run_bmc(model, prompts, args.gen, kv="bmc", graph_warmup=True)
                tps[name].append(r.summary(B)["decode_tokens_per_s"])
        med = {k: statistics.median(v) for k, v in tps.items()}
        report["decode"][f"B{B}"] = {"tokens_per_s": tps, "median": med,
                                     "no_cudnn_over_cudnn": med["no-cudnn (default)"] / med["cudnn first"]}
        print(f"decode B={B}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in med.items())
              + f" (no-cudnn / cudnn x{report['decode'][f'B{B}']['no_cudnn_over_cudnn']:.3f}; runs {tps})", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-sdpa.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
