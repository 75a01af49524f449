"""The public API (load, generate, stream, perplexity and their types), which `import bmc` exposes on first use
(bmc/__init__.py: the package itself imports nothing heavy, so a CLI's --help answers before torch loads)."""
from __future__ import annotations

import os
import sys

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from typing_extensions import Required, TypedDict, Unpack

import torch

from .attention import AttentionOptions, SparQOptions
from .engine import GenerationConfig, GenerationStats, TokenEvent, encode_prompts, generate_tokens
from .errors import BmcError, InvalidRequestError, ModelLoadError, UnsupportedModelError
from .grammar import GrammarSpec, check_grammar
from .models import Model, load_model
from .sampling import SamplingParams

Prompts = Sequence[str] | Sequence[Sequence[int]]


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    token_ids: list[int] = field(default_factory=list)  # generated ids only (EOS included when it ended the row)
    text: str | None = None  # None when the model has no tokenizer
    finish_reason: str | None = None  # "stop" (EOS or a stop string) or "length"


class Completions(list):
    """The completions of a generate() call, ordered by (prompt_index, sample_index), with the run's stats."""

    stats: GenerationStats


class TokenStream:
    """Iterate to get TokenEvents as they are produced; `stats` is complete once the iteration ends."""

    def __init__(self, model: Model, prompt_ids: list[list[int]], gen: GenerationConfig) -> None:
        self.stats = GenerationStats()
        self._events = generate_tokens(model, prompt_ids, gen, self.stats)

    def __iter__(self) -> Iterator[TokenEvent]:
        return self._events


def load(path: str | None = None, *, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
         share_weights: bool = False, quant: str = "auto", activations: str = "auto", tp: int = 1) -> Model:
    """Load an HF model directory or a llama GGUF file; no path loads the embedded default model. On a CPU in
    float32 the native decode step's packed weights are built here (and its C++ kernel compiled the first time
    on a machine), so no generation's timing includes them. share_weights (CPU): map the weights read-only from
    a file in ~/.cache/bmc/weights (written on first use), one copy in memory for every process that maps it.
    quant: "auto" ("stored" on a CPU in float32, else "none"), "stored" (a GGUF file's quantized and 16-bit
    matrices, an HF checkpoint's bfloat16 / float16 ones, kept as stored: exact, fewer bytes), "none" (every tensor
    dequantized to dtype), "gguf" (stored, for a GGUF file), "q8_0" or "q4_0" (quantized at load):
    bmc/models/quant.py.
    activations: "auto" (the default: "bfloat16" for a bfloat16 checkpoint kept in 16 bits on a CPU with AMX or
    AVX512-BF16, its own precision; "float" otherwise), "float" (exact: the quantized matrices' float weights),
    "int8" (quantized matrices against activations quantized to int8 blocks on the native step, VNNI dot products:
    ~2x the Q4 GEMMs at batch 8, within a stated bound) or "bfloat16" (prompts prefilled in bfloat16 arithmetic on
    the native step, AMX or AVX512-BF16; generated tokens in float32; within a stated bound).
    tp > 1: tensor parallelism over tp ranks (bmc/parallel): worker processes driven like one model, or, under
    torchrun (WORLD_SIZE = tp), this process's part of it; float weights (quant "none") on the PyTorch path."""
    from .models import check_activations, set_activations
    from .models.hub import model_source

    check_activations(activations)
    if path is not None:
        path = model_source(str(path))  # a hub name (ORG/NAME[:FILE.gguf]) becomes its cached copy
    if tp != 1:
        if activations not in ("float", "auto"):
            raise InvalidRequestError("tensor parallelism runs float activations (activations='float')")
        return _load_tensor_parallel(path, tp, dtype=dtype, device=device, quant=quant, share_weights=share_weights)
    model = None
    if share_weights:
        from .models import default_model_path, parse_device, parse_dtype, resolve_quant
        from .models.weight_file import load_mapped, share_weights as map_shared, stream_first_load

        cpu = torch.device(device).type == "cpu"
        if cpu:  # the weight file written by an earlier load: nothing to dequantize
            source = default_model_path() if path is None else os.path.expanduser(str(path))
            mode = resolve_quant(quant, source, parse_dtype(dtype), parse_device(device))
            try:
                model = load_mapped(source, parse_dtype(dtype), mode)
            except OSError:
                model = None
        if model is None and cpu:
            if sys.stderr.isatty():  # seconds, once per model file
                print("bmc: first load of this model here: converting its weights and caching them in "
                      "~/.cache/bmc/weights (later runs map them)", file=sys.stderr, flush=True)
            try:  # a GGUF's layers written to the cache one at a time, then mapped
                model = stream_first_load(source, parse_dtype(dtype), mode)
            except OSError:
                model = None
        if model is None:
            model = load_model(path, dtype=dtype, device=device, quant=quant, activations=activations)
            try:
                map_shared(model)
            except OSError as e:  # a read-only or full cache directory: run on the model's own weights
                print(f"bmc: weights cache unavailable ({e}); using this process's own copy", file=sys.stderr)
    else:
        model = load_model(path, dtype=dtype, device=device, quant=quant, activations=activations)
    set_activations(model, activations)
    model.net.native_decoder()
    return model


def _load_tensor_parallel(path: str | None, tp: int, *, dtype: str | torch.dtype, device: str | torch.device,
                          quant: str, share_weights: bool) -> Any:
    from .parallel.tp import TensorParallelModel, load_rank

    if tp < 1:
        raise InvalidRequestError(f"tp must be >= 1, got {tp}")
    if quant not in ("auto", "none") or share_weights:
        raise InvalidRequestError("tensor parallelism loads float weights (quant='none', share_weights=False); "
                                  "quantized and shared weights are not sharded yet")
    dev = str(torch.device(device).type)
    if os.environ.get("WORLD_SIZE") and os.environ.get("RANK"):  # under torchrun: this process is one rank
        world = int(os.environ["WORLD_SIZE"])
        if world != tp:
            raise InvalidRequestError(f"tp={tp} under torchrun with WORLD_SIZE={world}: they must agree")
        return load_rank(path, int(os.environ["RANK"]), world, dtype=dtype, device=dev, timeout_s=120.0,
                         init="env://")
    return TensorParallelModel(path, tp, dtype=str(dtype).replace("torch.", ""), device=dev)


class GenerateOptions(TypedDict, total=False):
    """The options of generate() and stream(), each checked once by `generation_config` (bmc.engine's
    GenerationConfig is what the engine runs)."""

    max_new_tokens: Required[int]
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int | None
    min_p: float | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: dict[int, float]
    json_schema: dict[str, Any] | str | bool
    regex: str
    grammar: str
    num_samples: int
    stop: str | Sequence[str] | None
    kv: str
    r: int | None
    T: int | None
    ignore_eos: bool
    attention: str
    speculative: str
    tree: str
    spec_grow: bool
    share_prefix: str
    sparq_r: int | None
    sparq_k: int
    window_k: int
    cuda_graphs: bool
    graph_warmup: bool
    run_ahead: bool | None
    adaptive_threads: bool
    kv_dtype: str


SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "seed", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "logit_bias")


def generation_config(**options: Unpack[GenerateOptions]) -> GenerationConfig:
    """The one place generate()'s and stream()'s options become a GenerationConfig: an unknown option or a missing
    max_new_tokens is refused by name, every value is checked by the config's own types."""
    unknown = sorted(set(options) - set(GenerateOptions.__annotations__))
    if unknown:
        raise InvalidRequestError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; the options "
                                  f"are {', '.join(GenerateOptions.__annotations__)}")
    if "max_new_tokens" not in options:
        raise InvalidRequestError("max_new_tokens is required")
    o: dict[str, Any] = dict(options)
    stop = o.pop("stop", None)
    if "logit_bias" in o:  # {token id: bias}, as OpenAI's requests carry it
        if not isinstance(o["logit_bias"], (dict, type(None))):
            raise InvalidRequestError(f"logit_bias must be a dict of token id -> bias, got {type(o['logit_bias'])}")
        o["logit_bias"] = tuple((o["logit_bias"] or {}).items())
    sampling = SamplingParams(**{k: o.pop(k) for k in SAMPLING_OPTIONS if k in o})
    constraints = {k: o.pop(k) for k in ("json_schema", "regex", "grammar") if o.get(k) is not None}
    o.pop("json_schema", None), o.pop("regex", None), o.pop("grammar", None)
    if len(constraints) > 1:
        raise InvalidRequestError(f"give one of json_schema, regex, grammar, not {' and '.join(constraints)}")
    if "json_schema" in constraints:
        o["grammar"] = GrammarSpec.json_schema(constraints["json_schema"])
    elif "regex" in constraints:
        o["grammar"] = GrammarSpec("regex", constraints["regex"])
    elif "grammar" in constraints:
        o["grammar"] = GrammarSpec("lark", constraints["grammar"])
    sparq = SparQOptions(r=o.pop("sparq_r", None), k=o.pop("sparq_k", 128))
    attention_options = AttentionOptions(sparq, window_k=o.pop("window_k", 256))
    return GenerationConfig(sampling=sampling, attention_options=attention_options,
                            stop=(stop,) if isinstance(stop, str) else tuple(stop or ()), **o)


def stream(model: Model, prompts: Prompts, *, chat: bool = False, **options: Unpack[GenerateOptions]) -> TokenStream:
    """Like generate(), but returns an iterable of TokenEvents yielded as tokens are produced."""
    if not isinstance(model, Model):
        raise InvalidRequestError("stream() runs on a model in this process; with tp > 1 use generate()")
    gen = generation_config(**options)
    if gen.stop and model.tokenizer is None:
        raise InvalidRequestError("stop strings need a tokenizer; this model has none")
    if gen.grammar is not None:
        check_grammar(model, gen.grammar)  # refused here, by the library's reason, before any prompt runs
    return TokenStream(model, encode_prompts(model, prompts, chat), gen)


def generate(model: Model, prompts: Prompts, *, chat: bool = False, **options: Unpack[GenerateOptions]) -> Completions:
    """Generate for a batch of prompts (strings or token-id lists); returns whole completions with `.stats`.
    `chat=True` wraps each prompt in the model's chat template (a prompt may then also be a conversation: a list of
    {"role", "content"} messages). The options (GenerateOptions; max_new_tokens is
    required), with their defaults:

    temperature=0.0 (greedy), top_k, top_p, min_p, seed: sampling; num_samples=1: completions per prompt; stop:
    strings that end a completion; ignore_eos=False. presence_penalty and frequency_penalty (OpenAI's, [-2, 2],
    over the tokens generated), repetition_penalty (vLLM's, over prompt and output; 1 = none) and logit_bias
    ({token id: bias in [-100, 100]}) adjust the logits before greedy or sampled selection. json_schema (a dict,
    its JSON text, or True for any JSON object), regex, or grammar (Lark, llguidance's dialect) constrain the output
    through llguidance: every token is one the grammar allows, and a completion ends ("stop") when the grammar is
    complete. Such requests' rows decode without speculation.
    kv="bmc" (or "upfront", "iterative"), with r or T: the KV cache strategy and its chunk (default: T chosen by
    the analytic model). kv_dtype: how the cache stores K and V: "auto" (the model's dtype: exact), "bfloat16",
    "float16", or "int8" (a float32 scale per token and KV head; each value within max|row| / 254 of its float,
    bmc/kv/formats.py).
    speculative="ngram" (prompt lookup), "draft:PATH" (a smaller model with the same vocabulary), "layers:N" (the
    model's first N layers) or "int8-self" (the model in int8) drafts token trees (`tree`: "auto", the default:
    each step's trees sized from this model's measured step cost by rows and the drafts' acceptance so far,
    bmc/spec/auto.py; or a fixed "chain:K", "dynamic:KxDEPTH" or "static:SIZE"; spec_grow=True grows the chunk
    for a tree instead of trimming it) and verifies them in the KV cache's padding rows: greedy output is identical to plain
    decoding, and sampling (temperature > 0) keeps the exact output distribution.
    share_prefix="auto": the samples of a prompt read its KV in place, and a part of at least 16 tokens common to
    prompts is prefilled once and read by the others (bifurcated attention / Hydragen); "off" gives every row its
    own copy. The tokens are the same either way.
    attention="sparq" approximates decode attention (SparQ: `sparq_r` query components, default head_dim/4, and
    the top `sparq_k`=128 positions); attention="window" is the local-window baseline keeping `window_k`=256
    positions.
    On CUDA the decode step is captured as a CUDA graph once per BMC capacity bucket (cuda_graphs=False: eager),
    and the graphs are kept for the model's later calls; graph_warmup=True captures every bucket the call's batch
    will pass through before its prompts run (no capture inside the timed decode).
    There a greedy batch's next step is launched before the last step's tokens are read, so the host's work
    between steps overlaps the GPU's (run_ahead=False: each step's tokens read before the next; the same tokens).
    On a CPU, decode steps run on fewer threads while other processes keep the cores busy (adaptive_threads=False:
    always torch's thread count); the tokens and logits are the same at any count.
    A tensor-parallel model (bmc.load(..., tp=N)) runs the same request on every rank."""
    from .parallel.tp import TensorParallelModel

    if isinstance(model, TensorParallelModel):
        generation_config(**options)  # refused here, before any rank sees it
        return model.generate(prompts, chat=chat, **options)
    s = stream(model, prompts, chat=chat, **options)
    by_row: dict[tuple[int, int], Completion] = {}
    for ev in s:
        c = by_row.setdefault((ev.prompt_index, ev.sample_index), Completion(ev.prompt_index, ev.sample_index))
        c.token_ids.append(ev.token_id)
        if ev.text is not None:
            c.text = (c.text or "") + ev.text
        c.finish_reason = ev.finish_reason
    out = Completions(by_row[k] for k in sorted(by_row))
    if model.tokenizer is not None:
        for c in out:
            c.text = c.text or ""
    out.stats = s.stats
    return out


def perplexity(model: Model, text: str, *, context: int = 512, batch: int = 4, max_chunks: int | None = None,
               progress=None, kv_dtype: str = "auto"):
    """The model's perplexity on `text`, scored as llama.cpp's llama-perplexity scores it (bmc/ppl.py):
    chunks of `context` tokens, the second half of each scored, the KV cache stored as `kv_dtype`. Returns a
    PerplexityResult (.ppl, .ppl_stderr)."""
    from .ppl import perplexity as _perplexity

    if not isinstance(model, Model):
        raise InvalidRequestError("perplexity() runs on a model in this process; with tp > 1 only generate() is built")

    return _perplexity(model, text, context=context, batch=batch, max_chunks=max_chunks, progress=progress,
                       kv_dtype=kv_dtype)


__all__ = ["load", "generate", "stream", "perplexity", "GenerateOptions", "generation_config", "Completion", "Completions", "TokenEvent", "TokenStream", "Model",
           "GenerationStats", "BmcError", "InvalidRequestError", "ModelLoadError", "UnsupportedModelError"]
