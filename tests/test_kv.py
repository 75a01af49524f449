"""The cache strategies: allocation counts, masks, in-place writes, crop / reorder, integrity."""
from __future__ import annotations

import math

import pytest
import torch

import bmc
from bmc.kv import KV_STRATEGIES, BMCCache, IterativeCache, KVCache, UpfrontCache, r_from_T

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


def grow_recording(cache, steps: int, each_step=None) -> list:
    """fill(), keeping every written (layer, column, K) and calling each_step(cache) after each step."""
    history = []
    for t in [5] + [1] * steps:
        cache.reserve(t)
        for layer in range(cache.num_layers):
            k = torch.randn(cache.batch_size, cache.num_kv_heads, t, cache.head_dim)
            cache.update(layer, k, -k)
            history.append((layer, cache.length, k))
        cache.commit(t)
        cache.check_integrity()
        if each_step is not None:
            each_step(cache)
    return history


def assert_still_written(cache, history: list) -> None:
    """Every column written is still where it was written, whatever the growths did."""
    for layer, start, k in history:
        torch.testing.assert_close(cache.kv[layer, 0, :, :, start : start + k.shape[2]], k, rtol=0, atol=0)


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


@pytest.mark.parametrize("name", list(KV_STRATEGIES))
def test_left_pad_length_must_match_batch_size(name):
    extra = dict(r=4) if name == "bmc" else {}
    with pytest.raises(ValueError, match="left_pad has 2 entries for batch size 3"):
        KV_STRATEGIES[name](batch_size=3, max_length=8, left_pad=[0, 1], **SHAPE, **extra)


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


# ---- check_integrity, crop and reorder on known K/V, across strategies ------------------------------------------------

def make(name: str, **kwargs) -> KVCache:
    """A cache of strategy `name`; bmc with r=4, so a 16-column run crosses chunk boundaries."""
    cls = KV_STRATEGIES[name]
    return cls(r=4, **SHAPE, **kwargs) if cls is BMCCache else cls(**SHAPE, **kwargs)


def known(cache: KVCache, n: int) -> torch.Tensor:
    """K/V for n columns, [L, 2, B, H, n, d]; every element distinct (arange), so a misplaced row or column cannot match."""
    shape = (cache.num_layers, 2, cache.batch_size, cache.num_kv_heads, n, cache.head_dim)
    return torch.arange(math.prod(shape), dtype=torch.float32).view(shape)


def write(cache: KVCache, ref: torch.Tensor, t: int) -> None:
    """One forward of t tokens whose K/V are ref's columns [length, length + t)."""
    s = cache.length
    cache.reserve(t)
    for layer in range(cache.num_layers):
        cache.update(layer, ref[layer, 0, :, :, s : s + t], ref[layer, 1, :, :, s : s + t])
    cache.commit(t)


def expected_bias(pads: list[int], length: int, capacity: int) -> torch.Tensor:
    """The bias of a hole-free cache: 0 on each row's written columns, min on its left padding and from `length` on."""
    c = torch.arange(capacity)[None, :]
    visible = (c >= torch.tensor(pads)[:, None]) & (c < length)
    mask = torch.full((len(pads), capacity), torch.finfo(torch.float32).min).masked_fill_(visible, 0.0)
    return mask.view(len(pads), 1, 1, capacity)


# One corruption per check, on a valid cache of length 5, capacity 8, left_pad [0, 2]. Each breaks only its own
# invariant (the checks run in order, so an earlier one would otherwise fire first).
CORRUPTIONS = [
    ("kv shape", lambda c: setattr(c, "kv", c.kv[..., :-1])),  # head_dim 3, not 4
    ("bias shape", lambda c: setattr(c, "bias", c.bias[..., :-1])),  # one column short of kv's capacity
    ("length within capacity", lambda c: setattr(c, "length", c.capacity + 1)),
    ("padding rows beyond length are masked", lambda c: c.bias[0, ..., 6].fill_(0.0)),
    ("bias holds only 0", lambda c: c.bias[0, ..., 3].fill_(-1.0)),  # a soft mask: the column leaks with weight e^-1
    ("bias holds only 0", lambda c: c.bias[1, ..., 0].fill_(-1e9)),  # padding masked by -1e9, not finfo.min
    ("prompt padding is masked", lambda c: c.bias[1, ..., 1].fill_(0.0)),
    ("written columns are visible", lambda c: c.bias[1, ..., 4].fill_(c.min_value)),
    ("no NaN/inf", lambda c: c.kv[1, 1, 1, 1, 2].fill_(float("nan"))),  # a written column
    ("no NaN/inf", lambda c: c.kv[0, 0, 0, 0, 7].fill_(float("inf"))),  # a padding column: 0 weight * inf is NaN
]


@pytest.mark.parametrize("message, corrupt", CORRUPTIONS, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CORRUPTIONS)])
def test_integrity_check_names_each_broken_invariant(message: str, corrupt) -> None:
    cache = BMCCache(r=4, batch_size=2, max_length=12, left_pad=[0, 2], **SHAPE)
    fill(cache, steps=0, first=5)
    assert (cache.length, cache.capacity) == (5, 8)  # the corruptions' columns assume this layout
    cache.check_integrity()  # the uncorrupted cache passes
    corrupt(cache)
    with pytest.raises(AssertionError, match=message):
        cache.check_integrity()


@pytest.mark.parametrize("name", sorted(KV_STRATEGIES))
def test_crop_then_write_keeps_prefix_and_masks_the_rest(name: str) -> None:
    """A verify step crops rejected draft columns; the next writes must land right after the crop, the kept prefix
    must survive (in place, or through a reallocation that copies only `length` columns), and the cropped columns that
    are not rewritten must be masked again."""
    pads = [0, 2]
    cache = make(name, batch_size=2, max_length=16, left_pad=pads)
    ref = known(cache, 16)
    new = -ref - 1  # distinct from every original value: a stale column cannot pass for a new one
    for t in [5, 1, 1, 1, 1, 1]:
        write(cache, ref, t)
    cache.crop(5)
    assert cache.get_seq_length() == 5
    cache.check_integrity()
    for t, length in [(1, 6), (2, 8), (6, 14)]:  # stale visible columns 8, 9 first; then growth past bmc's chunk
        write(cache, new, t)
        assert cache.get_seq_length() == length
        assert torch.equal(cache.kv[..., :5, :], ref[..., :5, :])
        assert torch.equal(cache.kv[..., 5:length, :], new[..., 5:length, :])
        assert torch.equal(cache.bias, expected_bias(pads, length, cache.capacity))  # incl. columns >= length masked
        cache.check_integrity()
    with pytest.raises(ValueError, match="outside"):
        cache.crop(15)


@pytest.mark.parametrize("name", sorted(KV_STRATEGIES))
@pytest.mark.parametrize("index", [[2, 0], [1, 0]])
def test_reorder_shrinking_batch_follows_index(name: str, index: list[int]) -> None:
    """engine.generate drops finished rows with cache.reorder(smaller index). K/V, bias rows and the padding
    bookkeeping must follow it; [1, 0] drops the most-padded row, so the max pad must shrink (sparq skips the bias
    when it is 0)."""
    pads = [0, 1, 3]
    cache = make(name, batch_size=3, max_length=16, left_pad=pads)
    ref = known(cache, 16)
    for t in [5, 1]:
        write(cache, ref, t)
    cache.reorder(torch.tensor(index))
    kept = [pads[i] for i in index]
    assert cache.batch_size == 2 and cache.left_pad.tolist() == kept and cache._max_pad == max(kept)
    assert torch.equal(cache.kv[..., :6, :], ref[:, :, index, :, :6])
    assert torch.equal(cache.bias, expected_bias(kept, 6, cache.capacity))
    cache.check_integrity()
    nxt = known(cache, 16) + 10_000  # the shrunk batch's next forward (3 columns: bmc crosses its chunk boundary)
    write(cache, nxt, 3)
    assert torch.equal(cache.kv[..., :6, :], ref[:, :, index, :, :6])
    assert torch.equal(cache.kv[..., 6:9, :], nxt[..., 6:9, :])
    assert torch.equal(cache.bias, expected_bias(kept, 9, cache.capacity))
    cache.check_integrity()


@pytest.mark.parametrize("strategy", ["bmc", "iterative", "upfront"])
def test_prefill_bias_is_causal_and_finite_where_padding_and_future_overlap(strategy):
    """A left-padded prefill's bias: 0 where a query may look, finfo.min elsewhere -- never min + min = -inf, so a
    padding query (which sees nothing) still has a finite softmax."""
    kw = dict(r=4) if strategy == "bmc" else {}
    cache = KV_STRATEGIES[strategy](num_layers=1, batch_size=2, num_kv_heads=1, head_dim=2, max_length=8,
                                    left_pad=[0, 3], **kw)
    cache.reserve(5)
    bias = cache.attention_bias(5)
    assert bias.shape == (2, 1, 5, cache.capacity) and torch.isfinite(bias).all()
    pads = [0, 3]
    want = torch.full_like(bias, cache.min_value)
    for b in range(2):
        for q in range(5):
            want[b, 0, q, pads[b]: q + 1] = 0.0
    assert torch.equal(bias, want)


def test_reorder_counts_the_old_and_the_new_tensor_in_the_peak():
    """Forking samples copies the rows into a new tensor while the old one is alive: the peak the stats report
    includes both (growth copies are counted the same way)."""
    cache = KV_STRATEGIES["upfront"](batch_size=1, max_length=8, **SHAPE)
    fill(cache, 0)
    one = cache.nbytes
    assert cache.peak_bytes == one
    cache.reorder(torch.tensor([0, 0, 0]))
    assert cache.nbytes == 3 * one and cache.peak_bytes == 4 * one and cache.allocations == 1


def test_holes_flag_cleared_once_crop_or_reorder_removes_them():
    """Rows accepting different draft counts leave a masked hole; the flag (which relaxes one integrity check and
    makes SparQ keep its bias) must drop again once a crop or a reorder removed every hole."""
    def verify(cache, keep):
        cache.reserve(4)
        for layer in range(cache.num_layers):
            k = torch.randn(cache.batch_size, cache.num_kv_heads, 4, cache.head_dim)
            cache.update(layer, k, -k)
        return cache.accept(keep, 4)

    cache = BMCCache(r=8, batch_size=2, max_length=32, **SHAPE)
    fill(cache, steps=0, first=3)
    verify(cache, [[0, 1, 2], [0]])  # row 1 keeps 1 of 3: columns 4, 5 are a hole in it
    assert cache.holes and cache.length == 6
    cache.check_integrity()
    fill(cache, steps=1, first=1)
    cache.crop(4)  # the hole is gone with the columns it was in
    assert not cache.holes
    cache.check_integrity()  # now with the strict "written columns are visible" check

    verify(cache, [[0], [0, 1]])  # row 0 has a hole now
    assert cache.holes
    cache.reorder(torch.tensor([0, 1]))  # both rows kept: the hole stays
    assert cache.holes
    cache.reorder(torch.tensor([1]))  # the row with the hole dropped
    assert not cache.holes
    cache.check_integrity()


def visible_rows(cache: KVCache) -> list[torch.Tensor]:
    """Each row's visible K/V columns in order ([L, 2, H, n, d] per row): what its attention reads."""
    out = []
    for b in range(cache.batch_size):
        cols = (cache.bias[b, 0, 0, : cache.length] == 0).nonzero().flatten()
        out.append(cache.kv[:, :, b].index_select(3, cols))
    return out


@pytest.mark.parametrize("name", sorted(KV_STRATEGIES))
def test_regroup_keeps_rows_joins_caches_and_compacts(name: str) -> None:
    """Rows kept in a new order, rows of other caches appended, all right-aligned on one write column with the
    leading columns no row reads dropped; every row reads exactly what it read before, and writes go on."""
    big = make(name, batch_size=3, max_length=40, left_pad=[4, 0, 2])
    fill(big, steps=6, first=9)  # rows hold 5, 9 and 7 prompt columns + 6 decoded
    small = make(name, batch_size=1, max_length=40)
    fill(small, steps=0, first=3)
    long = make(name, batch_size=2, max_length=40, left_pad=[0, 1])
    fill(long, steps=1, first=20)
    before = visible_rows(big)
    big.regroup([2, 0], [small, long])  # row 1 (the longest) leaves
    big.check_integrity()
    after = visible_rows(big)
    assert big.batch_size == 5 and big.length == 21  # the longest row now: long's first, 21 columns
    for got, want in zip(after, [before[2], before[0], *visible_rows(small), *visible_rows(long)]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert big.capacity >= big.length + 1
    fill(big, steps=2, first=1)  # the batch decodes on
    big.regroup([1], [])  # only row 0's 11 columns (5 + 6) are left: the rest is dropped
    assert big.batch_size == 1 and big.length == 5 + 6 + 3 and int(big.left_pad[0]) == 0
    big.check_integrity()
    big.regroup([], [])
    assert big.batch_size == 0 and big.nbytes == 0


@pytest.mark.parametrize("name", sorted(KV_STRATEGIES))
def test_retire_then_place_reuses_a_slot_in_place(name: str) -> None:
    batch = make(name, batch_size=3, max_length=40, left_pad=[0, 3, 1])
    fill(batch, steps=4, first=10)
    before = visible_rows(batch)
    batch.retire([1])
    batch.check_integrity()
    assert visible_rows(batch)[1].shape[3] == 0  # the retired row reads nothing
    fill(batch, steps=2, first=1)  # the slot keeps decoding junk that only it reads
    new = make(name, batch_size=1, max_length=40)
    fill(new, steps=0, first=6)
    kv = batch.kv
    assert batch.place(1, new)
    batch.check_integrity()
    assert batch.kv is kv  # nothing reallocated: the row was written in place
    torch.testing.assert_close(visible_rows(batch)[1], visible_rows(new)[0], rtol=0, atol=0)
    for b in (0, 2):  # the other rows read what they read before, plus their own new columns
        torch.testing.assert_close(visible_rows(batch)[b][..., : before[b].shape[3], :], before[b], rtol=0, atol=0)
    too_long = make(name, batch_size=1, max_length=40)
    fill(too_long, steps=0, first=batch.length + 1)
    batch.retire([0])
    assert not batch.place(0, too_long)  # more columns than the batch: a regroup re-aligns instead


def test_growth_with_a_spare_ping_pongs_between_two_mappings():
    """keep_spare (a generate() decode cache): every growth copies into the storage the previous one left, so after
    the first two a run faults in no new memory; the contents survive each copy, padding is re-zeroed (the reused
    storage holds an older tensor's rows), and the spare counts the bytes written in it, not its reservation."""
    cache = BMCCache(r=4, batch_size=2, max_length=45, **SHAPE)
    cache.keep_spare = True
    storages = set()

    def each_step(c):
        storages.add(c.kv.untyped_storage().data_ptr())
        assert bool((c.kv[..., c.length :, :] == 0).all())  # padding zeroed on the reused storage too

    history = grow_recording(cache, 40, each_step)
    assert cache.allocations > 3 and len(storages) == 2
    assert_still_written(cache, history)
    whole = 2 * 2 * 2 * 2 * 45 * 4  # layers x K/V x batch x heads x max_length x head_dim: each mapping's reserve
    assert cache.spare.numel() == whole and 0 < cache.spare_nbytes < whole * 4
    # the tensor before the last growth: 44 columns (chunks of 4), then the run's maximum length 45
    assert cache.spare_nbytes == 44 * 2 * 2 * 2 * 2 * 4 * 4


def test_integrity_check_catches_a_spare_aliasing_the_kv_tensor():
    cache = BMCCache(r=4, batch_size=2, max_length=45, **SHAPE)
    cache.keep_spare = True
    fill(cache, steps=10)
    cache.check_integrity()
    cache.spare = cache.kv.view(-1)  # a growth would then copy the cache onto itself
    with pytest.raises(AssertionError, match="spare is not the KV tensor's storage"):
        cache.check_integrity()


def test_growth_without_a_spare_holds_no_second_buffer():
    cache = BMCCache(r=4, batch_size=2, max_length=45, **SHAPE)
    fill(cache, steps=20)
    assert cache.spare is None and cache.spare_nbytes == 0


def test_growth_in_place_widens_one_mapping_without_a_copy():
    """grow_in_place (a CPU decode cache): the KV tensor is a view of one mapping whose (row, KV head) slabs have
    room for max_length columns, and every growth widens the view: the storage never changes, each written column
    stays where it was written, the new padding is zero, and the peak is the cache's own size (no second tensor
    alive during a copy, no spare)."""
    cache = BMCCache(r=4, batch_size=2, max_length=45, **SHAPE)
    cache.grow_in_place = cache.keep_spare = True
    storages = set()

    def each_step(c):
        storages.add(c.kv.untyped_storage().data_ptr())
        assert c.slab_columns == 45 and bool((c.kv[..., c.length :, :] == 0).all())

    history = grow_recording(cache, 40, each_step)
    assert cache.allocations > 3 and len(storages) == 1
    assert_still_written(cache, history)
    assert cache.peak_bytes == cache.nbytes and cache.spare is None


def test_reorder_of_a_cache_growing_in_place_keeps_its_room():
    """Forking or dropping rows copies them into slabs that still have room: later growths stay copy-free, and
    padding is zero even where the new tensor reuses the old storage's pages (the spare)."""
    cache = BMCCache(r=4, batch_size=2, max_length=45, **SHAPE)
    cache.grow_in_place = cache.keep_spare = True
    fill(cache, steps=6)
    before = cache.kv.clone()
    cache.reorder(torch.tensor([1, 0, 1]))
    cache.check_integrity()
    assert torch.equal(cache.kv, before[:, :, [1, 0, 1]]) and cache.slab_columns == 45
    cache.reorder(torch.tensor([2]))  # into the first mapping again (the spare), whose pages hold old rows
    assert torch.equal(cache.kv, before[:, :, [1]]) and cache.kv.untyped_storage().data_ptr() != 0
    at = cache.kv.untyped_storage().data_ptr()
    fill(cache, steps=20, first=1)  # zero-padding asserted by check_integrity's finiteness and here:
    assert bool((cache.kv[..., cache.length :, :] == 0).all())
    assert cache.kv.untyped_storage().data_ptr() == at  # grew in place after the reorder


@pytest.mark.parametrize("pads", [[4, 0, 2], [9, 9, 9], [1, 1, 1]])
def test_compaction_of_a_cache_growing_in_place_moves_rows_within_their_slabs(pads):
    """A regroup that keeps every row in its slot and joins none (the served batch's compaction) moves each row's
    columns within its own slab: the same storage, no spare kept (an older one released), every row reads what it
    read, a retired row stays retired, and writes go on. Leading dead columns short of, equal to and beyond the
    kept width (overlapping and disjoint moves)."""
    cache = BMCCache(r=4, batch_size=3, max_length=45, **SHAPE)
    cache.grow_in_place = cache.keep_spare = True
    fill(cache, steps=6, first=12)
    cache.reorder(torch.tensor([0, 1, 2]))  # a copy: the first mapping becomes the spare
    assert cache.spare is not None
    cache.left_pad = torch.tensor(pads)  # rows hide their leading columns (read in place elsewhere)
    cache._max_pad = max(pads)
    for b, pad in enumerate(pads):
        cache.bias[b, ..., :pad] = cache.min_value
    cache.retire([1]) if pads[0] == 4 else None
    before, at = visible_rows(cache), cache.kv.untyped_storage().data_ptr()
    cache.regroup(range(3))
    cache.check_integrity()
    assert cache.kv.untyped_storage().data_ptr() == at and cache.spare is None and cache.spare_nbytes == 0
    assert cache.length == 18 - min(p for b, p in enumerate(pads) if not (pads[0] == 4 and b == 1))
    for got, want in zip(visible_rows(cache), before):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    fill(cache, steps=5, first=1)
    assert cache.kv.untyped_storage().data_ptr() == at


def test_a_draining_batch_keeps_no_spare():
    """Fewer rows after a copy (the batch draining): the old, larger storage is let go, not kept as a spare."""
    cache = BMCCache(r=4, batch_size=3, max_length=45, **SHAPE)
    cache.grow_in_place = cache.keep_spare = True
    fill(cache, steps=6)
    cache.regroup([0, 2])
    assert cache.batch_size == 2 and cache.spare is None
    cache.regroup([0, 1], [cache])  # more rows again: the old storage is the spare for the next copy
    assert cache.batch_size == 4 and cache.spare is not None


def test_growth_in_place_falls_back_to_copies_without_address_space(monkeypatch):
    """Where the reservation is refused (strict overcommit: empty_mapped gives only the tensor's own size), the
    tensor is contiguous and every growth copies, as before: same contents, integrity holds."""
    import bmc.kv.base as base

    monkeypatch.setattr(base, "empty_mapped", lambda shape, dtype, reserve=0: torch.zeros(shape, dtype=dtype))
    cache = BMCCache(r=4, batch_size=2, max_length=45, **SHAPE)
    cache.grow_in_place = True

    def each_step(c):
        assert c.kv.is_contiguous() and c.slab_columns == c.capacity

    assert_still_written(cache, grow_recording(cache, 12, each_step))


def test_regroup_repeats_a_joining_row_for_each_sample():
    """A prompt's row joins once per sample from one prefilled row (no replicated prompt cache first), and only its
    columns after the ones it hides (read in place elsewhere) are copied."""
    from bmc.kv import BMCCache

    kw = dict(num_layers=2, num_kv_heads=2, head_dim=4, max_length=32)
    batch, prompt = BMCCache(r=8, batch_size=1, **kw), BMCCache(r=8, batch_size=1, **kw)
    batch.regroup([])
    prompt.reserve(6)
    prompt.kv[:, :, 0, :, :6] = torch.arange(6.0)[:, None]
    prompt.commit(6)
    prompt.hide_leading(0, 4)
    batch.regroup([], [(prompt, [0, 0, 0])])
    assert batch.batch_size == 3 and batch.length == 2
    assert torch.equal(batch.kv[:, :, :, :, :2], prompt.kv[:, :, :1, :, 4:6].expand(-1, -1, 3, -1, -1, -1))
    batch.check_integrity()
