"""OpenAI request bodies -> bmc requests, with the checks a user of vLLM or the OpenAI API expects: every field is
type- and range-checked, and what bmc does not implement is refused by name (never silently ignored)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..engine import GenerationConfig, encode_prompts
from ..errors import BmcError
from ..models import Model
from ..sampling import SamplingParams

MAX_LOGPROBS = 20


class APIError(Exception):
    """An error answered as OpenAI does: status code and {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             503: "service_unavailable"}.get(status, "internal_server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


@dataclass
class ParsedRequest:
    prompts: list[list[int]]  # token ids of each prompt (several only for /v1/completions with a list of prompts)
    gen: GenerationConfig
    stream: bool
    include_usage: bool
    logprobs: int | None  # top alternatives per token to report (0 = the chosen token's only); None = no logprobs
    chat: bool


def _number(body: dict, name: str, default: float | None, lo: float, hi: float, *, lo_open: bool = False
            ) -> float | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(f"{name} must be a finite number, got {v!r}", name)
    if v < lo or v > hi or (lo_open and v == lo):
        raise bad(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", name)
    return float(v)


def _int(body: dict, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"{name} must be an integer, got {v!r}", name)
    if v < lo or (hi is not None and v > hi):
        raise bad(f"{name} must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}", name)
    return v


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{name} must be true or false, got {v!r}", name)
    return v


def _refuse_unimplemented(body: dict, chat: bool) -> None:
    """Fields with an effect bmc does not implement: refused when set to anything but their no-op value."""
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        neutral = 1.0 if name == "repetition_penalty" else 0.0
        if body.get(name) not in (None, neutral):
            raise bad(f"{name} is not supported by bmc-serve (only {neutral})", name)
    if body.get("logit_bias"):
        raise bad("logit_bias is not supported by bmc-serve", "logit_bias")
    if not chat:
        if body.get("echo"):
            raise bad("echo is not supported by bmc-serve", "echo")
        if body.get("suffix"):
            raise bad("suffix is not supported by bmc-serve", "suffix")
        best_of = body.get("best_of")
        if best_of is not None and best_of != body.get("n", 1):
            raise bad("best_of other than n is not supported by bmc-serve", "best_of")
    if chat and body.get("tools"):
        raise bad("tools (function calling) are not supported by bmc-serve", "tools")
    if chat and body.get("response_format") not in (None, {"type": "text"}):
        raise bad("response_format other than text is not supported by bmc-serve", "response_format")


def _prompts(body: dict, model: Model) -> list[list[int]]:
    p = body.get("prompt")
    if p is None:
        raise bad("prompt is required", "prompt")
    vocab = model.config.vocab_size
    if isinstance(p, str):
        items: list = [p]
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        items = [p]
    elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        items = p
    else:
        raise bad("prompt must be a non-empty string, a list of token ids, or a list of those", "prompt")
    out = []
    for i, x in enumerate(items):
        if isinstance(x, str):
            if not x:
                raise bad(f"prompt {i} is empty", "prompt")
            out.append(encode_prompts(model, [x], chat=False)[0])
        else:
            if not x or not all(isinstance(t, int) and not isinstance(t, bool) for t in x):
                raise bad(f"prompt {i} must be a non-empty list of token ids", "prompt")
            if not all(0 <= t < vocab for t in x):
                raise bad(f"prompt {i} has token ids outside [0, {vocab})", "prompt")
            out.append(list(x))
    return out


def _chat_prompt(body: dict, model: Model) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string role", "messages")
        if m["role"] not in ("system", "user", "assistant", "developer"):
            raise bad(f"messages[{i}].role {m['role']!r} is not supported (system, user, assistant)", "messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise bad(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string", "messages")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    if model.tokenizer is None:
        raise bad("this model has no tokenizer, so no chat template: use /v1/completions with token ids")
    try:
        text = model.tokenizer.apply_chat_template(clean, add_generation_prompt=True)
    except Exception as e:  # the template's own raise_exception (e.g. roles out of order)
        raise bad(f"the model's chat template rejected the messages: {e}", "messages") from None
    return encode_prompts(model, [text], chat=False)[0]


def _stop(body: dict) -> tuple[str, ...]:
    s = body.get("stop")
    if s is None:
        return ()
    stops = [s] if isinstance(s, str) else s
    if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
        raise bad("stop must be a non-empty string or a list of them", "stop")
    return tuple(stops)


def parse_request(body: Any, model: Model, served_name: str, *, chat: bool, max_num_seqs: int,
                  server_gen: GenerationConfig) -> ParsedRequest:
    """Check a /v1/completions (chat=False) or /v1/chat/completions body; raises APIError."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    name = body.get("model")
    if name is not None and name != served_name:
        raise APIError(404, f"The model `{name}` does not exist (this server serves `{served_name}`)", param="model",
                       kind="not_found_error")
    _refuse_unimplemented(body, chat)
    prompts = [_chat_prompt(body, model)] if chat else _prompts(body, model)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise bad("stream_options is only allowed with stream=true, as an object", "stream_options")
    include_usage = _bool(options or {}, "include_usage", False)
    if chat:
        logprobs = _int(body, "top_logprobs", 0, 0, MAX_LOGPROBS) if _bool(body, "logprobs", False) else None
        if body.get("top_logprobs") is not None and logprobs is None:
            raise bad("top_logprobs needs logprobs=true", "top_logprobs")
    else:
        logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    n = _int(body, "n", 1, 1, max_num_seqs)
    max_tokens = _int(body, "max_completion_tokens", None, 1) if chat else None
    max_tokens = max_tokens or _int(body, "max_tokens", None, 1)
    longest = max(len(p) for p in prompts)
    room = model.max_context - longest
    if room < 1 or (max_tokens is not None and max_tokens > room):
        raise bad(f"the prompt has {longest} tokens; with max_tokens={max_tokens or 1} that is beyond the model's "
                  f"context of {model.max_context}", "max_tokens" if room >= 1 else "prompt")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", None, 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", None, -1)
    seed = _int(body, "seed", None, -(2**63), 2**64 - 1)
    try:
        sampling = SamplingParams(temperature=temperature, top_k=top_k if top_k and top_k > 0 else None,
                                  top_p=top_p if top_p is not None and top_p < 1.0 else None,
                                  seed=seed % 2**63 if seed is not None else None)
        gen = GenerationConfig(max_new_tokens=max_tokens or room, sampling=sampling, num_samples=n, stop=_stop(body),
                               ignore_eos=_bool(body, "ignore_eos", False), kv=server_gen.kv, r=server_gen.r,
                               T=server_gen.T, kv_dtype=server_gen.kv_dtype)
    except BmcError as e:
        raise bad(str(e)) from None
    return ParsedRequest(prompts, gen, stream, include_usage, logprobs, chat)
