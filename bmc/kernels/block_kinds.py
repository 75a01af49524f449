"""The native GEMM's quantized panel kinds: one table, read by Python (models/quant.py lays weights out by it) and by
C++ (the build renders it as the header `block_kinds.h` the kernels include).

A panel holds 16 output columns; each block of QK = 32 input rows holds, per column, a few vectors of 16 scales
(float32 or fp16) and then the 32 x 16 quants (int8, or two 4-bit values a byte: row j in the low nibble, row
j + 16 in the high one, GGUF's own order). A weight w of rows 0-15 is d * q + m, of rows 16-31 d_hi * q + m, a
vector missing meaning d_hi = d, m = 0.

Adding a kind: a row here, and its kernels where its traits are new (kernels/cpu/quant.h, vnni.h). A weight
carries its kind to the kernels by code (`Weight(panels, kind)`); neither side infers a kind from a tensor's
dtype or width."""
from __future__ import annotations

from dataclasses import dataclass

import torch

QK = 32  # rows of a block
PANEL = 16  # columns of a panel
NOT_BLOCKS = -1  # the kind code of float32 and 16-bit float panels (and of a float matrix still to be packed)
SCALE_VECTORS = ("d", "d_hi", "m")  # the order vectors take in a block


@dataclass(frozen=True)
class BlockKind:
    """One panel kind: its vectors (a subset of SCALE_VECTORS, in that order), their element size and the quants'."""

    name: str
    code: int
    vectors: tuple[str, ...]
    scale_bytes: int  # 4: float32, 2: fp16
    nibbles: bool  # 4-bit quants (uint8 storage, values 0-15); else int8
    doc: str
    offset_of_d: int = 0  # without an m vector: m = offset_of_d * d, implied (Q4_0's -8 d), not stored

    @property
    def storage(self) -> torch.dtype:
        return torch.uint8 if self.nibbles else torch.int8

    @property
    def quants_at(self) -> int:
        return len(self.vectors) * self.scale_bytes * PANEL

    @property
    def block_bytes(self) -> int:
        return self.quants_at + QK * PANEL // (2 if self.nibbles else 1)

    def vector_at(self, vector: str) -> int:
        """Byte offset of `vector` in a block, or -1 where the kind has none."""
        return self.vectors.index(vector) * self.scale_bytes * PANEL if vector in self.vectors else -1


BLOCK_KINDS: tuple[BlockKind, ...] = (
    BlockKind("q8", 0, ("d",), 4, False, "Q8_0: w = d q"),
    BlockKind("q4", 1, ("d", "m"), 4, True, "Q4_K (d = d sc_j, m = -dmin m_j per 32 values)"),
    BlockKind("q8x", 2, ("d", "d_hi", "m"), 4, False,
              "any other: Q5_K (q in 0-31), Q6_K (q - 32, a scale per 16 values), fused parts of different types"),
    BlockKind("q4h", 3, ("d", "m"), 2, True, "Q4_1, whose scales GGUF stores in fp16 already"),
    BlockKind("q4z", 4, ("d",), 2, True, "Q4_0: w = d (q - 8), the offset -8 d implied (18 bytes a block as stored, "
              "not q4h's 20)", offset_of_d=-8),
)
BLOCK_KIND = {k.name: k for k in BLOCK_KINDS}
assert [k.code for k in BLOCK_KINDS] == list(range(len(BLOCK_KINDS))), "codes index the C++ arrays"
assert all(set(k.vectors) <= set(SCALE_VECTORS) and k.vectors[0] == "d" for k in BLOCK_KINDS)


def kind_code(name: str | None) -> int:
    """The code the kernels take for panel kind `name`; None (float panels): NOT_BLOCKS."""
    return NOT_BLOCKS if name is None else BLOCK_KIND[name].code


def cpp_header() -> str:
    """The table as C++ (the header `block_kinds.h`, written by the build beside the extension's sources)."""
    def row(values: list) -> str:
        return "{" + ", ".join(values) + "}"

    def arr(ctype: str, name: str, values: list, why: str) -> str:
        return f"constexpr {ctype} {name}[NUM_BLOCK_KINDS] = {row(values)};  // {why}\n"

    enums = [f"K{k.name.upper()}" for k in BLOCK_KINDS]
    text = ("// Generated from bmc/kernels/block_kinds.py by the build: the table of quantized panel kinds.\n"
            "#pragma once\n\nnamespace {\n\n"
            f"enum QuantKind : int {row([f'{e} = {k.code}' for e, k in zip(enums, BLOCK_KINDS)])};\n"
            f"constexpr int NUM_BLOCK_KINDS = {len(BLOCK_KINDS)};\n"
            f"constexpr int NOT_BLOCKS = {NOT_BLOCKS};\n"
            "// X(kind) for every kind: the kernel tables are built from it\n"
            f"#define BMC_FOR_EACH_BLOCK_KIND(X) {' '.join(f'X({e})' for e in enums)}\n")
    text += arr("const char*", "KIND_NAME", [f'"{k.name}"' for k in BLOCK_KINDS], "for errors")
    text += arr("int64_t", "KIND_BLOCK", [str(k.block_bytes) for k in BLOCK_KINDS], "bytes of a block")
    text += arr("int64_t", "KIND_QUANTS", [str(k.quants_at) for k in BLOCK_KINDS], "where its quants start")
    text += arr("int64_t", "KIND_SCALE_HI", [str(k.vector_at("d_hi")) for k in BLOCK_KINDS],
                "rows 16-31's scales (-1: rows 0-15's)")
    text += arr("int64_t", "KIND_OFFSET", [str(k.vector_at("m")) for k in BLOCK_KINDS], "its offsets m (-1: none)")
    text += arr("int", "KIND_M_OF_D", [str(k.offset_of_d) for k in BLOCK_KINDS], "no m vector: m = this * d (0: none)")
    text += arr("int", "KIND_VECTORS", [str(len(k.vectors)) for k in BLOCK_KINDS], "vectors of 16 before the quants")
    text += arr("bool", "KIND_HALF_SCALES", [str(k.scale_bytes == 2).lower() for k in BLOCK_KINDS], "fp16 vectors")
    text += arr("bool", "KIND_NIBBLES", [str(k.nibbles).lower() for k in BLOCK_KINDS], "4-bit quants")
    text += arr("c10::ScalarType", "KIND_STORAGE",
                ["torch::kByte" if k.nibbles else "torch::kChar" for k in BLOCK_KINDS], "the panels' dtype")
    return text + "\n}  // namespace\n"
