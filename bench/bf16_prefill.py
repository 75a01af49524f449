"""Prompts in bfloat16 arithmetic (`--activations bfloat16`) against float32 and torch's bfloat16, in one run.

    python bench/bf16_prefill.py --out DIR                  # a random TinyLlama-shaped bfloat16 checkpoint
    python bench/bf16_prefill.py --model DIR --out DIR      # an HF directory (bfloat16 matrices kept in 16 bits)

1. GEMMs at M = 16, 64 and 512 rows on the model's first layer's matrices: bmc's native GEMM on its panels in
   float32 and in bfloat16 arithmetic (the path this CPU runs: AMX, vdpbf16ps or emulated), and torch's
   `x @ w.t()` in float32 (MKL) and bfloat16 (oneDNN) on the same values; GFLOP/s, best of --repeats.
2. Prefill of --prompt-len tokens at batch 1 (`engine.prefill_alone`, best of --repeats, interleaved): bmc float32
   arithmetic, bmc bfloat16 prompts (GEMMs and attention), and the PyTorch path in bfloat16 (`dtype="bfloat16"`);
   then one more prefill each, timed by phase (the native step's clock; torch's profiler on the PyTorch path).
3. With --decode N: batch-1 decode, the matrices as float32 panels against kept in 16 bits; then one more run each,
   its decode steps timed by phase.
The bfloat16 path is picked once per process (BMC_AMX=0 before the run: vdpbf16ps where AMX is present).
Writes JSON and a PNG under --out, with the threads, the host's CPU and the path."""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import torch


def best_s(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def make_checkpoint(path: Path) -> None:
    """A TinyLlama-shaped model (1.1B: hidden 2048, 22 layers, 32 / 4 heads, vocab 32000) with random bfloat16
    weights: speed does not depend on the values."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                   num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                                   bos_token_id=1, eos_token_id=2, torch_dtype=torch.bfloat16)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def gemms(model: Any, repeats: int) -> list[dict[str, Any]]:
    from bmc.kernels.native import native_module

    mod, layer, rows_out = native_module(), model.net.layers[0], []
    for name in ("qkv", "o", "gate_up", "down"):
        lin = getattr(layer, name)
        w = lin.dense_weight().t().contiguous()  # [out, in] float32
        for m in (16, 64, 512):
            x = torch.randn(m, lin.in_features)
            flops = 2 * m * lin.in_features * lin.out_features / 1e9
            xb, wb = x.bfloat16(), w.bfloat16()
            row = {"matrix": name, "K": lin.in_features, "N": lin.out_features, "M": m}
            for label, fn in (
                ("bmc float32", lambda: mod.panel_linear(x, lin.native_weight(), lin.out_features, None, False, False)),
                ("bmc bfloat16", lambda: mod.panel_linear(x, lin.native_weight(), lin.out_features, None, False, True)),
                ("torch float32", lambda: x @ w.t()),
                ("torch bfloat16", lambda: xb @ wb.t()),
            ):
                row[label] = flops / best_s(fn, repeats)
            rows_out.append(row)
            print(" ".join(f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    return rows_out


def prefill(path: str, prompt_len: int, repeats: int) -> dict[str, float]:
    import bmc
    from bmc.engine import prefill_alone

    models = {"bmc float32": bmc.load(path, activations="float"),  # "auto" would pick bfloat16 for this checkpoint
              "bmc bfloat16 prompts": bmc.load(path, activations="bfloat16"),
              "torch bfloat16 (--dtype bfloat16)": bmc.load(path, dtype="bfloat16")}
    ids = [100 + i % 30000 for i in range(prompt_len)]
    times: dict[str, list[float]] = {k: [] for k in models}
    with torch.inference_mode():
        for m in models.values():
            prefill_alone(m, ids, prompt_len=prompt_len)  # warm-up
        for _ in range(repeats):  # interleaved
            for label, m in models.items():
                t = time.perf_counter()
                prefill_alone(m, ids, prompt_len=prompt_len)
                times[label].append(time.perf_counter() - t)
    out = {label: prompt_len / min(ts) for label, ts in times.items()}
    for label, tps in out.items():
        print(f"prefill {prompt_len}: {label} {tps:.1f} tok/s (x{tps / out['bmc float32']:.2f})", flush=True)
    return out, {label: phases(m, ids, prompt_len) for label, m in models.items()}


def phases(model: Any, ids: list[int], prompt_len: int) -> dict[str, float]:
    """Where one more prefill's time goes, in ms: the native step's phases (NativeDecoder.set_profiling with
    prompts=True), or torch's profiler's busiest operators on the PyTorch path."""
    from bmc.engine import prefill_alone

    native = model.net.native_decoder()
    with torch.inference_mode():
        if native is not None:
            native.set_profiling(True, prompts=True)
            t = time.perf_counter()
            prefill_alone(model, ids, prompt_len=prompt_len)
            wall = time.perf_counter() - t
            out = {k[:-2]: 1e3 * v for k, v in native.profile().items() if k.endswith("_s")}
            native.set_profiling(False)
        else:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                t = time.perf_counter()
                prefill_alone(model, ids, prompt_len=prompt_len)
                wall = time.perf_counter() - t
            ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
            out = {e.key: e.self_cpu_time_total / 1e3 for e in ops}
    out["wall"] = 1e3 * wall
    print("  phases (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in out.items()), flush=True)
    return out


def decode(path: str, new_tokens: int, repeats: int) -> dict[str, float]:
    """Decode at batch 1 (16-token prompt, `new_tokens` generated, best of `repeats`, interleaved): the checkpoint's
    matrices as float32 panels (quant="none") against kept in 16 bits (quant="auto": "stored"), both float32
    arithmetic on the native step."""
    import bmc

    models = {"float32 panels (--quant none)": bmc.load(path, quant="none"),
              "16-bit panels (--quant auto)": bmc.load(path, activations="float")}
    prompt = [[100 + i for i in range(16)]]
    tps: dict[str, list[float]] = {k: [] for k in models}
    for m in models.values():
        bmc.generate(m, prompt, max_new_tokens=4, ignore_eos=True)  # warm-up
    for _ in range(repeats):
        for label, m in models.items():
            tps[label].append(bmc.generate(m, prompt, max_new_tokens=new_tokens, ignore_eos=True)
                              .stats.decode_tokens_per_s)
    out = {label: max(v) for label, v in tps.items()}
    base = out["float32 panels (--quant none)"]
    for label, v in out.items():
        print(f"decode batch 1: {label} {v:.1f} tok/s (x{v / base:.2f}; runs {[round(x, 1) for x in tps[label]]})",
              flush=True)
    for label, m in models.items():  # where one more run's decode steps go (the native step's clock)
        native = m.net.native_decoder()
        native.set_profiling(True)
        bmc.generate(m, prompt, max_new_tokens=new_tokens, ignore_eos=True)
        ms = {k[:-2]: 1e3 * v / new_tokens for k, v in native.profile().items() if k.endswith("_s")}
        native.set_profiling(False)
        print(f"  {label} ms a step: " + ", ".join(f"{k} {v:.2f}" for k, v in ms.items()), flush=True)
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    big = [r for r in result["gemms"] if r["M"] == 512]
    labels = ["bmc float32", "bmc bfloat16", "torch float32", "torch bfloat16"]
    for i, label in enumerate(labels):
        a.bar([j + 0.2 * i for j in range(len(big))], [r[label] for r in big], 0.2, label=label)
    a.set_xticks([j + 0.3 for j in range(len(big))], [f"{r['matrix']}\n{r['K']}x{r['N']}" for r in big])
    a.set_ylabel("GFLOP/s (M = 512)")
    a.set_title(f"GEMMs; bmc bfloat16 path: {result['bf16_path']}")
    a.legend(fontsize=8)
    pf = result["prefill"]
    b.bar(range(len(pf)), list(pf.values()), color=["gray", "tab:orange", "tab:blue"])
    b.set_xticks(range(len(pf)), [k.replace(" (", "\n(") for k in pf], fontsize=8)
    b.set_ylabel(f"prefill tok/s ({result['prompt_len']} tokens, batch 1)")
    b.set_title(f"{result['threads']} threads, {result['cpu']}"[:70])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="an HF directory (default: a random TinyLlama-shaped one, made under --out)")
    p.add_argument("--out", required=True)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode", type=int, default=0, metavar="N",
                   help="also decode N tokens at batch 1: float32 panels against 16-bit panels")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = args.model
    if path is None:
        path = str(out / "tinyllama-shape-bf16")
        if not Path(path, "config.json").exists():
            make_checkpoint(Path(path))
    import bmc
    from bmc.kernels.native import native_module
    from bmc.platform.topology import cpu_model

    model = bmc.load(path)
    result: dict[str, Any] = {"model": path, "dtype": "bfloat16 checkpoint, float32 native step", "batch": 1,
                              "prompt_len": args.prompt_len, "threads": torch.get_num_threads(), "cpu": cpu_model(),
                              "host": platform.node(), "bf16_path": native_module().bf16_path(),
                              "BMC_AMX": os.environ.get("BMC_AMX"), "torch": torch.__version__}
    result["gemms"] = gemms(model, args.repeats)
    del model
    result["prefill"], result["prefill_phases_ms"] = prefill(path, args.prompt_len, args.repeats)
    if args.decode:
        result["decode_tokens_per_s"] = decode(path, args.decode, args.repeats)
    tag = result["bf16_path"]
    (out / f"bf16-prefill-{tag}.json").write_text(json.dumps(result, indent=2))
    plot(result, out / f"bf16-prefill-{tag}.png")
    print(f"wrote {out}/bf16-prefill-{tag}.json and .png")


if __name__ == "__main__":
    main()
