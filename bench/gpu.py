"""bmc on a GPU vs HF transformers (DynamicCache, StaticCache) on a Llama-2-7B-shaped or OPT-6.7B-shaped model
with random weights (speed does not depend on the values): the paper's Table IX setting, run through the device
tool on an H100. HF runs first, then its weights are handed to bmc (bmc keeps its own transposed copies).

    python bench/gpu.py --model llama-7b --batch 32 --total 1024 --prompt 128 --out /tmp/out
"""
from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch

from bmc.bench.engines import run_bmc, run_hf
from bmc.bench.harness import first_divergence
from bmc.models import model_from_tensors

SHAPES = {
    "llama-7b": ("llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                               num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)),
    "opt-6.7b": ("opt", dict(hidden_size=4096, ffn_dim=16384, num_hidden_layers=32, num_attention_heads=32,
                             vocab_size=50272, max_position_embeddings=2048)),
}


def build_hf(name: str, dtype: torch.dtype):
    import transformers
    family, kw = SHAPES[name]
    cfg = (transformers.LlamaConfig if family == "llama" else transformers.OPTConfig)(**kw)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = (transformers.LlamaForCausalLM if family == "llama" else transformers.OPTForCausalLM)(cfg)
    return model.to(dtype).eval(), cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-7b", choices=list(SHAPES))
    ap.add_argument("--batch", type=int, nargs="+", default=[32])
    ap.add_argument("--total", type=int, default=1024, help="prompt + generated tokens (the paper's N)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sweep-T", action="store_true", help="also sweep bmc's T = 1, 2, 4, ... (the paper's Fig. 15)")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    gen = args.total - args.prompt
    hf, cfg = build_hf(args.model, dtype)
    report = {"model": args.model, "dtype": args.dtype, "device": torch.cuda.get_device_name(), "prompt": args.prompt,
              "gen": gen, "results": []}
    runs_by_batch = {}
    for B in args.batch:
        prompts = [[(13 * b + 7 * i) % (cfg.vocab_size - 10) + 5 for i in range(args.prompt)] for b in range(B)]
        run_hf(hf, prompts, 4, "dynamic")  # warm-up
        runs_by_batch[B] = [run_hf(hf, prompts, gen, "dynamic"), run_hf(hf, prompts, gen, "static")]
    state = {k: v for k, v in hf.state_dict().items()}
    model = model_from_tensors(cfg.to_dict(), state, origin=args.model, dtype=dtype, device="cuda")
    del hf, state
    gc.collect()
    torch.cuda.empty_cache()
    for B in args.batch:
        prompts = [[(13 * b + 7 * i) % (cfg.vocab_size - 10) + 5 for i in range(args.prompt)] for b in range(B)]
        run_bmc(model, prompts, 4, kv="bmc")  # warm-up
        runs = runs_by_batch[B]
        for kv in ("bmc", "iterative", "upfront"):
            r = run_bmc(model, prompts, gen, kv=kv)
            r.engine = "bmc" if kv == "bmc" else f"bmc-{kv}"
            runs.append(r)
            torch.cuda.empty_cache()
        res = {r.engine: r.summary(B) for r in runs}
        for v in res.values():
            v.pop("step_latency_ms")
        bmc_tps = res["bmc"]["decode_tokens_per_s"]
        out = {"batch": B, "engines": res,
               "ratios": {k: bmc_tps / v["decode_tokens_per_s"] for k, v in res.items() if k != "bmc"},
               "first_divergence_vs_bmc": {r.engine: first_divergence(runs[2].tokens, r.tokens) for r in runs}}
        report["results"].append(out)
        print(f"{args.model} {args.dtype} B={B} prompt={args.prompt} gen={gen} on {report['device']}")
        for k, v in res.items():
            extra = f" T={v.get('T')} r={v.get('r')} allocs={v.get('kv_allocations')}" if "T" in v else ""
            print(f"  {k:14s} {v['decode_tokens_per_s']:9.1f} tok/s  {v['time_per_output_token_ms']:7.2f} ms/step"
                  f"  bmc x{bmc_tps / v['decode_tokens_per_s']:.2f}{extra}")
        print(f"  first divergence vs bmc: {out['first_divergence_vs_bmc']}")
        if args.sweep_T:
            from bmc.analytic import choose_T
            pred, source = choose_T(args.total, model=model.config, batch=B, dtype=dtype, device=torch.device("cuda"))
            sweep = []
            for T in [2**i for i in range(0, 8)]:
                r = run_bmc(model, prompts, gen, kv="bmc", T=T)
                sweep.append({"T": T, "decode_tokens_per_s": r.summary(B)["decode_tokens_per_s"]})
                torch.cuda.empty_cache()
            best = max(sweep, key=lambda p: p["decode_tokens_per_s"])
            out["sweep_T"] = {"points": sweep, "best_T": best["T"], "predicted_T": pred, "T_source": source}
            print("  T sweep: " + "  ".join(f"T={p['T']}:{p['decode_tokens_per_s']:.0f}" for p in sweep)
                  + f"  best T={best['T']} predicted T={pred} ({source})")
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"gpu-{args.model}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
