"""T_opt = sqrt(C' * N) with C' = alpha*BW / (2*beta*C) (Eq. 7), rounded to a power of two."""
from __future__ import annotations

import logging
import math
from typing import Any

log = logging.getLogger("bmc")

# The paper's measured C' on an AMD Genoa server (section VIII-A); used until bmc-calibrate has measured this machine.
DEFAULT_C_PRIME = 0.1
_said_default = False


def round_pow2(x: float) -> int:
    """Nearest power of two in log space, at least 1."""
    return 1 if x <= 1 else 2 ** round(math.log2(x))


def t_opt_simple(n: int, c_prime: float) -> float:
    """Continuous optimum of Eq. 5 when the allocation cost C0 is negligible: sqrt(C' * N)."""
    return math.sqrt(c_prime * n)


def choose_T(n: int, **shape: Any) -> tuple[int, str]:
    """Number of allocations for a run of maximum length n; returns (T, where it came from)."""
    global _said_default
    if not _said_default:
        log.info("bmc: no calibration profile; using the paper's C'=%.2g (T = sqrt(C'*N), rounded to 2^k)", DEFAULT_C_PRIME)
        _said_default = True
    return min(n, round_pow2(t_opt_simple(n, DEFAULT_C_PRIME))), f"default C'={DEFAULT_C_PRIME}"
