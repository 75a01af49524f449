"""The decode step's glue between GEMMs, piece by piece, four ways (issue 48, item 3): the plain torch ops
(eager), torch.compile of the same function in its default mode and in "max-autotune-no-cudagraphs" (neither
captures graphs of its own: bmc captures the step's), and the hand-written Triton kernels (fused_triton.py).

    python bench/gpu_glue.py --out DIR        # Llama-7B shapes (D 4096, 32 + 32 KV heads of 128, I 11008), bf16

Each piece is captured `--copies` times in one CUDA graph (as a step runs it once a layer) and the median replay
is divided by the copies: µs a call with the launch gaps a graph has. Also whether each way gives the eager ops'
values bit for bit (max |difference| otherwise). Writes gpu-glue-B{B}.json and a PNG."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

import torch

from bmc.graphs import replay_median_ms
from bmc.models import decode_cuda
from bmc.models import fused_triton as ft
from bmc.models.ops import rope_tables


def graph_us(fn: Callable[[], Any], copies: int, reps: int = 30) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(copies):
            fn()
    return 1000 * replay_median_ms(g, reps) / copies


def max_diff(a: Any, b: Any) -> float:
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--copies", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dt = getattr(torch, args.dtype)
    B, D, H, KVH, hd, I, cap = args.batch, 4096, 32, 32, 128, 11008, 512
    torch.manual_seed(0)
    dev = "cuda"
    x, r = torch.randn(B, 1, D, device=dev, dtype=dt), torch.randn(B, 1, D, device=dev, dtype=dt)
    w = (1 + 0.1 * torch.randn(D, device=dev)).to(dt)
    a = torch.randn(B, 1, (H + 2 * KVH) * hd, device=dev, dtype=dt)
    inv = 1.0 / 10000 ** (torch.arange(0, hd, 2, device=dev).float() / hd)
    cos, sin = rope_tables(torch.full((B, 1), 300, device=dev), inv, dt)
    kv = torch.zeros(2, B, KVH, cap, hd, device=dev, dtype=dt)
    col = torch.tensor([300], device=dev)
    gu = torch.randn(B, 1, 2 * I, device=dev, dtype=dt)
    pieces: dict[str, tuple[Callable[..., Any], Callable[..., Any], tuple]] = {
        "add_rms_norm": (decode_cuda.add_rms_norm_ref, ft.add_rms_norm, (x, r, w, 1e-5)),
        "rope_write": (decode_cuda.rope_write_ref, ft.rope_write, (a, cos, sin, kv, H, KVH, col)),
        "silu_mul": (decode_cuda.silu_mul_ref, ft.silu_mul, (gu,)),
    }
    rows = {}
    for name, (ref, tri, inp) in pieces.items():
        want = ref(*inp)
        ways = {"eager": ref, "triton": tri}
        for mode in ("default", "max-autotune-no-cudagraphs"):
            torch._dynamo.reset()
            ways[f"compile:{mode}"] = torch.compile(ref, mode=mode, dynamic=False)
        row = {}
        for way, fn in ways.items():
            got = fn(*inp)
            us = graph_us(lambda: fn(*inp), args.copies)
            diff = max_diff(want, got)
            row[way] = {"us": us, "max_abs_diff": diff, "bitwise": diff == 0.0}
            print(f"  {name:13s} {way:34s} {us:7.2f} us  {'bitwise' if diff == 0 else f'max |diff| {diff:.3g}'}",
                  flush=True)
        rows[name] = row
    per_layer = {way: 2 * rows["add_rms_norm"][way]["us"] + rows["rope_write"][way]["us"] + rows["silu_mul"][way]["us"]
                 for way in rows["silu_mul"]}
    print("  a layer's glue (2 norms, rope_write, silu_mul): " + ", ".join(f"{k} {v:.1f} us" for k, v in per_layer.items()))
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": args.dtype, "batch": B,
              "shapes": {"D": D, "heads": H, "kv_heads": KVH, "head_dim": hd, "I": I, "capacity": cap},
              "copies": args.copies, "pieces": rows, "per_layer_us": per_layer}
    (out / f"gpu-glue-B{B}.json").write_text(json.dumps(report, indent=1))
    plot(report, out / f"gpu-glue-B{B}.png")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pieces = list(report["pieces"])
    ways = list(report["pieces"][pieces[0]])
    fig, ax = plt.subplots(figsize=(8, 4))
    w = 0.8 / len(ways)
    for j, way in enumerate(ways):
        ax.bar([i + j * w for i in range(len(pieces))], [report["pieces"][p][way]["us"] for p in pieces], w,
               label=f"{way}: {report['per_layer_us'][way]:.1f} us a layer")
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(pieces))], pieces)
    ax.set_ylabel("µs a call (in a CUDA graph)")
    ax.set_title(f"decode glue, Llama-7B shapes, {report['dtype']}, B={report['batch']}, {report['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
