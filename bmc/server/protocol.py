"""OpenAI request and response bodies as pydantic models (so /openapi.json documents them), and the conversion of a
checked request into bmc's: every field is type- and range-checked (strictly: "1" is not a number, true is not an
integer), unknown fields are refused by name, and what bmc does not implement is refused unless it is set to its
no-op value. Nothing here silently ignores a field that would change the answer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..engine import GenerationConfig, encode_prompts
from ..errors import BmcError
from ..grammar import GrammarSpec, check_grammar
from ..tools import forced_call_grammar, render_messages, template_reads_tools
from ..models import Model
from ..sampling import SamplingParams

MAX_LOGPROBS = 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default on /v1/completions (chat runs to the context)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               503: "service_unavailable"}
ERROR_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
               415: "unsupported_media_type", 500: "internal_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error answered as OpenAI does: status code and {"error": {"message", "type", "param", "code"}}, the code a
    string or null."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.kind = kind or ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.code = code or ERROR_CODES.get(status)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# ---- request bodies -----------------------------------------------------------------------------------------------
def _first_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string holding a lone UTF-16 surrogate (JSON allows "\\ud83d"; no tokenizer does)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
    elif isinstance(value, dict):
        for k, v in value.items():
            found = _first_surrogate(k, path) or _first_surrogate(v, f"{path}.{k}" if path else str(k))
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _first_surrogate(v, f"{path}[{i}]")
            if found:
                return found
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _Body(_Strict):
    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        where = _first_surrogate(data, "")
        if where is not None:
            raise ValueError(f"{where or 'the body'} holds a lone UTF-16 surrogate, which is not valid text "
                             "(a character cut in half?)")
        return data


class StreamOptions(_Strict):
    include_usage: bool | None = None


NonEmpty = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[int], Field(min_length=1)]
MAX_STOPS = 64  # each is checked after every token: thousands would slow every stream of the batch
MAX_PROMPTS = 1024  # prompts in one /v1/completions request (each queued as a request of its own)
Stop = Union[NonEmpty, Annotated[list[NonEmpty], Field(max_length=MAX_STOPS)], None]


class JsonSchemaFormat(_Strict):
    """OpenAI's response_format.json_schema (strict is accepted: the output always matches the schema)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's: text, any JSON object, or a JSON schema; llama-server's json_object with a `schema` too."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class _Sampling(_Body):
    """Fields common to both routes."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0, description="0: only with echo (the prompt scored, nothing generated)")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy; default 1.0")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0 = off")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    n: int | None = Field(None, ge=1)
    stop: Stop = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    user: str | None = None
    # OpenAI's penalties over the generated tokens, vLLM's repetition_penalty (prompt and output; 1 = none), and
    # OpenAI's logit_bias {"token id": bias in [-100, 100]}: checked in float32 by SamplingParams
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # constrained output (llguidance, bmc/grammar.py), at most one: OpenAI's response_format, llama-server's
    # json_schema and grammar (GBNF), and a regex (SGLang's name)
    response_format: ResponseFormat | None = None
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None
    regex: str | None = None
    # the prefix cache: false opts this request out (llama-server's cache_prompt); requests share cached prompt
    # KV only under the same cache_salt (vLLM's)
    cache_prompt: bool | None = None
    cache_salt: str | None = None


class CompletionRequest(_Sampling):
    prompt: Union[NonEmpty, TokenIds, Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_PROMPTS)],
                  Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]] = Field(
        description="a string, a list of token ids, or a list of either (one completion each)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, description="only equal to n")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: NonEmpty
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[TextPart], None] = None  # None only for an assistant's message of tool calls
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: which call it answers

    @model_validator(mode="after")
    def _content(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant's tool calls may go without)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self


class FunctionDef(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: NonEmpty


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # tool calls (bmc/tools.py): rendered through the chat template, parsed back into tool_calls
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None
    # accepted at their no-op values only (the legacy function-calling fields)
    functions: Annotated[list[dict[str, Any]], Field(max_length=0)] | None = None
    function_call: Literal["none", "auto"] | None = None
    modalities: list[Literal["text"]] | None = None
    # no effect on the tokens
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None


# ---- response bodies (documentation and Schemathesis' response checks) ------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    # with echo the prompt's first token has no log-probability: null there, as OpenAI's and vLLM's
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    kv_cache_dtype: str
    capabilities: dict[str, Any]  # what a client may ask of this server beyond plain text (CAPABILITIES)


# /v1/models' `capabilities`: the request fields beyond plain completions that this server implements
CAPABILITIES: dict[str, Any] = {
    "structured_outputs": ["json_object", "json_schema", "regex", "grammar"], "echo": True, "logprobs": True,
    "sampling": ["temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "logit_bias"], "tokenize": True, "tools": True,
    "tool_choice": ["none", "auto", "required", "function"]}


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


# each server-sent event: `data: {chunk JSON}` (then `data: [DONE]`)
SSE = {"text/event-stream": {"schema": {"type": "object", "required": ["data"],
                                        "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}}
ERRORS: dict[int | str, dict[str, Any]] = {s: {"model": ErrorResponse, "description": d} for s, d in (
    (400, "invalid request"), (401, "missing or wrong API key"), (404, "unknown model"), (413, "body too large"),
    (415, "not JSON"), (500, "the request failed inside the engine"), (503, "loading, engine stopped or queue full"))}
COMPLETION_RESPONSES: dict[int | str, dict[str, Any]] = {200: {"model": CompletionResponse, "content": SSE}, **ERRORS}
CHAT_RESPONSES: dict[int | str, dict[str, Any]] = {200: {"model": ChatCompletionResponse, "content": SSE}, **ERRORS}


class TokenizeRequest(_Body):
    """vLLM's /tokenize (`prompt`, or chat `messages`) and llama-server's (`content`, `add_special`)."""

    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_special: bool | None = None
    add_generation_prompt: bool | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def tokenize(body: TokenizeRequest, model: Model, context: int) -> dict[str, Any]:
    """{"count", "max_model_len", "tokens"} (vLLM's answer; llama-server's `tokens` is in it)."""
    given = [f for f in ("prompt", "content", "messages") if getattr(body, f) is not None]
    if len(given) != 1:
        raise bad("give one of prompt, content (text) or messages (a chat)", given[1] if given else "prompt")
    tok = model.tokenizer
    if tok is None:
        raise bad("this model has no tokenizer")
    try:
        if body.messages is not None:
            ids = tok.encode(_render_chat(body.messages, model, body.add_generation_prompt is not False))
        else:
            special = body.add_special_tokens if body.add_special_tokens is not None else body.add_special
            ids = tok.encode(body.prompt if body.prompt is not None else body.content or "",
                             add_special_tokens=special is not False)
    except BmcError as e:
        raise bad(str(e), given[0]) from None
    return {"count": len(ids), "max_model_len": context, "tokens": ids}


def detokenize(body: DetokenizeRequest, model: Model) -> dict[str, Any]:
    """{"prompt"} (vLLM's) and {"content"} (llama-server's): the same text."""
    V = model.config.vocab_size
    bad_ids = [t for t in body.tokens if not 0 <= t < V]
    if bad_ids:
        raise bad(f"tokens outside [0, {V}): {bad_ids[:8]}", "tokens")
    if model.tokenizer is None:
        raise bad("this model has no tokenizer")
    text = model.tokenizer.decode(body.tokens)
    return {"prompt": text, "content": text}


# ---- a checked body -> bmc's request ------------------------------------------------------------------------------
@dataclass
class ParsedRequest:
    prompts: list[list[int]]  # token ids of each prompt (several only for /v1/completions with a list of prompts)
    gen: GenerationConfig
    stream: bool
    include_usage: bool
    logprobs: int | None  # top alternatives per token to report (0 = the chosen token's only); None = no logprobs
    chat: bool
    model_name: str  # the served name the client asked for (answered back as `model`)
    cache_salt: str | None = None
    cache_prompt: bool = True
    echo: bool = False  # /v1/completions: the prompt comes back before the completion (with its logprobs if asked)
    echo_only: bool = False  # max_tokens 0 with echo: one token is computed and not returned
    prompt_texts: list[str] | None = None  # the prompts as the client wrote them (echo), where they were text
    tool_names: set[str] | None = None  # chat with tools: the replies are parsed into tool_calls (bmc/tools.py)


def _refuse_unimplemented(body: _Sampling) -> None:
    """Fields with an effect bmc does not implement: refused when set to anything but their no-op value."""
    if isinstance(body, CompletionRequest):
        if body.echo and body.stream:
            raise bad("echo with stream=true is not supported by bmc-serve (echo without streaming is)", "echo")
        if body.max_tokens == 0 and not body.echo:
            raise bad("max_tokens=0 needs echo=true (it scores the prompt and generates nothing)", "max_tokens")
        if body.suffix:
            raise bad("suffix is not supported by bmc-serve", "suffix")
        if body.best_of is not None and body.best_of != (body.n or 1):
            raise bad("best_of other than n is not supported by bmc-serve", "best_of")
        return


def _grammar(body: _Sampling) -> tuple[GrammarSpec | None, str | None]:
    """The request's output constraint and the field it came from (a 400 when more than one is given)."""
    given = []
    rf = body.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_schema":
            if rf.json_schema is None:
                raise bad('response_format of type "json_schema" needs a "json_schema" object', "response_format")
            schema = rf.json_schema.schema_
            given.append(("response_format", GrammarSpec.json_schema(schema if schema is not None else {})))
        else:
            given.append(("response_format", GrammarSpec.json_schema(rf.schema_ if rf.schema_ is not None else True)))
    if body.json_schema is not None:
        given.append(("json_schema", GrammarSpec.json_schema(body.json_schema)))
    if body.grammar is not None:
        given.append(("grammar", GrammarSpec("gbnf", body.grammar)))
    if body.regex is not None:
        given.append(("regex", GrammarSpec("regex", body.regex)))
    if isinstance(body, ChatCompletionRequest) and body.tool_choice not in (None, "none", "auto"):
        if not body.tools:
            raise bad("tool_choice names a tool call but the request has no tools", "tool_choice")
        name = body.tool_choice.function.name if not isinstance(body.tool_choice, str) else None
        if name is not None and name not in {t.function.name for t in body.tools}:
            raise bad(f"tool_choice names {name!r}, which is not one of the request's tools", "tool_choice")
        given.append(("tool_choice", forced_call_grammar(_active_tools(body) or [], name)))
    if len(given) > 1:
        raise bad(f"give one output constraint, not {' and '.join(f for f, _ in given)}", given[1][0])
    return (given[0][1], given[0][0]) if given else (None, None)


def _logit_bias(bias: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs; a key that is not a token id is refused by name."""
    pairs = []
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdecimal() and len(key) <= 12) or int(key) >= vocab:
            raise bad(f"logit_bias keys must be token ids in [0, {vocab}), got {key!r}", "logit_bias")
        pairs.append((int(key), value))
    return tuple(pairs)


def _prompts(body: CompletionRequest, model: Model) -> list[list[int]]:
    p = body.prompt
    items: list = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    if not items:
        raise bad("prompt must be a non-empty string, a list of token ids, or a list of those", "prompt")
    vocab = model.config.vocab_size
    out = []
    for i, x in enumerate(items):
        if not x:
            raise bad(f"prompt {i} is empty", "prompt")
        if isinstance(x, str):
            out.append(encode_prompts(model, [x], chat=False)[0])
        else:
            if not all(0 <= t < vocab for t in x):
                raise bad(f"prompt {i} has token ids outside [0, {vocab})", "prompt")
            out.append(list(x))
    return out


def _chat_prompt(body: ChatCompletionRequest, model: Model) -> list[int]:
    tools = _active_tools(body)
    return encode_prompts(model, [_render_chat(body.messages, model, tools=tools)], chat=False)[0]


def _active_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The request's tools as plain dicts, unless there are none or tool_choice is "none"."""
    if not body.tools or body.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools]


def _render_chat(messages: list[ChatMessage], model: Model, add_generation_prompt: bool = True,
                 tools: list[dict[str, Any]] | None = None) -> str:
    """The messages (and tools) through the model's chat template (bmc/tools.py when the template has no tools)."""
    clean = []
    for m in messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "".join(
            part.text for part in m.content)
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        clean.append(message)
    if model.tokenizer is None:
        raise bad("this model has no tokenizer, so no chat template: use /v1/completions with token ids")
    has_tools = any(m.get("tool_calls") or m["role"] == "tool" for m in clean)
    variables: dict[str, Any] = {}
    if tools or has_tools:
        clean, variables = render_messages(clean, tools, template_reads_tools(model.tokenizer.chat_template))
    try:
        return model.tokenizer.apply_chat_template(clean, add_generation_prompt=add_generation_prompt, **variables)
    except Exception as e:  # the template's own raise_exception (e.g. roles out of order)
        raise bad(f"the model's chat template rejected the messages: {e}", "messages") from None


def parse_request(body: CompletionRequest | ChatCompletionRequest, model: Model, served_names: list[str], *,
                  max_num_seqs: int, server_gen: GenerationConfig, context: int | None = None) -> ParsedRequest:
    """A checked body -> token ids and a GenerationConfig; raises APIError. Tokenizes: call it off the event loop."""
    chat = isinstance(body, ChatCompletionRequest)
    if body.model is not None and body.model not in served_names:
        raise APIError(404, f"The model `{body.model}` does not exist (this server serves "
                       f"{', '.join(f'`{n}`' for n in served_names)})", param="model", code="model_not_found")
    _refuse_unimplemented(body)
    if not body.stream and body.stream_options is not None:
        raise bad("stream_options is only allowed with stream=true", "stream_options")
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise bad("top_logprobs needs logprobs=true", "top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
    else:
        logprobs = body.logprobs
        # max_tokens 0 (echo only): one token is computed, as a prompt's last logits are, and not returned
        max_tokens = 1 if body.max_tokens == 0 else body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
    n = body.n or 1
    if n > max_num_seqs:
        raise bad(f"n={n} exceeds the server's --max-num-seqs={max_num_seqs}", "n")
    try:
        prompts = [_chat_prompt(body, model)] if isinstance(body, ChatCompletionRequest) else _prompts(body, model)
    except BmcError as e:  # the tokenizer's own checks
        raise bad(str(e), "messages" if chat else "prompt") from None
    longest = max(len(p) for p in prompts)
    context = model.max_context if context is None else context  # the server's --ctx-size, else the model's
    room = context - longest
    if room < 1 or (max_tokens is not None and max_tokens > room):
        asked = f"with max_tokens={max_tokens}" if max_tokens is not None else "with a token to generate"
        whose = "the model's context" if context == model.max_context else "the server's context (--ctx-size)"
        raise APIError(400, f"the prompt has {longest} tokens; {asked} that is beyond {whose} of "
                       f"{context}", param="max_tokens" if room >= 1 else "messages" if chat else "prompt",
                       code="context_length_exceeded")  # OpenAI's code
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if not all(stops):
        raise bad("stop strings must be non-empty", "stop")
    temperature = 1.0 if body.temperature is None else body.temperature
    try:
        sampling = SamplingParams(temperature=temperature, top_k=body.top_k if body.top_k and body.top_k > 0 else None,
                                  top_p=body.top_p if body.top_p is not None and body.top_p < 1.0 else None,
                                  min_p=body.min_p or None, seed=body.seed % 2**63 if body.seed is not None else None,
                                  presence_penalty=body.presence_penalty or 0.0,
                                  frequency_penalty=body.frequency_penalty or 0.0,
                                  repetition_penalty=(1.0 if body.repetition_penalty is None
                                                      else body.repetition_penalty),
                                  logit_bias=_logit_bias(body.logit_bias, model.config.vocab_size))
        sampling.check_vocab(model.config.vocab_size)
        spec, source = _grammar(body)
        if spec is not None:
            try:
                check_grammar(model, spec)
            except BmcError as e:
                raise bad(str(e) if str(e).startswith(str(source)) else f"{source}: {e}", source) from None
        gen = GenerationConfig(max_new_tokens=max_tokens or room, sampling=sampling, num_samples=n, stop=tuple(stops),
                               ignore_eos=bool(body.ignore_eos), kv=server_gen.kv, r=server_gen.r, T=server_gen.T,
                               kv_dtype=server_gen.kv_dtype, grammar=spec)
    except BmcError as e:  # SamplingParams' float32 checks name their field first
        field = str(e).split(" ", 1)[0]
        raise bad(str(e), field if field in type(body).model_fields else None) from None
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    echo = isinstance(body, CompletionRequest) and bool(body.echo)
    texts = None
    if echo:
        items = [body.prompt] if isinstance(body.prompt, str) or isinstance(body.prompt[0], int) else body.prompt
        texts = [x if isinstance(x, str) else model.tokenizer.decode(x) if model.tokenizer else "" for x in items]
    return ParsedRequest(prompts, gen, bool(body.stream), include_usage, logprobs, chat,
                         body.model if body.model is not None else served_names[0], body.cache_salt,
                         body.cache_prompt is not False, echo=echo, echo_only=echo and body.max_tokens == 0,
                         prompt_texts=texts,
                         tool_names=({t.function.name for t in body.tools} if isinstance(body, ChatCompletionRequest)
                                     and _active_tools(body) else None))


UNSUPPORTED = {
    "functions": "functions (legacy function calling) are not supported by bmc-serve: use tools",
    "function_call": "function_call other than none/auto is not supported by bmc-serve: use tool_choice",
    "response_format": "response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                       "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
    "modalities": "modalities other than [\"text\"] are not supported by bmc-serve",
}


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """FastAPI's validation errors -> one OpenAI-style message naming the field, and the param."""
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    kind = e.get("type", "")
    if kind == "json_invalid":
        return f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    if kind == "extra_forbidden":
        name = ".".join(loc)
        return f"unknown field `{name}`: bmc-serve does not implement it", name
    if not loc:
        msg = str(e.get("msg", "invalid body"))
        return ("the request body must be a JSON object" if kind in ("dict_type", "model_type") else
                msg.removeprefix("Value error, ")), None
    field = loc[0]
    if field in UNSUPPORTED:
        return UNSUPPORTED[field], field
    if field == "prompt":
        return (f"prompt must be a non-empty string, a list of token ids, or a list of at most {MAX_PROMPTS} of "
                "those", field)
    if field == "stop":
        return f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them", field
    readable = [x for x in loc if not any(c in x for c in "[]|") and x not in ("str", "list", "int")]
    return f"{'.'.join(readable)}: {e.get('msg', 'invalid value')}", field
