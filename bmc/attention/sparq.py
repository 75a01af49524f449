"""SparQ attention (Ribar et al.): approximate decode attention that reads a fraction of the KV cache.

For one decode query per head, with S cached positions:
  1. take the r largest |q| components (summed over the G query heads of a KV head under GQA) and read only those
     r rows of K (kept a second time dimension-major, [d, S], so the read is r contiguous rows, not r scattered
     floats out of every key); approximate scores s^ = softmax(q_r . K_r / tau + bias) with the temperature
     tau = sqrt(d * |q_r|_1 / |q|_1) (Eq. 9), i.e. the model's scale divided by sqrt(|q_r|_1 / |q|_1);
  2. take the k positions with the largest s^ (summed over the group), read their full keys and values and run
     exact attention over them;
  3. optionally give the mass the approximation assigns outside the top k, 1 - alpha, to the running mean value
     vector (Eq. 10). The paper drops this step for GQA models; so does the default here.
Elements read per KV head and step (Eq. 11): S*r + 2*k*d + 4*d (2*d without step 3), dense: 2*S*d + 2*d.

The BMC cache's masked padding rows never take part: their approximate score is -inf before the top-k, and
the gathered bias keeps them at zero weight when k exceeds the visible positions. Prefill and verify forwards
(more than one query per row) run dense attention; only single-query decode steps are approximated.

A narrow KV cache (kv_dtype bfloat16/float16/int8, bmc/kv/formats.py) is read as stored: the K mirror keeps the
stored values (int8: the rows' int8 values, dimension-major, and their scales, one float32 per column), step 1
scores s^ from them (int8: (q_r . q8_r) * scale), and step 2 decodes only the k chosen rows. So SparQ's saving
multiplies the format's: at int8 and r = d/4, step 1 reads S * (r + 4) bytes per KV head against S * r * 4."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..errors import InvalidRequestError
from ..kv.formats import KVFormat
from .dense import dense_attention, sdpa
from ..kernels.sparq import fused_decode


@functools.lru_cache(maxsize=None)
def bias_none(device: torch.device) -> torch.Tensor:
    """The kernel's "nothing masked" bias: one empty tensor per device, not an allocation per layer and step."""
    return torch.empty(0, device=device)


@dataclass(frozen=True)
class SparQOptions:
    r: int | None = None  # query components read in step 1; None = head_dim // 4
    k: int = 128  # positions fetched in step 2 (the paper's default)
    local_window: int | None = None  # most recent positions always in the top k; None = k // 4 (paper), 0 = none
    mean_value: bool | None = None  # step 3; None = on for MHA, off for GQA/MQA (the paper's finding)
    k_twice: bool = True  # keep K also dimension-major for step 1 (+50 % KV memory, contiguous reads)

    def resolve(self, head_dim: int, group_size: int) -> "SparQOptions":
        r = self.r if self.r is not None else max(1, head_dim // 4)
        if not 1 <= r <= head_dim:
            raise InvalidRequestError(f"sparq r must be in [1, head_dim={head_dim}], got {r}")
        if self.k < 1:
            raise InvalidRequestError(f"sparq k must be >= 1, got {self.k}")
        window = self.local_window if self.local_window is not None else self.k // 4
        if not 0 <= window <= self.k:
            raise InvalidRequestError(f"sparq local_window must be in [0, k={self.k}], got {window}")
        mean = self.mean_value if self.mean_value is not None else group_size == 1
        return SparQOptions(r, self.k, window, mean, self.k_twice)


def sparq_transfers(S: int, r: int, k: int, d: int, mean_value: bool) -> int:
    """Eq. 11: elements read/written per KV head for one decode step (k clipped to S)."""
    return S * r + 2 * min(k, S) * d + (4 if mean_value else 2) * d


def dense_transfers(S: int, d: int) -> int:
    return 2 * S * d + 2 * d


def sparq_budget(compression: float, S: int, d: int, k_max: int = 128) -> tuple[int, int]:
    """(r, k) whose Eq. 11 transfers (without step 3) are `compression` of dense at context S. Like the paper,
    k is fixed (128) and r carries the budget; at short contexts k shrinks to a quarter of the budget's rows."""
    budget = compression * dense_transfers(S, d)
    k = max(1, min(k_max, int(compression * S / 4)))
    r = round((budget - 2 * k * d - 2 * d) / S)
    return max(1, min(d, r)), k


def window_budget(compression: float, S: int, d: int) -> int:
    """Positions the local-window baseline keeps for the same transfers: 2*k*d + 2*d = compression * dense."""
    return max(1, round((compression * dense_transfers(S, d) - 2 * d) / (2 * d)))


def take_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x[b, h, idx[b, h, j], :] for x [B, H, R, C], idx [B, H, n] -> [B, H, n, C].

    When x is a view of a contiguous buffer (a cache's [B, H, capacity, C] K, or the [B, H, d, capacity] K
    mirror cut to its first S columns), this is one index_select of whole rows over a flat contiguous view of the
    buffer: a memcpy per row. Measured on this CPU: 4-5x faster than gather with an expanded index (element by
    element), and 10x faster than index_select over rows that are not contiguous. Rows cut short (C < row
    stride) are copied whole and narrowed afterwards: the extra columns are the chunk's padding."""
    B, H, R, C = x.shape
    n = idx.shape[-1]
    sb, sh, sr, sc = x.stride()
    per_head = sh // sr if sr else 0
    fits = x.storage_offset() + B * H * sh <= x.untyped_storage().nbytes() // x.element_size()
    if sc != 1 or sr < C or sh != per_head * sr or sb != H * sh or not fits:
        return x.gather(2, idx[..., None].expand(B, H, n, C))
    flat = x.as_strided((B * H * per_head, sr), (sr, 1))
    base = torch.arange(B * H, device=x.device).view(B, H, 1) * per_head
    rows = flat.index_select(0, (idx + base).view(-1)).view(B, H, n, sr)
    return rows if sr == C else rows[..., :C]


def sparq_select(qg: torch.Tensor, Kt: torch.Tensor, bias: torch.Tensor | None, scale: float, r: int, k: int,
                 window: int = 0, kt_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 1-2 selections. qg [B, H_kv, G, d] (the G query heads of each KV head); Kt [B, H_kv, d, S] (as
    stored: a narrow format's values, widened here; int8 values with their columns' scales kt_scale [B, H_kv, S]);
    bias [B, 1, 1, S] (0 visible, finfo.min masked; None = all visible, which saves two passes). Returns i1
    [B, H_kv, r] (query components), s_hat [B, H_kv, G, S] (approximate scores) and i2 [B, H_kv, k] (positions)."""
    B, kvh, G, d = qg.shape
    S = Kt.shape[-1]
    absq = qg.abs()
    i1 = absq.sum(2).topk(r, dim=-1, sorted=False).indices  # [B, H_kv, r]
    q_r = qg.gather(-1, i1[:, :, None, :].expand(B, kvh, G, r))
    K_r = take_rows(Kt, i1).to(qg.dtype)  # r rows of the dimension-major copy: [B, H_kv, r, S]
    ratio = q_r.abs().sum(-1, keepdim=True) / absq.sum(-1, keepdim=True).clamp_min(torch.finfo(qg.dtype).tiny)
    q_r = q_r * (scale / ratio.sqrt())  # Eq. 9's temperature, folded into the r query components
    logits = torch.matmul(q_r, K_r)
    if kt_scale is not None:  # int8: each column's scale, once for the r rows' sum (as the kernel does)
        logits.mul_(kt_scale[:, :, None, :])
    s_hat = torch.softmax(logits if bias is None else logits.add_(bias), dim=-1)
    pick = s_hat.sum(2) if G > 1 else s_hat[:, :, 0].clone()  # [B, H_kv, S]
    if bias is not None:  # a masked column scores finfo.min, below every real one (>= 0): never chosen over one
        pick.add_(bias[:, :, 0, :])
    if window:  # the most recent visible positions are always kept
        tail = pick[..., S - min(window, S):]
        tail.masked_fill_(tail >= 0, float("inf"))
    i2 = pick.topk(min(k, S), dim=-1, sorted=False).indices
    return i1, s_hat, i2


def sparq_attention(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, bias: torch.Tensor | None, scale: float, r: int,
                    k: int, Kt: torch.Tensor | None = None, v_mean: torch.Tensor | None = None,
                    window: int = 0, fused: bool = True, fmt: KVFormat | None = None,
                    kt_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """One decode query per head. q [B, H, 1, d]; K, V [B, H_kv, S, width] (the visible span of the cache, rows
    as `fmt` stores them; None: q's dtype); bias [B, 1, 1, S] or None (nothing masked); Kt: K dimension-major
    ([B, H_kv, d, S], the stored values; with int8 rows their scales kt_scale [B, H_kv, S]; made here when not
    kept); v_mean [B, H_kv, 1, d] turns on step 3. With r = d and k >= S this is dense attention (alpha = 1) over
    the stored rows. Returns the output [B, H, 1, d] and the elements moved (the K rows and K/V positions gathered,
    plus the new k, v and the mean vector's traffic). fused=True runs steps 1-3 in one C++ call (kernels/sparq.py)
    on CPU float32 queries when it builds, reading any KV format as stored."""
    B, H, t, d = q.shape
    kvh = K.shape[1]
    G = H // kvh
    qg = q.reshape(B, kvh, G, d)
    if Kt is None:
        values, kt_scale = (K, None) if fmt is None else fmt.split(K)
        Kt = values.transpose(-1, -2)
    S = Kt.shape[-1]
    moved = B * kvh * sparq_transfers(S, r, k, d, v_mean is not None)
    kernel = fused_decode() if fused and q.device.type == "cpu" and q.dtype == torch.float32 and \
        Kt.stride(-1) == 1 and K.stride(-1) == 1 and K.stride() == V.stride() else None
    if kernel is not None:  # steps 1-3 in one C++ call: same arithmetic as below
        flat_bias = bias_none(q.device) if bias is None else bias[:, 0, 0, :]
        if flat_bias.numel() and flat_bias.stride(-1) != 1:
            flat_bias = flat_bias.contiguous()
        mean = bias_none(q.device) if v_mean is None else v_mean[:, :, 0, :]
        y, _ = kernel(qg, K, V, Kt, bias_none(q.device) if kt_scale is None else kt_scale, flat_bias, mean, S, r, k,
                      window, scale)
        return y.reshape(B, H, t, d), moved
    i1, s_hat, i2 = sparq_select(qg, Kt, bias, scale, r, k, window, kt_scale)
    if v_mean is not None:
        alpha = s_hat.gather(-1, i2[:, :, None, :].expand(B, kvh, G, i2.shape[-1])).sum(-1, keepdim=True)
    K_k, V_k = take_rows(K, i2), take_rows(V, i2)
    if fmt is not None:  # only the k chosen rows are decoded
        K_k, V_k = fmt.decode(K_k, q.dtype), fmt.decode(V_k, q.dtype)
    bias_k = None if bias is None else bias[:, :, 0, :].expand(B, kvh, -1).gather(-1, i2)[:, :, None, :]
    y = sdpa(qg, K_k, V_k, attn_mask=bias_k, scale=scale)
    if v_mean is not None:
        y = alpha * y + (1 - alpha) * v_mean
    return y.reshape(B, H, t, d), moved


def grown(old: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, keep: int,
          device: torch.device) -> torch.Tensor:
    """A zeroed tensor of `shape` holding the first `keep` columns (last axis) of `old` (None: nothing to keep)."""
    out = torch.zeros(shape, dtype=dtype, device=device)
    if old is not None:
        out[..., :keep].copy_(old[..., :keep])
    return out


class SparQAttention:
    """SparQ as an attention backend bound to one cache (a generate() call's or the server's batch). Keeps, per
    layer, the dimension-major K mirror (grown with the cache's capacity, so under BMC it is reallocated once per
    chunk like the cache) and the running sum of visible values for step 3; both are rebuilt from the cache when
    its layout changes (rows join, leave or are regrouped). Counts the elements it reads (`transfers`) and what dense
    attention would have read (`dense_transfers`) over the decode steps. Reads the cache's rows as stored (a
    narrow kv_dtype's bytes): the mirror keeps the stored values, and an int8 mirror its columns' scales."""

    reads_stored = True

    def __init__(self, cache, opts: SparQOptions, group_size: int) -> None:  # cache: KVCache (import cycle)
        self.cache = cache
        self.opts = opts.resolve(cache.head_dim, group_size)
        L = cache.num_layers
        self.Kt: list[torch.Tensor | None] = [None] * L
        self.Kt_scale: list[torch.Tensor | None] = [None] * L  # int8 KV: each mirrored column's scale [B, H_kv, cap]
        self.v_sum: list[torch.Tensor | None] = [None] * L
        self.count: torch.Tensor | None = None  # [B, 1, 1, 1] visible positions per row (same for all layers)
        self.seen = [0] * L  # columns mirrored / summed per layer
        self.layout = cache.layout  # the cache's layout the state was built for
        self.rebuilds = 0  # times the state was rebuilt from the cache after its columns moved
        self.transfers = 0
        self.dense_transfers = 0

    def _reset(self) -> None:
        """The cache's columns moved, left or changed rows (a join, leave, regroup, compaction, accepted draft or
        crop): the state is rebuilt from the cache's columns as the layers next read them, one pass over K (and V
        for the mean) per layout change, not per step."""
        L = self.cache.num_layers
        self.Kt, self.Kt_scale, self.v_sum = [None] * L, [None] * L, [None] * L
        self.count = None
        self.seen = [0] * L
        self.layout = self.cache.layout
        self.rebuilds += 1

    def _track(self, layer: int, K: torch.Tensor, V: torch.Tensor, S: int) -> None:
        """Mirror columns [seen, S) of K (as stored) dimension-major and add their visible values to the running
        sum."""
        if self.layout != self.cache.layout:
            self._reset()
        start, o = self.seen[layer], self.opts
        if start >= S:
            return
        if o.k_twice:
            values, scale = self.cache.format.split(K[:, :, start:S])
            Kt, cap = self.Kt[layer], K.shape[2]
            if Kt is None or Kt.shape[-1] != cap:
                B, kvh, d = K.shape[0], K.shape[1], self.cache.head_dim
                self.Kt[layer] = Kt = grown(Kt, (B, kvh, d, cap), K.dtype, start, K.device)
                if scale is not None:
                    self.Kt_scale[layer] = grown(self.Kt_scale[layer], (B, kvh, cap), torch.float32, start, K.device)
            Kt[..., start:S].copy_(values.transpose(-1, -2))
            if scale is not None:
                self.Kt_scale[layer][..., start:S].copy_(scale)
        if o.mean_value:
            vis = (self.cache.bias[:, :, 0, start:S] == 0).to(self.cache.dtype)  # [B, 1, n]
            add = torch.matmul(vis[:, :, None, :], self.cache.read(V[:, :, start:S]))  # [B, H_kv, 1, d]
            self.v_sum[layer] = add if self.v_sum[layer] is None else self.v_sum[layer] + add
            if layer == 0:
                n = vis.sum(-1)[..., None, None]
                self.count = n if self.count is None else self.count + n
        self.seen[layer] = S

    def __call__(self, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, bias: torch.Tensor, scale: float,
                 layer: int = 0) -> torch.Tensor:
        t = q.shape[2]
        S = self.cache.length + t  # written columns, this forward's included
        self._track(layer, K, V, S)
        o = self.opts
        d, kvh, B = self.cache.head_dim, K.shape[1], K.shape[0]
        if t != 1 or (o.k >= S and o.r == d):  # prefill / verify, or nothing to save: exact attention
            return dense_attention(q, self.cache.read(K), self.cache.read(V), bias, scale, layer)
        v_mean = self.v_sum[layer] / self.count if o.mean_value else None
        Kt = self.Kt[layer][..., :S] if o.k_twice else None
        kt_scale = self.Kt_scale[layer][..., :S] if o.k_twice and self.Kt_scale[layer] is not None else None
        # else every written column is visible: no bias
        masked = self.cache._max_pad > 0 or self.cache.holes or self.cache.window is not None
        out, moved = sparq_attention(q, K[:, :, :S], V[:, :, :S], bias[..., :S] if masked else None, scale, o.r, o.k,
                                     Kt, v_mean, o.local_window, fmt=self.cache.format, kt_scale=kt_scale)
        self.transfers += moved
        self.dense_transfers += B * kvh * dense_transfers(S, d)
        return out


class WindowAttention:
    """The local-window baseline at a given budget (LM-Infinite, as the SparQ paper runs it): each decode query
    attends to the first `sink` (16) visible positions and the most recent k - sink, exactly; the rest is dropped.
    Reads 2*k*d + 2*d elements per KV head and step, as the cache stores them (only those rows are decoded)."""

    reads_stored = True

    def __init__(self, cache, k: int, sink: int | None = None) -> None:
        sink = min(16, k // 2) if sink is None else sink  # LM-Infinite's 16 first positions, fewer for tiny budgets
        if k < 1 or not 0 <= sink <= k:
            raise InvalidRequestError(f"window attention needs k >= 1 and 0 <= sink <= k, got k={k}, sink={sink}")
        self.cache, self.k, self.sink = cache, k, sink
        self.transfers = 0
        self.dense_transfers = 0

    def __call__(self, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, bias: torch.Tensor, scale: float,
                 layer: int = 0) -> torch.Tensor:
        t = q.shape[2]
        S = self.cache.length + t
        if t != 1 or self.k >= S:
            return dense_attention(q, self.cache.read(K), self.cache.read(V), bias, scale, layer)
        B, H, _, d = q.shape
        kvh = K.shape[1]
        first = self.cache.left_pad[:, None] + torch.arange(self.sink, device=q.device)[None, :]
        recent = torch.arange(S - (self.k - self.sink), S, device=q.device)[None, :].expand(B, -1)
        cols = torch.cat([first.clamp_max(S - 1), recent], dim=1)  # [B, k]
        bias_k = bias[:, :, 0, :].gather(-1, cols[:, None, :])
        # a first position that is also a recent one (short rows) would count twice: mask the first copy
        dup = torch.zeros_like(cols, dtype=torch.bool)
        dup[:, : self.sink] = first >= S - (self.k - self.sink)
        bias_k = bias_k.masked_fill(dup[:, None, :], torch.finfo(q.dtype).min)[:, :, None, :]  # [B, 1, 1, k]
        idx = cols[:, None, :, None].expand(B, kvh, self.k, K.shape[-1])
        out = dense_attention(q, self.cache.read(K.gather(2, idx)), self.cache.read(V.gather(2, idx)), bias_k, scale,
                              layer)
        self.transfers += B * kvh * (2 * self.k * d + 2 * d)
        self.dense_transfers += B * kvh * dense_transfers(S, d)
        return out
