"""bmc-calibrate: measure this machine's copy bandwidth, allocation cost and attention throughput, and store
them as the profile that picks BMC's number of allocations T (seed paper, Eq. 5-9)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ..errors import BmcError

if TYPE_CHECKING:
    import torch
from .common import Parser, fail, physical_cores

# The embedded default model's attention shape, for the printed examples.
SMOLLM2 = dict(layers=30, heads=9, kv_heads=3, head_dim=64)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="bmc-calibrate", description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer shapes and repeats (under 20 s on a small CPU)")
    p.add_argument("--output", help="also write the profile here (JSON)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the KV cache's dtype to measure (default float32)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("--no-save", action="store_true", help="do not write the profile to the user cache dir")
    p.add_argument("--model", help="also time this model's step by token rows (1 to 64), the curve --tree auto "
                   "sizes draft trees from, and store it (otherwise measured at its first speculative run); 'default': "
                   "the embedded SmolLM2-135M-Instruct")
    p.add_argument("--quant", default="auto", help="the model's weights, as bmc-generate takes them (default auto)")
    p.add_argument("--activations", default="auto", choices=["auto", "float", "int8", "bfloat16"],
                   help="the model's arithmetic, as bmc-generate takes it (default auto)")
    return p


def measure_rows(args: argparse.Namespace) -> str:
    """The model's step cost by token rows, measured and stored (spec/auto.py), as printable lines."""
    import bmc
    from ..spec.auto import row_costs

    model = bmc.load(None if args.model == "default" else args.model, dtype=args.dtype, device=args.device,
                     quant=args.quant, activations=args.activations)
    costs = row_costs(model, remeasure=True)
    ms = "  ".join(f"{r}:{s * 1e3:.1f}" for r, s in zip(costs.rows, costs.seconds))
    return (f"step by rows {model.path} (quant {model.quant}, {model.activations} activations), ms: {ms}\n"
            f"             (stored for --tree auto)")


def summary(profile: dict, dtype: "torch.dtype") -> str:
    import torch

    from ..analytic import Constants, Shape, best_T, c_prime

    k = profile["constants"]
    consts = Constants(copy_bw=k["copy_bw_bytes_per_s"], alloc_s=k["alloc_s"], attn_flops=k["attn_flops_per_s"],
                       verify_flops=k["verify_flops_per_s"], capture_layer_s=k.get("capture_layer_s", 0.0))
    lines = [
        f"device       {profile['device']} ({profile['device_name']}), {profile['threads']} threads, "
        f"torch {profile['torch']}, {profile['dtype']}",
        f"alpha*BW     {consts.copy_bw / 1e9:8.2f} GB/s   (chunk-boundary allocate + copy)",
        f"C0           {consts.alloc_s * 1e6:8.1f} us     (per allocation)",
        f"beta*C       {consts.attn_flops / 1e9:8.2f} GFLOP/s (decode attention, 1 query row, "
        f"{profile['attention_kernel']} kernel)",
        f"beta'*C      {consts.verify_flops / 1e9:8.2f} GFLOP/s (verify attention, {k['verify_rows']} rows)",
    ]
    if consts.capture_layer_s:
        lines.append(f"capture      {consts.capture_layer_s * 1e6:8.1f} us     (a decode step's CUDA graph, per layer; "
                     "part of C0 where the cache grows in place)")
    for batch in (1, 8, 32):
        shape = Shape(batch=batch, dtype_bytes=torch.finfo(dtype).bits // 8, **SMOLLM2)
        ts = "  ".join(f"N={n}: T={best_T(n, shape, consts)}" for n in (512, 2048, 8192))
        lines.append(f"SmolLM2 B={batch:<3} C'={c_prime(shape, consts):.3g}  {ts}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    import torch

    from ..analytic import default_profile_path, save_profile
    from ..analytic.calibrate import CalibrationError, calibrate
    from ..models import parse_device, parse_dtype

    torch.set_num_threads(args.threads or physical_cores())
    try:
        device, dtype = parse_device(args.device), parse_dtype(args.dtype)
    except BmcError as e:
        fail(str(e))
    t0 = time.perf_counter()
    print(f"bmc-calibrate: measuring on {device} ({'quick' if args.quick else 'full'})", file=sys.stderr)
    try:
        profile = calibrate(device, dtype, quick=args.quick,
                            progress=lambda s: print(f"  {s}  ({time.perf_counter() - t0:.0f}s)", file=sys.stderr,
                                                     flush=True))
    except CalibrationError as e:
        fail(str(e))
    targets = [] if args.no_save else [default_profile_path(device, dtype)]
    if args.output:
        targets.append(Path(args.output))
    for path in targets:
        try:
            save_profile(profile, path)
        except OSError as e:
            fail(f"cannot write profile {path}: {e.strerror}")
    print(summary(profile, dtype))
    for path in targets:
        print(f"profile written to {path}")
    if args.model:
        try:
            print(measure_rows(args))
        except BmcError as e:
            fail(str(e))
    print(f"({time.perf_counter() - t0:.1f}s)", file=sys.stderr)


if __name__ == "__main__":
    main()
