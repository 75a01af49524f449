"""A multi-turn conversation that keeps its KV in one BMC cache across turns: each turn prefills only what is new
(the user's message in the chat template, and whatever of the last reply the template renders differently from
the tokens generated), then decodes the reply, streaming its text.

Why a BMC cache: a conversation grows by a few hundred tokens a turn, with no known end. The cache is sized for
the model's whole context but allocated r rows at a time, so a short chat holds little memory and a long one
pays one copy per chunk, not per token.

The conversation's tokens, as llama.cpp keeps them: the earlier turns' prompts and replies exactly as they were
generated (a reply is not re-tokenized from its text, which need not give the same ids), then the chat template's
new part (the reply's end marker, the user's message, the assistant's header) tokenized alone. Exactness: a reply
equals generate() on those tokens (greedy: token for token; the tests hold it). Where the template renders the
history differently from what was said (a template that rewrites earlier turns), the whole conversation is
tokenized again, the cache is cut back to the longest common prefix and the rest is prefilled."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch

from .attention import dense_attention
from .engine import GenerationConfig, GenerationStats, eos_ids, longrope_switch, make_cache, prefill_attention
from .errors import InvalidRequestError
from .kv import KVCache
from .models import Model
from .sampling import Sampler, SamplingParams
from .textstream import TextStream

PREFILL_CHUNK = 1024  # the native step's longest prefill (NATIVE_MAX_T); longer messages go in pieces


class ContextFullError(InvalidRequestError):
    """The conversation reached the model's context: /reset (or a shorter message) is needed."""


@dataclass
class TurnStats:
    prompt_tokens: int = 0  # the rendered conversation, this turn
    prefilled_tokens: int = 0  # of those, the ones computed this turn (the rest came from the cache)
    generated_tokens: int = 0
    finish_reason: str | None = None


@dataclass
class ChatSession:
    model: Model
    max_new_tokens: int = 512
    sampling: SamplingParams = field(default_factory=SamplingParams)
    system: str | None = None
    kv: str = "bmc"
    kv_dtype: str = "auto"
    messages: list[dict[str, str]] = field(init=False)
    cache: KVCache = field(init=False)
    cached_ids: list[int] = field(init=False)  # the tokens whose K/V the cache holds, in order
    prompt_ids: list[int] = field(init=False)  # the last turn's conversation tokens, up to the assistant's header
    last: TurnStats = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, Model):
            raise InvalidRequestError("chat runs on a model in this process; with tp > 1 only generate() is built")
        if self.model.tokenizer is None:
            raise InvalidRequestError("chat needs a tokenizer with a chat template; this model has none")
        GenerationConfig(max_new_tokens=self.max_new_tokens)  # the same checks as generate()
        self.sampler = Sampler(self.sampling, self.model.device)
        self.eos = eos_ids(self.model)
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays) and free its KV."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.cache = self._new_cache()
        self.cached_ids = []
        self.prompt_ids = []
        self._anchor = ""  # the last turn's rendered prompt text plus its reply's text
        self._reply_ids: list[int] = []
        self.last = TurnStats()

    def _new_cache(self) -> KVCache:
        return make_cache(self.model, GenerationConfig(kv=self.kv, kv_dtype=self.kv_dtype), 1, self.model.max_context, [0], GenerationStats())

    @property
    def context_used(self) -> int:
        return len(self.cached_ids)

    @torch.inference_mode()
    def turn(self, user: str) -> Iterator[str]:
        """Add the user's message and stream the reply's text; the reply joins the conversation when done (also
        when the caller stops early: what was generated so far is the reply)."""
        if not user.strip():
            raise InvalidRequestError("the message is empty")
        tok = self.model.tokenizer
        assert tok is not None
        messages = self.messages + [{"role": "user", "content": user}]
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True)
        if self._anchor and rendered.startswith(self._anchor):  # the history as said, then the template's new part
            ids = self.prompt_ids + self._reply_ids + tok.encode(rendered[len(self._anchor):], add_special_tokens=False)
        else:
            ids = tok.encode(rendered)
        if len(ids) + 1 > self.model.max_context:
            raise ContextFullError(f"the conversation has {len(ids)} tokens, the model's context is "
                                   f"{self.model.max_context}: /reset to start over")
        self.messages, self.prompt_ids = messages, ids
        budget = min(self.max_new_tokens, self.model.max_context - len(ids))
        self.last = stats = TurnStats(prompt_tokens=len(ids))
        logits = self._prefill(ids)
        text = TextStream(tok)
        reply: list[int] = []
        try:
            while True:
                token = int(self.sampler(logits)[0])
                reply.append(token)
                finish = "stop" if token in self.eos else ("length" if len(reply) >= budget else None)
                delta, _ = text.push(token, final=finish is not None)
                if delta:
                    yield delta
                if finish is not None:
                    stats.finish_reason = finish
                    break
                logits = self._forward([token])  # the last token's K/V is written when the next one is computed
        finally:
            stats.generated_tokens = len(reply)
            said = reply[:-1] if reply and reply[-1] in self.eos else reply  # the template writes its end marker
            self._reply_ids = said
            self.messages.append({"role": "assistant", "content": tok.decode(said)})
            self._anchor = rendered + self.messages[-1]["content"]

    def _prefill(self, ids: list[int]) -> torch.Tensor:
        """Reuse the cached K/V of the longest common prefix with `ids` (always leaving one token to compute: its
        logits start the reply), then prefill the rest."""
        common = 0
        for a, b in zip(self.cached_ids, ids[:-1]):
            if a != b:
                break
            common += 1
        if common < len(self.cached_ids):
            self.cache.crop(common)
            del self.cached_ids[common:]
        self.last.prefilled_tokens = len(ids) - common
        logits = None
        for start in range(common, len(ids), PREFILL_CHUNK):
            logits = self._forward(ids[start : start + PREFILL_CHUNK])
        assert logits is not None
        return logits

    def _forward(self, new: list[int]) -> torch.Tensor:
        """Write the K/V of `new` after the cached tokens; the last one's logits [1, V]."""
        switch = longrope_switch(self.model.config)
        if switch is not None and 0 < len(self.cached_ids) <= switch < len(self.cached_ids) + len(new):
            # longrope: the conversation passes the switch, so all of it is computed again with the long factors
            # (what generate() does at that step, engine.relong)
            new, self.cache, self.cached_ids = self.cached_ids + new, self._new_cache(), []
        cache, dev, t = self.cache, self.model.device, len(new)
        start = len(self.cached_ids)
        positions = torch.arange(start, start + t, device=dev)[None]
        try:
            cache.reserve(t, positions)
            logits = self.model.net(torch.tensor([new], device=dev), positions, cache,
                                    prefill_attention(dense_attention, cache, t), cache.attention_bias(t),
                                    prompt_len=torch.tensor([start + t]))  # the conversation so far
            cache.commit(t)
        except BaseException:  # interrupted (Ctrl-C) between reserve and commit: start the KV over, exactly
            self.cache = self._new_cache()
            self.cached_ids = []
            raise
        self.cached_ids.extend(new)
        return logits[:, -1]
