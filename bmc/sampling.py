"""Next-token selection: greedy, temperature, top-k, top-p, min-p, with a seeded generator; before it, the logit
adjustments a request asks for (logit_bias, repetition, frequency and presence penalties: `adjust_logits`).

Values are checked as the kernels see them, in float32: a temperature that rounds to 0 there is refused (0 is
greedy; anything above it is a distribution), and the most likely token always survives top-p and min-p, so no
value in range can mask every token. A sampled id is checked against the vocabulary before anyone feeds it back."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import BmcError, InvalidRequestError
from .kernels.native import argmax


class SamplingError(BmcError):
    """The sampler produced something that is not a token id (non-finite logits): the request fails, alone."""


REPETITION_PENALTY_RANGE = (0.01, 100.0)  # a logit divided by it stays finite in float32


def _float32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def adjust_logits(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor | None,
                  prompt_seen: torch.Tensor | None) -> torch.Tensor:
    """[n, V] logits (float32, a copy) with the request's adjustments, in vLLM's order: logit_bias, then the
    repetition penalty (tokens of the prompt or the output), then frequency and presence (the output's counts,
    [n, V] float32, one row per sample). The greedy argmax and the sampler both read the result."""
    out = logits.float().clone()
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=out.device)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=out.device)
        out.index_add_(1, ids, bias.expand(out.shape[0], -1))  # an id named twice gets both
    if counts is None:
        return out
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        if prompt_seen is not None:
            seen = seen | prompt_seen
        rp = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / rp, out * rp), out)
    if params.frequency_penalty != 0.0:
        out -= counts * params.frequency_penalty
    if params.presence_penalty != 0.0:
        out -= (counts > 0).float() * params.presence_penalty
    return out


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    min_p: float | None = None  # drop tokens whose probability is below min_p x the most likely one's
    # OpenAI's: logits -= count * frequency_penalty + (count > 0) * presence_penalty, over the tokens generated
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's / HF's: a logit of a token in the prompt or the output is divided by it when > 0, else multiplied
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), OpenAI's [-100, 100]

    def __post_init__(self) -> None:
        t = self.temperature
        if t is None or isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0 (0 = greedy), got {t}")
        if t > 0 and _float32(t) == 0.0:
            raise InvalidRequestError(f"temperature {t} is 0 in float32, where sampling runs: use 0 for greedy or a "
                                      f"value >= {torch.finfo(torch.float32).tiny}")
        if self.top_k is not None and self.top_k < 1:
            raise InvalidRequestError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not (math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _number(v) or not -2.0 <= v <= 2.0:
                raise InvalidRequestError(f"{name} must be a number in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if not _number(rp) or not REPETITION_PENALTY_RANGE[0] <= rp <= REPETITION_PENALTY_RANGE[1]:
            raise InvalidRequestError(f"repetition_penalty must be a number in [{REPETITION_PENALTY_RANGE[0]}, "
                                      f"{REPETITION_PENALTY_RANGE[1]}] (1 = none), got {rp!r}")
        for pair in self.logit_bias:
            if (not isinstance(pair, tuple) or len(pair) != 2 or isinstance(pair[0], bool)
                    or not isinstance(pair[0], int) or pair[0] < 0):
                raise InvalidRequestError(f"logit_bias maps token ids (integers >= 0) to biases, got {pair!r}")
            if not _number(pair[1]) or not -100.0 <= pair[1] <= 100.0:
                raise InvalidRequestError(f"logit_bias values must be numbers in [-100, 100], got {pair[1]!r} "
                                          f"for token {pair[0]}")

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits change before selection (then the request's rows are selected on their own)."""
        return bool(self.logit_bias) or self.penalizes

    @property
    def penalizes(self) -> bool:
        """Whether selection depends on the tokens so far (then the request's rows keep their token counts)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def check_vocab(self, vocab: int) -> None:
        bad = sorted(t for t, _ in self.logit_bias if t >= vocab)
        if bad:
            raise InvalidRequestError(f"logit_bias names token ids outside the vocabulary of {vocab}: {bad[:8]}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution sampling draws from ([B, V] float32 logits -> probabilities)."""
        p = self.params
        # the largest logit becomes 0 before the division: any temperature > 0 in float32 then leaves it finite
        # (a tiny one sends the others to -inf, which is the limit it asks for), where x / t alone overflows
        logits = (logits - logits.amax(dim=-1, keepdim=True)) / p.temperature
        if p.top_k is not None and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p is not None and p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop_sorted = mass_before >= p.top_p  # keep the smallest prefix whose mass reaches top_p
            drop_sorted[..., 0] = False  # and the most likely token, whatever top_p rounds to in float32
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        probs = logits.softmax(dim=-1)
        if p.min_p is not None and p.min_p > 0.0:  # the most likely token always passes (its ratio is 1 >= min_p)
            floor = probs.amax(dim=-1, keepdim=True) * p.min_p
            probs = probs.masked_fill(probs < floor, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V] logits -> [B] token ids, each checked to be one."""
        ids = argmax(logits) if self.params.greedy else draw(self.probs(logits), self.generator)
        return check_token_ids(ids, logits.shape[-1])


def check_token_ids(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """ids, if every one is in [0, vocab); else SamplingError (an id out of range would reach the embedding)."""
    if ids.numel() and not bool(((ids >= 0) & (ids < vocab)).all()):
        raise SamplingError(f"the sampler produced token ids outside [0, {vocab}) (non-finite logits?): "
                            f"{ids.tolist()}")
    return ids


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of [B, V] probabilities by inverting the CDF with one uniform per row.

    Why not torch.multinomial: on the CPU it cost more than a whole decode step of the default model at batch 8
    (figures: docs/performance.md, "Figures behind the code's choices"). The CDF is summed in float64 so that every token's
    interval keeps its width, and u is kept below the total, so the chosen token always has probability > 0
    (cdf[i] > u >= cdf[i-1])."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)  # summed in float64, with no float64 copy of probs first
    total = cdf[:, -1:]
    u = torch.rand(total.shape, dtype=torch.float64, generator=generator, device=probs.device) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)
