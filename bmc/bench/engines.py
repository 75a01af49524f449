"""The engines bmc-bench compares, each behind one function: given prompts (token ids) and a generated length,
run greedy decoding of exactly that many tokens and return the tokens plus per-step timestamps.

Timestamps: `steps[0]` is when the first generated token exists (prefill done), `steps[i]` when token i+1 exists,
so the differences are the per-token decode latencies at growing context (the paper's Fig. 16)."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .. import stream
from ..attention import ATTENTION_BACKENDS
from ..kv import KVCache
from ..models import Model


@dataclass
class EngineRun:
    engine: str
    tokens: list[list[int]]
    start: float
    steps: list[float]
    peak_rss_mb: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prefill_s(self) -> float:
        return self.steps[0] - self.start

    @property
    def decode_s(self) -> float:
        return self.steps[-1] - self.steps[0]

    def summary(self, batch: int) -> dict[str, Any]:
        # decode steps after the prefill's token; an engine that cannot time each step (vLLM returns whole
        # completions) gives [first token, last token] and the step count
        n = self.extra.get("decode_steps", len(self.steps) - 1)
        lat = [b - a for a, b in zip(self.steps, self.steps[1:])] if n == len(self.steps) - 1 else []
        return {
            "engine": self.engine,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "decode_tokens_per_s": batch * n / self.decode_s if n else 0.0,
            "time_per_output_token_ms": 1000 * self.decode_s / n if n else 0.0,
            "total_s": self.steps[-1] - self.start,
            "peak_rss_mb": self.peak_rss_mb,
            "step_latency_ms": [1000 * x for x in lat],
            **self.extra,
        }


class PeakRSS:
    """The peak RSS of the process during one engine run. On Linux the kernel keeps it (VmHWM, reset by writing 5
    to /proc/self/clear_refs): nothing runs beside the engine. Elsewhere a thread samples the RSS every 5 ms
    (psutil; /proc fallback) -- which perturbs what it measures: with it a batch-8 bmc decode step of the default
    model ran ~5 % slower here (the sampler preempts one of the two compute threads, the other waits for it)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def rss() -> int:
        try:
            import psutil
            return psutil.Process().memory_info().rss
        except ImportError:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    @staticmethod
    def _high_water_mark() -> int | None:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.005)

    def __enter__(self) -> "PeakRSS":
        self.peak = self.rss()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            if self._high_water_mark() is not None:
                return self
        except OSError:
            pass
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is None:
            self.peak = max(self.peak, self._high_water_mark() or 0)
            return
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def run_bmc(model: Model, prompts: list[list[int]], gen_len: int, kv: str, **kw: Any) -> EngineRun:
    name = "bmc" if kv == "bmc" and not kw else f"bmc-{kv}" + "".join(f"-{k}{v}" for k, v in kw.items())
    B = len(prompts)
    tokens: list[list[int]] = [[] for _ in range(B)]
    steps: list[float] = []
    with PeakRSS() as rss:
        start = time.perf_counter()
        s = stream(model, prompts, max_new_tokens=gen_len, ignore_eos=True, kv=kv, **kw)
        for i, ev in enumerate(s):
            tokens[ev.prompt_index].append(ev.token_id)
            if i % B == B - 1:  # all rows of this step are out (rows never finish early with ignore_eos)
                steps.append(time.perf_counter())  # tokens reach the host each step: no extra sync needed
    st = s.stats
    extra = {"r": st.r, "T": st.T, "T_source": st.T_source, "kv_allocations": st.kv_allocations,
             "peak_kv_mb": st.peak_kv_bytes / 2**20, "bytes_per_step": st.decode_bytes / max(st.decode_steps, 1),
             "weight_pack_s": st.weight_pack_seconds}
    if model.device.type == "cuda":
        extra.update(cuda_graph_captures=st.cuda_graph_captures, cuda_graph_capture_s=st.cuda_graph_capture_seconds,
                     cuda_graph_mb=st.cuda_graph_bytes / 2**20, kv_arena_mb=st.kv_arena_bytes / 2**20)
    return EngineRun(name, tokens, start, steps, rss.peak / 2**20, extra)


def run_hf(hf_model: Any, prompts: list[list[int]], gen_len: int, cache: str) -> EngineRun:
    """HF transformers greedy generate; `cache` is "dynamic" (DynamicCache) or "static" (StaticCache)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    steps: list[float] = []

    class Clock(LogitsProcessor):  # called once per generated token, right after that step's forward
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            steps.append(time.perf_counter())
            return scores

    P = max(len(p) for p in prompts)
    dev = next(hf_model.parameters()).device
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts], device=dev)
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], device=dev)
    kw: dict[str, Any] = {"cache_implementation": "static"} if cache == "static" else {}
    with PeakRSS() as rss, torch.inference_mode():
        start = time.perf_counter()
        out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=gen_len, do_sample=False, pad_token_id=0,
                                eos_token_id=None, logits_processor=LogitsProcessorList([Clock()]), **kw)
    tokens = out[:, P:].tolist()
    return EngineRun(f"hf-{cache}", tokens, start, steps, rss.peak / 2**20)


def decode_time_split(model: Model, prompts: list[list[int]], gen_len: int, kv: str) -> dict[str, float]:
    """Where decode time goes for one strategy (the paper's Table IV): KV update (reserve: growth copies and mask
    columns; the in-place K/V writes), attention, and the rest. Decode steps only. The native step times its own
    phases (NativeDecoder.set_profiling); the eager path is timed by wall-clock wrappers around the cache verbs
    and the attention backend."""
    acc = {"kv_update_s": 0.0, "attention_s": 0.0}

    def timed(fn: Callable, key: str, is_decode: Callable[..., bool]) -> Callable:
        def wrapper(*a: Any, **k: Any) -> Any:
            if not is_decode(*a, **k):
                return fn(*a, **k)
            t = time.perf_counter()
            out = fn(*a, **k)
            acc[key] += time.perf_counter() - t
            return out
        return wrapper

    native = model.net.native_decoder()
    saved = KVCache.reserve, KVCache.update, ATTENTION_BACKENDS["dense"]
    KVCache.reserve = timed(saved[0], "kv_update_s", lambda self, n, *a: n == 1)  # type: ignore[method-assign]
    if native is not None:  # the native step writes K/V and attends itself, timed inside
        native.set_profiling(True)
    else:
        KVCache.update = timed(saved[1], "kv_update_s", lambda self, i, k, v: k.shape[2] == 1)  # type: ignore
        timed_dense = timed(saved[2](None, None, 1), "attention_s", lambda q, *a, **kw: q.shape[2] == 1)
        ATTENTION_BACKENDS["dense"] = lambda cache, opts, g: timed_dense
    try:
        run = run_bmc(model, prompts, gen_len, kv)
    finally:
        KVCache.reserve, KVCache.update, ATTENTION_BACKENDS["dense"] = saved  # type: ignore[method-assign]
        phases = native.profile() if native is not None else {}
        if native is not None:
            native.set_profiling(False)
    acc["kv_update_s"] += phases.get("kv_write_s", 0.0)
    acc["attention_s"] += phases.get("attention_s", 0.0)
    total = run.decode_s
    return {**acc, "other_s": total - acc["kv_update_s"] - acc["attention_s"], "decode_s": total,
            "kernel": "native-cpu" if native is not None else "torch"}


def stream_read_gbps(mib: int = 512, repeats: int = 3) -> float:
    """Memory read bandwidth as a decode step sees it: one pass over a buffer far larger than the caches, on 2 MiB
    pages as the weights are, best of `repeats`. The native kernel's stream_read (loads OR-ed together, next to no
    arithmetic) where it builds, else torch's sum. Why not sum alone: on the 2-core EPYC of 2026-11-25 an F32
    decode step read 42 GB/s where sum measured 31-36, bound by its own additions; on the EPYC of 2026-11-26 both
    read the same (one thread 42.6 / 42.9 GB/s, two 51.8 / 49.9)."""
    from ..platform.hugepages import empty_huge
    from ..kernels.native import native_module

    x = empty_huge((mib * 2**18,), torch.float32)
    x.fill_(1.0)
    mod = native_module()
    read = (lambda: mod.stream_read(x)) if mod is not None else (lambda: x.sum())
    read()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        read()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def random_llama_7b(layers: int = 32, device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> Model:
    """A Llama-2-7B-shaped bmc model (cut to `layers`) with HF's random init (seed 0), made on `device`: for the GPU
    benchmarks, whose speed and determinism do not depend on the values."""
    import gc

    import transformers

    from ..models import model_from_tensors

    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers,
                                   num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                   max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(device):
        hf = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    model = model_from_tensors(cfg.to_dict(), dict(hf.state_dict()), origin=f"llama-7b-shape-{layers}-layers",
                               dtype=dtype, device=device)
    del hf
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return model


def graph_call_us(fn: Any, calls: int = 50, replays: int = 20) -> float:
    """µs a call of fn() on CUDA: `calls` calls captured in one CUDA graph (after a few eager warm-up calls),
    the median of `replays` replays divided by `calls`: the kernels' time without the host's launches."""
    from ..graphs import replay_median_ms

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return replay_median_ms(graph, replays) * 1e3 / calls
