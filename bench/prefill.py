"""Prompt processing (prefill) of one --prompt-len token prompt at batch 1: bmc against llama.cpp's `llama-bench -p N
-n 0` on the same GGUF files, each on --threads threads, repeats interleaved (llama.cpp, then bmc's modes, per
round), medians and the per-round range of bmc / llama.cpp.

bmc's figure is generate()'s prefill tokens/s of the prompt (a random one; one token generated, so the call is
its prefill) in a fresh process per run, after a warm-up call in that process; its modes are --activations
`float` (exact) and `int8` (VNNI: llama.cpp's own arithmetic for Q8_0 / Q4_0 matrices, a stated bound).

    python bench/prefill.py --llama-bench PATH FILE.gguf [FILE.gguf ...] [--prompt-len 512] [--repeats 3]
    python bench/prefill.py --write-default-quants DIR   # the default model as Q8_0 and Q4_0 GGUFs (gguf-py's
                                                         # quantizer, every matrix, as llama-quantize --pure)
Writes bench/results/cpu/prefill.json and .png (or under --out)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "cpu"

CHILD = r"""
import json, sys, torch
import bmc
path, n, threads, activations = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(threads)
model = bmc.load(path, activations=activations)
g = torch.Generator().manual_seed(0)
prompt = torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()
bmc.generate(model, [prompt[: n // 4]], max_new_tokens=1, ignore_eos=True)  # warm-up: buffers, kernels
out = bmc.generate(model, [prompt], max_new_tokens=1, ignore_eos=True)
print(json.dumps({"tok_s": out.stats.prefill_tokens_per_s}))
"""


def run_bmc(path: str, n: int, threads: int, activations: str) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, path, str(n), str(threads), activations], capture_output=True,
                         text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["tok_s"])


def run_llama(llama_bench: str, path: str, n: int, threads: int) -> float:
    out = subprocess.run([llama_bench, "-m", path, "-p", str(n), "-n", "0", "-t", str(threads), "-r", "1", "-o",
                          "json"], capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout)[0]["avg_ts"])


def write_default_quants(folder: str) -> list[str]:
    """The default model dequantized, then every 2-D matrix whose rows are whole blocks quantized to Q8_0 and to
    Q4_0 by gguf-py (the reference quantizer), norms kept in F32."""
    import gguf
    import numpy as np

    from bmc.bench.peers import f32_gguf
    from bmc.models import default_model_path

    os.makedirs(folder, exist_ok=True)
    src = f32_gguf(default_model_path(), os.path.join(folder, "model-f32.gguf"))
    paths = []
    for kind, ftype in (("Q8_0", gguf.LlamaFileType.MOSTLY_Q8_0), ("Q4_0", gguf.LlamaFileType.MOSTLY_Q4_0)):
        qt, reader = getattr(gguf.GGMLQuantizationType, kind), gguf.GGUFReader(src)
        path = os.path.join(folder, f"model-{kind.lower()}.gguf")
        w = gguf.GGUFWriter(path, str(reader.fields["general.architecture"].contents()))
        for f in reader.fields.values():
            if f.name.startswith("GGUF.") or f.name in ("general.architecture", "general.file_type"):
                continue
            w.add_key_value(f.name, f.contents(), f.types[0],
                            sub_type=f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
        w.add_file_type(ftype)
        for t in reader.tensors:
            data = np.asarray(t.data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
            if data.ndim == 2 and data.shape[-1] % 32 == 0:
                w.add_tensor(t.name, gguf.quants.quantize(data, qt), raw_dtype=qt)
            else:
                w.add_tensor(t.name, data)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        paths.append(path)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--llama-bench")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--activations", default="float,int8")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--write-default-quants", metavar="DIR")
    args = ap.parse_args()
    if args.write_default_quants:
        print("\n".join(write_default_quants(args.write_default_quants)))
        return
    if not args.files or not args.llama_bench:
        ap.error("GGUF files and --llama-bench are needed")
    modes = args.activations.split(",")
    samples = {f: {"llama.cpp": [], **{m: [] for m in modes}} for f in args.files}
    for f in args.files:  # warm-ups: the files paged in, bmc's weight files written
        run_llama(args.llama_bench, f, 64, args.threads)
        run_bmc(f, 64, args.threads, modes[0])
    for r in range(args.repeats):
        for f in args.files:
            s = samples[f]
            s["llama.cpp"].append(run_llama(args.llama_bench, f, args.prompt_len, args.threads))
            for m in modes:
                s[m].append(run_bmc(f, args.prompt_len, args.threads, m))
            print(f"round {r} {os.path.basename(f)}: llama.cpp {s['llama.cpp'][-1]:.1f}, " +
                  ", ".join(f"bmc {m} {s[m][-1]:.1f}" for m in modes) + " tok/s", flush=True)
    results = []
    for f, s in samples.items():
        ref = statistics.median(s["llama.cpp"])
        for m in modes:
            med = statistics.median(s[m])
            ratios = [a / b for a, b in zip(s[m], s["llama.cpp"])]
            results.append({"file": os.path.basename(f), "activations": m, "bmc_tok_s": s[m],
                            "llamacpp_tok_s": s["llama.cpp"], "bmc_median": med, "llamacpp_median": ref,
                            "ratio": med / ref, "ratio_range": [min(ratios), max(ratios)]})
            print(f"{os.path.basename(f)} {m}: bmc {med:.1f} / llama.cpp {ref:.1f} tok/s = {med / ref:.2f}x "
                  f"({min(ratios):.2f}-{max(ratios):.2f})")
    with open("/proc/cpuinfo") as fh:
        cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), platform.machine())
    meta = {"host": platform.node(), "cpu": cpu, "threads": args.threads, "prompt_len": args.prompt_len, "batch": 1,
            "repeats": args.repeats, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.makedirs(args.out, exist_ok=True)
    out = Path(args.out) / "prefill.json"
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    plot(results, meta, out.with_suffix(".png"))
    print(f"wrote {out} and .png")


def plot(results: list[dict], meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = sorted({r["file"] for r in results})
    modes = sorted({r["activations"] for r in results})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / (len(modes) + 1)
    for j, m in enumerate(modes):
        rs = [next(r for r in results if r["file"] == f and r["activations"] == m) for f in files]
        xs = [i + j * width for i in range(len(files))]
        ax.bar(xs, [r["bmc_median"] for r in rs], width, label=f"bmc, {m} activations")
        for x, r in zip(xs, rs):
            ax.text(x, r["bmc_median"], f"{r['ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
    ref = [next(r["llamacpp_median"] for r in results if r["file"] == f) for f in files]
    ax.bar([i + len(modes) * width for i in range(len(files))], ref, width, label="llama.cpp (llama-bench)",
           color="gray")
    ax.set_xticks([i + len(modes) * width / 2 for i in range(len(files))], files)
    ax.set_ylabel(f"prefill tokens/s of a {meta['prompt_len']}-token prompt (median)")
    ax.set_title(f"Prefill at batch 1, {meta['threads']} threads of {meta['cpu']}, {meta['repeats']} interleaved "
                 f"rounds\nlabels: bmc / llama.cpp", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
