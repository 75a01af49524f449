"""Quantized weights where the native CPU step does not run (CUDA; a CPU in bfloat16 or with BMC_NATIVE=0): a
matrix's GGUF blocks held on the device as their quants (int32 words, quant_triton.py's layout: int8 values, or the
Q4 kinds' nibbles) with a scale d per 32 values (float16 where the kind's is: Q8_0, Q4_0, Q4_1), an offset m per
32 where the kind has one (none for Q8_0, nor for Q4_0's w = d (q - 8)) and, for Q6_K only, a second scale for
each block's values 16-31. Each weight is w = fma(q, d, m) in float32: d q is exact there, so w is bit for bit the
float32 weight `gguf` dequantizes (one rounding for the offset, as `gguf`'s d q + m) and quant="none" loads.

Which GEMM runs (measured on an H100, Llama-2-7B shapes: docs/performance.md, "Weight-only int8 / int4 on CUDA"):
- Q4 kinds (Q4_0, Q4_1, Q4_K) in bfloat16 on CUDA: torch's int4 GEMM (tinygemm), at every M (it beats the Triton
  GEMV at M = 1, by 4 %, and everything else at M <= 8).
- Otherwise, M <= GEMV_ROWS rows on CUDA (decode), one scale a block: the Triton GEMV (quant_triton.gemv).
- Otherwise (prompts; Q6_K; a CPU): the matrix dequantized to the model's dtype (the Triton kernel on CUDA, torch
  ops elsewhere: the same values), then torch's GEMM (cuBLAS).
- With activations="int8" (opt-in; models.set_activations): every row count on the int8-x GEMV (quant_i8x.py: x
  rounded to int8 per block of 32, dp4a), for the kinds with one scale a block; Q6_K stays on the float paths.

Stated bounds, per output y = sum_k x_k w_k (x as the model holds it, w the exact weights above):
- the Triton GEMV: products and sums in float32, one rounding to the output dtype:
  |y' - y| <= K 2^-23 sum_k |x_k w_k| + u |y|, u = 2^-8 (bfloat16), 2^-11 (float16), 0 (float32). The weights
  are not rounded to bfloat16 first, so in bfloat16 it is closer to y than quant="none"'s bfloat16 GEMM is.
- dequantize, then GEMM: quant="none"'s weights in the model's dtype, bit for bit, and the same torch GEMM: its
  output bit for bit (tests/test_gpu.py holds both). quant="gguf" gives quant="none"'s greedy tokens in float32
  (tested on the GPU, Q8_0 / Q4_0 / Q4_1 / Q4_K_M files).
- tinygemm computes w = (q - 8) * s + z with s and z in bfloat16, so a block's fp16 scale d and offset m + 8 d are
  rounded to bfloat16 (relative error <= 2^-8 each): every weight is within 2^-8 (|d| |q - 8| + |m + 8 d|) + its
  own bfloat16 rounding of the exact value, the same order as quant="none"'s bfloat16 cast of it (2^-8 |w|). A
  stated bound, not quant="none"'s weights: tests hold the logits to bfloat16's tolerance of quant="none"'s.
torch's `_weight_int8pack_mm` takes one scale per output channel, not per 32 values (GGUF's Q8_0 cannot use it),
and ran 10x slower than bfloat16 cuBLAS on an H100 at M = 1."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import InvalidRequestError
from .quant import QK, QuantWeight, block_kind_of

if TYPE_CHECKING:
    from .quant_i8x import Int8Rows

INT4_GROUP = 32  # values per tinygemm scale and zero point: GGUF's blocks


def int4pack_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch.ops.aten, "_weight_int4pack_mm")


class TorchQuantWeight:
    """An [out N, in K] quantized matrix on `device`, multiplied by the Triton GEMV (CUDA, M <= GEMV_ROWS), tinygemm
    (Q4 kinds in bfloat16 on CUDA), or dequantized to `dtype` and multiplied by torch (cuBLAS on CUDA)."""

    def __init__(self, qw: QuantWeight, device: torch.device, dtype: torch.dtype,
                 int8_activations: bool = False) -> None:
        self.kind, self.shape, self.dtype = qw.kind, qw.shape, dtype
        N, K = qw.shape
        v = qw.decode()
        qw.done()
        block = block_kind_of(qw.kind)
        self.nibbles = bool(block is not None and block.nibbles)  # values 0-15: 4 bits each
        values = torch.from_numpy(np.ascontiguousarray(v.quants())).to(device)  # int8 [N, K/32, 32]
        self.words = relayout(values, self.nibbles)  # the quants as int32 words (quant_triton.py's layout)
        del values
        self.d = _narrow(v.d0, device)  # [N, K/32]; float16 where the kind's scales are (Q8_0, Q4_0, Q4_1)
        # Q6_K's second scale per 32 values (rows 16-31): the Triton kernels take one scale a block, so such a
        # matrix is dequantized by torch ops for every GEMM (its bytes saved, not its time)
        self.d_hi = None if np.array_equal(v.d0, v.d1) else torch.from_numpy(np.ascontiguousarray(v.d1)).to(device)
        self.shift = 0  # w = d (q - shift) where the offset is -shift d (Q4_0), no offset stored
        self.m: torch.Tensor | None = None
        if np.array_equal(v.m, -8.0 * v.d0) and not np.array_equal(v.m, np.zeros_like(v.m)):
            self.shift = 8
        elif np.any(v.m != 0):
            self.m = _narrow(v.m, device)
        self.triton = device.type == "cuda" and triton_available()
        self.int4: tuple[torch.Tensor, torch.Tensor] | None = None
        if (self.nibbles and int4pack_available(device, dtype) and N % 8 == 0  # tinygemm tiles 8 output rows
                and not int8_activations):  # the int8-x GEMV reads the words: no second copy
            self.int4 = _int4pack(v.quants(), v.d0, v.m, device)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.words, self.d, self.d_hi, self.m, *(self.int4 or ())) if t is not None]

    def gemm_only(self) -> None:
        """Drop what only dense() and row lookups read, where the int4 GEMM holds the matrix (not a tied
        embedding's table): half the bytes."""
        if self.int4 is not None:
            self.words = self.d = self.m = None  # type: ignore[assignment]

    def int8_ready(self) -> bool:
        """Whether the int8-x GEMV can take this matrix: on CUDA with Triton, its words kept, one scale a block."""
        return self.triton and self.words is not None and self.d_hi is None

    def linear(self, x: torch.Tensor, b: torch.Tensor | None, int8_activations: bool = False) -> torch.Tensor:
        N, K = self.shape
        x2 = x.reshape(-1, K)
        M = x2.shape[0]
        if int8_activations:
            from .quant_i8x import quantize_x

            return self.linear_int8(quantize_x(x2), b, x.dtype).view(*x.shape[:-1], N)
        elif self.int4 is not None:
            packed, scales_zeros = self.int4
            y = torch.ops.aten._weight_int4pack_mm(x2.to(torch.bfloat16).contiguous(), packed, INT4_GROUP,
                                                   scales_zeros)
        elif self.triton and self.d_hi is None and M <= GEMV_ROWS:
            from .quant_triton import gemv

            # one row: x read as it is; several: widened to float32 first (measured faster: performance.md)
            xin = x2.contiguous() if M == 1 else x2.float()
            bn, nb, warps, mb = GEMV_CONFIGS[(self.nibbles, M == 1, M <= 4)]
            y = gemv(xin, self.words, self.d, self.m, self.shift, self.nibbles, N, K, x.dtype, bn=bn, nb=nb,
                     warps=warps, mb=mb)
        else:
            return torch.nn.functional.linear(x, self.dense(), b)
        y = y.view(*x.shape[:-1], N)
        return y + b if b is not None else y

    def linear_int8(self, rows: "Int8Rows", b: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Rows of x already rounded to int8 blocks (quant_i8x.quantize_x, or the decode step's glue) @ w.T: [M, N]
        in `dtype`, + b."""
        from .quant_i8x import gemv_i8x

        N, K = self.shape
        y = gemv_i8x(rows, self.words, self.d, self.m, self.shift, self.nibbles, N, K, dtype)
        return y + b if b is not None else y

    def dense(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The [N, K] matrix (or its rows `rows`) in `dtype`: fma(q, d, m) in float32 (d q exact: one rounding, as
        `gguf`'s d q + m), then cast; by the Triton kernel where it runs, else by torch ops, with the same values."""
        if self.words is None:
            raise InvalidRequestError(
                f"this {self.kind} matrix is held only in torch's int4 GEMM layout (quantized weights in bfloat16 on "
                "CUDA), which cannot be read back: a draft derived from the model's weights (int8-self, layer-"
                "truncated) needs quant='none' or float32")
        N, K = self.shape
        if rows is None and self.triton and self.d_hi is None:
            from .quant_triton import dequantize

            return dequantize(self.words, self.d, self.m, self.shift, self.nibbles, N, K, self.dtype)
        take = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
        q = values_of(take(self.words), self.nibbles, K).float()  # [n, K/32, 32]
        n = q.shape[0]
        d = take(self.d).float()
        if self.d_hi is None:
            w = q * d[..., None]
        else:
            w = (q.view(n, K // QK, 2, QK // 2) * torch.stack([d, take(self.d_hi)], dim=-1)[..., None]).view(
                n, K // QK, QK)
        if self.shift:
            w = w + (d * -float(self.shift))[..., None]
        elif self.m is not None:
            w = w + take(self.m).float()[..., None]
        return w.view(n, K).to(self.dtype)


# GEMV block shapes by (nibbles, M == 1, M <= 4): (BN rows, NB blocks a loop step, warps, MB rows of x a program);
# the best over the Llama-2-7B shapes' sum on an H100 (bench/gpu_quant.py; software pipelining measured slower)
GEMV_CONFIGS = {(False, True, True): (4, 32, 2, 1), (True, True, True): (4, 32, 2, 1),
                (False, False, True): (4, 32, 2, 4), (True, False, True): (8, 16, 2, 4),
                (False, False, False): (4, 16, 1, 8), (True, False, False): (8, 16, 2, 4)}
GEMV_ROWS = 8  # rows of x up to which the GEMV runs; above, dequantize + cuBLAS


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _narrow(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """float32 scales or offsets as float16 where that is exact (GGUF's own fp16 ones), else float32."""
    with np.errstate(over="ignore"):
        h = a.astype(np.float16)
    keep = h if np.array_equal(h.astype(np.float32), a) else a
    return torch.from_numpy(np.ascontiguousarray(keep)).to(device)


def relayout(values: torch.Tensor, nibbles: bool) -> torch.Tensor:
    """Quants [N, K/32, 32] in value order (int8; for nibbles 0-15) as the kernels' int32 words [N, K/32 * words]."""
    N, KB, _ = values.shape
    if nibbles:  # byte t of word j: values 4 (2t) + j (low nibble) and 4 (2t + 1) + j (high)
        v = values.to(torch.uint8).view(N, KB, 8, 4).transpose(2, 3)  # [N, KB, word j, value slot i]
        b = v[..., 0::2] | (v[..., 1::2] << 4)  # [N, KB, 4 words, 4 bytes]
    else:  # byte i of word j: value 8 i + j
        b = values.to(torch.int8).view(N, KB, 4, 8).transpose(2, 3)
    return b.contiguous().view(torch.int32).view(N, -1)


def values_of(words: torch.Tensor, nibbles: bool, K: int) -> torch.Tensor:
    """relayout's inverse: the quants [N, K/32, 32] in value order (int8)."""
    N = words.shape[0]
    b = words.contiguous().view(torch.uint8).view(N, K // QK, -1, 4)  # [N, KB, word j, byte t]
    if nibbles:
        v = torch.stack([b & 15, b >> 4], dim=-1).view(N, K // QK, 4, 8)  # [.., j, slot i]
        return v.transpose(2, 3).reshape(N, K // QK, QK).to(torch.int8)
    return b.view(torch.int8).transpose(2, 3).reshape(N, K // QK, QK)


def _int4pack(q: np.ndarray, d: np.ndarray, m: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """tinygemm's layout of Q4 values q (0-15, [N, K/32, 32]) with w = d q + m = (q - 8) d + (m + 8 d): the int4
    tiles (`_convert_weight_to_int4pack`, the largest inner k-tiling this K allows) and scales_and_zeros
    [K/32, N, 2] in bfloat16."""
    N = q.shape[0]
    flat = torch.from_numpy(q.reshape(N, -1).astype(np.int32))
    pairs = (flat[:, ::2] << 4 | flat[:, 1::2]).to(torch.uint8).to(device)  # two values a byte, the first high
    packed = None
    for inner in (8, 4, 2):
        try:
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs, inner)
            break
        except RuntimeError:
            if inner == 2:
                raise
    sd, zero = torch.from_numpy(d), torch.from_numpy(m + 8.0 * d)  # [N, K/32] float32 (Q4_0: zero 0 exactly)
    scales_zeros = torch.stack([sd, zero], dim=-1).transpose(0, 1).contiguous().to(device, torch.bfloat16)
    return packed, scales_zeros
