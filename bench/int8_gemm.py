"""int8 GEMMs for many rows, measured before any AMX-INT8 kernel is written (issue 44): bmc's VNNI kernel on Q8_0
and Q4_0 panels with int8 activation blocks (`activations="int8"`: a scale per 32 values on both sides), against
what torch gives: `torch._int_mm` (int8 x int8 -> int32 through oneDNN, AMX-INT8 where the CPU has it; one scale a
matrix, so it is the ceiling a block path could approach, not a drop-in) and bfloat16 (oneDNN, AMX-BF16 where
present). The TinyLlama shape's four matrices at 16, 64 and 512 rows; GOP/s (2 M K N per call), best of --repeats.

    python bench/int8_gemm.py --out DIR

Writes JSON and a PNG under --out, with the threads, the CPU and its AMX / VNNI flags."""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

import torch
from bf16_prefill import best_s  # bench/ is the script's own folder: the same best-of timing

SHAPES = {"qkv": (2048, 2560), "o": (2048, 2048), "gate_up": (2048, 11264), "down": (5632, 2048)}  # K x N


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            words = set(f.read().split())
    except OSError:
        return []
    return sorted(w for w in words if w.startswith(("amx", "avx512_vnni", "avx512_bf16", "avx_vnni")))


def measure(repeats: int, rows: list[int]) -> list[dict[str, Any]]:
    from bmc.kernels.native import native_module
    from bmc.models.ops import Linear
    from bmc.models.quant import quantize

    mod, out = native_module(), []
    for name, (K, N) in SHAPES.items():
        g = torch.Generator().manual_seed(0)
        w = torch.randn(N, K, generator=g) * 0.05
        panels = {kind: Linear(quantize(w, kind)).native_weight() for kind in ("q8_0", "q4_0")}
        wi8 = torch.randint(-127, 128, (K, N), generator=g, dtype=torch.int8)
        wb = w.bfloat16()
        for m in rows:
            x = torch.randn(m, K, generator=g)
            xi8 = torch.randint(-127, 128, (m, K), generator=g, dtype=torch.int8)
            xb = x.bfloat16()
            gop = 2 * m * K * N / 1e9
            row: dict[str, Any] = {"matrix": name, "K": K, "N": N, "M": m}
            for label, fn in (
                ("bmc Q8_0 int8 (VNNI)", lambda: mod.panel_linear(x, panels["q8_0"], N, None, True, False)),
                ("bmc Q4_0 int8 (VNNI)", lambda: mod.panel_linear(x, panels["q4_0"], N, None, True, False)),
                ("torch _int_mm int8", lambda: torch._int_mm(xi8, wi8)),
                ("torch bfloat16", lambda: xb @ wb.t()),
            ):
                row[label] = gop / best_s(fn, repeats)
            out.append(row)
            print(" ".join(f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted({r["M"] for r in result["gemms"]})
    labels = [k for k in result["gemms"][0] if k not in ("matrix", "K", "N", "M")]
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4.5), squeeze=False)
    for ax, m in zip(axes[0], rows):
        sel = [r for r in result["gemms"] if r["M"] == m]
        for i, label in enumerate(labels):
            ax.bar([j + 0.2 * i for j in range(len(sel))], [r[label] for r in sel], 0.2, label=label)
        ax.set_xticks([j + 0.3 for j in range(len(sel))], [f"{r['matrix']}\n{r['K']}x{r['N']}" for r in sel])
        ax.set_ylabel(f"GOP/s (M = {m})")
        ax.set_title(f"M = {m}, {result['threads']} threads")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{result['cpu']} ({' '.join(result['flags'])})"[:110], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rows", default="16,64,512")
    args = p.parse_args()
    from bmc.kernels.native import native_module
    from bmc.platform.topology import cpu_model

    if not native_module().has_int8_dot():
        raise SystemExit("this CPU lacks AVX512-VNNI / VBMI: bmc's int8 activations do not run here")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"threads": torch.get_num_threads(), "cpu": cpu_model(), "flags": cpu_flags(),
                              "host": platform.node(), "torch": torch.__version__, "dtype": "int8 / bfloat16",
                              "repeats": args.repeats}
    result["gemms"] = measure(args.repeats, [int(r) for r in args.rows.split(",")])
    (out / "int8-gemm.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "int8-gemm.png")
    print(f"wrote {out}/int8-gemm.json and .png")


if __name__ == "__main__":
    main()
