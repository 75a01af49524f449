"""bmc on a GPU vs HF transformers (DynamicCache, StaticCache) on a Llama-2-7B-shaped or OPT-6.7B-shaped model
with random weights (speed does not depend on the values): the paper's Table IX setting, run through the device
tool on an H100. HF runs first, then its weights are handed to bmc (bmc keeps its own transposed copies).

    python bench/gpu.py --model llama-7b --batch 32 --total 1024 --prompt 128 --out /tmp/out   # one setting
    python bench/gpu.py --model llama-7b --plot --out /tmp/out      # merge the settings' JSONs into one PNG
    python bench/gpu.py --quant none,q8_0,q4_0 --batch 1 --out /tmp/out  # weight-only int8 / int4 against bf16

Engines: HF generate with DynamicCache and with StaticCache (which transformers compiles with torch.compile on its
own when the cache is static), bmc (auto T; decode step captured as a CUDA graph per capacity bucket), bmc-eager
(the same without graphs), bmc-no-ahead (graphs, each step's tokens read before the next step is launched:
the scheduler's run_ahead off), bmc-iterative, bmc-upfront (one graph for the whole run). Each bmc engine runs warm: a
cold run first (it captures the graphs its buckets need; reported as first_run_tokens_per_s with its captures), then
--repeats runs, of which the median is reported; the model's arena and graphs are let go between engines.

--quant: the bmc engine alone on the same HF weights loaded with each quant in turn (quant="q8_0" / "q4_0":
quantized at load, GGUF's blocks of 32), one process, none first: decode tok/s, the weights' bytes on the GPU and
the GB/s they stream at (weight bytes x decode steps/s), and each quant's ratio to the first.
"""
from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch

from bmc.bench.engines import EngineRun, run_bmc, run_hf
from bmc.bench.harness import first_divergence
from bmc.graphs import graph_store, replay_median_ms
from bmc.models import gdc, model_from_tensors

SHAPES = {
    "llama-7b": ("llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                               num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)),
    "opt-6.7b": ("opt", dict(hidden_size=4096, ffn_dim=16384, num_hidden_layers=32, num_attention_heads=32,
                             vocab_size=50272, max_position_embeddings=2048)),
}


def build_hf(name: str, dtype: torch.dtype):
    import transformers
    family, kw = SHAPES[name]
    cfg = (transformers.LlamaConfig if family == "llama" else transformers.OPTConfig)(**kw)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = (transformers.LlamaForCausalLM if family == "llama" else transformers.OPTForCausalLM)(cfg)
    return model.to(dtype).eval(), cfg


def quarter_medians(steps_ms: list[float]) -> list[float]:
    """Median step time in each quarter of the decode: where in the run (which bucket) two engines differ."""
    q = max(1, len(steps_ms) // 4)
    return [sorted(part)[len(part) // 2] for part in (steps_ms[i:i + q] for i in range(0, q * 4, q)) if part]


def warm_runs(model, prompts: list[list[int]], gen: int, kv: str, repeats: int, **kw) -> tuple[EngineRun, dict]:
    """The engine `repeats` + 1 times in a row: the first (cold: it captures the graphs its buckets need) is
    reported apart, the rest give the median run. The model's arena and graphs are let go at the end, as if the
    next engine ran in a process of its own."""
    torch.cuda.reset_peak_memory_stats()
    runs = [run_bmc(model, prompts, gen, kv=kv, **kw) for _ in range(repeats + 1)]
    peak = torch.cuda.max_memory_allocated() / 2**20
    B = len(prompts)
    tps = [r.summary(B)["decode_tokens_per_s"] for r in runs]
    warm = sorted(range(1, len(runs)), key=lambda i: tps[i]) or [0]  # --repeats 0: the cold run only
    median = runs[warm[len(warm) // 2]]
    extra = {"first_run_tokens_per_s": tps[0], "warm_tokens_per_s": [tps[i] for i in range(1, len(runs))],
             "first_over_warm": tps[0] / tps[warm[len(warm) // 2]],
             "captures_per_run": [r.extra.get("cuda_graph_captures", 0) for r in runs],
             "capture_s_per_run": [r.extra.get("cuda_graph_capture_s", 0.0) for r in runs],
             "peak_cuda_mb": peak,
             "cold_slowest_steps_ms": sorted(runs[0].summary(B)["step_latency_ms"], reverse=True)[:5],
             "warm_step_ms_by_quarter": quarter_medians(median.summary(B)["step_latency_ms"])}
    store = graph_store(model)
    store.arena.free()
    gc.collect()
    torch.cuda.empty_cache()
    return median, extra


def run_config(args, B: int, N: int) -> dict:
    """One (batch, N) setting in this process: HF first, then its weights handed to bmc (HF freed first)."""
    dtype = getattr(torch, args.dtype)
    gen = N - args.prompt
    hf, cfg = build_hf(args.model, dtype)
    prompts = [[(13 * b + 7 * i) % (cfg.vocab_size - 10) + 5 for i in range(args.prompt)] for b in range(B)]
    runs = []
    if not args.no_hf:
        run_hf(hf, prompts, 4, "dynamic")  # warm-up
        runs = [run_hf(hf, prompts, gen, "dynamic"), run_hf(hf, prompts, gen, "static")]
    first_bmc = len(runs)
    state = {k: v for k, v in hf.state_dict().items()}
    model = model_from_tensors(cfg.to_dict(), state, origin=args.model, dtype=dtype, device="cuda")
    del hf, state
    gc.collect()
    torch.cuda.empty_cache()
    graphed = {"graph_warmup": True} if args.graph_warmup else {}
    engines = [("bmc", "bmc", graphed), ("bmc-no-ahead", "bmc", {**graphed, "run_ahead": False}),
               ("bmc-eager", "bmc", {"cuda_graphs": False}), ("bmc-upfront", "upfront", graphed)]
    if not args.no_iterative:
        engines.append(("bmc-iterative", "iterative", {}))
    if args.engines:
        engines = [e for e in engines if e[0] == "bmc" or e[0] in args.engines.split(",")]
    warm, failed = {}, {}
    for name, kv, kw in engines:
        try:
            r, warm[name] = warm_runs(model, prompts, gen, kv, args.repeats, **kw)
        except torch.cuda.OutOfMemoryError as e:  # e.g. upfront's B x N cache beside 7B of weights
            failed[name] = {"engine": name, "error": f"CUDA out of memory: {str(e).splitlines()[0]}"}
        if name in failed:  # freed here, not in the handler: its traceback still holds the run's cache
            graph_store(model).arena.free()
            gc.collect()
            torch.cuda.empty_cache()
            continue
        r.engine = name
        runs.append(r)
    res = {r.engine: r.summary(B) for r in runs}
    for k, v in res.items():
        v.pop("step_latency_ms")
        v.update(warm.get(k, {}))
    bmc_tps = res["bmc"]["decode_tokens_per_s"] if "bmc" in res else float("nan")
    out = {"batch": B, "N": N, "gen": gen, "repeats": args.repeats, "graph_warmup": args.graph_warmup,
           "engines": res, "failed": failed,
           "ratios": {k: bmc_tps / v["decode_tokens_per_s"] for k, v in res.items() if k != "bmc"},
           "first_divergence_vs_bmc": ({r.engine: first_divergence(runs[first_bmc].tokens, r.tokens) for r in runs}
                                       if "bmc" in res else {})}
    print(f"{args.model} {args.dtype} B={B} N={N} prompt={args.prompt} gen={gen} on {torch.cuda.get_device_name()}"
          f" (bmc engines: median of {args.repeats} warm runs after a cold one)")
    for k, v in failed.items():
        print(f"  {k:14s} {v['error']}")
    for k, v in res.items():
        extra = f" T={v.get('T')} r={v.get('r')} allocs={v.get('kv_allocations')}" if "T" in v else ""
        if "first_run_tokens_per_s" in v:
            extra += (f" cold {v['first_run_tokens_per_s']:.1f} tok/s (captures/run {v['captures_per_run']},"
                      f" {sum(v['capture_s_per_run']):.2f} s) peak {v['peak_cuda_mb']:.0f} MiB")
        print(f"  {k:14s} {v['decode_tokens_per_s']:9.1f} tok/s  {v['time_per_output_token_ms']:7.2f} ms/step"
              f"  bmc x{bmc_tps / v['decode_tokens_per_s']:.2f}{extra}")
    print(f"  first divergence vs bmc: {out['first_divergence_vs_bmc']}")
    if args.sweep_T:
        from bmc.analytic import choose_T
        pred, source = choose_T(N, model=model.config, batch=B, dtype=dtype, device=torch.device("cuda"),
                                copy_free=True)
        sweep = []
        for T in [2**i for i in range(0, 8)]:
            r, _ = warm_runs(model, prompts, gen, "bmc", 1, T=T)
            sweep.append({"T": T, "decode_tokens_per_s": r.summary(B)["decode_tokens_per_s"]})
        best = max(sweep, key=lambda p: p["decode_tokens_per_s"])
        out["sweep_T"] = {"points": sweep, "best_T": best["T"], "predicted_T": pred, "T_source": source}
        print("  T sweep (warm): " + "  ".join(f"T={p['T']}:{p['decode_tokens_per_s']:.0f}" for p in sweep)
              + f"  best T={best['T']} predicted T={pred} ({source})")
    return out


def gemm_ms(model, rows: int) -> float:
    """ms of one decode step's GEMMs alone (every Linear of the model once, at `rows` rows), captured in one CUDA graph:
    the step's time less this is what the rest of the step costs, in the same process. Under activations="int8" a
    GEMM whose input the step's glue rounds (decode_cuda.glue_for: the norms' and silu_mul's, and the attention's
    where it writes the o GEMM's) takes rows already rounded here too; the others (the LM head) round their own."""
    from bmc.attention import dense_attention
    from bmc.models.decode_cuda import glue_for, step_attention
    from bmc.models.quant_i8x import quantize_x

    lins = model.linears()
    cfg = model.net.cfg
    glue = glue_for(model.net.layers, step_attention(dense_attention), cfg.head_dim, rows, model.dtype)
    glued = {id(lin) for L in model.net.layers for lin in (L.qkv, L.gate_up, L.down)} if glue.int8_rows else set()
    if glue.attention_rounds_o:
        glued |= {id(L.o) for L in model.net.layers}
    xs = {lin.in_features: torch.randn(rows, lin.in_features, device="cuda", dtype=model.dtype) for lin in lins}
    rounded = {k: quantize_x(x) for k, x in xs.items()} if glued else {}

    def run() -> None:
        for lin in lins:
            if id(lin) in glued:
                lin.int8_rows(rounded[lin.in_features], model.dtype)
            else:
                lin(xs[lin.in_features])

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.inference_mode():
        run()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(g):
        run()
    ms = replay_median_ms(g, 20)
    del g
    return ms


def configure_activations(model, act: str) -> None:
    """A model loaded with activations="int8" (its words kept) run either way: "int8" (the int8-x GEMV), or "float"
    (what a float load runs: the Triton float GEMV, and for Q4 kinds in bfloat16 tinygemm, packed here from the
    same blocks)."""
    from bmc.graphs import graph_store
    from bmc.models import set_activations
    from bmc.models.quant_torch import _int4pack, int4pack_available, values_of

    qs = [lin for lin in model.linears() if lin.device_q is not None]
    for lin in qs:
        lin.int8_activations = False
    model.activations = "float"
    graph_store(model).clear()
    if act == "int8":
        for lin in qs:
            lin.device_q.int4 = None
        set_activations(model, "int8")
        return
    for lin in qs:
        tq = lin.device_q
        N, K = tq.shape
        if tq.nibbles and tq.int4 is None and int4pack_available(model.device, model.dtype) and N % 8 == 0:
            d = tq.d.float().cpu().numpy()
            m = -float(tq.shift) * d if tq.m is None else tq.m.float().cpu().numpy()
            tq.int4 = _int4pack(values_of(tq.words, True, K).cpu().numpy(), d, m, model.device)


def run_quant(args) -> dict:
    """--quant: one bmc engine per quant on the same random weights, in this process (quant_torch.py's paths)."""
    dtype = getattr(torch, args.dtype)
    B, N = args.batch, args.total
    gen = N - args.prompt
    hf, cfg = build_hf(args.model, dtype)
    prompts = [[(13 * b + 7 * i) % (cfg.vocab_size - 10) + 5 for i in range(args.prompt)] for b in range(B)]
    state = dict(hf.state_dict())
    del hf
    rows: dict[str, dict] = {}
    model, loaded = None, ""
    default_pdl = gdc.MODE
    for quant in args.quant.split(","):
        import time

        spec, _, pdl = quant.partition("/")  # "q4_0+int8/off": gdc.py's mode for this row (default: its default)
        kind, _, act = spec.partition("+")  # "q4_0+int8": activations="int8" on the same blocks
        if pdl and pdl not in gdc.MODES:
            raise SystemExit(f"--quant {quant}: /{pdl} is not one of /{', /'.join(gdc.MODES)}")
        gdc.MODE = pdl or default_pdl
        t0 = time.time()
        if kind != loaded:  # each kind quantized once (minutes on the host's CPU), its words kept for int8
            del model
            gc.collect()
            torch.cuda.empty_cache()
            model = model_from_tensors(cfg.to_dict(), state, origin=args.model, dtype=dtype, device="cuda",
                                       quant=kind, activations="float" if kind == "none" else "int8")
            loaded = kind
        configure_activations(model, act or "float")
        load_s = time.time() - t0
        gc.collect()
        torch.cuda.empty_cache()
        kw = {"graph_warmup": True} if args.graph_warmup else {}
        r, extra = warm_runs(model, prompts, gen, "bmc", args.repeats, **kw)
        gms = gemm_ms(model, B)
        summ = r.summary(B)
        tps = summ["decode_tokens_per_s"]
        wb = model.weight_bytes - sum(  # a Q4 matrix on tinygemm here holds its words too: not read
            sum(t.numel() * t.element_size() for t in (tq.words, tq.d, tq.m) if t is not None)
            for tq in (lin.device_q for lin in model.linears() if lin.device_q is not None) if tq.int4 is not None)
        rows[quant] = {"decode_tokens_per_s": tps, "time_per_output_token_ms": summ["time_per_output_token_ms"],
                       "weight_bytes": wb, "weight_GBps": wb * tps / B / 1e9, "load_s": load_s,
                       "first_run_tokens_per_s": extra["first_run_tokens_per_s"],
                       "warm_tokens_per_s": extra["warm_tokens_per_s"], "peak_cuda_mb": extra["peak_cuda_mb"],
                       "gemm_ms": gms, "outside_gemm_ms": summ["time_per_output_token_ms"] - gms,
                       "tokens": r.tokens[0][:32]}
        print(f"  {quant:6s} {tps:8.1f} tok/s  {summ['time_per_output_token_ms']:6.2f} ms/step  weights "
              f"{wb / 1e9:5.2f} GB  {rows[quant]['weight_GBps']:7.0f} GB/s  x{tps / next(iter(rows.values()))['decode_tokens_per_s']:.2f}"
              f"  GEMMs alone {gms:.2f} ms, the rest {summ['time_per_output_token_ms'] - gms:.2f}  (load {load_s:.0f} s)",
              flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    first = next(iter(rows.values()))["decode_tokens_per_s"]
    return {"model": args.model, "dtype": args.dtype, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "batch": B, "N": N, "prompt": args.prompt, "gen": gen, "repeats": args.repeats,
            "quants": rows, "ratios": {q: v["decode_tokens_per_s"] / first for q, v in rows.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-7b", choices=list(SHAPES))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--total", type=int, default=1024, help="prompt + generated tokens (the paper's N)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-hf", action="store_true", help="bmc engines only (e.g. for a T sweep)")
    ap.add_argument("--repeats", type=int, default=3, help="warm runs per bmc engine after its cold one (median; 0: the cold run is reported)")
    ap.add_argument("--engines", default="", help="only these bmc engines, comma-separated (bmc is always kept)")
    ap.add_argument("--graph-warmup", action="store_true",
                    help="bmc and bmc-upfront capture their buckets before the prompts (graph_warmup=True)")
    ap.add_argument("--no-iterative", action="store_true", help="skip bmc-iterative (slow at large batch)")
    ap.add_argument("--sweep-T", action="store_true", help="also sweep bmc's T = 1, 2, 4, ... (the paper's Fig. 15)")
    ap.add_argument("--plot", action="store_true", help="only merge the gpu-MODEL-*.json files in --out into a PNG")
    ap.add_argument("--quant", default="", help="e.g. none,q8_0,q8_0+int8,q4_0,q4_0+int8: the bmc engine per quant "
                    "(+int8: activations='int8' on the same blocks; /off or /on: that row's kernels launched "
                    "ahead or not, bmc/models/gdc.py), ratios to the first")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    if args.quant:
        print(f"{args.model} {args.dtype} B={args.batch} N={args.total} prompt={args.prompt} on "
              f"{torch.cuda.get_device_name()} (median of {args.repeats} warm runs after a cold one)", flush=True)
        report = run_quant(args)
        name = f"gpu-quant-{args.model}-B{args.batch}-N{args.total}.json"
        (path / name).write_text(json.dumps(report, indent=1))
        return
    if not args.plot:
        out = run_config(args, args.batch, args.total)
        report = {"model": args.model, "dtype": args.dtype, "device": torch.cuda.get_device_name(),
                  "prompt": args.prompt, "results": [out]}
        (path / f"gpu-{args.model}-B{args.batch}-N{args.total}.json").write_text(json.dumps(report, indent=1))
    reports = [json.loads(f.read_text()) for f in sorted(path.glob(f"gpu-{args.model}-B*-N*.json"))]
    if reports:
        merged = dict(reports[0], results=sorted((r for rep in reports for r in rep["results"]),
                                                 key=lambda r: (r["batch"], r["N"])))
        plot(merged, path / f"gpu-{args.model}.png")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in report["results"] if "bmc" in r["engines"]]
    engines = list(dict.fromkeys(e for r in results for e in r["engines"]))  # an engine out of memory: no bar
    fig, ax = plt.subplots(figsize=(2.2 * len(results) + 3, 4))
    w = 0.8 / len(engines)
    for j, e in enumerate(engines):
        ax.bar([i + j * w for i in range(len(results))],
               [r["engines"][e]["decode_tokens_per_s"] if e in r["engines"] else 0 for r in results], w, label=e)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(results))], [f"B={r['batch']} N={r['N']}" for r in results])
    ax.set_yscale("log")  # batch 1 and batch 64 on one chart
    ax.set_ylabel("decode tokens/s (log)")
    if "bmc-upfront" in engines:  # the ratio the BMC claim is about, over each group
        for i, r in enumerate(results):
            top = max(r["engines"][e]["decode_tokens_per_s"] for e in engines if e in r["engines"])
            if "bmc-upfront" not in r["engines"]:
                ax.text(i + 0.4 - w / 2, top * 1.15, "upfront: out of memory", ha="center", fontsize=8)
                continue
            ratio = r["engines"]["bmc"]["decode_tokens_per_s"] / r["engines"]["bmc-upfront"]["decode_tokens_per_s"]
            ax.text(i + 0.4 - w / 2, top * 1.15, f"bmc / upfront {ratio:.2f}x", ha="center", fontsize=8)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.6)
    ax.set_title(f"{report['model']}-shaped, {report['dtype']}, {report['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
