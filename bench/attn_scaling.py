"""Decode attention alone (NativeDecoder.attention_step) by threads: batch 8 of the model's heads, float32 and int8
KV, cached (one layer of 512 keys stepped again and again) and streamed (30 layers of 4K context), in ns per
(row, KV head, key) and in core-ns (x threads). Prints a table; no result file (docs/performance.md#kv-dtype keeps
the 16-core figures).

    python bench/attn_scaling.py [--model PATH] [--threads 1,2,4,8,16]"""
from __future__ import annotations

import argparse
import time

import torch

import bmc
from bmc.kv import KV_FORMATS


def ns_per_key(dec, cfg, B: int, cap: int, L: int, reps: int, kv_dtype: str) -> float:
    q = torch.randn(B, 1, cfg.num_heads * cfg.head_dim)
    bias = torch.zeros(B, 1, 1, cap)
    kv = KV_FORMATS[kv_dtype].encode(torch.randn(L, 2, B, cfg.num_kv_heads, cap, cfg.head_dim)).contiguous()
    for layer in range(L):
        dec.attention_step(q, kv, layer, bias, [], [], [])
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for layer in range(L):
            dec.attention_step(q, kv, layer, bias, [], [], [])
        best = min(best, (time.perf_counter() - t0) / L)
    return best / (B * cfg.num_kv_heads * cap) * 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--threads", default="1,2,4,8,16")
    args = p.parse_args()
    model = bmc.load(args.model)
    dec, cfg = model.net.native_decoder(), model.config
    if dec is None:
        raise SystemExit("the native kernel did not build")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        row = [f"threads {threads:2d}"]
        for kv_dtype in ("float32", "int8"):
            cached = ns_per_key(dec, cfg, 8, 512, 1, 50, kv_dtype)
            streamed = ns_per_key(dec, cfg, 8, 4096, 30, 3, kv_dtype)
            row.append(f"{kv_dtype}: cached {cached:.2f} ns/key ({cached * threads:.1f} core-ns), "
                       f"streamed {streamed:.2f} ns/key")
        print("  ".join(row), flush=True)


if __name__ == "__main__":
    main()
