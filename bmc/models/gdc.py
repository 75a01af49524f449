"""Programmatic dependent launch (PDL) for the CUDA decode step's Triton kernels (issue 48; measured in
docs/performance.md, "Kernels launched ahead of their inputs").

A graphed batch-1 step runs ~10 kernels a layer, each a few µs; between two of them the GPU idles while the next
is launched and its programs placed. With PDL (Hopper and later) a kernel is launched while the one before it
still runs: each kernel here first waits on the grid before it (`griddepcontrol.wait`: that grid complete and its
writes visible) and only then lets the next one launch, so at most one kernel runs ahead and nothing it reads or
writes can race. Kernels compute what they did; only when they start moves (tests/test_gpu.py holds the bits).
(Prefetching a GEMV's weights into L2 before its wait was measured, and lost: performance.md.)

MODE: "on" (default) or "off". Env BMC_CUDA_PDL sets it at import; it is read at every launch (a change needs
the graphs captured again)."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

MODE = os.environ.get("BMC_CUDA_PDL", "on")
MODES = ("off", "on")
# Triton's interpreter runs no inline PTX
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9  # PTX: NVIDIA only


def enabled(device: torch.device) -> bool:
    """Whether kernels launched on `device` now take PDL (MODE not "off", an NVIDIA Hopper or later GPU)."""
    if MODE not in MODES:
        raise ValueError(f"BMC_CUDA_PDL={MODE!r}: expected one of {', '.join(MODES)}")
    if MODE == "off" or _INTERPRETED or device.type != "cuda":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def wait_and_release(GDC: tl.constexpr):
    """The kernel before this one complete and its writes visible; then the next one may launch (it waits on
    this one in turn). A no-op where GDC is off."""
    if GDC:
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


def launch(device: torch.device) -> tuple[bool, dict[str, bool]]:
    """(GDC, the launch's keywords) for a kernel launched on `device`: the constexpr its kernel takes, and
    launch_pdl where it is on (passed only then: Triton's interpreter takes no such keyword)."""
    on = enabled(device)
    return on, ({"launch_pdl": True} if on else {})
