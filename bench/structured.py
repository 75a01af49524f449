"""JSON-schema decoding against unconstrained decoding on the default model: decode tok/s at a batch of 8 prompts
(the engine's step loop, as 8 concurrent requests of bmc-serve run), and the mask time per constrained token.

The schema asks for an array of at least 100 objects, so no row completes inside --max-new-tokens: both runs
decode every row for every step and the ratio is the masks' cost alone (an unconstrained run ignores EOS for the
same reason). Interleaved repeats in one process; median, min and max of each; one PNG and one JSON.

    python bench/structured.py --out bench/results/cpu/structured
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

import torch

SCHEMA = {"type": "array", "minItems": 100, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "tags"], "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000}, "name": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "enum": ["new", "sale", "gift"]}}}}}
PROMPTS = ["List products as JSON.", "Give me inventory records in JSON.", "Produce a JSON array of items.",
           "Write catalogue entries as JSON.", "Export the stock list as JSON.", "JSON list of goods, please.",
           "Return store items in JSON.", "Make a JSON array of products with tags."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/out/structured")
    args = ap.parse_args()
    import bmc

    model = bmc.load()
    prompts = (PROMPTS * (args.batch // len(PROMPTS) + 1))[: args.batch]
    kw = dict(max_new_tokens=args.max_new_tokens, chat=True, ignore_eos=True)
    bmc.generate(model, prompts, max_new_tokens=4, chat=True)  # warm-up (kernels, weights' layout)
    bmc.generate(model, prompts, max_new_tokens=4, chat=True, json_schema=SCHEMA)  # and the llguidance tokenizer
    runs: dict[str, list[dict]] = {"unconstrained": [], "json_schema": []}
    for _ in range(args.repeats):
        for name in runs:  # interleaved
            out = bmc.generate(model, prompts, **kw, **({"json_schema": SCHEMA} if name == "json_schema" else {}))
            st = out.stats
            assert all(len(c.token_ids) == args.max_new_tokens for c in out), "a row finished early"
            runs[name].append({"decode_tokens_per_s": st.decode_tokens_per_s, "decode_steps": st.decode_steps,
                               "mask_us_per_token": 1e6 * st.grammar_mask_seconds / max(st.grammar_masks, 1),
                               "mask_ms_per_step": 1e3 * st.grammar_mask_seconds / max(st.decode_steps, 1)})
            if name == "json_schema":
                json_prefix = out[0].text
    summary = {}
    for name, rs in runs.items():
        tps = [r["decode_tokens_per_s"] for r in rs]
        summary[name] = {"tok_s_median": statistics.median(tps), "tok_s_min": min(tps), "tok_s_max": max(tps),
                         "mask_us_per_token_median": statistics.median(r["mask_us_per_token"] for r in rs),
                         "mask_ms_per_step_median": statistics.median(r["mask_ms_per_step"] for r in rs)}
    ratio = summary["json_schema"]["tok_s_median"] / summary["unconstrained"]["tok_s_median"]
    ratios = [c["decode_tokens_per_s"] / u["decode_tokens_per_s"] for c, u in zip(runs["json_schema"],
                                                                                 runs["unconstrained"])]
    report = {"host": platform.node(), "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
              "threads": torch.get_num_threads(), "model": str(model.path), "dtype": str(model.dtype),
              "batch": args.batch, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
              "schema": SCHEMA, "runs": runs, "summary": summary, "ratio_median": ratio,
              "ratio_per_pair": ratios, "json_sample": json_prefix[:300]}
    print(f"batch {args.batch}, {args.max_new_tokens} tokens, {torch.get_num_threads()} threads, {report['cpu']}")
    for name, s in summary.items():
        print(f"  {name:14s} {s['tok_s_median']:7.1f} tok/s ({s['tok_s_min']:.1f}-{s['tok_s_max']:.1f})"
              + (f"  masks {s['mask_us_per_token_median']:.0f} us/token, {s['mask_ms_per_step_median']:.2f} ms/step"
                 if name == "json_schema" else ""))
    print(f"  json_schema / unconstrained: {ratio:.3f} (pairs {', '.join(f'{r:.3f}' for r in ratios)})")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "structured.json").write_text(json.dumps(report, indent=1))
    plot(report, out_dir / "structured.png")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["summary"]
    names = list(s)
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    med = [s[n]["tok_s_median"] for n in names]
    err = [[m - s[n]["tok_s_min"] for n, m in zip(names, med)], [s[n]["tok_s_max"] - m for n, m in zip(names, med)]]
    ax.bar(names, med, yerr=err, capsize=4, color=["tab:gray", "tab:blue"])
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"batch {report['batch']}, {report['max_new_tokens']} tokens: json_schema / unconstrained "
                 f"{report['ratio_median']:.2f}x\nmasks {s['json_schema']['mask_us_per_token_median']:.0f} us a token "
                 f"({report['cores']} cores)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
