"""Quantized weights on CUDA: what torch's own low-bit GEMMs give on the model's shapes, and what bmc's torch-ops
path (quant_torch.py: the blocks' values on the GPU, dequantized per GEMM) gives a whole decode, in one run.

    python bench/quant_cuda.py --model DIR     # an HF directory (a GGUF file too); quantized at load

1. GEMMs, per decode step of the model's shapes (its layers' q|k|v, o, gate|up, down and the LM head), at M rows:
   float32 and bfloat16 cuBLAS; bmc's quantized GEMMs for Q8_0 and Q4_0 blocks (dequantize-then-GEMM, or for Q4 in
   bfloat16 tinygemm on the blocks' own scales); torch's
   `_weight_int4pack_mm` (tinygemm: int4, group 32, bfloat16 scales and zeros) and `_weight_int8pack_mm` (int8,
   one scale per output channel) where this torch build has them on CUDA. CUDA events, median of --repeats.
2. Decode: bmc.generate tok/s at batch 1 and 8 (and 32), quant none / q8_0 / q4_0, float32 and bfloat16, with
   CUDA graphs; the weights' bytes on the GPU and the peak memory the run allocated.
Writes JSON and a PNG (decode tok/s per quant and dtype; GEMM ms per method) under --out."""
from __future__ import annotations

import argparse
import json
import statistics
from typing import Any, Callable

import torch


def shapes(model: Any) -> list[tuple[int, int]]:
    """(N out, K in) of every GEMM a decode step runs, the LM head last."""
    return [(lin.out_features, lin.in_features) for lin in model.linears()]


def time_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def gemm_table(model: Any, rows: int, repeats: int) -> dict[str, float | None]:
    """ms per decode step's GEMMs, per method (None: this torch has no such CUDA op)."""
    from bmc.models.quant import quantize
    from bmc.models.quant_torch import TorchQuantWeight

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    mats = [torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes(model)]
    x32 = {k: torch.randn(rows, k, device=dev) for k in {m.shape[1] for m in mats}}
    x16 = {k: v.bfloat16() for k, v in x32.items()}
    out: dict[str, float | None] = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        ws = [m.to(dev, dtype) for m in mats]
        xs = x32 if dtype == torch.float32 else x16
        out[f"cuBLAS {name}"] = time_ms(lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in ws], repeats)
    for kind in ("q8_0", "q4_0"):
        for name, dtype, xs in (("float32", torch.float32, x32), ("bfloat16", torch.bfloat16, x16)):
            qs = [TorchQuantWeight(quantize(m, kind), dev, dtype) for m in mats]
            how = "int4 GEMM" if qs[0].int4 is not None else "dequant+GEMM"
            out[f"bmc {kind} {name} ({how})"] = time_ms(lambda: [q.linear(xs[q.shape[1]], None) for q in qs], repeats)
    try:  # tinygemm: [N, K] int32 values 0-15 -> packed; scales_and_zeros [K/32, N, 2] bfloat16
        packed, sz = [], []
        for m in mats:
            n, k = m.shape
            g = m.view(n, k // 32, 32)
            lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
            scale = ((hi - lo) / 15).clamp(min=1e-8)
            q = ((g - lo) / scale).round().clamp(0, 15).to(torch.int32).view(n, k)
            zero = lo + 8 * scale  # tinygemm: w = (q - 8) * scale + zero
            qu8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).to(dev)
            for inner in (8, 4, 2):  # inner k tiles: the largest this K allows
                try:
                    packed.append(torch.ops.aten._convert_weight_to_int4pack(qu8, inner))
                    break
                except RuntimeError:
                    if inner == 2:
                        raise
            sz.append(torch.stack([scale, zero], -1).squeeze(2).transpose(0, 1).contiguous().to(dev, torch.bfloat16))
        out["torch _weight_int4pack_mm bfloat16"] = time_ms(
            lambda: [torch.ops.aten._weight_int4pack_mm(x16[m.shape[1]], p, 32, s) for m, p, s in zip(mats, packed, sz)],
            repeats)
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        print(f"_weight_int4pack_mm: {type(e).__name__}: {str(e)[:200]}")
        out["torch _weight_int4pack_mm bfloat16"] = None
    try:
        w8 = [(m.abs().amax(1) / 127).clamp(min=1e-8) for m in mats]
        q8 = [(m / s[:, None]).round().to(torch.int8).to(dev) for m, s in zip(mats, w8)]
        s8 = [s.to(dev, torch.bfloat16) for s in w8]
        out["torch _weight_int8pack_mm bfloat16"] = time_ms(
            lambda: [torch.ops.aten._weight_int8pack_mm(x16[q.shape[1]], q, s) for q, s in zip(q8, s8)], repeats)
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        print(f"_weight_int8pack_mm: {type(e).__name__}: {str(e)[:200]}")
        out["torch _weight_int8pack_mm bfloat16"] = None
    return out


def decode_rows(path: str, batches: list[int], gen: int) -> dict[str, Any]:
    import bmc
    from bmc.cli.generate import synthetic_prompts

    rows: dict[str, Any] = {}
    for dtype in ("float32", "bfloat16"):
        for quant in ("none", "q8_0", "q4_0"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            m = bmc.load(path, device="cuda", dtype=dtype, quant=quant)
            prompts = synthetic_prompts(m, max(batches), 32)
            bmc.generate(m, prompts[:1], max_new_tokens=8, ignore_eos=True)
            row: dict[str, Any] = {"weight_bytes": m.weight_bytes}
            for b in batches:
                row[f"decode_b{b}"] = max(bmc.generate(m, prompts[:b], max_new_tokens=gen, ignore_eos=True)
                                          .stats.decode_tokens_per_s for _ in range(2))
            row["peak_allocated"] = torch.cuda.max_memory_allocated()
            rows[f"{quant} {dtype}"] = row
            print(quant, dtype, {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
            del m
    return rows


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bmc.bench.plots import save_titled

    fig, axes = plt.subplots(1, 2, figsize=(15, 5))
    rows, batches = result["decode"], result["config"]["batches"]
    names = list(rows)
    width = 0.8 / len(batches)
    for i, b in enumerate(batches):
        axes[0].bar([j + i * width for j in range(len(names))], [rows[n][f"decode_b{b}"] for n in names], width,
                    label=f"batch {b}")
    axes[0].set_xticks([j + width * (len(batches) - 1) / 2 for j in range(len(names))], names, rotation=30,
                       ha="right", fontsize=8)
    axes[0].set_ylabel("decode tok/s")
    axes[0].legend()
    axes[0].set_title("bmc decode, CUDA graphs")
    for M, table in result["gemms"].items():
        have = {k: v for k, v in table.items() if v is not None}
        axes[1].barh([f"{k} (M={M})" for k in have], list(have.values()))
    axes[1].set_xlabel("ms per decode step's GEMMs")
    axes[1].tick_params(axis="y", labelsize=7)
    axes[1].set_title("GEMMs of the model's shapes")
    c = result["config"]
    save_titled(fig, f"quantized weights on {c['gpu']}: {c['model']}, prompt 32, {c['gen']} tokens", path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default="quant-cuda.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    import bmc

    torch.backends.cuda.matmul.allow_tf32 = False
    batches = [int(b) for b in args.batches.split(",")]
    model = bmc.load(args.model, device="cpu", quant="none")
    gemms = {}
    for M in (1, 8):
        gemms[M] = gemm_table(model, M, args.repeats)
        print(f"GEMMs M={M}:", {k: round(v, 3) if v is not None else None for k, v in gemms[M].items()}, flush=True)
    del model
    result = {"config": dict(vars(args), batches=batches, gpu=torch.cuda.get_device_name(), torch=torch.__version__),
              "gemms": gemms, "decode": decode_rows(args.model, batches, args.gen)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, args.out[:-5] + ".png")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
