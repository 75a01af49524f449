"""Memory for what a decode step streams. Weight panels: transparent huge pages (Linux's THP in "madvise" mode, the
common default, backs a region with 2 MiB pages only where asked, before its first touch). The KV cache: mappings of
its own with address space to grow into (empty_mapped), on 4 KiB pages. Elsewhere (no THP, not Linux, not glibc)
these are plain torch.empty / torch.zeros."""
from __future__ import annotations

import ctypes
import functools
import math
import mmap
import sys

import numpy as np
import torch


class HugePageArena:
    """Weight panels carved out of chunks whose aligned interior is asked to be backed by 2 MiB pages (madvise
    before the first touch; Linux with transparent huge pages in "madvise" mode, elsewhere a no-op). Why: the
    decode step streams every panel once a step, and most matrices of a small model are under 2 MiB each, so
    allocated one by one they sit on 4 KiB pages, where a stream misses the TLB every 4 KiB (measured: docs/
    performance.md, "Figures behind the code's choices"). A chunk lives while any panel in it does; its untouched tail costs no memory."""

    CHUNK = 64 << 20

    def __init__(self) -> None:
        self.chunk: torch.Tensor | None = None
        self.used = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
        nbytes_aligned = (nbytes + 63) // 64 * 64
        if self.chunk is None or self.used + nbytes_aligned > self.chunk.numel():
            self.chunk, self.used = empty_huge((max(self.CHUNK, nbytes_aligned),), torch.uint8), 0
        out = self.chunk[self.used : self.used + nbytes].view(dtype).view(shape)
        self.used += nbytes_aligned
        return out

    def drop(self) -> None:
        """Forget the chunk being filled: it lives on only while panels carved from it do (a model whose panels
        were replaced by a weight file's mapping frees it); the next panel starts a new one."""
        self.chunk, self.used = None, 0


def empty_mapped(shape: tuple[int, ...], dtype: torch.dtype, reserve: int = 0) -> torch.Tensor:
    """A zero-filled CPU tensor on an anonymous mapping of its own, unmapped when the last view of it dies.
    `reserve`: elements of address space to map in all (at least the tensor's), so that the mapping can later hold
    a larger tensor (`whole_mapping`); a page costs memory only once written. For the KV cache: a decode cache's
    tensor is a view whose slabs have room for the run's maximum length, widened in place at each growth, and the
    copies that remain (reorder, regroup) land in the mapping the last one left (kv/base.py, _new_kv and
    _replace_kv), so that each page is faulted in once a run. On 4 KiB pages, not THP: in "madvise" mode a fault
    on an advised region compacts memory for its 2 MiB page, which made growths slower, not faster (measured:
    docs/performance.md, "Figures behind the code's choices"). Without anonymous mmap it is torch.zeros."""
    numel, element = math.prod(shape), dtype.itemsize
    nbytes = max(numel, reserve) * element
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if nbytes == 0 or not flags:
        return torch.zeros(shape, dtype=dtype)
    try:  # address space beyond what is written is not committed memory (Linux's MAP_NORESERVE)
        region = mmap.mmap(-1, nbytes, flags=flags | (_MAP_NORESERVE if sys.platform == "linux" else 0))
    except OSError:  # strict overcommit refusing the reservation: the tensor's own size
        if nbytes == numel * element:
            raise
        region = mmap.mmap(-1, numel * element, flags=flags)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds `region` alive: unmapped with the last view
    return whole.view(dtype)[:numel].view(shape)


def whole_mapping(t: torch.Tensor) -> torch.Tensor:
    """All of the storage a tensor views (e.g. the whole reserve of empty_mapped), as a flat tensor of its dtype."""
    return t.new_empty(0).set_(t.untyped_storage())


_MAP_NORESERVE = 0x4000  # Linux's value on every architecture; Python's mmap module does not name it


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty on the CPU whose 2 MiB-aligned interior is advised onto huge pages before its first touch."""
    out = torch.empty(shape, dtype=dtype)
    nbytes = out.numel() * out.element_size()
    advice, libc = getattr(mmap, "MADV_HUGEPAGE", None), _libc()
    huge = 2 << 20
    begin, end = (out.data_ptr() + huge - 1) & ~(huge - 1), (out.data_ptr() + nbytes) & ~(huge - 1)
    if advice is not None and libc is not None and end > begin:
        libc.madvise(ctypes.c_void_p(begin), ctypes.c_size_t(end - begin), advice)
    return out


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None
