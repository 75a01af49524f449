"""The KV cache interface shared by every allocation strategy.

Layout: one tensor `kv` of shape [L, 2, B, H_kv, capacity, d] per cache, contiguous, or (grow_in_place, a CPU
decode cache) a view of a mapping whose (layer, K/V, row, head) slabs have room for max_length columns. So a chunk
boundary is a single allocation + copy for all layers, or a widening of the view with no copy at all, and
`kv[l, 0]` / `kv[l, 1]` are [B, H_kv, capacity, d] views whose rows the attention kernels read as plain dense
matrices (no paging, no gather). With a `kv_dtype` other than the
model's, the last axis holds each row as its format stores it (formats.py: int8 values and their scale) and
`read` gives the values.

Rows are left-padded: every row writes the same column `length`; a row's prompt padding and every column at or
beyond `length` are hidden by an additive bias of finfo.min (never by softmax over zeros). The bias is one
[B, 1, 1, capacity] tensor kept up to date in place (one column write per step), reused by all layers.

A sliding window (Mistral: a query at position p attends keys at positions in (p - window, p]) is the same bias:
the cache keeps each column's position (`col_pos`, [B, capacity]), and `reserve` masks, in the kept bias, every
column that has left the window of the forward's first query (positions only grow, so it never comes back);
a forward of several queries (prefill, a verify tree) gets the rest per query in `attention_bias`. Positions,
not column indices: speculative acceptance leaves masked holes, after which the two differ.

Strategies differ only in how much capacity they allocate when they run out (`_grow_to`):
iterative = exactly what is needed (a concat every token), upfront = the maximum length at once,
bmc = the next multiple of r.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Sequence

import torch

from ..platform.hugepages import empty_mapped, whole_mapping
from .formats import KVFormat, kv_format


class KVCache(ABC):
    name: ClassVar[str]
    # Whether the capacity beyond `length` is padding a speculative tree may use (bmc's chunk, upfront's buffer).
    # An iterative cache has none: HF DynamicCache crops rejected draft rows and concatenates the next step's.
    keeps_padding: ClassVar[bool] = True

    def __init__(
        self,
        *,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_length: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        left_pad: Sequence[int] | None = None,
        window: int | None = None,
        window_every_layer: bool = True,
        kv_dtype: str | None = None,
    ) -> None:
        self.num_layers, self.batch_size = num_layers, batch_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.max_length = max_length
        self.dtype, self.device = dtype, torch.device(device)
        # how rows are stored (kv_dtype, formats.py): the model's dtype by default; else each layer's K and V are
        # encoded as they are written and decoded for the PyTorch attention paths (the native step reads them as
        # stored)
        self.format: KVFormat = kv_format(kv_dtype, dtype)
        # an int8 cache's keys as k / s (kv/smoothing.py), set by engine.make_cache; None: as they come
        self.key_scales: Any = None
        self.same_dtype = self.format.storage == dtype and self.format.width(head_dim) == head_dim
        self.width = self.format.width(head_dim)
        self.min_value = torch.finfo(dtype).min
        pads = list(left_pad) if left_pad is not None else [0] * batch_size
        if len(pads) != batch_size:
            raise ValueError(f"left_pad has {len(pads)} entries for batch size {batch_size}")
        self.left_pad = torch.tensor(pads, dtype=torch.long, device=self.device)
        self._max_pad = max(pads, default=0)  # host copy: no device sync on the decode path
        self.length = 0  # columns written (the same for every row: rows are left-padded)
        self.kv = torch.empty((num_layers, 2, batch_size, num_kv_heads, 0, self.width), dtype=self.format.storage,
                              device=self.device)
        self.bias = torch.empty((batch_size, 1, 1, 0), dtype=dtype, device=self.device)
        self.write_at: torch.Tensor | None = None  # CUDA graphs: the write column as a device index (see graphs.py)
        self.holes = False  # set once rows accepted different speculative counts (masked columns inside)
        # bumped whenever written columns move, leave or change rows (everything but reserve / commit / growth):
        # attention state kept by column (SparQ's K mirror and value sum) is rebuilt when it changes
        self.layout = 0
        self.allocations = 0  # times the cache grew: a new KV tensor allocated and the old one copied (the T)
        self.peak_bytes = 0  # largest KV footprint seen, old + new tensor during a copy included
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        # False: the window is some layers' only (Gemma 2/3): the kept bias stays the full causal one, every column
        # stays (the other layers read it) and those layers' bias comes from window_bias() per forward
        self.window_every_layer = window_every_layer
        self.keep_spare = False  # keep the last KV tensor a copy left for the next copy (see _replace_kv)
        # CPU decode caches: each (row, KV head) slab of the KV tensor's mapping has room for max_length columns,
        # so a growth widens the view in place, nothing copied (see _new_kv and _widen)
        self.grow_in_place = False
        # drop the columns that left every row's window at a reallocation; off for attention backends that keep
        # state by column (SparQ's K copy)
        self.compact_window = True
        self.spare: torch.Tensor | None = None
        # CUDA graphs: a DeviceArena (graphs.py) this cache borrows its KV and bias from while it holds rows, so that
        # every call's buckets have the same addresses (set by the scheduler, with grow_in_place; never with a
        # sliding window, whose compaction would move columns within it); arena_rows: the most rows it will hold
        self.arena: Any = None
        self.arena_rows = 0
        # elements written so far in the spare's storage and in the KV tensor's (the pages they hold: a CPU mapping
        # reserves more address space than it has written)
        self.spare_written = 0
        self._kv_written = 0
        # sliding window only: each column's position, and per row the last position that left the window
        self.col_pos = torch.zeros((batch_size, 0), dtype=torch.long, device=self.device) if window else None
        self.window_floor = torch.full((batch_size,), -1, dtype=torch.long, device=self.device) if window else None

    # ---- growth policy -------------------------------------------------------------------------
    @abstractmethod
    def _grow_to(self, needed: int) -> int:
        """Capacity to allocate when `needed` columns do not fit in the current capacity."""

    # ---- the verbs -----------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.kv.shape[4]

    def get_seq_length(self) -> int:
        return self.length

    def reserve(self, num_new: int, positions: torch.Tensor | None = None) -> None:
        """Make room for `num_new` columns at `length` (allocating + copying if they do not fit) and open their
        bias columns; rows' left padding stays masked. Called once per forward, before the layers run.
        `positions` ([B, num_new], the new tokens' positions) is required with a sliding window."""
        needed = self.length + num_new
        if needed > self.capacity:
            # with a sliding window, the copy leaves behind the leading columns no row will read again: the cache
            # of a windowed model stops growing at about window + r columns however long the run
            drop = self.dead_prefix() if self.window is not None and self.compact_window else 0
            self._reallocate(self._grow_to(needed - drop), drop)
            needed -= drop
        start, end = self.length, needed
        cols = self.bias[:, :, :, start:end]
        cols.zero_()
        if start < self._max_pad:  # prompt padding columns (prefill only)
            idx = torch.arange(start, end, device=self.device)
            cols.masked_fill_((idx[None, :] < self.left_pad[:, None])[:, None, None, :], self.min_value)
        if self.window is not None:
            self._slide_window(start, end, positions)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               decoded: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v ([B, H_kv, t, d]) in place at columns [length, length + t); return the layer's
        full-capacity K and V views ([B, H_kv, capacity, d]): their values, or with decoded=False the rows as
        stored ([B, H_kv, capacity, width], for an attention that reads the format itself: SparQ)."""
        t = k.shape[2]
        kv = self.kv[layer]
        if not self.same_dtype:
            k, v = self.format.encode(k), self.format.encode(v)
        if self.write_at is not None and t == 1:  # a captured decode step: the column comes from a device tensor
            kv[0].index_copy_(2, self.write_at, k)
            kv[1].index_copy_(2, self.write_at, v)
        else:
            kv[0, :, :, self.length : self.length + t].copy_(k)
            kv[1, :, :, self.length : self.length + t].copy_(v)
        return (self.read(kv[0]), self.read(kv[1])) if decoded else (kv[0], kv[1])

    def read(self, stored: torch.Tensor) -> torch.Tensor:
        """Rows as stored in this cache's format ([..., width]) -> their values in the model's dtype (the tensor
        itself when the cache stores the model's dtype)."""
        return stored if self.same_dtype else self.format.decode(stored, self.dtype)

    def commit(self, num_new: int) -> None:
        """Advance the written length after all layers wrote `num_new` columns."""
        self.length += num_new

    def accept(self, keep: Sequence[Sequence[int]], num_new: int) -> int:
        """After a forward wrote `num_new` columns at `length` (a verified draft tree), keep for each row the
        block-relative columns keep[b] (in order), moved to [length, length + len(keep[b])) by one gather + copy
        over all layers; everything else in the block becomes masked padding again. Rows may keep different
        counts: a shorter row's unused columns stay masked (a hole its later queries never see). Advances
        `length` by the longest row and returns that count."""
        m = max(len(k) for k in keep)
        start = self.length
        if any(list(k) != list(range(len(k))) for k in keep):  # a branch other than the first: move it
            src = torch.tensor([list(k) + [0] * (m - len(k)) for k in keep], dtype=torch.long, device=self.device)
            L, two, B, H, _, d = self.kv.shape
            block = self.kv[:, :, :, :, start : start + num_new]
            moved = torch.gather(block, 4, src.view(1, 1, B, 1, m, 1).expand(L, two, B, H, m, d))
            self.kv[:, :, :, :, start : start + m].copy_(moved)
            if self.col_pos is not None:
                span = self.col_pos[:, start : start + num_new]
                self.col_pos[:, start : start + m] = span.gather(1, src)
        cols = self.bias[:, 0, 0, start : start + num_new]
        cols.fill_(self.min_value)
        counts = torch.tensor([len(k) for k in keep], device=self.device)
        cols[:, :m].masked_fill_(torch.arange(m, device=self.device)[None, :] < counts[:, None], 0.0)
        self.holes = self.holes or any(len(k) != m for k in keep)
        self.length = start + m
        self.layout += 1
        return m

    def crop(self, length: int) -> None:
        """Forget every column at or beyond `length` (rejected speculative rows); they become masked padding."""
        if not 0 <= length <= self.length:
            raise ValueError(f"crop to {length} outside [0, {self.length}]")
        self.bias[:, :, :, length : self.length].fill_(self.min_value)
        self.length = length
        self.layout += 1
        self._recount_holes()

    def reorder(self, rows: torch.Tensor) -> None:
        """Keep / permute batch rows (finished rows dropped, samples forked); `rows` indexes the batch."""
        rows = rows.to(self.device)
        old = self.nbytes
        if self.on_arena:  # the rows leave the arena first: the new view overlaps the old one
            moved = self.kv.index_select(2, rows)
            new, written = self._new_kv(tuple(moved.shape))
            new.copy_(moved)
            self._replace_kv(new, written)
        elif self.grow_in_place and self.device.type == "cpu":  # into slabs with room to grow, row by row
            L, two, _, H, cap, width = self.kv.shape
            new, written = self._new_kv((L, two, int(rows.numel()), H, cap, width))
            for i, src in enumerate(rows.tolist()):
                new[:, :, i].copy_(self.kv[:, :, src])
            self._replace_kv(new, written)
        else:
            self.kv = self.kv.index_select(2, rows)
            self._kv_written = self.kv.numel()
        self.peak_bytes = max(self.peak_bytes, old + self.nbytes)  # both alive while the rows are copied
        self._set_bias(self.bias.index_select(0, rows))
        if self.col_pos is not None:
            self.col_pos = self.col_pos.index_select(0, rows)
            self.window_floor = self.window_floor.index_select(0, rows)
        self.left_pad = self.left_pad.index_select(0, rows)
        self._max_pad = int(self.left_pad.max()) if rows.numel() else 0
        self.batch_size = int(rows.numel())
        self.layout += 1
        self._recount_holes()

    def hide_leading(self, row: int, n: int) -> None:
        """Make row `row`'s first n written columns left padding (they are read from elsewhere: a shared segment);
        `place` and `regroup` then copy only the columns after them."""
        assert 0 <= n <= self.length
        self.bias[row, ..., :n] = self.min_value
        self.left_pad[row] = max(int(self.left_pad[row]), n)
        self._max_pad = int(self.left_pad.max())
        self.layout += 1

    def retire(self, rows: Sequence[int]) -> None:
        """Rows whose requests left, without a copy: every written column of theirs becomes left padding. The slot
        stays in the tensor (its later columns are written and read by no one) until `place` fills it with a new
        request or `regroup` drops it."""
        idx = torch.tensor(list(rows), dtype=torch.long, device=self.device)
        self.bias[idx, :, :, : self.length] = self.min_value
        self.left_pad[idx] = self.length
        self._max_pad = self.length if len(rows) else self._max_pad
        self.layout += 1

    def place(self, row: int, src: "KVCache", src_row: int = 0) -> bool:
        """Write row `src_row` of `src` (a prefilled request) into batch row `row` (a retired slot), right-aligned on
        the write column: one row's columns copied, nothing else moved. False when it has more columns than the
        batch's length (then `regroup` re-aligns every row)."""
        self._check_format(src)
        lead = int(src.left_pad[src_row])
        n = src.length - lead
        if n > self.length:
            return False
        at, end = self.length - n, self.length
        self.kv[:, :, row, :, at:end] = src.kv[:, :, src_row, :, lead : src.length]
        self.bias[row, ..., :at] = self.min_value
        self.bias[row, ..., at:end] = src.bias[src_row, ..., lead : src.length]
        self.left_pad[row] = at + int(src.left_pad[src_row]) - lead
        self._max_pad = int(self.left_pad.max())
        if self.col_pos is not None:
            self.col_pos[row, at:end] = src.col_pos[src_row, lead : src.length] if src.col_pos is not None else (
                torch.arange(lead, src.length, device=self.device) - src.left_pad[src_row]).clamp(min=0)
            self.window_floor[row] = src.window_floor[src_row] if src.window_floor is not None else -1
        self.holes = self.holes or src.holes
        self.layout += 1
        return True

    def regroup(self, keep: Sequence[int], joins: Sequence["KVCache | tuple[KVCache, Sequence[int]]"] = ()) -> None:
        """Continuous batching's one copy: keep the batch rows `keep` (in that order), append every row of the
        caches in `joins` (prefilled requests, each written up to its own `length`; a (cache, rows) pair appends
        those rows of it, a row repeated for each sample that starts from it), and drop the leading columns
        that no row reads (the padding every row has: the compaction). Rows stay right-aligned on one write
        column: the new length is the longest row's and every other row is left-padded by the difference, so a
        row that joined late wastes at most the columns of the oldest row still running. Capacity follows the
        strategy's growth rule with room for one more token. One allocation and one copy of the written columns;
        on a CPU cache that grows in place, keeping every row in its slot and joining none (the compaction) moves
        each row's columns within its own slab instead: nothing allocated, and no spare needed (it is released)."""
        keep_idx = torch.tensor(list(keep), dtype=torch.long, device=self.device)
        parts = [(self, keep_idx)]
        for j in joins:
            cache, rows = j if isinstance(j, tuple) else (j, range(j.batch_size))
            self._check_format(cache)
            parts.append((cache, torch.tensor(list(rows), dtype=torch.long, device=self.device)))
        spans = []  # per part: (first column any of its rows reads, its length)
        for cache, rows in parts:
            lead = cache.dead_prefix(rows) if rows.numel() else cache.length
            spans.append((lead, cache.length))
        length = max((end - lead for lead, end in spans), default=0)
        B = sum(int(rows.numel()) for _, rows in parts)
        L, _, _, H, _, d = self.kv.shape
        capacity = self._grow_to(length + 1)
        in_place = (not joins and self.grow_in_place and (self.device.type == "cpu" or self.on_arena)
                    and B == self.batch_size > 0 and list(keep) == list(range(B)) and capacity <= self.slab_columns)
        own = None  # the kept rows' columns, taken out of the arena before the new view (over them) is written
        if not in_place and self.on_arena and keep_idx.numel():
            own = self.kv[:, :, :, :, spans[0][0] : spans[0][1]].index_select(2, keep_idx)
        if in_place:  # the same slabs, viewed at the new capacity
            kv, written = self.kv.as_strided((L, 2, B, H, capacity, d), self.kv.stride()), self._kv_written
        else:
            kv, written = self._new_kv((L, 2, B, H, capacity, d))
            kv[:, :, :, :, length:].zero_()  # padding must be finite (0 * NaN garbage would poison attention) ...
        bias = torch.full((B, 1, 1, capacity), self.min_value, dtype=self.dtype, device=self.device)
        col_pos = torch.zeros((B, capacity), dtype=torch.long, device=self.device) if self.window else None
        floors, pads, holes, b = [], [], False, 0
        for (cache, rows), (lead, end) in zip(parts, spans):
            n = int(rows.numel())
            if n == 0:
                continue
            at = length - (end - lead)  # where the part's first read column lands
            if not in_place:
                kv[:, :, b : b + n, :, :at].zero_()  # ... and so must the left padding; the rest is overwritten
            for i, src in enumerate(rows.tolist()):  # row by row: one strided copy each, no gathered temporary
                columns = own[:, :, i] if own is not None and cache is self else cache.kv[:, :, src, :, lead:end]
                if in_place and at != lead:  # within its own slab: an overlapping move goes through one row's copy
                    kv[:, :, b + i, :, at:length].copy_(columns.clone() if abs(at - lead) < end - lead else columns)
                elif not in_place:
                    kv[:, :, b + i, :, at:length].copy_(columns)
            if in_place:
                kv[:, :, b : b + n, :, :at].zero_()
            bias[b : b + n, ..., at:length] = cache.bias[..., lead:end].index_select(0, rows)
            pads.append(cache.left_pad.index_select(0, rows) - lead + at)
            if col_pos is not None:
                src = cache.col_pos[:, lead:end] if cache.col_pos is not None else (
                    torch.arange(lead, end, device=self.device)[None, :] - cache.left_pad[:, None]).clamp(min=0)
                col_pos[b : b + n, at:length] = src.index_select(0, rows)
                floors.append(cache.window_floor.index_select(0, rows) if cache.window_floor is not None
                              else torch.full((n,), -1, dtype=torch.long, device=self.device))
            holes = holes or cache.holes
            b += n
        if in_place:
            kv[:, :, :, :, length:].zero_()  # what the moves left behind: padding, kept finite
            self.kv, self._kv_written = kv, max(written, kv.numel())
            self.spare, self.spare_written = None, 0
            self.peak_bytes = max(self.peak_bytes, self.nbytes)
        else:
            self.peak_bytes = max(self.peak_bytes, self.nbytes + kv.numel() * kv.element_size())
            self._replace_kv(kv, written)
        self._set_bias(bias)
        self.length, self.batch_size = length, B
        if B == 0:
            self.spare = None  # idle: no KV memory held at all
        self.left_pad = torch.cat(pads) if pads else torch.zeros(0, dtype=torch.long, device=self.device)
        self._max_pad = int(self.left_pad.max()) if B else 0
        if col_pos is not None:
            self.col_pos = col_pos
            self.window_floor = torch.cat(floors) if floors else torch.zeros(0, dtype=torch.long, device=self.device)
        self.holes = holes
        self.layout += 1
        self._recount_holes()
        self.allocations += 1 if B and not in_place else 0  # emptied or moved in place: nothing allocated

    def attention_bias(self, num_new: int, visible: torch.Tensor | None = None) -> torch.Tensor:
        """Additive bias for the `num_new` queries of this forward: [B, 1, num_new, capacity]. Causal inside the
        new block, or `visible` ([B, num_new, num_new] bool, e.g. a draft tree's ancestor mask); for one query it is
        the cache's own [B, 1, 1, capacity] tensor (no per-step construction)."""
        if visible is not None:
            out = self.bias.repeat(1, 1, num_new, 1)
            block = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
            out[:, 0, :, self.length : self.length + num_new] = block.masked_fill_(~visible, self.min_value)
            return self._window_queries(out, num_new)
        if num_new == 1:
            return self.bias
        start = self.length
        q = torch.arange(num_new, device=self.device)[:, None]
        c = torch.arange(self.capacity, device=self.device)[None, :] - start
        future = (c > q) & (c < num_new)  # later tokens of the same block; columns >= start+num_new already masked
        # masked_fill, not bias + causal: a padding column that is also a future one must stay finfo.min, not -inf
        return self._window_queries(self.bias.repeat(1, 1, num_new, 1).masked_fill_(future, self.min_value), num_new)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def check_integrity(self) -> None:
        """Invariants every strategy must keep; raises AssertionError naming the broken one."""
        L, two, B, H, cap, d = self.kv.shape
        assert (L, two, B, H, d) == (self.num_layers, 2, self.batch_size, self.num_kv_heads, self.width), "kv shape"
        slab = self.slab_columns
        assert self.kv.numel() == 0 or (slab >= cap and self.kv.stride() == (
            two * B * H * slab * d, B * H * slab * d, H * slab * d, slab * d, d, 1)), \
            "kv is contiguous, or slabs of equal room"
        assert self.left_pad.shape == (B,), "one left_pad per row"
        assert self._max_pad == (int(self.left_pad.max()) if B else 0), "max pad matches left_pad"
        assert self.bias.shape == (B, 1, 1, cap), "bias shape"
        assert 0 <= self.length <= cap, "length within capacity"
        assert torch.all(self.bias[..., self.length :] == self.min_value), "padding rows beyond length are masked"
        if self.col_pos is not None:
            assert self.col_pos.shape == (B, cap), "one position per column"
        written = self.bias[..., : self.length]
        assert torch.all((written == 0) | (written == self.min_value)), "bias holds only 0 (visible) or min (masked)"
        hidden = self._hidden_columns()
        assert torch.all(written[hidden] == self.min_value), "prompt padding is masked, and so is what left the sliding window"
        if not self.holes:
            assert torch.all(written[~hidden] == 0), "written columns are visible"
        assert all(torch.isfinite(self.read(self.kv[i])).all() for i in range(L)), \
            "no NaN/inf in KV rows (padding rows are zero-filled)"
        if self.spare is not None:  # the next growth writes it: it must not be (a view of) the live tensor
            spare_at = self.spare.untyped_storage().data_ptr()
            assert spare_at != self.kv.untyped_storage().data_ptr(), "the spare is not the KV tensor's storage"
            assert self.spare_written <= self.spare.numel(), "the spare's written count within its storage"

    # ---- internals -----------------------------------------------------------------------------
    def _check_format(self, src: "KVCache") -> None:
        """Rows move between caches as stored bytes: both must store the same format."""
        if src.format is not self.format:
            raise ValueError(f"a {src.format.name} KV cache's rows cannot join a {self.format.name} one")
        if src.key_scales is not self.key_scales:
            raise ValueError("a KV cache's rows cannot join one whose keys are stored with other channel scales")

    def _slide_window(self, start: int, end: int, positions: torch.Tensor | None) -> None:
        """Record the new columns' positions and mask, in the kept bias, the columns the forward's first query no
        longer sees (position <= its position - window): no later query sees them either."""
        if positions is None:
            raise ValueError("a sliding-window cache needs the new tokens' positions in reserve()")
        positions = positions.to(self.device, torch.long).expand(self.batch_size, end - start)
        self.col_pos[:, start:end] = positions
        if not self.window_every_layer:
            return
        self.window_floor = torch.maximum(self.window_floor, positions[:, 0] - self.window)
        # the new columns too: a live row's are past its floor, a retired slot's dummy token (position 0) is not
        left = self.col_pos[:, :end] <= self.window_floor[:, None]
        self.bias[:, 0, 0, :end].masked_fill_(left, self.min_value)

    def _window_queries(self, bias: torch.Tensor, num_new: int) -> torch.Tensor:
        """A forward's [B, 1, num_new, capacity] bias with each query's own window applied (the kept bias has the
        first query's); unchanged without a window."""
        if self.window is None or num_new == 1 or not self.window_every_layer:
            return bias
        q_pos = self.col_pos[:, self.length : self.length + num_new]  # the queries are the new columns
        left = self.col_pos[:, None, :] <= (q_pos - self.window)[:, :, None]  # [B, num_new, capacity]
        return bias.masked_fill_(left[:, None], self.min_value)

    def window_bias(self, bias: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A forward's bias ([B, 1, t or 1, capacity], tree masks included) for the layers with the sliding window,
        where only some layers have it: each query (at `positions`, [B, t]) also masks the columns at positions
        <= its own - window. Device ops only: a CUDA graph replays it with the step's positions."""
        left = self.col_pos[:, None, None, :] <= (positions.to(self.device) - self.window)[:, None, :, None]
        return bias.masked_fill(left, self.min_value)

    def grid_origin(self) -> torch.Tensor | None:
        """[B] int64 on the CPU, for a forward whose new columns are reserved: each row's column of its position 0,
        where a window on every layer lets the cache drop the columns that left every row's window (negative once
        its first keys are dropped); None otherwise.
        The native attention counts a row's spans and chunks from there (the keys before its first column read as
        masked), so a row's arithmetic does not depend on when its cache dropped columns, nor on where its prompt's
        chunks began (each query's window start moves with them)."""
        if self.col_pos is None or not self.window_every_layer or self.capacity == 0:
            return None
        # the forward's first new column (reserved: its position is written), where every row writes
        c = min(self.length, self.capacity - 1)
        return (c - self.col_pos[:, c]).cpu()

    def _recount_holes(self) -> None:
        """After a crop or reorder that may have removed every hole: look again (only while the flag is set, so
        the plain decode path never pays this host sync), so integrity keeps its strict check and SparQ drops
        its bias once no written column is masked."""
        if self.holes:
            self.holes = bool((self.bias[..., : self.length] != 0).logical_and_(~self._hidden_columns()).any())

    def _hidden_columns(self) -> torch.Tensor:
        """[B, 1, 1, length]: the written columns masked by design, not by a speculative hole: each row's prompt
        padding and, with a sliding window, the columns that have left it."""
        col = torch.arange(self.length, device=self.device)
        hidden = col[None, :] < self.left_pad[:, None]
        if self.col_pos is not None:
            hidden = hidden | (self.col_pos[:, : self.length] <= self.window_floor[:, None])
        return hidden[:, None, None, :]

    def _new_kv(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, int]:
        """Storage for a new KV tensor, and the elements its storage has had written (the pages it holds): the
        spare when it is large enough, else a fresh allocation. On a CPU a fresh one is a mapping with address space
        for this batch at the maximum length (a page costs memory only once written). With grow_in_place the tensor
        is a view of it whose (row, KV head) slabs are max_length columns apart, so that a growth only widens the
        view (_widen); otherwise it is contiguous and, with keep_spare, the two mappings a growth copies between
        serve every later growth: each page is faulted in once per run, not once per copy (see _replace_kv)."""
        L, two, B, H, capacity, width = shape
        n = math.prod(shape)
        if n == 0:  # no rows (an idle batch): a view of a mapping would keep all of it alive
            if self.arena is not None:
                self.arena.release(self)
            return torch.empty(shape, dtype=self.format.storage, device=self.device), 0
        if self.arena is not None:
            if self.arena.lend(self, B, max(capacity, self.max_length), self.arena_rows):
                self.spare, self.spare_written = None, 0
                self.peak_bytes = max(self.peak_bytes, self.arena.nbytes)
                return self.arena.kv_view(shape), n
            self.arena.release(self)
        in_place = self.grow_in_place and self.device.type == "cpu"
        slab = max(capacity, self.max_length) if in_place else capacity
        total = L * two * B * H * slab * width
        if self.spare is not None and self.spare.numel() >= total:
            buf, written = self.spare, max(self.spare_written, n)
            self.spare, self.spare_written = None, 0
        elif self.device.type == "cpu":  # fresh pages cost more than the copy: a mapping to grow into (hugepages.py)
            reserve = max(total, L * two * B * H * max(capacity, self.max_length) * width)
            buf, written = whole_mapping(empty_mapped((n,), self.format.storage, reserve=reserve)), n
            if buf.numel() < total:  # strict overcommit refused the reservation: a contiguous tensor, grown by copies
                slab, total = capacity, n
        else:
            return torch.empty(shape, dtype=self.format.storage, device=self.device), n
        return buf[:total].as_strided(shape, (two * B * H * slab * width, B * H * slab * width, H * slab * width,
                                              slab * width, width, 1)), written

    @property
    def on_arena(self) -> bool:
        """Whether the KV tensor is a view of the arena this cache holds (graphs.py)."""
        return self.arena is not None and self.arena.holder() is self and self.arena.holds(self.kv)

    def _set_bias(self, bias: torch.Tensor) -> None:
        """`bias` ([B, 1, 1, capacity], a tensor of its own) becomes the cache's: copied into the arena's bias
        rows when the KV tensor is on the arena (a graph reads it there), else taken as it is."""
        if self.on_arena:
            view = self.arena.bias_view(bias.shape[0], bias.shape[3])
            view.copy_(bias)
            bias = view
        self.bias = bias

    @property
    def slab_columns(self) -> int:
        """Columns each (row, KV head) slab of the KV tensor has room for: its capacity when it is contiguous,
        max_length when the cache grows in place."""
        return self.kv.stride(3) // self.width if self.kv.numel() else self.capacity

    def _widen(self, new_capacity: int) -> None:
        """A growth without a copy: the KV view takes the next columns of its slabs (zeroed: padding must be
        finite, and a reused mapping holds old rows); the bias and column positions are re-made, as small as
        one column per row."""
        old = self.capacity
        L, two, B, H, _, width = self.kv.shape
        self.kv = self.kv.as_strided((L, two, B, H, new_capacity, width), self.kv.stride())
        self.kv[:, :, :, :, old:].zero_()
        self._kv_written = max(self._kv_written, self.kv.numel())
        self._regrow_columns(new_capacity, 0)
        self.peak_bytes = max(self.peak_bytes, self.nbytes)
        self.allocations += 1

    def _regrow_columns(self, new_capacity: int, drop: int) -> None:
        """The bias and column positions at `new_capacity` columns, holding the written columns from `drop` on
        (everything past them is masked padding)."""
        B, keep = self.batch_size, self.length - drop
        bias = torch.full((B, 1, 1, new_capacity), self.min_value, dtype=self.dtype, device=self.device)
        bias[..., :keep].copy_(self.bias[..., drop : self.length])
        self._set_bias(bias)
        if self.col_pos is not None:
            col_pos = torch.zeros((B, new_capacity), dtype=torch.long, device=self.device)
            col_pos[:, :keep].copy_(self.col_pos[:, drop : self.length])
            self.col_pos = col_pos

    def _replace_kv(self, new: torch.Tensor, written: int) -> None:
        """`new` (from _new_kv) becomes the KV tensor. With keep_spare the old one's storage, all of it (a CPU
        mapping's reserve too), becomes the next copy's target (the larger of the two is kept). Fresh pages cost
        more than the copy itself (page faults on VM-backed memory: docs/performance.md, "Figures behind the code's
        choices"). So a cache holds up to twice its KV instead. Only for a cache whose tensors nobody else holds (the scheduler's batch,
        a generate() or chat decode cache). A tensor of fewer rows than the old one keeps no spare: the batch is
        draining, and memory held for the copies of a larger batch would outlast it."""
        old, old_written = self.kv, max(self._kv_written, self.kv.numel())
        self.kv, self._kv_written = new, written
        if not self.keep_spare or new.shape[2] < old.shape[2]:  # fewer rows: the batch is draining, let it go
            return
        if self.arena is not None and (self.arena.holds(old) or self.arena.holds(new)):
            return  # the arena is never a spare, and a cache on it needs none
        flat = whole_mapping(old)
        if flat.numel() and (self.spare is None or flat.numel() > self.spare.numel()):
            self.spare, self.spare_written = flat, old_written

    @property
    def spare_nbytes(self) -> int:
        """Memory the spare holds: the pages written in it, not the address space it reserves."""
        return self.spare_written * self.format.storage.itemsize if self.spare is not None else 0

    def dead_prefix(self, rows: torch.Tensor | None = None) -> int:
        """How many leading columns no row (of `rows`, default all) reads now or later: each row's prompt padding
        and, with a sliding window, what left its window."""
        if self.length == 0 or self.batch_size == 0:
            return 0
        hidden = self._hidden_columns()[:, 0, 0]
        if rows is not None:
            hidden = hidden.index_select(0, rows)
        read = ~hidden.all(dim=0)  # columns some row still reads
        return int(read.to(torch.int8).argmax()) if bool(read.any()) else self.length

    def _reallocate(self, new_capacity: int, drop: int = 0) -> None:
        """A new tensor of `new_capacity` columns holding the written columns from `drop` on (the leading `drop`
        columns are read by no row: see dead_prefix): columns beyond `length` are masked padding or rejected draft
        rows, never read unmasked, so they are not copied."""
        if drop == 0 and self.grow_in_place and self.capacity < new_capacity <= self.slab_columns:
            self._widen(new_capacity)
            return
        old, keep = self.kv, self.length - drop
        L, _, B, H, _, d = old.shape
        new, written = self._new_kv((L, 2, B, H, new_capacity, d))
        new[:, :, :, :, :keep].copy_(old[:, :, :, :, drop : self.length])
        new[:, :, :, :, keep:].zero_()  # padding must be finite: 0 * NaN garbage would poison attention
        self._regrow_columns(new_capacity, drop)
        if drop:
            self.length = keep
            self.layout += 1
            self.left_pad = (self.left_pad - drop).clamp_(min=0)
            self._max_pad = int(self.left_pad.max()) if B else 0
        self.peak_bytes = max(self.peak_bytes, old.numel() * old.element_size() + new.numel() * new.element_size())
        self._replace_kv(new, written)
        self.allocations += 1
