"""The analytic model of the seed paper (section V-A): how many allocations T minimise copy + attention time."""
from __future__ import annotations

from .model import DEFAULT_C_PRIME, choose_T, round_pow2, t_opt_simple

__all__ = ["DEFAULT_C_PRIME", "choose_T", "round_pow2", "t_opt_simple"]
