"""Tensor parallelism on CPU ranks: decode latency at batch 1 and throughput at batch 32 of a Llama-2-7B-shaped
model with random weights, tp = 1 (one process) against tp = 2 (two worker processes over gloo), and the share of
a tp = 2 decode step rank 0 spends in all-reduces and the LM head's all-gather.

    python bench/tp.py [--layers 32] [--dtype float32] [--threads N]

Both run bmc's PyTorch path (the native CPU step has no collectives), tp = 1 on --threads threads, each tp = 2 rank
on half of them. Each rank builds only its part of the random model (its heads, its MLP share, the whole
embedding). Decode tok/s from generate()'s stats, prompts of --prompt tokens, --gen generated, EOS ignored, best of
--repeats. Writes JSON and a PNG under bench/results/cpu/. On the 2-core VM the full 32 layers do not fit in fp32
(27 GB): pass --layers."""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

from bmc.bench.results import write_result

LLAMA2_7B = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=4096,
                 intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                 rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False, bos_token_id=1,
                 eos_token_id=2, pad_token_id=0)


def measure(model: Any, args: argparse.Namespace, tp: Any = None) -> dict[str, float]:
    import bmc

    row: dict[str, float] = {}
    vocab = LLAMA2_7B["vocab_size"]
    for batch in args.batches:
        prompts = [[(7 * b + j) % (vocab - 3) + 3 for j in range(args.prompt)] for b in range(batch)]
        bmc.generate(model, prompts[:1], max_new_tokens=2, ignore_eos=True)  # warm-up
        best, share = 0.0, 0.0
        for _ in range(args.repeats):
            if tp is not None:
                tp.collective_seconds()
            out = bmc.generate(model, prompts, max_new_tokens=args.gen, ignore_eos=True)
            if out.stats.decode_tokens_per_s > best:
                best = out.stats.decode_tokens_per_s
                if tp is not None:  # prefill's collectives included: an upper bound of the decode share
                    share = tp.collective_seconds() / (out.stats.decode_seconds + out.stats.prefill_seconds)
        row[f"decode_b{batch}"] = best
        row[f"step_ms_b{batch}"] = 1000 * batch / best
        if tp is not None:
            row[f"collective_share_b{batch}"] = share
    return row


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bmc.bench.plots import save_titled

    rows, c = result["rows"], result["config"]
    fig, axes = plt.subplots(1, len(c["batches"]), figsize=(5 * len(c["batches"]), 4))
    for ax, b in zip(axes if len(c["batches"]) > 1 else [axes], c["batches"]):
        names = list(rows)
        vals = [rows[n][f"decode_b{b}"] for n in names]
        bars = ax.bar(names, vals)
        share = {n: rows[n].get(f"collective_share_b{b}") for n in names}
        ax.bar_label(bars, labels=[f"{v:.2f} tok/s\n{rows[n][f'step_ms_b{b}']:.0f} ms/step" + (
            f"\ncollectives {100 * share[n]:.0f} %" if share[n] is not None else "") for n, v in zip(names, vals)],
            fontsize=8)
        ax.set_title(f"decode, batch {b}")
        ax.set_ylim(0, max(vals) * 1.3)
    save_titled(fig, f"Llama-2-7B shape ({c['layers']} layers), random {c['dtype']} weights, PyTorch path, "
                 f"{c['threads']} threads in all, {c['host']}", path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--gen", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    os.environ["BMC_NATIVE"] = "0"
    import torch

    from bmc.analytic.profile import device_name
    from bmc.parallel.shard import fill_random
    from bmc.parallel.tp import TensorParallelModel, shape_model

    config_dir = tempfile.mkdtemp(prefix="bmc-tp-bench-")
    with open(os.path.join(config_dir, "config.json"), "w") as f:
        json.dump(dict(LLAMA2_7B, num_hidden_layers=args.layers), f)
    host = f"{device_name(torch.device('cpu'))}, {os.cpu_count()} cpus"
    result: dict[str, Any] = {"config": dict(vars(args), host=host, shape="Llama-2-7B"), "rows": {}}

    torch.set_num_threads(args.threads)
    one = shape_model(config_dir, args.dtype, torch.device("cpu"))
    fill_random(one)
    result["rows"]["tp=1"] = measure(one, args)
    print("tp=1", result["rows"]["tp=1"], flush=True)
    del one
    tp = TensorParallelModel(config_dir, 2, dtype=args.dtype, threads=max(1, args.threads // 2), random_weights=True)
    try:
        result["rows"]["tp=2"] = measure(tp, args, tp)
    finally:
        tp.close()
    print("tp=2", result["rows"]["tp=2"], flush=True)
    for b in args.batches:
        r1, r2 = result["rows"]["tp=1"], result["rows"]["tp=2"]
        print(f"batch {b}: tp=2 step {r2[f'step_ms_b{b}']:.0f} ms = {r2[f'step_ms_b{b}'] / r1[f'step_ms_b{b}']:.2f}x "
              f"tp=1's; collectives {100 * r2[f'collective_share_b{b}']:.1f} % of rank 0's time", flush=True)
    write_result(result, args.out, __file__, "tp", plot)


if __name__ == "__main__":
    main()
