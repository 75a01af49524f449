"""Tensor parallelism on GPUs (issue 48, items 1 and 4): decode of a Llama-2-7B or Llama-2-70B shape with random
weights at tp = 1, 2, 4 in one run, each rank's decode step captured as one CUDA graph per capacity bucket with its
NCCL all-reduces inside (graph_warmup: captured before the timed runs).

    python bench/gpu_tp.py --shape 7b --tps 1,2 --batches 1,32 --out DIR/gpu-tp-7b.json
    python bench/gpu_tp.py --shape 70b --tps 4 --batches 1,32 --out DIR/gpu-tp-70b.json   # 4 H100s (35 GB a rank)
    python bench/gpu_tp.py --shape tiny --tps 1,2 --device cpu --gen 24 --prompt 8         # a smoke test (gloo)

Each rank builds only its part of the random model on its own GPU (shard.MatrixShapes: the whole model's matrices
are meta tensors until cut; no 140 GB file, no whole model anywhere); tp = 1 is this process on the first GPU.
Per tp and batch: a cold run (it captures the buckets' graphs), then --repeats warm runs, of which the median decode
tok/s (generate()'s stats: rank 0's engine) is reported. GB/s: the weight bytes every rank reads a step, summed
over the ranks (the 262 MB untied embedding table, looked up a row at a time, not counted), times steps a second;
% of roofline: that over tp x the card's HBM bandwidth on paper (H100 SXM 3.35 TB/s, H200 4.8 TB/s). Also each
rank's last graph replayed alone (every rank at once, so its collectives meet): the GPU's share of a step, the rest
the host's (sampling, the token to the host, the scheduler). --profile: a profiled batch-1 run per tp, kernels a
step grouped (GEMM, attention, NCCL, bmc's glue) from rank 0's trace. Writes the JSON and a PNG beside it."""
from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import tempfile
import time
from typing import Any

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the device hosts require it)
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ["BMC_NATIVE"] = "0"  # tp = 1 on the same PyTorch path as the ranks (on a CPU smoke test)

import torch  # noqa: E402

LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=32000, max_position_embeddings=4096,
             rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False, bos_token_id=1,
             eos_token_id=2, pad_token_id=0)
SHAPES = {
    "7b": dict(LLAMA, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32),
    "70b": dict(LLAMA, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8),
    "tiny": dict(LLAMA, vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
}
HBM = {"H100": 3.35e12, "H200": 4.8e12}  # bytes/s on paper (SXM)

GROUPS = [  # (group, substrings of kernel names), first match wins
    ("nccl", ("nccl",)),
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitk", "matmul")),
    ("attention", ("fmha", "flash", "attention", "efficient")),
    ("bmc_fused", ("_rms", "_rope", "_silu")),
    ("copy", ("copy", "cat", "index", "gather", "scatter")),
]


def group_of(name: str) -> str:
    low = name.lower()
    return next((g for g, keys in GROUPS if any(k in low for k in keys)), "other")


def hbm_of(name: str) -> float | None:
    return next((bw for key, bw in HBM.items() if key in name), None)


def one_model(config_dir: str, dtype: str, device: str) -> Any:
    """tp = 1: the whole random model in this process, built as a rank builds its part."""
    from bmc.parallel.shard import MatrixShapes, fill_random
    from bmc.parallel.tp import shape_model

    dev = torch.device("cuda:0" if device == "cuda" else device)
    model = shape_model(config_dir, dtype, dev, MatrixShapes)
    fill_random(model)
    return model


def rank_info(model: Any, tp: int) -> list[dict[str, Any]]:
    if tp > 1:
        return model.rank_info()
    info: dict[str, Any] = {"weight_bytes": model.weight_bytes, "device": str(model.device)}
    if model.device.type == "cuda":
        from bmc.graphs import graph_store

        store = graph_store(model)
        info.update(device_name=torch.cuda.get_device_name(model.device), graph_captures=store.captures,
                    replay_ms=store.replay_ms())
    return [info]


def measure(model: Any, tp: int, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    import bmc

    rows: dict[str, Any] = {}
    for B, ahead in [(B, ahead) for B in args.batches for ahead in ([True, False] if args.no_ahead_too else [True])]:
        prompts = [[(13 * b + 7 * i) % (vocab - 10) + 5 for i in range(args.prompt)] for b in range(B)]
        kw = dict(max_new_tokens=args.gen, ignore_eos=True, graph_warmup=args.device == "cuda", run_ahead=ahead)
        t0 = time.perf_counter()
        cold = bmc.generate(model, prompts, **kw)
        cold_s = time.perf_counter() - t0
        warm = [bmc.generate(model, prompts, **kw) for _ in range(args.repeats)]
        tps = [o.stats.decode_tokens_per_s for o in warm]
        med = sorted(tps)[len(tps) // 2]
        st = warm[len(warm) // 2].stats
        ranks = rank_info(model, tp)
        wb = sum(r["weight_bytes"] for r in ranks)
        replay = [r.get("replay_ms") for r in ranks]
        row = {"tokens_per_s": med, "warm_tokens_per_s": tps, "cold_tokens_per_s": cold.stats.decode_tokens_per_s,
               "cold_call_s": cold_s, "ms_per_step": 1000 * B / med, "weight_bytes": wb,
               "weight_bytes_per_rank": [r["weight_bytes"] for r in ranks], "GBps": wb * med / B / 1e9,
               "decode_kernel": st.decode_kernel, "graph_replays": st.cuda_graph_replays,
               "graph_captures": st.cuda_graph_captures, "replay_ms_per_rank": replay,
               "tokens": [c.token_ids for c in warm[0]]}
        peak = hbm_of(ranks[0].get("device_name", ""))
        if peak:
            row["pct_of_hbm"] = 100 * row["GBps"] * 1e9 / (tp * peak)
        if replay[0] is not None:
            row["host_ms"] = row["ms_per_step"] - max(replay)
        rows[f"b{B}" + ("" if ahead else "-no-ahead")] = row
        print(f"tp={tp} B={B}{'' if ahead else ' (run_ahead off)'}: {med:.1f} tok/s ({row['ms_per_step']:.2f} ms/step, warm {[round(t, 1) for t in tps]}, "
              f"cold {row['cold_tokens_per_s']:.1f}), weights {wb / 1e9:.2f} GB over {tp} rank(s), "
              f"{row['GBps']:.0f} GB/s" + (f" = {row['pct_of_hbm']:.1f} % of {tp} x {peak / 1e12:.2f} TB/s" if peak
                                            else "")
              + f"; {st.decode_kernel}, {st.cuda_graph_replays} replays"
              + (f"; graph alone {', '.join(f'{r:.3f}' for r in replay)} ms, host {row['host_ms']:.2f} ms"
                 if replay[0] is not None else ""), flush=True)
    if args.profile and args.device == "cuda":
        rows["profile_b1"] = profile(model, tp, args, vocab)
    return rows


def profile(model: Any, tp: int, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Kernels a decode step of rank 0 at batch 1, grouped: a profiled short run (graphs already captured), the
    kernels between its first and last graph launch over the launches between."""
    prompts = [[(7 * i) % (vocab - 10) + 5 for i in range(args.prompt)]]
    kw = dict(max_new_tokens=args.profile_gen, ignore_eos=True, graph_warmup=True)
    events = model.profile(prompts, kw) if tp > 1 else profiled_events(model, prompts, kw)
    launches = sorted(ts for name, ts, _ in events if name == "cudaGraphLaunch")
    if len(launches) < 3:
        return {"error": f"{len(launches)} graph launches in the trace"}
    lo, hi, steps = launches[0], launches[-1], len(launches) - 1
    groups: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    busy = 0.0
    for name, ts, dur in events:
        if name != "cudaGraphLaunch" and dur is not None and lo <= ts < hi:
            g = groups[group_of(name)]
            g[0] += 1 / steps
            g[1] += dur / steps
            busy += dur / steps
    out = {"steps": steps, "gpu_busy_us_per_step": busy, "wall_us_per_step": (hi - lo) / steps,
           "groups": {g: {"per_step": v[0], "us_per_step": v[1]} for g, v in groups.items()}}
    print(f"  tp={tp} profile (rank 0, B=1): GPU busy {busy:.0f} of {out['wall_us_per_step']:.0f} us a step; "
          + ", ".join(f"{g} {v[0]:.0f}x {v[1]:.0f} us" for g, v in sorted(groups.items(), key=lambda kv: -kv[1][1])),
          flush=True)
    return out


def profiled_events(model: Any, prompts: list[list[int]], kw: dict[str, Any]) -> list[tuple[str, float, Any]]:
    from bmc.parallel.tp import profiled_generate

    return profiled_generate(model, prompts, kw)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="7b", choices=list(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (a quick run)")
    p.add_argument("--tps", default="1,2")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--no-ahead-too", action="store_true",
                   help="each batch also with run_ahead=False (each step's tokens read before the next is launched)")
    p.add_argument("--profile-gen", type=int, default=48)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.tps = [int(t) for t in args.tps.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    from bmc.bench.results import write_result
    from bmc.parallel.tp import TensorParallelModel

    config = dict(SHAPES[args.shape])
    if args.layers:
        config["num_hidden_layers"] = args.layers
    config_dir = tempfile.mkdtemp(prefix="bmc-gpu-tp-")
    with open(os.path.join(config_dir, "config.json"), "w") as f:
        json.dump(config, f)
    cuda = args.device == "cuda"
    host = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if cuda else f"{os.cpu_count()} cpus")
    result: dict[str, Any] = {"config": dict(vars(args), host=host, model=config, torch=torch.__version__),
                              "rows": {}}
    print(f"Llama-2-{args.shape} shape ({config['num_hidden_layers']} layers), random {args.dtype} weights, prompt "
          f"{args.prompt} + {args.gen} generated, median of {args.repeats} warm runs after a cold one, on {host}",
          flush=True)
    for tp in args.tps:
        if tp == 1:
            model = one_model(config_dir, args.dtype, args.device)
        else:
            model = TensorParallelModel(config_dir, tp, dtype=args.dtype, device=args.device, random_weights=True)
        try:
            result["rows"][f"tp={tp}"] = measure(model, tp, args, config["vocab_size"])
        finally:
            if tp > 1:
                model.close()
            del model
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    base = result["rows"].get("tp=1")
    for tp in args.tps:
        if tp == 1 or base is None:
            continue
        row = result["rows"][f"tp={tp}"]
        for B in args.batches:
            r, b = row[f"b{B}"], base[f"b{B}"]
            r["latency_vs_tp1"] = r["ms_per_step"] / b["ms_per_step"]
            r["throughput_vs_tp1"] = r["tokens_per_s"] / b["tokens_per_s"]
            print(f"B={B}: tp={tp} step {r['ms_per_step']:.2f} ms = {r['latency_vs_tp1']:.3f}x tp=1's "
                  f"({b['ms_per_step']:.2f} ms); tok/s {r['throughput_vs_tp1']:.2f}x", flush=True)
    out = args.out or os.path.join(os.path.dirname(__file__), "results", "h100", f"gpu-tp-{args.shape}.json")
    write_result(result, out, __file__, "gpu-tp", plot)


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bmc.bench.plots import save_titled

    c, rows = result["config"], result["rows"]
    fig, axes = plt.subplots(1, len(c["batches"]), figsize=(5 * len(c["batches"]), 4))
    for ax, B in zip(axes if len(c["batches"]) > 1 else [axes], c["batches"]):
        names = list(rows)
        vals = [rows[n][f"b{B}"]["tokens_per_s"] for n in names]
        bars = ax.bar(names, vals)
        ax.bar_label(bars, labels=[
            f"{v:.0f} tok/s\n{rows[n][f'b{B}']['ms_per_step']:.2f} ms/step\n{rows[n][f'b{B}']['GBps']:.0f} GB/s"
            + (f" ({rows[n][f'b{B}']['pct_of_hbm']:.0f} %)" if "pct_of_hbm" in rows[n][f"b{B}"] else "")
            for n, v in zip(names, vals)], fontsize=8)
        ax.set_title(f"decode, batch {B}")
        ax.set_ylim(0, max(vals) * 1.35)
    save_titled(fig, f"Llama-2-{c['shape']} shape ({c['model']['num_hidden_layers']} layers), random {c['dtype']}, "
                     f"prompt {c['prompt']} + {c['gen']}, CUDA graphs with NCCL inside, {c['host']}", path)


if __name__ == "__main__":
    main()
