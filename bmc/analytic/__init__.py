"""The analytic model of the seed paper (section V-A): how many allocations T minimise copy + attention time."""
from __future__ import annotations

from .model import (DEFAULT_C_PRIME, Constants, Shape, best_T, c_prime, predicted_time, round_pow2, t_opt,
                    t_opt_simple)
from .profile import ProfileWarning, choose_T, default_profile_path, load_profile, save_profile

__all__ = ["DEFAULT_C_PRIME", "Constants", "Shape", "best_T", "c_prime", "predicted_time", "round_pow2", "t_opt",
           "t_opt_simple", "ProfileWarning", "choose_T", "default_profile_path", "load_profile", "save_profile"]
