"""Hydragen in the served batch: the scheduler's decode step for B rows whose prompts share a cached P-token prefix,
read in place from the prefix cache (one copy, a shared segment of the step) against copied into every row's own
cache (what bmc-serve did before: the hit written into each request's prefill cache, B copies in the batch).

Both schedulers serve the same default model in this process: each first caches the prefix (one request), then
admits B requests of the prefix plus a distinct short suffix; once all B rows decode, their steps are timed one
against the other, interleaved (a step of one, a step of the other), so both see the same phases of the machine.
Reports ms per step (median and quartiles), the ratio, KV bytes held, and the tokens of both (they must agree).

    python bench/served_prefix.py                       # B = 16, P = 4096: writes JSON + PNG under bench/results/cpu
    python bench/served_prefix.py --batch 8 --prefix 2048 --steps 40
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from typing import Any

import torch

import bmc
from bmc.analytic.profile import device_name
from bmc.bench.results import write_result
from bmc.engine import GenerationConfig
from bmc.scheduler import Request, Scheduler


def running_scheduler(model: Any, prefix: list[int], suffixes: list[list[int]], in_place: bool, max_new: int
                      ) -> tuple[Scheduler, dict[int, list[int]]]:
    """A scheduler whose B rows all decode over the cached prefix (read in place, or copied in)."""
    B = len(suffixes)
    sched = Scheduler(model, max_num_seqs=B, max_num_batched_tokens=max(512, 2 * B), prefix_cache_bytes=8 << 30)
    sched.read_in_place = in_place  # the A/B switch: False copies a hit into each request's own cache
    tokens: dict[int, list[int]] = {i: [] for i in range(B)}

    def emit_to(i: int):
        return lambda out: tokens[i].append(out.token_id) if not isinstance(out, BaseException) else None

    sched.add(Request(prefix + [7], GenerationConfig(max_new_tokens=1, ignore_eos=True), lambda out: None))
    while sched.has_work():
        sched.step()
    for i, suffix in enumerate(suffixes):
        sched.add(Request(prefix + suffix, GenerationConfig(max_new_tokens=max_new, ignore_eos=True), emit_to(i)))
    while sched.waiting or sched._inbox or sched.prefilling or sched.joining or len(sched.live_rows) < B:
        sched.step()
    sched.step()  # the joins' regroup, before the timed steps
    return sched, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--suffix", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps of each scheduler")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = bmc.load(args.model)
    rng = random.Random(0)
    V = model.config.vocab_size
    prefix = [rng.randrange(100, V) for _ in range(args.prefix)]
    suffixes = [[rng.randrange(100, V) for _ in range(args.suffix)] for _ in range(args.batch)]
    max_new = args.steps + 8
    with torch.inference_mode():
        runs = {name: running_scheduler(model, prefix, suffixes, in_place, max_new)
                for name, in_place in (("in place", True), ("copied in", False))}
        times: dict[str, list[float]] = {name: [] for name in runs}
        phases: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
        native = model.net.native_decoder()
        for _ in range(args.steps):
            for name, (sched, _) in runs.items():
                if native is not None:
                    native.set_profiling(True)  # the native step's phases of this step alone
                t0 = time.perf_counter()
                sched.step()
                times[name].append(time.perf_counter() - t0)
                if native is not None:
                    phases[name].append(native.profile())
                    native.set_profiling(False)
    result: dict[str, Any] = {
        "config": dict(vars(args), host=f"{device_name(torch.device('cpu'))}, {os.cpu_count()} cpus",
                       node=platform.node(), dtype=str(model.dtype), model=os.path.basename(model.path),
                       kernel="native-cpu" if model.net.native_decoder() is not None else "torch"),
        "runs": {}}
    for name, (sched, tokens) in runs.items():
        t = sorted(times[name])
        q = statistics.quantiles(t, n=4)
        result["runs"][name] = {
            "step_ms_median": statistics.median(t) * 1e3, "step_ms_q1": q[0] * 1e3, "step_ms_q3": q[2] * 1e3,
            "kv_bytes": sched.kv_bytes, "prefix_cache_bytes": sched.prefix_cache.nbytes,
            "shared_rows": sched.shared_prefix_rows, "batch_columns": sched.cache.length,
            "batch_capacity": sched.cache.capacity,
            "phase_ms_median": {k: statistics.median(p[k] for p in phases[name]) * 1e3 for k in phases[name][0]}
            if phases[name] else {}}
    a, b = result["runs"]["in place"], result["runs"]["copied in"]
    same = runs["in place"][1] == runs["copied in"][1]
    result["speedup_median"] = b["step_ms_median"] / a["step_ms_median"]
    if a["phase_ms_median"]:
        result["attention_speedup_median"] = b["phase_ms_median"]["attention_s"] / a["phase_ms_median"]["attention_s"]
    result["tokens_equal"] = same
    for name, r in result["runs"].items():
        print(f"{name:>10}: {r['step_ms_median']:7.1f} ms/step (q1 {r['step_ms_q1']:.1f}, q3 {r['step_ms_q3']:.1f}), "
              f"batch KV {r['kv_bytes'] / 2**20:7.1f} MiB, prefix cache {r['prefix_cache_bytes'] / 2**20:6.1f} MiB, "
              f"{r['shared_rows']} rows in place")
    for name, r in result["runs"].items():
        print(f"{name:>10} phases (ms, median): " + ", ".join(f"{k[:-2]} {v:.1f}" for k, v in r["phase_ms_median"].items()))
    print(f"in place / copied in: {result['speedup_median']:.2f}x faster per step, attention "
          f"{result.get('attention_speedup_median', float('nan')):.2f}x; tokens equal: {same}")
    if not same:
        sys.exit("the two schedulers' tokens differ")
    write_result(result, args.out, __file__, f"served-prefix-b{args.batch}-p{args.prefix}", plot)


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, runs = result["config"], result["runs"]
    names = list(runs)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    med = [runs[n]["step_ms_median"] for n in names]
    err = [[runs[n]["step_ms_median"] - runs[n]["step_ms_q1"] for n in names],
           [runs[n]["step_ms_q3"] - runs[n]["step_ms_median"] for n in names]]
    axes[0].bar(names, med, yerr=err, color=["tab:green", "tab:gray"], capsize=6)
    axes[0].set_ylabel("ms per decode step (median, quartiles)")
    axes[0].set_title(f"step {result['speedup_median']:.2f}x, attention "
                      f"{result.get('attention_speedup_median', float('nan')):.2f}x faster in place", fontsize=9)
    kv = [(runs[n]["kv_bytes"] + runs[n]["prefix_cache_bytes"]) / 2**20 for n in names]
    axes[1].bar(names, kv, color=["tab:green", "tab:gray"])
    axes[1].set_ylabel("KV MiB held (batch + prefix cache)")
    fig.suptitle(f"Served batch {cfg['batch']} over a cached {cfg['prefix']}-token prefix ({cfg['model']}, "
                 f"{cfg['dtype']}, {cfg['threads']} threads, {cfg['kernel']})\n{cfg['host']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
