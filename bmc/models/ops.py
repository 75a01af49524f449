"""Small shared kernels of the model files, written for a CPU decode step where every op costs ~10 µs of
dispatch and the GEMMs are matrix-vector-like (M = batch).

Weights are stored transposed, [in, out] contiguous: `x @ Wt` streams the fused QKV / gate-up matrices several
times faster than `F.linear(x, W)` (MKL's transposed-B path) at small M (docs/performance.md, "Figures behind the
code's choices")."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from ..kernels.block_kinds import BlockKind
    from .quant import QuantWeight
    from .quant_i8x import Int8Rows
    from .quant_torch import TorchQuantWeight


def linear(x: torch.Tensor, wt: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ wt [in, out] (+ b)."""
    if b is None:
        return torch.matmul(x, wt)
    shape = x.shape
    return torch.addmm(b, x.reshape(-1, shape[-1]), wt).view(*shape[:-1], wt.shape[1])


def mkl_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_linear"))


class Linear:
    """A weight held [in, out] (+ bias), optionally with an MKL-packed copy for one row count M.

    Packing (cblas_sgemm_pack, the path torch.compile's CPU freezing uses) re-lays the weight for a fixed M, which
    pays at M = 8 and not at M = 1 (engine.PACK_MIN_ROWS). Any other M falls back to `x @ wt`."""

    __slots__ = ("wt", "b", "packed", "packed_m", "panels", "device_q", "in_features", "out_features", "quant",
                 "int8_activations")

    def __init__(self, wt: "torch.Tensor | QuantWeight | TorchQuantWeight", b: torch.Tensor | None = None) -> None:
        from .quant import QuantWeight
        from .quant_torch import TorchQuantWeight

        self.b = b
        self.packed: torch.Tensor | None = None
        self.packed_m = 0
        self.panels: torch.Tensor | None = None  # the native step's layout, when a shared weight file holds it
        self.device_q: TorchQuantWeight | None = None  # quantized where the native step does not run (CUDA)
        self.quant: str | None = None  # a QuantWeight kind ("q8_0", "q6_k", "mixed", ...): wt None
        self.int8_activations = False  # quantized panels against int8 activation blocks (models.set_activations)
        if isinstance(wt, TorchQuantWeight):
            self.wt = None
            self.out_features, self.in_features = wt.shape
            self.device_q, self.quant = wt, wt.kind
        elif isinstance(wt, QuantWeight):
            self.wt = None
            self.out_features, self.in_features = wt.shape
            self.panels, self.quant = wt.panels(), wt.kind
        else:
            self.wt = wt
            self.in_features, self.out_features = wt.shape

    def block_kind(self) -> "BlockKind | None":
        """The block kind of quantized panels; None for float ones (32 or 16 bits) and float matrices."""
        from .quant import block_kind_of

        return block_kind_of(self.quant) if self.panels is not None and self.quant is not None else None

    def native_weight(self) -> object:
        """What the native step is given (kernels' Weight): the panels with their block kind, or wt (packed
        there)."""
        from ..kernels.block_kinds import NOT_BLOCKS
        from ..kernels.native import native_module

        if self.panels is None:
            return native_module().Weight(self.wt, NOT_BLOCKS)
        block = self.block_kind()
        return native_module().Weight(self.panels, NOT_BLOCKS if block is None else block.code)

    def dense_weight(self) -> torch.Tensor:
        """[in, out] in float: wt, or the panels laid out again (quantized ones dequantized): a copy."""
        if self.wt is not None:
            return self.wt
        if self.device_q is not None:
            return self.device_q.dense().t().contiguous()
        from ..kernels.native import native_module

        p = self.panels
        if self.block_kind() is not None:
            p = native_module().dequantize_panels(self.native_weight(), self.in_features)  # [np, K, 16]
        p = p.float()  # 16-bit float panels widened (exact)
        return p.permute(1, 0, 2).reshape(self.in_features, -1)[:, : self.out_features].contiguous()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the [out, in] matrix (a tied embedding table looked up in its LM head), float [n, in]."""
        if self.wt is not None:
            return self.wt.t()[ids]
        if self.device_q is not None:
            return self.device_q.dense(ids)
        if self.block_kind() is None:  # float panels, in 32 or 16 bits
            return self.panels[ids // 16, :, ids % 16].float()
        from ..kernels.native import native_module

        return native_module().quant_rows(self.native_weight(), self.in_features, ids)

    def columns(self, start: int, stop: int) -> "Linear":
        """Output columns [start, stop) as a Linear over the same storage (one expert of a stacked MoE matrix):
        whole panels where the weight is held as panels, so start and stop must be multiples of 16 there."""
        if self.device_q is not None:
            raise NotImplementedError("a column slice of a weight quantized for torch ops (CUDA)")
        part = Linear(self.wt[:, start:stop] if self.wt is not None else torch.empty(0, 0))
        part.b = self.b[start:stop] if self.b is not None else None
        if self.wt is None:
            assert start % 16 == 0 and stop % 16 == 0 and self.panels is not None
            part.wt, part.panels, part.quant = None, self.panels[start // 16 : stop // 16], self.quant
            part.in_features, part.out_features = self.in_features, stop - start
        part.int8_activations = self.int8_activations
        return part

    def keep_panels_only(self) -> None:
        """Pack wt into the native step's panels (where not packed yet) and drop wt: one copy of the weight in
        memory, read by the native step and, through the same GEMM, by the PyTorch path."""
        if self.wt is None or self.wt.device.type != "cpu" or self.wt.dtype != torch.float32:
            return
        if self.panels is None:
            from .quant import float_panels

            self.panels = float_panels(self.wt)
        self.wt, self.packed, self.packed_m = None, None, 0

    def pack(self, m: int) -> None:
        if self.wt is None:
            return  # quantized: the native GEMM reads the panels
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.wt.t(), m) if m > 0 else None
        self.packed_m = m

    def int8_rows(self, rows: "Int8Rows", dtype: torch.dtype) -> torch.Tensor:
        """[M, out] in dtype from rows of x already rounded to int8 blocks (activations="int8" on CUDA: the decode
        step's glue kernels round them, quant_i8x.py)."""
        assert self.device_q is not None and self.int8_activations
        return self.device_q.linear_int8(rows, self.b, dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.device_q is not None:  # torch ops: dequantized for this GEMM, or tinygemm (quant_torch.py)
            return self.device_q.linear(x, self.b, self.int8_activations)
        if self.wt is None:  # quantized panels: the native GEMM, each panel dequantized as it is read
            from ..kernels.native import native_module

            y = native_module().panel_linear(x.reshape(-1, self.in_features).float(), self.native_weight(),
                                             self.out_features, self.b, self.int8_activations)
            return y.view(*x.shape[:-1], self.out_features).to(x.dtype)
        if self.packed is not None and x.numel() == self.packed_m * x.shape[-1]:
            y = torch.ops.mkl._mkl_linear(x.reshape(self.packed_m, -1), self.packed, self.wt.t(), self.b,
                                          self.packed_m)
            return y.view(*x.shape[:-1], y.shape[-1])
        return linear(x, self.wt, self.b)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """One fused kernel; bitwise equal to HF's float32 formulation on fp32 inputs (checked in tests)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and a sign-folded sin, [B, t, 1, d], so that rope(x) = x*cos + roll(x, d/2)*sin_signed, which equals
    HF's x*cos + rotate_half(x)*sin exactly (a sign flip is exact) with one op fewer and no cat. inv_freq: [d/2], or
    [B, t, d/2] per token (longrope); scale: longrope's attention factor, multiplied in as HF does."""
    freqs = positions[..., None].float() * inv_freq  # [B, t, d/2], computed as HF computes it
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    half = sin.shape[-1] // 2
    sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos.to(dtype), sin_signed.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [B, t, heads, d] (queries and keys together)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def set_native_arithmetic(dec: object, linears: list[Linear], bf16_prompts: bool) -> None:
    """A native decoder's GEMM arithmetic (models.set_activations): int8 activations where its Linears have them,
    bfloat16 for prompt rows where the model asks for it."""
    dec.set_int8_activations(any(lin.int8_activations for lin in linears))  # type: ignore[attr-defined]
    dec.set_bf16_prompts(bf16_prompts)  # type: ignore[attr-defined]
