"""Continuous batching over one BMC cache: requests join the running batch at step boundaries and leave when they
finish or are cancelled, freeing their rows and KV.

One `step()` reads straight through:
  1. leave and join: finished and cancelled rows leave, prefilled requests join, in one `KVCache.regroup` (one
     allocation and copy, which also drops the leading columns no row reads); at a chunk boundary with nothing
     joining or leaving, the same regroup compacts before the cache grows;
  2. admit: waiting requests take free seats, oldest first, each with a cache of its own for its prompt;
  3. one forward: a token for every running row (decode first, as vLLM and llama.cpp do) and, in what is left of
     the token budget (`max_num_batched_tokens` minus the decode rows; with `itl_factor`, cut further by the
     measured cost of a prompt token beside the running rows: chunk_budget.py), the next chunk of each admitted
     prompt, oldest first. On a CPU the native step runs them as one fused forward (`forward_parts`): every weight is
     read once for the decode rows and the prompt chunks, so a chunk costs its FLOPs, not another pass over the
     weights (measured: docs/performance.md, "Figures behind the code's choices"). A request whose prompt is done samples its first token
     here and joins at the next step.

Exactness: a request's prompt is prefilled as generate() prefills it alone (its own cache from `make_cache` for its
own length, the same attention choice), in chunks only where it exceeds the budget; its rows then decode in the
shared cache, where other rows' columns and padding are masked by the bias; sampling draws from the request's own
generator over its own rows, so other requests never change its draws. Tests hold served tokens to generate()'s.

Thread model: `step()` runs on one engine thread; `add()` and `abort()` may be called from any thread."""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .attention import ATTENTION_BACKENDS, AttentionFn, AttentionOptions, SharedPrefix, dense_attention
from .chunk_budget import ChunkBudget
from .engine import (GenerationConfig, GenerationStats, check_attention, eos_ids, longrope_switch, make_cache,
                     prefill_attention, relong)
from .engine_options import EngineOptions
from .errors import BmcError, InvalidRequestError
from .graphs import MIN_BUCKET_STEPS, DecodeGraphs, graph_store
from .kernels.native import argmax
from .models.step import StepPart
from .platform.threads import ThreadGovernor
from .kv import KVCache
from .models import Model
from .prefix_cache import Node, PrefixCache, common_prefix
from .run_ahead import Ahead, launch
from .grammar import RowMatcher, apply_masks, check_grammar
from .sampling import Sampler, SamplingError, SamplingParams, adjust_logits
from .spec import DraftTree, Proposal, TreeSpec, greedy_accept, make_drafter
from .spec.auto import AutoTree, row_costs
from .spec.verify import sample_paths
from .spec.decode import SpeculativeStep
from .textstream import TextStream

log = logging.getLogger("bmc")

# A single-sample prompt's rows read its own just-cached blocks in place from this many tokens on: a long prompt
# would widen the right-aligned batch for every row, while a short one costs a segment of its own in every step
# (a closed loop of 8 random 128-token prompts ran 1.06x slower whole-process with every prompt read in place)
OWN_PROMPT_IN_PLACE = 512
SEGMENT_GRAPH_AFTER = 4  # eager steps on one set of segments before its decode step is captured (CUDA)
SCORED_LOGITS_BYTES = 256 << 20  # at most this much of logits and log-probabilities a scored prompt chunk holds


def scored_chunk_rows(vocab: int, available: int | None = None) -> int:
    """Prompt positions a scored chunk (perplexity, echo) prefills at a time: its [t, V] float32 logits and their
    log-softmax within SCORED_LOGITS_BYTES, or an eighth of the memory available where that is less (the chunk's
    rows, not the batch, set the peak: chunks are scored one at a time); at least 16."""
    budget = SCORED_LOGITS_BYTES if available is None else min(SCORED_LOGITS_BYTES, available // 8)
    return max(16, budget // (8 * max(vocab, 1)))


def available_memory() -> int | None:
    """MemAvailable (Linux), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class QueueFullError(BmcError):
    """The waiting queue is at its limit (the server answers 503 with Retry-After)."""


class EngineStoppedError(BmcError):
    """The scheduler was closed (its engine thread died): it takes no more requests."""


@dataclass
class TokenOutput:
    """One generated token of one of a request's samples, handed to the request's `emit`."""

    sample_index: int
    token_id: int
    text: str  # new printable text ("" while a multi-byte character or a possible stop string is pending)
    finish_reason: str | None = None  # "stop" or "length" on the sample's last token
    logprob: float | None = None  # log-probability of token_id under the model (when the request asked)
    top_logprobs: list[tuple[int, float]] | None = None


Emit = Callable[["TokenOutput | BaseException"], None]  # an exception ends the request with that error


class Request:
    """A prompt with its generation settings; `emit` is called on the engine thread for every token (and once
    with an exception if the request fails)."""

    _ids = itertools.count()

    def __init__(self, prompt_ids: list[int], gen: GenerationConfig, emit: Emit, *, logprobs: int | None = None,
                 request_id: str | None = None, device: torch.device | str = "cpu", cache_salt: str | None = None,
                 cache_prompt: bool = True, prompt_logprobs: bool = False, prompt_top: int = 0) -> None:
        """prompt_logprobs: score the prompt (perplexity, the API's echo): `prompt_logprobs` gets each prompt token's
        log-probability given the ones before it and `next_logprobs` the log-probabilities of the token after the
        prompt, all computed (a prefix-cache hit would skip them: such a request reads and writes no cache);
        prompt_top > 0 also keeps each position's `prompt_top` most likely tokens (`prompt_top_logprobs`: the API's
        echo with logprobs)."""
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        self.request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        self.prompt_ids, self.gen, self.emit, self.logprobs = prompt_ids, gen, emit, logprobs
        self.cache_salt, self.cache_prompt = cache_salt, cache_prompt and not prompt_logprobs  # tenant; False = opt out
        self.prompt_logprobs: list[float] | None = [] if prompt_logprobs else None
        self.next_logprobs: torch.Tensor | None = None
        self.prompt_top = prompt_top if prompt_logprobs else 0
        self.prompt_top_logprobs: list[list[tuple[int, float]]] = []  # per scored position, most likely first
        self.cache_limit: int | None = None  # keep at most this many prompt tokens in the prefix cache (None: all)
        self.cached_tokens = 0  # prompt tokens a prefix-cache hit gave it (not prefilled)
        self.prompt_seen: torch.Tensor | None = None  # [V] bool: the prompt's tokens (the repetition penalty)
        self.grammar_text: str | None = None  # gen.grammar compiled for llguidance (at its first token)
        self.prefix_node: Node | None = None  # the cached path its rows read in place (locked while it runs)
        self.prefix_locked = False
        self.sampler = Sampler(gen.sampling, torch.device(device))
        self.arrival = time.monotonic()
        self.admitted_at: float | None = None  # left the waiting queue (queue time = admitted_at - arrival)
        self.cancelled = False
        self.done = False  # every sample finished, or the request failed or was cancelled

    @property
    def num_samples(self) -> int:
        return self.gen.num_samples


@dataclass
class _Prefill:
    request: Request
    cache: KVCache
    done: int = 0  # prompt tokens prefilled so far (a hit read in place counts as done)
    start: int = 0  # the position of the cache's column 0: the tokens read in place from the prefix cache
    attention: AttentionFn | None = None  # the prompt's attention over its cached path and its own columns


@dataclass
class _Row:
    request: Request
    sample_index: int
    token: int  # the last sampled token: not in the cache yet, the next decode step's input
    pos: int  # its position
    key: int = field(default_factory=itertools.count().__next__)  # the row's name for the drafter
    count: int = 1  # tokens generated
    text: TextStream | None = None
    finish: str | None = None
    history: list[int] | None = None  # longrope: a row still rotated short keeps its tokens for the switch
    start: int = 0  # the position of the row's first own column (the tokens before it are read in place)
    generated: list[int] | None = None  # its tokens, where its finished turn is kept in the prefix cache
    counts: torch.Tensor | None = None  # [V] float32: how often each token was generated (penalties only)
    matcher: RowMatcher | None = None  # its grammar's state (constrained requests only)


@dataclass
class SchedulerCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    decode_steps: int = 0
    prefill_chunks: int = 0
    joins_in_place: int = 0  # requests that took a retired slot (one row copied)
    regroups: int = 0  # full copies of the batch cache (joins that did not fit, dropping slots, compaction)
    fused_steps: int = 0  # steps that ran the decode rows and prompt chunks in one native forward
    ahead_steps: int = 0  # decode steps launched before the last step's tokens were read (run_ahead.py)
    relongs: int = 0  # rows whose KV was recomputed at longrope's switch
    draft_failures: int = 0  # steps whose drafter raised (they decoded without drafts)
    cached_prompt_tokens: int = 0  # prompt tokens read from the prefix cache instead of prefilled
    grammar_masks: int = 0  # rows whose logits a grammar masked (one per constrained row and token)
    grammar_mask_seconds: float = 0.0  # the time those masks took (computed and applied)
    finished: collections.Counter = field(default_factory=collections.Counter)  # by finish reason / "abort" / "error"


class Scheduler:
    def __init__(self, model: Model, options: EngineOptions | None = None, **changes: Any) -> None:
        """options: the engine's settings (engine_options.py), checked there; `changes` replace some of them by
        name (Scheduler(model, max_num_seqs=4, kv="upfront"))."""
        o = options if options is not None else EngineOptions()
        o = o.replace(**changes) if changes else o
        self.options = o
        self.model, self.max_num_seqs, self.max_num_batched_tokens = model, o.max_num_seqs, o.max_num_batched_tokens
        self.max_queue = o.max_queue
        self.kv, self.r, self.T = o.kv, o.r, o.T
        self.max_length = model.max_context if o.max_length is None else o.max_length
        if not 1 <= self.max_length <= model.max_context:
            raise InvalidRequestError(f"max_length must be in [1, {model.max_context}], got {self.max_length}")
        self.eos = eos_ids(model)
        gen = o.generation_defaults()
        # The batch cache: T chosen for a full batch at the longest context (with speculation, Eq. 9's k and m);
        # it starts with no rows.
        self.cache_stats = GenerationStats()  # how the batch cache was sized: r, T and where T came from
        self.cache = make_cache(model, gen, o.max_num_seqs, self.max_length, [0] * o.max_num_seqs, self.cache_stats)
        self.cache.keep_spare = True  # joins and leaves copy into the last buffer (and growth too on CUDA): no fresh pages
        self.cache.regroup([])
        self.decode_attention = served_attention(model, self.cache, o.attention, o.attention_options)
        # CUDA: the plain decode step (dense attention over the batch cache alone) captured once per capacity
        # bucket and batch, as generate() does; joins and leaves in place keep the buffers, so the graph replays
        self.graphs = (DecodeGraphs(model, self.decode_attention) if o.cuda_graphs and model.device.type == "cuda"
                       and o.attention == "dense" and o.kv in ("bmc", "upfront") else None)
        if self.graphs is not None and self.cache.window is None:
            # the batch cache borrows the model's arena while it holds rows and grows in place there: each bucket
            # has the same addresses in every call, so its graph is captured once per model (graphs.py)
            self.cache.arena, self.cache.arena_rows = graph_store(model).arena, o.max_num_seqs
            self.cache.grow_in_place = True
        self.prefix_cache: PrefixCache | None = None
        self.prefix_cache_off = (prefix_cache_unsupported(model, self.max_length) if o.prefix_cache_bytes > 0
                                 else "off")
        if self.prefix_cache_off is None:
            self.prefix_cache = PrefixCache(o.prefix_cache_bytes, self.cache.format.name, block=o.prefix_block,
                                            max_length=self.max_length)
        self.min_shared = o.prefix_block if o.min_shared is None else max(o.min_shared, o.prefix_block)
        self.keep_turns = o.keep_turns
        # A hit is read in place as shared segments (one copy for every row whose prompt starts with it) where the
        # decode attention is the dense one the segment kernels merge into; SparQ's and the speculative trees'
        # attention read the row's own cache only, and a sliding window within reach needs each column's position,
        # so there a hit is copied into the request's prompt cache.
        self.read_in_place = reads_in_place(model, o.attention, o.speculative, self.max_length)
        self._segments_key: tuple | None = None
        self._segments: AttentionFn = self.decode_attention
        self._segments_age = 0  # decode steps the current segments attention has run (a graph pays once it lasts)
        # CUDA: steps whose rows read cached segments get graphs of their own (the plain step's graph stays beside)
        self.segment_graphs = DecodeGraphs(model, self.decode_attention, persistent=False) if (
            self.graphs is not None and self.read_in_place) else None
        self.spec = served_speculation(model, o.speculative, o.tree, o.spec_trim)
        # greedy decode steps launched before the last one's tokens are read (run_ahead.py): by default where the
        # steps are CUDA graphs; never where a row's next step depends on the host beyond its token
        self.run_ahead = (self.graphs is not None if o.run_ahead is None else o.run_ahead) and (
            self.spec is None and self.cache.window is None and longrope_switch(model.config) is None)
        self._ahead: Ahead | None = None  # the last step's tokens, not read yet
        self._drafting: set[int] = set()  # rows the drafter keeps a context for
        self.spec_max_tokens = o.spec_max_tokens
        self.chunk_budget: ChunkBudget | None = None  # prompt chunks cut by measured cost (chunk_budget.py)
        self.rows: list[_Row | None] = []  # one per batch-cache row; None = a retired slot waiting for a join
        self.waiting: collections.deque[Request] = collections.deque()
        self.prefilling: list[_Prefill] = []
        self.joining: list[tuple[_Prefill, list[_Row]]] = []
        self.counters = SchedulerCounters()
        # CPU decode steps run on fewer threads while other processes hold the cores (platform/threads.py)
        native = model.net.native_decoder() if model.device.type == "cpu" else None
        self._native_decoder = native  # built once per model: looked up here, not per step
        if native is not None:  # attention splits its work for the configured count, whatever count runs it
            native.set_split_threads(torch.get_num_threads())
        if o.itl_factor > 0:
            if model.full_config is not None:  # every rank must cut alike; each would time its own steps
                raise InvalidRequestError("itl_factor under tensor parallelism is not built (each rank would cut "
                                          "prompt chunks by its own timing)")
            if native is None:
                raise InvalidRequestError(
                    "itl_factor needs the native CPU step, where a prompt chunk shares one forward with the running "
                    f"rows; on {model.device.type} with this model a chunk is a forward of its own (the token budget "
                    "alone bounds it there)")
            self.chunk_budget = ChunkBudget(o.itl_factor)
        self.threads = (ThreadGovernor(torch.get_num_threads()) if o.adaptive_threads and native is not None
                        and torch.get_num_threads() > 1 else None)
        self.last_step: dict[str, float] = {}  # the phases of the last step, for logs
        self.peak_kv_bytes = 0  # the most KV bytes held in a step's forward or at its end: batch, prefills, prefix cache
        self.peak_running_kv_bytes = 0  # of those, what running requests read: batch, prefills, pinned cached paths
        self._inbox: collections.deque[Request] = collections.deque()
        self._requests: dict[int, Request] = {}  # every request added and not done, wherever it is: fail_all and
        # close() answer each of them, also one that has left every list mid-step
        self.closed: BaseException | None = None
        self._lock = threading.Lock()
        self.wakeup = threading.Event()  # set when work arrives, for an engine thread that sleeps while idle

    # ---- any thread --------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request (it joins at a step boundary). Raises QueueFullError when max_queue requests wait."""
        gen, P = request.gen, len(request.prompt_ids)
        if P + gen.max_new_tokens > self.max_length:
            where = "the model's context" if self.max_length == self.model.max_context else "this engine's max_length"
            raise InvalidRequestError(f"the prompt has {P} tokens; with max_tokens={gen.max_new_tokens} that is "
                                      f"{P + gen.max_new_tokens} positions, beyond {where} of {self.max_length}")
        request.sampler.params.check_vocab(self.model.config.vocab_size)
        if request.num_samples > self.max_num_seqs:
            raise InvalidRequestError(f"n={request.num_samples} exceeds the server's max_num_seqs={self.max_num_seqs}")
        with self._lock:
            if self.closed is not None:
                raise EngineStoppedError(f"the engine has stopped ({type(self.closed).__name__}: {self.closed})")
            if self.max_queue is not None and self.num_waiting - self.free_seats >= self.max_queue:
                raise QueueFullError(f"the queue is full ({self.max_queue} requests waiting)")
            self._inbox.append(request)
            self._requests[id(request)] = request
        self.wakeup.set()

    def abort(self, request: Request) -> None:
        """Cancel a request: its rows and KV are freed at the next step boundary, after which it emits nothing (a
        token of the step in flight, or of a step run ahead and not read yet, may still come before)."""
        request.cancelled = True
        self.wakeup.set()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._inbox)

    @property
    def free_seats(self) -> int:
        """Rows not taken by running, prefilling or joining requests (read from any thread: a snapshot)."""
        taken = len(self.live_rows) + sum(p.request.num_samples for p in self.prefilling) + sum(
            len(rows) for _, rows in self.joining)
        return max(0, self.max_num_seqs - taken)

    @property
    def num_running(self) -> int:
        """Requests admitted and not done: prefilling, joining or decoding."""
        live = {id(r.request) for r in self.live_rows if not r.request.done}
        live.update(id(p.request) for p in self.prefilling)
        live.update(id(p.request) for p, _ in self.joining)
        return len(live)

    @property
    def kv_bytes(self) -> int:
        """KV bytes held: the batch cache and the caches of prompts being prefilled or about to join."""
        own = sum(p.cache.nbytes for p in self.prefilling) + sum(p.cache.nbytes for p, _ in self.joining)
        return self.cache.nbytes + self.cache.spare_nbytes + own

    def fail_all(self, error: BaseException) -> None:
        """An unexpected error outside any one request: every request not done fails with it (each answered before
        any state is touched), the batch cache is emptied, and the scheduler takes new requests again."""
        self.fail_requests(error)
        self._ahead = None
        self.waiting.clear()
        self.prefilling, self.joining, self.rows = [], [], []
        with torch.inference_mode():
            self.cache.regroup([])

    def fail_requests(self, error: BaseException) -> None:
        """Every request added and not done fails with `error`; nothing else is touched (safe from any thread once
        the engine thread is gone)."""
        with self._lock:
            self._inbox.clear()
            requests = list(self._requests.values())
        for req in requests:
            self._fail(req, error)

    def close(self, error: BaseException) -> None:
        """The engine thread is gone: refuse new requests and answer every one in flight with `error`."""
        with self._lock:
            self.closed = error
        self.fail_requests(error)

    @property
    def live_rows(self) -> list[_Row]:
        return [r for r in self.rows if r is not None]

    def has_work(self) -> bool:
        return bool(self.live_rows or self.waiting or self.prefilling or self.joining or self._inbox)

    # ---- the engine thread ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        self._intake()
        t0 = time.perf_counter()
        if self._ahead is not None and not self._runs_on(self._ahead.rows):
            self._land_ahead()  # the step may change the batch: the last step's tokens are read first
        self._drop_cancelled()
        self._leave_and_join()
        if self._segments_key is not None and not any(r.request.prefix_node for r in self.live_rows):
            self._segments, self._segments_key = self.decode_attention, None  # it holds the nodes' tensors
            if self.segment_graphs is not None:
                self.segment_graphs.drop()
        self._relong()
        self._forget_drafts()
        self._admit()
        t1 = time.perf_counter()
        draft = self._draft() if self.spec is not None and self.live_rows else None
        decode = self._decode_part() if self.live_rows and draft is None else None
        per_row = 1 + draft[0].num_nodes if draft is not None else 1  # forward rows a batch row takes
        budget = self.max_num_batched_tokens - len(self.rows) * per_row
        running = 0  # the running rows' forward rows (chunk_budget.py: only whether there are any)
        if self.chunk_budget is not None and (draft is not None or decode is not None):
            running = len(self.live_rows) * per_row
        if self.chunk_budget is not None and self.prefilling:
            budget = self.chunk_budget.prompt_tokens(running, budget)
        chunks = self._chunk_parts(budget)
        ahead = decode is not None and not chunks and self._runs_on(self.rows)
        if draft is not None:  # the trees' own forward: verify logits of every node, not the last token's
            self._verify(*draft)
        verify_rows = len(self.rows) * (1 + draft[0].num_nodes) if draft is not None else 0
        parts = ([decode] if decode is not None else []) + [part for _, part in chunks]
        fused_before = self.counters.fused_steps
        governed = self.threads is not None and decode is not None and not chunks and self._thread_free(decode)
        if governed:
            self.threads.begin()
        try:
            results = self._forward(parts)
        finally:
            if governed:
                self.threads.end()
        held_in_forward = self.kv_bytes  # before finishing: a prompt that ends in its prefill frees its cache
        if decode is not None:
            self._finish_decode(results.pop(0), decode, ahead)
        for (group, part), result in zip(chunks, results):
            if len(group) == 1:
                self._finish_chunk(group[0], int(part.tokens.shape[1]), result, part.cache)
            else:
                self._finish_group(group, part, result)
        auto = self.spec.auto if self.spec is not None else None
        if auto is not None and not chunks and (draft is not None or decode is not None):  # a step of decode rows
            auto.timed(verify_rows or len(self.rows), time.perf_counter() - t1, draft is not None)
        prompt_tokens = sum(int(part.tokens.shape[1]) for _, part in chunks)
        if self.chunk_budget is not None and (not chunks or self.counters.fused_steps > fused_before):
            # (a step whose parts ran as forwards of their own, a fused step that failed, is not the model's)
            self.chunk_budget.timed(running, prompt_tokens, time.perf_counter() - t1)
        pc = self.prefix_cache
        held = self.kv_bytes
        self.peak_kv_bytes = max(self.peak_kv_bytes, max(held, held_in_forward) + (pc.nbytes if pc is not None else 0))
        self.peak_running_kv_bytes = max(self.peak_running_kv_bytes, held + (pc.pinned_bytes if pc is not None else 0))
        self.last_step = {"leave_join_s": t1 - t0, "forward_s": time.perf_counter() - t1, "rows": len(self.rows),
                          "prompt_tokens": prompt_tokens,
                          "columns": self.cache.length}

    def _intake(self) -> None:
        """The requests added since the last step join the waiting queue (at a step boundary, so a step sees one
        set of requests; a tensor-parallel leader also hands them to its followers here: parallel/serve.py)."""
        with self._lock:
            self.waiting.extend(self._inbox)
            self._inbox.clear()

    def _drop_cancelled(self) -> None:
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
            self._finish_request(req, "abort")
        for p in [p for p in self.prefilling if p.request.cancelled]:
            self.prefilling.remove(p)
            self._finish_request(p.request, "abort")
        for p, rows in [j for j in self.joining if j[0].request.cancelled]:
            self.joining.remove((p, rows))
            self._finish_request(p.request, "abort")
        if any(row.request.cancelled and not row.request.done for row in self.live_rows):
            self._land_ahead()  # a cancel that came after the step's start: the last step's tokens first
        for row in self.live_rows:
            if row.request.cancelled and not row.request.done:
                self._release(row.request)
                self._keep_turn(row)  # what was said so far: a client that stops a reply may still go on from it
                self._finish_request(row.request, "abort")

    def _leave_and_join(self) -> None:
        """Rows that finished or were cancelled are retired in place (no copy); prefilled requests take retired
        slots in place (one row's columns copied) when they fit the batch's length. A full regroup (one copy of the
        batch) runs only when a join does not fit (no free slot, or a prompt longer than the batch), when slots
        are free and no request is on its way to fill them, or at a chunk boundary with leading columns that no
        row reads (the compaction)."""
        cache = self.cache
        leaving = [i for i, r in enumerate(self.rows) if r is not None and (r.finish is not None or r.request.done)]
        if leaving:
            cache.retire(leaving)
            for i in leaving:
                self.rows[i] = None
        joins = [(p, [row for row in rows if row.finish is None]) for p, rows in self.joining]
        self.joining = []
        free = [i for i, r in enumerate(self.rows) if r is None]
        overflow: list[tuple[_Prefill, list[_Row]]] = []
        for p, rows in joins:
            if not rows:
                continue
            width = p.cache.length - int(p.cache.left_pad[0])
            if len(free) < len(rows) or width > cache.length:
                overflow.append((p, rows))
                continue
            for row in rows:  # each sample gets its own copy of the prompt's KV
                slot = free.pop(0)
                cache.place(slot, p.cache)
                self.rows[slot] = row
            self.counters.joins_in_place += 1
        live = [i for i, r in enumerate(self.rows) if r is not None]
        # retired slots cost a step little (no columns read, and a GEMM row is cheap beside the weights' reads):
        # the batch shrinks once half of it is idle, so a draining batch copies itself a few times, not per leave
        idle_slots = len(live) <= len(self.rows) // 2 and not (self.waiting or self.prefilling)
        at_boundary = (cache.length + 1 > cache.capacity and bool(live)
                       and int(cache.left_pad.index_select(0, torch.tensor(live, device=cache.device)).min()) > 0)
        if not (overflow or idle_slots or at_boundary):
            return
        self.counters.regroups += 1
        if not (overflow or idle_slots):  # the compaction alone: retired slots stay for the requests on their way,
            cache.regroup(range(len(self.rows)))  # and every row keeps its slot (moved in place on a CPU)
            return
        # the prompt's KV, one copy per sample still running (only its columns after what is read in place)
        cache.regroup(live, [(p.cache, [0] * len(rows)) for p, rows in overflow])
        self.rows = [self.rows[i] for i in live] + [row for _, rows in overflow for row in rows]

    def _relong(self) -> None:
        """longrope: batch rows still rotated short whose next token is past the switch get their KV recomputed with
        the long factors (engine.relong), as generate() alone does at that step."""
        switch = longrope_switch(self.model.config)
        if switch is None:
            return
        for i, row in enumerate(self.rows):
            if row is None or row.history is None or row.finish is not None or row.pos < switch:
                continue
            try:
                relong(self.model, self.cache, i, row.history[:-1])
            except Exception as e:
                self._fail(row.request, e)
                continue
            row.history = None
            self.counters.relongs += 1

    @torch.inference_mode()
    def capture_ladder(self, rows: int) -> int:
        """CUDA: capture the decode step of `rows` rows at every capacity the batch cache can pass through (its
        growth rule, from the first chunk up to max_length) before any request runs, so that no capture happens
        inside a user-facing run: a batch of placeholder rows steps once near the end of each bucket (as a real
        run would capture it) and leaves. Graphs are kept per model (graphs.py). Returns the graphs captured."""
        if self.graphs is None or self.cache.arena is None or self.cache.batch_size or rows < 1:
            return 0
        dev, cache = self.model.device, self.cache
        # one column per row, as a prefill's cache holds only its prompt (an upfront seed of max_length would hold a
        # second batch-sized cache beside the arena)
        seed = make_cache(self.model, self.options.generation_defaults(), rows, 1, [0] * rows, GenerationStats())
        seed.reserve(1)
        zeros = torch.zeros(rows, self.model.config.num_kv_heads, 1, self.model.config.head_dim,
                            dtype=self.model.dtype, device=dev)
        for layer in range(self.model.config.num_layers):
            seed.update(layer, zeros, zeros)
        seed.commit(1)
        cache.regroup([], [seed])
        if not cache.on_arena:  # the arena is held elsewhere or too large: graphs of this call would not be kept
            cache.regroup([])
            return 0
        before, tok = self.graphs.captures, torch.zeros(rows, dtype=torch.long, device=dev)
        allocations = cache.allocations  # the placeholder's growths are not the run's
        try:
            while True:
                cache.length = max(cache.length, cache.capacity - MIN_BUCKET_STEPS)  # the columns skipped: masked
                cache.holes = True
                pos = torch.full((rows, 1), cache.length, dtype=torch.long, device=dev)
                cache.reserve(1, pos)
                self.graphs.step(cache, tok, pos[:, 0])
                cache.commit(1)
                if cache.capacity >= self.max_length:
                    break
                cache.length = cache.capacity  # the next reserve grows the cache into the next bucket
        finally:
            cache.regroup([])
            cache.allocations = allocations
        return self.graphs.captures - before

    def _decode_part(self) -> StepPart | None:
        """One token for every batch row: its column reserved in the batch cache (a retired slot computes a token
        no one reads, at position 0, until a join fills it or a regroup drops it). After a step run ahead, the
        tokens are its own, still on the device."""
        rows, dev = self.rows, self.model.device
        if self._ahead is not None and not self._runs_on(self._ahead.rows):
            self._land_ahead()  # (the batch changed since the step's start: its rows' tokens come from the host)
        if self._ahead is not None:
            tokens, pos = self._ahead.tokens[:, None], self._ahead.positions[:, None]
        else:
            tokens = torch.tensor([[r.token if r else 0] for r in rows], dtype=torch.long, device=dev)
            pos = torch.tensor([[r.pos if r else 0] for r in rows], dtype=torch.long, device=dev)
        try:
            self.cache.reserve(1, pos)
        except Exception as e:
            self._land_ahead()  # the step before did produce its tokens
            self._fail_batch(e)
            return None
        return StepPart(tokens, pos, self.cache, self.cache.bias, self._batch_attention())

    def _batch_attention(self) -> AttentionFn:
        """The decode step's attention: with rows that read cached prompt paths in place, every cached node on
        those paths is one shared segment, read once for all its rows (Hydragen), merged with each row's own
        columns; else the batch cache alone. Rebuilt when the rows or the prefix cache's nodes change."""
        nodes = [r.request.prefix_node if r is not None else None for r in self.rows]
        if not any(nodes):
            return self.decode_attention
        assert self.prefix_cache is not None
        key = (tuple(map(id, nodes)), self.prefix_cache.version)
        if key != self._segments_key:
            readers: dict[int, tuple[Node, list[int]]] = {}
            for b, node in enumerate(nodes):
                for seg in node.path() if node is not None else ():
                    readers.setdefault(id(seg), (seg, [-1] * len(nodes)))[1][b] = 0
            segments = [(seg.kv, seg.bias(self.cache.dtype), group) for seg, group in readers.values()]
            self._segments = SharedPrefix.of_segments(segments, read=self.cache.read).attention  # type: ignore
            self._segments_key, self._segments_age = key, 0
            if self.segment_graphs is not None:  # its graph reads the old segments: let them go
                self.segment_graphs.drop()
        self._segments_age += 1
        return self._segments

    @property
    def shared_segments(self) -> int:
        """Distinct cached nodes that batch rows read in place (the segments of the decode step's attention)."""
        return len({id(n) for r in self.live_rows if r.request.prefix_node is not None
                    for n in r.request.prefix_node.path()})

    @property
    def shared_prefix_rows(self) -> int:
        """Batch rows that read a cached prompt path in place."""
        return sum(1 for r in self.live_rows if r.request.prefix_node is not None)

    # ---- speculative decoding (the tree is verified in the batch cache's padding rows) ----
    def _speculates(self, row: _Row | None) -> bool:
        """Rows draft and verify: greedy rows by the argmax (exact), sampled rows by rejection sampling with their
        request's generator (lossless, spec/verify.py). Rows that report logprobs, or whose request adjusts its
        logits (logit_bias, penalties, a grammar: the adjustment along a drafted path would depend on the path), take
        one token per step from the root's logits inside the same forward (so no draft reaches them unchecked)."""
        return (row is not None and row.finish is None and row.request.logprobs is None
                and not row.request.sampler.params.adjusts_logits and row.request.gen.grammar is None)

    def _draft(self) -> tuple[DraftTree, int, list[Proposal]] | None:
        """Every greedy row's draft tree, within the token budget (half of it while prompts wait, so prefill
        keeps moving) and within spec_max_tokens verify rows in all; None when no row has a draft (the step is a
        plain, fused decode).

        Why a cap on verify rows: drafts are free while the step is bound by reading the weights and cost their
        FLOPs once it is bound by arithmetic: fp32 weights give 2 FLOP per 4 bytes read per token row, so a CPU
        turns compute-bound at (GEMM peak FLOP/s) / (2 x read bandwidth) rows, about a dozen on a few cores
        (figures: docs/performance.md, "Figures behind the code's choices")."""
        spec, rows = self.spec, self.rows
        assert spec is not None
        switch = longrope_switch(self.model.config)  # a row still rotated short drafts up to the switch only
        specs = [spec.spec.capped(min(r.request.gen.max_new_tokens - r.count, switch - r.pos if r.history is not None
                                      else r.request.gen.max_new_tokens) - 1) if self._speculates(r) else None
                 for r in rows]
        share = self.max_num_batched_tokens // (2 if self.prefilling or self.waiting else 1)
        if self.spec_max_tokens is not None:
            share = min(share, self.spec_max_tokens)
        most = share // len(rows) - 1
        if spec.auto is not None:  # the step's tree size from measured costs and acceptance (spec/auto.py)
            auto = spec.auto
            drafting = [r.key for r, s in zip(rows, specs) if s is not None]  # type: ignore[union-attr]
            for r, s in zip(rows, specs):
                if s is not None:
                    auto.observe(r.key, r.token)  # type: ignore[union-attr]
            most = auto.nodes(len(rows), drafting, most) if drafting else 0
            if most < 1:
                if drafting and spec.drafter.cheap:  # a first token for each, checked against what it decodes
                    ones = [s.capped(1) if s is not None else None for s in specs]
                    for key, p in zip(drafting, spec.drafter.propose_batch(drafting, [s for s in ones if s])):
                        if p.tokens:
                            auto.guessed(key, p.tokens[0])
                return None
            specs = [s.capped(most) if s is not None else None for s in specs]
        try:
            tree, proposals, free = spec.draft(self.cache, [r.key if r else -1 for r in rows], specs)
        except Exception:  # a drafter that fails (a draft model's forward) costs speed, never a request: any
            # proposal verifies to the same tokens, so this step decodes plainly
            log.exception("the drafter failed; this step decodes without drafts")
            self.counters.draft_failures += 1
            return None
        nodes = min(tree.num_nodes, most)
        if nodes < 1 or not bool(tree.valid[:, :nodes].any()):
            if spec.auto is not None:  # nothing proposed: the drafting rows' nodes count as not accepted
                spec.auto.record([(r.key, [0]) for r, s in zip(rows, specs) if s is not None], most)  # type: ignore[union-attr]
            return None
        return tree.truncate(nodes), free, proposals

    def _verify(self, tree: DraftTree, free: int, proposals: list[Proposal]) -> None:
        rows, dev = self.rows, self.model.device
        tokens = torch.tensor([r.token if r else 0 for r in rows], dtype=torch.long, device=dev)
        pos = torch.tensor([r.pos if r else 0 for r in rows], dtype=torch.long, device=dev)
        try:
            logits = SpeculativeStep.verify_forward(self.model, self.cache, self.decode_attention, tree, tokens, pos)
        except Exception as e:
            self._fail_batch(e)
            return
        preds = argmax(logits).tolist()
        nodes, parents, valid = tree.tokens.tolist(), tree.parents.tolist(), tree.valid.tolist()
        paths = greedy_accept(nodes, parents, valid, preds)
        bonus = [preds[i][path[-1]] for i, path in enumerate(paths)]
        live = [i for i, r in enumerate(rows) if r is not None]
        sampled: dict[int, list[int]] = {}  # each sampling request's speculating rows
        for i in live:
            if self._speculates(rows[i]) and not rows[i].request.sampler.params.greedy:
                sampled.setdefault(id(rows[i].request), []).append(i)
        probs = self._target_probs(logits, [rows[idx[0]].request for idx in sampled.values()], list(sampled.values()))
        for idx in sampled.values():
            req = rows[idx[0]].request
            try:
                at = torch.tensor(idx, device=logits.device)
                walked, drawn = sample_paths([nodes[i] for i in idx], [parents[i] for i in idx],
                                             [valid[i] for i in idx], logits.index_select(0, at),
                                             [proposals[i].q for i in idx], req.sampler,
                                             probs[id(req)] if id(req) in probs else None)
            except Exception as e:
                self._fail(req, e)
                walked, drawn = [[0] for _ in idx], [0] * len(idx)
            for i, path, token in zip(idx, walked, drawn):
                paths[i], bonus[i] = path, token
        self.cache.accept(paths, 1 + tree.num_nodes)
        assert self.spec is not None
        self.spec.record(tree, paths, free)
        if self.spec.auto is not None:
            self.spec.auto.record([(rows[i].key, paths[i]) for i in live if self._speculates(rows[i])],  # type: ignore[union-attr]
                                  tree.num_nodes)
        self.counters.decode_steps += 1
        plain = [i for i in live if not self._speculates(rows[i])]
        if plain:  # their trees are empty: path [0], the root's logits as a plain decode step
            self._sample_and_emit(logits[plain, 0], [rows[i] for i in plain])
        for i in live:
            row = rows[i]
            if not self._speculates(row):
                continue
            for tid in [nodes[i][j - 1] for j in paths[i][1:]] + [bonus[i]]:
                self._emit(row, tid, False, None)
                if row.finish is not None or row.request.done:
                    break

    @staticmethod
    def _target_probs(logits: torch.Tensor, requests: list[Request], rows: list[list[int]]
                      ) -> dict[int, torch.Tensor]:
        """The target distribution at every verify position of each sampling request's rows, made in one
        Sampler.probs call for all requests that sample with the same parameters (their generators differ, their
        distributions do not); a group that fails is left to sample_paths, which fails its requests alone."""
        groups: dict[tuple, list[int]] = {}
        for j, req in enumerate(requests):
            p = req.sampler.params
            groups.setdefault((p.temperature, p.top_k, p.top_p, p.min_p), []).append(j)
        out: dict[int, torch.Tensor] = {}
        for members in groups.values():
            idx = [i for j in members for i in rows[j]]
            _, t, V = logits.shape
            try:
                picked = logits.index_select(0, torch.tensor(idx, device=logits.device)).reshape(-1, V).float()
                probs = requests[members[0]].sampler.probs(picked).view(len(idx), t, V)
            except Exception:
                continue
            at = 0
            for j in members:
                out[id(requests[j])] = probs[at : at + len(rows[j])]
                at += len(rows[j])
        return out

    def _forget_drafts(self) -> None:
        """Drop the drafter's state of rows that left (finished, cancelled, failed)."""
        if self.spec is None:
            return
        keep = {r.key for r in self.live_rows} | {r.key for _, rows in self.joining for r in rows}
        for key in self._drafting - keep:
            self.spec.drafter.forget(key)
            if self.spec.auto is not None:
                self.spec.auto.forget(key)
        self._drafting &= keep

    def _runs_on(self, rows: list[_Row | None]) -> bool:
        """Whether this step may run ahead (or keep running ahead) over `rows`: a step of decode rows alone over the
        same batch (nothing waiting, joining or leaving, no regroup due), every row greedy with nothing read from
        its logits on the host."""
        # (the inbox is not this step's: a request added meanwhile is taken in at the next step's intake, which lands
        # first, and a tensor-parallel follower's inbox is empty whatever rank 0's holds; waiting requests count only
        # where a seat is free for them)
        if not self.run_ahead or (self.waiting and self.free_seats > 0) or self.prefilling or self.joining:
            return False
        if len(rows) != len(self.rows) or any(a is not b for a, b in zip(rows, self.rows)):
            return False
        live = [r for r in rows if r is not None]
        if not live or len(live) <= len(rows) // 2:  # no rows, or the idle slots' regroup is due (_leave_and_join)
            return False
        for r in live:
            req, params = r.request, r.request.sampler.params
            if (r.finish is not None or req.done or req.cancelled or not params.greedy or params.adjusts_logits
                    or req.gen.grammar is not None or req.logprobs is not None):
                return False
        return True

    def _land_ahead(self) -> None:
        """The last step's tokens read and emitted, as that step would have emitted them (rows that have finished
        since drop theirs: their step was computed for nothing)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        picked, vocab = ahead.read(), ahead.vocab
        for row, tid in zip(ahead.rows, picked):
            if row is None or row.finish is not None or row.request.done:
                continue
            if not 0 <= tid < vocab:
                self._fail(row.request, SamplingError(f"the step produced token id {tid}, outside [0, {vocab})"))
                continue
            self._emit(row, tid, False, None)

    def _finish_decode(self, result: torch.Tensor | BaseException, part: StepPart | None = None,
                       ahead: bool = False) -> None:
        if isinstance(result, BaseException):  # a failed batch step fails the requests in it, not the server
            self._land_ahead()  # the step before it did produce its tokens
            self._fail_batch(result)
            return
        if ahead:  # this step's tokens stay on the device for the next step; the last step's are read meanwhile
            assert part is not None
            launched = launch(result, self.rows, part.positions[:, 0], int(result.shape[-1]),
                              self._ahead.live if self._ahead is not None else None)
            self._land_ahead()  # before the commit: a finished turn is kept from the columns before this step's
            self.cache.commit(1)
            self.counters.decode_steps += 1
            self.counters.ahead_steps += 1
            self._ahead = launched
            return
        self._land_ahead()  # (a step run ahead whose next could not: a request cancelled meanwhile)
        self.cache.commit(1)
        self.counters.decode_steps += 1
        rows = self.rows
        live = [i for i, r in enumerate(rows) if r is not None and r.finish is None]
        logits = result if len(live) == len(rows) else result.index_select(0, torch.tensor(live, device=result.device))
        self._sample_and_emit(logits, [rows[i] for i in live])

    def _fail_batch(self, error: BaseException) -> None:
        for req in {id(r.request): r.request for r in self.live_rows}.values():
            self._fail(req, error)
        self.rows = []
        self.cache.regroup([])

    def _admit(self) -> None:
        """Waiting requests take free seats, oldest first; each gets a cache of its own for its prompt. One whose
        prompt shares a long part with a prompt being prefilled waits for it (and keeps its place)."""
        seats = self.free_seats
        deferred: list[Request] = []
        while self.waiting and self.waiting[0].num_samples <= seats:
            req = self.waiting.popleft()
            if self._shares_inflight_prompt(req):
                deferred.append(req)
                continue
            req.admitted_at = time.monotonic()
            seats -= req.num_samples
            P = len(req.prompt_ids)
            # stored in the batch cache's format (the server's --kv-dtype), whatever the request's own config says
            gen = dataclasses.replace(req.gen, kv_dtype=self.cache.format.name)
            hit = None
            pc = self.prefix_cache
            if pc is not None and req.cache_prompt and (
                    self.min_shared <= pc.block or pc.peek(req.prompt_ids, self._salt(req)) >= self.min_shared):
                hit = pc.match(req.prompt_ids, self._salt(req))
            start = hit.end if hit is not None and self.read_in_place else 0  # the cache holds the rest
            cache = make_cache(self.model, gen, 1, P - start, [0], GenerationStats())
            p = _Prefill(req, cache, start=start)
            if hit is not None:
                assert self.prefix_cache is not None
                if self.read_in_place:  # read where it is stored, by every row of this prompt
                    self.prefix_cache.lock(hit)
                    req.prefix_node, req.prefix_locked = hit, True
                    p.done = start
                    p.attention = SharedPrefix.of_segments([(n.kv, n.bias(self.cache.dtype), [0]) for n in hit.path()],
                                                           read=self.cache.read).attention
                else:  # copied into the prompt's own cache
                    p.done = self.prefix_cache.seed(cache, hit)
                req.cached_tokens = hit.end
                self.counters.cached_prompt_tokens += hit.end
            self.prefilling.append(p)
        self.waiting.extendleft(reversed(deferred))

    def _salt(self, req: Request, long: bool | None = None) -> str | None:
        """The prefix cache's key space for a request's KV: its tenant (cache_salt) and, under longrope, the factors
        its KV is rotated with (long: a prompt past the switch, or a row recomputed at it), since a stored block is
        only what a prefill would compute for a prompt rotated the same way."""
        switch = longrope_switch(self.model.config)
        if switch is None:
            return req.cache_salt
        if long is None:
            long = len(req.prompt_ids) > switch
        return f"{req.cache_salt or ''}\x00longrope" if long else req.cache_salt

    def _shares_inflight_prompt(self, req: Request) -> bool:
        """Whether a prompt being prefilled (the same salt, both caching) shares at least half of what this prompt
        would prefill, and a whole block: once it is done, this one reads those tokens from the cache (a burst of
        requests with one new system prompt or document prefills it once, not once each)."""
        pc = self.prefix_cache
        if pc is None or not req.cache_prompt or not self.prefilling:
            return False
        cached = pc.peek(req.prompt_ids, self._salt(req))
        usable = len(req.prompt_ids) - 1
        for p in self.prefilling:
            other = p.request
            if self._salt(other) == self._salt(req) and other.cache_prompt:
                shared = min(common_prefix(req.prompt_ids, other.prompt_ids), usable) // pc.block * pc.block
                if shared - cached >= self.min_shared and 2 * (shared - cached) >= usable - cached:
                    return True
        return False

    def _chunk_parts(self, budget: int) -> list[tuple[list[_Prefill], StepPart]]:
        """The next chunk of each admitted prompt, oldest first, within what is left of the token budget. Where
        parts run as forwards of their own (CUDA, the PyTorch path), whole prompts that start this step are
        prefilled together as one left-padded batch, as generate() prefills its prompts."""
        chunks: list[tuple[list[_Prefill], StepPart]] = []
        whole: list[_Prefill] = []
        native = getattr(self.model.net, "native_decoder", None)
        group = ((native is None or native() is None) and self.model.config.sliding_window is None
                 and longrope_switch(self.model.config) is None)
        for p in list(self.prefilling):
            if budget <= 0:
                break
            P = len(p.request.prompt_ids)
            t = min(budget, P - p.done)
            if p.request.prompt_logprobs is not None:  # its logits bounded, whatever the batch and context
                t = min(t, scored_chunk_rows(self.model.config.vocab_size, available_memory()))
            budget -= t
            if group and p.done == 0 and t == P and p.attention is None and p.request.prompt_logprobs is None:
                whole.append(p)
                continue
            self._add_chunk(chunks, [p], lambda p=p, t=t: self._chunk_part(p, t))
        if len(whole) == 1:
            self._add_chunk(chunks, whole, lambda: self._chunk_part(whole[0], len(whole[0].request.prompt_ids)))
        elif whole:
            self._add_chunk(chunks, whole, lambda: self._group_part(whole))
        return chunks

    def _add_chunk(self, chunks: list, group: list[_Prefill], make: Callable[[], StepPart]) -> None:
        try:
            chunks.append((group, make()))
        except Exception as e:
            for p in group:
                self.prefilling.remove(p)
                self._fail(p.request, e)

    def _group_part(self, group: list[_Prefill]) -> StepPart:
        """Whole prompts prefilled as one batch, left-padded into a cache of their own (each row is copied into
        its request's cache once the forward is done)."""
        dev, cfg = self.model.device, self.model.config
        lengths = [len(p.request.prompt_ids) for p in group]
        M = max(lengths)
        pads = [M - n for n in lengths]
        gen = GenerationConfig(kv="upfront", kv_dtype=self.cache.format.name)
        cache = make_cache(self.model, gen, len(group), M, pads, GenerationStats())
        pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        tokens = torch.tensor([[pad_id] * lp + p.request.prompt_ids for lp, p in zip(pads, group)], dtype=torch.long,
                              device=dev)
        positions = (torch.arange(M, device=dev)[None, :] - torch.tensor(pads, device=dev)[:, None]).clamp(min=0)
        cache.reserve(M, positions)
        return StepPart(tokens, positions, cache, cache.attention_bias(M), prefill_attention(dense_attention, cache, M),
                        prompt_len=torch.tensor(lengths))

    def _finish_group(self, group: list[_Prefill], part: StepPart, result: torch.Tensor | BaseException) -> None:
        """Each prompt of a batch prefill: its row copied into its own cache (as a hit is seeded), then finished as
        a prompt prefilled alone."""
        if isinstance(result, BaseException):
            for p in group:
                self._finish_chunk(p, 0, result)
            return
        src, M = part.cache, int(part.tokens.shape[1])
        src.commit(M)
        for i, p in enumerate(group):
            n, dev = len(p.request.prompt_ids), self.model.device
            try:
                p.cache.reserve(n, torch.arange(n, device=dev)[None])
                p.cache.kv[:, :, 0, :, :n].copy_(src.kv[:, :, i, :, M - n : M])
            except Exception as e:
                self._finish_chunk(p, 0, e)
                continue
            self._finish_chunk(p, n, result[i : i + 1], p.cache)

    def _chunk_part(self, p: _Prefill, t: int) -> StepPart:
        """The next t prompt tokens, reserved in the request's own cache (prefilled as generate() prefills)."""
        dev, cache = self.model.device, p.cache
        tokens = torch.tensor([p.request.prompt_ids[p.done : p.done + t]], dtype=torch.long, device=dev)
        positions = torch.arange(p.done, p.done + t, device=dev)[None]
        cache.reserve(t, positions)
        attention = p.attention if p.attention is not None else prefill_attention(dense_attention, cache, t)
        scored = p.request.prompt_logprobs is not None
        return StepPart(tokens, positions, cache, cache.attention_bias(t), attention,
                        prompt_len=torch.tensor([len(p.request.prompt_ids)]), all_logits=scored,
                        score=(lambda logits, p=p, t=t: self._score_prompt(p, t, logits)) if scored else None)

    def _forward(self, parts: list[StepPart]) -> list[torch.Tensor | BaseException]:
        """Last-token logits of every part: one fused step where the native kernel runs them all (the weights read
        once for the decode rows and the prompt chunks), else one forward each. A fused step that fails is run
        again part by part, so an error fails only the part it comes from."""
        net = self.model.net
        if len(parts) > 1 and hasattr(net, "forward_parts") and not any(part.all_logits for part in parts):
            try:
                fused = net.forward_parts(parts)
            except Exception:
                fused = None
            if fused is not None:
                self.counters.fused_steps += 1
                return list(fused.split([int(part.tokens.shape[0]) for part in parts]))
        results: list[torch.Tensor | BaseException] = []
        for part in parts:
            try:
                graphs = self._graphs_for(part)
                if graphs is not None:
                    logits = graphs.step(part.cache, part.tokens[:, 0], part.positions[:, 0], part.attention)
                else:
                    logits = net(part.tokens, part.positions, part.cache, part.attention, part.bias,
                                 prompt_len=part.prompt_len, all_logits=part.all_logits)
                results.append(part.score(logits) if part.score is not None else logits[:, -1])
                del logits
            except Exception as e:
                results.append(e)
        return results

    def _thread_free(self, part: StepPart) -> bool:
        """Whether this decode part's logits are the same at any thread count: the native step's decode (each
        output computed by one thread), one token a row."""
        return part.tokens.shape[1] == 1 and self._native_decoder is not None and part.native_ready()

    def _graphs_for(self, part: StepPart) -> DecodeGraphs | None:
        """The graphs that run this part: the batch's decode step over its own cache, or over cached segments once
        the same rows have read the same segments for SEGMENT_GRAPH_AFTER steps (a join or leave of a reader
        changes them, and a capture costs a few steps); None: eager."""
        if self.graphs is None or part.cache is not self.cache or part.tokens.shape[1] != 1:
            return None
        if part.attention is self.decode_attention:
            return self.graphs
        if (self.segment_graphs is not None and part.attention is self._segments
                and self._segments_age > SEGMENT_GRAPH_AFTER):
            return self.segment_graphs
        return None

    def _finish_chunk(self, p: _Prefill, t: int, result: torch.Tensor | BaseException,
                      reserved: KVCache | None = None) -> None:
        """The chunk of t prompt tokens forwarded into `reserved` (p's cache) is committed; a done prompt is kept in
        the prefix cache and its rows sample their first token."""
        req = p.request
        if isinstance(result, BaseException):
            self.prefilling.remove(p)
            self._fail(req, result)
            return
        assert reserved is p.cache  # a scored prompt's chunk was scored right after its forward (StepPart.score)
        p.cache.commit(t)
        p.done += t
        self.counters.prefill_chunks += 1
        if p.done < len(req.prompt_ids):
            return
        self.prefilling.remove(p)
        self.counters.prompt_tokens += len(req.prompt_ids)
        if self.prefix_cache is not None and req.cache_prompt:
            ids = req.prompt_ids if req.cache_limit is None else req.prompt_ids[: req.cache_limit]
            self.prefix_cache.insert(ids, p.cache, self._salt(req), cache_start=p.start)
            # with CUDA graphs a single row keeps its prompt in its own columns: a prompt's own part is no one
            # else's, and as a segment it would make the row's every step a segment step, whose graph a join redoes
            if self.read_in_place and (req.num_samples > 1 or self.graphs is None):
                self._share_prompt(p, OWN_PROMPT_IN_PLACE if req.num_samples == 1 else self.prefix_cache.block)
        n = req.num_samples
        switch = longrope_switch(self.model.config)
        short = switch is not None and len(req.prompt_ids) <= switch
        start = req.prefix_node.end if req.prefix_node is not None else 0
        keep_turn = n == 1 and self.keep_turns and self.prefix_cache is not None and req.cache_prompt
        rows = [_Row(req, s, token=-1, pos=len(req.prompt_ids),
                     text=TextStream(self.model.tokenizer, req.gen.stop) if self.model.tokenizer else None,
                     history=list(req.prompt_ids) if short else None, start=start,
                     generated=[] if keep_turn else None, counts=self._zero_counts(req))
                 for s in range(n)]
        if self.spec is not None:
            for row in filter(self._speculates, rows):
                self.spec.drafter.start(row.key, req.prompt_ids, req.sampler)  # its tokens follow through _emit
                self._drafting.add(row.key)
        self._sample_and_emit(result.expand(n, -1), rows, first=True)
        if all(row.finish is not None for row in rows):  # max_tokens=1, or EOS / a stop string at once
            self._finish_request(req, rows[-1].finish or "stop")
        elif not req.done:
            self.joining.append((p, rows))

    @staticmethod
    def _score_prompt(p: _Prefill, t: int, logits: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of the chunk's next prompt tokens under its logits [1, t, V] (one position's
        log-softmax row at a time would be slower; one chunk's is t * V floats); the last position's logits."""
        req = p.request
        assert req.prompt_logprobs is not None
        ids, start = req.prompt_ids, p.done
        lp = torch.log_softmax(logits[0].float(), dim=-1)
        targets = ids[start + 1 : start + t + 1]
        if targets:
            picked = lp[: len(targets)].gather(-1, torch.tensor(targets, device=lp.device)[:, None])[:, 0]
            req.prompt_logprobs.extend(picked.double().tolist())
            if req.prompt_top:
                top = torch.topk(lp[: len(targets)], min(req.prompt_top, lp.shape[-1]), dim=-1)
                req.prompt_top_logprobs.extend([list(zip(i, v)) for i, v in zip(top.indices.tolist(),
                                                                                 top.values.double().tolist())])
        if start + t == len(ids):
            req.next_logprobs = lp[-1].clone()
        return logits[:, -1].clone()  # a view would keep the chunk's [t, V] logits alive for the whole step

    def _share_prompt(self, p: _Prefill, at_least: int) -> None:
        """A prompt's rows read its blocks just cached in place instead of copies in the batch cache: its samples
        read one copy, and a long prompt does not widen the batch (rows are right-aligned on one write column, so
        one row of 2000 columns costs every row 2000). The prompt cache's columns before the cached path's end
        become padding that a join copies nothing of. Only where the cached blocks past the hit are at_least
        tokens."""
        req, pc = p.request, self.prefix_cache
        assert pc is not None
        if (len(req.prompt_ids) - 1) // pc.block * pc.block - p.start < at_least:  # a match could not be long enough
            return
        node = pc.match(req.prompt_ids, self._salt(req), count=False)
        if node is None or node.end - p.start < at_least:
            return
        pc.lock(node)
        self._release(req)
        req.prefix_node, req.prefix_locked = node, True
        p.cache.hide_leading(0, node.end - p.start)

    def _matcher(self, row: _Row) -> RowMatcher:
        """The row's grammar matcher (made at its first token; the grammar compiled once per request)."""
        if row.matcher is None:
            req = row.request
            if req.grammar_text is None:
                req.grammar_text = check_grammar(self.model, req.gen.grammar)
            row.matcher = RowMatcher(self.model, req.grammar_text)
        return row.matcher

    def _zero_counts(self, req: Request) -> torch.Tensor | None:
        """A row's token counts when its request's penalties read them (and, for the repetition penalty, the
        request's prompt tokens as a [V] mask, made once)."""
        params = req.sampler.params
        if not params.penalizes:
            return None
        V = self.model.config.vocab_size
        if params.repetition_penalty != 1.0 and req.prompt_seen is None:
            req.prompt_seen = torch.zeros(V, dtype=torch.bool, device=self.model.device)
            req.prompt_seen[torch.tensor(req.prompt_ids, dtype=torch.long, device=self.model.device)] = True
        return torch.zeros(V, dtype=torch.float32, device=self.model.device)

    def _sample_and_emit(self, logits: torch.Tensor, rows: list[_Row], first: bool = False) -> None:
        """Next token of every row: greedy rows by one argmax, each sampling request by its own generator over its
        own rows (in sample order, as generate() alone draws them); then stop checks and emission. A request whose
        sampling fails (an id out of range, non-finite logits) fails alone: its rows leave at the next step."""
        groups: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            groups.setdefault(id(row.request), []).append(i)
        ids = [0] * len(rows)
        greedy = [i for i, row in enumerate(rows) if row.request.sampler.params.greedy
                  and not row.request.sampler.params.adjusts_logits and row.request.gen.grammar is None]
        if greedy:
            every = len(greedy) == len(rows)  # the usual case: no copy of the logits
            picked = argmax(logits if every else logits.index_select(0, torch.tensor(greedy, device=logits.device)))
            for i, t in zip(greedy, picked.tolist()):
                ids[i] = t
        vocab = int(logits.shape[-1])
        # greedy rows under a grammar (and nothing else): their masks applied and their argmax taken at once
        masked = [i for i, row in enumerate(rows) if row.request.gen.grammar is not None
                  and row.request.sampler.params.greedy and not row.request.sampler.params.adjusts_logits]
        if masked:
            try:
                t0 = time.perf_counter()
                mine = logits.index_select(0, torch.tensor(masked, device=logits.device)).float()
                mine = apply_masks(mine, [self._matcher(rows[i]) for i in masked])
                self.counters.grammar_mask_seconds += time.perf_counter() - t0
                self.counters.grammar_masks += len(masked)
                for i, t in zip(masked, argmax(mine).tolist()):
                    ids[i] = t
            except Exception:  # a request's grammar failed: its rows go the per-request way, and it fails alone
                masked = []
        done = set(masked)
        for idx in groups.values():
            req = rows[idx[0]].request
            params = req.sampler.params
            try:
                if idx[0] in done:
                    pass
                elif params.adjusts_logits or req.gen.grammar is not None:
                    mine = logits.index_select(0, torch.tensor(idx, device=logits.device))
                    counts = torch.stack([rows[i].counts for i in idx]) if params.penalizes else None
                    mine = adjust_logits(mine, params, counts, req.prompt_seen)
                    if req.gen.grammar is not None:
                        t0 = time.perf_counter()
                        mine = apply_masks(mine, [self._matcher(rows[i]) for i in idx])
                        self.counters.grammar_mask_seconds += time.perf_counter() - t0
                        self.counters.grammar_masks += len(idx)
                    picked = (argmax(mine) if params.greedy else req.sampler(mine)).tolist()
                    for i, t in zip(idx, picked):
                        ids[i] = t
                elif not params.greedy:
                    picked = req.sampler(logits.index_select(0, torch.tensor(idx, device=logits.device))).tolist()
                    for i, t in zip(idx, picked):
                        ids[i] = t
                if not all(0 <= ids[i] < vocab for i in idx):  # the argmax of non-finite logits
                    raise SamplingError(f"the step produced token ids outside [0, {vocab}): {[ids[i] for i in idx]}")
                logprobs = self._logprobs(logits, idx, ids, req.logprobs)
            except Exception as e:
                self._fail(req, e)
                continue
            for i in idx:
                self._emit(rows[i], ids[i], first, logprobs.get(i))

    @staticmethod
    def _logprobs(logits: torch.Tensor, idx: list[int], ids: list[int], k: int | None
                  ) -> dict[int, tuple[float, list[tuple[int, float]]]]:
        """(the chosen token's logprob, the top k alternatives) of rows idx, when the request asked for them."""
        if k is None:
            return {}
        lp = torch.log_softmax(logits.index_select(0, torch.tensor(idx, device=logits.device)).float(), dim=-1)
        out = {}
        for j, i in enumerate(idx):
            top = torch.topk(lp[j], k) if k else None
            out[i] = (float(lp[j, ids[i]]), list(zip(top.indices.tolist(), top.values.tolist())) if top is not None
                      else [])
        return out

    def _emit(self, row: _Row, tid: int, first: bool, logprob: tuple[float, list] | None) -> None:
        req = row.request
        if req.done:
            return
        if not first:
            row.count += 1
            row.pos += 1
        row.token = tid
        if row.history is not None:
            row.history.append(tid)
        if row.generated is not None:
            row.generated.append(tid)
        if row.counts is not None:
            row.counts[tid] += 1
        grammar_done = False
        if row.matcher is not None:
            try:
                row.matcher.consume(tid)
            except Exception as e:
                self._fail(req, e)
                return
            grammar_done = row.matcher.finished
        self.counters.generation_tokens += 1
        if row.key in self._drafting:
            self.spec.drafter.extend(row.key, [tid])  # type: ignore[union-attr]
        gen = req.gen
        finish = "stop" if (tid in self.eos and not gen.ignore_eos) or grammar_done else (
            "length" if row.count >= gen.max_new_tokens else None)
        text = ""
        if row.text is not None:
            try:
                text, hit_stop = row.text.push(tid, final=finish is not None)
            except Exception as e:
                self._fail(req, e)
                return
            if hit_stop:
                finish = "stop"
        row.finish = finish
        req.emit(TokenOutput(row.sample_index, tid, text, finish, *(logprob or (None, None))))
        if finish is not None and not first and all(r.finish is not None for r in self.live_rows if r.request is req):
            self._release(req)  # its rows read the cached path no more (they leave before the next forward)
            self._keep_turn(row)
            self._finish_request(req, finish)

    def _keep_turn(self, row: _Row) -> None:
        """A finished conversation turn: the row's prompt and generated tokens (all but the last, which is not in
        the cache) kept in the prefix cache from its columns in the batch cache, so the next turn, which resends
        them with a new message, prefills only that message. Rows with masked columns inside (speculative holes)
        or whose columns do not match their tokens keep nothing."""
        pc, req = self.prefix_cache, row.request
        i = next((i for i, r in enumerate(self.rows) if r is row), None)
        if pc is None or row.generated is None or self.cache.holes or i is None:
            return
        lead, length = int(self.cache.left_pad[i]), self.cache.length
        ids = req.prompt_ids + row.generated[:-1]
        if length - lead != len(ids) - row.start:
            log.warning("request %s: its batch columns (%d) do not match its tokens (%d); its turn is not cached",
                        req.request_id, length - lead, len(ids) - row.start)
            return
        try:
            long = longrope_switch(self.model.config) is not None and row.history is None  # relonged, or born long
            pc.insert_span(ids, self.cache.kv[:, :, i : i + 1, :, lead:length], self._salt(req, long), row.start)
        except Exception:  # the cache is an optimisation: its failure must not fail a request that has finished
            log.exception("request %s: keeping its turn in the prefix cache failed", req.request_id)

    def _finish_request(self, req: Request, reason: str) -> None:
        if not req.done:
            req.done = True
            self._requests.pop(id(req), None)
            self._release(req)
            self.counters.finished[reason] += 1

    def _release(self, req: Request) -> None:
        """Unlock the cached path a request read in place (its rows may still read it until they leave: an evicted
        node's tensor lives on with them)."""
        if req.prefix_locked and self.prefix_cache is not None:
            req.prefix_locked = False
            self.prefix_cache.unlock(req.prefix_node)  # type: ignore[arg-type]

    def _fail(self, req: Request, error: BaseException) -> None:
        if not req.done:
            req.done = True
            self._requests.pop(id(req), None)
            self._release(req)
            self.counters.finished["error"] += 1
            req.emit(error)


def prefix_cache_unsupported(model: Model, max_length: int | None = None) -> str | None:
    """Why the prefix cache cannot serve this model for sequences of up to max_length positions (None: it can). A
    stored block is its tokens' KV at their positions from 0: a window on every layer (Mistral) lets a prefill cache
    drop leading columns (not where no sequence passes the window; a window on some layers only, as Gemma's, keeps
    every column for the others). (Longrope is served: its short- and long-rotated blocks are kept apart.)"""
    window = model.config.sliding_window
    if window is not None and model.config.local_layers is None and (max_length is None or max_length > window):
        return "a sliding window on every layer (its prompt caches drop columns that left the window)"
    return None


def reads_in_place(model: Model, attention: str, speculative: str, max_length: int) -> bool:
    """Whether rows read prefix-cache hits in place as shared segments (else a hit is copied into the prompt's
    cache): the segment kernels merge into dense attention without soft-capping, and a segment's bias is
    position-free (no sliding window that a sequence of max_length reaches), and a longrope row is recomputed in
    its own columns at the switch."""
    window = model.config.sliding_window
    return (attention == "dense" and speculative == "off" and model.config.attn_softcap is None
            and (window is None or max_length <= window) and longrope_switch(model.config) is None)


def served_attention(model: Model, cache: KVCache, attention: str, options: AttentionOptions) -> AttentionFn:
    """The decode steps' attention over the batch cache, by name (attention/__init__.py). A backend's state by
    column (SparQ's dimension-major K mirror and its running sum of values) is rebuilt from the cache whenever rows
    join, leave or are regrouped (KVCache.layout)."""
    check_attention(model, attention)
    if attention != "dense":
        cache.compact_window = False  # approximate backends pick columns by index (the window's first positions)
    return ATTENTION_BACKENDS[attention](cache, options, model.config.group_size)


def served_speculation(model: Model, speculative: str, tree: str, trim: bool = True) -> SpeculativeStep | None:
    """The step's speculation: a drafter by name (spec/registry.py) whose rows join and leave with the batch's, and
    the tree shape. Each row drafts and verifies with its request's sampler."""
    if speculative == "off":
        return None
    drafter = make_drafter(speculative, model, Sampler(SamplingParams(), model.device))
    spec = TreeSpec.parse(tree)
    if spec.auto and model.full_config is not None:  # a tensor-parallel rank: every rank must cut its trees alike,
        # and a choice from each rank's own timing need not be: the fixed tree of before auto
        log.info("tree='auto' under tensor parallelism runs chain:4 (every rank must choose the same trees)")
        spec = TreeSpec.parse("chain:4")
    auto = None
    if spec.auto:
        try:
            auto = AutoTree(row_costs(model))
        except Exception:  # timing the model failed (memory, an unusual model): speculate, with the fixed tree
            log.exception("tree='auto' could not time this model's steps; running chain:4")
            spec = TreeSpec.parse("chain:4")
    return SpeculativeStep(drafter, spec, trim_to_chunk=trim, auto=auto)
