"""Micro-benchmarks behind bmc-calibrate, on the runtime's own operations and KV-shaped tensors:

- alpha*BW and C0: KVCache._reallocate (allocate + copy + zero the new rows) at several cache sizes, fitted as
  time = C0 + bytes / alpha*BW;
- beta*C: the attention kernel decode runs here, of one query row (decode) and of t rows (verify) over several
  capacities: the native CPU step's attention on a CPU in float32 (the native Attention.attention_step), else
  dense_attention (SDPA). Fitted as time = overhead + n * seconds_per_row, beta*C = FLOPs per row /
  seconds_per_row (the fixed per-call overhead is paid every step whatever T is, so it does not move T_opt);
- on CUDA, the capture of a decode step as a graph (what a new capacity bucket costs where the cache grows in
  place): steps of a Llama-shaped layer stack (norms, projections, rotary, the K/V write, attention over the
  bucket, MLP) captured at several capacities and layer counts, fitted as time = fixed + layers * per-layer."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Iterable

import torch

from ..attention import dense_attention
from ..graphs import capture_into
from ..kernels.native import native_attention
from ..kv import BMCCache
from .model import Constants
from .profile import attention_kernel

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Grid:
    configs: tuple[tuple[int, int, int, int], ...]  # (batch, query heads, kv heads, head dim)
    copy_rows: tuple[int, ...]
    attn_rows: tuple[int, ...]
    verify_t: int
    layers: int
    repeats: int
    max_bytes: int = 256 * 2**20  # skip points whose KV tensors exceed this (time and memory on small machines)


QUICK = Grid(configs=((1, 9, 3, 64), (8, 9, 3, 64)), copy_rows=(256, 1024, 4096), attn_rows=(256, 1024, 4096),
             verify_t=16, layers=4, repeats=3)
FULL = Grid(configs=((1, 9, 3, 64), (8, 9, 3, 64), (8, 32, 32, 128), (32, 9, 3, 64)),
            copy_rows=(128, 512, 2048, 8192), attn_rows=(256, 1024, 4096, 8192), verify_t=16, layers=2, repeats=3)


# On a GPU small tensors are launch-bound (time flat in size, no slope to fit): measure at model shapes instead,
# Llama-7B-like heads and batches up to 32, with tensors large enough that bytes and FLOPs dominate.
GPU_QUICK = Grid(configs=((8, 32, 32, 128), (32, 32, 32, 128)), copy_rows=(256, 512, 1024, 2048),
                 attn_rows=(512, 1024, 2048, 4096), verify_t=16, layers=4, repeats=5, max_bytes=4 * 2**30)
GPU_FULL = Grid(configs=((8, 32, 32, 128), (32, 32, 32, 128), (64, 32, 8, 128)),
                copy_rows=(256, 512, 1024, 2048, 4096), attn_rows=(512, 1024, 2048, 4096, 8192), verify_t=16,
                layers=4, repeats=7, max_bytes=8 * 2**30)


class CalibrationError(RuntimeError):
    pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Fastest of `repeats` calls of fn() after one warm-up call: on a shared VM the noise (page reclaim, other
    tenants) only ever adds time, and a median of a few calls still caught it."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = intercept + slope * x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def measure_copy(cfg: tuple[int, int, int, int], grid: Grid, device: torch.device, dtype: torch.dtype) -> dict:
    """Chunk-boundary cost: the cache at capacity n grows by one chunk (n/8 rows)."""
    B, _, kvh, d = cfg
    points = []
    for n in grid.copy_rows:
        if 2 * grid.layers * B * kvh * n * d * torch.finfo(dtype).bits // 8 > grid.max_bytes:
            continue
        cache = BMCCache(r=max(1, n // 8), num_layers=grid.layers, batch_size=B, num_kv_heads=kvh, head_dim=d,
                         max_length=10 * n, dtype=dtype, device=device)
        cache._reallocate(n)
        cache.kv.normal_()
        cache.length = n  # full: a chunk boundary copies every written row
        full_kv, full_bias = cache.kv, cache.bias

        def grow() -> None:
            cache._reallocate(n + cache.r)
            cache.kv, cache.bias = full_kv, full_bias  # back to capacity n for the next repeat

        seconds = _time(grow, device, grid.repeats)
        points.append({"rows": n, "bytes": full_kv.numel() * full_kv.element_size(), "seconds": seconds})
        del cache, full_kv, full_bias
    c0, s_per_byte = fit_line([p["bytes"] for p in points], [p["seconds"] for p in points])
    return {"config": cfg, "points": points, "alloc_s": max(0.0, c0),
            "copy_bw_bytes_per_s": 1 / s_per_byte if s_per_byte > 0 else float("inf")}


AttentionStep = Callable[[], torch.Tensor]


def attention_step(cfg: tuple[int, int, int, int], t: int, n: int, device: torch.device,
                   dtype: torch.dtype) -> AttentionStep:
    """One decode (t = 1) or verify step's attention over capacity n on the kernel the runtime uses here, its last
    eighth masked as padding by the additive bias."""
    B, h, kvh, d = cfg
    kv = torch.randn(1, 2, B, kvh, n, d, dtype=dtype, device=device)
    min_value = torch.finfo(dtype).min
    if attention_kernel(device, dtype) == "native-cpu":
        dec = native_attention(h, kvh, d)
        q = torch.randn(B, t, h * d, dtype=dtype, device=device)
        bias = torch.zeros(B, 1, t, n, dtype=dtype, device=device)
        bias[..., n - n // 8 :] = min_value
        return lambda: dec.attention_step(q, kv, 0, bias, [], [], [])
    q = torch.randn(B, h, t, d, dtype=dtype, device=device)
    bias = torch.zeros(B, 1, t * (h // kvh) if t > 1 else 1, n, dtype=dtype, device=device)
    bias[..., n - n // 8 :] = min_value
    return lambda: dense_attention(q, kv[0, 0], kv[0, 1], bias, d**-0.5)


def measure_attention(cfg: tuple[int, int, int, int], t: int, grid: Grid, device: torch.device,
                      dtype: torch.dtype) -> dict:
    """Attention of t query rows over capacities n (padding rows masked by the bias, as the runtime runs it)."""
    B, h, kvh, d = cfg
    points = []
    for n in grid.attn_rows:
        if 2 * B * kvh * n * d * torch.finfo(dtype).bits // 8 > grid.max_bytes:
            continue
        seconds = _time(attention_step(cfg, t, n, device, dtype), device, 4 * grid.repeats)  # cheap calls
        points.append({"rows": n, "seconds": seconds})
    overhead, s_per_row = fit_line([p["rows"] for p in points], [p["seconds"] for p in points])
    flops_per_row = 4 * B * h * d * t
    return {"config": cfg, "t": t, "points": points, "overhead_s": overhead,
            "flops_per_s": flops_per_row / s_per_row if s_per_row > 0 else float("inf")}


CAPTURE_HIDDEN = 1024  # a capture's cost is its kernel count, not its sizes: a small Llama-shaped layer


def _decode_stack(layers: int, n: int, device: torch.device, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """One decode step (batch 1) of `layers` Llama-shaped layers over a KV bucket of n columns, as the runtime's
    eager step runs it: about the same kernels per layer."""
    hid, heads, d = CAPTURE_HIDDEN, CAPTURE_HIDDEN // 64, 64
    g = torch.Generator(device=device).manual_seed(0)
    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=dtype) * 0.02
    weights = [(w(hid, 3 * hid), w(hid, hid), w(hid, 2 * 4 * hid), w(4 * hid, hid)) for _ in range(layers)]
    kv = torch.zeros(layers, 2, 1, heads, n, d, dtype=dtype, device=device)
    bias = torch.zeros(1, 1, 1, n, dtype=dtype, device=device)
    at = torch.zeros(1, dtype=torch.long, device=device)
    x0 = torch.randn(1, 1, hid, generator=g, device=device, dtype=dtype)
    cos, sin = torch.ones(1, 1, 1, d, device=device, dtype=dtype), torch.zeros(1, 1, 1, d, device=device, dtype=dtype)

    def step() -> torch.Tensor:
        x = x0
        for i, (wqkv, wo, wup, wdown) in enumerate(weights):
            h = torch.nn.functional.rms_norm(x, (hid,))
            q, k, v = (h @ wqkv).view(1, 1, 3, heads, d).permute(2, 0, 3, 1, 4).unbind(0)
            q, k = q * cos + q.flip(-1) * sin, k * cos + k.flip(-1) * sin
            kv[i, 0].index_copy_(2, at, k)
            kv[i, 1].index_copy_(2, at, v)
            a = dense_attention(q, kv[i, 0], kv[i, 1], bias, d**-0.5)
            x = x + a.transpose(1, 2).reshape(1, 1, hid) @ wo
            gate, up = (torch.nn.functional.rms_norm(x, (hid,)) @ wup).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gate) * up) @ wdown
        return x
    return step


def measure_capture(grid: Grid, device: torch.device, dtype: torch.dtype) -> dict:
    """Seconds to capture a decode step as a CUDA graph (after its eager warm-up, as graphs.py does), over layer
    counts and bucket sizes: fitted as fixed + layers * per-layer; the bucket size barely matters."""
    points = []
    _capture_once(_decode_stack(2, grid.attn_rows[0], device, dtype), device)  # the process's first capture sets up
    for layers in (2, 4, 8):
        for n in grid.attn_rows[:2]:
            step = _decode_stack(layers, n, device, dtype)
            times = []
            times = [_capture_once(step, device) for _ in range(max(2, grid.repeats // 2))]
            points.append({"layers": layers, "rows": n, "seconds": min(times)})
    fixed, per_layer = fit_line([p["layers"] for p in points], [p["seconds"] for p in points])
    if per_layer <= 0:  # a flat or inverted fit (a neighbour's burst): the whole capture per layer, an upper bound
        per_layer = statistics.median(p["seconds"] / p["layers"] for p in points)
    return {"points": points, "fixed_s": fixed, "per_layer_s": per_layer}


def _capture_once(step: Callable[[], Any], device: torch.device) -> float:
    """Seconds to capture `step` as a CUDA graph after its eager warm-up on a side stream (as graphs.py does)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream(device).wait_stream(side)
    _sync(device)
    t0 = time.perf_counter()
    graph = torch.cuda.CUDAGraph()
    with capture_into(graph):
        step()
    _sync(device)
    seconds = time.perf_counter() - t0
    del graph
    return seconds


def median_of_fitted(values: Iterable[float]) -> float:
    """Median over the configurations whose fit has a slope: on a busy machine one configuration's times can come
    out flat (a neighbour's burst landed on its small point), and one inf would turn a two-point median into inf.
    inf when no configuration could be fitted."""
    finite = [v for v in values if math.isfinite(v) and v > 0]
    return statistics.median(finite) if finite else float("inf")


def calibrate(device: torch.device, dtype: torch.dtype, quick: bool = False,
              progress: Progress = lambda s: None) -> dict[str, Any]:
    """Run every measurement; return the profile dict (identity, constants, raw measurements)."""
    from .. import __version__
    from .profile import PROFILE_VERSION, identity

    if device.type == "cuda":
        grid = GPU_QUICK if quick else GPU_FULL
    else:
        grid = QUICK if quick else FULL
    copies, decodes, verifies = [], [], []
    total, done = 3 * len(grid.configs), 0
    with torch.inference_mode():
        for cfg in grid.configs:
            for kind, fn, out in (("copy", lambda c=cfg: measure_copy(c, grid, device, dtype), copies),
                                  ("decode attention", lambda c=cfg: measure_attention(c, 1, grid, device, dtype),
                                   decodes),
                                  (f"verify attention (t={grid.verify_t})",
                                   lambda c=cfg: measure_attention(c, grid.verify_t, grid, device, dtype), verifies)):
                done += 1
                progress(f"[{done}/{total}] {kind} B={cfg[0]} H={cfg[1]} H_kv={cfg[2]} d={cfg[3]}")
                out.append(fn())
        capture = None
        if device.type == "cuda":
            progress("[+] CUDA graph capture of a decode step")
            capture = measure_capture(grid, device, dtype)
    consts = Constants(
        copy_bw=median_of_fitted(c["copy_bw_bytes_per_s"] for c in copies),
        alloc_s=statistics.median(c["alloc_s"] for c in copies),
        attn_flops=median_of_fitted(a["flops_per_s"] for a in decodes),
        verify_flops=median_of_fitted(a["flops_per_s"] for a in verifies),
        capture_layer_s=capture["per_layer_s"] if capture is not None else 0.0,
    )
    for name, value in (("copy bandwidth", consts.copy_bw), ("decode attention FLOP/s", consts.attn_flops)):
        if not (math.isfinite(value) and value > 0):  # time did not grow with size: the fit is meaningless
            raise CalibrationError(f"{name} could not be fitted ({value}): the measured times do not grow with "
                                   "the tensor sizes (launch- or noise-bound); nothing written")
    return {
        "version": PROFILE_VERSION, **identity(device, dtype), "threads": torch.get_num_threads(),
        "bmc": __version__, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "quick": quick,
        "constants": {"copy_bw_bytes_per_s": consts.copy_bw, "alloc_s": consts.alloc_s,
                      "attn_flops_per_s": consts.attn_flops, "verify_flops_per_s": consts.verify_flops,
                      "verify_rows": grid.verify_t, "capture_layer_s": consts.capture_layer_s},
        "measurements": {"copy": copies, "decode_attention": decodes, "verify_attention": verifies,
                         **({"capture": capture} if capture is not None else {})},
    }
