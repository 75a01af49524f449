"""The native CPU step (`cpu_decode.cpp`): every layer of a Llama or OPT decoder in one C++ call for steps of up
to NATIVE_MAX_T new tokens per row (decode, speculative verify, prompt chunks), and several batches in one step
(`forward_parts`: the scheduler's decode rows with a prompt chunk, each weight read once for both).

Why: in eager PyTorch a batch-1 decode step spends a large share of its time in ~450 op dispatches on top of its
GEMMs, and MKL's small-M sgemm reads the weights well below the memory's bandwidth (figures: docs/performance.md,
"Figures behind the code's choices"). The native step packs each weight once into 16-column panels read as contiguous streams, keeps up
to 8 rows in registers, and never returns to Python between layers.

It computes what the eager path computes (the same attention over the cache's whole capacity with the additive
bias, the same KV writes at the cache's `length`), in a different summation order: logits agree within float32
rounding (tests compare both paths and HF). `BMC_NATIVE=0` switches it off."""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from . import build


# New tokens per row a native step takes; longer prompt chunks run eagerly. The native step runs prefill too: its
# blocked GEMM beat MKL's eager path up to 1024 tokens, and lost at 2048, where the native attention reads the whole
# masked square and SDPA's causal kernel half of it (figures: docs/performance.md, "Figures behind the code's choices").
NATIVE_MAX_T = 1024
_SOURCE_FILE = os.path.join(os.path.dirname(__file__), "cpu_decode.cpp")  # includes the wing's headers (cpu/)


def native_module() -> Any:
    return build("bmc_cpu_decode", _SOURCE_FILE, None, "BMC_NATIVE")


def native_enabled() -> bool:
    """Read per step, so a process (or a test) can switch between the native and the eager path."""
    return os.environ.get("BMC_NATIVE", "1") != "0"


def native_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether native steps can run for a model on this device and dtype (builds the kernel on first call)."""
    return device.type == "cpu" and dtype == torch.float32 and native_enabled() and native_module() is not None


_argmax_rows: Any = None  # the native kernel's argmax_rows once looked up; False where unavailable


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1): by the native kernel for float32 logits on the CPU (the same index: the first maximum,
    or the first NaN), else by torch, whose CPU argmax over a 49k vocabulary cost a visible share of a decode
    step (docs/performance.md, "Figures behind the code's choices")."""
    global _argmax_rows
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.numel() > 0 and native_enabled():
        if _argmax_rows is None:
            mod = native_module()
            _argmax_rows = mod.argmax_rows if mod is not None else False
        if _argmax_rows:
            return _argmax_rows(logits)
    return logits.argmax(dim=-1)


class NativeDecoders:
    """A model's native decoders, built lazily once per list of layers: a truncated or quantized shallow copy of
    the model shares this object but has its own layer list, so it gets its own decoder (or None) instead of
    clobbering the target's while the two alternate in speculative decoding."""

    def __init__(self) -> None:
        self._built: dict[int, tuple[list, Any]] = {}  # id(layers) -> (layers, decoder); the list pins the id

    def clear(self) -> None:
        """Forget the decoders built: the next get() builds them anew (a setting they bake in changed)."""
        self._built.clear()

    def get(self, layers: list, make: Callable[[], Any]) -> Any:
        if not native_enabled():
            return None
        entry = self._built.get(id(layers))
        if entry is None or entry[0] is not layers:
            entry = self._built[id(layers)] = (layers, with_env_settings(make()))
        return entry[1]


def int8_kv_dots_enabled() -> bool:
    """Whether an int8 KV cache is attended in integers (VNNI dot products on the stored bytes, kernels/cpu/attention.h's
    attend_i8: a bound ~2^-16 of what it rounds, beside int8 rows' 2^-8), where the CPU can; `BMC_INT8_KV_DOTS=0`
    widens the rows to float32 first instead (the A/B of the two)."""
    return os.environ.get("BMC_INT8_KV_DOTS", "1") != "0"


def with_env_settings(dec: Any) -> Any:
    """A freshly built decoder or attention kernel with the process's settings applied (None passes through)."""
    if dec is not None and not int8_kv_dots_enabled():
        dec.set_int8_kv_dots(False)
    return dec


def native_attention(heads: int, kv_heads: int, head_dim: int) -> Any:
    """The native step's attention alone (cpu/attention.h): `attention_step(q, kv, layer, bias, seg_kv, seg_bias,
    seg_group, prompt=False)` runs the kernel a decode or verify step (prompt=True: a prompt chunk) runs, without a
    decoder (bmc-calibrate, the benchmarks and the tests call it); None when the native kernel is unavailable."""
    mod = native_module()
    if mod is None:
        return None
    return with_env_settings(mod.Attention(heads, kv_heads, head_dim, head_dim**-0.5))


def or_empty(t: torch.Tensor | None) -> torch.Tensor:
    """An optional tensor for the C++ side, where an empty tensor means absent."""
    return torch.empty(0) if t is None else t
