"""Generation: the options (GenerationConfig), the stats, and what a run's caches are made of (make_cache,
prefill_attention, longrope's relong, eos_ids), for the engine's step loop (scheduler.py), which generate() drives
through offline.py. A decode step there: the cache makes room (a chunk boundary allocates and copies, or on a CPU
widens the view in place, once every r tokens) -> the model computes q, k, v for the new token and writes k, v in
place -> attention over the cache's capacity with its bias -> logits -> sampler -> stop checks."""
from __future__ import annotations

import os

import logging
import math
import operator
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from .analytic import choose_T
from .attention import (ATTENTION_BACKENDS, AttentionFn, AttentionOptions, causal_attention,
                        dense_attention)
from .errors import InvalidRequestError, UnsupportedModelError
from .grammar import GrammarSpec
from .graphs import GRAPH_LIMIT, MIN_BUCKET_STEPS
from .kv import KV_DTYPES, KV_STRATEGIES, BMCCache, KVCache, kv_format, r_from_T, whole_score_blocks
from .kv.smoothing import key_scales_for
from .models import Model, ModelConfig
from .sampling import SamplingParams
from .spec import TreeSpec, parse_speculative
from .spec.static_tree import DEFAULT_ACCEPTANCE, expected_accepted
from .spec.decode import SpecStats

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
    tree: str = "auto"  # draft tree shape: auto (sized each step from measured costs), chain:K, dynamic:KxDEPTH, static
    spec_grow: bool = False  # grow the chunk for a tree that does not fit its free rows (default: trim the tree)
    cuda_graphs: bool = True  # on CUDA with bmc/upfront caches: capture the decode step once per capacity bucket
    graph_warmup: bool = False  # CUDA: capture every bucket's graph for the call's batch before its prompts run
    run_ahead: bool | None = None  # greedy decode steps launched before the last one's tokens are read (None: on
    # CUDA graphs; bmc/run_ahead.py)
    adaptive_threads: bool = True  # CPU: decode steps on fewer threads while other processes hold the cores
    share_prefix: str = "auto"  # "auto": one copy of each prompt's KV for its samples, and of a leading part common
    # to all prompts for the whole batch (shared-prefix attention); "off": every row keeps its own copy
    kv_dtype: str = "auto"  # how the cache stores K and V (bmc/kv/formats.py): "auto" (the model's dtype),
    # "float32", "bfloat16", "float16" or "int8" (a float32 scale per token and KV head)
    grammar: GrammarSpec | None = None  # what the output must match (a JSON schema, a regex, a grammar: grammar.py)

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
        sparq = self.attention_options.sparq  # what needs no model (r <= head_dim is checked when it is bound)
        if sparq.k < 1:
            raise InvalidRequestError(f"sparq k must be >= 1, got {sparq.k}")
        if sparq.r is not None and sparq.r < 1:
            raise InvalidRequestError(f"sparq r must be >= 1, got {sparq.r}")
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
    ahead_steps: int = 0  # of those, launched before the last step's tokens were read (run_ahead.py)
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
    grammar_masks: int = 0  # constrained rows' masked tokens (json_schema, regex, grammar)
    grammar_mask_seconds: float = 0.0  # the time their masks took (inside decode_seconds)
    decode_kernel: str = ""  # "native-cpu" (bmc.kernels' C++ step), "cuda-graphs" or "torch" (eager ops)
    cuda_graph_captures: int = 0  # decode-step graphs captured (one per capacity bucket and batch)
    cuda_graph_replays: int = 0
    cuda_graph_capture_seconds: float = 0.0  # time this call spent capturing (inside decode_seconds)
    cuda_graph_bytes: int = 0  # memory the model's kept graphs hold (their pool), after the call
    kv_arena_bytes: int = 0  # the model's KV arena (graphs.py) the call's batch cache grew in, 0 if none
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


def copy_free_growth(model: Model, gen: GenerationConfig, max_length: int) -> bool:
    """Whether a growth of this run's decode cache copies nothing: on a CPU it widens a view in place (kv/base.py);
    on CUDA with graphs it widens its view of the model's arena (graphs.py; not with a sliding window in reach).
    Only dense attention keeps no state by column (SparQ's K mirror is copied at each growth)."""
    if gen.attention != "dense":
        return False
    if model.device.type == "cuda":
        return gen.cuda_graphs and gen.kv == "bmc" and window_in_reach(model.config, max_length) is None
    return model.device.type == "cpu"


def make_cache(model: Model, gen: GenerationConfig, batch: int, max_length: int, left_pad: Sequence[int],
               stats: GenerationStats) -> KVCache:
    cfg = model.config
    kw = dict(num_layers=cfg.num_layers, batch_size=batch, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
              max_length=max_length, dtype=model.dtype, device=model.device, left_pad=left_pad,
              window=window_in_reach(cfg, max_length), window_every_layer=cfg.local_layers is None,
              kv_dtype=gen.kv_dtype)
    stats.kv_strategy = gen.kv
    cache = _make_cache(model, gen, batch, max_length, stats, kw)
    if cache.format.name == "int8":
        cache.key_scales = key_scales_for(model)
    return cache


def _make_cache(model: Model, gen: GenerationConfig, batch: int, max_length: int, stats: GenerationStats,
                kw: dict) -> KVCache:
    cfg = model.config
    if gen.kv != "bmc":
        return KV_STRATEGIES[gen.kv](**kw)
    if gen.r is not None:
        r, stats.T_source = gen.r, "r given"
    elif gen.T is not None:
        r, stats.T_source = r_from_T(max_length, gen.T), "T given"
    else:
        k, m = speculation_shape(gen)
        copy_free = copy_free_growth(model, gen, max_length)
        # the whole model's shapes under tensor parallelism: every rank grows its cache at the same boundaries
        T, stats.T_source = choose_T(max_length, model=model.full_config or cfg, batch=batch, dtype=model.dtype,
                                     device=model.device, k=k, m=m,
                                     kv_bytes=kv_format(gen.kv_dtype, model.dtype).bytes_per_value(cfg.head_dim),
                                     copy_free=copy_free)
        if copy_free and model.device.type == "cuda":
            # every bucket is a kept graph: no more than the store keeps for two batch shapes, and none so short
            # that it runs eager (graphs.py captures only with MIN_BUCKET_STEPS rows left)
            most = max(1, min(GRAPH_LIMIT // 2, max_length // (2 * MIN_BUCKET_STEPS)))
            if T > most:
                T, stats.T_source = most, stats.T_source + f"; T<={most}: each bucket a kept CUDA graph"
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
        elif chat and isinstance(p, Sequence) and p and all(isinstance(m, dict) for m in p):
            if tok is None:
                raise InvalidRequestError("this model has no tokenizer, so no chat template")
            if not all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in p):
                raise InvalidRequestError(f"prompt {i}: each message needs a string role and content")
            ids = tok.encode(tok.apply_chat_template(list(p), add_generation_prompt=True))
        else:
            try:  # ints, numpy's or a tensor's integers; not floats, bools or messages
                if any(isinstance(t, bool) for t in p):
                    raise TypeError("bool")
                ids = [operator.index(t) for t in p]
            except TypeError:
                listed = isinstance(p, Sequence) and len(p) > 0
                kind = ("a conversation (a list of messages) needs chat=True"
                        if listed and all(isinstance(m, dict) for m in p) else
                        f"got {type(p).__name__}" + (f" of {type(p[0]).__name__}" if listed else ""))
                raise InvalidRequestError(
                    f"prompt {i} must be a string or a list of token ids (ints): {kind}") from None
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


PACK_MIN_ROWS = 2  # MKL-packed GEMMs win at M = 8 and lose at M = 1 (docs/performance.md: figures behind choices)
PACK_MIN_STEPS = 96  # packing costs about a second of the default model: it pays back over this many steps


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


def kv_bytes_per_token(model: Model, kv_dtype: str = "auto") -> float:
    """Bytes one token's K and V take over every layer, stored as kv_dtype (int8: its scales included)."""
    cfg = model.config
    return (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
            * kv_format(kv_dtype, model.dtype).bytes_per_value(cfg.head_dim))


def check_kv_fits(model: Model, rows: int, max_length: int, kv_dtype: str = "auto") -> None:
    """Refuse a run whose KV cache alone (rows x max_length positions, stored as kv_dtype) exceeds the device's
    memory, before any allocation: an absurd num_samples or batch gets a clear error instead of an allocator failure
    or the OOM killer."""
    need = rows * max_length * kv_bytes_per_token(model, kv_dtype)
    have = device_memory_bytes(model.device)
    if need > have:
        raise InvalidRequestError(f"{rows} rows of {max_length} positions need {need / 2**30:.1f} GiB of KV cache; "
                                  f"the {model.device.type} has {have / 2**30:.1f} GiB")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def generate_tokens(model: Model, prompt_ids: list[list[int]], gen: GenerationConfig,
                    stats: GenerationStats | None = None) -> Iterator[TokenEvent]:
    """The tokens of every (prompt, sample) row as they are produced, on the engine's step loop (offline.py drives
    the server's scheduler)."""
    from .offline import generate_on_steps

    return generate_on_steps(model, prompt_ids, gen, stats if stats is not None else GenerationStats())
