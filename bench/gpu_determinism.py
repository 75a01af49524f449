"""Is a CUDA bf16 decode deterministic run to run? (issue 48, "noticed": batch-32 runs parted after 5-85 tokens.)

    python bench/gpu_determinism.py --out DIR          # every mode, each in a process of its own

Each mode runs generate() `--runs` times in one process on the same prompts (a Llama-2-7B shape cut to `--layers`
layers, random bf16 weights, greedy, ignore_eos) and reports, for every run after the first, the first generated
position at which some row differs from the first run (None: identical). Modes:
- default: CUDA graphs (captured before the runs), steps run ahead;
- no-ahead: graphs, run_ahead off;
- eager: no graphs;
- det: torch.use_deterministic_algorithms(True) with CUBLAS_WORKSPACE_CONFIG=:4096:8 (torch then fills new
  tensors with NaN: a read of memory never written shows as NaN tokens, not as drift);
- cudnn: BMC_CUDA_SDPA=cudnn, cuDNN's attention first (bmc's CUDA attention before session 39; the "no-cudnn-sdpa"
  mode of bench/results/h100/gpu-determinism/ was then the only one without it);
- no-reduced: cuBLAS bf16 GEMMs without reduced-precision reductions."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MODES = ["default", "no-ahead", "eager", "det", "cudnn", "no-reduced"]


def one_mode(mode: str, args) -> dict:
    import torch

    from bmc.bench.engines import random_llama_7b, run_bmc
    from bmc.bench.harness import first_divergence

    if mode == "det":
        torch.use_deterministic_algorithms(True, warn_only=True)
    if mode == "no-reduced":
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    model = random_llama_7b(args.layers)
    prompts = [[(13 * b + 7 * i) % 31990 + 5 for i in range(args.prompt)] for b in range(args.batch)]
    kw: dict = {"cuda_graphs": False} if mode == "eager" else {"graph_warmup": True}
    if mode == "no-ahead":
        kw["run_ahead"] = False
    runs = [run_bmc(model, prompts, args.gen, kv="bmc", **kw).tokens for _ in range(args.runs)]
    nan_like = sum(t == 0 for r in runs for row in r for t in row)  # NaN logits argmax to token 0
    return {"mode": mode, "parted_at": [first_divergence(runs[0], r) for r in runs[1:]],
            "token0_count": nan_like, "rows_parted_vs_first": [sum(a != b for a, b in zip(runs[0], r)) for r in runs[1:]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/out/gpu-determinism")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=160)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one_mode(args.one, args)), flush=True)
        return
    results = []
    for mode in args.modes.split(","):
        env = dict(os.environ)
        if mode == "det":
            env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        if mode == "cudnn":
            env["BMC_CUDA_SDPA"] = "cudnn"
        cmd = [sys.executable, __file__, "--one", mode] + [f"--{k}={getattr(args, k)}" for k in
                                                          ("layers", "batch", "prompt", "gen", "runs")]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        r = json.loads(line[7:]) if line else {"mode": mode, "error": (p.stderr or p.stdout)[-2000:]}
        print(json.dumps(r), flush=True)
        results.append(r)
    import torch
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"determinism-B{args.batch}.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
         "layers": args.layers, "batch": args.batch, "prompt": args.prompt, "gen": args.gen, "runs": args.runs,
         "results": results}, indent=1))


if __name__ == "__main__":
    main()
