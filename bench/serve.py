"""Serving benchmark: drive OpenAI-compatible endpoints (bmc-serve, vLLM-CPU's server, llama.cpp's llama-server)
with one client of its own (asyncio + httpx, the protocol of `vllm bench serve`) on the same weights, dtype and cores.

    python bench/serve.py                                   # bmc alone: closed loop, concurrency 1-16
    python bench/serve.py --llama-server PATH --vllm-python PATH   # + the peers, each started and stopped here
    python bench/serve.py --url http://127.0.0.1:8000 --name mine # an endpoint already running
    python bench/serve.py --scenario seed004                # several clients, prompts 1000-1500, 100-200 generated
    python bench/serve.py --workload copy --bmc-variant 'ngram=--speculative ngram'   # speculation, A/B in one run
    python bench/serve.py --shared-prefix 2000 --input-len 64 --concurrency 16 --num-prompts 64 \
        --bmc-variant 'no-cache=--no-prefix-cache'          # a shared system prompt (peers: prefix caching on)

Workloads: random prompts of --input-len tokens (ids drawn from the vocabulary, decoded to text, the same text
for every engine), --output-len tokens generated with EOS ignored; closed loop (--concurrency C: C clients back to
back) and open loop (--request-rates: Poisson arrivals). Reported per run: request/s, output tok/s, TTFT, TPOT
((latency - TTFT) / (tokens - 1)), ITL (between streamed chunks), end-to-end latency (mean, p50, p90, p99) and
goodput under --slo-ttft / --slo-tpot. --workload copy
instead asks (chat template) to copy a list of --input-len tokens or so, the case prompt lookup drafts for.
--shared-prefix N puts one random N-token text in front of every prompt (an agent's system prompt): peers then run
with their prefix caches on (llama-server's cache_prompt, vLLM's prefix caching), as bmc-serve does by default, and
bmc's peak KV bytes and prefix-cache hits are read from its /metrics. Also the offline reference: generate() at batch --offline-batch on the same
lengths, so the server's own cost shows (output tok/s served / offline). JSON + PNG under bench/results/cpu/."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bmc.bench.results import write_result  # noqa: E402  (from this checkout when bmc is not installed)
from bmc.platform.ports import free_port  # noqa: E402


# ---- the client --------------------------------------------------------------------------------------------------
@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    chunk_at: list[float] = field(default_factory=list)  # perf_counter() of each streamed chunk
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                      extra: dict[str, Any]) -> RequestResult:
    res = await _one_request(client, url, model, prompt, max_tokens, extra)
    if not res.ok and res.error.startswith("RemoteProtocolError"):
        # a kept-alive connection the server had closed (llama-server does): nothing was sent, send it again
        res = await _one_request(client, url, model, prompt, max_tokens, extra)
    return res


async def _one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                       extra: dict[str, Any]) -> RequestResult:
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True, **extra)
    t0 = time.perf_counter()
    last = t0
    res = RequestResult(ok=False)
    chunks = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if not data.get("choices"):
                    continue
                choice = data["choices"][0]
                if choice.get("finish_reason") is not None and not choice.get("text"):
                    # the closing chunk with no text (OpenAI's shape; bmc, llama-server and vLLM send it): no token
                    if choice["finish_reason"] == "length":
                        res.output_tokens = max_tokens
                    continue
                now = time.perf_counter()
                res.chunk_at.append(now)
                if chunks == 0:
                    res.ttft = now - t0
                else:
                    res.itls.append(now - last)
                last = now
                chunks += 1
                if data["choices"][0].get("finish_reason") == "length":
                    res.output_tokens = max_tokens  # EOS ignored: a "length" finish means all max_tokens came
        res.latency = time.perf_counter() - t0
        res.output_tokens = res.output_tokens or chunks
        res.ok = chunks > 0
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def closed_loop(url: str, model: str, prompts: list[str], lengths: list[int], concurrency: int,
                      extra: dict[str, Any], pause: tuple[float, float] = (0.0, 0.0)) -> tuple[list[RequestResult], float]:
    """`concurrency` clients, each sending its next request as soon as the last finished (after a random pause)."""
    queue = list(zip(prompts, lengths))
    results: list[RequestResult] = []
    rng = random.Random(0)

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            prompt, n = queue.pop()
            results.append(await one_request(client, url, model, prompt, n, extra))
            if pause[1] > 0:
                await asyncio.sleep(rng.uniform(*pause))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return results, time.perf_counter() - t0


async def open_loop(url: str, model: str, prompts: list[str], lengths: list[int], rate: float,
                    extra: dict[str, Any]) -> tuple[list[RequestResult], float]:
    """Poisson arrivals at `rate` requests/s, whatever the server's pace."""
    rng = random.Random(1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=httpx.Limits(max_connections=1000)) as client:
        t0 = time.perf_counter()
        tasks = []
        for p, n in zip(prompts, lengths):
            tasks.append(asyncio.create_task(one_request(client, url, model, p, n, extra)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


async def join_scenario(url: str, model_name: str, prompts: list[str], long_prompt: str, output_len: int,
                        join_after: float, extra: dict[str, Any]) -> dict[str, Any]:
    """Running streams, then one long prompt joins: the running rows' inter-token latency while it is prefilled
    (from its arrival to its first token) against theirs before it arrived."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
        tasks = [asyncio.create_task(one_request(client, url, model_name, p, output_len, extra)) for p in prompts]
        await asyncio.sleep(join_after)
        t_join = time.perf_counter()
        joiner = await one_request(client, url, model_name, long_prompt, 8, extra)
        t_first = t_join + joiner.ttft
        running = await asyncio.gather(*tasks)
    before = [itl for r in running for t, itl in zip(r.chunk_at[1:], r.itls) if t < t_join]
    during = [itl for r in running for t, itl in zip(r.chunk_at[1:], r.itls) if t_join <= t <= t_first + 0.5]
    if not before or not during or any(r.chunk_at[-1] < t_first for r in running):
        return {"error": "the running streams ended before the long prompt's first token: raise --output-len"}
    unloaded, loaded = percentiles(before), percentiles(during)
    return {"streams": len(prompts), "long_prompt_ttft_s": joiner.ttft, "unloaded_itl_p50_s": unloaded["p50"],
            "unloaded_itl_p99_s": unloaded["p99"], "itl_p50_during_join_s": loaded["p50"],
            "itl_p90_during_join_s": loaded["p90"], "itl_p99_during_join_s": loaded["p99"],
            "itl_max_during_join_s": max(during), "itls_during_join": len(during),
            "ratio_p99_to_unloaded": loaded["p99"] / unloaded["p50"]}


def percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    s = sorted(xs)
    at = lambda q: s[min(len(s) - 1, int(round(q * (len(s) - 1))))]  # noqa: E731
    return {"mean": sum(s) / len(s), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": s[-1]}


def summarize(results: list[RequestResult], duration: float, slo_ttft: float, slo_tpot: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    good = [r for r in ok if r.ttft <= slo_ttft and r.tpot <= slo_tpot]
    return {"requests": len(results), "failed": len(results) - len(ok), "duration_s": duration,
            "request_per_s": len(ok) / duration, "output_tok_per_s": out_tokens / duration,
            "goodput_req_per_s": len(good) / duration,
            "ttft_s": percentiles([r.ttft for r in ok]), "tpot_s": percentiles([r.tpot for r in ok]),
            "itl_s": percentiles([x for r in ok for x in r.itls]), "e2e_s": percentiles([r.latency for r in ok]),
            "errors": sorted({r.error for r in results if not r.ok})[:5]}


# ---- the engines -------------------------------------------------------------------------------------------------

class Engine:
    """A server process started and stopped by the benchmark (or an endpoint given by --url)."""

    def __init__(self, name: str, cmd: list[str] | None, env: dict[str, str] | None = None, url: str | None = None,
                 model_name: str = "", extra: dict[str, Any] | None = None, startup_s: float = 600.0) -> None:
        self.name, self.cmd, self.env, self.extra = name, cmd, env, extra or {}
        self.port = free_port() if cmd else 0
        self.url = url or f"http://127.0.0.1:{self.port}"
        self.model_name, self.startup_s = model_name, startup_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        if self.cmd is None:
            return
        cmd = [c.replace("{port}", str(self.port)) for c in self.cmd]
        self.log = open(f"/tmp/bench-serve-{self.name}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(self.env or {})},
                                     start_new_session=True)
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            self.stop()
            raise RuntimeError(f"{self.name} was not healthy within {self.startup_s} s")
        if not self.model_name:
            self.model_name = httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def engines_from_args(args: argparse.Namespace, model: Any) -> list[Engine]:
    eos = sorted(set(model.config.eos_token_ids) | set(model.tokenizer.eos_token_ids if model.tokenizer else []))
    threads = str(args.threads)
    caching = args.shared_prefix > 0  # peers' prefix caches: on where prompts share a prefix, else off
    out: list[Engine] = []
    if args.url:
        return [Engine(args.name, None, url=args.url, extra={"ignore_eos": True})]
    if "bmc" in args.engines:
        for k in args.bmc_instances:  # K instances share the batch: each gets 1/K of the sequences and budget
            seqs = -(-args.max_num_seqs // k)
            budget = max(seqs + 1, -(-args.max_num_batched_tokens // k))
            cmd = [sys.executable, "-m", "bmc.cli.serve", "--port", "{port}", "--max-num-seqs", str(seqs),
                   "--max-num-batched-tokens", str(budget), "--log-level", "warning", "--quant", args.bmc_quant]
            cmd += ["--threads", threads] if k == 1 else ["--instances", str(k)]
            cmd += ["--model", args.model] if args.model else []
            cmd += args.bmc_flags.split()
            out.append(Engine("bmc" if k == 1 else f"bmc x{k}", cmd, extra={"ignore_eos": True}, startup_s=600))
            for variant in args.bmc_variant if k == 1 else []:  # the same server with other flags, A/B in one run
                label, _, flags = variant.partition("=")
                out.append(Engine(f"bmc {label}", cmd + flags.split(), extra={"ignore_eos": True}, startup_s=600))
    if "llamacpp" in args.engines:
        if not args.llama_server:
            print("skipping llama.cpp: pass --llama-server PATH (llama.cpp's llama-server binary)", file=sys.stderr)
        else:
            from bmc.bench.peers import f32_gguf

            gguf = f32_gguf(model.path, os.path.join(args.work_dir, "model-f32.gguf"))
            cmd = [args.llama_server, "-m", gguf, "--port", "{port}", "--host", "127.0.0.1", "-t", threads, "-tb",
                   threads, "-np", str(args.max_num_seqs), "-c", str(args.max_num_seqs * args.context_per_slot),
                   "-b", str(args.max_num_batched_tokens), "-cb", "-no-kvu"]
            cmd += [] if caching else ["--no-cache-prompt"]
            # llama-server has no ignore_eos field: a logit bias keeps EOS from ending the stream
            out.append(Engine("llama.cpp", cmd, extra={"logit_bias": [[e, False] for e in eos],
                                                       "cache_prompt": caching}))
    if "vllm" in args.engines:
        if not args.vllm_python:
            print("skipping vLLM: pass --vllm-python PATH (the python of a venv with vllm-cpu)", file=sys.stderr)
        else:
            from bmc.bench.peers import hf_dir

            d = hf_dir(model, os.path.join(args.work_dir, "model-hf"))
            cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", d, "--port", "{port}",
                   "--host", "127.0.0.1", "--dtype", args.vllm_dtype, "--max-num-seqs", str(args.max_num_seqs),
                   "--max-num-batched-tokens", str(max(args.max_num_batched_tokens, 2048)),
                   "--enable-prefix-caching" if caching else "--no-enable-prefix-caching",
                   "--gpu-memory-utilization", "0.3", "--max-model-len", "4096"]
            env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "2"}
            tcmalloc = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
            if os.path.exists(tcmalloc):
                env["LD_PRELOAD"] = tcmalloc
            out.append(Engine("vLLM", cmd, env=env, extra={"ignore_eos": True}, startup_s=900))
    return out


# ---- workloads ---------------------------------------------------------------------------------------------------
def random_prompts(model: Any, n: int, lo: int, hi: int, seed: int) -> list[str]:
    """Texts of about lo..hi tokens: random vocabulary ids decoded to text (vLLM's random dataset)."""
    rng = random.Random(seed)
    tok, V = model.tokenizer, model.config.vocab_size
    special = set(model.config.eos_token_ids) | {model.config.bos_token_id or 0}
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        ids = [t for t in (rng.randrange(V) for _ in range(length * 2)) if t not in special]
        text = tok.decode(ids[:length])
        ids2 = tok.encode(text, add_special_tokens=False)[:length]
        out.append(tok.decode(ids2))
    return out


def copy_prompts(model: Any, n: int, length: int, seed: int) -> list[str]:
    """Chat-formatted requests to copy a list of about `length` tokens (items with random colours and counts): the
    output repeats the context, where prompt-lookup speculation drafts well."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        items, text = [], ""
        while len(model.tokenizer.encode(text)) < length:
            i = len(items)
            items.append(f"Item {i}: a {rng.choice(['red', 'green', 'blue', 'black'])} box of {rng.randint(2, 99)} "
                         f"{rng.choice(['apples', 'pears', 'nails', 'books'])}.")
            text = " ".join(items)
        out.append(model.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Copy the following list exactly.\n" + text}], add_generation_prompt=True))
    return out


def workload(model: Any, args: argparse.Namespace, n: int, seed: int) -> list[str]:
    if args.workload == "copy":
        return copy_prompts(model, n, args.input_len, seed)
    prompts = random_prompts(model, n, args.input_len, args.input_len, seed)
    if args.shared_prefix:  # the same text in front of every prompt, for every engine and concurrency
        prefix = random_prompts(model, 1, args.shared_prefix, args.shared_prefix, 1)[0]
        prompts = [prefix + "\n" + p for p in prompts]
    return prompts


def bmc_kv_metrics(url: str) -> dict[str, float]:
    """bmc-serve's KV gauges and prefix-cache counters (empty for a peer, or with the prefix cache off), summed over
    instances behind a router; and, since the server started, its requests and their seconds queued before
    admission, per instance too ("[0]", "[1]", ...): an uneven split or one instance's queue time says a run's
    requests waited for a row (a first wave sent to one instance while the other was still loading did)."""
    names = ("bmc:kv_cache_peak_bytes", "bmc:kv_cache_running_peak_bytes", "bmc:prefix_cache_usage_bytes",
             "bmc:prefix_cache_hits_total", "bmc:prefix_cache_queries_total",
             "bmc:request_queue_time_seconds_sum", "bmc:request_queue_time_seconds_count")
    out: dict[str, float] = {}
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in names:
            key = name.removeprefix("bmc:")
            instance = line.split('instance="', 1)[1].split('"', 1)[0] if 'instance="' in line else "all"
            if instance != "all":
                if "request_queue_time" not in name:
                    continue
                key += f"[{instance}]"
            out[key] = float(line.rsplit(" ", 1)[1])
    return out


def offline_reference(model: Any, prompts: list[str], batch: int, output_len: int) -> dict[str, Any]:
    """generate() at batch `batch` on the same prompts: the server's ceiling."""
    import bmc

    bmc.generate(model, prompts[:1], max_new_tokens=4, ignore_eos=True)  # warm-up
    t0 = time.perf_counter()
    out = bmc.generate(model, prompts[:batch], max_new_tokens=output_len, ignore_eos=True)
    wall = time.perf_counter() - t0
    toks = sum(len(c.token_ids) for c in out)
    return {"batch": batch, "output_tok_per_s": toks / wall, "decode_tok_per_s": out.stats.decode_tokens_per_s,
            "wall_s": wall}


def run_engine(engine: Engine, args: argparse.Namespace, model: Any) -> dict[str, Any]:
    res: dict[str, Any] = {"engine": engine.name, "closed_loop": [], "open_loop": [], "scenario": None}
    engine.start()
    try:
        url, name, extra = engine.url, engine.model_name, engine.extra
        warm = random_prompts(model, 2, 16, 16, 99)
        asyncio.run(closed_loop(url, name, warm, [8, 8], 2, extra))
        if args.scenario == "join":
            prompts = random_prompts(model, args.clients, args.input_len, args.input_len, 21)
            long_prompt = random_prompts(model, 1, 1500, 1500, 22)[0]
            res["scenario"] = asyncio.run(join_scenario(url, name, prompts, long_prompt, args.output_len,
                                                        args.join_after, extra))
            print(f"{engine.name:>10} join: {res['scenario']}", flush=True)
            return res
        if args.scenario == "seed004":
            n = args.num_prompts or 4 * args.clients
            prompts = random_prompts(model, n, 1000, 1500, 4)
            rng = random.Random(5)
            lengths = [rng.randint(100, 200) for _ in prompts]
            results, dur = asyncio.run(closed_loop(url, name, prompts, lengths, args.clients, extra,
                                                   pause=(0.0, args.pause)))
            res["scenario"] = dict(summarize(results, dur, args.slo_ttft, args.slo_tpot), clients=args.clients,
                                   prompt_tokens="1000-1500", output_tokens="100-200")
            print(f"{engine.name:>10} seed004 {args.clients} clients: {fmt(res['scenario'])}", flush=True)
            return res
        for c in args.concurrency:
            n = args.num_prompts or max(2 * c, 8)
            prompts = workload(model, args, n, 10 + c)
            results, dur = asyncio.run(closed_loop(url, name, prompts, [args.output_len] * n, c, extra))
            row = dict(summarize(results, dur, args.slo_ttft, args.slo_tpot), concurrency=c,
                       **bmc_kv_metrics(url))
            res["closed_loop"].append(row)
            print(f"{engine.name:>10} concurrency {c:>3}: {fmt(row)}", flush=True)
        for rate in args.request_rates:
            n = args.num_prompts or max(int(rate * 30), 8)
            prompts = workload(model, args, n, 1000 + int(rate * 100))
            results, dur = asyncio.run(open_loop(url, name, prompts, [args.output_len] * n, rate, extra))
            row = dict(summarize(results, dur, args.slo_ttft, args.slo_tpot), request_rate=rate)
            res["open_loop"].append(row)
            print(f"{engine.name:>10} rate {rate:>5.2f}/s: {fmt(row)}", flush=True)
    finally:
        engine.stop()
    return res


def fmt(row: dict[str, Any]) -> str:
    return (f"{row['output_tok_per_s']:7.1f} tok/s {row['request_per_s']:5.2f} req/s  TTFT p50/p99 "
            f"{row['ttft_s']['p50'] * 1e3:7.0f}/{row['ttft_s']['p99'] * 1e3:7.0f} ms  TPOT p50/p99 "
            f"{row['tpot_s']['p50'] * 1e3:6.1f}/{row['tpot_s']['p99'] * 1e3:6.1f} ms  ITL p99 "
            f"{row['itl_s']['p99'] * 1e3:6.1f} ms  failed {row['failed']}")


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bmc.bench.plots import save_titled

    runs = result["runs"]
    has_open = any(r["open_loop"] for r in runs)
    fig, axes = plt.subplots(1, 2 if has_open else 1, figsize=(11 if has_open else 6, 4), squeeze=False)
    ax = axes[0][0]
    for r in runs:
        if r["closed_loop"]:
            xs = [row["concurrency"] for row in r["closed_loop"]]
            ax.plot(xs, [row["output_tok_per_s"] for row in r["closed_loop"]], marker="o", label=r["engine"])
    off = result.get("offline")
    if off:
        ax.axhline(off["output_tok_per_s"], ls="--", color="gray", label=f"bmc generate() batch {off['batch']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (closed loop)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput")
    ax.legend()
    if has_open:
        ax = axes[0][1]
        for r in runs:
            xs = [row["request_rate"] for row in r["open_loop"]]
            ax.plot(xs, [row["tpot_s"]["p99"] * 1e3 for row in r["open_loop"]], marker="o", label=f"{r['engine']} p99 TPOT")
            ax.plot(xs, [row["ttft_s"]["p99"] * 1e3 for row in r["open_loop"]], marker="s", ls=":",
                    label=f"{r['engine']} p99 TTFT")
        ax.set_yscale("log")
        ax.set_xlabel("request rate (Poisson, req/s)")
        ax.set_ylabel("ms")
        ax.set_title("latency percentiles")
        ax.legend(fontsize=7)
    c = result["config"]
    save_titled(fig, f"{c['model_name']}, fp32, {c['threads']} threads, in {c['input_len']} / out {c['output_len']}, "
                 f"{c['host']}", path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model for every engine (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--engines", default="bmc,vllm,llamacpp")
    p.add_argument("--url", help="benchmark this running endpoint instead of starting engines")
    p.add_argument("--name", default="endpoint", help="label for --url")
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary")
    p.add_argument("--vllm-python", help="python of a venv with vllm-cpu")
    p.add_argument("--vllm-dtype", default="float32", help="vLLM's --dtype (bfloat16: its best mode on a CPU with "
                   "AVX512-BF16 or AMX)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--bmc-instances", default="1",
                   help="comma list of bmc-serve --instances values to run, e.g. 1,2,4 (each K splits --max-num-seqs "
                   "and the token budget over its instances; K > 1 pins one thread per physical core)")
    p.add_argument("--bmc-variant", action="append", default=[],
                   help="also run bmc-serve with extra flags, as 'LABEL=FLAGS' (repeatable), e.g. "
                   "'ngram=--speculative ngram --tree chain:4'")
    p.add_argument("--bmc-flags", default="", help="extra bmc-serve flags of the base bmc engine, e.g. "
                   "'--no-prefix-cache' (for whole-command A/B pairs)")
    p.add_argument("--bmc-quant", default="none",
                   help="bmc-serve --quant (default none: float32 weights, as the peers run them)")
    p.add_argument("--workload", choices=["random", "copy"], default="random",
                   help="closed/open loop prompts: random tokens (default) or requests to copy a list")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--context-per-slot", type=int, default=2048, help="llama-server: context of each of its slots")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens of one text in front of every prompt")
    p.add_argument("--concurrency", default="1,2,4,8,16")
    p.add_argument("--request-rates", default="", help="open loop: comma list of requests/s")
    p.add_argument("--num-prompts", type=int, default=0, help="requests per run (default: 2 x concurrency, >= 8)")
    p.add_argument("--scenario", choices=["seed004", "join"],
                   help="seed004: --clients back to back with pauses, prompts 1000-1500, 100-200 generated; join: "
                   "--clients streams running, then a 1500-token prompt joins (their ITL while it is prefilled)")
    p.add_argument("--join-after", type=float, default=3.0, help="join: seconds before the long prompt arrives")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--pause", type=float, default=1.0, help="seed004: random pause up to this many seconds")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO on TTFT, seconds")
    p.add_argument("--slo-tpot", type=float, default=0.2, help="goodput SLO on TPOT, seconds")
    p.add_argument("--offline-batch", type=int, default=8, help="generate() reference batch (0: skip)")
    p.add_argument("--work-dir", default=os.path.expanduser("~/.cache/bmc/bench"))
    p.add_argument("--out", default=None, help="JSON path (default bench/results/cpu/serve-<host>.json); PNG beside")
    args = p.parse_args()
    args.concurrency = [int(x) for x in args.concurrency.split(",") if x]
    args.request_rates = [float(x) for x in args.request_rates.split(",") if x]
    args.engines = [e.strip() for e in args.engines.split(",")]
    args.bmc_instances = [int(x) for x in args.bmc_instances.split(",") if x]
    os.makedirs(args.work_dir, exist_ok=True)

    import torch

    import bmc
    from bmc.analytic.profile import device_name

    torch.set_num_threads(args.threads)
    model = bmc.load(args.model, quant="none")
    host = f"{device_name(torch.device('cpu'))}, {os.cpu_count()} cpus"
    result: dict[str, Any] = {"config": dict(vars(args), model_name=os.path.basename(model.path), host=host,
                                             dtype="float32"), "runs": [], "offline": None}
    if args.offline_batch and not args.url and args.scenario is None:
        prompts = workload(model, args, args.offline_batch, 7)
        result["offline"] = offline_reference(model, prompts, args.offline_batch, args.output_len)
        print(f"offline generate() batch {args.offline_batch}: {result['offline']['output_tok_per_s']:.1f} tok/s",
              flush=True)
    engines = engines_from_args(args, model)
    for engine in engines:  # the model stays here for the prompts' tokenizer; it computes nothing meanwhile
        try:
            result["runs"].append(run_engine(engine, args, model))
        except RuntimeError as e:
            print(f"{engine.name}: {e}", file=sys.stderr)
    tag = args.scenario or "closed"
    drawn = any(r["closed_loop"] or r["open_loop"] for r in result["runs"])  # scenarios are tables: JSON only
    write_result(result, args.out, __file__, f"serve-{tag}", plot if drawn else None)


if __name__ == "__main__":
    main()
