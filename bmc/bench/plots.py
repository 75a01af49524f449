"""PNGs of a bmc-bench report: throughput per configuration and engine, per-token latency over the context
(the paper's Fig. 16) and the decode time split per KV strategy (its Table IV)."""
from __future__ import annotations

import sys
from typing import Any


def write_plots(report: dict[str, Any], prefix: str) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e .[bench]): no PNGs written", file=sys.stderr)
        return []
    results = report["results"]
    title = f"{report['model'].split('/')[-1]}, {report['dtype']}, {report['threads']} threads, {report['device']}"
    paths = []

    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(results)), 4))
    engines = report["engines"]
    width = 0.8 / len(engines)
    for j, e in enumerate(engines):
        xs = [i + j * width for i in range(len(results))]
        ax.bar(xs, [r["engines"][e]["decode_tokens_per_s"] for r in results], width, label=e)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(results))])
    ax.set_xticklabels([f"B={r['batch']}\n{r['prompt_len']}+{r['gen_len']}" for r in results])
    ax.set_ylabel("decode tokens/s (all rows)")
    ax.set_title(f"throughput: {title}", fontsize=9)
    ax.legend(fontsize=8)
    paths.append(_save(fig, prefix + "-throughput.png"))

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6), squeeze=False)
    for ax, r in zip(axes[0], results):
        for e, s in r["engines"].items():
            lat = s["step_latency_ms"]
            ax.plot([r["prompt_len"] + 1 + i for i in range(len(lat))], lat, label=e, linewidth=0.8)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("ms per decode step")
        ax.set_title(f"B={r['batch']}, {r['prompt_len']}+{r['gen_len']}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"per-token latency over the context:\n{title}", fontsize=9)  # one line overran a 1-panel figure
    paths.append(_save(fig, prefix + "-latency.png"))

    split_results = [r for r in results if r.get("decode_split")]
    if split_results:
        fig, axes = plt.subplots(1, len(split_results), figsize=(4.5 * len(split_results), 3.6), squeeze=False)
        for ax, r in zip(axes[0], split_results):
            names = list(r["decode_split"])
            bottom = [0.0] * len(names)
            for part, color in (("kv_update_s", "tab:red"), ("attention_s", "tab:blue"), ("other_s", "tab:gray")):
                vals = [r["decode_split"][n][part] for n in names]
                ax.bar(names, vals, bottom=bottom, label=part[:-2], color=color)
                bottom = [b + v for b, v in zip(bottom, vals)]
            ax.set_ylabel("decode seconds")
            ax.set_title(f"B={r['batch']}, {r['prompt_len']}+{r['gen_len']}", fontsize=9)
            ax.tick_params(axis="x", labelsize=7)
            ax.legend(fontsize=7)
        fig.suptitle(f"decode time split: {title}", fontsize=9)
        paths.append(_save(fig, prefix + "-split.png"))
    return paths


def _save(fig: Any, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def save_titled(fig: Any, title: str, path: str) -> None:
    """A bench figure's last steps: its suptitle (the setting: batch, lengths, dtype, threads, host), laid out and
    written at `path`."""
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def engine_bars(ax: Any, rows: dict[str, dict[str, dict[str, Any]]], kinds: list[str], key: str, title: str,
                labels: list[str] | None = None) -> None:
    """One group of bars per kind (a precision, a KV dtype) and one bar per engine in it: rows[kind][engine][key],
    labelled with its value; a perplexity axis starts near its lowest value so the differences show."""
    engines = sorted({e for k in kinds for e in rows[k]})
    width = 0.8 / len(engines)
    for i, e in enumerate(engines):
        vals = [rows[k].get(e, {}).get(key) or 0 for k in kinds]
        bars = ax.bar([j + i * width for j in range(len(kinds))], vals, width, label=e)
        # perplexities differ in the third decimal: upright, side by side, their labels ran into each other
        ax.bar_label(bars, fmt="%.3f" if key == "ppl" else "%.1f", fontsize=7, rotation=90 if key == "ppl" else 0,
                     padding=2)
    ax.set_xticks([j + width * (len(engines) - 1) / 2 for j in range(len(kinds))], labels or kinds)
    ax.set_title(title)
    ppls = [v for k in kinds for e in engines if (v := rows[k].get(e, {}).get("ppl"))]
    if key == "ppl" and ppls:  # from near the lowest (the differences show) to room for the upright labels
        ax.set_ylim(min(ppls) * 0.95, max(ppls) * 1.04)
