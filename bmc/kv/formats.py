"""How the KV cache stores its rows (`kv_dtype`): a name registry of formats, one per element type.

A format stores one (token, KV head) row of head_dim values in `width(head_dim)` elements of `storage` dtype, so
the cache stays one tensor [L, 2, B, H_kv, capacity, width] and every cache verb (grow, gather, reorder, regroup)
moves rows without knowing the format:

- float32 / bfloat16 / float16: the values cast (round to nearest even, as torch casts);
- int8: head_dim int8 values q and, in the row's last 4 bytes, their float32 scale s ~ max|x| / 127, with
  q ~ round(x / s) (half to even) clamped to [-127, 127]; a row reads back as q * s. The error of each value is at
  most s / 2 = max|x| / 254 of its row (a stated bound the tests check). 68 bytes a row at head_dim 64 against 256
  in float32: 3.8x fewer bytes for decode attention to stream. (s = max|x| * fl(1/127) and q = round(x * (1/s)):
  products, so that both sides round alike.)

The native CPU step (bmc/kernels/cpu/kv_format.h) writes and reads these same bytes with the same arithmetic, so
its KV equals the PyTorch path's bit for bit."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from ..errors import InvalidRequestError

SCALE_BYTES = 4  # an int8 row's float32 scale, stored after its values
INV_127 = float(torch.tensor(1 / 127, dtype=torch.float32))  # the float32 constant both sides multiply by


class KVFormat(ABC):
    name: ClassVar[str]
    storage: ClassVar[torch.dtype]

    def width(self, head_dim: int) -> int:
        """Storage elements per row of head_dim values."""
        return head_dim

    def bytes_per_value(self, head_dim: int) -> float:
        """Bytes the cache holds (and decode attention reads) per value: the analytic model's copy term."""
        return self.width(head_dim) * torch.empty(0, dtype=self.storage).element_size() / head_dim

    @abstractmethod
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Rows [..., head_dim] -> their storage [..., width]."""

    @abstractmethod
    def decode(self, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Storage [..., width] -> the rows' values [..., head_dim] in `dtype` (a new tensor)."""

    def split(self, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Storage [..., width] -> (the stored values [..., head_dim], a view; each row's scale [...] in float32,
        or None where a value is its own scale). A row's values are decode(s) = values * scale."""
        return s, None


class FloatFormat(KVFormat):
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.storage)

    def decode(self, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return s.to(dtype)


class Float32(FloatFormat):
    name, storage = "float32", torch.float32


class BFloat16(FloatFormat):
    name, storage = "bfloat16", torch.bfloat16


class Float16(FloatFormat):
    name, storage = "float16", torch.float16


class Int8(KVFormat):
    name, storage = "int8", torch.int8

    def width(self, head_dim: int) -> int:
        return head_dim + SCALE_BYTES

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        # products by a float32 constant and a reciprocal, not divisions: the native step (compiled with
        # -ffast-math, which may turn a division by a constant into a product) computes the same bits
        x = x.float()
        d = x.shape[-1]
        scale = x.abs().amax(-1, keepdim=True) * INV_127
        q = torch.where(scale > 0, x * scale.reciprocal(), 0.0).round_().clamp_(-127, 127)
        out = torch.empty((*x.shape[:-1], d + SCALE_BYTES), dtype=torch.int8, device=x.device)
        out[..., :d] = q.to(torch.int8)
        out[..., d:].view(torch.float32).copy_(scale)
        return out

    def decode(self, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        d = s.shape[-1] - SCALE_BYTES
        return (s[..., :d].float() * scales(s)).to(dtype)

    def split(self, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return s[..., : s.shape[-1] - SCALE_BYTES], scales(s)[..., 0]


def scales(s: torch.Tensor) -> torch.Tensor:
    """The float32 scales [..., 1] of int8 rows [..., head_dim + 4]."""
    return s[..., s.shape[-1] - SCALE_BYTES :].contiguous().view(torch.float32)


KV_FORMATS: dict[str, KVFormat] = {f.name: f for f in (Float32(), BFloat16(), Float16(), Int8())}
KV_DTYPES = ("auto", *KV_FORMATS)  # "auto": the model's dtype


def kv_format(kv_dtype: str | None, dtype: torch.dtype) -> KVFormat:
    """The format for `kv_dtype` ("auto" or None: the model's `dtype`)."""
    name = str(dtype).removeprefix("torch.") if kv_dtype in (None, "auto") else kv_dtype
    if name not in KV_FORMATS:
        raise InvalidRequestError(f"unknown kv_dtype {kv_dtype!r}; choose from {', '.join(KV_DTYPES)}")
    return KV_FORMATS[name]
