"""Decode speed of each model family on the native CPU step against a Llama of the same shapes: the cost of each
family's extras (q/k/v biases, q/k norms, sandwich norms, soft-capped scores, windows on some layers, scaled
embeddings, GeGLU) in one run.

    python bench/families.py [--prompt 512] [--gen 128] [--threads N]

Every model has SmolLM2-135M's shapes (hidden 576, 30 layers, 9 heads, 3 KV heads, head_dim 64, MLP 1536, vocab
49152) with random float32 weights built in memory by transformers; the families' own settings on top: Gemma 2 its
soft-caps (50, 30) and a 4096 window on every other layer, Gemma 3 its q/k norms and a 512 window on five layers in
six (so a 512-token prompt + 128 generated passes it), Qwen2 its biases, Qwen3 its q/k norms, Phi-3 fused
projections. decode tok/s from generate()'s stats (EOS ignored, best over --rounds passes of --repeats runs) at
batch 1 and 8, synthetic
prompts of --prompt tokens. Writes JSON and a PNG (tok/s per family and batch, ratio to Llama) under
bench/results/cpu/."""
from __future__ import annotations

import argparse
import os
from typing import Any

from bmc.bench.results import write_result

SHAPES = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
              num_key_value_heads=3, head_dim=64, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, tie_word_embeddings=True)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {  # name -> (transformers config class, its settings)
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "phi3": ("Phi3Config", dict(original_max_position_embeddings=2048)),
    "gemma": ("GemmaConfig", {}),
    "gemma2": ("Gemma2Config", dict(sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                    query_pre_attn_scalar=64)),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=512, query_pre_attn_scalar=64)),
}


def build(family: str) -> Any:
    """A bmc model of `family` with random weights (transformers' own initialisation, built in memory)."""
    import torch
    import transformers

    from bmc.models import model_from_tensors

    cls, extra = FAMILIES[family]
    cfg = getattr(transformers, cls)(**{**SHAPES, **extra})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    del hf
    return model_from_tensors(cfg.to_dict(), state)


def measure(model: Any, args: argparse.Namespace) -> dict[str, float]:
    import bmc
    from bmc.cli.generate import synthetic_prompts

    prompts = synthetic_prompts(model, 8, args.prompt)
    bmc.generate(model, prompts[:1], max_new_tokens=4, ignore_eos=True)  # warm-up (builds the native decoder)
    row: dict[str, float] = {}
    for batch in (1, 8):
        row[f"decode_b{batch}"] = max(
            bmc.generate(model, prompts[:batch], max_new_tokens=args.gen, ignore_eos=True).stats.decode_tokens_per_s
            for _ in range(args.repeats))
    return row


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bmc.bench.plots import save_titled

    rows, names = result["rows"], list(result["rows"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, key in zip(axes, ("decode_b1", "decode_b8")):
        vals = [rows[n][key] for n in names]
        bars = ax.bar(names, vals, color=["grey" if n == "llama" else "tab:blue" for n in names])
        ax.bar_label(bars, labels=[f"{v:.1f}\n{v / rows['llama'][key]:.2f}x" for v in vals], fontsize=7)
        ax.set_title(f"decode tok/s, batch {key[-1]} (ratio to Llama)")
        ax.set_ylim(0, max(vals) * 1.25)
    c = result["config"]
    save_titled(fig, f"native CPU step, SmolLM2-135M shapes, random fp32 weights, prompt {c['prompt']} + {c['gen']} "
                 f"generated, {c['threads']} threads, {c['host']}", path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="runs per family and batch in a round (best kept)")
    p.add_argument("--rounds", type=int, default=2, help="passes over all families (best kept)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated subset (llama always runs)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import torch

    from bmc.analytic.profile import device_name

    torch.set_num_threads(args.threads)
    names = ["llama"] + [f for f in args.families.split(",") if f != "llama"]
    unknown = [f for f in names if f not in FAMILIES]
    if unknown:
        p.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    host = f"{device_name(torch.device('cpu'))}, {os.cpu_count()} cpus"
    result: dict[str, Any] = {"config": dict(vars(args), host=host, shapes=SHAPES), "rows": {}}
    models = {}
    for name in names:  # all built first, then measured in rounds: a slow spell of the host hits every family
        models[name] = build(name)
        assert models[name].net.native_decoder() is not None, f"{name} does not run on the native step"
    for r in range(args.rounds):
        for name in names:
            row = measure(models[name], args)
            best = result["rows"].setdefault(name, row)
            for k, v in row.items():
                best[k] = max(best[k], v)
            print(f"round {r + 1} {name:>7}: b1 {row['decode_b1']:.1f} b8 {row['decode_b8']:.1f} tok/s", flush=True)
    base = result["rows"]["llama"]
    for name, row in result["rows"].items():
        print(f"{name:>7}: b1 {row['decode_b1']:.1f} tok/s ({row['decode_b1'] / base['decode_b1']:.2f}x llama)  "
              f"b8 {row['decode_b8']:.1f} tok/s ({row['decode_b8'] / base['decode_b8']:.2f}x)", flush=True)
    write_result(result, args.out, __file__, "families", plot)

if __name__ == "__main__":
    main()
