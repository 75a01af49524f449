"""The seed paper's cost model (section V-A, Eq. 1-9) with constants measured by bmc-calibrate.

Per run of maximum length N with T allocations of r = N / T rows each:

    time(T) = a * N * (T + 1) / 2  +  T * C0  +  f * N^2 * (1 + 1/T) / 2                     (Eq. 5)

  a  = seconds to copy one cache row (all layers, K and V) at a chunk boundary = row_bytes / (alpha*BW)
  f  = seconds of attention per cache row per decode step                    = row_flops / (beta*C)
  C0 = fixed cost of one growth: the allocation (the intercept of copy time vs bytes) and, on CUDA, the capture of
       the new bucket's decode-step graph (layers x the calibrated capture seconds per layer)

dtime/dT = 0 gives T_opt = N * sqrt(f / (a*N + 2*C0)), which is sqrt(C' * N) with C' = f / a when C0 is
negligible (Eq. 7; the paper's C' = alpha*BW / (2*beta*C) in its units). The copy term moves H_kv heads in
`dtype` bytes while attention computes over all H query heads, so GQA and narrower KV dtypes scale C' by the
group size G and by 4 / dtype bytes (Eq. 8). Under speculative decoding with k verified tokens per step and a
mean of m accepted, the attention term becomes f' * k * N^2 / m (Eq. 9): T_opt grows as sqrt(N * k / m).

A CPU decode cache grows in place (kv/base.py: its slabs have room, a growth widens the view): its copy term is
zero (a = 0), and T_opt = N * sqrt(f / (2*C0)) balances the fixed cost of a growth against the padding rows'
attention alone (choose_T(copy_free=True)). A CUDA cache with graphs grows in place too (in the model's arena,
graphs.py), and there C0 is mostly the graph capture.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

log = logging.getLogger("bmc")

# The paper's C' on an AMD Genoa server (section VIII-A); used only when this machine has no calibration profile.
DEFAULT_C_PRIME = 0.1


@dataclass(frozen=True)
class Shape:
    """What the cost depends on: batch, layers, query heads, KV heads, head dim, KV element bytes."""

    batch: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: float = 4  # per K or V value as the cache stores it (int8 KV: (d + 4) / d with its scales)

    @property
    def row_bytes(self) -> float:
        """Bytes of one cache row over all layers, K and V."""
        return 2 * self.batch * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def row_flops(self) -> int:
        """Attention FLOPs per cache row per query: QK^T and PV, a multiply and an add each, all query heads."""
        return 4 * self.batch * self.layers * self.heads * self.head_dim


@dataclass(frozen=True)
class Constants:
    copy_bw: float  # alpha*BW: bytes of cache copied per second at a chunk boundary
    alloc_s: float  # C0: seconds per allocation
    attn_flops: float  # beta*C: attention FLOP/s of a decode step (one query row)
    verify_flops: float | None = None  # beta'*C: attention FLOP/s of a verify step (t query rows)
    capture_layer_s: float = 0.0  # CUDA: seconds to capture one layer of a decode step as a graph (0 elsewhere)


def expected_experts(experts: int, top_k: int, rows: int) -> float:
    """Expected distinct experts a mixture-of-experts layer reads in a step of `rows` rows, each routed to top_k of
    `experts` (uniformly, independently): an expert no row chose is not read. T does not depend on it (Eq. 5 weighs
    cache growth against padding attention, neither of which reads weights); a step's bytes do."""
    if experts <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** max(rows, 0))


def round_pow2(x: float) -> int:
    """Nearest power of two in log space (halves round up, not to even), at least 1."""
    return 1 if x <= 1 else 2 ** math.floor(math.log2(x) + 0.5)


def t_opt_simple(n: int, c_prime: float) -> float:
    """Eq. 7: sqrt(C' * N), the optimum when the allocation cost C0 is negligible."""
    return math.sqrt(c_prime * n)


def coefficients(shape: Shape, c: Constants, k: int = 1, m: float = 1.0) -> tuple[float, float]:
    """(a, f) of Eq. 5 in seconds per row; with speculation (k verified tokens, m accepted per step) the
    attention term per generated token is k / m verify rows at the verify throughput (Eq. 9)."""
    a = shape.row_bytes / c.copy_bw
    if k == 1:
        return a, shape.row_flops / c.attn_flops
    rate = c.verify_flops or c.attn_flops
    return a, shape.row_flops * k / (m * rate)


def c_prime(shape: Shape, c: Constants, k: int = 1, m: float = 1.0) -> float:
    a, f = coefficients(shape, c, k, m)
    return f / a


def growth_s(shape: Shape, c: Constants) -> float:
    """C0: the fixed seconds of one growth, the allocation and the capture of the bucket's graph."""
    return c.alloc_s + c.capture_layer_s * shape.layers


def predicted_time(T: float, n: int, shape: Shape, c: Constants, k: int = 1, m: float = 1.0) -> float:
    """Eq. 5 (Eq. 9 with k, m): copy + allocation + attention seconds for a run of n tokens with T allocations."""
    a, f = coefficients(shape, c, k, m)
    return a * n * (T + 1) / 2 + T * growth_s(shape, c) + f * n * n * (1 + 1 / T) / 2


def t_opt(n: int, shape: Shape, c: Constants, k: int = 1, m: float = 1.0) -> float:
    """Continuous optimum of Eq. 5/9 with C0 kept (Eq. 6 solved for T). A growth that copies nothing (a = 0: a
    CPU cache growing in place) leaves T * C0 against the padding's attention: T_opt = N sqrt(f / 2 C0), and with
    no fixed cost either, every token (T = N)."""
    a, f = coefficients(shape, c, k, m)
    cost = a * n + 2 * growth_s(shape, c)
    return n * math.sqrt(f / cost) if cost > 0 else float(n)


def best_T(n: int, shape: Shape, c: Constants, k: int = 1, m: float = 1.0) -> int:
    """T_opt rounded to a power of two (the paper's rule), within [1, n]."""
    return max(1, min(n, round_pow2(t_opt(n, shape, c, k, m))))
