"""generate() and stream() as clients of the engine's step loop (Scheduler.step, scheduler.py), as vLLM's LLM.generate
is a client of its engine: every prompt of the call is a request, the step loop prefills them (all in the first
step, each as it would be prefilled alone), decodes them as one continuous batch and samples each by its own
generator, and this module turns the requests' tokens into TokenEvents and the run's GenerationStats.

The call's scheduler has a prefix cache of its own, with blocks of one token: a leading part common to prompts
(a system prompt, few-shot examples: at least MIN_SHARED_PREFIX tokens) is prefilled once and read in place by the
others, and the samples of one prompt read its KV in place (Hydragen); it is dropped when the call ends.

Every option runs here: approximate attention rebuilds its state by column when rows join or leave
(KVCache.layout), drafters take rows as they join, and each sampled row verifies its drafts with its own
generator."""
from __future__ import annotations

import collections
import time
from typing import Iterator

import torch

from .engine import (MIN_SHARED_PREFIX, GenerationConfig, GenerationStats, TokenEvent, _pack_weights, _synchronize,
                     check_length, kv_bytes_per_token)
from .engine_options import EngineOptions
from .models import Model
from .prefix_cache import common_prefix
from .scheduler import Request, Scheduler, TokenOutput, prefix_cache_unsupported, reads_in_place
from .spec import TreeSpec


def prompt_tokens_to_cache(prompt_ids: list[list[int]], num_samples: int) -> list[int]:
    """How many leading tokens of each prompt the call's prefix cache keeps: all of them where its samples read it
    (num_samples > 1); else the most it shares with another prompt of the call where that is at least
    MIN_SHARED_PREFIX (a prompt's longest common prefix with any other is with a neighbour in sorted order), and
    none otherwise: the rest would be stored for no reader."""
    if num_samples > 1:
        return [len(p) for p in prompt_ids]
    keep = [0] * len(prompt_ids)
    order = sorted(range(len(prompt_ids)), key=lambda i: prompt_ids[i])
    for a, b in zip(order, order[1:]):
        n = common_prefix(prompt_ids[a], prompt_ids[b])
        if n >= MIN_SHARED_PREFIX:
            keep[a], keep[b] = max(keep[a], n), max(keep[b], n)
    return keep


def make_engine(model: Model, prompt_ids: list[list[int]], gen: GenerationConfig, max_length: int,
                cached: list[int]) -> Scheduler:
    """A scheduler for the call: a seat for every row, every prompt prefilled in the first step, a prefix cache
    (blocks of one token) that can hold the `cached` leading tokens of each prompt once, nothing else."""
    rows = len(prompt_ids) * gen.num_samples
    verify_rows = 1 + (TreeSpec.parse(gen.tree).size if gen.speculative != "off" else 0)  # a root and its tree
    budget = 0
    if gen.share_prefix == "auto" and any(cached) and prefix_cache_unsupported(model, max_length) is None:
        budget = int(kv_bytes_per_token(model, gen.kv_dtype) * sum(cached))
    return Scheduler(model, EngineOptions(
        max_num_seqs=rows, max_num_batched_tokens=sum(len(p) for p in prompt_ids) + rows * verify_rows + 1,
        kv=gen.kv, r=gen.r, T=gen.T, kv_dtype=gen.kv_dtype, attention=gen.attention,
        attention_options=gen.attention_options, speculative=gen.speculative, tree=gen.tree, spec_max_tokens=None,
        spec_trim=not gen.spec_grow, prefix_cache_bytes=budget, cuda_graphs=gen.cuda_graphs, max_length=max_length,
        run_ahead=gen.run_ahead,
        adaptive_threads=gen.adaptive_threads, prefix_block=1, min_shared=MIN_SHARED_PREFIX, keep_turns=False))


@torch.inference_mode()
def generate_on_steps(model: Model, prompt_ids: list[list[int]], gen: GenerationConfig,
                      stats: GenerationStats) -> Iterator[TokenEvent]:
    """Every prompt a request of one scheduler; its steps run until every request is done. A request that fails
    raises its error here."""
    max_length = check_length(model, prompt_ids, gen)
    # samples read their prompt's blocks in place; where hits are copied in, only prompts sharing a prefix gain
    in_place = reads_in_place(model, gen.attention, gen.speculative, max_length)
    cached = prompt_tokens_to_cache(prompt_ids, gen.num_samples if in_place else 1)
    engine = make_engine(model, prompt_ids, gen, max_length, cached)
    events: collections.deque[tuple[int, TokenOutput | BaseException]] = collections.deque()
    for i, ids in enumerate(prompt_ids):
        request = Request(ids, gen, lambda out, i=i: events.append((i, out)), device=model.device,
                          cache_prompt=cached[i] > 0)
        request.cache_limit = cached[i]
        engine.add(request)
    rows = len(prompt_ids) * gen.num_samples
    stats.batch_size, stats.max_length, stats.kv_strategy = rows, max_length, gen.kv
    stats.prompt_tokens = sum(len(p) for p in prompt_ids)
    weight_bytes, tokenizer = model.weight_bytes, model.tokenizer
    pc = engine.prefix_cache
    if gen.graph_warmup:
        engine.capture_ladder(rows)
    t0 = time.perf_counter()
    t_decode: float | None = None
    while engine.has_work():
        steps = engine.counters.decode_steps
        if t_decode is None and not (engine.num_waiting or engine.prefilling):
            _synchronize(model.device)  # every prompt is prefilled: the decode phase starts
            t_decode = time.perf_counter()
            stats.prefill_seconds = t_decode - t0
        live = engine.live_rows
        if live:
            _pack_weights(model, len(live), gen.max_new_tokens - max(r.count for r in live), stats)
        engine.step()
        if engine.counters.decode_steps > steps:
            weights = weight_bytes if not model.config.num_experts else model.step_weight_bytes(len(live))
            stats.decode_bytes += weights + engine.cache.nbytes + (pc.pinned_bytes if pc is not None else 0)
        if pc is not None:
            stats.prefix_kv_bytes = max(stats.prefix_kv_bytes, pc.pinned_bytes)
            stats.prefix_groups = max(stats.prefix_groups, engine.shared_segments)
        while events:
            i, out = events.popleft()
            if isinstance(out, BaseException):
                raise out
            stats.generated_tokens += 1
            yield TokenEvent(i, out.sample_index, out.token_id, out.text if tokenizer is not None else None,
                             out.finish_reason)
    _synchronize(model.device)
    end = time.perf_counter()
    if t_decode is None:  # every request ended in its prefill (max_new_tokens=1): the whole call was prefill
        stats.prefill_seconds = end - t0
    stats.decode_seconds = end - (t_decode if t_decode is not None else end)
    finish_stats(stats, model, engine, rows)


def finish_stats(stats: GenerationStats, model: Model, engine: Scheduler, rows: int) -> None:
    c = engine.counters
    stats.decode_steps = c.decode_steps
    stats.ahead_steps = c.ahead_steps
    stats.decode_tokens = max(0, stats.generated_tokens - rows)  # each row's first token comes from its prefill
    stats.r, stats.T, stats.T_source = engine.cache_stats.r, engine.cache_stats.T, engine.cache_stats.T_source
    stats.kv_allocations = engine.cache.allocations
    stats.peak_kv_bytes = engine.peak_kv_bytes
    stats.cached_prompt_tokens = c.cached_prompt_tokens
    stats.grammar_masks, stats.grammar_mask_seconds = c.grammar_masks, c.grammar_mask_seconds
    if engine.spec is not None:
        stats.speculative = engine.spec.stats
    attention = engine.decode_attention
    if hasattr(attention, "transfers"):  # SparQ and the window baseline count what they read
        stats.attention_transfers = attention.transfers
        stats.attention_dense_transfers = attention.dense_transfers
    graphs = engine.graphs
    if graphs is not None:
        every = [graphs] + ([engine.segment_graphs] if engine.segment_graphs is not None else [])
        stats.cuda_graph_captures = sum(g.captures for g in every)
        stats.cuda_graph_replays = sum(g.replays for g in every)
        stats.cuda_graph_capture_seconds = sum(g.capture_seconds for g in every)
        if graphs.store is not None:
            stats.cuda_graph_bytes = graphs.store.graph_bytes
            stats.kv_arena_bytes = graphs.store.arena.nbytes
    native = model.net.native_decoder() is not None
    stats.decode_kernel = ("cuda-graphs" if graphs is not None and graphs.replays else "native-cpu" if native
                           else "torch")
