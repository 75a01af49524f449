"""Perplexity of a model on a text, scored as llama.cpp's `llama-perplexity` scores it, so the two can be compared
on the same file (the check users run on a quantized model):

- the text is tokenized whole, without special tokens, and cut into chunks of `context` tokens (a partial last
  chunk is dropped); where the tokenizer adds a BOS token, it replaces each chunk's first token;
- each chunk is one forward from an empty cache; the tokens of its second half are scored, each predicted from
  the logits of the token before it (the first half is context only);
- PPL = exp(mean negative log-likelihood over the scored tokens), with the standard error llama.cpp prints:
  PPL * sqrt(var(NLL) / (n - 1)).

Chunks are batched (`batch` chunks per forward) and reported as they finish."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .attention import dense_attention
from .engine import GenerationConfig, GenerationStats, make_cache, prefill_attention
from .errors import InvalidRequestError
from .models import Model


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
    dev, t0 = model.device, time.perf_counter()
    nll_sum = nll_sq = 0.0
    count = 0
    running: list[float] = []
    for c0 in range(0, n_chunks, batch):
        b = min(batch, n_chunks - c0)
        tokens = torch.tensor([ids[(c0 + i) * context : (c0 + i + 1) * context] for i in range(b)], device=dev)
        targets = tokens[:, first + 1 :].clone()
        if bos is not None:
            tokens[:, 0] = bos
        cache = make_cache(model, GenerationConfig(kv="upfront", kv_dtype=kv_dtype), b, context, [0] * b, GenerationStats())
        positions = torch.arange(context, device=dev)[None].expand(b, -1)
        cache.reserve(context, positions)
        logits = model.net(tokens, positions, cache, prefill_attention(dense_attention, cache, context),
                           cache.attention_bias(context), all_logits=True, prompt_len=torch.full((b,), context))
        for i in range(b):  # one chunk's log-softmax at a time: [context/2, vocab] floats, not b of them
            logp = torch.log_softmax(logits[i, first:-1].float(), dim=-1)
            nll = -logp.gather(-1, targets[i, :, None])[:, 0].double()  # [context - 1 - first]
            nll_sum += float(nll.sum())
            nll_sq += float((nll**2).sum())
            count += nll.shape[0]
            running.append(math.exp(nll_sum / count))
            if progress is not None:
                progress(c0 + i + 1, n_chunks, running[-1])
    mean = nll_sum / count
    var = max(nll_sq / count - mean * mean, 0.0)
    ppl = math.exp(mean)
    return PerplexityResult(ppl=ppl, ppl_stderr=ppl * math.sqrt(var / max(count - 1, 1)), nll=mean,
                            scored_tokens=count, chunks=n_chunks, context=context,
                            seconds=time.perf_counter() - t0, chunk_ppl=running)
