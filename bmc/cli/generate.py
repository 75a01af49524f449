"""bmc-generate: generate text from the command line (default model: the embedded SmolLM2-135M-Instruct)."""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Sequence

from ..choices import KV_STRATEGY_NAMES as KV_STRATEGIES
from ..errors import BmcError
from .common import (MAX_THREADS, Parser, add_chat_template_argument, add_kv_dtype_argument, add_load_arguments,
                     chat_template_of, fail, physical_cores)

BENCH_TEXT = (
    "The history of computing is a story of trade-offs between memory and arithmetic. Early machines stored a few "
    "thousand words, and programmers spent their days deciding what to keep and what to recompute. "
)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="bmc-generate", description=__doc__)
    p.add_argument("prompts", nargs="*", help="one prompt per argument")
    p.add_argument("-p", "--prompt", action="append", default=[], help="a prompt (repeatable; as the arguments)")
    p.add_argument("-f", "--prompt-file", help="file with one prompt per line ('-' reads stdin)")
    p.add_argument("-m", "--model",
                   help="HF model directory, .gguf file, or a hub name ORG/NAME or ORG/NAME:FILE.gguf (read from the "
                   "Hugging Face cache, downloaded if missing; bmc-models lists them) (default: the embedded "
                   "SmolLM2-135M-Instruct)")
    p.add_argument("-n", "--max-new-tokens", type=int, default=128, help="tokens to generate per prompt (default 128)")
    p.add_argument("-c", "--ctx-size", type=int, default=None,
                   help="positions a run may use, prompt and generated tokens together, and so the KV cache's; "
                   "generation stops when the longest prompt's context is full (default: the model's context; at "
                   "most that)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, help="sample from the k most likely tokens (default: all)")
    p.add_argument("--top-p", type=float, help="sample from the smallest set of tokens of this mass (default 1)")
    p.add_argument("--seed", type=int, help="sampling seed: the same tokens on every run (default: random)")
    p.add_argument("--num-samples", type=int, default=1, help="completions per prompt")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--kv", default="bmc",
                   help=f"KV cache strategy: {', '.join(KV_STRATEGIES)} (with --benchmark a comma list, or 'all')")
    p.add_argument("--r", type=int, help="BMC chunk size in rows")
    p.add_argument("--T", type=int, help="BMC number of allocations (r = ceil(N / T))")
    p.add_argument("--speculative", default="off",
                   help="speculative decoding drafter: off (default), ngram (prompt lookup), draft:PATH (a smaller "
                   "model with the same vocabulary), layers:N (the model's first N layers), int8-self (the model in "
                   "int8). Greedy output is identical to plain greedy; sampling keeps the exact distribution")
    p.add_argument("--tree", default="auto",
                   help="draft tree: auto (each step's trees sized from this model's measured step cost by rows and "
                   "the drafts' acceptance so far; default), chain:K, dynamic:KxDEPTH or static:SIZE[xDEPTH][:p0,"
                   "p1,...] (Sequoia's best shape for acceptance rates by child rank; plain 'static' is static:26)")
    p.add_argument("--spec-grow", action="store_true",
                   help="grow the KV chunk for a tree that does not fit its free rows (default: trim the tree)")
    p.add_argument("--share-prefix", default="auto", choices=["auto", "off"],
                   help="store shared KV once: each prompt's for its --num-samples, and a leading part common to "
                   "all prompts for the whole batch (shared-prefix attention; default auto)")
    p.add_argument("--attention", default="dense", choices=["dense", "sparq", "window"],
                   help="decode attention: dense (exact, default), sparq (approximate: top --sparq-r query components, "
                   "top --sparq-k positions) or window (local-window baseline keeping --window-k positions)")
    p.add_argument("--sparq-r", type=int, default=None, help="SparQ query components (default head_dim/4)")
    p.add_argument("--sparq-k", type=int, default=128, help="SparQ positions attended per step (default 128)")
    p.add_argument("--window-k", type=int, default=256, help="window attention: positions kept (default 256)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="on CUDA, run decode steps eagerly instead of one captured graph per BMC capacity bucket")
    p.add_argument("--cuda-graph-warmup", action="store_true",
                   help="on CUDA, capture the decode step of every capacity bucket before the prompts run (else each "
                   "bucket is captured when the run first reaches it; graphs are kept across calls either way)")
    p.add_argument("--no-adaptive-threads", action="store_true",
                   help="on a CPU, run every decode step on --threads (default: fewer while other processes keep the "
                   "cores busy; the tokens are the same)")
    add_load_arguments(p)
    add_kv_dtype_argument(p)
    p.add_argument("--tp", type=int, default=1,
                   help="tensor parallel ranks (worker processes over torch.distributed, each with its share of "
                   "the heads and MLP; float weights, the PyTorch path; default 1)")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    add_chat_template_argument(p)
    p.add_argument("--json", action="store_true", help="one JSON object per completion per line")
    p.add_argument("--benchmark", action="store_true",
                   help="report prefill/decode tokens/s and achieved GB/s (without prompts: synthetic ones)")
    p.add_argument("--repeats", type=int, default=1,
                   help="--benchmark: runs of every strategy, interleaved; the median is reported with the spread "
                   "(default 1)")
    p.add_argument("--batch-size", type=int, default=8, help="--benchmark without prompts: number of prompts")
    p.add_argument("--prompt-len", type=int, default=128, help="--benchmark without prompts: tokens per prompt")
    return p


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt) + list(args.prompts)
    if args.prompt_file:
        try:
            f = sys.stdin if args.prompt_file == "-" else open(args.prompt_file, encoding="utf-8")
            with f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            fail(f"cannot read --prompt-file {args.prompt_file}: {e.strerror}")
        except UnicodeDecodeError as e:
            fail(f"--prompt-file {args.prompt_file} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                 f"{e.start})")
    return prompts


def check_args(args: argparse.Namespace) -> None:
    """Ranges argparse's types do not check: one line and exit 2, before the model loads."""
    if args.threads is not None and not 1 <= args.threads <= MAX_THREADS:
        fail(f"--threads must be in [1, {MAX_THREADS}], got {args.threads}")
    if args.tp < 1:
        fail(f"--tp must be >= 1, got {args.tp}")
    if args.ctx_size is not None and args.ctx_size < 2:  # before the model loads (its upper bound: after)
        fail(f"--ctx-size must be >= 2 (a prompt token and one to generate), got {args.ctx_size}")
    if args.ctx_size is not None and args.tp > 1:
        fail("--ctx-size is not supported with --tp (the ranks tokenize the prompts): use --max-new-tokens")
    for name in ("batch_size", "prompt_len", "repeats"):  # the generation arguments are checked by GenerationConfig
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("temperature", "top_p"):
        v = getattr(args, name)
        if v is not None and not math.isfinite(v):
            fail(f"--{name.replace('_', '-')} must be a finite number, got {v}")


def within_context(model, prompts: list, args: argparse.Namespace) -> int:
    """--max-new-tokens cut to what --ctx-size leaves after the longest prompt (as llama.cpp stops when its
    context is full); a prompt that fills it is refused."""
    from ..engine import encode_prompts

    if not 2 <= args.ctx_size <= model.max_context:
        fail(f"--ctx-size must be in [2, {model.max_context}] (the model's context), got {args.ctx_size}")
    longest = max(len(ids) for ids in encode_prompts(model, prompts, args.chat))
    if longest >= args.ctx_size:
        fail(f"a prompt has {longest} tokens, --ctx-size is {args.ctx_size}: nothing left to generate")
    return min(args.max_new_tokens, args.ctx_size - longest)


def synthetic_prompts(model, batch: int, length: int) -> list[list[int]]:
    """Deterministic benchmark prompts of exactly `length` tokens each (different text per row)."""
    if model.tokenizer is None:
        return [[(7 * i + j) % model.config.vocab_size for j in range(length)] for i in range(batch)]
    base = model.tokenizer.encode(BENCH_TEXT * ((length + batch) // 20 + 2), add_special_tokens=False)
    return [base[i : i + length] for i in range(batch)]


def kv_list(spec: str, benchmark: bool) -> list[str]:
    names = list(KV_STRATEGIES) if spec == "all" else [s.strip() for s in spec.split(",")]
    for n in names:
        if n not in KV_STRATEGIES:
            fail(f"unknown --kv {n!r}; choose from {', '.join(KV_STRATEGIES)}")
    if len(names) > 1 and not benchmark:
        fail("several --kv strategies are only allowed with --benchmark")
    return names


def print_completion(c, args: argparse.Namespace, many: bool) -> None:
    if args.json:
        print(json.dumps({"prompt_index": c.prompt_index, "sample_index": c.sample_index, "token_ids": c.token_ids,
                          "text": c.text, "finish_reason": c.finish_reason}, ensure_ascii=False), flush=True)
        return
    if many:
        print(f"--- prompt {c.prompt_index} sample {c.sample_index} ({c.finish_reason})")
    print(c.text if c.text is not None else " ".join(map(str, c.token_ids)), flush=True)


def run_stream(model, prompts, kw: dict, args: argparse.Namespace) -> None:
    """Single row: print text as it comes. Several rows: print each completion as soon as it finishes."""
    from .. import Completion

    from .. import stream

    s = stream(model, prompts, **kw)
    rows: dict[tuple[int, int], Completion] = {}
    single = len(prompts) * args.num_samples == 1 and not args.json
    for ev in s:
        c = rows.setdefault((ev.prompt_index, ev.sample_index), Completion(ev.prompt_index, ev.sample_index))
        c.token_ids.append(ev.token_id)
        if ev.text is not None:
            c.text = (c.text or "") + ev.text
            if single:
                print(ev.text, end="", flush=True)
        c.finish_reason = ev.finish_reason
        if ev.finish_reason is not None:
            if single:
                print(flush=True)
            else:
                print_completion(c, args, many=True)


def benchmark_line(kv: str, st) -> str:
    rt = f"r={st.r} T={st.T} ({st.T_source})" if st.r else ""
    sp = st.speculative
    spec = (f" accepted/step={sp.mean_accepted_length:.2f} padding rows used={100 * sp.padding_use:.0f}%"
            if sp is not None else "")
    if st.attention_dense_transfers:
        spec += f" attention transfers={100 * st.attention_compression:.1f}% of dense"
    return (f"{kv:>9} {rt:>20} allocs={st.kv_allocations:<5} peakKV={st.peak_kv_bytes / 2**20:8.1f}MiB "
            f"prefill={st.prefill_seconds:6.2f}s ({st.prefill_tokens_per_s:7.1f} tok/s) "
            f"decode={st.decode_tokens_per_s:7.1f} tok/s {st.decode_gb_per_s:6.2f} GB/s{spec}")


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    check_args(args)
    template = chat_template_of(args)
    kvs = kv_list(args.kv, args.benchmark)
    try:
        prompts: list = read_prompts(args)  # before the load (and torch): a bad file fails in a moment
    except BmcError as e:
        fail(str(e))
    import torch

    from .. import generate, load

    torch.set_num_threads(args.threads or physical_cores())
    try:
        t0 = time.perf_counter()
        model = load(args.model, dtype=args.dtype, device=args.device, tp=args.tp,
                     share_weights=args.device == "cpu" and not args.no_weights_cache and args.tp == 1,
                     quant=args.quant, activations=args.activations)
        if template is not None:
            if getattr(model, "tokenizer", None) is None:
                fail("--chat-template: this model has no tokenizer here (with --tp, prompts are rendered by the ranks)")
            model.tokenizer.chat_template = template
        if args.benchmark:
            print(f"loaded {model.path} ({model.config.model_type}, {model.config.num_layers} layers, {args.dtype}, "
                  f"{args.device}) in {time.perf_counter() - t0:.1f}s; threads={torch.get_num_threads()}",
                  file=sys.stderr)
        if not prompts:
            if not args.benchmark:
                fail("no prompt given (pass prompts as arguments or --prompt-file)")
            prompts = synthetic_prompts(model, args.batch_size, args.prompt_len)
        max_new_tokens = args.max_new_tokens
        if args.ctx_size is not None:
            max_new_tokens = within_context(model, prompts, args)
        kw = dict(max_new_tokens=max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, seed=args.seed, num_samples=args.num_samples, stop=args.stop or None,
                  r=args.r, T=args.T, ignore_eos=args.ignore_eos, chat=args.chat, speculative=args.speculative,
                  tree=args.tree, spec_grow=args.spec_grow, share_prefix=args.share_prefix, attention=args.attention,
                  sparq_r=args.sparq_r, sparq_k=args.sparq_k, window_k=args.window_k,
                  cuda_graphs=not args.no_cuda_graphs, graph_warmup=args.cuda_graph_warmup,
                  adaptive_threads=not args.no_adaptive_threads,
                  kv_dtype=args.kv_dtype)
        if args.stream and not args.benchmark and args.tp == 1:  # under --tp: whole completions
            run_stream(model, prompts, dict(kw, kv=kvs[0]), args)
            return
        if args.benchmark:
            generate(model, prompts[:1], **dict(kw, max_new_tokens=4, kv=kvs[0]))  # warm-up: first-call overheads
        runs: dict[str, list] = {kv: [] for kv in kvs}
        for _ in range(args.repeats if args.benchmark else 1):  # interleaved: a slow moment hits every strategy
            for kv in kvs:
                runs[kv].append(generate(model, prompts, **dict(kw, kv=kv)))
        # each strategy's median run by decode speed (the first of two middle ones)
        results = [(kv, sorted(outs, key=lambda o: o.stats.decode_tokens_per_s)[(len(outs) - 1) // 2])
                   for kv, outs in runs.items()]
        many = len(results[0][1]) > 1
        if not args.benchmark or args.json:
            for c in results[0][1]:
                print_completion(c, args, many)
        if args.benchmark:
            print(f"batch={len(prompts) * args.num_samples} prompt_tokens={results[0][1].stats.prompt_tokens} "
                  f"max_new_tokens={max_new_tokens}", file=sys.stderr)
            base = results[0][1].stats.decode_tokens_per_s
            for kv, out in results:
                ratio = out.stats.decode_tokens_per_s / base if base else 0.0
                spread = ""
                if args.repeats > 1:
                    speeds = [o.stats.decode_tokens_per_s for o in runs[kv]]
                    spread = f"  (median of {len(speeds)}, decode {min(speeds):.1f}-{max(speeds):.1f} tok/s)"
                print(benchmark_line(kv, out.stats) + f"  x{ratio:.2f} vs {results[0][0]}{spread}", file=sys.stderr)
            same = all([c.token_ids for c in o] == [c.token_ids for c in results[0][1]]
                       for outs in runs.values() for o in outs)
            if len(results) > 1:
                print(f"tokens identical across strategies: {same}", file=sys.stderr)
    except BmcError as e:
        fail(str(e))
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
