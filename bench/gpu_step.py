"""Anatomy of one graphed decode step on a GPU: which kernels a Llama-7B-shaped step runs, how many a layer, how long,
and how much of the step's wall time the GPU is busy (issue 48, item 3); each of decode_cuda's glue modes in turn.

    python bench/gpu_step.py --modes off,triton,compile --profile --out DIR   # bf16, batch 1, 128 + 256 tokens

Random weights (speed does not depend on the values), made here directly (no HF model), the bmc engine with CUDA
graphs captured before the timed runs (graph_warmup), one process, the modes in turn (each captures its own graphs).
Per mode: decode tok/s (median of --repeats warm runs after a cold one), GB/s (the model's weight bytes, embedding
table included, times steps a second, as bench/gpu.py reports them), the first token where a mode's greedy tokens
part from the first mode's, and with --profile, from a torch.profiler trace of a short run: each kernel's count and
time per step, grouped (GEMM, attention, bmc's fused glue, ...), and the GPU's busy time per step. Writes
gpu-step-*.json, a PNG, and the traces (gzipped Chrome JSON)."""
from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path

import torch

from bmc.bench.engines import run_bmc
from bmc.models import model_from_tensors

GROUPS = [  # (group, substrings of kernel names), first match wins
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitk", "matmul", "_qgemv", "tinygemm", "int4")),
    ("attention", ("fmha", "flash", "attention", "efficient")),
    ("bmc_fused", ("_rms", "_rope", "_silu", "_add_norm", "fused")),
    ("reduce", ("reduce", "mean", "norm")),
    ("copy", ("copy", "cat", "index", "gather", "scatter", "roll")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "pointwise", "triton")),
]


def group_of(name: str) -> str:
    low = name.lower()
    for g, keys in GROUPS:
        if any(k in low for k in keys):
            return g
    return "other"


def llama_state(layers: int, vocab: int, dtype: torch.dtype, D: int = 4096, I: int = 11008, kv_heads: int = 32,
                heads: int = 32) -> tuple[dict, dict]:
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=D, intermediate_size=I, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                                   max_position_embeddings=4096)
    g = torch.Generator(device="cuda").manual_seed(0)
    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32) * 0.02).to(dtype)
    hd = D // heads
    st = {"model.embed_tokens.weight": rnd(vocab, D), "model.norm.weight": 1 + rnd(D), "lm_head.weight": rnd(vocab, D)}
    for i in range(layers):
        p = f"model.layers.{i}."
        st.update({p + "self_attn.q_proj.weight": rnd(heads * hd, D), p + "self_attn.k_proj.weight": rnd(kv_heads * hd, D),
                   p + "self_attn.v_proj.weight": rnd(kv_heads * hd, D), p + "self_attn.o_proj.weight": rnd(D, heads * hd),
                   p + "mlp.gate_proj.weight": rnd(I, D), p + "mlp.up_proj.weight": rnd(I, D),
                   p + "mlp.down_proj.weight": rnd(D, I), p + "input_layernorm.weight": 1 + rnd(D),
                   p + "post_attention_layernorm.weight": 1 + rnd(D)})
    return cfg.to_dict(), st


def profile_steps(model, prompts: list[list[int]], gen: int, trace: Path) -> dict:
    """Kernels per decode step from a profiler trace of one warm run: those between the first and the last graph
    launch (the decode window), divided by the launches in it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_bmc(model, prompts, gen, kv="bmc", graph_warmup=True)
    raw = trace.with_suffix("")
    prof.export_chrome_trace(str(raw))
    events = json.loads(raw.read_text())["traceEvents"]
    with gzip.open(trace, "wt") as f:
        json.dump(events, f)
    raw.unlink()
    launches = sorted(e["ts"] for e in events if e.get("name") == "cudaGraphLaunch")
    if len(launches) < 3:
        return {"error": f"{len(launches)} graph launches in the trace"}
    lo, hi = launches[0], launches[-1]
    steps = len(launches) - 1
    kernels = [e for e in events if e.get("cat") == "kernel" and lo <= e["ts"] < hi]
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for k in kernels:
        by_name[k["name"]].append(k["dur"])
    rows = sorted(({"name": n[:160], "group": group_of(n), "per_step": len(d) / steps, "us_per_step": sum(d) / steps,
                    "us_each": sum(d) / len(d)} for n, d in by_name.items()), key=lambda r: -r["us_per_step"])
    groups: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"per_step": 0.0, "us_per_step": 0.0})
    for r in rows:
        groups[r["group"]]["per_step"] += r["per_step"]
        groups[r["group"]]["us_per_step"] += r["us_per_step"]
    busy = sum(k["dur"] for k in kernels) / steps
    wall = (hi - lo) / steps
    # the host's work between two replays: from a launch's return to the next launch
    return {"steps": steps, "kernels_per_step": len(kernels) / steps, "gpu_busy_us_per_step": busy,
            "wall_us_per_step": wall, "groups": dict(groups), "kernels": rows}


def replay_ms(model, reps: int = 50) -> float:
    """The last bucket's graph replayed alone (graphs.GraphStore.replay_ms)."""
    from bmc.graphs import graph_store

    return graph_store(model).replay_ms(reps)


def run_mode(model, prompts: list[list[int]], args, mode: str, out: Path) -> dict:
    """The engine with decode_cuda.MODE = mode: --repeats warm runs after a cold one, then a profiled run; the
    model's arena and graphs let go at the end (the next mode captures its own)."""
    import gc

    from bmc.graphs import graph_store
    from bmc.models import decode_cuda

    decode_cuda.MODE = mode
    B = len(prompts)
    runs = [run_bmc(model, prompts, args.gen, kv="bmc", graph_warmup=True) for _ in range(args.repeats + 1)]
    tps = [r.summary(B)["decode_tokens_per_s"] for r in runs]
    warm = sorted(tps[1:])
    med = warm[len(warm) // 2]
    wb = model.weight_bytes
    name = f"gpu-step-L{args.layers}-B{B}-N{args.prompt + args.gen}-{mode}"
    replay = replay_ms(model)
    prof = profile_steps(model, prompts, args.profile_gen, out / f"{name}-trace.json.gz") if args.profile else {}
    graph_store(model).arena.free()
    gc.collect()
    torch.cuda.empty_cache()
    rep = {"mode": mode, "tokens_per_s_cold": tps[0], "tokens_per_s_warm": tps[1:], "tokens_per_s": med,
           "ms_per_step": 1000 * B / med, "replay_ms": replay, "weight_bytes": wb, "GBps": wb * med / B / 1e9,
           "tokens": runs[-1].tokens, "profile": prof}
    print(f"{name}: {med:.1f} tok/s ({rep['ms_per_step']:.2f} ms/step, cold {tps[0]:.1f}, warm {[round(t, 1) for t in tps[1:]]}), "
          f"weights {wb / 1e9:.2f} GB, {rep['GBps']:.0f} GB/s; the last bucket's graph replayed alone "
          f"{replay:.3f} ms ({wb / replay / 1e6:.0f} GB/s), the step's host work {rep['ms_per_step'] - replay:.3f} ms",
          flush=True)
    if prof and "error" not in prof:
        print(f"  profile: {prof['kernels_per_step']:.0f} kernels/step, GPU busy {prof['gpu_busy_us_per_step']:.0f} us "
              f"of {prof['wall_us_per_step']:.0f} us/step (under the profiler)")
        for g, v in sorted(prof["groups"].items(), key=lambda kv: -kv[1]["us_per_step"]):
            print(f"  {g:12s} {v['per_step']:7.1f}/step {v['us_per_step']:8.1f} us/step")
        for r in prof["kernels"][:args.top]:
            print(f"  {r['per_step']:6.1f}x {r['us_each']:7.2f} us = {r['us_per_step']:8.1f} us  [{r['group']}] {r['name'][:100]}")
    elif prof:
        print("  profile:", prof["error"])
    return rep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="off,triton", help="decode_cuda.MODE values, in turn (off: the plain path)")
    ap.add_argument("--profile", action="store_true", help="also a profiled run per mode (kernels per step)")
    ap.add_argument("--profile-gen", type=int, default=48)
    ap.add_argument("--top", type=int, default=14, help="kernels printed per profile")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    cfg, st = llama_state(args.layers, args.vocab, dtype, kv_heads=args.kv_heads)
    model = model_from_tensors(cfg, st, origin="llama-7b-shape", dtype=dtype, device="cuda")
    del st
    torch.cuda.empty_cache()
    B = args.batch
    prompts = [[(13 * b + 7 * i) % (args.vocab - 10) + 5 for i in range(args.prompt)] for b in range(B)]
    print(f"Llama-7B shape, {args.layers} layers, vocab {args.vocab}, {args.dtype}, B={B}, prompt {args.prompt}, "
          f"{args.gen} generated, on {torch.cuda.get_device_name()} (median of {args.repeats} warm runs after a cold one)")
    modes = [run_mode(model, prompts, args, m, out) for m in args.modes.split(",")]
    from bmc.bench.harness import first_divergence

    for m in modes[1:]:
        m["first_divergence_vs_" + modes[0]["mode"]] = first_divergence(modes[0]["tokens"], m["tokens"])
        print(f"  {m['mode']}: x{m['tokens_per_s'] / modes[0]['tokens_per_s']:.3f} over {modes[0]['mode']}, "
              f"first divergence {m['first_divergence_vs_' + modes[0]['mode']]}")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": args.dtype, "batch": B,
              "layers": args.layers, "vocab": args.vocab, "kv_heads": args.kv_heads, "prompt": args.prompt,
              "gen": args.gen, "repeats": args.repeats, "modes": modes}
    name = f"gpu-step-L{args.layers}-B{B}-N{args.prompt + args.gen}"
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    plot(report, out / f"{name}.png")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = report["modes"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    ax.bar([m["mode"] for m in modes], [m["GBps"] for m in modes])
    for i, m in enumerate(modes):
        ax.text(i, m["GBps"], f"{m['tokens_per_s']:.0f} tok/s\n{m['ms_per_step']:.2f} ms", ha="center", va="bottom", fontsize=8)
    ax.axhline(0.7 * 3350, ls="--", c="gray")
    ax.text(-0.4, 0.7 * 3350, "70 % of 3.35 TB/s", va="bottom", fontsize=8)
    ax.set_ylabel("weight GB/s (weights x steps/s)")
    ax.set_ylim(0, 3350)
    ax = axes[1]
    groups = sorted({g for m in modes if m["profile"] and "groups" in m["profile"] for g in m["profile"]["groups"]})
    w = 0.8 / max(1, len(modes))
    for j, m in enumerate(modes):
        gs = m["profile"].get("groups", {}) if m["profile"] else {}
        ax.barh([i + j * w for i in range(len(groups))], [gs.get(g, {}).get("us_per_step", 0) / 1000 for g in groups],
                w, label=f"{m['mode']}: {m['profile'].get('kernels_per_step', 0):.0f} kernels" if m["profile"] else m["mode"])
    ax.set_yticks([i + 0.4 - w / 2 for i in range(len(groups))], groups)
    ax.set_xlabel("GPU ms per step by kernel group (profiled run)")
    ax.legend(fontsize=8)
    fig.suptitle(f"Llama-7B shape, {report['layers']} layers, {report['dtype']}, B={report['batch']}, prompt "
                 f"{report['prompt']} + {report['gen']} generated, {report['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
