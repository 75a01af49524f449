"""Prompt KV kept across requests: the prefix cache (llama-server's cache_prompt, vLLM's automatic prefix caching,
SGLang's RadixAttention).

A radix tree over token ids whose edges are runs of whole blocks (BLOCK tokens in the server, one token in the
cache generate() keeps for one call): a node holds its run's ids and their K and V as one tensor,
[L, 2, 1, H_kv, len, width] (the cache's format, int8 scales included), which is exactly the shape of a shared
segment in the attention kernels (bmc/attention/shared_prefix.py, the native step). So a request whose prompt
starts with cached tokens reads them in place, as Hydragen reads a shared prefix: every row whose path runs
through a node reads that one copy, once per step for all of them, and its own cache holds only the tokens after
it. Why a radix tree of runs and not vLLM's chained hashes of single blocks: a segment must be contiguous for the
kernel to read it as one matrix product, and a run stays contiguous (a 2000-token system prompt is one node, not
125 blocks to gather every step).

- Matching walks the tree from the salt's root (vLLM's cache_salt: prompts under different salts share nothing)
  and stops at the first block not stored; it leaves at least the prompt's last token to prefill (its logits give
  the first generated token). A match that ends inside a node splits it: the head becomes a new parent and the
  original node keeps the tail, both views of the same tensor (nothing is copied, a running row's path is kept).
- Children are keyed by their first block's ids, so two runs that diverge inside a block never share it.
- A new run is merged into the chain of ancestors above it that no request reads and that have no other child
  (one new tensor), so a conversation kept turn after turn stays one node: one segment, not one per turn.
- A request that reads a path in place locks its last node; a locked node and its ancestors are never evicted.
- Eviction is least-recently-used among unlocked leaves, until the bytes held fit the budget. Bytes are counted
  by tensor storage: a node split into views of one tensor frees it when the last view goes.
- Keys hold the ids themselves, not a hash of them, so two prompts never share KV by collision."""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .platform.hugepages import empty_mapped, whole_mapping
from .kv import KVCache

BLOCK = 16  # tokens a block: the granularity of a hit and of a split (vLLM's default block size)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up (vLLM's prefix_cache_queries, in tokens)
    hits: int = 0  # of those, tokens found (prefix_cache_hits)
    inserted_blocks: int = 0
    evicted_blocks: int = 0


@dataclass(eq=False)
class Node:
    ids: tuple[int, ...]  # this run's token ids (whole blocks); () for a root
    kv: torch.Tensor | None  # [L, 2, 1, H_kv, len(ids), width] as the cache stores it; None for a root
    parent: "Node | None"
    start: int = 0  # tokens on the path before this run
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)  # by their first block's ids
    locks: int = 0  # requests reading this node's path in place (never evicted while > 0)
    stamp: int = 0  # last use, for LRU
    _bias: torch.Tensor | None = None
    # a node that owns a growable slab (a CPU mapping with room for the cache's max_length columns, pages written
    # as used): [L, 2, 1, H_kv, max_length, width], kv being its columns [at, at + len); None: kv is all it has
    _slab: torch.Tensor | None = None
    _at: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.ids)

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """The segment's additive bias for the kernels, in the model's dtype (the scores'): [1, 1, 1, len] of zeros
        (every column is read)."""
        if self._bias is None or self._bias.shape[-1] != len(self.ids) or self._bias.dtype != dtype:
            assert self.kv is not None
            self._bias = torch.zeros(1, 1, 1, len(self.ids), dtype=dtype, device=self.kv.device)
        return self._bias

    def path(self) -> list["Node"]:
        """The nodes from the root's first child down to this one."""
        out: list[Node] = []
        node: Node | None = self
        while node is not None and node.kv is not None:
            out.append(node)
            node = node.parent
        return out[::-1]




class PrefixCache:
    def __init__(self, budget_bytes: int, format_name: str, block: int = BLOCK, max_length: int = 0) -> None:
        """max_length: the longest path (a conversation's nodes grow in place up to it on a CPU; 0: no growth)."""
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.block = block  # tokens a block (generate()'s cache for one call: 1, any common length is shared)
        self.budget_bytes = budget_bytes
        self.format_name = format_name  # the KV format every node is in (the batch cache's)
        self.roots: dict[str | None, Node] = {}
        self.nbytes = 0
        self.stats = PrefixCacheStats()
        self.version = 0  # bumped when a node is split or evicted (a running batch's segment table is rebuilt)
        self._storages: dict[int, list[int]] = {}  # storage pointer -> [nodes viewing it, its bytes]
        self._locked: dict[int, Node] = {}  # nodes with locks > 0, by id
        self._written: dict[int, int] = {}  # slab storages: the bytes of the columns written (the rest is unmapped)
        self.max_length = max_length
        self._clock = itertools.count(1)

    def _storage(self, kv: torch.Tensor) -> tuple[int, int]:
        """A node tensor's storage and the bytes it holds (a slab's: what was written of it)."""
        s = kv.untyped_storage()
        ptr = s.data_ptr()
        return ptr, self._written.get(ptr, s.nbytes())

    # ---- lookups -------------------------------------------------------------------------------------
    def match(self, ids: list[int], salt: str | None, count: bool = True) -> Node | None:
        """The deepest node whose path the prompt starts with, in whole blocks and leaving at least the prompt's
        last token to prefill; None on a miss. A match that ends inside a node splits it there. Counts the lookup
        in `stats` (unless `count` is False) and refreshes the path."""
        self.stats.queries += len(ids) if count else 0
        usable = (len(ids) - 1) // self.block * self.block
        node = self.roots.get(salt)
        found: Node | None = None
        pos = 0
        while node is not None and pos < usable:
            child = node.children.get(tuple(ids[pos : pos + self.block]))
            if child is None:
                break
            n = _common_blocks(child.ids, ids[pos:usable], self.block)
            if n < len(child.ids):
                child = self._split(child, n)
            found, node, pos = child, child, pos + n
        if found is None:
            return None
        self.stats.hits += found.end if count else 0
        self._touch(found)
        return found

    def peek(self, ids: list[int], salt: str | None) -> int:
        """The tokens match() would find, without splitting, counting or refreshing anything."""
        usable = (len(ids) - 1) // self.block * self.block
        node, pos = self.roots.get(salt), 0
        while node is not None and pos < usable:
            child = node.children.get(tuple(ids[pos : pos + self.block]))
            if child is None:
                break
            n = _common_blocks(child.ids, ids[pos:usable], self.block)
            pos += n
            node = child if n == len(child.ids) else None
        return pos

    def lock(self, node: Node) -> None:
        node.locks += 1
        self._locked[id(node)] = node

    def unlock(self, node: Node) -> None:
        assert node.locks > 0
        node.locks -= 1
        if node.locks == 0:
            del self._locked[id(node)]
        self._evict()

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the storages that running requests read in place (locked paths): part of what the running batch
        holds, never evicted; the budget bounds the rest (nbytes - pinned_bytes)."""
        storages: dict[int, int] = {}
        for node in self._locked.values():
            for seg in node.path():
                if seg.parent is not None and seg.parent.children.get(seg.ids[:self.block]) is seg:  # still in the tree
                    ptr, nbytes = self._storage(seg.kv)  # type: ignore[arg-type]
                    storages[ptr] = nbytes
        return sum(storages.values())

    def seed(self, cache: KVCache, node: Node) -> int:
        """Copy the path of `node` into row 0 of an empty prefill cache as its first columns (the copy-in mode, for
        attention that reads no shared segments); returns the tokens written."""
        n = node.end
        assert cache.length == 0 and cache.batch_size == 1 and cache.format.name == self.format_name
        cache.reserve(n, torch.arange(n, device=cache.device)[None])
        dst = cache.kv[:, :, 0:1, :, :n]
        for seg in node.path():
            assert seg.kv is not None
            dst[:, :, :, :, seg.start : seg.end].copy_(seg.kv)
        cache.commit(n)
        return n

    # ---- insertion and eviction ----------------------------------------------------------------------
    def insert(self, ids: list[int], cache: KVCache, salt: str | None, cache_start: int = 0) -> None:
        """Keep the whole blocks of a prefilled prompt that are not kept yet: row 0 of `cache` holds the tokens from
        position `cache_start` on, written from its column 0 (a request that read `cache_start` tokens in place
        holds only the rest). Then evict least-recently-used leaves until the budget holds."""
        assert cache.format.name == self.format_name and int(cache.left_pad[0]) == 0
        self.insert_span(ids, cache.kv[:, :, 0:1, :, : cache.length], salt, cache_start)

    def insert_span(self, ids: list[int], kv: torch.Tensor, salt: str | None, start: int) -> None:
        """insert() from a span of stored KV: kv [L, 2, 1, H_kv, n, width] holds the tokens at positions
        start .. start + n - 1 of `ids` (a prompt cache's row, or a finished row's columns in the batch cache)."""
        end = min(len(ids), start + int(kv.shape[4])) // self.block * self.block
        cache_start = start
        node = self.roots.setdefault(salt, Node((), None, None))
        pos = 0
        while pos < end:
            child = node.children.get(tuple(ids[pos : pos + self.block]))
            if child is None:
                break
            n = _common_blocks(child.ids, ids[pos:end], self.block)
            if n < len(child.ids):
                child = self._split(child, n)
            node, pos = child, pos + n
        if pos < end and pos >= cache_start:
            src = kv[:, :, :, :, pos - cache_start : end - cache_start]
            self.stats.inserted_blocks += (end - pos) // self.block
            new = Node(tuple(ids[pos:end]), src, node, start=pos)
            node.children[new.ids[:self.block]] = new
            node = self._coalesce(new, counted=False)
        elif node.kv is not None and not node.children and node.locks == 0:
            node = self._coalesce(node, counted=True)  # nothing new: the path's last run may still merge up
        if node.kv is not None:
            self._touch(node)
            node.locks += 1  # older leaves go first
            self._evict()
            node.locks -= 1
            self._evict()  # and the new run too, if it alone does not fit

    def _coalesce(self, leaf: Node, counted: bool) -> Node:
        """Merge a leaf with the chain of ancestors above it that no request reads and that have no other child,
        into one tensor of its own: a conversation kept turn after turn stays one node (one segment for the kernels
        to read), for the price of copying that chain once a turn. `counted`: the leaf's kv is a node's own tensor
        already counted (else a view of someone else's, which is copied in any case). Returns the node that now
        holds the leaf's run."""
        chain = [leaf]
        while True:
            parent = chain[0].parent
            if parent is None or parent.kv is None or parent.locks or len(parent.children) != 1:
                break
            chain.insert(0, parent)
        if counted and len(chain) == 1:
            return leaf
        top, tail = chain[0], chain[1:]
        if counted or len(chain) > 1:  # chain[0] is a node's own tensor: append in place where its slab has room
            grow = sum(len(n.ids) for n in tail)
            if top._slab is not None and top._at + len(top.ids) + grow <= top._slab.shape[4]:
                self._append(top, tail, counted)
                return top
        parts = [n.kv for n in chain]
        width = sum(int(kv.shape[4]) for kv in parts)  # type: ignore[union-attr]
        first = parts[0]
        assert first is not None
        # a run stored alone gets a tensor of its size; a chain that merged is a conversation: room to grow
        slab = self._new_slab(first, width) if len(chain) > 1 else torch.empty(
            (*first.shape[:4], width, first.shape[5]), dtype=first.dtype, device=first.device)
        merged = slab[:, :, :, :, :width]
        at = 0
        for kv in parts:
            assert kv is not None
            merged[:, :, :, :, at : at + kv.shape[4]].copy_(kv)
            at += kv.shape[4]
        if slab.shape[4] > width:  # a growable slab: only its written columns count
            self._written[merged.untyped_storage().data_ptr()] = self._column_bytes(first) * width
        self._count(merged, +1)
        for n in chain if counted else chain[:-1]:
            self._count(n.kv, -1)  # type: ignore[arg-type]
        top.ids, top.kv, top.children, top._bias = tuple(i for n in chain for i in n.ids), merged, {}, None
        _unlink(chain[1:])
        top._slab, top._at = (slab, 0) if slab.shape[4] > width else (None, 0)
        if len(chain) > 1:
            self.version += 1  # a running batch's segment table may hold the old tensors
        return top

    @staticmethod
    def _column_bytes(kv: torch.Tensor) -> int:
        L, two, b, H, _, width = kv.shape
        return L * two * b * H * width * kv.element_size()

    def _new_slab(self, like: torch.Tensor, width: int) -> torch.Tensor:
        """A tensor for `width` columns of a node: on a CPU, a view of a mapping with room for max_length columns
        per (layer, K/V, head) slab, whose pages cost memory only once written (later turns are appended in place:
        no copy, no second tensor); else exactly `width` columns."""
        L, two, b, H, _, w = like.shape
        cap = max(self.max_length, width)
        if like.device.type != "cpu" or self.max_length <= width:
            return torch.empty((L, two, b, H, width, w), dtype=like.dtype, device=like.device)
        flat = whole_mapping(empty_mapped((1,), like.dtype, reserve=L * two * b * H * cap * w))
        if flat.numel() < L * two * b * H * cap * w:  # the reservation was refused: a tensor of its own size
            return torch.empty((L, two, b, H, width, w), dtype=like.dtype, device=like.device)
        return flat.as_strided((L, two, b, H, cap, w), (two * b * H * cap * w, b * H * cap * w, H * cap * w,
                                                         cap * w, w, 1))

    def _append(self, top: Node, tail: list[Node], counted: bool) -> None:
        """Write the runs of `tail` (top's only descendants, in order) after top's columns in its slab (`counted`:
        as _coalesce's)."""
        assert top._slab is not None and top.kv is not None
        end = top._at + len(top.ids)
        for n in tail:
            assert n.kv is not None
            top._slab[:, :, :, :, end : end + n.kv.shape[4]].copy_(n.kv)
            end += n.kv.shape[4]
        grown = self._column_bytes(top.kv) * (end - top._at - len(top.ids))
        ptr = top.kv.untyped_storage().data_ptr()
        self._written[ptr] = self._written.get(ptr, 0) + grown
        self._storages[ptr][1] += grown
        self.nbytes += grown
        for n in tail if counted else tail[:-1]:  # an uncounted last one is a view of someone else's tensor
            self._count(n.kv, -1)  # type: ignore[arg-type]
        top.ids = top.ids + tuple(i for n in tail for i in n.ids)
        top.kv, top.children, top._bias = top._slab[:, :, :, :, top._at : end], {}, None
        _unlink(tail)
        self.version += 1

    def _split(self, node: Node, n: int) -> Node:
        """Cut `node` after its first n tokens: a new parent takes the head; `node` keeps the tail and its children
        (so the path of a request that locked it is unchanged). Both are views of the same tensor."""
        assert 0 < n < len(node.ids) and n % self.block == 0 and node.kv is not None and node.parent is not None
        head = Node(node.ids[:n], node.kv[:, :, :, :, :n], node.parent, start=node.start, stamp=node.stamp)
        node.parent.children[head.ids[:self.block]] = head
        node.ids, node.kv, node.start, node.parent = node.ids[n:], node.kv[:, :, :, :, n:], node.start + n, head
        node._at += n  # the tail keeps the slab's room after it; the head has a child after it
        head.children[node.ids[:self.block]] = node
        self._count(head.kv, +1)  # type: ignore[arg-type]
        self.version += 1
        return head

    def _touch(self, node: Node) -> None:
        """Refresh the path, the last node first: a parent is always more recent than its children."""
        for seg in reversed(node.path()):
            seg.stamp = next(self._clock)

    def _count(self, kv: torch.Tensor, delta: int) -> None:
        ptr, nbytes = self._storage(kv)
        entry = self._storages.setdefault(ptr, [0, nbytes])
        if entry[0] == 0:
            self.nbytes += nbytes
        entry[0] += delta
        if entry[0] == 0:
            self.nbytes -= entry[1]
            del self._storages[ptr]
            self._written.pop(ptr, None)

    def _evictable(self, node: Node) -> bool:
        return not node.children and node.locks == 0 and node.kv is not None

    def _evict(self) -> None:
        if self.nbytes <= self.budget_bytes:
            return
        heap = [(n.stamp, id(n), n) for n in self.nodes() if self._evictable(n)]
        heapq.heapify(heap)
        while self.nbytes > self.budget_bytes and heap:
            _, _, victim = heapq.heappop(heap)
            parent = victim.parent
            assert parent is not None and victim.kv is not None
            del parent.children[victim.ids[:self.block]]
            self._count(victim.kv, -1)
            self.stats.evicted_blocks += len(victim.ids) // self.block
            self.version += 1
            if self._evictable(parent):
                heapq.heappush(heap, (parent.stamp, id(parent), parent))

    def nodes(self) -> list[Node]:
        out: list[Node] = []
        todo = list(self.roots.values())
        while todo:
            node = todo.pop()
            if node.kv is not None:
                out.append(node)
            todo.extend(node.children.values())
        return out

    def clear(self) -> None:
        self.roots.clear()
        self._locked.clear()
        self._storages.clear()
        self.nbytes = 0
        self.version += 1

    def check_integrity(self) -> None:
        """Invariants: the bytes counted are the storages the nodes view, within the budget unless only locked
        paths are left; every node is a whole number of blocks at the position its parent ends, keyed by its first
        block; stamps never decrease toward the root."""
        storages: dict[int, int] = {}
        for node in self.nodes():
            assert node.kv is not None and node.parent is not None
            assert len(node.ids) > 0 and len(node.ids) % self.block == 0 and node.kv.shape[4] == len(node.ids), \
                "a node is whole blocks, its KV as long as its ids"
            assert node.start == node.parent.end, "a node starts where its parent ends"
            assert node.parent.children.get(node.ids[:self.block]) is node, "keyed by its first block"
            assert node.parent.kv is None or node.parent.stamp >= node.stamp, "a parent is as recent as its children"
            ptr, nbytes = self._storage(node.kv)
            storages[ptr] = nbytes
        assert sum(storages.values()) == self.nbytes, "nbytes counts the storages the nodes view"
        assert self.nbytes <= self.budget_bytes or not any(self._evictable(n) for n in self.nodes()), \
            "within the budget, or only locked paths are left"
        assert self.nbytes - self.pinned_bytes <= self.budget_bytes, "what running requests do not read fits"
        assert all(n.locks > 0 for n in self._locked.values()), "the locked set holds the locked nodes"


def _unlink(merged: list[Node]) -> None:
    """Nodes merged into another one leave the tree: their links go, so that no parent/child cycle keeps them (and
    the tensors they view, a finished row's batch cache among them) alive until the garbage collector's next pass."""
    for n in merged:
        n.children, n.parent = {}, None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token lists (slices compared in C, by bisection)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_blocks(run: tuple[int, ...], ids: list[int], block: int) -> int:
    """Tokens of whole blocks at the start of `run` that `ids` starts with."""
    return common_prefix(run, tuple(ids[: len(run)])) // block * block
