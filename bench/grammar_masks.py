"""Token masks for constrained decoding: llguidance against xgrammar on this CPU, on the default model's tokenizer.

For each JSON schema: the grammar's compile time, then a valid document of that schema is walked token by token
(as a model would emit it) and each step's mask is computed and the token consumed; the median and p99 microseconds
per mask are reported. One process, the libraries interleaved per schema, `--repeats` walks each.

    python bench/grammar_masks.py --out bench/results/cpu/grammar      # xgrammar needs `pip install xgrammar`

The choice it informs is recorded in docs/performance.md ("Constrained decoding: which library").
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

SCHEMAS = {
    "person": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                 "email": {"type": "string"}},
                "required": ["name", "age", "email"]},
               {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"}),
    "nested": ({"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["new", "sale", "gift"]}}},
            "required": ["sku", "qty", "tags"]}},
        "total": {"type": "number"}}, "required": ["items", "total"]},
               {"items": [{"sku": "A-1", "qty": 2, "tags": ["new"]},
                          {"sku": "B-22", "qty": 1, "tags": ["sale", "gift"]}],
                "total": 31.5}),
    "any-json": ({"type": "object"}, {"ok": True, "values": [1, 2, 3], "note": "free-form object"}),
}


def walk_llguidance(tok_json: str, vocab: int, eos: list[int], schema: dict,
                    tokens: list[int]) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.torch as llt

    t0 = time.perf_counter()
    tokenizer = llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    compile_s = time.perf_counter() - t0
    assert not matcher.is_error(), matcher.get_error()
    mask = llt.allocate_token_bitmask(1, vocab)
    times = []
    for t in tokens:
        t1 = time.perf_counter()
        llt.fill_next_token_bitmask(matcher, mask, 0)
        times.append(time.perf_counter() - t1)
        assert (int(mask[0, t // 32]) >> (t % 32)) & 1, "the valid document's token is masked out"
        assert matcher.consume_token(t), matcher.get_error()
    return compile_s, times


def walk_xgrammar(hf_tok, vocab: int, schema: dict, tokens: list[int]) -> tuple[float, list[float]]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema))
    matcher = xgr.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for t in tokens:
        t1 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        times.append(time.perf_counter() - t1)
        assert (int(mask[0, t // 32]) >> (t % 32)) & 1, "the valid document's token is masked out"
        assert matcher.accept_token(t)
    return compile_s, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench/out/grammar")
    args = ap.parse_args()
    import transformers

    import bmc

    model = bmc.load()
    backend = model.tokenizer.backend
    tok_json = backend.to_str()
    vocab = model.config.vocab_size
    eos = list(model.tokenizer.eos_token_ids)
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
    try:
        import xgrammar  # noqa: F401
        libs = ["llguidance", "xgrammar"]
    except ImportError:
        libs = ["llguidance"]
    results: dict[str, dict] = {}
    for name, (schema, doc) in SCHEMAS.items():
        text = json.dumps(doc, separators=(",", ":"))
        tokens = model.tokenizer.encode(text, add_special_tokens=False)
        per: dict[str, dict] = {lib: {"compile_ms": [], "mask_us": []} for lib in libs}
        for _ in range(args.repeats):
            for lib in libs:  # interleaved
                c, ts = (walk_llguidance(tok_json, vocab, eos, schema, tokens) if lib == "llguidance"
                         else walk_xgrammar(hf_tok, vocab, schema, tokens))
                per[lib]["compile_ms"].append(c * 1e3)
                per[lib]["mask_us"].extend(t * 1e6 for t in ts)
        results[name] = {"tokens": len(tokens), **{lib: {
            "compile_ms_median": statistics.median(v["compile_ms"]),
            "mask_us_median": statistics.median(v["mask_us"]),
            "mask_us_p99": sorted(v["mask_us"])[int(0.99 * (len(v["mask_us"]) - 1))]} for lib, v in per.items()}}
        line = "  ".join(f"{lib}: compile {results[name][lib]['compile_ms_median']:.1f} ms, mask median "
                         f"{results[name][lib]['mask_us_median']:.1f} us p99 {results[name][lib]['mask_us_p99']:.1f}"
                         for lib in libs)
        print(f"{name:9s} ({len(tokens)} tokens)  {line}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"host": platform.node(), "cpu": platform.processor() or platform.machine(), "threads":
              torch.get_num_threads(), "cores": os.cpu_count(), "vocab": vocab, "repeats": args.repeats,
              "versions": {lib: __import__(lib).__version__ if hasattr(__import__(lib), "__version__") else "?"
                           for lib in libs}, "schemas": results}
    (out / "grammar_masks.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "grammar_masks.png")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["schemas"])
    libs = [k for k in report["schemas"][names[0]] if k != "tokens"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    w = 0.8 / len(libs)
    for j, lib in enumerate(libs):
        ax.bar([i + j * w for i in range(len(names))], [report["schemas"][n][lib]["mask_us_median"] for n in names],
               w, label=lib)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(names))], names)
    ax.set_ylabel("median mask time per token (us)")
    ax.set_title(f"token masks, vocab {report['vocab']}, {report['cores']} cores")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
