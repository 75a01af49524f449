"""Perplexity of a model on a text, scored as llama.cpp's `llama-perplexity` scores it, so the two can be compared
on the same file (the check users run on a quantized model):

- the text is tokenized whole, without special tokens, and cut into chunks of `context` tokens (a partial last
  chunk is dropped); where the tokenizer adds a BOS token, it replaces each chunk's first token;
- each chunk is prefilled from an empty cache (a request of the engine's step loop, `batch` chunks a step, scored
  with prompt_logprobs); the tokens of its second half are scored, each predicted from the logits of the token
  before it (the first half is context only);
- PPL = exp(mean negative log-likelihood over the scored tokens), with the standard error llama.cpp prints:
  PPL * sqrt(var(NLL) / (n - 1)).

Chunks are reported as they finish, in order."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .engine import GenerationConfig
from .engine_options import EngineOptions
from .errors import InvalidRequestError
from .models import Model
from .scheduler import Request, Scheduler, TokenOutput


@dataclass
class PerplexityResult:
    ppl: float
    ppl_stderr: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    scored_tokens: int
    chunks: int
    context: int
    seconds: float
    chunk_ppl: list[float] = field(default_factory=list)  # the running estimate after each chunk, as llama.cpp prints

    @property
    def tokens_per_s(self) -> float:
        return self.chunks * self.context / self.seconds if self.seconds else 0.0


Progress = Callable[[int, int, float], None]  # (chunks done, chunks in all, running PPL)


@torch.inference_mode()
def perplexity(model: Model, text: str, *, context: int = 512, batch: int = 4, max_chunks: int | None = None,
               progress: Progress | None = None, kv_dtype: str = "auto") -> PerplexityResult:
    tok = model.tokenizer
    if tok is None:
        raise InvalidRequestError("perplexity needs a tokenizer; this model has none")
    if not 16 <= context <= model.max_context:
        raise InvalidRequestError(f"context must be in [16, {model.max_context}] (the model's), got {context}")
    if batch < 1:
        raise InvalidRequestError(f"batch must be >= 1, got {batch}")
    ids = tok.encode(text, add_special_tokens=False)
    n_chunks = len(ids) // context if max_chunks is None else min(len(ids) // context, max_chunks)
    if n_chunks < 1:
        raise InvalidRequestError(f"the text has {len(ids)} tokens; at least one chunk of context={context} is "
                                  "needed (a longer text or a smaller --ctx-size)")
    with_special = tok.encode("a")
    bos = with_special[0] if len(with_special) > len(tok.encode("a", add_special_tokens=False)) else None
    first = context // 2
    t0 = time.perf_counter()
    # every chunk a request of the engine's step loop: its prompt is the chunk but its last token, scored position by
    # position (prompt_logprobs), the last token by the distribution after the prompt; `batch` chunks a step
    engine = Scheduler(model, EngineOptions(max_num_seqs=batch, max_num_batched_tokens=batch * context + 1,
                                            kv="upfront", kv_dtype=kv_dtype, max_length=context))
    gen = GenerationConfig(max_new_tokens=1, kv="upfront", kv_dtype=kv_dtype)
    requests: list[Request] = []
    errors: dict[int, BaseException] = {}  # a chunk's failure, raised when its turn comes
    for c in range(n_chunks):
        chunk = ids[c * context : (c + 1) * context]
        prompt = ([bos] + chunk[1:-1]) if bos is not None else chunk[:-1]
        requests.append(Request(prompt, gen, lambda out, c=c: _keep_error(errors, c, out), device=model.device,
                                prompt_logprobs=True))
    for req in requests:
        engine.add(req)
    nll_sum = nll_sq = 0.0
    count = 0
    running: list[float] = []
    for i, req in enumerate(requests):
        while not req.done:
            engine.step()
        if i in errors:
            raise errors[i]
        assert req.next_logprobs is not None and req.prompt_logprobs is not None
        target = ids[(i + 1) * context - 1]  # the chunk's last token: predicted after the prompt
        nll = [-x for x in req.prompt_logprobs[first:]] + [-float(req.next_logprobs[target])]
        nll_sum += sum(nll)
        nll_sq += sum(x * x for x in nll)
        count += len(nll)
        req.prompt_logprobs = None  # the chunk's scores are summed
        req.next_logprobs = None
        running.append(math.exp(nll_sum / count))
        if progress is not None:
            progress(i + 1, n_chunks, running[-1])
    mean = nll_sum / count
    var = max(nll_sq / count - mean * mean, 0.0)
    ppl = math.exp(mean)
    return PerplexityResult(ppl=ppl, ppl_stderr=ppl * math.sqrt(var / max(count - 1, 1)), nll=mean,
                            scored_tokens=count, chunks=n_chunks, context=context,
                            seconds=time.perf_counter() - t0, chunk_ppl=running)


def _keep_error(errors: dict[int, BaseException], chunk: int, out: TokenOutput | BaseException) -> None:
    """A chunk's request reports its token (one, not needed) and its failure, which ends the run."""
    if isinstance(out, BaseException):
        errors[chunk] = out
