"""CUDA graphs of the decode step, one per capacity bucket and batch, kept per model across calls.

A BMC cache changes shape only T times per generation: between two chunk boundaries every decode step runs the
same kernels on the same buffers. So the step is captured once per bucket and replayed for the rest of the chunk:
the per-kernel launch cost of a step (hundreds of small kernels) disappears.

A graph replays kernels on fixed addresses, so it can outlive a call only if the tensors it reads do. The batch
cache of a scheduler with graphs therefore borrows the model's arena (DeviceArena): one CUDA buffer with room for
rows x columns of KV and their bias, lent to one cache at a time. A cache on the arena grows in place (its slabs
have room for the run's maximum length: a growth widens the view and copies nothing, as a CPU cache grows), so the
view of a (batch, capacity) bucket has the same address and strides in every call that fits the arena, and its
graph (GraphStore, one per model) replays in the next call without a capture. The arena holds what the run's
longest bucket holds (an upfront cache's memory); the graphs share one memory pool (they never run at once).

What changes from step to step lives in device tensors the graph reads: the token and position (static input
buffers), the column the step writes its K/V to (`cache.write_at`, an index tensor the cache's update uses instead
of a Python slice) and the bias column opened by `cache.reserve` (an eager write before the replay). Replay runs
the same kernels on the same data as the eager step, so tokens are identical (tested on the GPU)."""
from __future__ import annotations

import collections
import contextlib
import gc
import statistics
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from .attention import AttentionFn

if TYPE_CHECKING:
    from .kv import KVCache
    from .models import Model

MIN_BUCKET_STEPS = 16  # capture only when the chunk has this many free rows left: a capture costs a few steps
GRAPH_LIMIT = 64  # graphs a model keeps over its arena (least recently used dropped first)
# The most of the device's free memory an arena may take: for the rows the cache has (else it grows by copies, whose
# peak, two buckets, is larger), and for the rows it may come to have (taken only while memory is plentiful)
ARENA_SHARE = 0.9
ARENA_SHARE_AHEAD = 0.5


@contextlib.contextmanager
def capture_into(graph: torch.cuda.CUDAGraph, pool: Any = None) -> Iterator[None]:
    """torch.cuda.graph with Python's cycle collector held off while the stream captures: a collection then could
    destroy a graph left in a cycle by an earlier run, and a graph's reset is not permitted during a capture (the
    capture fails, and with it the step)."""
    enabled = gc.isenabled()
    with torch.cuda.graph(graph, pool=pool):  # its entry collects first
        gc.disable()
        try:
            yield
        finally:
            if enabled:
                gc.enable()


class DeviceArena:
    """One KV buffer (and its bias) a model lends to one cache at a time, so that the graphs of its decode steps
    read the same addresses in every call. Views of it have a cache's usual layout: [L, 2, B, H_kv, capacity, w]
    with (row, head) slabs `columns` apart (KVCache's grow-in-place layout), bias [B, 1, 1, capacity] rows
    `columns` apart."""

    def __init__(self, device: torch.device, on_free: Callable[[], None] = lambda: None) -> None:
        self.device = device
        self.kv: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.layout: tuple[Any, ...] | None = None  # (layers, KV heads, width, storage dtype, bias dtype)
        self.rows = self.columns = 0
        self._lessee: weakref.ref | None = None
        self._on_free = on_free

    @property
    def nbytes(self) -> int:
        if self.kv is None:
            return 0
        return self.kv.numel() * self.kv.element_size() + self.bias.numel() * self.bias.element_size()

    def holder(self) -> Any:
        return self._lessee() if self._lessee is not None else None

    def holds(self, t: torch.Tensor) -> bool:
        return self.kv is not None and t.numel() > 0 and (
            t.untyped_storage().data_ptr() == self.kv.untyped_storage().data_ptr())

    def lend(self, cache: "KVCache", rows: int, columns: int, want_rows: int = 0) -> bool:
        """Lend the arena to `cache` for a view of `rows` x `columns` (re-made larger if it is too small and no
        other live cache holds it; with `want_rows` rows, the most the batch will have, if they fit
        ARENA_SHARE_AHEAD of the free memory). False: held by another cache, or beyond ARENA_SHARE of the free
        memory (the cache allocates its own)."""
        holder = self.holder()
        if holder is not None and holder is not cache:
            return False
        layout = (cache.num_layers, cache.num_kv_heads, cache.width, cache.format.storage, cache.dtype)
        if self.kv is None or layout != self.layout or rows > self.rows or columns > self.columns:
            if self.kv is not None:
                self.free()
            L, H, width, storage, dtype = layout
            def size(r: int) -> int:
                return L * 2 * r * H * columns * width * storage.itemsize + r * columns * dtype.itemsize
            free = self.free_bytes()
            rows = max(rows, want_rows) if size(max(rows, want_rows)) <= ARENA_SHARE_AHEAD * free else rows
            if size(rows) > ARENA_SHARE * free:
                return False
            self.kv = torch.empty(L * 2 * rows * H * columns * width, dtype=storage, device=self.device)
            self.bias = torch.empty(rows * columns, dtype=dtype, device=self.device)
            self.layout, self.rows, self.columns = layout, rows, columns
        self._lessee = weakref.ref(cache)
        return True

    def free_bytes(self) -> int:
        """Device memory free now (an old arena being re-made is already let go)."""
        return torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 2**62

    def release(self, cache: "KVCache") -> None:
        if self.holder() is cache:
            self._lessee = None

    def free(self) -> None:
        """Let the buffer go (a cache still viewing it keeps its memory alive until it lets go) and every graph
        that reads it."""
        self.kv = self.bias = self.layout = self._lessee = None
        self.rows = self.columns = 0
        self._on_free()

    def kv_view(self, shape: tuple[int, ...]) -> torch.Tensor:
        L, two, B, H, capacity, width = shape
        slab = self.columns
        assert self.kv is not None and B <= self.rows and capacity <= slab
        return self.kv[: L * two * B * H * slab * width].as_strided(
            shape, (two * B * H * slab * width, B * H * slab * width, H * slab * width, slab * width, width, 1))

    def bias_view(self, batch: int, capacity: int) -> torch.Tensor:
        c = self.columns
        assert self.bias is not None and batch <= self.rows and capacity <= c
        return self.bias[: batch * c].as_strided((batch, 1, 1, capacity), (c, c, c, 1))


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    tok: torch.Tensor
    pos: torch.Tensor
    logits: torch.Tensor
    attention: AttentionFn  # what the graph reads (kept alive with it)


class GraphStore:
    """A model's decode graphs over its arena, kept across calls (least recently used dropped past GRAPH_LIMIT),
    captured into one memory pool. Dropped all at once when the arena is re-made."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.arena = DeviceArena(device, on_free=self.clear)
        self.graphs: collections.OrderedDict[tuple, _Captured] = collections.OrderedDict()
        self.write_at = torch.zeros(1, dtype=torch.long, device=device)
        self.pool: Any = None
        self.captures = 0  # over the model's life
        self.capture_seconds = 0.0

    @property
    def graph_bytes(self) -> int:
        """Device memory the graphs' pool holds (their intermediates and outputs), from the allocator's
        snapshot: the segments of that pool."""
        if self.pool is None or not self.graphs:
            return 0
        pool = tuple(self.pool)
        return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                   if tuple(seg.get("segment_pool_id", ())) == pool)

    def clear(self) -> None:
        self.graphs.clear()
        self.pool = None

    def get(self, key: tuple) -> _Captured | None:
        entry = self.graphs.get(key)
        if entry is not None:
            self.graphs.move_to_end(key)
        return entry

    def put(self, key: tuple, entry: _Captured) -> None:
        self.graphs[key] = entry
        while len(self.graphs) > GRAPH_LIMIT:
            self.graphs.popitem(last=False)

    def replay_ms(self, reps: int = 50) -> float:
        """Median ms of the most recently used graph replayed back to back (no host work between): the GPU's time
        for a step of the last bucket, against which a step's wall time shows the host's share (bench/gpu_step.py,
        bench/gpu_tp.py; under tensor parallelism every rank replays at once, its collectives meeting the others').
        NaN without a graph."""
        if not self.graphs:
            return float("nan")
        return replay_median_ms(next(reversed(self.graphs.values())).graph, reps)


def replay_median_ms(graph: "torch.cuda.CUDAGraph", reps: int) -> float:
    """Median ms of `reps` replays of a captured graph, each timed by CUDA events and synchronised (the benchmarks'
    one timing loop for a graph)."""
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_store(model: "Model") -> GraphStore:
    """The model's store (made on first use)."""
    store = model.__dict__.get("_graph_store")
    if store is None:
        store = model.__dict__["_graph_store"] = GraphStore(model.device)
    return store


class DecodeGraphs:
    """A scheduler's decode steps as graphs: over a cache on the model's arena with the plain attention, in the
    model's GraphStore (kept across calls); otherwise (a cache off the arena, the attention over cached segments)
    one graph of its own, re-captured when the bucket changes."""

    def __init__(self, model: "Model", attention: AttentionFn, persistent: bool = True) -> None:
        self.model, self.attention = model, attention
        self.store = graph_store(model) if persistent else None
        self.local: dict[tuple, _Captured] = {}
        self._write_at: torch.Tensor | None = None
        self.captures = 0
        self.replays = 0
        self.capture_seconds = 0.0

    def step(self, cache: "KVCache", tok: torch.Tensor, pos: torch.Tensor,
             attention: AttentionFn | None = None) -> torch.Tensor:
        """One decode step (the cache has reserved its column): logits [B, 1, V]. Replays the bucket's graph, or
        runs the step eagerly (capturing a graph for the bucket when enough steps remain in it). The cache's
        write_at is the graphs' index tensor during the step only, so an eager step between two replays (the
        scheduler's, with shared segments) writes at its Python column. attention: this step's (default: the
        one given at construction); another one is another graph (the scheduler's segments: their tensors are
        read in place, so the graph holds the attention, and with it them, until drop())."""
        attention = self.attention if attention is None else attention
        shared = self.store is not None and attention is self.attention and cache.on_arena
        if shared:
            write_at = self.store.write_at
        else:
            if self._write_at is None:
                self._write_at = torch.zeros(1, dtype=torch.long, device=cache.device)
            write_at = self._write_at
        cache.write_at = write_at
        try:
            return self._step(cache, tok, pos, attention, shared)
        finally:
            cache.write_at = None

    def drop(self) -> None:
        """Forget the graph of its own (and the attention it reads, with its tensors)."""
        self.local.clear()

    def _step(self, cache: "KVCache", tok: torch.Tensor, pos: torch.Tensor, attention: AttentionFn,
              shared: bool) -> torch.Tensor:
        assert cache.write_at is not None
        cache.write_at.fill_(cache.length)
        key = (cache.kv.data_ptr(), tuple(cache.kv.shape), cache.kv.stride(), cache.bias.data_ptr(),
               cache.bias.stride(), tok.dtype, pos.dtype, id(attention))
        entry = self.store.get(key) if shared else self.local.get(key)
        if entry is not None and entry.attention is attention:
            entry.tok.copy_(tok[:, None])
            entry.pos.copy_(pos[:, None])
            entry.graph.replay()
            self.replays += 1
            return entry.logits
        if not shared:
            self.drop()  # the old bucket's graph is done: its private memory pool goes with it
        tok_in, pos_in = tok[:, None].clone(), pos[:, None].clone()
        if cache.capacity - cache.length < MIN_BUCKET_STEPS:
            return self.model.net(tok_in, pos_in, cache, attention, cache.bias)
        # the eager step on a side stream is also the warm-up capture needs; its logits are this step's result
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self.model.net(tok_in, pos_in, cache, attention, cache.bias)
        torch.cuda.current_stream().wait_stream(side)
        t0 = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        pool = None
        if shared:
            if self.store.pool is None:
                self.store.pool = torch.cuda.graph_pool_handle()
            pool = self.store.pool
        # recorded, not run (the K/V written above stay as they are)
        with capture_into(graph, pool):
            out = self.model.net(tok_in, pos_in, cache, attention, cache.bias)
        seconds = time.perf_counter() - t0
        entry = _Captured(graph, tok_in, pos_in, out, attention)
        self.captures += 1
        self.capture_seconds += seconds
        if shared:
            self.store.put(key, entry)
            self.store.captures += 1
            self.store.capture_seconds += seconds
        else:
            self.local[key] = entry
        return logits
