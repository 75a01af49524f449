"""Shared system prompt on a GPU (issue 42's shape): R requests share a P-token prefix, each with its own S-token
suffix, G generated (EOS ignored), C clients in a closed loop on the scheduler bmc-serve runs (in this process, no
HTTP). A Llama-7B-shaped bf16 model with random weights (bench/gpu_serve.py's; speed does not depend on the values).

Variants, one process, interleaved repeats:
  - copies:          no prefix cache: every row prefills and stores the whole prompt; plain steps graphed
  - segments-eager:  prefix cache on: rows read the cached prefix in place (Hydragen in the batch), those steps eager
  - segments-graphs: the same, the segment steps captured once the same rows read the same segments for a few steps

    python bench/gpu_shared_prefix.py --out /tmp/out     # gpu-shared-prefix-<gpu>.json and .png there
"""
from __future__ import annotations

import argparse
import json
import statistics
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
from gpu_serve import build_model_dir  # noqa: E402

VARIANTS = ("copies", "segments-eager", "segments-graphs")


def closed_loop(model: Any, prompts: list[list[int]], clients: int, gen: int, variant: str) -> dict[str, float]:
    sched = Scheduler(model, max_num_seqs=clients, max_num_batched_tokens=4096, max_length=len(prompts[0]) + gen,
                      prefix_cache_bytes=0 if variant == "copies" else 8 << 30)
    if variant == "segments-eager":
        sched.segment_graphs = None
    todo, done, first = list(prompts), [], {}

    def submit() -> None:
        i, t = len(prompts) - len(todo), time.perf_counter()

        def emit(out, i=i, t=t):
            if isinstance(out, BaseException):
                raise out
            first.setdefault(i, time.perf_counter() - t)
            if out.finish_reason is not None:
                done.append(i)
        sched.add(Request(todo.pop(0), GenerationConfig(max_new_tokens=gen, ignore_eos=True), emit,
                          device=model.device))

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(min(clients, len(todo))):
        submit()
    finished = steps = 0
    while sched.has_work():
        sched.step()
        steps += 1
        while finished < len(done):
            finished += 1
            if todo:
                submit()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    seg = sched.segment_graphs
    return {"output_tok_per_s": len(prompts) * gen / wall, "wall_s": wall, "steps": steps,
            "ttft_p50_s": statistics.median(first.values()), "peak_kv_bytes": sched.peak_kv_bytes,
            "cached_prompt_tokens": sched.counters.cached_prompt_tokens,
            "graph_replays": sched.graphs.replays if sched.graphs is not None else 0,
            "segment_graph_replays": seg.replays if seg is not None else 0,
            "segment_graph_captures": seg.captures if seg is not None else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default="/tmp/llama7b-random-16")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=2000)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="bench/out")
    a = ap.parse_args()
    cfg = build_model_dir(a.model_dir, a.layers)
    model = bmc.load(a.model_dir, dtype="bfloat16", device="cuda")
    g = torch.Generator().manual_seed(0)
    vocab = cfg["vocab_size"]
    prefix = torch.randint(3, vocab, (a.prefix,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, vocab, (a.suffix,), generator=g).tolist() for _ in range(a.requests)]
    closed_loop(model, prompts[: a.clients], a.clients, 8, "segments-graphs")  # warm-up: allocator, kernels
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for _ in range(a.repeats):
        for v in VARIANTS:
            runs[v].append(closed_loop(model, prompts, a.clients, a.gen, v))
            print(v, json.dumps(runs[v][-1]), flush=True)
            torch.cuda.empty_cache()
    best = {v: max(r["output_tok_per_s"] for r in rs) for v, rs in runs.items()}
    gpu = torch.cuda.get_device_name().replace(" ", "-")
    result = {"gpu": gpu, "model": f"Llama-7B shape, {a.layers} layers, bf16, random weights", "requests": a.requests,
              "clients": a.clients, "prefix": a.prefix, "suffix": a.suffix, "gen": a.gen, "repeats": a.repeats,
              "runs": runs, "best_output_tok_per_s": best,
              "ratios": {"segments-graphs/copies": best["segments-graphs"] / best["copies"],
                         "segments-graphs/segments-eager": best["segments-graphs"] / best["segments-eager"]}}
    print(json.dumps(result["ratios"]))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu-shared-prefix-{gpu}.json").write_text(json.dumps(result, indent=1))
    plot(result, out / f"gpu-shared-prefix-{gpu}.png")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for x, v in enumerate(VARIANTS):
        values = [r["output_tok_per_s"] for r in result["runs"][v]]
        ax.bar(x, max(values), color="#4c72b0" if v != "copies" else "#999999")
        ax.plot([x] * len(values), values, "k.", ms=8)
    ax.set_xticks(range(len(VARIANTS)), VARIANTS)
    ax.set_ylabel("output tok/s (bars: best; dots: each repeat)")
    ax.set_title(f"{result['gpu']}: {result['requests']} requests, {result['prefix']}-token shared prefix + "
                 f"{result['suffix']}, {result['gen']} generated, {result['clients']} clients\n{result['model']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
