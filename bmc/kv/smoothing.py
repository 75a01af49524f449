"""Key channel scales for an int8 KV cache (issue 44, item 5).

An int8 row holds one scale for the whole (token, KV head) row, so a key row whose few outlier channels are 50x
the rest (Qwen's biased keys, Gemma's normed ones) spends its 255 levels on them and rounds the other channels
coarsely: int8 KV raised Gemma 3 270M's perplexity by 0.9 %. Keys are stored as k / s instead, s a fixed scale per
(layer, KV head, channel), and queries are taken as q * s, so every score q . k is unchanged (KIVI's observation:
keys have outlier channels, values do not; SmoothQuant's migration, moved whole onto the query).

s is a power of two, so q * s and k / s are exact in float arithmetic and the scores of q * s against the stored
rows are those of q against s times them, bit for bit: the smoothing moves only what int8 rounds. It is measured
once per model, from the post-RoPE keys of a prefill of seeded random tokens (the channels' sizes come from the
weights, the norms and the biases, not from the text): the largest |k| of each channel, the larger of each RoPE
pair (the rotation mixes them), rounded up to a power of two, and not below 2^-8 of the head's largest (a channel
quiet in the calibration is not magnified past that). Values keep their per-row scales.

A cache carries the scales it was written with (`KVCache.key_scales`, set by engine.make_cache); rows move only
between caches with the same scales. The scales are stored in bmc's cache directory, keyed by the model files'
path, size and modification time, the device, dtype, quantization and arithmetic: measured once per model and
machine (0.3 s for the default model), read back afterwards. BMC_KV_SMOOTH=0 turns it off (an A/B switch)."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CALIBRATION_TOKENS = 256
SCALES_VERSION = 1
QUIET_FLOOR = 2.0**-8  # a channel's scale is at least this fraction of its head's largest


@dataclass(eq=False)
class KeyScales:
    """[L, H_kv, d] float32 powers of two; `queries` / `keys` give a layer's multipliers for the eager path."""

    table: torch.Tensor
    group: int  # query heads per KV head
    _expanded: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def multipliers(self, layer: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(s for the query heads [1, H, 1, d], 1 / s for the KV heads [1, H_kv, 1, d]) of `layer`."""
        key = (layer, dtype, device)
        if key not in self._expanded:
            s = self.table[layer].to(device)
            self._expanded[key] = (s.repeat_interleave(self.group, 0)[None, :, None].to(dtype),
                                   s.reciprocal()[None, :, None].to(dtype))
        return self._expanded[key]


def smoothing_enabled() -> bool:
    return os.environ.get("BMC_KV_SMOOTH", "1") != "0"


def key_scales_for(model: Any) -> KeyScales | None:
    """The model's key scales for int8 caches, measured at the first call and kept on the model; None where the
    model does not smooth its keys (families outside llama.py's stack, a rank of a tensor-parallel model, or
    BMC_KV_SMOOTH=0)."""
    if not smoothing_enabled() or not getattr(model.net, "SMOOTHS_KEYS", False) or model.full_config is not None:
        return None
    scales = getattr(model, "_key_scales", None)
    if scales is None:
        path = _stored_path(model)
        table = _read(path, model)
        if table is None:
            table = measure_key_scales(model)
            _write(path, table)
        scales = KeyScales(table, model.config.num_heads // model.config.num_kv_heads)
        model._key_scales = scales
    return scales


def _stored_path(model: Any) -> Path | None:
    """Where the model's scales are kept, or None for a model that is not a file or directory here."""
    from ..analytic.profile import cache_dir, identity

    source = model.path
    if not source or not os.path.exists(source):
        return None
    files = [source] if os.path.isfile(source) else sorted(
        os.path.join(source, f) for f in os.listdir(source) if os.path.isfile(os.path.join(source, f)))
    stats = [(os.path.abspath(f), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
    key = json.dumps([SCALES_VERSION, CALIBRATION_TOKENS, stats, identity(model.device, model.dtype), model.quant,
                      model.activations])
    return cache_dir() / f"keyscales-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"


def _read(path: Path | None, model: Any) -> torch.Tensor | None:
    cfg = model.config
    try:
        table = torch.load(path, weights_only=True) if path is not None else None
    except Exception:  # a damaged or foreign file, whatever torch.load makes of it: measured again
        return None
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    ok = isinstance(table, torch.Tensor) and table.shape == shape and table.dtype == torch.float32
    return table if ok and bool(torch.isfinite(table).all() and (table > 0).all()) else None


def _write(path: Path | None, table: torch.Tensor) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(table, tmp)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: measured again next time


def measure_key_scales(model: Any, tokens: int = CALIBRATION_TOKENS) -> torch.Tensor:
    """[L, H_kv, d] powers of two from a prefill of `tokens` seeded random tokens into a cache of the model's dtype
    (see the module docstring)."""
    from ..engine import prefill_alone

    cfg = model.config
    g = torch.Generator().manual_seed(0)
    n = min(tokens, max(cfg.max_position_embeddings, 2))
    ids = torch.randint(min(3, cfg.vocab_size - 1), cfg.vocab_size, (n,), generator=g).tolist()
    with torch.inference_mode():
        cache, _ = prefill_alone(model, ids, n)
        k = cache.kv[:, 0, 0, :, : cache.length].float()  # [L, H_kv, n, d]
    top = k.abs().amax(2)
    half = top.shape[-1] // 2
    if half:  # RoPE rotates channel j with j + d/2: either can hold the pair's size at some position
        pair = torch.maximum(top[..., :half], top[..., half : 2 * half])
        top = torch.cat([pair, pair, top[..., 2 * half :]], -1)
    floor = top.amax(-1, keepdim=True) * QUIET_FLOOR
    top = torch.maximum(top, floor).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.exp2(torch.ceil(torch.log2(top))).cpu()
