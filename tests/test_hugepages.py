"""Weight panels on 2 MiB pages and KV mappings (bmc/platform/hugepages.py): what the arena hands out is correct memory, the
advice covers exactly the 2 MiB-aligned interior of each allocation, and a KV mapping is zeroed, reserves room and
takes no advice."""
from __future__ import annotations

import math
import mmap

import pytest
import torch

from bmc.platform import hugepages
from bmc.platform.hugepages import HugePageArena, empty_huge, empty_mapped, whole_mapping

HUGE = 2 << 20


class FakeLibc:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def madvise(self, addr, length, advice) -> int:
        self.calls.append((addr.value, length.value, advice))
        return 0


@pytest.fixture
def libc(monkeypatch) -> FakeLibc:
    fake = FakeLibc()
    monkeypatch.setattr(hugepages, "_libc", lambda: fake)
    return fake


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")
def test_empty_huge_advises_the_aligned_interior(libc):
    t = empty_huge((3 * HUGE + 12345,), torch.uint8)
    assert len(libc.calls) == 1
    begin, length, advice = libc.calls[0]
    assert advice == mmap.MADV_HUGEPAGE and begin % HUGE == 0 and length % HUGE == 0 and length >= 2 * HUGE
    assert t.data_ptr() <= begin and begin + length <= t.data_ptr() + t.numel()
    empty_huge((1000,), torch.float32)  # under 2 MiB: no aligned interior, no advice
    assert len(libc.calls) == 1


def test_arena_hands_out_disjoint_aligned_tensors(libc, monkeypatch):
    monkeypatch.setattr(HugePageArena, "CHUNK", 1 << 20)
    arena = HugePageArena()
    shapes = [((36, 18, 384), torch.uint8), ((4, 96, 16), torch.float16), ((3, 5), torch.float32),
              ((2, 20000, 16), torch.float32), ((1, 1), torch.int8)]  # the fourth outgrows a chunk
    got = [arena.empty(s, d) for s, d in shapes]
    spans = []
    for t, (shape, dtype) in zip(got, shapes):
        assert tuple(t.shape) == shape and t.dtype == dtype and t.is_contiguous() and t.data_ptr() % 64 == 0
        t.fill_(1)
        spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two overlap
    assert len({t.untyped_storage().data_ptr() for t in got}) == 3  # a chunk, one made to measure, a chunk
    for t in got:
        assert bool((t == 1).all())


def test_empty_mapped_is_zeroed_reserves_room_and_takes_no_huge_page_advice(libc):
    shape = (2, 3, HUGE // 4 + 5)
    t = empty_mapped(shape, torch.float32, reserve=4 * math.prod(shape))
    assert tuple(t.shape) == shape and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % mmap.PAGESIZE == 0 and bool((t == 0).all())  # a fresh mapping: zeros, page-aligned
    assert libc.calls == []  # 4 KiB pages: THP's compaction stalled every growth
    whole = whole_mapping(t)
    assert whole.dtype == torch.float32 and whole.numel() == 4 * math.prod(shape) and whole.data_ptr() == t.data_ptr()
    whole[-1] = 7.0  # the reserve is memory too, once written
    view = t[1, 2]
    del t, whole
    view.fill_(3.0)  # a view alone keeps the mapping alive
    assert float(view.sum()) == 3.0 * view.numel()
    assert empty_mapped((0, 4), torch.int8).numel() == 0
