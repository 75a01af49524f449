"""Speculative decoding on the default model at batch 1, on tasks where drafting pays, plus the seed paper's
Table I (attention-block latency over T under speculative decoding) on this machine.

Part 1: per task, plain greedy decoding vs prompt-lookup speculative decoding with the tree verified in the BMC
cache's padding rows (trimmed to the chunk, or growing it) and on iterative / upfront caches, and vs a draft
model (the target's int8 copy) on the BMC cache; every run must give the plain run's tokens. Reports tokens/s,
ratios, mean accepted length, tree size, T and padding-row use. Short tasks (a ~100-token text or code) and long
ones (a ~3000-token document to extract from or continue): with a long context an iterative cache copies ~140 MB
per verify step, which is where the cache strategy matters under speculation.
Part 2: one layer with SmolLM2 shapes: each verify step writes k tree rows, attends with k queries (on the
runtime's attention kernel: the native CPU step's on a CPU in float32), keeps m.

    python bench/spec.py                      # writes bench/out/spec.json and bench/out/spec.png
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

import bmc
from bmc.analytic import Shape, best_T, default_profile_path, load_profile
from bmc.bench.layer import layer_attention
from bmc.kv import BMCCache, IterativeCache, r_from_T

OUT = Path(__file__).resolve().parent / "out"
PASSAGE = ("The quick brown fox jumps over the lazy dog while the cat sleeps on the warm windowsill and the rain "
           "falls softly on the garden outside. ")
CODE = '''def load_config(path):
    with open(path) as f:
        data = json.load(f)
    if "name" not in data:
        raise ValueError("config has no name")
    return data
'''
TASKS = {  # (prompt, chat): texts where the answer copies from the context
    "continue-repetition": (PASSAGE * 2 + PASSAGE[:60], False),
    "extract-paragraph": ("Copy the following paragraph exactly, word for word:\n\n" + PASSAGE * 2, True),
    "edit-code": ("Rename the function load_config to read_settings in this code and show the whole code:\n\n"
                  + CODE, True),
    "continue-code": (CODE + "\n\ndef save_config(path, data):\n", False),
}
DOC_TASKS = ("extract-from-document", "continue-document")  # long contexts: where the cache strategy matters


def document_tasks(tok, tokens: int) -> dict[str, tuple[str, bool]]:
    """A ~`tokens`-token document (Python's own docs, shipped with CPython as pydoc_data.topics: deterministic,
    no download), then (a) a request to copy one of its paragraphs, (b) the start of that paragraph to continue."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))[: 8 * tokens]  # ~4 characters per token: enough text
    ids = tok.encode(text, add_special_tokens=False)
    doc = tok.decode(ids[:tokens])
    paras = [p for p in doc.split("\n\n") if len(p) > 300 and len(p.split("\n")[0]) > 40]
    para = paras[len(paras) // 2]  # one from the middle of the document
    head = para.split("\n")[0]  # its first line
    return {
        "extract-from-document": (f"{doc}\n\nCopy the paragraph of the text above that begins with \"{head}\", "
                                  "word for word.", True),
        "continue-document": (f"{doc}\n\n{head}", False),
    }


CONFIGS = {  # name -> generate() kwargs
    "plain (bmc)": dict(kv="bmc"),
    "sd bmc (trim)": dict(kv="bmc", speculative="ngram"),
    "sd bmc (grow)": dict(kv="bmc", speculative="ngram", spec_grow=True),
    "sd iterative": dict(kv="iterative", speculative="ngram"),
    "sd upfront": dict(kv="upfront", speculative="ngram"),
    "sd bmc (int8-self)": dict(kv="bmc", speculative="int8-self"),  # a draft model: the target's int8 copy
}


CONFIG_KEYS = {"plain (bmc)": "plain", "sd bmc (trim)": "trim", "sd bmc (grow)": "grow", "sd iterative": "iterative",
               "sd upfront": "upfront", "sd bmc (int8-self)": "int8-self"}  # the names --configs takes


def end_to_end(model, gen_len: int, tree: str, doc_tokens: int, only: list[str] | None,
               configs: list[str] | None = None) -> list[dict]:
    rows = []
    tasks = {**TASKS, **document_tasks(model.tokenizer, doc_tokens)}
    for task, (prompt, chat) in tasks.items():
        if only and task not in only:
            continue
        bmc.generate(model, [prompt], max_new_tokens=8, chat=chat)  # warm-up
        ref = None
        row = {"task": task, "runs": {}}
        for name, kw in CONFIGS.items():
            if configs and CONFIG_KEYS[name] not in configs:
                continue
            extra = dict(tree=tree) if "speculative" in kw else {}
            out = bmc.generate(model, [prompt], max_new_tokens=gen_len, chat=chat, **kw, **extra)
            st = out.stats
            ref = ref if ref is not None else out[0].token_ids
            run = {"tokens_per_s": st.decode_tokens_per_s, "generated": len(out[0].token_ids),
                   "identical_to_plain": out[0].token_ids == ref, "T": st.T, "r": st.r,
                   "kv_allocations": st.kv_allocations}
            if st.speculative is not None:
                sp = st.speculative
                run.update(mean_accepted_length=sp.mean_accepted_length, padding_use=sp.padding_use,
                           tree_nodes_per_step=sp.drafted / max(sp.verify_steps, 1))
            run["prompt_tokens"] = st.prompt_tokens
            row["runs"][name] = run
            print(f"{task:22s} {name:15s} {run['tokens_per_s']:6.1f} tok/s  identical={run['identical_to_plain']}"
                  + (f"  m={run['mean_accepted_length']:.2f} tree={run['tree_nodes_per_step']:.1f}"
                     f" padding use={100 * run['padding_use']:.0f}%" if "padding_use" in run else ""), flush=True)
        r = row["runs"]
        row["sd_vs_plain"] = r["sd bmc (trim)"]["tokens_per_s"] / r["plain (bmc)"]["tokens_per_s"]
        row["bmc_sd_vs_iterative_sd"] = r["sd bmc (trim)"]["tokens_per_s"] / r["sd iterative"]["tokens_per_s"]
        rows.append(row)
    return rows


def sd_attention_block_seconds(n: int, batch: int, T: int, k: int, m: int) -> float:
    """One layer (SmolLM2 shapes) decoding n tokens by verify steps of k tree rows that keep m of them."""
    h, kvh, d = 9, 3, 64
    kw = dict(num_layers=1, batch_size=batch, num_kv_heads=kvh, head_dim=d, max_length=n + k)
    cache = IterativeCache(**kw) if T >= n else BMCCache(r=r_from_T(n, T), **kw)
    attend = layer_attention(cache, h, k)
    kv = torch.randn(batch, kvh, k, d)
    keep = [list(range(m))] * batch
    with torch.inference_mode():
        t0 = time.perf_counter()
        while cache.length < n:
            cache.reserve(k)
            cache.update(0, kv, kv)
            attend(k)
            cache.accept(keep, k)
        return time.perf_counter() - t0


def table_one(n: int, batch: int, k: int, m: int) -> dict:
    consts = load_profile(default_profile_path(torch.device("cpu"), torch.float32), torch.device("cpu"), torch.float32)
    shape = Shape(batch=batch, layers=1, heads=9, kv_heads=3, head_dim=64)
    pred = best_T(n, shape, consts, k=k, m=m) if consts else None
    points = []
    for T in [2**i for i in range(int(math.log2(n // m)) + 1)]:
        s = sd_attention_block_seconds(n, batch, T, k, m)
        points.append({"T": T, "attention_block_s": s})
        print(f"Table I: N={n} B={batch} k={k} m={m} T={T:5d}  {s:.3f} s", flush=True)
    best = min(points, key=lambda p: p["attention_block_s"])
    return {"N": n, "B": batch, "k": k, "m": m, "predicted_T": pred, "best_T": best["T"], "points": points}


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
    tasks = [r["task"] for r in report["tasks"]]
    names = [n for n in CONFIGS if all(n in r["runs"] for r in report["tasks"])]
    w = 0.8 / len(names)
    for j, name in enumerate(names):
        a1.bar([i + j * w for i in range(len(tasks))], [r["runs"][name]["tokens_per_s"] for r in report["tasks"]],
               w, label=name)
    a1.set_xticks([i + 0.4 - w / 2 for i in range(len(tasks))])
    a1.set_xticklabels(tasks, fontsize=7, rotation=20, ha="right")
    a1.set_ylabel("decode tokens/s (B=1)")
    a1.legend(fontsize=7)
    a1.set_title(f"speculative decoding, tree {report['tree']}, {report['gen_len']} tokens", fontsize=9)
    t1 = report["table_one"]
    if t1 is None:
        a2.set_axis_off()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return
    Ts = [p["T"] for p in t1["points"]]
    best = min(p["attention_block_s"] for p in t1["points"])
    a2.plot(Ts, [p["attention_block_s"] / best for p in t1["points"]], "o-")
    if t1["predicted_T"]:
        a2.axvline(t1["predicted_T"], color="red", linestyle="--", label=f"predicted T={t1['predicted_T']}")
    a2.set_xscale("log", base=2)
    a2.set_xlabel("T (allocations)")
    a2.set_ylabel("attention block latency / best")
    a2.set_title(f"Table I analog: N={t1['N']} B={t1['B']} k={t1['k']} m={t1['m']}, one layer", fontsize=9)
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--tree", default="dynamic:4x6")
    ap.add_argument("--doc-tokens", type=int, default=3000, help="document length of the long-context tasks")
    ap.add_argument("--tasks", default="", help=f"comma list (default: all of {', '.join([*TASKS, *DOC_TASKS])})")
    ap.add_argument("--configs", default="", help="comma list of plain,trim,grow,iterative,upfront,int8-self "
                    "(default: all; plain, trim and iterative are always run: the ratios need them)")
    ap.add_argument("--table-n", type=int, default=4096, help="N of the Table I analog; 0 skips it")
    ap.add_argument("--table-b", type=int, default=8)
    ap.add_argument("--k", type=int, default=26, help="tree nodes per verify step (the paper's 26)")
    ap.add_argument("--m", type=int, default=4, help="accepted tokens per verify step (the paper's 4)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = bmc.load(quant="none")
    report = {"model": model.path, "batch": 1, "dtype": "float32", "threads": args.threads, "device": "cpu",
              "gen_len": args.gen_len, "tree": args.tree, "doc_tokens": args.doc_tokens,
              "tasks": end_to_end(model, args.gen_len, args.tree, args.doc_tokens,
                                  [t for t in args.tasks.split(",") if t],
                                  [c for c in args.configs.split(",") if c] + ["plain", "trim", "iterative"]
                                  if args.configs else None)}
    report["table_one"] = table_one(args.table_n, args.table_b, args.k, args.m) if args.table_n else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "spec.png")
    print(f"{'task':22s} {'SD/plain':>9} {'BMC+SD/iter+SD':>15} {'m':>5}")
    for r in report["tasks"]:
        sd = r["runs"]["sd bmc (trim)"]
        print(f"{r['task']:22s} {r['sd_vs_plain']:9.2f} {r['bmc_sd_vs_iterative_sd']:15.2f} "
              f"{sd['mean_accepted_length']:5.2f}")
    t1 = report["table_one"]
    if t1 is not None:
        print(f"Table I analog: best T={t1['best_T']}, predicted T={t1['predicted_T']}")
    print(f"wrote {out / 'spec.json'} and {out / 'spec.png'}")


if __name__ == "__main__":
    main()
