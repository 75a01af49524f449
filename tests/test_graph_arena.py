"""The KV arena that lets CUDA graphs outlive a call (bmc/graphs.py), checked on the CPU: a cache on the arena holds
what a cache of its own holds through growth, joins, leaves, reorders and compaction; the arena is lent to one
cache at a time and re-made (dropping the graphs over it) only when too small. The graphs themselves are tested on
the GPU (tests/test_gpu.py). Also the cost model's capture term (C0 on CUDA)."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from bmc.analytic import Constants, Shape, load_profile, predicted_time, t_opt
from bmc.analytic import profile as profile_mod
from bmc.analytic.model import growth_s
from bmc.graphs import DeviceArena
from bmc.kv import BMCCache

L, H, D, MAX = 2, 2, 4, 64


def batch_cache(arena: DeviceArena | None, rows: int = 4) -> BMCCache:
    c = BMCCache(r=8, num_layers=L, batch_size=0, num_kv_heads=H, head_dim=D, max_length=MAX, left_pad=[])
    c.arena, c.arena_rows, c.grow_in_place = arena, rows, arena is not None
    c.regroup([])
    return c


def prefilled(n: int, seed: int) -> BMCCache:
    g = torch.Generator().manual_seed(seed)
    c = BMCCache(r=8, num_layers=L, batch_size=1, num_kv_heads=H, head_dim=D, max_length=MAX, left_pad=[0])
    c.reserve(n)
    for layer in range(L):
        c.update(layer, torch.randn(1, H, n, D, generator=g), torch.randn(1, H, n, D, generator=g))
    c.commit(n)
    return c


def decode(c: BMCCache, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        c.reserve(1)
        k, v = torch.randn(2, c.batch_size, H, 1, D, generator=g)
        for layer in range(L):
            c.update(layer, k + layer, v - layer)
        c.commit(1)


def assert_same_reads(a: BMCCache, b: BMCCache) -> None:
    """What attention reads: the bias over the written columns, and K/V wherever the bias lets a query see."""
    n = a.length
    assert (a.length, a.batch_size) == (b.length, b.batch_size)
    assert torch.equal(a.bias[..., :n], b.bias[..., :n])
    seen = (a.bias[:, 0, 0, :n] == 0)[:, None, :, None]
    for layer in range(L):
        for s in range(2):
            x, y = a.kv[layer, s, :, :, :n], b.kv[layer, s, :, :, :n]
            assert torch.equal(x[seen.expand_as(x)], y[seen.expand_as(y)])


def test_a_cache_on_the_arena_holds_what_a_cache_of_its_own_holds():
    arena = DeviceArena(torch.device("cpu"))
    a, b = batch_cache(arena), batch_cache(None)
    joins = [prefilled(n, n) for n in (5, 11, 3, 7)]
    base = None
    for step, op in enumerate(["join2", "decode", "join1", "decode", "reorder", "decode", "leave", "decode",
                               "compact", "decode", "join1"]):
        for c in (a, b):
            if op == "join2":
                c.regroup([], joins[:2])
            elif op == "join1":
                c.regroup(list(range(c.batch_size)), [joins[2 + (step > 5)]])
            elif op == "decode":
                decode(c, 9, step)
            elif op == "reorder":
                c.reorder(torch.tensor([2, 0, 1]))
            elif op == "leave":
                c.retire([1])
                c.regroup([0, 2])
            else:
                c.regroup(list(range(c.batch_size)))
            c.check_integrity()
        assert_same_reads(a, b)
        assert a.on_arena and a.kv.untyped_storage().data_ptr() == arena.kv.untyped_storage().data_ptr()
        if base is None:
            base = arena.kv.data_ptr()
        assert arena.kv.data_ptr() == base, "rows within arena_rows: the arena is never re-made"
    assert a.allocations == b.allocations or a.allocations < b.allocations  # growth widened the view in place
    for c in (a, b):
        c.regroup([])
    assert arena.holder() is None and not a.on_arena, "an emptied cache gives the arena back"


def test_the_arena_is_lent_to_one_cache_at_a_time_and_remade_only_when_too_small():
    freed = []
    arena = DeviceArena(torch.device("cpu"), on_free=lambda: freed.append(1))
    first, second = batch_cache(arena, rows=2), batch_cache(arena, rows=2)
    first.regroup([], [prefilled(6, 1)])
    second.regroup([], [prefilled(6, 2)])
    assert first.on_arena and not second.on_arena, "held by the first: the second allocates its own"
    decode(second, 20, 3)
    second.check_integrity()
    kept = arena.kv.data_ptr()
    first.regroup([])  # the first empties: the arena is free again, and kept
    third = batch_cache(arena, rows=2)
    third.regroup([], [prefilled(4, 4), prefilled(9, 5)])
    assert third.on_arena and arena.kv.data_ptr() == kept and not freed
    third.regroup([0, 1], [prefilled(3, 6)])  # three rows: more than it has, so it is re-made (its graphs go)
    assert third.on_arena and arena.rows == 3 and freed == [1]
    third.check_integrity()


def test_capture_cost_is_part_of_a_growths_fixed_cost():
    shape = Shape(batch=1, layers=32, heads=32, kv_heads=32, head_dim=128, dtype_bytes=2)
    free = Constants(copy_bw=math.inf, alloc_s=1e-5, attn_flops=5e11)
    captured = dataclasses.replace(free, capture_layer_s=2e-3)
    assert growth_s(shape, captured) == pytest.approx(1e-5 + 32 * 2e-3)
    n = 1024
    assert t_opt(n, shape, captured) < t_opt(n, shape, free), "a costly capture means fewer buckets"
    T = 8
    assert predicted_time(T, n, shape, captured) - predicted_time(T, n, shape, free) == pytest.approx(T * 32 * 2e-3)


def test_a_profile_carries_the_capture_term(tmp_path):
    path = tmp_path / "p.json"
    base = {"version": 1, **profile_mod.identity(torch.device("cpu"), torch.float32), "threads": 2,
            "constants": {"copy_bw_bytes_per_s": 1e10, "alloc_s": 0.0, "attn_flops_per_s": 2e10}}
    path.write_text(json.dumps(base))
    assert load_profile(path, torch.device("cpu"), torch.float32).capture_layer_s == 0.0  # older profiles
    base["constants"]["capture_layer_s"] = 1.5e-3
    path.write_text(json.dumps(base))
    assert load_profile(path, torch.device("cpu"), torch.float32).capture_layer_s == 1.5e-3
    base["constants"]["capture_layer_s"] = -1.0
    path.write_text(json.dumps(base))
    with pytest.warns(profile_mod.ProfileWarning, match="unreadable"):
        assert load_profile(path, torch.device("cpu"), torch.float32) is None


class _Recorder:
    """Stands in for DecodeGraphs on the CPU: records the bucket of every step it is asked to run."""

    def __init__(self) -> None:
        self.captures, self.seen = 0, []

    def step(self, cache, tok, pos):
        assert cache.on_arena and tok.shape == (cache.batch_size,) and int(pos[0]) == cache.length
        self.seen.append((cache.batch_size, cache.capacity, cache.capacity - cache.length))
        self.captures += 1


@pytest.mark.parametrize("kv,r", [("bmc", 16), ("upfront", None)])
def test_the_ladder_steps_once_in_every_bucket_the_batch_can_reach(gqa_dir, kv, r, monkeypatch):
    import bmc
    from bmc.scheduler import Scheduler

    import bmc.scheduler

    model = bmc.load(str(gqa_dir))
    sched = Scheduler(model, max_num_seqs=3, max_length=100, kv=kv, r=r)
    sched.graphs = _Recorder()
    sched.cache.arena, sched.cache.arena_rows, sched.cache.grow_in_place = DeviceArena(model.device), 3, True
    made = []

    def recorded(*a, **k):
        made.append(bmc.scheduler.make_cache.__wrapped__(*a, **k))
        return made[-1]

    recorded.__wrapped__ = bmc.scheduler.make_cache
    monkeypatch.setattr(bmc.scheduler, "make_cache", recorded)
    assert sched.capture_ladder(3) == (7 if kv == "bmc" else 1)
    # the placeholder rows hold one column each, as a prefill's cache holds its prompt: an upfront placeholder of
    # max_length would be a second batch-sized cache beside the arena (out of memory at a 7B's B=64, N=1024)
    assert [c.max_length for c in made] == [1]
    # each bucket with MIN_BUCKET_STEPS free rows, or as many as a run entering it has (the first: all but the
    # placeholder's column; the last: the 4 beyond 96), so the graphs taken are the ones a run would take
    want = [(16, 15), (32, 16), (48, 16), (64, 16), (80, 16), (96, 16), (100, 4)] if kv == "bmc" else [(100, 16)]
    assert sched.graphs.seen == [(3, c, free) for c, free in want]
    assert sched.cache.batch_size == 0 and sched.cache.arena.holder() is None


def test_the_arena_takes_what_the_rows_need_while_it_fits_and_more_rows_only_while_memory_is_plentiful():
    """A copying growth peaks at two buckets, so the arena (one) is taken up to ARENA_SHARE of the free memory for
    the rows the cache has; room for the rows it may come to have only up to ARENA_SHARE_AHEAD."""
    from bmc import graphs

    one_row = L * 2 * H * MAX * D * 4 + MAX * 4  # KV and bias of one row, float32
    for free, rows, lent, kept_rows in [(10 * one_row, 2, True, 4), (5 * one_row, 2, True, 2),
                                        (2 * one_row, 2, False, 0)]:
        arena = DeviceArena(torch.device("cpu"))
        arena.free_bytes = lambda free=free: free
        cache = batch_cache(arena, rows=4)
        cache.regroup([], [prefilled(3, r) for r in range(rows)])
        assert cache.on_arena == lent and arena.rows == kept_rows, (free // one_row, rows)
        assert graphs.ARENA_SHARE * free >= arena.nbytes
        cache.check_integrity()


def test_the_graph_store_keeps_the_most_recently_used_graphs_up_to_its_limit():
    """The store's bookkeeping is plain Python and runs here: put keeps at most GRAPH_LIMIT entries, dropping the
    least recently used, and get refreshes an entry (a GPU-only run was the first to find `put` missing)."""
    from bmc.graphs import GRAPH_LIMIT, GraphStore
    store = GraphStore(torch.device("cpu"))
    for i in range(GRAPH_LIMIT):
        store.put((i,), f"graph {i}")  # type: ignore[arg-type]
    assert store.get((0,)) == "graph 0"  # refreshed: (1,) is now the oldest
    store.put((GRAPH_LIMIT,), "new")  # type: ignore[arg-type]
    assert len(store.graphs) == GRAPH_LIMIT
    assert store.get((1,)) is None and store.get((0,)) == "graph 0" and store.get((GRAPH_LIMIT,)) == "new"
    store.clear()
    assert store.get((0,)) is None and store.graph_bytes == 0
