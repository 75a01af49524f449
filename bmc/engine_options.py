"""The engine's settings: what one step loop (scheduler.py) is built with, batch-wide, checked once here. A request's
own settings (sampling, max_new_tokens, stop) are its GenerationConfig; the options that shape the batch (its cache,
its attention, its speculation, its prefix cache, its limits) are these. bmc-serve's flags, ServeOptions, generate()
(offline.py), ChatSession and perplexity() all build one of these and nothing else spells them."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .attention import AttentionOptions
from .engine import GenerationConfig
from .errors import InvalidRequestError
from .prefix_cache import BLOCK


@dataclass(frozen=True)
class EngineOptions:
    max_num_seqs: int = 8  # rows (sequences) decoding at once
    max_num_batched_tokens: int = 256  # tokens a step computes: the decode rows first, prompt chunks in the rest
    itl_factor: float = 0.0  # beside running rows, prompt chunks cut so a step takes at most this many times the
    # rows' own step, by measured costs (chunk_budget.py; 0: off, the token budget alone)
    max_queue: int | None = None  # requests waiting beyond the free seats before add() refuses (None: no limit)
    max_length: int | None = None  # the longest prompt + max_tokens a request may have (None: the model's context)
    kv: str = "bmc"  # the batch cache's strategy (kv/)
    r: int | None = None  # BMC chunk rows (None: from T)
    T: int | None = None  # BMC allocations over max_length (None: the analytic model's choice)
    kv_dtype: str = "auto"  # how K and V are stored (kv/formats.py)
    attention: str = "dense"  # the decode attention (attention/): dense, sparq, window
    attention_options: AttentionOptions = field(default_factory=AttentionOptions)
    speculative: str = "off"  # a drafter (spec/registry.py): off, ngram, draft:PATH, layers:N, int8-self
    tree: str = "auto"  # each row's draft tree (auto: sized each step from measured costs, spec/auto.py)
    spec_max_tokens: int | None = None  # verify rows a step may hold in all (None: no cap; auto sizes trees)
    spec_trim: bool = True  # trim a tree to its rows' free padding (else the cache grows for it)
    prefix_cache_bytes: int = 0  # prompt KV kept across requests under this budget (0: no prefix cache)
    prefix_block: int = BLOCK  # the prefix cache's block, in tokens
    min_shared: int | None = None  # the fewest cached tokens a prompt reads in place or waits for (None: a block)
    keep_turns: bool = True  # keep finished turns (a prompt and its reply) for a next turn to read
    cuda_graphs: bool = True  # CUDA: the plain decode step captured once per capacity bucket and batch
    run_ahead: bool | None = None  # greedy decode steps launched before the last step's tokens are read
    # (run_ahead.py; None: where decode steps are CUDA graphs)
    adaptive_threads: bool = True  # CPU: decode steps take fewer threads while other processes keep the cores busy

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise InvalidRequestError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= self.max_num_seqs:
            raise InvalidRequestError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must exceed "
                                      f"max_num_seqs ({self.max_num_seqs}): decode rows come first, prompts need the "
                                      "rest")
        if not (self.itl_factor == 0 or 1 < self.itl_factor <= 1e6):  # NaN fails both
            raise InvalidRequestError(f"itl_factor must be 0 (off) or in (1, 1e6], got {self.itl_factor}")
        if self.max_queue is not None and self.max_queue < 0:
            raise InvalidRequestError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.spec_max_tokens is not None and self.spec_max_tokens < 2:
            raise InvalidRequestError(f"spec_max_tokens must be >= 2 (a root and one draft), got {self.spec_max_tokens}")
        if self.prefix_cache_bytes < 0:
            raise InvalidRequestError(f"prefix_cache_bytes must be >= 0, got {self.prefix_cache_bytes}")
        if self.prefix_block < 1:
            raise InvalidRequestError(f"prefix_block must be >= 1, got {self.prefix_block}")
        self.generation_defaults()  # the names and their combination, as generate() checks them

    def generation_defaults(self) -> GenerationConfig:
        """The cache and attention settings a request of this engine runs with (its prompt cache is made by them)."""
        return GenerationConfig(kv=self.kv, r=self.r, T=self.T, kv_dtype=self.kv_dtype, attention=self.attention,
                                attention_options=self.attention_options, speculative=self.speculative,
                                tree=self.tree, cuda_graphs=self.cuda_graphs, run_ahead=self.run_ahead)

    def replace(self, **changes: object) -> "EngineOptions":
        """These options with some changed (an unknown name is refused by name)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise InvalidRequestError(f"unknown engine option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}")
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
