"""A multi-turn conversation as a client of the engine's step loop (Scheduler.step, scheduler.py), as a chat UI is a
client of bmc-serve: each turn is one request of a scheduler that belongs to the conversation, whose prefix cache
keeps every finished turn (its prompt and reply, `keep_turns`), so the next turn reads the conversation's KV in
place from there and prefills only what is new (the user's message in the chat template, and whatever of the last
reply the template renders differently from the tokens generated). The cache's blocks are one token and a turn
kept after the last merges into it, so the conversation stays one segment the decode step reads.

The conversation's tokens, as llama.cpp keeps them: the earlier turns' prompts and replies exactly as they were
generated (a reply is not re-tokenized from its text, which need not give the same ids), then the chat template's
new part (the reply's end marker, the user's message, the assistant's header) tokenized alone. Exactness: a reply
equals generate() on those tokens (greedy: token for token; seeded: the same draws, each turn's sampler starting
from the seed; the tests hold it). Where the template renders the history differently from what was said (a
template that rewrites earlier turns), the whole conversation is tokenized again and the cache's longest common
prefix with it is reused. Longrope keeps its short- and long-rotated turns apart (the switch recomputes a row, as
generate() does); a sliding window on some layers only (Gemma 2/3) copies the cached turns into the row's cache
instead of reading them in place."""
from __future__ import annotations

import collections
import contextlib
import signal
import threading
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .engine import GenerationConfig, eos_ids, kv_bytes_per_token
from .engine_options import EngineOptions
from .errors import InvalidRequestError
from .models import Model
from .sampling import SamplingParams
from .scheduler import Request, Scheduler, TokenOutput

PREFILL_CHUNK = 1024  # prompt tokens a step prefills (the native step's longest, NATIVE_MAX_T)


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
    ctx_size: int | None = None  # the conversation's bound in tokens (None: the model's context; at most that)
    messages: list[dict[str, str]] = field(init=False)
    engine: Scheduler = field(init=False)
    prompt_ids: list[int] = field(init=False)  # the last turn's conversation tokens, up to the assistant's header
    last: TurnStats = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, Model):
            raise InvalidRequestError("chat runs on a model in this process; with tp > 1 only generate() is built")
        if self.model.tokenizer is None:
            raise InvalidRequestError("chat needs a tokenizer with a chat template; this model has none")
        if not self.model.tokenizer.chat_template:
            raise InvalidRequestError("this model has no chat template: give one with --chat-template NAME|FILE "
                                      "(built in: chatml, llama3, gemma)")
        GenerationConfig(max_new_tokens=self.max_new_tokens, sampling=self.sampling, kv=self.kv,
                         kv_dtype=self.kv_dtype)  # the same checks as generate()
        limit = self.model.max_context
        if self.ctx_size is not None and not (isinstance(self.ctx_size, int) and 2 <= self.ctx_size <= limit):
            raise InvalidRequestError(f"ctx_size (--ctx-size) must be an integer in [2, {limit}] (the model's "
                                      f"context), got {self.ctx_size}")
        self.context = self.ctx_size or limit
        self.eos = eos_ids(self.model)
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays) and free its KV."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.engine = self._new_engine()
        self.prompt_ids = []
        self._anchor = ""  # the last turn's rendered prompt text plus its reply's text
        self._reply_ids: list[int] = []
        self.last = TurnStats()

    def load_messages(self, messages: list[dict[str, str]]) -> None:
        """Continue a saved conversation (`messages` as /save writes them: role and content): its turns replace this
        one's, and the next turn prefills them all once (their tokens as the template renders them now)."""
        roles = ("system", "user", "assistant")
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and m.get("role") in roles and isinstance(m.get("content"), str) for m in messages):
            raise InvalidRequestError("a conversation is a JSON list of {\"role\": system|user|assistant, "
                                      "\"content\": text} objects")
        self.reset()
        self.messages = [{"role": m["role"], "content": m["content"]} for m in messages]

    def _new_engine(self) -> Scheduler:
        """One row, prompts prefilled PREFILL_CHUNK tokens a step, and a prefix cache that can hold the model's
        whole context once (blocks of one token: every token of a turn is kept)."""
        m = self.model
        per_token = kv_bytes_per_token(m, self.kv_dtype)
        return Scheduler(m, EngineOptions(max_num_seqs=1, max_num_batched_tokens=PREFILL_CHUNK + 1, kv=self.kv,
                                          kv_dtype=self.kv_dtype, prefix_block=1, keep_turns=True,
                                          prefix_cache_bytes=int(per_token * (self.context + 64)),
                                          max_length=self.context))

    @property
    def context_used(self) -> int:
        """Tokens of the conversation so far: the last turn's prompt and its reply."""
        return len(self.prompt_ids) + len(self._reply_ids)

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
        if len(ids) + 1 > self.context:
            whose = "the model's context" if self.context == self.model.max_context else "--ctx-size"
            raise ContextFullError(f"the conversation has {len(ids)} tokens, {whose} is {self.context}: /reset to "
                                   "start over")
        self.messages, self.prompt_ids, self._reply_ids = messages, ids, []
        gen = GenerationConfig(max_new_tokens=min(self.max_new_tokens, self.context - len(ids)),
                               sampling=self.sampling, kv=self.kv, kv_dtype=self.kv_dtype)
        events: collections.deque[TokenOutput | BaseException] = collections.deque()
        request = Request(ids, gen, events.append, device=self.model.device)
        self.last = stats = TurnStats(prompt_tokens=len(ids))
        reply: list[int] = []
        try:
            self.engine.add(request)
            while not request.done:
                self._step()
                while events:
                    out = events.popleft()
                    if isinstance(out, BaseException):
                        raise out
                    reply.append(out.token_id)
                    if out.finish_reason is not None:
                        stats.finish_reason = out.finish_reason
                    if out.text:
                        yield out.text
        finally:
            if not request.done:  # the caller stopped reading (or was interrupted): what came so far is the reply
                self.engine.abort(request)
            while self.engine.has_work():  # the row leaves the batch: its turn is kept in the prefix cache only
                try:
                    self._step()
                except KeyboardInterrupt:  # another Ctrl-C while the reply ends: it is ending already
                    continue
            stats.prefilled_tokens = len(ids) - request.cached_tokens
            stats.generated_tokens = len(reply)
            said = reply[:-1] if reply and reply[-1] in self.eos else reply  # the template writes its end marker
            self._reply_ids = said
            self.messages.append({"role": "assistant", "content": tok.decode(said)})
            self._anchor = rendered + self.messages[-1]["content"]

    def _step(self) -> None:
        """One engine step. Ctrl-C lands between steps, never inside one (a step cut in half would leave the
        conversation's KV in an unknown state): it waits for the step to end and is raised then, so the reply stops
        and the conversation's KV stays. Any other failure inside a step starts the KV over (its tokens are kept: the
        next turn prefills them again, exactly)."""
        try:
            with interrupts_between_steps():
                self.engine.step()
        except KeyboardInterrupt:
            raise
        except BaseException:
            self.engine = self._new_engine()
            raise


@contextlib.contextmanager
def interrupts_between_steps() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) until the block ends, then raise it as KeyboardInterrupt. Only on the main thread
    with Python's own handler in place (elsewhere signals are not this code's to take)."""
    if threading.current_thread() is not threading.main_thread() or (
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    pending: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pending:
        raise KeyboardInterrupt
