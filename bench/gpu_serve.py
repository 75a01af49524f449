"""Served against offline on a GPU (issue 42's target): a Llama-7B-shaped bf16 model with random weights (speed does
not depend on the values), 128-token prompts of token ids, 128 generated with EOS ignored.

  1. generate() at batch 1 and batch C (the offline ceiling);
  2. the scheduler in this process (the engine bmc-serve runs, without HTTP) in a closed loop of 1 and C clients,
     with its decode step captured as CUDA graphs and eagerly (`--no-cuda-graphs`);
  3. bmc-serve over HTTP (token-id prompts on /v1/completions, streamed), the same closed loops.

Output tok/s is generated tokens over wall time, first request sent to last token received. Run on a device host:

    python bench/gpu_serve.py --out /tmp/out            # writes gpu-serve-<gpu>.json and .png there
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bmc  # noqa: E402
from bmc.engine import GenerationConfig  # noqa: E402
from bmc.scheduler import Request, Scheduler  # noqa: E402


def build_model_dir(path: str, layers: int) -> dict:
    """A Llama-7B-shaped model with random weights saved as an HF directory (bf16 safetensors), once."""
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers,
                                   num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                   max_position_embeddings=4096, torch_dtype="bfloat16")
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        with torch.device("cuda"):
            hf = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        hf.save_pretrained(path)
        del hf
        gc.collect()
        torch.cuda.empty_cache()
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        save_word_tokenizer(path, cfg.vocab_size)
    return cfg.to_dict()


def save_word_tokenizer(path: str, vocab_size: int) -> None:
    """A tokenizer of `vocab_size` words (" w0", " w1", ...): every token decodes to text, so each streamed token is
    a chunk the client sees."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"\u2581w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, f)


def offline(model: Any, prompts: list[list[int]], batch: int, gen: int) -> dict[str, float]:
    bmc.generate(model, prompts[:batch], max_new_tokens=8, ignore_eos=True)  # warm-up (graphs, allocator)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = bmc.generate(model, prompts[:batch], max_new_tokens=gen, ignore_eos=True)
    wall = time.perf_counter() - t0
    return {"batch": batch, "output_tok_per_s": batch * gen / wall, "decode_tok_per_s": out.stats.decode_tokens_per_s,
            "wall_s": wall}


def scheduler_loop(model: Any, prompts: list[list[int]], clients: int, gen: int, graphs: bool, max_seqs: int
                   ) -> dict[str, float]:
    """A closed loop of `clients` in this process: a request is added as soon as one finishes."""
    sched = Scheduler(model, max_num_seqs=max_seqs, max_num_batched_tokens=max(2048, 2 * max_seqs),
                      cuda_graphs=graphs)
    todo = list(prompts)
    done: list[int] = []
    first: dict[int, float] = {}

    def submit() -> None:
        i = len(prompts) - len(todo)
        p = todo.pop()
        t = time.perf_counter()

        def emit(out, i=i, t=t):
            if isinstance(out, BaseException):
                raise out
            first.setdefault(i, time.perf_counter() - t)
            if out.finish_reason is not None:
                done.append(i)
        sched.add(Request(p, GenerationConfig(max_new_tokens=gen, ignore_eos=True), emit, device=model.device))

    for _ in range(min(clients, len(todo))):
        submit()
    t0 = time.perf_counter()
    finished = 0
    while sched.has_work():
        sched.step()
        while finished < len(done):
            finished += 1
            if todo:
                submit()
    wall = time.perf_counter() - t0
    ttft = sorted(first.values())
    return {"clients": clients, "requests": len(prompts), "output_tok_per_s": len(prompts) * gen / wall,
            "ttft_p50_s": ttft[len(ttft) // 2], "wall_s": wall,
            "graph_replays": sched.graphs.replays if sched.graphs is not None else 0}


def http_loop(model_dir: str, prompts: list[list[int]], clients: list[int], gen: int, max_seqs: int,
              flags: list[str]) -> list[dict[str, Any]]:
    from serve import Engine, closed_loop, summarize

    cmd = [sys.executable, "-m", "bmc.cli.serve", "--model", model_dir, "--device", "cuda", "--dtype", "bfloat16",
           "--port", "{port}", "--max-num-seqs", str(max_seqs), "--max-num-batched-tokens", str(max(2048, 2 * max_seqs)),
           "--log-level", "warning", "--no-prefix-cache", *flags]
    engine = Engine("bmc-serve", cmd, extra={"ignore_eos": True}, startup_s=900)
    engine.start()
    rows = []
    try:
        asyncio.run(closed_loop(engine.url, engine.model_name, prompts[:2], [8, 8], 2, engine.extra))  # warm-up
        for c in clients:
            n = max(2 * c, 4)
            results, dur = asyncio.run(closed_loop(engine.url, engine.model_name, prompts[:n], [gen] * n, c,
                                                   engine.extra))
            row = dict(summarize(results, dur, 10.0, 1.0), clients=c, flags=" ".join(flags))
            rows.append(row)
            print(f"  bmc-serve {' '.join(flags) or '(graphs)'} c={c}: {row['output_tok_per_s']:.1f} tok/s, "
                  f"failed {row['failed']}", flush=True)
    finally:
        engine.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default="/tmp/llama7b-random")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--no-http", action="store_true")
    ap.add_argument("--profile", action="store_true", help="only cProfile the scheduler's closed loop at --clients")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    C = args.clients
    cfg = build_model_dir(args.model_dir, args.layers)
    V = cfg["vocab_size"]
    prompts = [[(13 * b + 7 * i) % (V - 10) + 5 for i in range(args.prompt)] for b in range(2 * C)]
    result: dict[str, Any] = {"config": dict(vars(args), gpu=torch.cuda.get_device_name(), dtype="bfloat16",
                                             torch=torch.__version__), "offline": [], "scheduler": [], "http": []}
    model = bmc.load(args.model_dir, dtype="bfloat16", device="cuda")
    if args.profile:
        import cProfile
        import pstats

        scheduler_loop(model, prompts[:C], C, 16, True, C)  # warm-up
        prof = cProfile.Profile()
        prof.runcall(scheduler_loop, model, prompts, C, args.gen, True, C)
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        return
    for batch in (1, C):
        row = offline(model, prompts, batch, args.gen)
        result["offline"].append(row)
        print(f"generate() batch {batch}: {row['output_tok_per_s']:.1f} tok/s", flush=True)
    for graphs in (True, False):
        for c in (1, C):
            n = max(2 * c, 4)
            row = dict(scheduler_loop(model, prompts[:n], c, args.gen, graphs, C), cuda_graphs=graphs)
            result["scheduler"].append(row)
            print(f"scheduler graphs={graphs} c={c}: {row['output_tok_per_s']:.1f} tok/s "
                  f"(replays {row['graph_replays']})", flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    if not args.no_http:
        for flags in ([], ["--no-cuda-graphs"]):
            result["http"] += http_loop(args.model_dir, prompts, [1, C], args.gen, C, flags)
    off = {r["batch"]: r["output_tok_per_s"] for r in result["offline"]}
    result["ratios"] = {
        f"{kind} {'graphs' if r.get('cuda_graphs', not r.get('flags')) else 'eager'} c={r['clients']} / batch":
            r["output_tok_per_s"] / off[r["clients"]]
        for kind in ("scheduler", "http") for r in result[kind]}
    for k, v in result["ratios"].items():
        print(f"  {k}: {v:.2f}")
    os.makedirs(args.out, exist_ok=True)
    name = "gpu-serve-" + torch.cuda.get_device_name().split()[-2].lower()
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(args.out, name + ".png"))


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values = [], []
    for r in result["offline"]:
        labels.append(f"generate()\nbatch {r['batch']}")
        values.append(r["output_tok_per_s"])
    for r in result["scheduler"]:
        labels.append(f"scheduler {'graphs' if r['cuda_graphs'] else 'eager'}\nc={r['clients']}")
        values.append(r["output_tok_per_s"])
    for r in result["http"]:
        labels.append(f"bmc-serve {'eager' if r['flags'] else 'graphs'}\nc={r['clients']}")
        values.append(r["output_tok_per_s"])
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 1.1), 4.5))
    ax.bar(range(len(labels)), values, color=["tab:blue" if "generate" in s else "tab:green" for s in labels])
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("output tok/s (log)")
    cfg = result["config"]
    ax.set_title(f"Served vs offline, Llama-7B-shaped bf16 random weights, {cfg['prompt']}/{cfg['gen']} tokens, "
                 f"{cfg['gpu']}", fontsize=9)
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
