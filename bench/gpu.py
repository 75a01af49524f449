"""bmc on a GPU vs HF transformers (DynamicCache, StaticCache) on a Llama-2-7B-shaped or OPT-6.7B-shaped model
with random weights (speed does not depend on the values): the paper's Table IX setting, run through the device
tool on an H100. HF runs first, then its weights are handed to bmc (bmc keeps its own transposed copies).

    python bench/gpu.py --model llama-7b --batch 32 --total 1024 --prompt 128 --out /tmp/out   # one setting
    python bench/gpu.py --model llama-7b --plot --out /tmp/out      # merge the settings' JSONs into one PNG

Engines: HF generate with DynamicCache and with StaticCache (which transformers compiles with torch.compile on its
own when the cache is static), bmc (auto T; decode step captured as a CUDA graph per capacity bucket), bmc-eager
(the same without graphs), bmc-iterative, bmc-upfront (one graph for the whole run).
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


def run_config(args, B: int, N: int) -> dict:
    """One (batch, N) setting in this process: HF first, then its weights handed to bmc (HF freed first)."""
    dtype = getattr(torch, args.dtype)
    gen = N - args.prompt
    hf, cfg = build_hf(args.model, dtype)
    prompts = [[(13 * b + 7 * i) % (cfg.vocab_size - 10) + 5 for i in range(args.prompt)] for b in range(B)]
    runs = []
    if not args.no_hf:
        run_hf(hf, prompts, 4, "dynamic")  # warm-up
        runs = [run_hf(hf, prompts, gen, "dynamic"), run_hf(hf, prompts, gen, "static")]
    first_bmc = len(runs)
    state = {k: v for k, v in hf.state_dict().items()}
    model = model_from_tensors(cfg.to_dict(), state, origin=args.model, dtype=dtype, device="cuda")
    del hf, state
    gc.collect()
    torch.cuda.empty_cache()
    run_bmc(model, prompts, 4, kv="bmc")  # warm-up
    engines = [("bmc", "bmc", {}), ("bmc-eager", "bmc", {"cuda_graphs": False}), ("bmc-upfront", "upfront", {})]
    if not args.no_iterative:
        engines.append(("bmc-iterative", "iterative", {}))
    for name, kv, kw in engines:
        r = run_bmc(model, prompts, gen, kv=kv, **kw)
        r.engine = name
        runs.append(r)
        torch.cuda.empty_cache()
    res = {r.engine: r.summary(B) for r in runs}
    for v in res.values():
        v.pop("step_latency_ms")
    bmc_tps = res["bmc"]["decode_tokens_per_s"]
    out = {"batch": B, "N": N, "gen": gen, "engines": res,
           "ratios": {k: bmc_tps / v["decode_tokens_per_s"] for k, v in res.items() if k != "bmc"},
           "first_divergence_vs_bmc": {r.engine: first_divergence(runs[first_bmc].tokens, r.tokens) for r in runs}}
    print(f"{args.model} {args.dtype} B={B} N={N} prompt={args.prompt} gen={gen} on {torch.cuda.get_device_name()}")
    for k, v in res.items():
        extra = f" T={v.get('T')} r={v.get('r')} allocs={v.get('kv_allocations')}" if "T" in v else ""
        print(f"  {k:14s} {v['decode_tokens_per_s']:9.1f} tok/s  {v['time_per_output_token_ms']:7.2f} ms/step"
              f"  bmc x{bmc_tps / v['decode_tokens_per_s']:.2f}{extra}")
    print(f"  first divergence vs bmc: {out['first_divergence_vs_bmc']}")
    if args.sweep_T:
        from bmc.analytic import choose_T
        pred, source = choose_T(N, model=model.config, batch=B, dtype=dtype, device=torch.device("cuda"))
        sweep = []
        for T in [2**i for i in range(0, 8)]:
            r = run_bmc(model, prompts, gen, kv="bmc", T=T)
            sweep.append({"T": T, "decode_tokens_per_s": r.summary(B)["decode_tokens_per_s"]})
            torch.cuda.empty_cache()
        best = max(sweep, key=lambda p: p["decode_tokens_per_s"])
        out["sweep_T"] = {"points": sweep, "best_T": best["T"], "predicted_T": pred, "T_source": source}
        print("  T sweep: " + "  ".join(f"T={p['T']}:{p['decode_tokens_per_s']:.0f}" for p in sweep)
              + f"  best T={best['T']} predicted T={pred} ({source})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-7b", choices=list(SHAPES))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--total", type=int, default=1024, help="prompt + generated tokens (the paper's N)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-hf", action="store_true", help="bmc engines only (e.g. for a T sweep)")
    ap.add_argument("--no-iterative", action="store_true", help="skip bmc-iterative (slow at large batch)")
    ap.add_argument("--sweep-T", action="store_true", help="also sweep bmc's T = 1, 2, 4, ... (the paper's Fig. 15)")
    ap.add_argument("--plot", action="store_true", help="only merge the gpu-MODEL-*.json files in --out into a PNG")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    if not args.plot:
        out = run_config(args, args.batch, args.total)
        report = {"model": args.model, "dtype": args.dtype, "device": torch.cuda.get_device_name(),
                  "prompt": args.prompt, "results": [out]}
        (path / f"gpu-{args.model}-B{args.batch}-N{args.total}.json").write_text(json.dumps(report, indent=1))
    reports = [json.loads(f.read_text()) for f in sorted(path.glob(f"gpu-{args.model}-B*-N*.json"))]
    if reports:
        merged = dict(reports[0], results=sorted((r for rep in reports for r in rep["results"]),
                                                 key=lambda r: (r["batch"], r["N"])))
        plot(merged, path / f"gpu-{args.model}.png")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    engines = [e for e in results[0]["engines"] if all(e in r["engines"] for r in results)]
    fig, ax = plt.subplots(figsize=(2.2 * len(results) + 3, 4))
    w = 0.8 / len(engines)
    for j, e in enumerate(engines):
        ax.bar([i + j * w for i in range(len(results))], [r["engines"][e]["decode_tokens_per_s"] for r in results],
               w, label=e)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(results))], [f"B={r['batch']} N={r['N']}" for r in results])
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{report['model']}-shaped, {report['dtype']}, {report['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
