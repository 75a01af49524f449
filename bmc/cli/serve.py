"""bmc-serve: an OpenAI-compatible server (completions, chat completions, SSE streaming, /health, /metrics) with
continuous batching on the BMC cache. Default model: the embedded SmolLM2-135M-Instruct."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Sequence

from ..choices import KV_STRATEGY_NAMES as KV_STRATEGIES
from ..errors import BmcError
from ..server.limits import DEFAULT_MAX_BODY_BYTES
from .common import (MAX_THREADS, Parser, add_chat_template_argument, add_kv_dtype_argument, add_load_arguments,
                     chat_template_of, fail, physical_cores)

if TYPE_CHECKING:
    from ..engine_options import EngineOptions


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="bmc-serve", description=__doc__)
    p.add_argument("-m", "--model",
                   help="HF model directory, .gguf file, or a hub name ORG/NAME or ORG/NAME:FILE.gguf (read from the "
                   "Hugging Face cache, downloaded if missing; bmc-models lists them) (default: the embedded "
                   "SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="one or more names clients may pass as `model` (e.g. the name a client sends by default); "
                   "the first is the one reported (default: the model file's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("-c", "--ctx-size", type=int, default=None,
                   help="the longest prompt + max_tokens a request may have, and so the KV cache's bound (default: "
                   "the model's context; at most that)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: a free one)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="rows decoded together at most (default 8)")
    p.add_argument("--max-num-batched-tokens", type=int, default=256,
                   help="tokens per step: every decode row first, then prompt chunks in what is left (default 256); "
                   "smaller keeps running streams smoother while a long prompt joins, larger prefills faster")
    p.add_argument("--itl-factor", type=float, default=0.0,
                   help="CPU: while rows decode, prompt chunks are cut so that a step takes about this many times the "
                   "rows' own step, by the costs measured on this server's steps, e.g. 2: a long prompt joining "
                   "slows the running streams about that much and never stalls them for a whole budget (default 0: "
                   "off, --max-num-batched-tokens alone)")
    p.add_argument("--max-queue", type=int, default=None,
                   help="requests waiting for a row at most; more are answered 503 with Retry-After (default: no limit)")
    p.add_argument("--api-key", default=os.environ.get("BMC_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1 routes (default: $BMC_API_KEY; /health is open)")
    p.add_argument("--allowed-origins", nargs="+", metavar="ORIGIN",
                   help="origins a browser may call the API from (CORS), e.g. http://localhost:3000, or '*' "
                   "(default: none, CORS off)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"request bodies larger than this get a 413 (default {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--prefix-cache-bytes", type=int, default=None,
                   help="prompt KV kept across requests (the prefix cache), at most this many bytes, least recently "
                   "used evicted first (default: 1/8 of the machine's memory, at most 4 GiB)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="keep no prompt KV across requests: every prompt is prefilled whole")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="CUDA: run every decode step eagerly (default: captured once per capacity bucket and batch)")
    p.add_argument("--no-adaptive-threads", action="store_true",
                   help="CPU: run every decode step on --threads (default: fewer while other processes keep the cores "
                   "busy; the tokens are the same)")
    p.add_argument("--instances", default="1",
                   help="engine processes behind the one endpoint, each pinned to its own physical cores (the BMC "
                   "paper's BMC_MI): a number, or 'auto' (one per NUMA node) (default 1)")
    add_load_arguments(p)
    add_chat_template_argument(p)
    add_kv_dtype_argument(p)
    p.add_argument("--tp", type=int, default=1,
                   help="tensor parallelism over this many ranks (processes; GPUs with --device cuda): this process "
                   "is rank 0 and schedules, the others follow it step by step; float weights (--quant none) on the "
                   "PyTorch path; --threads is per rank (default: the physical cores split between the ranks)")
    p.add_argument("--cpus", help="CPUs to run on, e.g. 0-7; with --instances K, K sets split by '|', e.g. "
                   "'0-7|8-15' (default: the physical cores split evenly, hyper-thread siblings left out)")
    p.add_argument("--kv", default="bmc", choices=list(KV_STRATEGIES), help="KV cache strategy (default bmc)")
    p.add_argument("--r", type=int, help="BMC chunk size in rows")
    p.add_argument("--T", type=int, help="BMC number of allocations over the model's context (r = ceil(N / T))")
    p.add_argument("--speculative", default="off",
                   help="speculative decoding drafter: off (default), ngram (prompt lookup: drafts copied from the "
                   "request's own context), draft:PATH (a smaller model with the same vocabulary), layers:N (the "
                   "model's first N layers) or int8-self (the model in int8); drafts are verified in the BMC "
                   "cache's padding rows: greedy tokens are identical to plain greedy, sampled ones keep the exact "
                   "distribution")
    p.add_argument("--tree", default="auto",
                   help="draft tree per row: auto (default: each step's trees sized from this model's measured "
                   "step cost by rows and the drafts' acceptance so far, batch-wide), chain:K, dynamic:KxDEPTH or "
                   "static:SIZE; trees take at most half of --max-num-batched-tokens while prompts wait")
    p.add_argument("--spec-max-tokens", type=int, default=None,
                   help="verify rows per step at most (every row's root and tree) (default: no cap; --tree auto "
                   "weighs each row's arithmetic against its expected tokens)")
    p.add_argument("--attention", default="dense", choices=["dense", "sparq", "window"],
                   help="decode attention: dense (exact, default), sparq (approximate: the top --sparq-r query "
                   "components pick the top --sparq-k positions of each row) or window (the local-window baseline "
                   "keeping --window-k positions)")
    p.add_argument("--sparq-r", type=int, default=None, help="SparQ query components (default head_dim/4)")
    p.add_argument("--sparq-k", type=int, default=128, help="SparQ positions attended per step (default 128)")
    p.add_argument("--window-k", type=int, default=256, help="window attention: positions kept (default 256)")
    p.add_argument("--timeout-graceful-shutdown", type=float, default=30.0,
                   help="on SIGTERM, seconds running requests get to finish before they are cut (default 30)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad flags before anything loads: the HTTP and process flags here, the engine's through the one
    EngineOptions they make (engine_options.py checks it)."""
    chat_template_of(args)  # a bad --chat-template exits here, before the model loads
    if not 0 <= args.port <= 65535:
        fail(f"--port must be in [0, 65535], got {args.port}")
    if args.threads is not None and not 1 <= args.threads <= MAX_THREADS:
        fail(f"--threads must be in [1, {MAX_THREADS}], got {args.threads}")
    if args.ctx_size is not None and args.ctx_size < 2:
        fail(f"--ctx-size must be >= 2 (a prompt token and one to generate), got {args.ctx_size}")
    if args.max_body_bytes < 1:
        fail(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    if args.served_model_name is not None and not all(args.served_model_name):
        fail("--served-model-name: names must be non-empty")
    if args.timeout_graceful_shutdown < 0:
        fail("--timeout-graceful-shutdown must be >= 0")
    from ..models.hub import is_hub_name

    if args.model is not None and not (os.path.exists(os.path.expanduser(args.model)) or is_hub_name(args.model)):
        fail(f"model path does not exist: {args.model} (a hub model is named ORG/NAME or ORG/NAME:FILE.gguf)")
    if not 1 <= args.tp <= MAX_THREADS:
        fail(f"--tp must be in [1, {MAX_THREADS}], got {args.tp}")
    if args.tp > 1:
        if args.instances != "1":
            fail("--tp with --instances is not built: run one tensor-parallel engine (--instances 1)")
        if args.itl_factor:
            fail("--itl-factor with --tp is not built: each rank would cut prompt chunks by its own timing")
        if args.quant not in ("auto", "none") or args.activations not in ("float", "auto"):
            fail("--tp loads float weights and activations: quantized weights (--quant) and --activations "
                 f"{args.activations} are not sharded yet")
        import torch

        if args.device == "cuda" and torch.cuda.device_count() < args.tp:
            fail(f"--tp {args.tp} on CUDA needs {args.tp} GPUs; torch sees {torch.cuda.device_count()}")
    if args.instances != "auto" and not (args.instances.isdigit() and 1 <= int(args.instances) <= MAX_THREADS):
        fail(f"--instances must be a number >= 1 or 'auto', got {args.instances!r}")
    try:
        from ..spec import parse_speculative

        engine_options(args)
        name, arg = parse_speculative(args.speculative) if args.speculative != "off" else ("off", None)
    except BmcError as e:
        fail(flag_names(str(e)))
    if name == "draft" and not os.path.exists(os.path.expanduser(str(arg))):
        fail(f"--speculative draft:PATH: the draft model path does not exist: {arg}")


# the engine options' names as the flags spell them, for their errors
FLAGS = {"max_num_seqs": "--max-num-seqs", "max_num_batched_tokens": "--max-num-batched-tokens",
         "itl_factor": "--itl-factor",
         "max_queue": "--max-queue", "spec_max_tokens": "--spec-max-tokens", "prefix_cache_bytes": "--prefix-cache-bytes",
         "give r or T": "give --r or --T", "max_length": "--ctx-size"}


def flag_names(message: str) -> str:
    for name, flag in FLAGS.items():
        message = message.replace(name, flag)
    for name in ("r", "T"):
        if message.startswith(f"{name} must be"):
            message = "--" + message
    return message


def engine_options(args: argparse.Namespace, prefix_cache_bytes: int | None = None) -> "EngineOptions":
    """The engine's options from bmc-serve's flags (the only place they are mapped)."""
    from ..attention import AttentionOptions, SparQOptions
    from ..engine_options import EngineOptions

    if prefix_cache_bytes is None:
        prefix_cache_bytes = 0 if args.no_prefix_cache else (
            args.prefix_cache_bytes if args.prefix_cache_bytes is not None else default_prefix_cache_bytes())
    return EngineOptions(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, max_queue=args.max_queue,
        itl_factor=args.itl_factor,
        kv=args.kv, r=args.r, T=args.T, kv_dtype=args.kv_dtype, attention=args.attention,
        attention_options=AttentionOptions(sparq=SparQOptions(r=args.sparq_r, k=args.sparq_k), window_k=args.window_k),
        speculative=args.speculative, tree=args.tree, spec_max_tokens=args.spec_max_tokens,
        prefix_cache_bytes=prefix_cache_bytes, cuda_graphs=not args.no_cuda_graphs,
        adaptive_threads=not args.no_adaptive_threads, max_length=args.ctx_size)


def default_prefix_cache_bytes() -> int:
    """1/8 of physical memory, at most 4 GiB (split between --instances)."""
    return min(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 8, 4 << 30)


def instance_count(args: argparse.Namespace) -> int:
    if args.instances != "auto":
        return int(args.instances)
    from ..platform.topology import numa_nodes

    return max(1, len(numa_nodes()))


def router_argv(argv: Sequence[str]) -> list[str]:
    """The command line each instance gets: the router's, less what only the router uses."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in ("--instances", "--cpus", "--host", "--port", "--threads", "-t"):
            skip = "=" not in a
            continue
        out.append(a)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    check_args(args)
    try:
        import uvicorn

        from ..server import ServeOptions, build_app
    except ImportError as e:
        fail(f"bmc-serve needs {e.name}, a dependency of bmc: run scripts/setup.sh again")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    instances = instance_count(args)
    if instances > 1:
        from ..server.router import build_router_app, core_sets_for

        try:
            core_sets = core_sets_for(instances, args.cpus)
        except (ValueError, OSError) as e:
            fail(str(e))
        instance_argv = router_argv(sys.argv[1:] if argv is None else argv)
        if args.prefix_cache_bytes is None:  # the default budget is the machine's: split it between the instances
            instance_argv += ["--prefix-cache-bytes", str(default_prefix_cache_bytes() // instances)]
        app = build_router_app(core_sets, instance_argv, args.api_key or None,
                               allowed_origins=args.allowed_origins, max_body_bytes=args.max_body_bytes)
        signal.signal(signal.SIGTERM, lambda signum, frame: None)  # as below: a drained router exits 0
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=args.timeout_graceful_shutdown)
        return
    if args.cpus:
        from ..platform.topology import parse_cpu_list

        try:
            cpus = parse_cpu_list(args.cpus)
            os.sched_setaffinity(0, cpus)  # before torch starts its threads: they inherit the mask
        except (ValueError, OSError) as e:
            fail(f"--cpus {args.cpus}: {e}")
        from ..platform.topology import bind_memory_to

        bound = bind_memory_to(cpus)  # several NUMA nodes: memory beside the cores
        if bound is not None:
            logging.getLogger("bmc.serve").info("memory bound to NUMA node(s) %s", bound)
    import torch

    torch.set_num_threads(args.threads or max(1, physical_cores() // args.tp))
    opts = ServeOptions(model=args.model, served_model_names=args.served_model_name, engine=engine_options(args),
                        chat_template=chat_template_of(args),
                        api_key=args.api_key or None, allowed_origins=args.allowed_origins,
                        max_body_bytes=args.max_body_bytes, dtype=args.dtype, device=args.device,
                        share_weights=args.device == "cpu" and not args.no_weights_cache and args.tp == 1,
                        quant=args.quant, activations=args.activations, tp=args.tp)
    app = build_app(opts)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=args.timeout_graceful_shutdown))
    state = app.state.bmc

    def stop() -> None:
        server.should_exit = True

    state.on_load_error = stop
    state.on_engine_death = stop  # every request in flight has its answer; exit non-zero for a supervisor
    # uvicorn drains on SIGTERM, then restores the handler it found and raises the signal again; with this no-op
    # handler found, a drained server exits 0 (a service manager's clean stop) instead of dying of the signal
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run()
    if state.load_error is not None:
        fail(f"could not load the model: {state.load_error}")
    if not server.started:
        sys.exit(1)  # uvicorn said why (e.g. the port is taken)
    if state.engine is not None and state.engine.error is not None:
        sys.exit(f"bmc-serve: the engine thread died ({type(state.engine.error).__name__}: {state.engine.error}); "
                 "exiting for a restart")


if __name__ == "__main__":
    main()
