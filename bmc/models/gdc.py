"""Programmatic dependent launch (PDL) for the CUDA decode step's Triton kernels (issue 48; measured in
docs/performance.md, "Kernels launched ahead of their inputs").

A graphed batch-1 step runs ~10 kernels a layer, each a few µs; between two of them the GPU idles while the next
is launched and its programs placed. With PDL (NVIDIA Hopper and later, Triton 3.4 and later) a kernel is launched
while the one before it still runs: each kernel here first waits on the grid before it (`griddepcontrol.wait`:
that grid complete and its writes visible) and only then lets the next one launch, so at most one kernel runs
ahead and nothing it reads or writes can race. Kernels compute what they did; only when they start moves
(tests/test_gpu.py holds the bits). The kernels that take it: the fused decode step's (fused_triton.py: norms,
RoPE, attention, silu_mul) and the int8-x rounding and GEMV (quant_i8x.py); quant_triton.py's float GEMV and any
library's kernel (cuBLAS, NCCL) launch as before, and the overlap simply ends at them.
(Prefetching a GEMV's weights into L2 before its wait was measured, and lost: performance.md.)

MODE: "on" (default) or "off". Env BMC_CUDA_PDL sets it at import; it is read at every launch (a change needs
the graphs captured again)."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

MODES = ("off", "on")
MODE = os.environ.get("BMC_CUDA_PDL", "on")
if MODE not in MODES:
    raise ValueError(f"BMC_CUDA_PDL={MODE!r}: expected one of {', '.join(MODES)}")
# Triton's interpreter runs no inline PTX
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _triton_launches_pdl() -> bool:
    """Triton 3.4 added the launch_pdl keyword (an older one refuses it)."""
    try:
        major, minor = (int(v) for v in triton.__version__.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (3, 4)


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return (torch.version.hip is None and _triton_launches_pdl()  # PTX: NVIDIA only
            and torch.cuda.get_device_capability(index)[0] >= 9)


def enabled(device: torch.device) -> bool:
    """Whether kernels launched on `device` now take PDL (MODE "on", an NVIDIA Hopper or later GPU, a Triton
    that launches it)."""
    if MODE not in MODES:
        raise ValueError(f"gdc.MODE={MODE!r}: expected one of {', '.join(MODES)}")
    return MODE == "on" and supported(device)


def supported(device: torch.device) -> bool:
    """Whether kernels on `device` can launch ahead (whatever MODE says)."""
    if _INTERPRETED or device.type != "cuda":
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
