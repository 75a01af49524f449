"""Transparent huge pages for what a decode step streams (weight panels, the KV cache): Linux's THP in "madvise"
mode (the common default) backs a region with 2 MiB pages only where asked, before its first touch. Elsewhere (no
THP, not Linux, not glibc) every function here is plain torch.empty."""
from __future__ import annotations

import ctypes
import functools
import mmap

import numpy as np
import torch


class HugePageArena:
    """Weight panels carved out of chunks whose aligned interior is asked to be backed by 2 MiB pages (madvise
    before the first touch; Linux with transparent huge pages in "madvise" mode, elsewhere a no-op). Why: the
    decode step streams every panel once a step, and most matrices of a small model are under 2 MiB each, so
    allocated one by one they sit on 4 KiB pages. Measured (2-core EPYC, 2 threads, batch 1, int8 activations): a
    200-300 MB matrix streamed at 27-42 GB/s on 4 KiB pages and at 33-63 GB/s on 2 MiB pages in the same runs.
    A chunk lives while any panel in it does; its untouched tail costs no memory."""

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
