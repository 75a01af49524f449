"""Shared-prefix attention (bifurcated attention / Hydragen): a prefix KV stored once per group of rows, attended
by all the group's queries as one matrix-matrix product, merged exactly with each row's own suffix attention
through their log-sum-exps:

    O = (O_p * exp(LSE_p) + O_s * exp(LSE_s)) / (exp(LSE_p) + exp(LSE_s))

so the prefix is read once per group per step instead of once per row (B-fold less memory traffic and storage)."""
from __future__ import annotations

from typing import Callable

import torch


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over k/v ([..., S, d]) that also returns the log-sum-exp of the scores ([..., rows, 1]).
    On CPU, torch's fused flash kernel returns both (faster than the unfused formula: docs/performance.md)."""
    if _CPU_FLASH is not None and q.device.type == "cpu" and q.dim() == 4 and q.dtype == torch.float32:
        out, lse = _CPU_FLASH(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
        return out, lse.unsqueeze(-1)
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if bias is not None:
        s = s + bias
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(s - lse), v), lse


def merge_by_lse(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    lse = torch.logaddexp(lse1, lse2)
    return o1 * torch.exp(lse1 - lse) + o2 * torch.exp(lse2 - lse)


class SharedPrefix:
    """Shared KV segments in front of every row's own cache: a tree of shared prefixes (Hydragen's hierarchical
    sharing), e.g. a few-shot header shared by all rows, then each prompt's text shared by its samples. Each segment
    is the KV of G groups, [L, 2, G, H_kv, P, d] with a [G, 1, 1, P] bias (left padding of shorter prompts masked),
    and for every batch row the group it reads; rows of a group are contiguous. A segment is attended as one
    matrix-matrix product per group and merged with the others and the row's suffix through log-sum-exps."""

    def __init__(self, kv: torch.Tensor, bias: torch.Tensor, group: torch.Tensor,
                 parent: "SharedPrefix | None" = None, read: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 ) -> None:
        """`parent`: the segments in front of this one (already reordered to this batch's rows). `read`: the
        cache's decoding of its stored rows into values (KVCache.read), for a kv_dtype other than the model's."""
        self.segments: list[tuple[torch.Tensor, torch.Tensor, list[int]]] = list(parent.segments) if parent else []
        self.segments.append((kv, bias, group.tolist()))
        self.read = read if read is not None else (parent.read if parent else None)
        self._reindex()

    @classmethod
    def of_segments(cls, segments: list[tuple[torch.Tensor, torch.Tensor, list[int]]],
                    read: Callable[[torch.Tensor], torch.Tensor] | None = None) -> "SharedPrefix":
        """Segments given whole: (kv, bias, group) each, a row's group -1 where it does not read that segment (the
        served batch, where each row reads the cached nodes of its own prompt's path)."""
        self = cls.__new__(cls)
        self.segments, self.read = list(segments), read
        self._reindex()
        return self

    @property
    def nbytes(self) -> int:
        return sum(kv.numel() * kv.element_size() for kv, _, _ in self.segments)

    @property
    def num_groups(self) -> int:
        return sum(kv.shape[2] for kv, _, _ in self.segments)

    def reorder(self, rows: torch.Tensor) -> None:
        """Rows kept / permuted / forked in the suffix cache; the shared KV itself never moves."""
        idx = rows.tolist()
        self.segments = [(kv, bias, [group[i] for i in idx]) for kv, bias, group in self.segments]
        self._reindex()

    def _reindex(self) -> None:  # what the attention paths read per step; changes only on reorder
        self._spans = [self.spans(g) for _, _, g in self.segments]
        self._native = ([kv for kv, _, _ in self.segments], [b for _, b, _ in self.segments],
                        [torch.tensor(g, dtype=torch.long) for _, _, g in self.segments])

    def native_segments(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """(kv, bias, group) per segment for the native CPU step (bmc.kernels), which attends them in one softmax
        with the row's own cache."""
        return self._native

    @staticmethod
    def spans(group: list[int]) -> list[tuple[int, int, int]]:
        """(group, first row, end row) runs of consecutive rows that read the segment (group >= 0)."""
        out: list[tuple[int, int, int]] = []
        for b, g in enumerate(group):
            if g < 0:
                continue
            if out and out[-1][0] == g and out[-1][2] == b:
                out[-1] = (g, out[-1][1], b + 1)
            else:
                out.append((g, b, b + 1))
        return out

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float,
                  layer: int = 0) -> torch.Tensor:
        """q [B, H, t, d]; k, v: the rows' suffix cache views [B, H_kv, S, d] with their bias (from group_bias)."""
        B, H, t, d = q.shape
        kvh = k.shape[1]
        rows = (H // kvh) * t
        qg = q.reshape(B, kvh, rows, d)
        o, lse = attention_with_lse(qg, k, v, bias, scale)
        for (kv, pbias, _), spans in zip(self.segments, self._spans):
            # a row that does not read the segment keeps its state: an empty one merged (weight exp(-inf) = 0)
            o_p, lse_p = torch.zeros_like(o), torch.full_like(lse, float("-inf"))
            pk, pv = kv[layer, 0], kv[layer, 1]
            if self.read is not None:
                pk, pv = self.read(pk), self.read(pv)
            for g, a, b in spans:  # one GEMM per group: every query row of the group against it
                n = b - a
                qs = qg[a:b].transpose(0, 1).reshape(1, kvh, n * rows, d)
                og, lg = attention_with_lse(qs, pk[g : g + 1], pv[g : g + 1], pbias[g : g + 1], scale)
                o_p[a:b] = og.view(kvh, n, rows, d).transpose(0, 1)
                lse_p[a:b] = lg.view(kvh, n, rows, 1).transpose(0, 1)
            merged = torch.logaddexp(lse_p, lse)
            o, lse = o_p * torch.exp(lse_p - merged) + o * torch.exp(lse - merged), merged
        return o.reshape(B, H, t, d)
