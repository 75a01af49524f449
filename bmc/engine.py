"""Generation: the options (GenerationConfig), the stats, and what a run's caches are made of (make_cache,
prefill_attention, longrope's relong, eos_ids), shared by the engine's step loop (scheduler.py), which generate()
drives through offline.py, and the static loop at the bottom, which runs what the step loop does not run yet
(offline.static_loop_reason: approximate attention, draft-model drafters, speculative sampling).

The static loop reads in order: check_length -> prefill (each prompt once, forked to its samples) -> repeat:
emit_tokens (events and stop checks) -> Rows.keep (finished rows leave) -> decode_step or the speculative step ->
finish_stats. A decode step: the cache makes room (a chunk boundary allocates and copies, or on a CPU widens the
view in place, once every r tokens) -> the model computes q, k, v for the new token and writes k, v in place ->
attention over the cache's capacity with its bias -> logits -> sampler -> stop checks."""
from __future__ import annotations

import os

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Generator, Iterator, Sequence

import torch

from .analytic import choose_T
from .attention import (ATTENTION_BACKENDS, AttentionFn, AttentionOptions, causal_attention,
                        dense_attention)
from .errors import InvalidRequestError, UnsupportedModelError
from .kv import KV_DTYPES, KV_STRATEGIES, BMCCache, KVCache, kv_format, r_from_T, whole_score_blocks
from .models import Model, ModelConfig
from .sampling import Sampler, SamplingParams
from .spec import TreeSpec, make_drafter, parse_speculative
from .spec.static_tree import DEFAULT_ACCEPTANCE, expected_accepted
from .spec.decode import SpecStats, SpeculativeStep
from .textstream import TextStream

log = logging.getLogger("bmc")


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_samples: int = 1
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    kv: str = "bmc"
    r: int | None = None
    T: int | None = None
    attention: str = "dense"  # "dense" (exact), "sparq" or "window" (approximate decode attention)
    attention_options: AttentionOptions = field(default_factory=AttentionOptions)
    speculative: str = "off"  # "off" or a drafter: "ngram", "draft:PATH", "layers:N", "int8-self"
    tree: str = "dynamic:4x6"  # draft tree shape: chain:K or dynamic:KxDEPTH
    spec_grow: bool = False  # grow the chunk for a tree that does not fit its free rows (default: trim the tree)
    cuda_graphs: bool = True  # on CUDA with bmc/upfront caches: capture the decode step once per capacity bucket
    share_prefix: str = "auto"  # "auto": one copy of each prompt's KV for its samples, and of a leading part common
    # to all prompts for the whole batch (shared-prefix attention); "off": every row keeps its own copy
    kv_dtype: str = "auto"  # how the cache stores K and V (bmc/kv/formats.py): "auto" (the model's dtype),
    # "float32", "bfloat16", "float16" or "int8" (a float32 scale per token and KV head)

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}")
        if self.num_samples < 1:
            raise InvalidRequestError(f"num_samples must be >= 1, got {self.num_samples}")
        if self.kv not in KV_STRATEGIES:
            raise InvalidRequestError(f"unknown kv strategy {self.kv!r}; choose from {', '.join(KV_STRATEGIES)}")
        if self.attention not in ATTENTION_BACKENDS:
            raise InvalidRequestError(f"unknown attention {self.attention!r}; choose from {', '.join(ATTENTION_BACKENDS)}")
        if self.r is not None and self.r < 1:
            raise InvalidRequestError(f"r must be >= 1, got {self.r}")
        if self.T is not None and self.T < 1:
            raise InvalidRequestError(f"T must be >= 1, got {self.T}")
        if self.r is not None and self.T is not None:
            raise InvalidRequestError("give r or T, not both")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        if self.attention != "dense" and self.speculative != "off":
            raise InvalidRequestError(f"attention={self.attention!r} approximates single-query decode steps; "
                                      "it does not combine with speculative decoding")
        if self.attention_options.window_k < 1:
            raise InvalidRequestError(f"window_k must be >= 1, got {self.attention_options.window_k}")
        if self.kv_dtype not in KV_DTYPES:
            raise InvalidRequestError(f"unknown kv_dtype {self.kv_dtype!r}; choose from {', '.join(KV_DTYPES)}")
        if self.share_prefix not in ("auto", "off"):
            raise InvalidRequestError(f"share_prefix must be 'auto' or 'off', got {self.share_prefix!r}")
        if self.speculative != "off":
            parse_speculative(self.speculative)
            TreeSpec.parse(self.tree)


@dataclass
class TokenEvent:
    """One generated token of one row. `text` is the new printable text (may be empty while a multi-byte
    character or a possible stop string is pending); `finish_reason` is set on the row's last event."""

    prompt_index: int
    sample_index: int
    token_id: int
    text: str | None
    finish_reason: str | None = None


@dataclass
class GenerationStats:
    batch_size: int = 0
    prompt_tokens: int = 0  # real (unpadded) prompt tokens over all distinct prompts
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0  # tokens produced by decode steps (the first token of each row comes from prefill)
    decode_bytes: int = 0  # weights + KV capacity read by the decode steps
    kv_strategy: str = ""
    r: int | None = None
    T: int | None = None
    T_source: str = ""
    max_length: int = 0
    kv_allocations: int = 0
    peak_kv_bytes: int = 0
    speculative: SpecStats | None = None
    weight_pack_seconds: float = 0.0  # MKL re-layout of the weights for the decode batch (inside decode_seconds)
    prefix_kv_bytes: int = 0  # cached prompt KV that rows read in place, stored once for them (0 when not sharing)
    prefix_groups: int = 0  # the most cached segments one decode step read
    cached_prompt_tokens: int = 0  # prompt tokens read from the call's prefix cache (a part common to prompts)
    decode_kernel: str = ""  # "native-cpu" (bmc.kernels' C++ step), "cuda-graphs" or "torch" (eager ops)
    cuda_graph_captures: int = 0  # decode-step graphs captured (one per capacity bucket and batch)
    cuda_graph_replays: int = 0
    attention_transfers: int = 0  # KV elements read by approximate decode attention (SparQ Eq. 11), all layers
    attention_dense_transfers: int = 0  # what dense attention would have read over the same steps

    @property
    def attention_compression(self) -> float:
        """Approximate attention's decode KV transfers over dense's (1.0 for dense attention)."""
        return self.attention_transfers / self.attention_dense_transfers if self.attention_dense_transfers else 1.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def decode_gb_per_s(self) -> float:
        return self.decode_bytes / self.decode_seconds / 1e9 if self.decode_seconds else 0.0

    def as_dict(self) -> dict:
        d = dict(vars(self))
        if self.speculative is not None:
            sp = self.speculative
            d["speculative"] = dict(vars(sp), mean_accepted_length=sp.mean_accepted_length, padding_use=sp.padding_use,
                                    acceptance_by_rank=sp.acceptance_by_rank)
        d.update(attention_compression=self.attention_compression, prefill_tokens_per_s=self.prefill_tokens_per_s, decode_tokens_per_s=self.decode_tokens_per_s,
                 decode_gb_per_s=self.decode_gb_per_s)
        return d


def speculation_shape(gen: GenerationConfig) -> tuple[int, float]:
    """(k, m) of the paper's Eq. 9 for choosing T under speculative decoding: k = tokens verified per step (the
    root + the tree), m = tokens emitted per step, estimated before the run from the tree's shape and the measured
    default acceptance rates by child rank (bmc/spec/static_tree.py). (1, 1.0) without speculation."""
    if gen.speculative == "off":
        return 1, 1.0
    spec = TreeSpec.parse(gen.tree)
    parents = spec.parents if spec.parents is not None else tuple(range(-1, spec.depth - 1))  # else: the best chain
    return 1 + spec.size, 1.0 + expected_accepted(parents, DEFAULT_ACCEPTANCE)


def copy_free_growth(model: Model, gen: GenerationConfig) -> bool:
    """Whether a growth of this run's decode cache copies nothing: on a CPU it widens a view in place (kv/base.py),
    and only dense attention keeps no state by column (SparQ's K mirror is copied at each growth)."""
    return model.device.type == "cpu" and gen.attention == "dense"


def make_cache(model: Model, gen: GenerationConfig, batch: int, max_length: int, left_pad: Sequence[int],
               stats: GenerationStats) -> KVCache:
    cfg = model.config
    kw = dict(num_layers=cfg.num_layers, batch_size=batch, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
              max_length=max_length, dtype=model.dtype, device=model.device, left_pad=left_pad,
              window=window_in_reach(cfg, max_length), window_every_layer=cfg.local_layers is None,
              kv_dtype=gen.kv_dtype)
    stats.kv_strategy = gen.kv
    if gen.kv != "bmc":
        return KV_STRATEGIES[gen.kv](**kw)
    if gen.r is not None:
        r, stats.T_source = gen.r, "r given"
    elif gen.T is not None:
        r, stats.T_source = r_from_T(max_length, gen.T), "T given"
    else:
        k, m = speculation_shape(gen)
        # the whole model's shapes under tensor parallelism: every rank grows its cache at the same boundaries
        T, stats.T_source = choose_T(max_length, model=model.full_config or cfg, batch=batch, dtype=model.dtype,
                                     device=model.device, k=k, m=m,
                                     kv_bytes=kv_format(gen.kv_dtype, model.dtype).bytes_per_value(cfg.head_dim),
                                     copy_free=copy_free_growth(model, gen))
        if k > 1:
            stats.T_source += f"; SD k={k} m~{m:.2f} (Eq. 9)"
        r = r_from_T(max_length, T)
        if model.device.type == "cpu":  # capacities of whole score blocks: tokens that do not depend on T
            r = whole_score_blocks(r, max_length)
    stats.r, stats.T = r, math.ceil(max_length / r)
    cache = BMCCache(r=r, **kw)
    # on a CPU the KV tensor's slabs have room for the run (KVCache._new_kv): a growth widens the view, nothing is
    # copied; a reorder or regroup copies into the mapping the last one left, so pages are faulted once per run. On
    # CUDA every growth copies (its allocator reuses blocks; the spare could never hold the next growth).
    cache.grow_in_place = cache.keep_spare = model.device.type == "cpu"
    return cache


def window_in_reach(cfg: ModelConfig, max_length: int) -> int | None:
    """The model's sliding window when a run of `max_length` positions can pass it, else None (within the
    window, windowed attention is plain causal attention)."""
    w = cfg.sliding_window
    return w if w is not None and max_length > w else None


def longrope_switch(cfg: ModelConfig) -> int | None:
    """longrope's pretraining context (Phi-3 128k, Phi-3.5), else None. transformers runs a sequence of up to that
    many tokens with the short factors and a longer one with the long factors: a prompt past it prefills long; a
    shorter row that generates past it has its whole KV recomputed with the long factors at that step (Phi-3's
    prepare_inputs_for_generation drops the cache there). bmc does the same per row (relong()); a prefix shared
    by rows on both sides of the switch is not the same K for all of them, so longrope runs do not share KV."""
    s = cfg.rope_scaling
    return s["original_max_position_embeddings"] if s is not None and s["rope_type"] == "longrope" else None


def prefill_alone(model: Model, ids: list[int], prompt_len: int, all_logits: bool = False, kv_dtype: str = "auto"
                  ) -> tuple[KVCache, torch.Tensor]:
    """One sequence prefilled at positions 0..len-1 into an exact-size cache of its own (a prompt of `prompt_len`
    tokens as longrope sees it): the cache and the logits (every position's, or the last one's)."""
    n = len(ids)
    cache = make_cache(model, GenerationConfig(kv="upfront", kv_dtype=kv_dtype), 1, n, [0], GenerationStats())
    positions = torch.arange(n, device=model.device)[None]
    cache.reserve(n, positions)
    logits = model.net(torch.tensor([ids], device=model.device), positions, cache,
                       prefill_attention(dense_attention, cache, n), cache.attention_bias(n), all_logits=all_logits,
                       prompt_len=torch.tensor([prompt_len]))
    cache.commit(n)
    return cache, logits


def relong(model: Model, cache: KVCache, row: int, ids: list[int]) -> None:
    """Recompute batch row `row` of `cache` from its tokens `ids` (positions 0..len-1, everything before the row's
    next token) with longrope's long factors, as transformers recomputes the sequence at the switch: a prefill
    into a cache of its own, placed over the row's columns (the same count, right-aligned on the write column)."""
    n = len(ids)
    # the sequence with its next token (past the switch), stored as the row's cache stores it
    src, _ = prefill_alone(model, ids, prompt_len=n + 1, kv_dtype=cache.format.name)
    if not cache.place(row, src):
        raise UnsupportedModelError(f"longrope's switch needs the row's {n} columns; its cache kept "
                                    f"{cache.length} (a sliding window dropped the rest)")


def relong_rows(model: Model, rows: "Rows", histories: list[list[int]]) -> None:
    """Before a step: rows still rotated short whose next token is past longrope's switch get their KV
    recomputed long (histories[b]: batch row b's prompt and generated tokens, the last one not in the cache)."""
    switch = longrope_switch(model.config)
    if switch is None or rows.short is None:
        return
    for b in (rows.short & (rows.pos >= switch)).nonzero()[:, 0].tolist():
        relong(model, rows.cache, b, histories[b][:-1])
        rows.short[b] = False


def spec_budgets(model: Model, rows: "Rows", remaining: list[int]) -> list[int]:
    """Tokens each row may emit in a speculative step: its remaining ones, and for a row still rotated short
    only up to longrope's switch (the tree's deepest node is then the last short position; the switch itself is
    a step of its own, after relong_rows)."""
    switch = longrope_switch(model.config)
    if switch is None or rows.short is None:
        return remaining
    return [min(r, switch - p) if s else r for r, p, s in zip(remaining, rows.pos.tolist(), rows.short.tolist())]


def encode_prompts(model: Model, prompts: Sequence[str] | Sequence[Sequence[int]], chat: bool) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise InvalidRequestError("prompts must be a non-empty list of strings or of token-id lists")
    tok = model.tokenizer
    out: list[list[int]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tok is None:
                raise InvalidRequestError("this model has no tokenizer: pass prompts as token-id lists")
            if not p:
                raise InvalidRequestError(f"prompt {i} is empty")
            if chat:
                p = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
            ids = tok.encode(p)
        else:
            ids = [int(t) for t in p]
            if not ids:
                raise InvalidRequestError(f"prompt {i} is empty")
            bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
            if bad:
                raise InvalidRequestError(f"prompt {i} has token ids outside [0, {model.config.vocab_size}): {bad[:5]}")
        out.append(ids)
    return out


def eos_ids(model: Model) -> set[int]:
    ids = set(model.config.eos_token_ids)
    if model.tokenizer is not None:
        ids.update(model.tokenizer.eos_token_ids)
    return ids


MIN_SHARED_PREFIX = 16  # generate(): shorter common prefixes are recomputed per row (the merge would cost more)


PACK_MIN_ROWS = 2  # measured: MKL-packed GEMMs win at M = 8 (48 vs 69 ms/step), lose at M = 1 (35 vs 32 ms)
PACK_MIN_STEPS = 96  # packing costs ~1 s for the default model; at M = 8 it saves ~25 ms per step


def _pack_weights(model: Model, rows: int, steps_left: int, stats: GenerationStats) -> None:
    """Re-lay the weights for decode GEMMs of `rows` rows when enough steps remain to pay for it."""
    if not model.can_pack or rows == model.packed_batch:
        return
    want = rows if rows >= PACK_MIN_ROWS and steps_left >= PACK_MIN_STEPS else 0
    if want or model.packed_batch:
        t = time.perf_counter()
        model.pack_for_batch(want)
        stats.weight_pack_seconds += time.perf_counter() - t


def prefill_attention(attention: AttentionFn, cache: KVCache, num_new: int) -> AttentionFn:
    """causal_attention where a prefill's bias is exactly causal (dense attention into an empty cache with no left
    padding, and no sliding window the `num_new` tokens pass): half the attention FLOPs of a long prompt and no
    mask to read; else `attention` as it is."""
    if (attention is dense_attention and cache.length == 0 and not bool(cache.left_pad.any())
            and (cache.window is None or num_new <= cache.window)):
        return causal_attention
    return attention


@dataclass
class Rows:
    """What the static loop carries, row b of each tensor being batch row b: the KV cache, the attention that reads
    it, backend state that follows the cache's rows (SparQ's K copy), and each row's next token and its position."""

    cache: KVCache
    attention: AttentionFn
    stateful: Any
    pos: torch.Tensor
    next_tok: torch.Tensor | None = None
    short: torch.Tensor | None = None  # longrope: rows whose KV is still rotated with the short factors

    def keep(self, idx: torch.Tensor) -> None:
        """Keep batch rows `idx` (finished rows leave the batch)."""
        self.cache.reorder(idx)
        if self.stateful is not None:
            self.stateful.reorder(idx)
        self.next_tok, self.pos = self.next_tok.index_select(0, idx), self.pos.index_select(0, idx)
        if self.short is not None:
            self.short = self.short.index_select(0, idx)


def check_attention(model: Model, attention: str) -> None:
    """Refuse approximate attention for a model whose scores it does not compute (Gemma 2's soft-capping)."""
    if attention != "dense" and model.config.attn_softcap is not None:
        raise InvalidRequestError(f"attention={attention!r} does not implement {model.config.model_type}'s "
                                  "attention-logit soft-capping: use attention='dense'")


def check_length(model: Model, prompt_ids: list[list[int]], gen: GenerationConfig) -> int:
    """The run's maximum length N (longest prompt + max_new_tokens), refused beyond the model's context."""
    check_attention(model, gen.attention)
    switch = longrope_switch(model.config)
    if (gen.attention != "dense" and switch is not None
            and any(len(p) <= switch < len(p) + gen.max_new_tokens for p in prompt_ids)):
        raise InvalidRequestError(f"attention={gen.attention!r} keeps state by column that longrope's switch at "
                                  f"{switch} tokens would recompute: use attention='dense', or prompts and "
                                  "max_new_tokens on one side of it")
    P = max(len(p) for p in prompt_ids)
    max_length = P + gen.max_new_tokens
    if max_length > model.max_context:
        longest = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
        raise InvalidRequestError(
            f"prompt {longest} has {P} tokens; with max_new_tokens={gen.max_new_tokens} that is {max_length} "
            f"positions, beyond the model's context of {model.max_context}")
    check_kv_fits(model, len(prompt_ids) * gen.num_samples, max_length, gen.kv_dtype)
    return max_length


def device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_kv_fits(model: Model, rows: int, max_length: int, kv_dtype: str = "auto") -> None:
    """Refuse a run whose KV cache alone (rows x max_length positions, stored as kv_dtype) exceeds the device's
    memory, before any allocation: an absurd num_samples or batch gets a clear error instead of an allocator failure
    or the OOM killer."""
    cfg = model.config
    need = (2 * cfg.num_layers * rows * cfg.num_kv_heads * max_length * cfg.head_dim
            * kv_format(kv_dtype, model.dtype).bytes_per_value(cfg.head_dim))
    have = device_memory_bytes(model.device)
    if need > have:
        raise InvalidRequestError(f"{rows} rows of {max_length} positions need {need / 2**30:.1f} GiB of KV cache; "
                                  f"the {model.device.type} has {have / 2**30:.1f} GiB")


def prefill(model: Model, prompt_ids: list[list[int]], gen: GenerationConfig, max_length: int,
            stats: GenerationStats) -> tuple[Rows, torch.Tensor]:
    """Prefill every prompt once, left-padded into one batch, and fork each to its samples: the rows and the last
    logits of each. (Runs on the step loop share prompts; this loop's approximate attention and draft models keep
    every row's KV to itself.)"""
    cfg, dev = model.config, model.device
    n_prompts, n = len(prompt_ids), gen.num_samples
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    P = max(len(p) for p in prompt_ids)
    left_pad = [P - len(p) for p in prompt_ids]
    cache = make_cache(model, gen, n_prompts, P + gen.max_new_tokens, left_pad, stats)
    attention = ATTENTION_BACKENDS[gen.attention](cache, gen.attention_options, cfg.group_size)
    stateful = attention if hasattr(attention, "reorder") else None  # backend state follows the cache's rows
    # approximate backends pick columns by index (SparQ's K copy, the window baseline's first positions)
    cache.compact_window = gen.attention == "dense"
    stats.batch_size, stats.max_length = n_prompts * n, max_length
    stats.prompt_tokens = sum(len(p) for p in prompt_ids)
    tokens = torch.tensor([[pad_id] * lp + p for lp, p in zip(left_pad, prompt_ids)], dtype=torch.long, device=dev)
    pads = torch.tensor(left_pad, dtype=torch.long, device=dev)
    positions = (torch.arange(P, device=dev)[None, :] - pads[:, None]).clamp(min=0)

    cache.reserve(P, positions)
    logits = model.net(tokens, positions, cache, prefill_attention(attention, cache, P), cache.attention_bias(P),
                       prompt_len=torch.tensor([len(p) for p in prompt_ids]))
    cache.commit(P)
    pos = (cache.length - cache.left_pad).clone()  # next position per batch row
    if n > 1:  # fork each prompt's prefilled KV to its samples
        fork = torch.arange(n_prompts, device=dev).repeat_interleave(n)
        logits, pos = logits.index_select(0, fork), pos.index_select(0, fork)
        cache.reorder(fork)
        if stateful is not None:
            stateful.reorder(fork)
    switch = longrope_switch(cfg)
    short = None if switch is None else torch.tensor(
        [len(p) <= switch for p in prompt_ids for _ in range(n)], device=dev)
    return Rows(cache, attention, stateful, pos, short=short), logits


def emit_tokens(active: list[int], new_ids: list[list[int]], row_ids: list[tuple[int, int]],
                texts: list[TextStream | None], counts: list[int], stop_ids: set[int], gen: GenerationConfig,
                stats: GenerationStats) -> Generator[TokenEvent, None, list[int]]:
    """A TokenEvent for each of the batch rows' new tokens, with the stop checks (EOS, length, stop strings);
    returns the batch rows still generating."""
    keep: list[int] = []
    for b, row in enumerate(active):
        finish = None
        for tid in new_ids[b]:
            counts[row] += 1
            stats.generated_tokens += 1
            finish = "stop" if tid in stop_ids else ("length" if counts[row] >= gen.max_new_tokens else None)
            text = None
            if texts[row] is not None:
                text, hit_stop = texts[row].push(tid, final=finish is not None)
                if hit_stop:
                    finish = "stop"
            yield TokenEvent(row_ids[row][0], row_ids[row][1], tid, text, finish)
            if finish is not None:
                break
        if finish is None:
            keep.append(b)
    return keep


def decode_step(model: Model, rows: Rows, sampler: Sampler) -> list[list[int]]:
    """One token for every row: the cache makes room (a chunk boundary allocates and copies), the forward writes
    K/V in place and attends over the capacity with the bias, the sampler picks."""
    rows.cache.reserve(1, rows.pos[:, None])
    logits = model.net(rows.next_tok[:, None], rows.pos[:, None], rows.cache, rows.attention, rows.cache.bias)
    rows.cache.commit(1)
    rows.pos += 1
    rows.next_tok = sampler(logits[:, -1])
    return [[t] for t in rows.next_tok.tolist()]


def finish_stats(stats: GenerationStats, model: Model, gen: GenerationConfig, rows: Rows) -> None:
    cache = rows.cache
    stats.kv_allocations = cache.allocations
    stats.peak_kv_bytes = max(cache.peak_bytes, cache.nbytes)
    native = gen.attention == "dense" and model.net.native_decoder() is not None
    stats.decode_kernel = "native-cpu" if native else "torch"
    if hasattr(rows.attention, "transfers"):
        stats.attention_transfers = rows.attention.transfers
        stats.attention_dense_transfers = rows.attention.dense_transfers


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def generate_tokens(model: Model, prompt_ids: list[list[int]], gen: GenerationConfig,
                    stats: GenerationStats | None = None) -> Iterator[TokenEvent]:
    """The tokens of every (prompt, sample) row as they are produced: on the engine's step loop (offline.py, the
    server's scheduler), or on the static loop below for what that loop does not run yet (static_loop_reason)."""
    from .offline import generate_on_steps, static_loop_reason

    stats = stats if stats is not None else GenerationStats()
    if static_loop_reason(gen) is None:
        return generate_on_steps(model, prompt_ids, gen, stats)
    return static_loop(model, prompt_ids, gen, stats)


@torch.inference_mode()
def static_loop(model: Model, prompt_ids: list[list[int]], gen: GenerationConfig,
                stats: GenerationStats) -> Iterator[TokenEvent]:
    """Approximate attention and draft-model speculation: prefill, then (emit the rows' new tokens -> drop finished
    rows -> one decode or speculative step) until every row is done. Rows are (prompt, sample) pairs; each prompt
    is prefilled once and forked to its samples."""
    dev = model.device
    max_length = check_length(model, prompt_ids, gen)
    sampler = Sampler(gen.sampling, dev)
    stop_ids = set() if gen.ignore_eos else eos_ids(model)
    t0 = time.perf_counter()
    rows, logits = prefill(model, prompt_ids, gen, max_length, stats)
    rows.next_tok = sampler(logits[:, -1])
    _synchronize(dev)
    stats.prefill_seconds = time.perf_counter() - t0

    row_ids = [(pi, si) for pi in range(len(prompt_ids)) for si in range(gen.num_samples)]
    texts = [TextStream(model.tokenizer, gen.stop) if model.tokenizer is not None else None for _ in row_ids]
    counts = [0] * len(row_ids)
    active = list(range(len(row_ids)))  # row ids still generating, in batch order
    new_ids = [[t] for t in rows.next_tok.tolist()]  # each batch row's tokens from the last step
    spec = None
    if gen.speculative != "off":
        spec = SpeculativeStep(make_drafter(gen.speculative, model, sampler), TreeSpec.parse(gen.tree),
                               trim_to_chunk=not gen.spec_grow, sampler=sampler)
        stats.speculative = spec.stats
        for row, ids in zip(active, new_ids):
            spec.drafter.start(row, prompt_ids[row_ids[row][0]] + ids)
    # longrope: each row's tokens, for the recompute at the switch (relong_rows)
    histories = ([prompt_ids[pi] + ids for (pi, _), ids in zip(row_ids, new_ids)] if rows.short is not None
                 else [])
    weight_bytes = model.weight_bytes
    t_decode = time.perf_counter()
    while True:
        keep = yield from emit_tokens(active, new_ids, row_ids, texts, counts, stop_ids, gen, stats)
        if not keep:
            break
        if len(keep) < len(active):
            rows.keep(torch.tensor(keep, dtype=torch.long, device=dev))
            histories = [histories[b] for b in keep] if histories else histories
            active = [active[b] for b in keep]
        relong_rows(model, rows, histories)
        # after the first tokens are out (time to first token does not wait for it), and when the batch shrinks
        _pack_weights(model, len(active), gen.max_new_tokens - max(counts[r] for r in active), stats)
        stats.decode_steps += 1
        stats.decode_bytes += weight_bytes + rows.cache.nbytes
        if spec is not None:  # draft, verify in the padding rows, keep the accepted path
            new_ids, rows.next_tok = spec(model, rows.cache, rows.attention, rows.next_tok, rows.pos, active,
                                          spec_budgets(model, rows, [gen.max_new_tokens - counts[r] for r in active]))
            stats.decode_tokens += sum(len(x) for x in new_ids)
        else:
            new_ids = decode_step(model, rows, sampler)
            stats.decode_tokens += len(active)
        for h, ids in zip(histories, new_ids):
            h.extend(ids)
    _synchronize(dev)
    stats.decode_seconds = time.perf_counter() - t_decode
    finish_stats(stats, model, gen, rows)
