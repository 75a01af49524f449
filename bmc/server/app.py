"""bmc-serve's FastAPI app: OpenAI routes (completions, chat completions, models), SSE streaming, /health and
/metrics over the continuous-batching scheduler. No model code here: the scheduler runs on its own thread
(server/engine.py) and this module only translates between HTTP and its requests.

What a client sends cannot stop the engine: bodies are checked by the pydantic models in protocol.py (every
refusal a 4xx with an OpenAI error object, counted in bmc:request_errors), tokenized off the event loop, and a
request that fails inside the engine fails alone. If the engine thread dies anyway (a bug), /health turns 503,
every request in flight is answered, and the process exits non-zero for its supervisor (or the router) to restart."""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import GenerationConfig
from ..engine_options import EngineOptions
from ..errors import InvalidRequestError
from ..models import Model
from ..scheduler import EngineStoppedError, QueueFullError, Scheduler, TokenOutput
from ..tools import parse_tool_calls
from .engine import EngineThread, RequestGroup
from .gate import RequestGate
from .metrics import ServerMetrics
from .protocol import (CAPABILITIES, CHAT_RESPONSES, COMPLETION_RESPONSES, ERRORS, APIError, ChatCompletionRequest,
                       CompletionRequest, DetokenizeRequest, ModelCard, ModelList, ParsedRequest, TokenizeRequest,
                       detokenize, parse_request, tokenize, validation_message)

log = logging.getLogger("bmc.server")
from .limits import DEFAULT_MAX_BODY_BYTES


@dataclass
class ServeOptions:
    """What bmc-serve serves: the model and how it is loaded, the HTTP side, and the engine's options (one
    EngineOptions, checked where it is made)."""

    model: str | None = None  # HF directory or GGUF file; None = the embedded default model
    served_model_names: list[str] | None = None  # names clients may pass as `model`; the first is reported
    engine: EngineOptions = field(default_factory=EngineOptions)
    api_key: str | None = None
    allowed_origins: list[str] | None = None  # CORS: origins browsers may call from (None = CORS off)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    dtype: str = "float32"
    device: str = "cpu"
    share_weights: bool = False  # map the weights from a file shared by every process serving the model
    quant: str = "auto"  # see bmc/models/quant.py
    activations: str = "auto"  # "int8" / "bfloat16": stated-bound arithmetic; "auto": bmc.load's default
    tp: int = 1  # tensor parallel ranks: this process is rank 0 and runs the scheduler (parallel/serve.py)
    chat_template: str | None = None  # replaces the model's own (--chat-template), None: the model's


def default_served_name(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base


class ServerState:
    """The model, scheduler and engine thread once loaded (in the background: /health is 503 until then)."""

    def __init__(self, opts: ServeOptions) -> None:
        self.opts = opts
        self.model: Model | None = None
        self.scheduler: Scheduler | None = None
        self.engine: EngineThread | None = None
        self.load_error: BaseException | None = None
        self.on_load_error = lambda: None  # the CLI stops the server: a server that cannot load should not run
        self.on_engine_death: Callable[[], None] = lambda: None  # the CLI stops the server and exits non-zero
        self.names = list(opts.served_model_names or ["bmc"])
        self.metrics: ServerMetrics | None = None
        self.created = int(time.time())

    @property
    def name(self) -> str:
        return self.names[0]

    def load(self) -> None:
        from .. import load

        try:
            o = self.opts
            if o.tp > 1:
                from ..parallel.serve import load_served

                model, scheduler = load_served(o.model, o.tp, dtype=o.dtype, device=o.device, options=o.engine)
            else:
                model = load(o.model, dtype=o.dtype, device=o.device, share_weights=o.share_weights, quant=o.quant,
                             activations=o.activations)
                scheduler = Scheduler(model, o.engine)
            tokenizer = getattr(model, "tokenizer", None)
            if o.chat_template is not None and tokenizer is not None:
                tokenizer.chat_template = o.chat_template
            elif tokenizer is not None and not tokenizer.chat_template:
                log.warning("the model has no chat template: /v1/chat/completions answers 400 (start with "
                            "--chat-template NAME|FILE)")
            self.names = list(o.served_model_names or [default_served_name(model.path)])
            if o.engine.prefix_cache_bytes and scheduler.prefix_cache is None:
                log.warning("prefix cache off: not served for %s", scheduler.prefix_cache_off)
            metrics = ServerMetrics(self.name)
            metrics.bind(lambda: scheduler.num_running, lambda: scheduler.num_waiting, lambda: scheduler.kv_bytes,
                         lambda: scheduler.cache.batch_size)
            if scheduler.spec is not None:
                metrics.bind_speculation(lambda: scheduler.spec.stats)
            if scheduler.prefix_cache is not None:
                metrics.bind_prefix_cache(scheduler)
            self.engine = EngineThread(scheduler)
            step_histogram = metrics.step.labels(self.name)
            self.engine.on_step = step_histogram.observe
            self.engine.on_death = lambda error: self.on_engine_death()
            self.engine.start()
            # The load leaves ~200k long-lived Python objects (vocabulary, merges, modules); a full collection
            # walks them all and stalls every stream while it holds the GIL. Frozen, they are skipped.
            gc.collect()
            gc.freeze()
            self.model, self.scheduler, self.metrics = model, scheduler, metrics
            log.info("model %s loaded: %s layers, context %d (the model's %d); serving as %s", model.path,
                     model.config.num_layers, scheduler.max_length, model.max_context, ", ".join(map(repr, self.names)))
        except BaseException as e:
            self.load_error = e
            log.error("could not load the model: %s", e)
            self.on_load_error()

    @property
    def ready(self) -> bool:
        return self.scheduler is not None and self.engine is not None and self.engine.alive

    def require_ready(self) -> tuple[Model, Scheduler, ServerMetrics]:
        if not self.ready:
            raise APIError(503, "the model is still loading" if self.load_error is None and self.engine is None
                           else "the engine is not running", headers={"Retry-After": "1"})
        return self.model, self.scheduler, self.metrics  # type: ignore[return-value]

    def count_error(self, status: int) -> None:
        if self.metrics is not None:
            self.metrics.errors.labels(self.name, str(status)).inc()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        close_ranks = getattr(self.scheduler, "close_ranks", None)  # tensor parallel: the other ranks stop too
        if close_ranks is not None:
            close_ranks()


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body is read by then, so the next ASGI message is the disconnect);
    raced against a non-streamed generation, as vLLM's with_cancellation does."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def build_app(opts: ServeOptions) -> FastAPI:
    state = ServerState(opts)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        threading.Thread(target=state.load, name="bmc-load", daemon=True).start()
        yield
        state.shutdown()

    app = FastAPI(title="bmc-serve", lifespan=lifespan,
                  strict_content_type=False)  # no Content-Type: read as JSON (RequestGate refuses other types)
    app.state.bmc = state
    app.add_middleware(RequestGate, api_key=opts.api_key, max_body_bytes=opts.max_body_bytes,
                       on_error=state.count_error)
    if opts.allowed_origins:  # outermost: a preflight is answered before the API key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=opts.allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["*"])

    def error_response(e: APIError) -> JSONResponse:
        state.count_error(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = ("the request body could not be read as JSON (nested too deep, or a number too long?)"
                   if e.status_code == 400 else str(e.detail))
        return error_response(APIError(e.status_code, message, headers=dict(e.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(e.errors()))
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error answering %s", request.url.path)
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}"))

    @app.get("/health", responses={503: {"description": "loading, or the engine stopped"}})
    async def health() -> JSONResponse:
        if state.ready:
            return JSONResponse({"status": "ok"})
        status = "loading" if state.engine is None and state.load_error is None else "error"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        if state.metrics is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def card(name: str) -> dict[str, Any]:
        model, scheduler, _ = state.require_ready()
        return {"id": name, "object": "model", "created": state.created, "owned_by": "bmc",
                "max_model_len": scheduler.max_length, "kv_cache_dtype": scheduler.cache.format.name,
                "capabilities": CAPABILITIES}

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [card(name) for name in state.names]})

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERRORS)
    async def model_card(model_id: str) -> JSONResponse:
        if model_id not in state.names:
            state.require_ready()
            raise APIError(404, f"The model `{model_id}` does not exist", param="model", code="model_not_found")
        return JSONResponse(card(model_id))

    @app.post("/tokenize", responses=ERRORS)
    async def tokenize_route(body: TokenizeRequest) -> JSONResponse:
        model, scheduler, _ = state.require_ready()
        return JSONResponse(await asyncio.to_thread(tokenize, body, model, scheduler.max_length))

    @app.post("/detokenize", responses=ERRORS)
    async def detokenize_route(body: DetokenizeRequest) -> JSONResponse:
        model, _, _ = state.require_ready()
        return JSONResponse(await asyncio.to_thread(detokenize, body, model))

    @app.post("/v1/completions", responses=COMPLETION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serve(body, request)

    @app.post("/v1/chat/completions", responses=CHAT_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serve(body, request)

    async def serve(body: CompletionRequest | ChatCompletionRequest, request: Request) -> Response:
        model, scheduler, metrics = state.require_ready()
        arrival = time.monotonic()
        e = opts.engine
        server_gen = GenerationConfig(kv=e.kv, r=e.r, T=e.T, kv_dtype=e.kv_dtype)
        # tokenizing (and rendering a chat template) costs in proportion to the text: off the event loop, so a long
        # prompt does not stall /health and the other streams' writes
        parsed = await asyncio.to_thread(parse_request, body, model, state.names, max_num_seqs=e.max_num_seqs,
                                         server_gen=server_gen, context=scheduler.max_length)
        group = RequestGroup(state.engine, asyncio.get_running_loop())
        try:
            group.submit(parsed.prompts, parsed.gen, parsed.logprobs, cache_salt=parsed.cache_salt,
                         cache_prompt=parsed.cache_prompt, score_prompt=parsed.echo and parsed.logprobs is not None)
        except (QueueFullError, EngineStoppedError) as e:
            raise APIError(503, str(e), headers={"Retry-After": "1"}) from None
        except InvalidRequestError as e:
            raise APIError(400, str(e)) from None
        run = Run(group, parsed, model, metrics, arrival)
        if parsed.stream:
            return StreamingResponse(run.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        task = asyncio.ensure_future(run.collect())
        gone = asyncio.ensure_future(client_gone(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return JSONResponse(task.result())
            group.abort()  # the client left: its rows are freed at the next step
            return Response(status_code=499)
        finally:
            for t in (task, gone):
                if not t.done():
                    t.cancel()
            group.abort()

    return app


class Run:
    """The outputs of one HTTP request as they arrive: its choices' text, token counts and metrics."""

    def __init__(self, group: RequestGroup, parsed: ParsedRequest, model: Model, metrics: ServerMetrics,
                 arrival: float) -> None:
        self.group, self.p, self.model, self.metrics = group, parsed, model, metrics
        self.name = parsed.model_name  # answered as `model`: the name the client used
        self.arrival, self.created = arrival, int(time.time())
        self.id = ("chatcmpl-" if parsed.chat else "cmpl-") + uuid.uuid4().hex
        self.n = parsed.gen.num_samples
        self.total = len(parsed.prompts) * self.n
        self.finished: dict[int, str] = {}
        self.completion_tokens = 0
        self.first_token_at: float | None = None
        self.last_at: dict[int, float] = {}
        self.prefilled: set[int] = set()

    @property
    def usage(self) -> dict[str, Any]:
        prompt = sum(len(p) for p in self.p.prompts)
        completion = 0 if self.p.echo_only else self.completion_tokens  # echo only: the token computed is not sent
        cached = sum(req.cached_tokens for req in self.group.requests)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}  # OpenAI's: found in the prefix cache

    async def outputs(self) -> AsyncIterator[tuple[int, TokenOutput]]:
        """(choice index, output) until every choice finished; raises the request's error if it failed."""
        m, label = self.metrics, self.metrics.model_name
        while len(self.finished) < self.total:
            prompt_index, out = await self.group.queue.get()
            if isinstance(out, BaseException):
                m.request_success.labels(label, "error").inc()
                raise out
            now = time.monotonic()
            index = prompt_index * self.n + out.sample_index
            if self.first_token_at is None:
                self.first_token_at = now
                m.ttft.labels(label).observe(now - self.arrival)
            if prompt_index not in self.prefilled:
                self.prefilled.add(prompt_index)
                m.prompt_tokens.labels(label).inc(len(self.p.prompts[prompt_index]))
                req = self.group.requests[prompt_index]
                if req.admitted_at is not None:
                    m.queue.labels(label).observe(max(0.0, req.admitted_at - req.arrival))
            if index in self.last_at:
                m.itl.labels(label).observe(now - self.last_at[index])
            self.last_at[index] = now
            self.completion_tokens += 1
            m.generation_tokens.labels(label).inc()
            if out.finish_reason is not None:
                self.finished[index] = out.finish_reason
                m.request_success.labels(label, out.finish_reason).inc()
            yield index, out
        m.e2e.labels(label).observe(time.monotonic() - self.arrival)

    # ---- logprobs in the two OpenAI shapes ------------------------------------------------------
    def _token_text(self, tid: int) -> str:
        """/v1/completions' `tokens` and `top_logprobs` keys: a part of a character as `bytes:\\xNN` (OpenAI's)."""
        tok = self.model.tokenizer
        return tok.logprob_text(tid) if tok is not None else str(tid)

    def _chat_logprob(self, out: TokenOutput) -> dict[str, Any]:
        tok = self.model.tokenizer

        def entry(tid: int, lp: float) -> dict[str, Any]:  # text as decoded (joined, the reply), and its own bytes
            s = tok.decode([tid], skip_special_tokens=False) if tok is not None else str(tid)
            raw = tok.token_bytes(tid) if tok is not None else s.encode("utf-8")
            return {"token": s, "logprob": lp, "bytes": list(raw)}  # raw: a client rebuilds split characters
        return dict(entry(out.token_id, out.logprob), top_logprobs=[entry(t, lp) for t, lp in out.top_logprobs or []])

    def _add_completion_logprob(self, acc: dict[str, list], out: TokenOutput, offset: int) -> None:
        acc["tokens"].append(self._token_text(out.token_id))
        acc["token_logprobs"].append(out.logprob)
        acc["top_logprobs"].append({self._token_text(t): lp for t, lp in out.top_logprobs or []})
        acc["text_offset"].append(offset)

    # ---- non-streaming --------------------------------------------------------------------------
    async def collect(self) -> dict[str, Any]:
        text: dict[int, str] = {i: "" for i in range(self.total)}
        lps: dict[int, Any] = {}
        try:
            async for index, out in self.outputs():
                if self.p.logprobs is not None:
                    if self.p.chat:
                        lps.setdefault(index, {"content": []})["content"].append(self._chat_logprob(out))
                    else:
                        acc = lps.setdefault(index, {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                     "text_offset": []})
                        self._add_completion_logprob(acc, out, len(text[index]))
                text[index] += out.text
        except APIError:
            raise
        except Exception as e:
            raise APIError(500, f"the request failed: {type(e).__name__}: {e}") from None
        if self.p.echo:
            text, lps = self._echo(text, lps)
        choices = []
        for i in range(self.total):
            c: dict[str, Any] = {"index": i, "logprobs": lps.get(i), "finish_reason": self.finished.get(i)}
            if self.p.chat:
                c["message"] = {"role": "assistant", "content": text[i]}
                calls = self._tool_calls(i, text[i])
                if calls is not None:
                    c["message"]["content"], c["message"]["tool_calls"] = calls
                    c["finish_reason"] = "tool_calls"
            else:
                c["text"] = text[i]
            choices.append(c)
        return {"id": self.id, "object": "chat.completion" if self.p.chat else "text_completion",
                "created": self.created, "model": self.name, "choices": choices, "usage": self.usage}

    def _echo(self, text: dict[int, str], lps: dict[int, Any]) -> tuple[dict[int, str], dict[int, Any]]:
        """The prompt before each choice's completion (OpenAI's echo); with logprobs, its tokens first, the first
        one's logprob null (nothing predicts it), as lm-eval's local-completions reads them. max_tokens 0: the
        prompt alone, finish_reason "length"."""
        assert self.p.prompt_texts is not None
        out_text, out_lps = {}, {}
        for i in range(self.total):
            prompt_index = i // self.n
            req = self.group.requests[prompt_index]
            gen_text = "" if self.p.echo_only else text[i]
            out_text[i] = self.p.prompt_texts[prompt_index] + gen_text
            if self.p.echo_only:
                self.finished[i] = "length"
            if self.p.logprobs is None:
                continue
            ids = self.p.prompts[prompt_index]
            acc: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            offset = 0
            scored = req.prompt_logprobs or []
            tops = req.prompt_top_logprobs
            for j, tid in enumerate(ids):
                acc["tokens"].append(self._token_text(tid))
                acc["token_logprobs"].append(None if j == 0 else scored[j - 1])
                acc["top_logprobs"].append(None if j == 0 else {self._token_text(t): lp for t, lp in tops[j - 1]}
                                           if tops else {})
                acc["text_offset"].append(offset)
                offset += len(self.model.tokenizer.decode([tid]) if self.model.tokenizer else "")
            if not self.p.echo_only and i in lps:
                gen = lps[i]
                for key in ("tokens", "token_logprobs", "top_logprobs"):
                    acc[key].extend(gen[key])
                acc["text_offset"].extend(len(self.p.prompt_texts[prompt_index]) + o for o in gen["text_offset"])
            out_lps[i] = acc
        return out_text, out_lps

    def _tool_calls(self, index: int, text: str) -> tuple[str | None, list[dict[str, Any]]] | None:
        """(the content left, OpenAI's tool_calls) when a finished reply of a request with tools holds calls."""
        if self.p.tool_names is None or self.finished.get(index) != "stop":
            return None
        rest, calls = parse_tool_calls(text, self.p.tool_names)
        return (rest, [c.as_openai() for c in calls]) if calls else None

    # ---- streaming ------------------------------------------------------------------------------
    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        body: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if self.p.chat else "text_completion",
                                "created": self.created, "model": self.name, "choices": choices}
        if self.p.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _stream_event(self, index: int, out: TokenOutput, offsets: dict[int, int]) -> str:
        """The token's chunk; a last token's finish_reason follows in a chunk of its own with an empty delta, as
        OpenAI and llama-server send it (a client that stops reading at finish_reason keeps the last token)."""
        lp = None
        if self.p.logprobs is not None:
            if self.p.chat:
                lp = {"content": [self._chat_logprob(out)]}
            else:
                lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                self._add_completion_logprob(lp, out, offsets.get(index, 0))
        offsets[index] = offsets.get(index, 0) + len(out.text)
        events = []
        if out.text or lp is not None:
            events.append(self._chunk([self._choice(index, out.text, lp, None)]))
        if out.finish_reason is not None:
            events.append(self._chunk([self._choice(index, "", None, out.finish_reason)]))
        return "".join(events)

    def _held_reply(self, index: int, text: str, finish_reason: str) -> str:
        """A held reply's chunks: its tool calls as one delta (OpenAI's shape, each call with its index, id, name
        and whole arguments) or its text; then the finish chunk."""
        calls = self._tool_calls(index, text)
        if calls is None:
            delta: dict[str, Any] = {"content": text} if text else {}
        else:
            rest, tool_calls = calls
            delta = {"content": rest} if rest else {}
            delta["tool_calls"] = [dict(c, index=k) for k, c in enumerate(tool_calls)]
            finish_reason = "tool_calls"
        events = []
        if delta:
            events.append(self._chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]))
        events.append(self._chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}]))
        return "".join(events)

    def _choice(self, index: int, text: str, lp: Any, finish_reason: str | None) -> dict[str, Any]:
        c: dict[str, Any] = {"index": index, "logprobs": lp, "finish_reason": finish_reason}
        if self.p.chat:
            c["delta"] = {"content": text} if text else {}
        else:
            c["text"] = text
        return c

    async def sse(self) -> AsyncIterator[str]:
        """data: chunks, an error event if the request fails, a usage chunk if asked, then data: [DONE]. A client
        that leaves cancels this generator: `finally` aborts its requests (their rows are freed at the next step)."""
        try:
            if self.p.chat:
                for i in range(self.total):
                    yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}])
            offsets: dict[int, int] = {}
            pending: list[str] = []  # the events of one engine step go out in one write
            held: dict[int, str] = {}  # with tools, each reply is held until it ends: it may be a call
            try:
                async for index, out in self.outputs():
                    if self.p.tool_names is not None:
                        held[index] = held.get(index, "") + out.text
                        if out.finish_reason is not None:
                            pending.append(self._held_reply(index, held.pop(index), out.finish_reason))
                    # nothing to show for a pending multi-byte character or possible stop string (unless logprobs)
                    elif out.text or out.finish_reason is not None or self.p.logprobs is not None:
                        pending.append(self._stream_event(index, out, offsets))
                    if pending and self.group.queue.empty():
                        yield "".join(pending)
                        pending = []
            except Exception as e:
                err = APIError(500, f"the request failed: {type(e).__name__}: {e}")
                pending.append(f"data: {json.dumps(err.body())}\n\n")
            else:
                if self.p.include_usage:
                    pending.append(self._chunk([], self.usage))
            yield "".join(pending) + "data: [DONE]\n\n"
        finally:
            self.group.abort()
