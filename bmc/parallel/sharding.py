"""Which query and KV heads each tensor-parallel rank holds: seed 004's policy for MQA/GQA ("Multi-Query Attention
is All You Need", section on sharding).

K/V heads do not split like query heads: a KV head serves a whole group of G query heads, and a query head must
sit on a rank that holds its KV head. Two levels:
  1. at least as many KV heads as ranks: the KV heads are divided across the ranks, each taking the whole query
     group of every KV head it holds (no KV replicated; MHA is the case G = 1);
  2. fewer KV heads than ranks (MQA, GQA with few groups): the ranks are divided among the KV heads, each KV head
     replicated on its share of ranks, and the query heads of its group divided among those ranks.
Where the counts do not divide, the parts differ by one (the first ones larger): the ranks then hold different
head counts, each with a cache of its own heads only."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankHeads:
    q_heads: tuple[int, ...]  # the rank's query heads (global indices, ascending)
    kv_heads: tuple[int, ...]  # its KV heads (global indices, ascending; replicated ones appear on several ranks)


def split_even(items: range | list[int], parts: int) -> list[list[int]]:
    """`items` in `parts` contiguous runs whose lengths differ by at most one, the longer ones first."""
    items = list(items)
    base, extra = divmod(len(items), parts)
    out, at = [], 0
    for p in range(parts):
        n = base + (1 if p < extra else 0)
        out.append(items[at : at + n])
        at += n
    return out


def shard_heads(num_heads: int, num_kv_heads: int, world: int) -> list[RankHeads]:
    """Each rank's heads under the two-level policy above; ValueError where a rank would hold no query head or a
    KV head would span ranks unevenly (fewer KV heads than ranks and the ranks not a multiple of them)."""
    if world < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"heads {num_heads}, KV heads {num_kv_heads}, world {world}: not a valid layout")
    G = num_heads // num_kv_heads
    if num_kv_heads >= world:  # level 1: KV heads (with their whole groups) across the ranks
        return [RankHeads(tuple(q for kv in part for q in range(kv * G, (kv + 1) * G)), tuple(part))
                for part in split_even(range(num_kv_heads), world)]
    if world % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads over {world} ranks: with fewer KV heads than ranks, the ranks must "
                         "be a multiple of the KV heads (each KV head replicated on as many ranks)")
    share = world // num_kv_heads  # ranks per KV head
    if G < share:
        raise ValueError(f"{num_heads} query heads in groups of {G} over {world} ranks: {share} ranks per KV head "
                         f"would leave some without a query head")
    out = []
    for kv in range(num_kv_heads):  # level 2: the group's query heads across the KV head's ranks
        for part in split_even(range(kv * G, (kv + 1) * G), share):
            out.append(RankHeads(tuple(part), (kv,)))
    return out
