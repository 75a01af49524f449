"""tree="auto" against plain decoding and fixed trees (issue 50): the default model in several weight formats, at
batch 1 and 8, on a copy-heavy prompt (copy a 60-word paragraph) and on free text, with prompt-lookup drafting.

Every run must give plain decoding's tokens (greedy). Repeats are interleaved (plain, each tree, auto, then again)
and the median of each is reported, with its spread, the ratio to plain in the same round, and the mean accepted
drafts per verify step. Times are whole generate() calls (prefill included, as a user waits for them); each
format's first auto call measures the model's step cost by rows (stored, so not in the timed runs: a warm-up call
runs first).

    python bench/spec_auto.py [--model PATH] [--formats stored,q8_0,q4_0,none] [--batches 1,8] [--repeats 3]
        [--activations float,int8] [--copy-until-eos] [--out DIR]
Writes bench/results/cpu/spec-auto.json and .png.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

import bmc

PARAGRAPH = ("The committee met on Tuesday to review the annual budget. After a long discussion about rising costs, "
             "the members agreed to reduce travel spending by ten percent and to postpone the new building project "
             "until next spring. The chair thanked everyone for their patience and closed the meeting at six.")
TASKS = {
    "copy": [f"Copy the following paragraph exactly.\n\n{PARAGRAPH}\n\nCopy:\n"],
    "free": ["Write a short story about a dragon who learns to bake bread."],
}
FORMAT_NAMES = {"stored": "Q4_1", "q8_0": "Q8_0", "q4_0": "Q4_0", "none": "F32"}
OUT = Path(__file__).resolve().parent / "results" / "cpu"


def run(model, prompts: list[str], tree: str | None, n: int, eos: bool = False) -> tuple[float, list, float]:
    kw = dict(max_new_tokens=n, ignore_eos=not eos, chat=True)
    if tree is not None:
        kw.update(speculative="ngram", tree=tree)
    t0 = time.perf_counter()
    out = bmc.generate(model, prompts, **kw)
    seconds = time.perf_counter() - t0
    sp = out.stats.speculative
    per_step = sp.accepted / sp.verify_steps if sp is not None and sp.verify_steps else 0.0
    return seconds, [c.token_ids for c in out], per_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model path (default: the default model, SmolLM2-135M Q4_1)")
    ap.add_argument("--chat-template", default=None, help="a built-in chat template (for a file without one)")
    ap.add_argument("--formats", default="stored,q8_0,q4_0,none")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--trees", default="chain:2,chain:4,dynamic:4x6,auto")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--activations", default="float", help="float (exact) and/or int8 (VNNI, Q4/Q8 matrices): the "
                    "arithmetic of plain and speculative alike, e.g. float,int8")
    ap.add_argument("--copy-until-eos", action="store_true",
                    help="the copy task stops where the model ends its answer (EOS) instead of running --tokens past "
                    "it: the copy alone, without the free text a forced continuation adds after it")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    trees = args.trees.split(",")
    results = []
    for fmt, act in [(f, a) for f in args.formats.split(",") for a in args.activations.split(",")]:
        model = bmc.load(args.model, quant="auto" if fmt == "stored" else fmt, share_weights=True, activations=act)
        if args.chat_template:
            from bmc.chat_templates import chat_template

            model.tokenizer.chat_template = chat_template(args.chat_template)
        for batch in (int(b) for b in args.batches.split(",")):
            for task, base_prompts in TASKS.items():
                prompts = (base_prompts * batch)[:batch]
                eos = args.copy_until_eos and task == "copy"
                _, want, _ = run(model, prompts, None, args.tokens, eos)
                generated = sum(len(w) for w in want)
                run(model, prompts, "auto", 8)  # warm-up: the step-cost curve measured (once per model) here
                times: dict[str, list[float]] = {t: [] for t in ["plain", *trees]}
                accepted: dict[str, list[float]] = {t: [] for t in trees}
                for _ in range(args.repeats):
                    for t in times:
                        s, got, per_step = run(model, prompts, None if t == "plain" else t, args.tokens, eos)
                        assert got == want, (fmt, act, batch, task, t)  # exactness first
                        times[t].append(s)
                        if t != "plain":
                            accepted[t].append(per_step)
                plain = statistics.median(times["plain"])
                for t, v in times.items():
                    ratios = [p / x for p, x in zip(times["plain"], v)]  # same-round pairs
                    name = (f"{os.path.basename(args.model)} as stored" if args.model and fmt == "stored"
                            else FORMAT_NAMES.get(fmt, fmt))
                    row = {"format": name + ("" if act == "float" else f" {act}"),
                           "quant": fmt, "activations": act, "batch": batch, "task": task,
                           "tree": t, "median_s": statistics.median(v), "min_s": min(v), "max_s": max(v),
                           "vs_plain": plain / statistics.median(v), "vs_plain_pairs": ratios,
                           "generated_tokens": generated, "until_eos": eos,
                           "tokens_per_s": generated / statistics.median(v),
                           "accepted_per_verify_step": statistics.median(accepted[t]) if t in accepted else None}
                    results.append(row)
                    print(f"{row['format']:16s} B={batch} {task:4s} {t:12s} {row['median_s'] * 1000:8.1f} ms "
                          f"x{row['vs_plain']:.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
                          + (f"  accepted/step {row['accepted_per_verify_step']:.2f}" if t in accepted else ""),
                          flush=True)
        del model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model or "default (SmolLM2-135M-Instruct, Q4_1)", "host": platform.node(), "cpu": platform.processor() or platform.machine(), "threads": args.threads,
            "tokens": args.tokens, "repeats": args.repeats, "activations": args.activations, "drafter": "ngram",
            "copy_until_eos": args.copy_until_eos,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    (out / "spec-auto.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    plot(results, trees, out / "spec-auto.png")


def plot(results: list[dict], trees: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["format"], r["batch"], r["task"]) for r in results}, key=lambda g: (g[0], g[1], g[2]))
    fig, ax = plt.subplots(figsize=(max(8, len(groups) * 0.9), 4.5))
    width = 0.8 / len(trees)
    for j, t in enumerate(trees):
        vals = [next(r["vs_plain"] for r in results if (r["format"], r["batch"], r["task"]) == g and r["tree"] == t)
                for g in groups]
        ax.bar([i + j * width for i in range(len(groups))], vals, width, label=t)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], [f"{f}\nB={b} {t}" for f, b, t in groups],
                  fontsize=7)
    ax.set_ylabel("speed vs plain decoding (same round)")
    ax.set_title("Prompt-lookup speculation, default model (SmolLM2-135M), fixed trees and tree=auto")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
