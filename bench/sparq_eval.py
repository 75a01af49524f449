"""SparQ attention vs dense and vs a local window at the same transfer budget, on the default model, on tasks that
need the long context (the SparQ paper's Table 2/3 analog):

- needle: a passphrase sentence hidden at a depth of a long haystack (Python's own documentation text, shipped
  with every CPython as pydoc_data.topics), then the question; correct if the code appears in the answer;
- repetition: a long passage, then the start of one of its sentences; the model must continue it verbatim;
  scored as the share of examples whose next 16 tokens match, and the mean matched prefix length;
- perplexity: teacher-forced negative log-likelihood of held-out text after a long context, token by token
  through the decode path (where SparQ acts).

Each example is prefilled once (dense: SparQ approximates decode steps only) and every method decodes from a copy
of that cache. Compression = the method's KV transfers per decode step over dense's (Eq. 11 / appendix G).

    python bench/sparq_eval.py                 # writes bench/out/sparq_eval.json and .png
    python bench/sparq_eval.py --quick         # a couple of examples per task (smoke)
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import time
from pathlib import Path

import torch

import bmc
from bmc.attention import ATTENTION_BACKENDS, AttentionOptions, SparQOptions, dense_attention, sparq_budget, window_budget
from bmc.engine import GenerationConfig, GenerationStats, make_cache

OUT = Path(__file__).resolve().parent / "out"
COMPRESSIONS = (0.5, 0.25, 0.125)


def corpus(tok) -> list[int]:
    from pydoc_data.topics import topics  # English prose shipped with CPython: deterministic, no download

    return tok.encode("\n\n".join(topics[k] for k in sorted(topics)), add_special_tokens=False)


def methods(S: int, d: int) -> list[tuple[str, float, str, AttentionOptions]]:
    out = [("dense", 1.0, "dense", AttentionOptions())]
    for c in COMPRESSIONS:
        r, k = sparq_budget(c, S, d)
        out.append((f"sparq r={r} k={k}", c, "sparq", AttentionOptions(sparq=SparQOptions(r=r, k=k))))
        out.append((f"window k={window_budget(c, S, d)}", c, "window", AttentionOptions(window_k=window_budget(c, S, d))))
    return out


@torch.inference_mode()
def prefill(model, ids: list[int], extra: int):
    gen = GenerationConfig(max_new_tokens=extra)
    cache = make_cache(model, gen, 1, len(ids) + extra, [0], GenerationStats())
    P = len(ids)
    cache.reserve(P)
    dev = model.device
    logits = model.net(torch.tensor([ids], device=dev), torch.arange(P, device=dev)[None], cache, dense_attention,
                       cache.attention_bias(P))
    cache.commit(P)
    return cache, logits[0, -1]


@torch.inference_mode()
def decode(model, cache, attn_name: str, opts: AttentionOptions, first: torch.Tensor, steps: int,
           forced: list[int] | None = None) -> tuple[list[int], list[float], int, int]:
    """Greedy (or teacher-forced on `forced`) decode from a prefilled cache. Returns the tokens, the log-prob of
    each next token (forced ones when forcing), and the attention transfers (method, dense)."""
    attn = ATTENTION_BACKENDS[attn_name](cache, opts, model.config.group_size)
    logp = first.log_softmax(-1)
    tok = int(forced[0]) if forced else int(logp.argmax())
    toks, lps = [tok], [float(logp[tok])]
    pos = cache.length
    for i in range(1, steps):
        cache.reserve(1)
        logits = model.net(torch.tensor([[tok]], device=cache.device), torch.tensor([[pos]], device=cache.device), cache,
                           attn, cache.bias)
        cache.commit(1)
        pos += 1
        logp = logits[0, -1].log_softmax(-1)
        tok = int(forced[i]) if forced else int(logp.argmax())
        toks.append(tok)
        lps.append(float(logp[tok]))
    return toks, lps, getattr(attn, "transfers", 0), getattr(attn, "dense_transfers", 0)


def chat_ids(model, text: str) -> list[int]:
    tok = model.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))


def needle_examples(model, ids: list[int], n: int, ctx: int, rng: random.Random) -> list[dict]:
    tok = model.tokenizer
    out = []
    for i in range(n):
        depth = (i % 5) / 5 + 0.1  # 0.1 .. 0.9
        start = rng.randrange(0, len(ids) - ctx)
        body = tok.decode(ids[start : start + ctx])
        cut = body.rfind("\n", 0, int(len(body) * depth)) + 1 or int(len(body) * depth)
        code = str(rng.randrange(10000, 99999))
        text = (body[:cut] + f"\nThe secret code for the blue door is {code}.\n" + body[cut:]
                + "\n\nWhat is the secret code for the blue door?")
        out.append({"prompt": chat_ids(model, text), "answer": code, "depth": depth})
    return out


def repetition_examples(model, ids: list[int], n: int, ctx: int, rng: random.Random, cue: int = 16,
                        check: int = 16) -> list[dict]:
    """The cue is the first `cue` tokens of a sentence of the passage (after a full stop), not the very end."""
    tok = model.tokenizer
    sep = tok.encode("\n\n", add_special_tokens=False)
    out = []
    for _ in range(n):
        start = rng.randrange(0, len(ids) - ctx)
        passage = ids[start : start + ctx]
        starts = [j for j in range(ctx // 10, ctx - cue - check) if tok.decode(passage[j - 1 : j]).endswith(".")]
        at = rng.choice(starts) if starts else ctx // 2
        out.append({"prompt": passage + sep + passage[at : at + cue], "target": passage[at + cue : at + cue + check]})
    return out


def run(model, args) -> dict:
    rng = random.Random(0)
    ids = corpus(model.tokenizer)
    d = model.config.head_dim
    tasks = {
        "needle": needle_examples(model, ids, args.examples, args.context, rng),
        "repetition": repetition_examples(model, ids, args.examples, args.context, rng),
    }
    tasks = {t: ex for t, ex in tasks.items() if t in args.tasks}  # examples are the same whichever tasks run
    results: dict[str, dict] = {}
    t0 = time.perf_counter()

    def add(task: str, name: str, comp: float, kind: str, score: dict, transfers: tuple[int, int]) -> None:
        # one row per method and budget; the (r, k) that meet the budget vary a little with each example's length
        key = kind if kind == "dense" else f"{kind} 1/{round(1 / comp)}"
        row = results.setdefault(task, {}).setdefault(key, {"method": kind, "target_compression": comp,
                                                            "settings": [], "scores": [], "transfers": [0, 0]})
        if name not in row["settings"]:
            row["settings"].append(name)
        row["scores"].append(score)
        row["transfers"][0] += transfers[0]
        row["transfers"][1] += transfers[1]

    for task, examples in tasks.items():
        for i, ex in enumerate(examples):
            steps = 16 if task == "needle" else len(ex["target"])
            cache, first = prefill(model, ex["prompt"], steps)
            for name, comp, kind, opts in methods(len(ex["prompt"]), d):
                toks, _, tr, dtr = decode(model, copy.deepcopy(cache), kind, opts, first, steps)
                if task == "needle":
                    score = {"correct": ex["answer"] in model.tokenizer.decode(toks)}
                else:
                    match = next((j for j, (a, b) in enumerate(zip(toks, ex["target"])) if a != b), len(toks))
                    score = {"correct": match == len(ex["target"]), "matched": match}
                add(task, name, comp, kind, score, (tr, dtr))
            print(f"[{time.perf_counter() - t0:6.0f}s] {task} {i + 1}/{len(examples)} ({len(ex['prompt'])} tokens)",
                  flush=True)

    # perplexity: context then held-out tokens, teacher-forced through decode
    for i in range(args.ppl_texts if "perplexity" in args.tasks else 0):
        start = rng.randrange(0, len(ids) - args.context - args.ppl_tokens)
        ctx, held = ids[start : start + args.context], ids[start + args.context : start + args.context + args.ppl_tokens]
        cache, first = prefill(model, ctx, len(held))
        for name, comp, kind, opts in methods(len(ctx), d):
            _, lps, tr, dtr = decode(model, copy.deepcopy(cache), kind, opts, first, len(held), forced=held)
            add("perplexity", name, comp, kind, {"nll": -sum(lps) / len(lps)}, (tr, dtr))
        print(f"[{time.perf_counter() - t0:6.0f}s] perplexity {i + 1}/{args.ppl_texts}", flush=True)

    for task, rows in results.items():
        for row in rows.values():
            sc = row.pop("scores")
            tr, dtr = row.pop("transfers")
            row["compression"] = tr / dtr if dtr else 1.0
            row["n"] = len(sc)
            if task == "perplexity":
                row["perplexity"] = math.exp(sum(s["nll"] for s in sc) / len(sc))
            else:
                row["accuracy"] = 100 * sum(s["correct"] for s in sc) / len(sc)
                if task == "repetition":
                    row["mean_matched_tokens"] = sum(s["matched"] for s in sc) / len(sc)
    return results


def table(results: dict) -> str:
    lines = ["| task | method | settings | measured compression | n | score |", "|---|---|---|---|---|---|"]
    for task, rows in results.items():
        for name, row in rows.items():
            score = (f"ppl {row['perplexity']:.3f}" if task == "perplexity" else f"{row['accuracy']:.0f} %"
                     + (f" (mean {row['mean_matched_tokens']:.1f} tokens)" if task == "repetition" else ""))
            lines.append(f"| {task} | {name} | {', '.join(row['settings'])} | {row['compression']:.3f} | {row['n']} "
                         f"| {score} |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, (task, rows) in zip(axes[0], results.items()):
        key = "perplexity" if task == "perplexity" else "accuracy"
        dense = rows["dense"][key]
        for kind, style in (("sparq", "o-"), ("window", "s--")):
            pts = sorted((r["compression"], r[key]) for r in rows.values() if r["method"] == kind)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=kind)
        ax.axhline(dense, color="k", lw=1, label="dense")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("attention transfers / dense")
        ax.set_ylabel(key + (" (lower is better)" if key == "perplexity" else " %"))
        ax.set_title(task)
        ax.legend()
    fig.suptitle("SparQ vs local window at equal transfers (SmolLM2-135M, fp32, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    ap.add_argument("--context", type=int, default=2000, help="context tokens per example")
    ap.add_argument("--examples", type=int, default=12, help="examples per task")
    ap.add_argument("--ppl-texts", type=int, default=3)
    ap.add_argument("--ppl-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tasks", default="needle,repetition,perplexity", help="comma list of the tasks to run")
    ap.add_argument("--device", default="cpu", help="accuracy does not depend on it; a GPU affords more examples")
    ap.add_argument("--quick", action="store_true", help="2 examples per task, short contexts")
    ap.add_argument("--out", default=str(OUT / "sparq_eval.json"))
    args = ap.parse_args()
    if args.quick:
        args.examples, args.context, args.ppl_texts, args.ppl_tokens = 2, 600, 1, 32
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    model = bmc.load(args.model, device=args.device, quant="none")
    args.tasks = [t for t in args.tasks.split(",") if t]
    results = run(model, args)
    meta = {"model": str(model.path), "dtype": str(model.dtype), "device": str(model.device),
            "threads": torch.get_num_threads(), "batch": 1, "context_tokens": args.context,
            "examples_per_task": args.examples, "perplexity_texts": args.ppl_texts, "ppl_tokens": args.ppl_tokens,
            "compressions": COMPRESSIONS, "tasks": args.tasks, "torch": torch.__version__}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    plot(results, out.with_suffix(".png"))
    print(table(results))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
