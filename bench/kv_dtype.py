"""Long-context decode by KV-cache dtype, bmc against llama.cpp on the same GGUF file, in one run.

    python bench/kv_dtype.py --llama-bin DIR    # DIR: a llama.cpp build's bin/ (llama-batched-bench, llama-perplexity)

Where the KV dominates what a decode step reads: the default model as shipped (Q4_1, 98 MB of weights), batch 8,
each sequence a --ctx-token context (prompt ctx - gen, then --gen generated). At 8K the float32 KV of 8 rows is 3 GB
a step against 0.1 GB of weights.
- bmc: per kv_dtype (float32, bfloat16, int8), one random prompt prefilled once and forked to 8 rows that each keep
  their own copy (every row's attention streams its own KV, as 8 independent requests would); decode steps of the
  three caches interleaved in --rounds rounds, tok/s from the median step (this host's speed drifts by 20 %
  between minutes: steps taken minutes apart do not compare);
- llama.cpp: llama-batched-bench -npp (ctx - gen) -ntg gen -npl 8 -pps (the prompt prefilled once and copied
  to the 8 sequences' own KV streams, llama.cpp's default), flash attention on, -ctk/-ctv f32, bf16, q8_0 (llama.cpp's 8-bit KV: blocks of 32 with an fp16 scale; bmc's int8 has
  one float32 scale per row of head_dim);
- perplexity per KV dtype: bmc.perplexity and llama-perplexity, --chunks chunks of --ppl-ctx tokens of Python's
  own documentation (pydoc_data.topics), as bench/quant.py scores them;
- with --sparq C (a compression, e.g. 0.125): rows "<kv dtype>+sparq", bmc decoding with SparQ attention at
  C of dense attention's transfers (sparq_budget: r and k at this context), reading that KV dtype as stored
  (approximate attention: no perplexity row, no llama.cpp counterpart).
Writes JSON and a PNG under bench/results/cpu/."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from typing import Any

from bmc.bench.results import write_result

KV_DTYPES = {"float32": "f32", "bfloat16": "bf16", "int8": "q8_0"}  # bmc's name -> llama.cpp's closest cache type


def bmc_decode(model: Any, kv_dtypes: list[str], ids: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Decode steps of `batch` rows at the prompt's context, the KV dtypes' steps interleaved (this host's speed
    drifts by 20 % between minutes): each dtype's cache is prefilled once and forked to the rows (each row its own
    copy), then --rounds rounds step every cache twice. Median step time per dtype -> tok/s."""
    import statistics

    import torch

    from bmc.attention import SparQAttention, SparQOptions, causal_attention, dense_attention, sparq_budget
    from bmc.kv import KV_STRATEGIES

    cfg, P, B = model.config, len(ids), args.batch
    caches, prefill_s, times, attention = {}, {}, {k: [] for k in kv_dtypes}, {}
    with torch.inference_mode():
        for k in kv_dtypes:
            cache = KV_STRATEGIES["upfront"](num_layers=cfg.num_layers, batch_size=1, num_kv_heads=cfg.num_kv_heads,
                                             head_dim=cfg.head_dim, max_length=args.ctx, dtype=model.dtype,
                                             kv_dtype=k.removesuffix("+sparq"))
            t0 = time.perf_counter()
            cache.reserve(P)
            model.net(torch.tensor([ids]), torch.arange(P)[None], cache, causal_attention, cache.attention_bias(P))
            cache.commit(P)
            prefill_s[k] = time.perf_counter() - t0
            cache.reorder(torch.zeros(B, dtype=torch.long))
            caches[k] = cache
            attention[k] = dense_attention
            if k.endswith("+sparq"):  # its K mirror is made on the first decode step (a round the median drops)
                r, kk = sparq_budget(args.sparq, args.ctx, cfg.head_dim)
                attention[k] = SparQAttention(cache, SparQOptions(r=r, k=kk), cfg.group_size)
        pos, tok = P, torch.full((B, 1), 100)
        for _ in range(args.rounds):
            for k in kv_dtypes:
                cache = caches[k]
                for i in range(2):
                    t0 = time.perf_counter()
                    cache.reserve(1)
                    model.net(tok, torch.full((B, 1), pos + i), cache, attention[k], cache.attention_bias(1))
                    cache.commit(1)
                    times[k].append(time.perf_counter() - t0)
            pos += 2
    return {k: {"decode": B / statistics.median(times[k]), "step_ms": [round(t * 1e3, 2) for t in times[k]],
                "prefill_s": prefill_s[k], "kv_gb": caches[k].nbytes / 1e9} for k in kv_dtypes}


def bmc_ppl(model: Any, kv_dtype: str, text: str, args: argparse.Namespace) -> float | None:
    import bmc

    return bmc.perplexity(model, text, context=args.ppl_ctx, max_chunks=args.chunks, kv_dtype=kv_dtype).ppl \
        if args.chunks and kv_dtype in KV_DTYPES else None


def llama_row(path: str, cache_type: str, text_file: str, args: argparse.Namespace) -> dict[str, Any]:
    b, t = args.llama_bin, str(args.threads)
    prompt = args.ctx - args.gen
    kv = ["-fa", "on", "-ctk", cache_type, "-ctv", cache_type]
    # -c: every sequence's share (n_ctx / sequences: llama.cpp's default KV streams, one per sequence)
    out = subprocess.run([os.path.join(b, "llama-batched-bench"), "-m", path, "-c",
                          str(args.batch * (args.ctx + 64)), "-npp", str(prompt), "-ntg", str(args.gen),
                          "-npl", str(args.batch), "-pps", "-t", t, "-tb", t, *kv], capture_output=True, text=True,
                         check=True).stdout
    # the table's last row: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    cells = [c.strip() for c in [ln for ln in out.splitlines() if ln.startswith("|")][-1].strip("|").split("|")]
    row: dict[str, Any] = {"decode": float(cells[7]), "prefill_s": float(cells[4]), "ppl": None}
    if not args.chunks:
        return row
    out = subprocess.run([os.path.join(b, "llama-perplexity"), "-m", path, "-f", text_file, "-c", str(args.ppl_ctx),
                          "--chunks", str(args.chunks), "-t", t, "-b", str(4 * args.ppl_ctx), *kv],
                         capture_output=True, text=True, check=True)
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    row["ppl"] = float(m.group(1)) if m else None
    return row


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bmc.bench.plots import engine_bars, save_titled

    kinds = list(result["rows"])
    fig, axes = plt.subplots(1, 2, figsize=(11 + 1.5 * sum(k not in KV_DTYPES for k in kinds), 4.5))
    labels = [f"{k}\n(llama.cpp {KV_DTYPES[k]})" if k in KV_DTYPES else
              f"{k.removesuffix('+sparq')}\n+ SparQ {result['config']['sparq']:g}" for k in kinds]
    for ax, key, title in ((axes[0], "decode", "decode tok/s (8 rows, higher is better)"),
                           (axes[1], "ppl", "perplexity (lower is better)")):
        engine_bars(ax, result["rows"], kinds, key, title, labels)
    axes[0].legend()
    c = result["config"]
    save_titled(fig, f"KV dtype at {c['ctx']} context, batch {c['batch']}, {c['gen']} generated; {c['model']}; "
                 f"{c['threads']} threads, {c['host']}", path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-bin", help="a llama.cpp build's bin/ directory (llama-batched-bench, llama-perplexity)")
    p.add_argument("--ctx", type=int, default=8192, help="context per sequence at the end of the run")
    p.add_argument("--gen", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=8, help="interleaved rounds of 2 decode steps per KV dtype")
    p.add_argument("--ppl-ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=8, help="perplexity chunks (0: no perplexity)")
    p.add_argument("--model", help="the model (default: the embedded SmolLM2-135M-Instruct Q4_1 GGUF)")
    p.add_argument("--kv-dtypes", default=",".join(KV_DTYPES))
    p.add_argument("--sparq", type=float, default=0.0, help="also decode float32 and int8 KV with SparQ at this "
                   "compression of dense transfers (e.g. 0.125; 0: off)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import torch

    import bmc
    from bmc.analytic.profile import device_name
    from bmc.models import default_model_path

    torch.set_num_threads(args.threads)
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    text_file = os.path.join(os.path.expanduser("~/.cache/bmc/bench"), "heldout.txt")
    os.makedirs(os.path.dirname(text_file), exist_ok=True)
    with open(text_file, "w", encoding="utf-8") as f:
        f.write(text)
    path = args.model or default_model_path()
    model = bmc.load(path)
    if args.ctx > model.max_context:
        sys.exit(f"--ctx {args.ctx} is past the model's context ({model.max_context})")
    ids = torch.randint(100, model.config.vocab_size - 100, (args.ctx - args.gen,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    host = f"{device_name(torch.device('cpu'))}, {os.cpu_count()} cpus"
    result: dict[str, Any] = {"config": dict(vars(args), host=host, model=os.path.basename(path),
                                             activations=model.activations, text="pydoc_data.topics"), "rows": {}}
    kinds = args.kv_dtypes.split(",")
    if args.sparq:
        kinds += [f"{k}+sparq" for k in ("float32", "int8") if k in kinds]
    if args.ctx - args.gen + 2 * args.rounds > args.ctx:
        sys.exit("--gen must cover the 2 * --rounds decode steps")
    decode = bmc_decode(model, kinds, ids, args)
    for kv_dtype in kinds:
        rows = result["rows"][kv_dtype] = {}
        t0 = time.time()
        rows["bmc"] = dict(decode[kv_dtype], ppl=bmc_ppl(model, kv_dtype, text, args))
        if args.llama_bin and kv_dtype in KV_DTYPES:
            rows["llama.cpp"] = llama_row(path, KV_DTYPES[kv_dtype], text_file, args)
        print(f"{kv_dtype:>9}: " + "  ".join(f"{e} decode {r['decode']:.1f} tok/s ppl {r['ppl'] or 0:.4f}"
                                              for e, r in rows.items()) + f"  ({time.time() - t0:.0f} s)", flush=True)
    base = result["rows"].get("float32", {})
    for kv_dtype, rows in result["rows"].items():
        for e, r in rows.items():
            if e in base:
                r["vs_float32"] = r["decode"] / base[e]["decode"]
        if "llama.cpp" in rows:
            rows["bmc"]["vs_llama_cpp"] = rows["bmc"]["decode"] / rows["llama.cpp"]["decode"]
    for kv_dtype, rows in result["rows"].items():
        print(f"{kv_dtype:>9}: " + "  ".join(f"{e} {r.get('vs_float32', 0):.2f}x its float32" for e, r in rows.items())
              + (f"  bmc/llama.cpp {rows['bmc']['vs_llama_cpp']:.2f}x" if "llama.cpp" in rows else ""))
    write_result(result, args.out, __file__, "kv-dtype", plot)


if __name__ == "__main__":
    main()
