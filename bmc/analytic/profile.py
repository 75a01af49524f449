"""Calibration profiles: where they live, what makes one valid here, and choose_T() that uses them."""
from __future__ import annotations

import dataclasses
import json
import math
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from .model import DEFAULT_C_PRIME, Constants, Shape, best_T, round_pow2, t_opt_simple

log = logging.getLogger("bmc")
PROFILE_VERSION = 1
_said: set[str] = set()  # messages already given once in this process


class ProfileWarning(UserWarning):
    """A calibration profile exists but cannot be used here (corrupt, or measured on another machine/torch)."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from ..platform.topology import cpu_model

    return cpu_model()


def attention_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """The attention kernel decode steps run on this device and dtype: the native CPU step's, or PyTorch's SDPA."""
    from ..kernels.native import native_supported

    return "native-cpu" if native_supported(device, dtype) else "torch"


def identity(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """What a profile must match to be used: the device, its model, torch's version, the KV dtype and the attention
    kernel that was timed (BMC_NATIVE=0 or a failed kernel build changes it)."""
    return {"device": device.type, "device_name": device_name(device), "torch": torch.__version__,
            "dtype": dtype_name(dtype), "attention_kernel": attention_kernel(device, dtype)}


def cache_dir() -> Path:
    base = os.environ.get("BMC_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "bmc")
    return Path(base)


def default_profile_path(device: torch.device, dtype: torch.dtype) -> Path:
    return cache_dir() / f"profile-{device.type}-{dtype_name(dtype)}.json"


def save_profile(profile: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile, indent=2))
    tmp.replace(path)  # atomic: a reader never sees half a profile


def _warn_once(msg: str) -> None:
    if msg not in _said:
        _said.add(msg)
        warnings.warn(msg, ProfileWarning, stacklevel=3)


def load_profile(path: Path, device: torch.device, dtype: torch.dtype) -> Constants | None:
    """The profile's constants if it is well-formed and was measured here; otherwise warn once and return None."""
    try:
        data = json.loads(path.read_text())
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"version {data.get('version')!r}, expected {PROFILE_VERSION}")
        k = data["constants"]
        consts = Constants(copy_bw=float(k["copy_bw_bytes_per_s"]), alloc_s=float(k["alloc_s"]),
                           attn_flops=float(k["attn_flops_per_s"]),
                           verify_flops=float(k["verify_flops_per_s"]) if k.get("verify_flops_per_s") else None,
                           capture_layer_s=float(k.get("capture_layer_s", 0.0)))
        finite = all(math.isfinite(x) for x in (consts.copy_bw, consts.attn_flops, consts.alloc_s,
                                                consts.capture_layer_s))
        if not (finite and consts.copy_bw > 0 and consts.attn_flops > 0 and consts.alloc_s >= 0
                and consts.capture_layer_s >= 0):
            raise ValueError("constants must be finite and positive")
    except (OSError, ValueError, KeyError, TypeError) as e:
        _warn_once(f"bmc: ignoring calibration profile {path}: unreadable ({e}); run bmc-calibrate again")
        return None
    want = identity(device, dtype)
    foreign = {key: (data.get(key), val) for key, val in want.items() if data.get(key) != val}
    if set(foreign) == {"attention_kernel"}:  # measured here, for the other kernel (BMC_NATIVE=0, TP ranks)
        timed, runs = foreign["attention_kernel"]
        msg = (f"bmc: calibration profile {path} times the {timed} attention kernel and this run uses {runs}: T from "
               f"the paper's C'={DEFAULT_C_PRIME}")
        if msg not in _said:
            _said.add(msg)
            log.info(msg)
        return None
    if foreign:
        what = ", ".join(f"{key} {got!r} != {val!r}" for key, (got, val) in foreign.items())
        _warn_once(f"bmc: ignoring calibration profile {path}: measured elsewhere ({what}); run bmc-calibrate here")
        return None
    return consts


def choose_T(n: int, *, model: Any, batch: int, dtype: torch.dtype, device: torch.device,
             k: int = 1, m: float = 1.0, kv_bytes: float | None = None, copy_free: bool = False) -> tuple[int, str]:
    """Allocations T for a run of maximum length n: from this machine's profile ($BMC_PROFILE or the cache dir),
    else from the paper's C' = 0.1. `kv_bytes`: bytes the cache stores per K or V value (kv_dtype; default the
    model dtype's). `copy_free`: the cache grows in place (a CPU decode cache): Eq. 5 without its copy term, the
    profile's fixed cost per growth (C0, measured with the copy: an upper bound of a widening's) against the
    padding's attention. Returns (T, where it came from)."""
    path = Path(os.environ["BMC_PROFILE"]) if os.environ.get("BMC_PROFILE") else default_profile_path(device, dtype)
    consts = load_profile(path, device, dtype) if path.exists() else None
    if consts is None:
        msg = (f"bmc: no calibration profile at {path}; T from the paper's C'={DEFAULT_C_PRIME} "
               f"(run bmc-calibrate to measure this machine)")
        if msg not in _said:
            _said.add(msg)
            log.info(msg)
        # Eq. 8: a kv_dtype narrower than the model's copies fewer bytes per row for the same attention
        narrow = (torch.finfo(dtype).bits // 8) / kv_bytes if kv_bytes else 1.0
        return (max(1, min(n, round_pow2(t_opt_simple(n, DEFAULT_C_PRIME * narrow * k / m)))),
                f"default C'={DEFAULT_C_PRIME}")
    shape = Shape(batch=batch, layers=model.num_layers, heads=model.num_heads, kv_heads=model.num_kv_heads,
                  head_dim=model.head_dim, dtype_bytes=kv_bytes or torch.finfo(dtype).bits // 8)
    if copy_free:
        consts = dataclasses.replace(consts, copy_bw=math.inf)
    T = best_T(n, shape, consts, k, m)
    msg = f"bmc: T={T} for N={n}, batch {batch} from profile {path}" + (" (growth in place)" if copy_free else "")
    if msg not in _said:
        _said.add(msg)
        log.info(msg)
    return T, f"profile {path}" + ("; growth in place, no copy term" if copy_free else "")
