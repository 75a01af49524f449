"""Prompt KV kept across requests: the prefix cache (llama-server's cache_prompt, vLLM's automatic prefix caching).

Indexed by chained blocks of BLOCK token ids, as vLLM indexes it: a block's key is (its parent's number, its own
ids), a flat tuple, so hashing a key costs its BLOCK ids and not the whole chain before it,
so a lookup walks the new prompt block by block and stops at the first block not stored. Why blocks and not a radix
tree of whole prompts: the system prompt or conversation that many prompts share is stored once (each block once),
eviction frees whole blocks without splitting tensors, and a lookup costs one dict probe per block. Keys hold the ids
themselves, not a hash of them, so two prompts never share a block by collision. A `salt` (vLLM's cache_salt) is
the root of the chain: prompts under different salts never share a block.

A block holds its tokens' K and V as the cache stores them ([L, 2, H_kv, BLOCK, width]: the KV format's bytes,
int8 scales included), copied out of a request's prefill cache once its prompt is done, and copied into a new
request's prefill cache on a hit (`seed`): the hit's columns are then written as that request's own, and the rest
of its prompt is prefilled after them, as a prompt chunk. Nothing reads a block in place, so evicting one never
disturbs a running request. Eviction is least-recently-used under a byte budget; a lookup refreshes a chain from
its last block back to its first, so a parent is always more recent than its children and leaves go first."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Hashable

import torch

from .kv import KVCache

BLOCK = 16  # tokens a block; also the granularity of a hit (vLLM's default block size)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up (vLLM's prefix_cache_queries, in tokens)
    hits: int = 0  # of those, tokens found (prefix_cache_hits)
    inserted_blocks: int = 0
    evicted_blocks: int = 0


@dataclass
class _Block:
    key: tuple[Hashable, tuple[int, ...]]  # (the parent block's number or the salt root, this block's token ids)
    parent: tuple | None  # the parent block's key (None: the chain's first block)
    number: int  # this block's name in its children's keys
    kv: torch.Tensor  # [L, 2, H_kv, BLOCK, width] as the cache stores it
    children: int = 0  # blocks whose parent this is (a block with children is not evicted before them)


@dataclass
class PrefixCache:
    budget_bytes: int
    format_name: str  # the KV format every stored block is in (the batch cache's)
    blocks: "collections.OrderedDict[tuple, _Block]" = field(default_factory=collections.OrderedDict)  # LRU first
    nbytes: int = 0
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    _numbers: int = 0

    @staticmethod
    def _block_ids(ids: list[int]) -> list[tuple[int, ...]]:
        """The full blocks of `ids`, in order."""
        return [tuple(ids[start : start + BLOCK]) for start in range(0, len(ids) - BLOCK + 1, BLOCK)]

    def _walk(self, ids: list[int], salt: str | None) -> tuple[list[_Block], list[tuple[int, ...]]]:
        """The stored blocks `ids` starts with, and the full blocks of `ids` after them."""
        found: list[_Block] = []
        ref: Hashable = ("salt", salt)
        blocks = self._block_ids(ids)
        for block_ids in blocks:
            block = self.blocks.get((ref, block_ids))
            if block is None:
                break
            found.append(block)
            ref = block.number
        return found, blocks[len(found):]

    def match(self, ids: list[int], salt: str | None) -> list[_Block]:
        """The stored blocks a prompt starts with, leaving at least its last token to prefill (its logits give the
        first generated token). Counts the lookup in `stats` and refreshes the blocks found."""
        found, _ = self._walk(ids[:-1], salt)
        for block in reversed(found):  # the first block ends up most recent: leaves are evicted before parents
            self.blocks.move_to_end(block.key)
        self.stats.queries += len(ids)
        self.stats.hits += len(found) * BLOCK
        return found

    def seed(self, cache: KVCache, blocks: list[_Block]) -> int:
        """Write `blocks` into row 0 of an empty prefill cache as its first columns; returns the tokens written."""
        n = len(blocks) * BLOCK
        if not n:
            return 0
        assert cache.length == 0 and cache.batch_size == 1 and cache.format.name == self.format_name
        cache.reserve(n, torch.arange(n, device=cache.device)[None])
        dst = cache.kv[:, :, 0, :, :n]
        for j, block in enumerate(blocks):
            dst[:, :, :, j * BLOCK : (j + 1) * BLOCK].copy_(block.kv)
        cache.commit(n)
        return n

    def insert(self, ids: list[int], cache: KVCache, salt: str | None) -> None:
        """Keep the full blocks of a prefilled prompt (row 0 of `cache`, written from column 0) that are not kept yet,
        then evict least-recently-used blocks until the budget holds."""
        assert cache.format.name == self.format_name and int(cache.left_pad[0]) == 0
        chain, new = self._walk(ids[: cache.length], salt)
        parent = chain[-1] if chain else None
        for block_ids in new:
            j = len(chain)
            kv = cache.kv[:, :, 0, :, j * BLOCK : (j + 1) * BLOCK].clone()
            key = (parent.number if parent is not None else ("salt", salt), block_ids)
            self._numbers += 1
            block = _Block(key, parent.key if parent is not None else None, self._numbers, kv)
            self.blocks[key] = block
            self.nbytes += kv.numel() * kv.element_size()
            self.stats.inserted_blocks += 1
            if parent is not None:
                parent.children += 1
            chain.append(block)
            parent = block
        for block in reversed(chain):  # refresh the chain, last block first (see match)
            self.blocks.move_to_end(block.key)
        self._evict()

    def _evict(self) -> None:
        while self.nbytes > self.budget_bytes and self.blocks:
            victim = next((b for b in self.blocks.values() if b.children == 0), None)
            if victim is None:
                break
            del self.blocks[victim.key]
            self.nbytes -= victim.kv.numel() * victim.kv.element_size()
            self.stats.evicted_blocks += 1
            if victim.parent is not None:
                self.blocks[victim.parent].children -= 1

    def clear(self) -> None:
        self.blocks.clear()
        self.nbytes = 0

    def check_integrity(self) -> None:
        """Invariants: the bytes counted are the bytes held and within the budget; every block's parent is stored
        (the root aside) and its children count is right."""
        held = sum(b.kv.numel() * b.kv.element_size() for b in self.blocks.values())
        assert held == self.nbytes, "nbytes counts the blocks held"
        assert self.nbytes <= self.budget_bytes or not any(b.children == 0 for b in self.blocks.values()), \
            "within the budget"
        counts: collections.Counter = collections.Counter()
        for block in self.blocks.values():
            if block.parent is not None:
                parent = self.blocks.get(block.parent)
                assert parent is not None and block.key[0] == parent.number, "a block's parent is stored"
                counts[block.parent] += 1
        assert all(b.children == counts[k] for k, b in self.blocks.items()), "children counts"
