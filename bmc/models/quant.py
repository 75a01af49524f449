"""Quantized weights: GGUF's blocks of 32 kept as stored (quant="gguf") or made at load (quant="q8_0" / "q4_0",
as llama.cpp's reference quantizers make them), re-laid into the native step's 16-column panels.

A weight is read in panels of 16 output columns; each block of 32 input rows of a panel holds its 16 columns'
scales and quants (the block kinds and their layouts: kernels/block_kinds.py, one table read by C++ too). The
kernel dequantizes a panel into a thread's buffer and runs the float32 GEMM kernels on it, so a quantized model
computes with exactly the float32 weights `gguf` dequantizes: quant="gguf" gives quant="none"'s logits on the
native step, bit for bit, reading 4.3x (Q8_0) or 6.4-7.1x (Q4_1, Q4_0) fewer weight bytes.

Modes: "none" dequantizes every tensor to the model's dtype; "stored" keeps the matrices as the checkpoint stores
them: an HF checkpoint's bfloat16 / float16 matrices as 16-bit float panels (stored_matrices), a GGUF file's as
"gguf" does. "gguf" keeps the F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K matrices of a GGUF file as stored (GGUF_TYPES: 16-bit floats as float panels in 16 bits, widened as
they are read; K-quants per sub-block), and Q5_0 ones as the Q8_0 blocks of the same values (q5_0_as_q8_0; other
types, e.g. Q3_K, are dequantized to float32); "q8_0" and "q4_0" quantize the float matrices of any checkpoint at
load; "auto" is "stored" where the native step runs (CPU, float32) and "none" otherwise. Kept 16-bit matrices
compute with their float32 values, bit for bit "none"'s GEMM, from half the bytes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..choices import QUANT_MODES  # noqa: F401 (one list: the CLIs offer it without torch)
from ..errors import InvalidRequestError
from ..kernels.block_kinds import BLOCK_KIND, PANEL, QK, BlockKind
from ..platform.hugepages import HugePageArena

Q5_0_BLOCK = 22  # fp16 scale, 32 high bits, 16 bytes of low nibbles
# Rows re-laid into panels at a time: the default model's 49152-row LM head in one go held ~90 MB of temporaries
PANEL_ROWS = 2048


@dataclass(frozen=True)
class GgufType:
    """How bmc keeps one GGUF tensor type on the native step: its blocks (bytes, values; K-quants in super-blocks of
    256, a 16-bit float a "block" of one) and the panels it is laid out in: a block kind (kernels/block_kinds.py),
    or, for 16-bit floats, the float panels' layout [ceil(N/16), K, 16] in that dtype, widened as the GEMM loads
    each weight (exact: quant="none"'s float32 GEMM bit for bit)."""

    block_bytes: int
    block_values: int
    panel: str | None = None  # a BLOCK_KIND name
    half: torch.dtype | None = None


GGUF_TYPES: dict[str, GgufType] = {
    "q8_0": GgufType(34, 32, panel="q8"),
    "q4_0": GgufType(18, 32, panel="q4z"),
    "q4_1": GgufType(20, 32, panel="q4h"),
    "q4_k": GgufType(144, 256, panel="q4"),
    "q5_k": GgufType(176, 256, panel="q8x"),
    "q6_k": GgufType(210, 256, panel="q8x"),
    "f16": GgufType(2, 1, half=torch.float16),
    "bf16": GgufType(2, 1, half=torch.bfloat16),
}
MIXED_PANEL = "q8x"  # "mixed": a fused matrix (q|k|v, gate|up) whose parts are of different types: any fits q8x


def is_half(kind: str) -> bool:
    """A 16-bit float type (kept as float panels of that dtype)."""
    return kind in GGUF_TYPES and GGUF_TYPES[kind].half is not None


def block_kind_of(kind: str) -> BlockKind | None:
    """The panel kind a QuantWeight kind ("q8_0", ..., "mixed") is laid out in; None for 16-bit floats."""
    if kind == "mixed":
        return BLOCK_KIND[MIXED_PANEL]
    panel = GGUF_TYPES[kind].panel
    return None if panel is None else BLOCK_KIND[panel]


def q5_0_as_q8_0(blocks: np.ndarray) -> np.ndarray:
    """GGUF Q5_0 blocks [N, K/32 * 22] as Q8_0 blocks [N, K/32 * 34] of the same values: a Q5_0 value is
    d * (q - 16) with q in [0, 31], so q - 16 is an int8 under the same fp16 scale, bit for bit. The native kernels
    read Q8_0; the price is 34 bytes a block instead of 22 (still 3.8x fewer than float32)."""
    N = blocks.shape[0]
    b = blocks.reshape(N, -1, Q5_0_BLOCK)
    out = np.empty((N, b.shape[1], GGUF_TYPES["q8_0"].block_bytes), dtype=np.uint8)
    step = max(1, (1 << 16) // b.shape[1])  # rows at a time: the temporaries (8 bytes a value) stay a few MB
    for r0 in range(0, N, step):
        rows = b[r0 : r0 + step]
        qh = np.ascontiguousarray(rows[..., 2:6]).view("<u4")  # [n, blocks, 1]: bit j is value j's fifth bit
        qs = rows[..., 6:]
        low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # values 0-15 in the low nibbles, 16-31 in the high
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
        out[r0 : r0 + step, :, :2] = rows[..., :2]
        out[r0 : r0 + step, :, 2:] = ((low | high).astype(np.int16) - 16).astype(np.int8).view(np.uint8)
    return out.reshape(N, -1)


@dataclass
class Values32:
    """A matrix's values in blocks of 32 along K, as every kind here decodes: w = d0 * q + m for a block's rows
    0-15 and d1 * q + m for rows 16-31, with d * q exact in float32 (so one rounding, as `gguf`'s own)."""

    d0: np.ndarray  # float32 [N, K/32]
    d1: np.ndarray  # float32 [N, K/32] (d0 except for Q6_K's 16-value sub-blocks)
    m: np.ndarray  # float32 [N, K/32]
    q: np.ndarray | None  # int8 [N, K/32, 32], in row order; or None where `nibbles` holds them
    nibbles: np.ndarray | None = None  # uint8 [N, K/32, 16]: byte j = value j (low) and j + 16 (high), GGUF's order

    def quants(self) -> np.ndarray:
        if self.q is not None:
            return self.q
        return np.concatenate([self.nibbles & 15, self.nibbles >> 4], axis=-1).astype(np.int8)

    def packed(self) -> np.ndarray:
        """The quants as Q4 panels store them: `nibbles` (values 0-15 only)."""
        if self.nibbles is not None:
            return self.nibbles
        q = self.q.view(np.uint8)
        return q[..., : QK // 2] | (q[..., QK // 2 :] << 4)


def _fp16(b: np.ndarray) -> np.ndarray:  # [..., 2] bytes -> float32 [...]
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def decode(kind: str, blocks: np.ndarray, N: int, K: int) -> Values32:
    """GGUF blocks [N, K / values * bytes] as Values32, following `gguf.quants`' dequantizers term by term."""
    import gguf

    nblk = K // QK
    if kind in ("q8_0", "q4_0", "q4_1"):
        b = blocks.reshape(N, nblk, GGUF_TYPES[kind].block_bytes)
        d = _fp16(b[..., 0:2])
        if kind == "q8_0":
            return Values32(d, d, np.zeros_like(d), b[..., 2:].view(np.int8))
        if kind == "q4_0":  # w = d * (q - 8) = d * q + (-8 d), exact in float32
            return Values32(d, d, -8.0 * d, None, b[..., 2:])
        return Values32(d, d, _fp16(b[..., 2:4]), None, b[..., 4:])
    ns = K // 256
    b = blocks.reshape(N * ns, GGUF_TYPES[kind].block_bytes)
    if kind in ("q4_k", "q5_k"):  # eight 32-value sub-blocks: w = (d * sc_j) * q - dmin * m_j
        d, dmin = _fp16(b[:, 0:2]), _fp16(b[:, 2:4])
        sc, mn = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
        scale = (d[:, None] * sc.reshape(-1, 8).astype(np.float32)).reshape(N, nblk)
        offset = -(dmin[:, None] * mn.reshape(-1, 8).astype(np.float32)).reshape(N, nblk)
        if kind == "q4_k":  # group g of 32 bytes: low nibbles = sub-block 2g, high = 2g + 1
            qs = b[:, 16:].reshape(-1, 4, 1, 32)
            q = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
        else:  # the same nibbles (from byte 48) plus a fifth bit from the 32 bytes of qh
            low = (b[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
            high = (b[:, 16:48].reshape(-1, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
            q = low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << 4)
        return Values32(scale, scale, offset, q.astype(np.int8).reshape(N, nblk, QK))
    if kind == "q6_k":  # sixteen 16-value sub-blocks: w = (d * sc_j) * (q - 32), q - 32 an int8
        sc = b[:, 192:208].view(np.int8).astype(np.float32)
        scale = (_fp16(b[:, 208:210])[:, None] * sc).reshape(N, nblk, 2)  # a block of 32: two sub-blocks
        low = (b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
        high = (b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        q = (low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << 4)).astype(np.int8) - np.int8(32)
        return Values32(scale[..., 0], scale[..., 1], np.zeros((N, nblk), np.float32), q.reshape(N, nblk, QK))
    raise InvalidRequestError(f"no panel format for {kind!r} blocks")


def _by_panel(x: np.ndarray) -> np.ndarray:
    """[N, nblk, ...] -> [np, nblk, 16 columns, ...], the rows past N zero."""
    N = x.shape[0]
    npanels = (N + PANEL - 1) // PANEL
    pad = np.zeros((npanels * PANEL, *x.shape[1:]), dtype=x.dtype)
    pad[:N] = x
    return pad.reshape(npanels, PANEL, *x.shape[1:]).swapaxes(1, 2)


def panels_of(v: Values32, kind: BlockKind) -> torch.Tensor:
    """Values32 in the panels of block kind `kind`: each block's vectors (float32, or fp16), then its quants, per
    16 columns. A kind without d_hi needs d0 == d1, without m needs m == 0, with nibbles q in 0-15, with fp16
    vectors d0 and m exact in fp16 (the types GGUF_TYPES lays out there)."""
    N, nblk = v.d0.shape
    npanels = (N + PANEL - 1) // PANEL
    vectors = [{"d": v.d0, "d_hi": v.d1, "m": v.m}[name] for name in kind.vectors]
    q = v.packed() if kind.nibbles else v.quants().view(np.uint8)
    size = kind.scale_bytes
    vtype = np.float16 if size == 2 else np.float32
    out = np.empty((npanels, nblk, kind.block_bytes), dtype=np.uint8)
    for i, x in enumerate(vectors):
        with np.errstate(over="ignore"):  # an overflow is caught just below
            narrow = x.astype(vtype)
        if size == 2 and not np.array_equal(narrow.astype(np.float32), x):  # never from GGUF's own fp16 scales
            raise InvalidRequestError("a block's scale does not fit bmc's fp16 panel scales: load this file with "
                                      "quant='none'")
        out[..., size * PANEL * i : size * PANEL * (i + 1)] = np.ascontiguousarray(_by_panel(narrow)).view(
            np.uint8).reshape(npanels, nblk, -1)
    out[..., kind.quants_at :] = _by_panel(q).swapaxes(2, 3).reshape(npanels, nblk, -1)  # [rows, 16 c]
    return torch.from_numpy(out).view(kind.storage)


@dataclass
class QuantWeight:
    """An [out N, in K] matrix in GGUF blocks along K: blocks [N, K/32 * block bytes] uint8 (None: shape only, for
    a model whose panels a weight file supplies); kind "mixed": `parts` of different kinds stacked along N."""

    kind: str  # a key of GGUF_TYPES, or "mixed"
    shape: tuple[int, int]
    blocks: np.ndarray | None
    parts: list["QuantWeight"] | None = None
    # given a slice of the blocks once it has been copied out (made panels, or concatenated): a GGUF file's mapped
    # pages dropped as they are used, so a load's resident memory holds the panels, not the file too
    release: Callable[[np.ndarray], None] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        N, K = self.shape
        if self.kind == "mixed":
            assert self.parts and sum(p.shape[0] for p in self.parts) == N and {p.shape[1] for p in self.parts} == {K}
            return
        per = GGUF_TYPES[self.kind].block_values
        if K % per:
            raise InvalidRequestError(f"a {self.kind} matrix needs rows of whole blocks of {per}, got {K} columns")
        if self.blocks is not None and self.blocks.shape != (N, K // per * GGUF_TYPES[self.kind].block_bytes):
            raise ValueError(f"{self.kind} blocks {self.blocks.shape} do not match the shape {self.shape}")

    @staticmethod
    def can_cat(parts: list["QuantWeight"]) -> bool:
        """Whether cat can stack them as they are stored: one kind, or block types (whose values all fit q8x panels);
        16-bit floats beside other types cannot (the caller fuses their float32 values instead)."""
        kinds = {p.kind for p in parts}
        return len(kinds) == 1 or not any(is_half(k) for k in kinds)

    @staticmethod
    def cat(parts: list["QuantWeight"]) -> "QuantWeight":
        """Matrices stacked along the output axis (fused q|k|v, gate|up): one kind's blocks concatenated, or parts
        of different kinds held as "mixed" (panels in q8x, which every kind's values fit exactly)."""
        assert len({p.shape[1] for p in parts}) == 1, "QuantWeight.cat: one width"
        n, k = sum(p.shape[0] for p in parts), parts[0].shape[1]
        if len({p.kind for p in parts}) > 1 or parts[0].kind == "mixed":
            flat = [q for p in parts for q in (p.parts if p.kind == "mixed" else [p])]  # type: ignore[union-attr]
            return QuantWeight("mixed", (n, k), None, flat)
        blocks = None if any(p.blocks is None for p in parts) else np.concatenate([p.blocks for p in parts])
        for p in parts:
            p.done()
        return QuantWeight(parts[0].kind, (n, k), blocks)

    def done(self, r0: int = 0, r1: int | None = None) -> None:
        """Rows [r0, r1) of the blocks are no longer read (a "mixed" matrix: all of every part)."""
        for p in self.parts or [self]:
            if p.release is not None and p.blocks is not None:
                p.release(p.blocks if self.parts else p.blocks[r0:r1])

    def has_values(self) -> bool:
        return all(p.blocks is not None for p in self.parts) if self.parts else self.blocks is not None

    def half_rows(self, r0: int = 0, r1: int | None = None) -> torch.Tensor:
        """Rows [r0, r1) of a 16-bit float matrix (is_half) as a tensor of that dtype (a copy)."""
        assert is_half(self.kind) and self.blocks is not None
        return torch.from_numpy(self.blocks[r0:r1].copy().view(np.int16)).view(GGUF_TYPES[self.kind].half)

    def decode(self, r0: int = 0, r1: int | None = None) -> Values32:
        """Rows [r0, r1) as Values32 (block types only)."""
        assert self.has_values() and not is_half(self.kind)
        N, K = self.shape
        r1 = N if r1 is None else r1
        if not self.parts:
            return decode(self.kind, self.blocks[r0:r1], r1 - r0, K)
        vs, off = [], 0
        for p in self.parts:
            lo, hi = max(r0, off), min(r1, off + p.shape[0])
            if lo < hi:
                vs.append(p.decode(lo - off, hi - off))
            off += p.shape[0]
        return Values32(np.concatenate([v.d0 for v in vs]), np.concatenate([v.d1 for v in vs]),
                        np.concatenate([v.m for v in vs]), np.concatenate([v.quants() for v in vs]))

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], as the `gguf` package dequantizes it."""
        import gguf

        assert self.has_values()
        if self.parts:
            return torch.cat([p.dequantize() for p in self.parts])
        if is_half(self.kind):
            return self.half_rows().float()
        qtype = getattr(gguf.GGMLQuantizationType, self.kind.upper())
        return torch.from_numpy(np.require(gguf.quants.dequantize(self.blocks, qtype), np.float32, ["C", "W"])
                                ).view(self.shape)

    def panel_shape(self) -> tuple[int, int, int]:
        N, K = self.shape
        block = block_kind_of(self.kind)
        if block is None:
            return (N + PANEL - 1) // PANEL, K, PANEL
        return (N + PANEL - 1) // PANEL, K // QK, block.block_bytes

    def panel_dtype(self) -> torch.dtype:
        block = block_kind_of(self.kind)
        return GGUF_TYPES[self.kind].half if block is None else block.storage

    def panels(self) -> torch.Tensor:
        """The native step's layout: the panels of block_kind_of(kind) [np, K/32, block bytes] (int8, or uint8 for
        4-bit quants); for 16-bit floats [np, K, 16] in float16 / bfloat16; uninitialised when only the shape is
        known."""
        if not self.has_values():
            return torch.empty(self.panel_shape(), dtype=self.panel_dtype())
        out = PANEL_ARENA.empty(self.panel_shape(), self.panel_dtype())
        N = self.shape[0]
        for r0 in range(0, N, PANEL_ROWS):  # a slice of rows at a time: the temporaries stay a few MB
            r1 = min(N, r0 + PANEL_ROWS)
            block = block_kind_of(self.kind)
            if block is None:
                out[r0 // PANEL : (r1 + PANEL - 1) // PANEL] = _half_panels(self.half_rows(r0, r1))
            else:
                out[r0 // PANEL : (r1 + PANEL - 1) // PANEL] = panels_of(self.decode(r0, r1), block)
            if not self.parts:
                self.done(r0, r1)
        if self.parts:
            self.done()
        return out


PANEL_ARENA = HugePageArena()  # every weight panel a load makes


def float_panels(wt: torch.Tensor) -> torch.Tensor:
    """A float32 [in K, out N] matrix in the native step's panels [ceil(N/16), K, 16] (the kernel's pack_panels
    layout, the columns past N zero), on the panel arena's huge pages."""
    K, N = wt.shape
    whole = N // PANEL
    out = PANEL_ARENA.empty(((N + PANEL - 1) // PANEL, K, PANEL), torch.float32)
    out[:whole].copy_(wt[:, : whole * PANEL].reshape(K, whole, PANEL).transpose(0, 1))
    if whole * PANEL < N:
        out[whole].zero_()
        out[whole, :, : N - whole * PANEL].copy_(wt[:, whole * PANEL :])
    return out


def _half_panels(w: torch.Tensor) -> torch.Tensor:
    """[n, K] -> [ceil(n/16), K, 16] (pack_panels' layout, in w's dtype), the rows past n zero."""
    n, K = w.shape
    rows = (n + PANEL - 1) // PANEL * PANEL
    pad = torch.zeros((rows, K), dtype=w.dtype)
    pad[:n] = w
    return pad.view(rows // PANEL, PANEL, K).transpose(1, 2)


def quantize(w: torch.Tensor, kind: str) -> QuantWeight:
    """An [N, K] float matrix in `kind` ("q8_0" or "q4_0") blocks, as llama.cpp's reference quantizers make them
    (quantize_row_q8_0_ref / quantize_row_q4_0_ref: the scale rounded to fp16 for storage, the quants computed
    with the float32 scale)."""
    N, K = w.shape
    if K % QK:
        raise InvalidRequestError(f"quant={kind!r} needs matrices whose rows are whole blocks of {QK}; one has {K}")
    x = w.detach().to("cpu", torch.float32).reshape(N, K // QK, QK)  # quantized on the CPU, wherever w is
    if kind == "q8_0":
        d = x.abs().amax(-1) / 127.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        v = x * inv[..., None]
        tie = (v - torch.trunc(v)).abs() == 0.5  # C's roundf takes halves away from zero, torch.round to even
        q = torch.where(tie, torch.trunc(v) + torch.sign(v), torch.round(v)).to(torch.int8)
        body = q.numpy().view(np.uint8)
    elif kind == "q4_0":
        idx = x.abs().argmax(-1, keepdim=True)
        mx = x.gather(-1, idx)[..., 0]  # the value of largest magnitude, with its sign
        d = mx / -8.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = torch.clamp(torch.trunc(x * inv[..., None] + 8.5), max=15).to(torch.uint8).numpy()
        body = q[..., : QK // 2] | (q[..., QK // 2 :] << 4)
    else:
        raise InvalidRequestError(f"unknown quantization {kind!r}; quantize makes q8_0 or q4_0")
    d16 = d.numpy().astype(np.float16).view(np.uint8).reshape(N, K // QK, 2)
    blocks = np.concatenate([d16, body.reshape(N, K // QK, -1)], axis=-1).reshape(N, -1)
    return QuantWeight(kind, (N, K), np.ascontiguousarray(blocks))


HALF_KIND_OF = {t.half: kind for kind, t in GGUF_TYPES.items() if t.half is not None}


def stored_matrices(tensors: dict[str, torch.Tensor]) -> dict:
    """An HF state dict with its bfloat16 / float16 matrices (2-D) as QuantWeights of that kind, the bytes shared:
    the loaders keep them as 16-bit panels (a tied embedding is looked up in them; any other tensor is read
    widened)."""
    out: dict = {}
    for name, t in tensors.items():
        kind = HALF_KIND_OF.get(t.dtype) if isinstance(t, torch.Tensor) and t.dim() == 2 else None
        if kind is None:
            out[name] = t
        else:
            raw = t.contiguous().view(torch.int16).numpy().view(np.uint8)  # [N, 2K]: the values' bytes
            out[name] = QuantWeight(kind, (t.shape[0], t.shape[1]), raw)
    return out


def check_mode(quant: str) -> str:
    if quant not in QUANT_MODES:
        raise InvalidRequestError(f"unknown quant {quant!r}; choose from {', '.join(QUANT_MODES)}")
    return quant
