"""The cache strategies: allocation counts, masks, in-place writes, crop / reorder, integrity."""
from __future__ import annotations

import math

import pytest
import torch

import bmc
from bmc.kv import KV_STRATEGIES, BMCCache, IterativeCache, UpfrontCache, r_from_T

SHAPE = dict(num_layers=2, num_kv_heads=2, head_dim=4)


def fill(cache, steps: int, first: int = 5) -> None:
    """Prefill `first` columns then decode one column at a time, checking invariants after every step."""
    for t in [first] + [1] * steps:
        cache.reserve(t)
        for layer in range(cache.num_layers):
            k = torch.randn(cache.batch_size, cache.num_kv_heads, t, cache.head_dim)
            cache.update(layer, k, -k)
        cache.commit(t)
        cache.check_integrity()


@pytest.mark.parametrize("r", [1, 3, 8, 16])
def test_bmc_allocates_once_every_r_tokens(r):
    n = 5 + 40
    cache = BMCCache(r=r, batch_size=2, max_length=n, **SHAPE)
    fill(cache, steps=40)
    assert cache.allocations == 1 + math.ceil(n / r) - math.ceil(5 / r)  # prefill's chunks come in one allocation
    assert cache.capacity == n  # never grown past N
    assert cache.capacity - cache.length < r


def test_iterative_allocates_every_token_and_upfront_once():
    it = IterativeCache(batch_size=2, max_length=45, **SHAPE)
    fill(it, steps=40)
    assert it.allocations == 41  # prefill + one per decoded token
    assert it.capacity == it.length == 45
    up = UpfrontCache(batch_size=2, max_length=45, **SHAPE)
    fill(up, steps=10)
    assert up.allocations == 1 and up.capacity == 45 and up.length == 15


def test_bias_masks_padding_and_left_pad_rows():
    cache = BMCCache(r=4, batch_size=2, max_length=12, left_pad=[0, 2], **SHAPE)
    fill(cache, steps=0, first=5)
    assert cache.capacity == 8
    mn = torch.finfo(torch.float32).min
    row0, row1 = cache.bias[0, 0, 0], cache.bias[1, 0, 0]
    assert row0.tolist() == [0.0] * 5 + [mn] * 3
    assert row1.tolist() == [mn] * 2 + [0.0] * 3 + [mn] * 3
    causal = cache.attention_bias(1)
    assert causal is cache.bias  # one query: the cache's own tensor, no per-step construction


def test_prefill_bias_is_causal_within_block():
    cache = BMCCache(r=8, batch_size=1, max_length=8, **SHAPE)
    cache.reserve(3)
    b = cache.attention_bias(3)[0, 0]
    visible = (b == 0).int().tolist()
    assert visible == [[1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]]


def test_writes_are_in_place_between_chunk_boundaries():
    cache = BMCCache(r=8, batch_size=1, max_length=16, **SHAPE)
    fill(cache, steps=0, first=2)
    ptr = cache.kv.data_ptr()
    fill(cache, steps=5, first=1)  # 2 + 6 = 8 columns: still the first chunk
    assert cache.kv.data_ptr() == ptr and cache.allocations == 1
    fill(cache, steps=0, first=1)  # the 9th column crosses the boundary
    assert cache.kv.data_ptr() != ptr and cache.allocations == 2


def test_iterative_drops_rejected_draft_rows_like_hf_crop_and_cat():
    """After a verify step keeps 2 of 5 rows, an iterative cache has no padding to offer a tree; its next step
    allocates exactly what it needs and copies only the kept rows (HF DynamicCache: crop, then cat)."""
    it = IterativeCache(batch_size=1, max_length=64, **SHAPE)
    fill(it, steps=0, first=6)
    context = it.kv[..., :6, :].clone()
    it.reserve(5)  # a verify step: 5 tree rows written at columns 6..10, then 2 of them accepted
    block = torch.randn(1, SHAPE["num_kv_heads"], 5, SHAPE["head_dim"])
    for layer in range(SHAPE["num_layers"]):
        it.update(layer, block, -block)
    it.accept([[0, 3]], 5)
    assert it.length == 8 and it.capacity == 11 and not it.keeps_padding
    allocations = it.allocations
    fill(it, steps=0, first=4)  # the next step's 4 rows would fit the 3 rejected ones plus 1: it copies anyway
    assert it.allocations == allocations + 1 and it.capacity == it.length == 12
    assert torch.equal(it.kv[..., :6, :], context)
    for layer in range(SHAPE["num_layers"]):
        assert torch.equal(it.kv[layer, 0, :, :, 6:8], block[:, :, [0, 3]])
        assert torch.equal(it.kv[layer, 1, :, :, 6:8], -block[:, :, [0, 3]])
    assert BMCCache.keeps_padding and UpfrontCache.keeps_padding


def test_growth_preserves_contents_and_zero_fills_padding():
    cache = BMCCache(r=4, batch_size=1, max_length=12, **SHAPE)
    fill(cache, steps=0, first=4)
    before = cache.kv[..., :4, :].clone()
    fill(cache, steps=0, first=1)
    assert torch.equal(cache.kv[..., :4, :], before)
    assert torch.count_nonzero(cache.kv[..., 5:, :]) == 0


def test_crop_and_reorder():
    cache = BMCCache(r=4, batch_size=3, max_length=16, left_pad=[0, 1, 2], **SHAPE)
    fill(cache, steps=3, first=4)
    cache.crop(5)
    cache.check_integrity()
    assert cache.length == 5 and torch.all(cache.bias[..., 5:] == torch.finfo(torch.float32).min)
    rows = cache.kv[:, :, 2].clone()
    cache.reorder(torch.tensor([2, 2, 0]))
    cache.check_integrity()
    assert cache.batch_size == 3 and torch.equal(cache.kv[:, :, 0], rows) and cache.left_pad.tolist() == [2, 2, 0]
    with pytest.raises(ValueError):
        cache.crop(6)


def test_integrity_check_catches_unmasked_padding():
    cache = BMCCache(r=4, batch_size=1, max_length=8, **SHAPE)
    fill(cache, steps=0, first=2)
    cache.bias[..., 3] = 0.0  # a padding row made visible: attention would read zeros with weight e^0
    with pytest.raises(AssertionError, match="masked"):
        cache.check_integrity()


def test_r_from_T():
    assert r_from_T(1024, 16) == 64 and r_from_T(1000, 16) == 63 and r_from_T(5, 16) == 1
    with pytest.raises(ValueError):
        r_from_T(100, 0)


def test_generate_reports_allocations(gqa_dir):
    model = bmc.load(str(gqa_dir))
    prompts = [[5, 6, 7, 8], [9, 10]]
    n = 4 + 20
    stats = {kv: bmc.generate(model, prompts, max_new_tokens=20, ignore_eos=True, kv=kv, r=6 if kv == "bmc" else None).stats
             for kv in KV_STRATEGIES}
    assert stats["bmc"].kv_allocations == math.ceil((n - 1) / 6)  # the last token is sampled, never written
    assert stats["bmc"].r == 6 and stats["bmc"].T == math.ceil(n / 6)
    assert stats["upfront"].kv_allocations == 1
    assert stats["iterative"].kv_allocations == 20  # prefill + 19 decode steps
    assert stats["iterative"].peak_kv_bytes < stats["upfront"].peak_kv_bytes * 2
    for s in stats.values():
        assert s.generated_tokens == 40 and s.decode_tokens == 38 and s.peak_kv_bytes > 0


def test_update_through_device_index_equals_slice_write():
    """The CUDA-graph write path (column from `write_at`, an index tensor) writes what the slice path writes."""
    from bmc.kv import BMCCache

    a, b = (BMCCache(r=8, num_layers=2, batch_size=2, num_kv_heads=3, head_dim=4, max_length=16) for _ in range(2))
    for c in (a, b):
        c.reserve(5)
        c.commit(5)
        c.reserve(1)
    k, v = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    b.write_at = torch.tensor([b.length])
    for layer in range(2):
        a.update(layer, k, v)
        b.update(layer, k, v)
    assert torch.equal(a.kv, b.kv)
    assert torch.equal(a.kv[:, 0, :, :, 5:6], k.expand(2, 2, 3, 1, 4)) and torch.equal(a.kv[:, 1, :, :, 5:6], v.expand(2, 2, 3, 1, 4))
