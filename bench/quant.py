"""Quantized weights, bmc against llama.cpp on the same GGUF files: decode tok/s at batch 1 and 8 and perplexity on
held-out text, per precision, in one run.

    python bench/quant.py --llama-bin DIR     # DIR: a llama.cpp build's bin/ (llama-bench, llama-batched-bench,
                                              # llama-perplexity, llama-quantize); without it, bmc alone

Files (under --work-dir): Q4_1 is the default model as shipped; F32 is it dequantized (bmc.bench.peers.f32_gguf);
F16, BF16, Q8_0, Q4_0 and Q6_K are llama-quantize --pure of the F32 file (every matrix in that type where its rows allow),
Q4_K_M llama-quantize's own mix of Q4_K, Q6_K and (rows not whole super-blocks) Q5_0 / Q8_0. Both engines read the
same file: bmc keeps every block as stored (quant="auto"; F32 runs float32).
- decode: bmc's generate() decode tok/s on 8 synthetic 32-token prompts (batch 8) or the first (batch 1), 128
  tokens, EOS ignored, best of --repeats; llama.cpp's llama-bench tg128 (batch 1) and llama-batched-bench's S_TG
  at 8 sequences of 32 + 128 tokens;
- perplexity: bmc.perplexity and llama-perplexity, both chunks of --ctx tokens scoring each second half, the first
  --chunks chunks of the text: Python's own documentation (pydoc_data.topics, shipped with CPython; neither
  engine's test domain) unless --text names a file.
Writes JSON and a PNG (tok/s per precision and engine; perplexity per precision and engine) under
bench/results/cpu/."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from typing import Any

from bmc.bench.results import write_result

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q6_K", "Q4_0", "Q4_1", "Q4_K_M"]
# llama-quantize --pure: every matrix in the type (a K-quant falls back to Q8_0 where a row is not whole
# super-blocks: the model's width 576 is not a multiple of 256, only ffn_down's 1536 is); Q4_K_M: llama.cpp's mix
PURE = {"F16": True, "BF16": True, "Q8_0": True, "Q4_0": True, "Q6_K": True, "Q4_K_M": False}


def held_out_text(path: str | None) -> tuple[str, str]:
    if path:
        with open(path, encoding="utf-8") as f:
            return f.read(), path
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)), f"pydoc_data.topics (Python {platform.python_version()})"


def model_files(work: str, llama_bin: str | None) -> dict[str, str]:
    from bmc.bench.peers import f32_gguf
    from bmc.models import default_model_path

    src = default_model_path()
    files = {"Q4_1": src, "F32": f32_gguf(src, os.path.join(work, "model-f32.gguf"))}
    for t, pure in PURE.items():
        dst = os.path.join(work, f"model-{t.lower()}{'' if pure else '-mix'}.gguf")
        if not os.path.exists(dst) and llama_bin:
            subprocess.run([os.path.join(llama_bin, "llama-quantize"), *(["--pure"] if pure else []), files["F32"],
                            dst, t], check=True, capture_output=True)
        if os.path.exists(dst):
            files[t] = dst
    return files


def has_quantized(path: str) -> bool:
    from bmc.models.gguf_file import GGUFFile

    return any(t.tensor_type.name not in ("F32", "F16", "BF16") for t in GGUFFile(path).tensors.values())


def bmc_row(path: str, text: str, args: argparse.Namespace) -> dict[str, Any]:
    import bmc
    from bmc.cli.generate import synthetic_prompts

    model = bmc.load(path, activations=args.activations if has_quantized(path) else "float")
    prompts = synthetic_prompts(model, 8, 32)
    bmc.generate(model, prompts[:1], max_new_tokens=4, ignore_eos=True)  # warm-up
    from collections import Counter

    kept = Counter(lin.quant or "float32" for lin in model.linears())
    row: dict[str, Any] = {"quant": model.quant, "activations": model.activations, "weight_bytes": model.weight_bytes,
                           "matrices": dict(kept)}
    from bmc.bench.engines import stream_read_gbps

    gbps = [stream_read_gbps()]  # around batch 1: this host's bandwidth drifts by 1.5x between minutes
    for batch in (1, 8):
        best = 0.0
        for _ in range(args.repeats):
            out = bmc.generate(model, prompts[:batch], max_new_tokens=args.gen, ignore_eos=True)
            best = max(best, out.stats.decode_tokens_per_s)
        row[f"decode_b{batch}"] = best
        if batch == 1:
            gbps.append(stream_read_gbps())
    # batch 1's roofline: the weight bytes a step streams (the KV, ~7 MB at these lengths, left out) at the higher
    # of the read bandwidths measured just before and just after
    row.update(read_gb_per_s=gbps, b1_roofline_fraction=row["decode_b1"] * model.weight_bytes / (max(gbps) * 1e9))
    res = bmc.perplexity(model, text, context=args.ctx, max_chunks=args.chunks)
    row.update(ppl=res.ppl, ppl_stderr=res.ppl_stderr, ppl_seconds=res.seconds)
    return row


def llama_row(path: str, text_file: str, args: argparse.Namespace) -> dict[str, Any]:
    b, t = args.llama_bin, str(args.threads)
    out = subprocess.run([os.path.join(b, "llama-bench"), "-m", path, "-p", "0", "-n", str(args.gen), "-t", t,
                          "-r", str(args.repeats), "-o", "json"], capture_output=True, text=True, check=True).stdout
    row: dict[str, Any] = {"decode_b1": json.loads(out)[0]["avg_ts"]}
    out = subprocess.run([os.path.join(b, "llama-batched-bench"), "-m", path, "-c", "4096", "-npp", "32",
                          "-ntg", str(args.gen), "-npl", "8", "-t", t, "-tb", t], capture_output=True, text=True,
                         check=True).stdout
    # the table's last row: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    cells = [c.strip() for c in [ln for ln in out.splitlines() if ln.startswith("|")][-1].strip("|").split("|")]
    row["decode_b8"] = float(cells[7])
    out = subprocess.run([os.path.join(b, "llama-perplexity"), "-m", path, "-f", text_file, "-c", str(args.ctx),
                          "--chunks", str(args.chunks), "-t", t, "-b", str(4 * args.ctx)], capture_output=True,
                         text=True, check=True)
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out.stdout + out.stderr)
    row.update(ppl=float(m.group(1)), ppl_stderr=float(m.group(2))) if m else row.update(ppl=None)
    return row


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bmc.bench.plots import engine_bars, save_titled

    types = [t for t in TYPES if t in result["rows"]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, title in ((axes[0], "decode_b1", "decode tok/s, batch 1"), (axes[1], "decode_b8", "decode tok/s, batch 8"),
                           (axes[2], "ppl", "perplexity (lower is better)")):
        engine_bars(ax, result["rows"], types, key, title)
    axes[0].legend()
    c = result["config"]
    save_titled(fig, f"SmolLM2-135M-Instruct GGUF, bmc (activations {c.get('activations', 'float')}) vs llama.cpp, "
                 f"{c['threads']} threads, {c['host']}; perplexity: "
                 f"{c['chunks']} chunks of {c['ctx']} of {c['text']}", path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-bin", help="a llama.cpp build's bin/ directory (llama-bench, llama-batched-bench, "
                   "llama-perplexity, llama-quantize)")
    p.add_argument("--text", help="held-out text file (default: Python's pydoc_data.topics)")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--work-dir", default=os.path.expanduser("~/.cache/bmc/bench"))
    p.add_argument("--types", default=",".join(TYPES), help=f"comma-separated, of {','.join(TYPES)}")
    p.add_argument("--activations", default="float", choices=["float", "int8"],
                   help="bmc's activations on quantized matrices (int8: as llama.cpp computes them; F32 stays float)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    unknown = set(args.types.split(",")) - set(TYPES)
    if unknown:
        p.error(f"unknown --types {', '.join(sorted(unknown))}; choose from {', '.join(TYPES)}")
    os.makedirs(args.work_dir, exist_ok=True)
    import torch

    from bmc.analytic.profile import device_name

    torch.set_num_threads(args.threads)
    text, text_name = held_out_text(args.text)
    text_file = os.path.join(args.work_dir, "heldout.txt")
    with open(text_file, "w", encoding="utf-8") as f:
        f.write(text)
    files = model_files(args.work_dir, args.llama_bin)
    host = f"{device_name(torch.device('cpu'))}, {os.cpu_count()} cpus"
    result: dict[str, Any] = {"config": dict(vars(args), host=host, text=text_name,
                                             text_sha256=hashlib.sha256(text.encode()).hexdigest()[:16],
                                             files={t: os.path.basename(f) for t, f in files.items()}), "rows": {}}
    for t in [t for t in TYPES if t in args.types.split(",")]:
        if t not in files:
            print(f"{t}: no file (needs --llama-bin for llama-quantize)", file=sys.stderr)
            continue
        rows = result["rows"][t] = {}
        t0 = time.time()
        rows["bmc"] = bmc_row(files[t], text, args)
        if args.llama_bin:
            rows["llama.cpp"] = llama_row(files[t], text_file, args)
        line = "  ".join(f"{e}: b1 {r['decode_b1']:.1f} b8 {r['decode_b8']:.1f} tok/s ppl {r['ppl']:.4f}"
                         for e, r in rows.items())
        line += f"  bmc b1 {100 * rows['bmc']['b1_roofline_fraction']:.0f}% of roofline"
        ratio = ""
        if "llama.cpp" in rows:
            rb, rl = rows["bmc"], rows["llama.cpp"]
            ratio = (f"  bmc/llama.cpp b1 {rb['decode_b1'] / rl['decode_b1']:.2f}x b8 "
                     f"{rb['decode_b8'] / rl['decode_b8']:.2f}x ppl {rb['ppl'] / rl['ppl']:.4f}")
        print(f"{t:>5}: {line}{ratio}  ({time.time() - t0:.0f} s)", flush=True)
    write_result(result, args.out, __file__, "quant", plot)

if __name__ == "__main__":
    main()
