"""A GGUF file's metadata and tensor table, parsed straight from its bytes.

Why not gguf.GGUFReader: it builds a numpy memmap view for every part of every field, ~1M views for the default
model's 49k-token vocabulary and merges, and took 3.8 of the 5.8 s a load took here; this parser reads the same
fields with struct from one mapping in ~0.1 s. The tensors' bytes are handed out as numpy views of the mapping
shaped as GGUFReader shapes them (typed for float and integer types, [rows, row bytes] for block-quantized ones),
so gguf.quants.dequantize reads them unchanged. Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types -> struct format (scalars); 8 = string, 9 = array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: innermost dimension first
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # a view of the file's mapping


class GGUFFile:
    """fields: {key: value} (str, int, float, bool, or a list of them); tensors: {name: GGUFTensor}."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.buf = memoryview(self._map)
        self.pos = 0
        if bytes(self.buf[:4]) != GGUF_MAGIC:
            raise ValueError("no GGUF magic")
        self.pos = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (bmc reads 2 and 3)")
        n_tensors, n_fields = self._scalar("<Q"), self._scalar("<Q")
        # GGUFReader's pseudo-fields first, as it lists them
        self.fields: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors,
                                       "GGUF.kv_count": n_fields}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = tuple(self._scalar("<Q") for _ in range(self._scalar("<I")))
            infos.append((name, dims, self._scalar("<I"), self._scalar("<Q")))
        align = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = (self.pos + align - 1) // align * align
        self.tensors = {name: self._tensor(name, dims, kind, data_start + offset) for name, dims, kind, offset in infos}

    def release(self, data: np.ndarray) -> None:
        """Drop this process's pages of `data`, a view of the mapping, once its bytes have been copied out: the
        page cache keeps them, but a load's resident memory no longer grows by the whole file as it reads tensor
        after tensor (MADV_DONTNEED on a read-only file mapping; reading the view again faults them back in)."""
        if not hasattr(mmap, "MADV_DONTNEED") or data.nbytes == 0:
            return
        base = np.frombuffer(self._map, dtype=np.uint8, count=1).ctypes.data
        start = data.ctypes.data - base
        if not 0 <= start < len(self._map):
            return  # not a view of this mapping
        first = start // mmap.PAGESIZE * mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, first, min(start + data.nbytes, len(self._map)) - first)

    def _scalar(self, fmt: str) -> Any:
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._scalar("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8")
        self.pos += n
        return s

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, n = self._scalar("<I"), self._scalar("<Q")
        if item in _NUMPY:  # numbers: one numpy read instead of n struct calls
            dtype = np.dtype(_NUMPY[item]).newbyteorder("<")
            arr = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)
            self.pos += n * dtype.itemsize
            return arr.tolist()
        return [self._value(item) for _ in range(n)]

    def _tensor(self, name: str, dims: tuple[int, ...], kind: int, start: int) -> GGUFTensor:
        import gguf

        qtype = gguf.GGMLQuantizationType(kind)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n = int(np.prod(dims)) if dims else 1
        np_dims = tuple(reversed(dims))
        typed = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
                 gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
                 gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
                 gguf.GGMLQuantizationType.I64: np.int64}
        if qtype in typed:
            data = np.frombuffer(self.buf, dtype=typed[qtype], count=n, offset=start).reshape(np_dims)
        else:  # as GGUFReader: bytes, the innermost dimension as its row of blocks
            if dims[0] % block:
                raise ValueError(f"tensor {name}: {dims[0]} values per row is not a whole number of blocks")
            shape = (*np_dims[:-1], dims[0] // block * type_size)
            data = np.frombuffer(self.buf, dtype=np.uint8, count=n // block * type_size, offset=start).reshape(shape)
        return GGUFTensor(name, dims, qtype, data)
