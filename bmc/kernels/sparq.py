"""SparQ decode attention (steps 1-3) as one C++ call per layer on CPU float32 queries over any KV format as stored
(`bmc/kernels/cpu/sparq.cpp`), built
on first use with torch's cpp_extension (g++ and ninja; cached under ~/.cache/torch_extensions).

Why: in eager PyTorch the step is ~30 op dispatches and ~10 passes over [B, H, G, S] score tensors; measured at 8K
context (bench/sparq_speed.py) that cost as much as the dense attention it replaces. The kernel streams the r
chosen rows of the dimension-major K once, in L1-sized column blocks, parallel over rows, KV heads and blocks;
the top-k threshold by a histogram of the scores' bits, then nth_element in one bucket; step 2 reads only the k chosen rows. Same arithmetic as
sparq_select + exact attention over the chosen positions (tests compare the two); if the build fails, SparQ runs
the PyTorch path."""
from __future__ import annotations

import functools
import os
from typing import Any

from . import build

_SOURCE_FILE = os.path.join(os.path.dirname(__file__), "cpu", "sparq.cpp")


@functools.lru_cache(maxsize=None)
def fused_decode() -> Any:
    """The compiled `sparq_decode`, or None (BMC_SPARQ_KERNEL=0, or the build failed: logged once)."""
    mod = build("bmc_sparq", _SOURCE_FILE, None, "BMC_SPARQ_KERNEL")
    return None if mod is None else mod.sparq_decode
