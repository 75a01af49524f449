"""Mixture-of-experts decode (issue 47): bmc against llama.cpp on the same GGUF file, an OLMoE-1B-7B-shaped model
(16 layers, hidden 2048, 16 heads of 128, 64 experts of width 1024, top 8, q/k norms over all heads) or, with
`--shape qwen3-30b-a3b`, a Qwen3-30B-A3B-shaped one (48 layers, 32 query heads over 4 KV heads, 128 experts of width
768, top 8, q/k norms per head), with random blocks in Q4_0 or Q8_0 (the router in float32, as llama.cpp keeps it).
The vocabulary is the default model's (SmolLM2's 49152 tokens, copied into the file so that llama.cpp loads it) in
place of OLMoE's 50304 or Qwen3's 151936.

Decode tokens/s at batch 1 (llama.cpp: `llama-bench -p 0 -n N`) and batch B (`llama-batched-bench -npl B`), each
engine on `--threads` threads, repeats interleaved (bmc, llama.cpp, bmc, ...), medians and ranges. For bmc also the
bytes a decode step reads: the dense matrices, plus the experts its rows chose (counted by the native step's
profile on a step of B rows of random tokens), and that as a share of the machine's read bandwidth (stream_read):
the kind's best, each round's, and each run's own (stream_read in the run's process just before and just after the
timed generate() call; the PNG's label), since this VM's bandwidth moves between phases within minutes.

    python bench/moe.py --llama-bench PATH --batched-bench PATH [--kinds q4_0,q8_0] [--batches 1,8]
    python bench/moe.py --shape qwen3-30b-a3b --kinds q4_0 --vocab-from TOKENIZER.gguf --out DIR   # bmc alone
Writes bench/results/cpu/moe-<shape>.json and .png. Files go to --dir (default /tmp/bmc-moe; OLMoE ~11 GB for both
kinds, Qwen3-30B-A3B 17 GB in Q4_0).
"""
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

import numpy as np

OUT = Path(__file__).resolve().parent / "results" / "cpu"
SHAPES = {  # arch: the GGUF architecture; q/k norms over all heads (olmoe) or per head (qwen3moe)
    "olmoe": dict(arch="olmoe", layers=16, hidden=2048, heads=16, kv_heads=16, head_dim=128, experts=64, top_k=8,
                  expert_ff=1024),
    # Qwen3-30B-A3B: 48 layers, 32 query heads over 4 KV heads, 128 experts of width 768, top 8 (vocabulary: see above)
    "qwen3-30b-a3b": dict(arch="qwen3moe", layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128,
                          top_k=8, expert_ff=768),
    "smoke": dict(arch="olmoe", layers=2, hidden=256, heads=2, kv_heads=2, head_dim=128, experts=8, top_k=2,
                  expert_ff=128),  # a quick check of the script
}

CHILD = r"""
import json, sys, time, torch
import bmc
from bmc.kv import KV_STRATEGIES
from bmc.attention import dense_attention
path, B, n, threads, activations = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.set_num_threads(threads)
model = bmc.load(path, share_weights=True, activations=activations)
cfg = model.config
g = torch.Generator().manual_seed(B)
prompts = [torch.randint(3, cfg.vocab_size, (16,), generator=g).tolist() for _ in range(B)]
bmc.generate(model, prompts, max_new_tokens=8, ignore_eos=True)  # warm-up
# the read bandwidth just before and just after the timed run: this VM's bandwidth moves between phases (35-61 GB/s
# within an hour), so a run is measured against its own moment's roofline
from bmc.bench.engines import stream_read_gbps
read_before = stream_read_gbps(repeats=2)
out = bmc.generate(model, prompts, max_new_tokens=n, ignore_eos=True)
read_after = stream_read_gbps(repeats=2)
# experts a decode step of B rows reads: one step of random tokens with the step's profile on
dec = model.net.native_decoder()
cache = KV_STRATEGIES["upfront"](num_layers=cfg.num_layers, batch_size=B, num_kv_heads=cfg.num_kv_heads,
                                 head_dim=cfg.head_dim, max_length=4)
cache.reserve(1)
dec.set_profiling(True)
with torch.inference_mode():
    model.net(torch.randint(3, cfg.vocab_size, (B, 1), generator=g), torch.zeros(B, 1, dtype=torch.long), cache,
              dense_attention, cache.attention_bias(1))
runs = dec.profile()["expert_runs"]
dec.set_profiling(False)
L0 = model.net.layers[0]
per_expert = sum(model._bytes_of(lin) for lin in (L0.experts_gate_up, L0.experts_down)) / cfg.num_experts
experts = sum(model._bytes_of(lin) for L in model.net.layers for lin in (L.experts_gate_up, L.experts_down))
step_bytes = model.weight_bytes - experts + runs * per_expert
print(json.dumps({"tok_s": out.stats.decode_tokens_per_s, "experts_per_layer": runs / cfg.num_layers,
                  "step_bytes": step_bytes, "read_before": read_before, "read_after": read_after}))
"""


def write_moe_shaped(path: str, kind: str, vocab_from: str, shape: dict) -> None:
    """A GGUF of `shape["arch"]` of random `kind` blocks, with `vocab_from`'s tokenizer (every tokenizer.* key).
    One layer's blocks serve every layer (speed does not depend on the values; generating 16 GB of them would take
    longer than the runs), each layer with a router of its own."""
    import gguf

    sys.path.insert(0, os.path.dirname(__file__))
    from load_memory import random_blocks

    s, rng = shape, np.random.default_rng(0)
    D, E, I, hd, H, KV = s["hidden"], s["experts"], s["expert_ff"], s["head_dim"], s["heads"], s["kv_heads"]
    reader = gguf.GGUFReader(vocab_from)
    V = len(reader.fields["tokenizer.ggml.tokens"].data)
    w = gguf.GGUFWriter(path + ".part", s["arch"])
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    for add, v in ((w.add_block_count, s["layers"]), (w.add_context_length, 4096), (w.add_embedding_length, D),
                   (w.add_feed_forward_length, I), (w.add_head_count, H), (w.add_head_count_kv, KV),
                   (w.add_key_length, hd), (w.add_value_length, hd), (w.add_layer_norm_rms_eps, 1e-5),
                   (w.add_rope_freq_base, 1e4), (w.add_vocab_size, V), (w.add_expert_count, E),
                   (w.add_expert_used_count, s["top_k"]), (w.add_expert_feed_forward_length, I)):
        add(v)
    qtype = getattr(gguf.GGMLQuantizationType, kind.upper())

    made: dict[tuple[int, ...], np.ndarray] = {}

    def add_blocks(name: str, *dims: int) -> None:
        if dims not in made:
            made[dims] = random_blocks(kind, int(np.prod(dims[:-1])), dims[-1], rng).reshape(*dims[:-1], -1)
        w.add_tensor(name, made[dims], raw_dtype=qtype)

    add_blocks("token_embd.weight", V, D)
    add_blocks("output.weight", V, D)
    w.add_tensor("output_norm.weight", np.ones(D, np.float32))
    qk_norm = D if s["arch"] == "olmoe" else hd  # OLMoE normalises q and k over all heads, Qwen3 per head
    for i in range(s["layers"]):
        for name, rows in (("attn_q", H * hd), ("attn_k", KV * hd), ("attn_v", KV * hd)):
            add_blocks(f"blk.{i}.{name}.weight", rows, D)
        add_blocks(f"blk.{i}.attn_output.weight", D, H * hd)
        for name, n in (("attn_norm", D), ("ffn_norm", D), ("attn_q_norm", qk_norm),
                        ("attn_k_norm", qk_norm * KV // H if s["arch"] == "olmoe" else qk_norm)):
            w.add_tensor(f"blk.{i}.{name}.weight", np.ones(n, np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", rng.normal(0, 0.05, (E, D)).astype(np.float32))
        add_blocks(f"blk.{i}.ffn_gate_exps.weight", E, I, D)
        add_blocks(f"blk.{i}.ffn_up_exps.weight", E, I, D)
        add_blocks(f"blk.{i}.ffn_down_exps.weight", E, D, I)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(path + ".part", path)


def write_tokenizer_only(src: str, dst: str) -> None:
    """A GGUF of `src`'s tokenizer.* keys alone (2 MB for SmolLM2): --vocab-from on hosts the model cannot reach."""
    import gguf

    reader, w = gguf.GGUFReader(src), gguf.GGUFWriter(dst, "llama")
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def run_bmc(path: str, B: int, n: int, threads: int, mode: str = "float") -> dict:
    """mode: bmc's activations, then optionally an environment setting: "int8 BMC_MOE_SPREAD=0"."""
    activations, *env = mode.split(" ")
    out = subprocess.run([sys.executable, "-c", CHILD, path, str(B), str(n), str(threads), activations],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, **dict(e.split("=", 1) for e in env)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_llama(args: argparse.Namespace, path: str, B: int, n: int) -> float:
    if B == 1:
        out = subprocess.run([args.llama_bench, "-m", path, "-t", str(args.threads), "-p", "0", "-n", str(n), "-r", "1",
                              "-o", "json"], capture_output=True, text=True, check=True)
        return float(json.loads(out.stdout)[0]["avg_ts"])
    out = subprocess.run([args.batched_bench, "-m", path, "-t", str(args.threads), "-c", str(B * (16 + n) + 64),
                          "-npp", "16", "-ntg", str(n), "-npl", str(B)], capture_output=True, text=True, check=True)
    lines = [line.strip().strip("|").split("|") for line in out.stdout.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0]]
    rows = [r for r in lines[1:] if r[0].strip().isdigit()]
    return float(rows[-1][header.index("S_TG t/s")])  # generated tokens/s of all B sequences


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench; without it (and --batched-bench) bmc runs alone")
    ap.add_argument("--batched-bench")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="olmoe")
    ap.add_argument("--vocab-from", help="a GGUF whose tokenizer.* keys the file takes (default: the default model)")
    ap.add_argument("--kinds", default="q4_0,q8_0")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dir", default="/tmp/bmc-moe")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--activations", default="float,int8", help="bmc's modes: float (exact) and int8 (VNNI, "
                    "a stated bound; llama.cpp's own arithmetic for these types), each optionally with settings of "
                    "bmc's A/B switches: 'int8 BMC_MOE_SPREAD=0'")
    ap.add_argument("--smoke", action="store_true", help="--shape smoke: a tiny model, to check the script")
    ap.add_argument("--tokenizer-only", metavar="PATH", help="write the default model's tokenizer alone to PATH, "
                    "for --vocab-from on a device host, and stop")
    args = ap.parse_args()
    if args.tokenizer_only:
        import bmc.models

        write_tokenizer_only(bmc.models.default_model_path(), args.tokenizer_only)
        return
    name = "smoke" if args.smoke else args.shape
    shape = SHAPES[name]
    with_llama = bool(args.llama_bench and args.batched_bench)
    import bmc.models

    os.makedirs(args.dir, exist_ok=True)
    files = {}
    for kind in args.kinds.split(","):
        files[kind] = os.path.join(args.dir, f"{name}-shaped-{kind}.gguf")
        if not os.path.exists(files[kind]):
            t = time.perf_counter()
            write_moe_shaped(files[kind], kind, args.vocab_from or bmc.models.default_model_path(), shape)
            print(f"wrote {files[kind]} ({os.path.getsize(files[kind]) / 1e9:.2f} GB) in {time.perf_counter() - t:.0f} s",
                  flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    from bmc.bench.engines import stream_read_gbps

    read: dict[str, list[float]] = {}  # the roofline: one pass over a large buffer on all threads, per kind
    rounds_read: dict[str, list[float]] = {kind: [] for kind in files}  # and again before every round
    modes = args.activations.split(",")
    samples: dict[tuple[str, int], dict[str, list]] = {(k, b): {"llama.cpp": [], **{m: [] for m in modes},
                                                                "detail": []} for k in files for b in batches}
    # one kind at a time: its GGUF and bmc's weight file for it must both stay in the page cache (the Q8_0 pair is
    # 15 GB; both kinds' files at once, 23 GB, were read from disk again each run on a 24 GB machine)
    for kind, path in files.items():
        read[kind] = [stream_read_gbps()]
        t = time.perf_counter()
        run_bmc(path, batches[0], 8, args.threads, modes[0])  # warm-ups: the files paged in (the first makes bmc's)
        print(f"{kind}: bmc's first load and a warm-up run in {time.perf_counter() - t:.0f} s", flush=True)
        if with_llama:
            run_llama(args, path, 1, 8)
        for r in range(args.repeats):
            rounds_read[kind].append(stream_read_gbps())  # each round's own roofline: the VM's bandwidth drifts
            for B in batches:
                s = samples[kind, B]
                for mode in modes:
                    got = run_bmc(path, B, args.tokens, args.threads, mode)
                    s[mode].append(got["tok_s"])
                    s["detail"].append(got)
                    s.setdefault(f"{mode} runs", []).append(got)
                if with_llama:
                    s["llama.cpp"].append(run_llama(args, path, B, args.tokens))
                print(f"round {r} {kind} B={B}: " + ", ".join(f"bmc {m} {s[m][-1]:.1f}" for m in modes) +
                      (f", llama.cpp {s['llama.cpp'][-1]:.1f}" if with_llama else "") +
                      f" tok/s ({got['experts_per_layer']:.1f} experts a layer)", flush=True)
        read[kind].append(stream_read_gbps())
    results = []
    for (kind, B), s in samples.items():
        read_gb_s = max(read[kind])  # bandwidth drifts on a VM: the kind's best, before or after its runs
        ref = s["llama.cpp"]
        d = s["detail"][-1]
        for mode in modes:
            med = statistics.median(s[mode])
            gb_s = med / B * d["step_bytes"] / 1e9
            # each round's share of the bandwidth measured just before it (its runs beside their own roofline)
            shares = [t / B * d["step_bytes"] / 1e9 / rr for t, rr in zip(s[mode], rounds_read[kind])]
            # each run against the read bandwidth measured in its own process just before and after it
            run_reads = [(g["read_before"] + g["read_after"]) / 2 for g in s[f"{mode} runs"]]
            run_shares = [t / B * d["step_bytes"] / 1e9 / rr for t, rr in zip(s[mode], run_reads)]
            row = {"kind": kind, "batch": B, "activations": mode, "bmc_tok_s": s[mode], "bmc_median": med,
                   "experts_per_layer": d["experts_per_layer"], "step_gb": d["step_bytes"] / 1e9,
                   "achieved_gb_s": gb_s, "read_gb_s": read_gb_s, "roofline_share": gb_s / read_gb_s,
                   "rounds_read_gb_s": rounds_read[kind], "round_shares": shares,
                   "round_share_median": statistics.median(shares), "run_read_gb_s": run_reads,
                   "run_read_before_after": [(g["read_before"], g["read_after"]) for g in s[f"{mode} runs"]],
                   "run_shares": run_shares, "run_share_median": statistics.median(run_shares)}
            if ref:
                row.update({"llamacpp_tok_s": ref, "llamacpp_median": statistics.median(ref),
                            "ratio": med / statistics.median(ref),
                            "ratio_range": [min(a / b for a, b in zip(s[mode], ref)),
                                            max(a / b for a, b in zip(s[mode], ref))]})
            results.append(row)
            vs = f" / llama.cpp {row['llamacpp_median']:.1f} tok/s = {row['ratio']:.2f}x" if ref else " tok/s"
            print(f"{kind} B={B} activations={mode}: bmc {med:.1f}{vs}; {d['step_bytes'] / 1e9:.2f} GB a step, "
                  f"{gb_s:.1f} GB/s = {gb_s / read_gb_s:.0%} of {read_gb_s:.1f}; each round against its own "
                  f"stream_read: median {row['round_share_median']:.0%} "
                  f"({min(shares):.0%}-{max(shares):.0%}); each run against the stream_read beside it: median "
                  f"{row['run_share_median']:.0%} ({min(run_shares):.0%}-{max(run_shares):.0%})")
    meta = {"host": platform.node(), "cpu": _cpu_name(), "threads": args.threads, "tokens": args.tokens,
            "prompt_tokens": 16, "repeats": args.repeats, "shape": name, "dims": shape,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.makedirs(args.out, exist_ok=True)
    out = Path(args.out) / ("moe-smoke.json" if args.smoke else f"moe-{name}.json")
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    plot(results, meta, out.with_suffix(".png"))
    print(f"wrote {out} and .png")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def plot(results: list[dict], meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    groups = sorted({(r["kind"], r["batch"]) for r in results})
    modes = sorted({r["activations"] for r in results})
    width = 0.8 / (len(modes) + 1)
    for j, mode in enumerate(modes):
        rs = [next(r for r in results if (r["kind"], r["batch"]) == g and r["activations"] == mode) for g in groups]
        xs = [i + j * width for i in range(len(groups))]
        ax.bar(xs, [r["bmc_median"] for r in rs], width, label=f"bmc, {mode} activations")
        for x, r in zip(xs, rs):
            label = (f"{r['ratio']:.2f}x\n" if "ratio" in r else "") + f"{r['run_share_median']:.0%}"
            ax.text(x, r["bmc_median"], label, ha="center", va="bottom", fontsize=7)
    if all("llamacpp_median" in r for r in results):
        ref = [next(r["llamacpp_median"] for r in results if (r["kind"], r["batch"]) == g) for g in groups]
        ax.bar([i + len(modes) * width for i in range(len(groups))], ref, width, label="llama.cpp", color="gray")
    ax.set_xticks([i + len(modes) * width / 2 for i in range(len(groups))],
                  [f"{k.upper()}\nbatch {b}" for k, b in groups])
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_ylim(0, max(r["bmc_median"] for r in results) * 1.2)
    d = meta["dims"]
    ax.set_title(f"{meta['shape']} shape ({d['experts']} experts, top {d['top_k']}), random weights, "
                 f"{meta['threads']} threads of {meta['cpu']}, {meta['tokens']} tokens\nlabels: bmc / llama.cpp "
                 f"(where run), and the share of the read bandwidth (measured beside each run) bmc reaches", fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
