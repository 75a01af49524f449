"""Batch-1 decode beside busy processes (issue 44, item 4): bmc with its default threads (and its thread governor)
against llama.cpp's `llama-bench -n N` on the same GGUF file and thread count, idle and beside --busy processes that
each spin on a core (`python3 -c "while True: pass"`), the settings interleaved per round (bmc idle, bmc loaded,
llama.cpp idle, llama.cpp loaded). Reports each engine's loaded / idle ratio per round (median and range) and bmc /
llama.cpp under load.

    python bench/busy.py --llama-bench PATH [--model FILE.gguf] [--busy 1] [--tokens 256] [--rounds 3]

bmc's figure is generate()'s decode tokens/s of a random --prompt-len prompt in a fresh process per run (its load
and a warm-up call before the loaded part starts: the busy processes run for the timed call only). Writes
bench/results/cpu/busy-<host>.json and .png (or --out)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

CHILD = r"""
import json, sys, torch
import bmc
path, n, prompt_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = bmc.load(path)  # default threads: physical cores, governed
g = torch.Generator().manual_seed(0)
prompt = torch.randint(3, model.config.vocab_size, (prompt_len,), generator=g).tolist()
bmc.generate(model, [prompt], max_new_tokens=8, ignore_eos=True)  # warm-up
print("ready", flush=True)
sys.stdin.readline()  # the parent starts the load, then says go
out = bmc.generate(model, [prompt], max_new_tokens=n, ignore_eos=True)
print(json.dumps({"tok_s": out.stats.decode_tokens_per_s, "threads": torch.get_num_threads()}), flush=True)
"""


class Load:
    """`count` processes spinning on a core each, for the length of a `with`."""

    def __init__(self, count: int) -> None:
        self.count, self.procs = count, []

    def __enter__(self) -> "Load":
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.count)]
        time.sleep(0.5 if self.count else 0)
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def run_bmc(path: str, n: int, prompt_len: int, busy: int) -> dict[str, Any]:
    child = subprocess.Popen([sys.executable, "-c", CHILD, path, str(n), str(prompt_len)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    while child.stdout.readline().strip() != "ready":
        if child.poll() is not None:
            raise RuntimeError("bmc's run failed before its timed call")
    with Load(busy):
        child.stdin.write("go\n")
        child.stdin.flush()
        line = child.stdout.readline()
    child.wait(timeout=60)
    return json.loads(line)


def run_llama(llama_bench: str, path: str, n: int, threads: int, busy: int) -> float:
    with Load(busy):
        out = subprocess.run([llama_bench, "-m", path, "-p", "0", "-n", str(n), "-t", str(threads), "-r", "1", "-o",
                              "json"], capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout)[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--model", default=None, help="a GGUF file (default: bmc's default model)")
    ap.add_argument("--busy", type=int, default=1, help="spinning processes beside the loaded runs")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from bmc.bench.results import write_result
    from bmc.models import default_model_path
    from bmc.platform.topology import physical_cores

    path = args.model or default_model_path()
    threads = physical_cores()  # bmc's default, given to llama.cpp too
    samples: dict[str, list[float]] = {k: [] for k in ("bmc idle", "bmc loaded", "llama.cpp idle", "llama.cpp loaded")}
    for r in range(args.rounds):
        samples["bmc idle"].append(run_bmc(path, args.tokens, args.prompt_len, 0)["tok_s"])
        samples["bmc loaded"].append(run_bmc(path, args.tokens, args.prompt_len, args.busy)["tok_s"])
        samples["llama.cpp idle"].append(run_llama(args.llama_bench, path, args.tokens, threads, 0))
        samples["llama.cpp loaded"].append(run_llama(args.llama_bench, path, args.tokens, threads, args.busy))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in samples.items()) + " tok/s", flush=True)
    ratio = {e: [b / a for a, b in zip(samples[f"{e} idle"], samples[f"{e} loaded"])] for e in ("bmc", "llama.cpp")}
    vs = [a / b for a, b in zip(samples["bmc loaded"], samples["llama.cpp loaded"])]
    summary = {f"{e} loaded/idle": {"median": statistics.median(v), "min": min(v), "max": max(v)}
               for e, v in ratio.items()}
    summary["bmc/llama.cpp loaded"] = {"median": statistics.median(vs), "min": min(vs), "max": max(vs)}
    for k, v in summary.items():
        print(f"{k}: {v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})")
    result = {"meta": {"host": platform.node(), "model": os.path.basename(path), "threads": threads,
                       "busy_processes": args.busy, "tokens": args.tokens, "prompt_len": args.prompt_len,
                       "batch": 1, "rounds": args.rounds, "date": time.strftime("%Y-%m-%d %H:%M:%S")},
              "samples": samples, "summary": summary}
    write_result(result, args.out, __file__, "busy", plot)


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, m = result["samples"], result["meta"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    names = list(s)
    ax.bar(range(len(names)), [statistics.median(s[k]) for k in names],
           color=["tab:blue", "tab:cyan", "tab:orange", "tab:red"])
    for i, k in enumerate(names):
        ax.plot([i] * len(s[k]), s[k], "k.", ms=4)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("decode tokens/s, batch 1 (median; dots: rounds)")
    r = result["summary"]
    ax.set_title(f"{m['model']}, {m['threads']} threads, {m['busy_processes']} busy process(es), {m['host']}\n"
                 f"loaded/idle: bmc {r['bmc loaded/idle']['median']:.2f}, llama.cpp "
                 f"{r['llama.cpp loaded/idle']['median']:.2f}; bmc/llama.cpp loaded "
                 f"{r['bmc/llama.cpp loaded']['median']:.2f}x", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
