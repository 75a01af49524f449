"""Quantized weights: GGUF's blocks of 32 kept as stored (quant="gguf") or made at load (quant="q8_0" / "q4_0",
as llama.cpp's reference quantizers make them), re-laid into the native step's 16-column panels.

A weight is read in panels of 16 output columns; each block of 32 input rows of a panel holds its 16 columns'
scales and quants (the layout is described in kernels/cpu_decode.cpp). The kernel dequantizes a panel into a
thread's buffer and runs the float32 GEMM kernels on it, so a quantized model computes with exactly the float32
weights `gguf` dequantizes: quant="gguf" gives quant="none"'s logits on the native step, bit for bit, reading
4.3x (Q8_0) or 6.4-7.1x (Q4_1, Q4_0) fewer weight bytes.

Modes: "none" dequantizes every tensor to the model's dtype; "gguf" keeps the Q8_0, Q4_0, Q4_1 and Q4_K matrices
of a GGUF file as stored, and Q5_0 ones as the Q8_0 blocks of the same values (q5_0_as_q8_0; other types, e.g.
F16, Q5_K or Q6_K, are dequantized to float32); "q8_0" and "q4_0" quantize
the float matrices of any checkpoint at load; "auto" is "gguf" for a GGUF file where the native step runs (CPU,
float32) and "none" otherwise."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidRequestError

QK = 32  # values per block of the panels
QUANT_MODES = ("auto", "none", "gguf", "q8_0", "q4_0")
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q4_k": 144}  # GGUF's block sizes
BLOCK_VALUES = {"q8_0": 32, "q4_0": 32, "q4_1": 32, "q4_k": 256}  # values per GGUF block (Q4_K: a super-block)
PANEL = 16
Q5_0_BLOCK = 22  # fp16 scale, 32 high bits, 16 bytes of low nibbles


def q5_0_as_q8_0(blocks: np.ndarray) -> np.ndarray:
    """GGUF Q5_0 blocks [N, K/32 * 22] as Q8_0 blocks [N, K/32 * 34] of the same values: a Q5_0 value is
    d * (q - 16) with q in [0, 31], so q - 16 is an int8 under the same fp16 scale, bit for bit. The native kernels
    read Q8_0; the price is 34 bytes a block instead of 22 (still 3.8x fewer than float32)."""
    N = blocks.shape[0]
    b = blocks.reshape(N, -1, Q5_0_BLOCK)
    qh = np.ascontiguousarray(b[..., 2:6]).view("<u4")  # [N, blocks, 1]: bit j is value j's fifth bit
    qs = b[..., 6:]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # values 0-15 in the low nibbles, 16-31 in the high
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    out = np.empty((N, b.shape[1], BLOCK_BYTES["q8_0"]), dtype=np.uint8)
    out[..., :2] = b[..., :2]
    out[..., 2:] = ((low | high).astype(np.int16) - 16).astype(np.int8).view(np.uint8)
    return out.reshape(N, -1)


@dataclass
class QuantWeight:
    """An [out N, in K] matrix in GGUF blocks along K: blocks [N, K/32 * block bytes] uint8 (None: shape only, for
    a model whose panels a weight file supplies)."""

    kind: str  # "q8_0", "q4_0" or "q4_1"
    shape: tuple[int, int]
    blocks: np.ndarray | None

    def __post_init__(self) -> None:
        N, K = self.shape
        per = BLOCK_VALUES[self.kind]
        if K % per:
            raise InvalidRequestError(f"a {self.kind} matrix needs rows of whole blocks of {per}, got {K} columns")
        if self.blocks is not None and self.blocks.shape != (N, K // per * BLOCK_BYTES[self.kind]):
            raise ValueError(f"{self.kind} blocks {self.blocks.shape} do not match the shape {self.shape}")

    @staticmethod
    def cat(parts: list["QuantWeight"]) -> "QuantWeight":
        """Matrices of one kind stacked along the output axis (fused q|k|v, gate|up)."""
        kinds, ks = {p.kind for p in parts}, {p.shape[1] for p in parts}
        assert len(kinds) == 1 and len(ks) == 1, "QuantWeight.cat: one kind and width"
        n = sum(p.shape[0] for p in parts)
        blocks = None if any(p.blocks is None for p in parts) else np.concatenate([p.blocks for p in parts])
        return QuantWeight(parts[0].kind, (n, parts[0].shape[1]), blocks)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], as the `gguf` package dequantizes it."""
        import gguf

        assert self.blocks is not None
        qtype = getattr(gguf.GGMLQuantizationType, self.kind.upper())
        return torch.from_numpy(np.require(gguf.quants.dequantize(self.blocks, qtype), np.float32, ["C", "W"])
                                ).view(self.shape)

    def panel_shape(self) -> tuple[int, int, int]:
        N, K = self.shape
        per_block = 4 * PANEL + QK * PANEL if self.kind == "q8_0" else 8 * PANEL + QK * PANEL // 2
        return (N + PANEL - 1) // PANEL, K // QK, per_block

    def panel_dtype(self) -> torch.dtype:
        return torch.int8 if self.kind == "q8_0" else torch.uint8

    def panels(self) -> torch.Tensor:
        """The native step's layout: int8 [np, K/32, 576] (Q8) or uint8 [np, K/32, 384] (Q4, Q4_0 with m = -8 d);
        uninitialised when only the shape is known."""
        shape, dtype = self.panel_shape(), self.panel_dtype()
        if self.blocks is None:
            return torch.empty(shape, dtype=dtype)
        N, K = self.shape
        npanels, nblk, _ = shape
        if self.kind == "q4_k":
            return q4k_panels(self.blocks, N, K)
        b = np.zeros((npanels * PANEL, nblk, BLOCK_BYTES[self.kind]), dtype=np.uint8)
        b[:N] = self.blocks.reshape(N, nblk, -1)
        b = b.reshape(npanels, PANEL, nblk, -1).transpose(0, 2, 1, 3)  # [np, nblk, 16 columns, block bytes]
        d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)  # [np, nblk, 16]
        out = np.empty(shape, dtype=np.uint8)
        out[..., : 4 * PANEL] = d.view(np.uint8).reshape(npanels, nblk, -1)
        if self.kind == "q8_0":
            q = b[..., 2:].transpose(0, 1, 3, 2)  # [np, nblk, 32 rows, 16 columns]
            out[..., 4 * PANEL :] = q.reshape(npanels, nblk, -1)
        else:
            if self.kind == "q4_1":
                m = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
                qs = b[..., 4:]
            else:  # q4_0: w = d * (q - 8) = d * q + (-8 d), exact in float32
                m = -8.0 * d
                qs = b[..., 2:]
            out[..., 4 * PANEL : 8 * PANEL] = m.astype(np.float32).view(np.uint8).reshape(npanels, nblk, -1)
            out[..., 8 * PANEL :] = qs.transpose(0, 1, 3, 2).reshape(npanels, nblk, -1)  # [np, nblk, 16 j, 16 c]
        return torch.from_numpy(out).view(dtype)


def q4k_panels(blocks: np.ndarray, N: int, K: int) -> torch.Tensor:
    """Q4_K super-blocks (256 values: fp16 d and dmin, eight 6-bit sub-block scales and mins, 4-bit quants) as Q4
    panels, exactly: each 32-value sub-block j has w = (d * sc_j) * q - dmin * m_j, so its panel scale is d * sc_j
    and its offset -(dmin * m_j), both exact in float32 (fp16 times a 6-bit integer), and d * sc_j * q is exact
    too: the kernel's d' * q + m' rounds once, where `gguf`'s d * q - dm does."""
    import gguf

    ns = K // 256
    b = blocks.reshape(N, ns, 144)
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)  # [N, ns]
    dmin = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    sc, mn = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(N * ns, 12))
    scale = (d[..., None] * sc.reshape(N, ns, 8).astype(np.float32)).reshape(N, ns * 8)  # per 32-value block
    offset = -(dmin[..., None] * mn.reshape(N, ns, 8).astype(np.float32)).reshape(N, ns * 8)
    qs = b[..., 16:].reshape(N, ns, 4, 32)  # group g: low nibbles = sub-block 2g, high = 2g + 1, value i at byte i
    q = np.stack([qs & 15, qs >> 4], axis=3).reshape(N, ns * 8, 32)  # [N, block, 32 values]
    packed = q[..., :16] | (q[..., 16:] << 4)  # Q4 panels' order: byte i = value i (low) and value i + 16 (high)
    npanels, nblk = (N + PANEL - 1) // PANEL, K // QK
    out = np.zeros((npanels, nblk, 8 * PANEL + QK * PANEL // 2), dtype=np.uint8)

    def by_panel(x: np.ndarray) -> np.ndarray:  # [N, nblk, ...] -> [np, nblk, 16 columns, ...]
        pad = np.zeros((npanels * PANEL, *x.shape[1:]), dtype=x.dtype)
        pad[:N] = x
        return pad.reshape(npanels, PANEL, *x.shape[1:]).swapaxes(1, 2)

    out[..., : 4 * PANEL] = np.ascontiguousarray(by_panel(scale)).view(np.uint8).reshape(npanels, nblk, -1)
    out[..., 4 * PANEL : 8 * PANEL] = np.ascontiguousarray(by_panel(offset)).view(np.uint8).reshape(npanels, nblk, -1)
    out[..., 8 * PANEL :] = by_panel(packed).swapaxes(2, 3).reshape(npanels, nblk, -1)  # [np, nblk, 16 j, 16 c]
    return torch.from_numpy(out)


def quantize(w: torch.Tensor, kind: str) -> QuantWeight:
    """An [N, K] float matrix in `kind` ("q8_0" or "q4_0") blocks, as llama.cpp's reference quantizers make them
    (quantize_row_q8_0_ref / quantize_row_q4_0_ref: the scale rounded to fp16 for storage, the quants computed
    with the float32 scale)."""
    N, K = w.shape
    if K % QK:
        raise InvalidRequestError(f"quant={kind!r} needs matrices whose rows are whole blocks of {QK}; one has {K}")
    x = w.detach().float().reshape(N, K // QK, QK)
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


def check_mode(quant: str) -> str:
    if quant not in QUANT_MODES:
        raise InvalidRequestError(f"unknown quant {quant!r}; choose from {', '.join(QUANT_MODES)}")
    return quant
