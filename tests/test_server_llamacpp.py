"""llama.cpp's server tests (ggml-org/llama.cpp, tools/server/tests/unit/) ported to bmc-serve's OpenAI routes,
rewritten in this suite's style: greedy and seeded outputs are compared with bmc.generate() alone where llama.cpp
matches regexes over a trained model's text. Ported, llama.cpp file: its tests -> ours:
- test_basic: test_server_start_simple, test_server_models, test_server_model_aliases_and_tags; test_security:
  test_access_public_endpoint -> test_health_models_and_aliases (unlike llama-server, /v1/models needs the key
  and an unknown model name is a 404)
- test_completion: test_completion, test_completion_stream, test_completion_with_openai_library,
  test_completion_stream_with_openai_library, test_consistent_result_different_batch_size (61-token prompt in
  32-token prefill chunks) -> test_completion_equals_generate; test_completion_stream_vs_non_stream,
  test_consistent_result_same_seed, test_different_result_different_seed, test_cache_vs_nocache_prompt
  -> test_seeds; test_completion_with_tokens_input -> test_token_id_prompts; test_completion_parallel_slots
  -> test_parallel_requests_equal_generate_alone; test_n_probs, test_n_probs_stream -> test_completion_logprobs;
  test_cancel_request -> test_client_leaving_stops_a_non_streamed_request; test_completion_stream_with_openai_
  library_stops -> test_stop_strings; test_nocache_long_input_prompt -> test_beyond_the_context
- test_ctx_shift: test_ctx_shift_disabled_long_prompt -> test_beyond_the_context; test_ctx_shift_disabled_short_
  prompt (n_predict -1), test_ctx_shift_disabled_stream -> test_chat_without_max_tokens_runs_to_the_context_end
- test_chat_completion: test_chat_completion, test_chat_completion_with_openai_library, test_chat_completions_
  multiple_choices -> test_chat_equals_generate; test_chat_completion_stream -> test_chat_stream_chunks;
  test_logprobs, test_logprobs_stream -> test_chat_logprobs; test_context_size_exceeded(_stream)
  -> test_beyond_the_context; test_invalid_chat_completion_req (less user/assistant/assistant: the template's call),
  test_completion_with_response_format, test_completion_with_json_schema, test_completion_with_grammar
  -> test_constrained_output (their invalid formats and n_predict -> test_bad_requests_get_a_400_naming_the_field);
  test_logit_bias -> test_logit_bias; penalties (fields bmc supports) -> test_penalties_as_generate_gives_them
- test_ignore_eos -> test_ignore_eos; min_p (a llama-server field bmc supports, no test of its own) -> test_min_p
- test_security: test_incorrect_api_key, test_correct_api_key -> test_api_key (test_openai_library_correct_api_key:
  every openai-client test here); test_cors_options -> test_cors_preflight
test_tokenize -> test_tokenize_and_detokenize (vLLM's and llama-server's fields); echo with prompt logprobs (lm-eval's
  local-completions) -> test_echo_scores_the_prompt_as_the_reference_does.
Not ported (llama-server-only: bmc has no such route or field): /props,
/slots, /infill, /embedding, /rerank, lora, /apply-template and __verbose
prompts, assistant prefill, return_progress, timings, response_fields, n_probs/post_sampling_probs/return_tokens,
test_metrics (cache_n timings, llamacpp: metric names), context shift (bmc refuses), the web UI, X-Api-Key
(Anthropic's header), media paths, host families, split-GGUF downloads, router and stream-resume tests.

Ported and passing: 18 tests (48 of their 49 cases); failing on a server deviation: test_beyond_the_context[messages]
(a chat prompt beyond the context names param "prompt", not "messages"); not applicable: the list above
(llama-server endpoints and fields that bmc does not serve).
"""
from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import pytest

import bmc

from .conftest import make_llama, transformers  # noqa: F401
from .serving import ServerProcess

openai = pytest.importorskip("openai", reason="the server tests drive bmc-serve with the openai client")

KEY = "sk-this-is-the-secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CTX = 2048
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MEANING = "I believe the meaning of life is"
LONG_PROMPT = "Write a joke about AI from a very long prompt which will not be truncated"  # 61 tokens: 2 chunks
BOOK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return bmc.load(str(make_llama(tmp_path_factory.mktemp("llama-llamacpp"), "gqa", max_pos=CTX)))


@pytest.fixture(scope="module")
def server(model):
    srv = ServerProcess(["--model", str(model.path), "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
                         "--api-key", KEY, "--served-model-name", "tiny", "gpt-3.5-turbo",
                         "--allowed-origins", "http://localhost:3000"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=120, max_retries=0)


def post(server, path: str, body, headers=AUTH, timeout=60) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=timeout)


def sse(server, path: str, body) -> list[str]:  # the `data:` payloads, [DONE] included
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def chat_want(model, messages, n: int | None, **kw):
    """generate() on the chat template's rendering, as the server renders it (n None: to the context's end); and
    the prompt's token count."""
    text = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    n_prompt = len(model.tokenizer.encode(text))
    return bmc.generate(model, [text], max_new_tokens=n or CTX - n_prompt, **kw)[0], n_prompt


def openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    assert (err["code"] is None or isinstance(err["code"], str)) and (param is None or err["param"] == param), err
    return err


# ---- test_basic.py ------------------------------------------------------------------------------------------------
def test_health_models_and_aliases(server, client):
    r = httpx.get(server.url + "/health", timeout=10)  # open without the key
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert [(m.id, m.object) for m in client.models.list().data] == [("tiny", "model"), ("gpt-3.5-turbo", "model")]
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    for name in ("tiny", "gpt-3.5-turbo"):
        assert client.completions.create(model=name, prompt=MEANING, max_tokens=2, temperature=0).model == name
    openai_error(post(server, COMPLETIONS, {"model": "davinci-002", "prompt": MEANING}), 404, "model")


# ---- test_completion.py -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("prompt, n", [(MEANING, 8), (LONG_PROMPT, 64)], ids=["short", "chunked-prefill"])
def test_completion_equals_generate(client, model, prompt, n, stream):
    want = bmc.generate(model, [prompt], max_new_tokens=n)[0]
    kw = dict(model="tiny", prompt=prompt, max_tokens=n, temperature=0)
    if stream:
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        body, usage = [c for c in chunks if c.choices], chunks[-1].usage
        text, finish = "".join(c.choices[0].text for c in body), body[-1].choices[0].finish_reason
        assert all(c.choices[0].finish_reason is None for c in body[:-1]) and body[-1].choices[0].text == ""
        assert len({c.id for c in chunks}) == 1 and chunks[-1].choices == []
    else:
        r = client.completions.create(**kw)
        text, finish, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
        assert r.id.startswith("cmpl") and r.object == "text_completion"
    assert (text, finish) == (want.text, want.finish_reason)
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(model.tokenizer.encode(prompt)), len(want.token_ids))


def test_seeds(client, model):
    """Temperature 1, seed 42: requests one after the other (cache_prompt on and off: a hint with no effect on the
    tokens; streamed and not) and four side by side all give generate()'s text; seeds 0-3 give four others."""
    def one(seed=42, cache_prompt=None, stream=False) -> str:
        extra = {"ignore_eos": True} if cache_prompt is None else {"ignore_eos": True, "cache_prompt": cache_prompt}
        r = client.completions.create(model="tiny", prompt=MEANING, max_tokens=16, temperature=1.0, seed=seed,
                                      stream=stream, extra_body=extra)
        return "".join(c.choices[0].text for c in r) if stream else r.choices[0].text

    def want(seed: int) -> str:
        return bmc.generate(model, [MEANING], max_new_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)[0].text

    alone = [one(), one(cache_prompt=True), one(cache_prompt=False), one(stream=True)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(one, [42] * 4, timeout=120))
    assert alone + together == [want(42)] * 8
    others = [one(seed) for seed in range(4)]
    assert others == [want(seed) for seed in range(4)] and len(set(others + [want(42)])) == 5


def test_token_id_prompts(server, client, model):
    ids = model.tokenizer.encode(MEANING)
    want = bmc.generate(model, [MEANING], max_new_tokens=8)[0].text
    assert client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0).choices[0].text == want
    r = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=8, temperature=0)
    assert [(c.index, c.text) for c in r.choices] == [(0, want), (1, want)]
    # llama-server also takes strings mixed with ids; OpenAI's schema does not, and bmc refuses them
    for mixed in ([ids, MEANING], [1, 2, MEANING, 3]):
        openai_error(post(server, COMPLETIONS, {"prompt": mixed, "max_tokens": 2}), 400, "prompt")


@pytest.mark.parametrize("n_requests", [3, 6], ids=["fewer-than-seqs", "more-than-seqs"])
def test_parallel_requests_equal_generate_alone(server, client, model, n_requests):
    prompts = ["Write a very long book.", "Write another a poem.", "What is LLM?", "The sky is blue and I love it.",
               "Write another very long music lyrics.", "Write a very long joke."][:n_requests]
    with concurrent.futures.ThreadPoolExecutor(n_requests) as pool:
        got = list(pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=1.0,
                                                                seed=42).choices[0].text, prompts, timeout=120))
    assert got == [bmc.generate(model, [p], max_new_tokens=24, temperature=1.0, seed=42)[0].text for p in prompts]
    assert server.wait_metric("bmc:num_requests_running", 0) == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_logprobs(server, model, stream):
    body = {"prompt": MEANING, "logprobs": 10, "temperature": 0, "max_tokens": 5, "ignore_eos": True}
    if stream:
        events = sse(server, COMPLETIONS, body)
        parts = [json.loads(e)["choices"][0]["logprobs"] for e in events[:-1]]
        assert events[-1] == "[DONE]" and parts[-1] is None  # the finish chunk carries none
        assert len(parts) == 6 and all(len(p["tokens"]) == 1 for p in parts[:-1])
        lp = {k: sum((p[k] for p in parts[:-1]), []) for k in ("tokens", "token_logprobs", "top_logprobs")}
    else:
        lp = post(server, COMPLETIONS, body).json()["choices"][0]["logprobs"]
    want = bmc.generate(model, [MEANING], max_new_tokens=5, ignore_eos=True)[0]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert lp["tokens"] == [model.tokenizer.logprob_text(t) for t in want.token_ids]
    assert any(t.startswith("bytes:") for t in lp["tokens"]), "this prompt makes a token of part of a character"
    for token, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        # keyed by text, a partial character's token by its bytes: never two tokens under one key, so all 10
        assert chosen <= 0 and len(top) == 10 and token in top and max(top.values()) <= chosen + 1e-5


def test_client_leaving_stops_a_non_streamed_request(server):
    """The client gives up on a ~2000-token request once it runs: its row is freed and the engine stops stepping
    for it (steps are counted by the engine thread, so a request left running would add ~2000)."""
    steps, n = server.metric("bmc:engine_step_seconds_count"), CTX - 64
    server.abandon_request(COMPLETIONS, {"prompt": MEANING, "max_tokens": n, "temperature": 0, "ignore_eos": True},
                           KEY)
    assert server.wait_metric("bmc:num_requests_running", 0) == 0
    assert server.wait_metric("bmc:kv_cache_usage_bytes", 0) == 0
    assert server.metric("bmc:engine_step_seconds_count") - steps < n - 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_strings(client, model, stream):
    full = bmc.generate(model, [MEANING], max_new_tokens=40)[0].text
    # a 3-character stop string first seen after the start of the text
    i = next(i for i in range(1, len(full) - 3) if full.index(full[i:i + 3]) == i and "\ufffd" not in full[i:i + 3])
    stop = [full[i:i + 3], "Assistant:\n"]
    want = bmc.generate(model, [MEANING], max_new_tokens=40, stop=stop)[0]
    assert (want.text, want.finish_reason) == (full[:i], "stop")
    r = client.completions.create(model="tiny", prompt=MEANING, max_tokens=40, temperature=0, stop=stop, stream=stream)
    choices = [c.choices[0] for c in r] if stream else r.choices
    assert ("".join(c.text for c in choices), choices[-1].finish_reason) == (want.text, "stop")


@pytest.mark.parametrize("path, body, field", [(COMPLETIONS, {"prompt": MEANING * 80}, "prompt"),
                                               (CHAT, {"messages": BOOK * 100}, "messages"),
                                               (COMPLETIONS, {"prompt": MEANING, "max_tokens": CTX}, "max_tokens")],
                         ids=["prompt", "messages", "max_tokens"])
def test_beyond_the_context(server, path, body, field):
    """A prompt longer than the context, streamed or not: a 400 before any token, naming the field at fault (for
    chat `messages`, as OpenAI names it); so is max_tokens beyond the room the prompt leaves."""
    for stream in (False, True):
        err = openai_error(post(server, path, {**body, "stream": stream}), 400)
        assert "context" in err["message"] and err["type"] == "invalid_request_error" and err["param"] == field, err


def test_chat_without_max_tokens_runs_to_the_context_end(client, model):
    """No max_tokens on chat: generation runs until the context is full (a long prompt leaves ~40 tokens of room)."""
    def n_tokens(reps: int) -> int:
        tok = model.tokenizer
        return len(tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi how are you " * reps}])))

    reps = (CTX - 40 - n_tokens(0)) // (n_tokens(2) - n_tokens(1))
    messages = [{"role": "user", "content": "Hi how are you " * reps}]
    text, finish, usage = "", None, None
    for chunk in client.chat.completions.create(model="tiny", messages=messages, temperature=0, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            text, finish = text + (c.delta.content or ""), c.finish_reason or finish
    want, n_prompt = chat_want(model, messages, None, ignore_eos=True)
    assert (finish, usage.prompt_tokens, usage.completion_tokens) == ("length", n_prompt, CTX - n_prompt)
    assert text == want.text and len(want.token_ids) == CTX - n_prompt


# ---- test_chat_completion.py --------------------------------------------------------------------------------------
TURNS = BOOK + [{"role": "assistant", "content": "Timmy"}, {"role": "user", "content": "Why?"}]
PARTS = [BOOK[0], {"role": "user", "content": [{"type": "text", "text": "What is"},
                                               {"type": "text", "text": " the best book"}]}]


@pytest.mark.parametrize("messages, flat, n, sampling", [
    (BOOK, BOOK, 1, {"temperature": 0}), (TURNS, TURNS, 1, {"temperature": 0}), (PARTS, BOOK, 1, {"temperature": 0}),
    (BOOK, BOOK, 1, {"temperature": 0.8, "seed": 42}), (BOOK, BOOK, 2, {"temperature": 0})],
    ids=["system-user", "turns", "text-parts", "seeded", "n2"])
def test_chat_equals_generate(client, model, messages, flat, n, sampling):
    want, n_prompt = chat_want(model, flat, 8, **sampling)
    r = client.chat.completions.create(model="gpt-3.5-turbo", messages=messages, max_tokens=8, n=n, **sampling)
    assert "cmpl" in r.id and r.model == "gpt-3.5-turbo" and r.object == "chat.completion"
    assert [(c.index, c.message.role, c.message.content, c.finish_reason) for c in r.choices] == [
        (i, "assistant", want.text, want.finish_reason) for i in range(n)]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, n * len(want.token_ids))


def test_chat_stream_chunks(server, model):
    want, n_prompt = chat_want(model, BOOK, 8)
    events = sse(server, CHAT, {"model": "gpt-3.5-turbo", "messages": BOOK, "max_tokens": 8, "temperature": 0,
                                "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl")
    assert all(c["model"] == "gpt-3.5-turbo" and c["object"] == "chat.completion.chunk" for c in chunks)
    first, *middle, finish, usage = chunks
    assert first["choices"][0]["delta"]["role"] == "assistant" and not first["choices"][0]["delta"].get("content")
    assert all("role" not in c["choices"][0]["delta"] and c["choices"][0]["finish_reason"] is None for c in middle)
    assert "".join(c["choices"][0]["delta"]["content"] for c in middle) == want.text
    assert finish["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": want.finish_reason}]
    n, got = len(want.token_ids), usage["usage"]
    assert usage["choices"] == [] and (got["prompt_tokens"], got["completion_tokens"], got["total_tokens"]) == (
        n_prompt, n, n_prompt + n)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_logprobs(client, model, stream):
    r = client.chat.completions.create(model="tiny", messages=BOOK, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=10, stream=stream, extra_body={"ignore_eos": True})
    if stream:
        chunks = [c.choices[0] for c in r]
        assert chunks[0].delta.role == "assistant" and all(c.delta.role is None for c in chunks[1:])
        tokens = [c.logprobs.content for c in chunks[1:] if c.finish_reason is None]
        assert all(len(t) == 1 for t in tokens)
        entries, text = [t[0] for t in tokens], "".join(c.delta.content or "" for c in chunks)
    else:
        entries, text = r.choices[0].logprobs.content, r.choices[0].message.content
    assert text == chat_want(model, BOOK, 5, ignore_eos=True)[0].text
    assert len(entries) == 5 and "".join(e.token for e in entries) == text
    for e in entries:
        assert e.logprob <= 0 and e.bytes and all(0 <= b < 256 for b in e.bytes) and len(e.top_logprobs) == 10
        assert abs(e.top_logprobs[0].logprob - e.logprob) < 1e-5  # greedy: the chosen token is the most likely


# test_invalid_chat_completion_req's messages, then llama-server's own fields and the response formats bmc lacks
BAD_REQUESTS = [(CHAT, {"messages": m}, "messages") for m in (
    None, "string", [123], [{}], [{"role": 123}], [{"role": "system", "content": 123}],
    [{"role": "system", "content": "test"}, {}])] + [
    (COMPLETIONS, {"n_predict": 8}, "n_predict"),
    (CHAT, {"response_format": {"type": "sound"}}, "response_format"),
    (CHAT, {"response_format": {"type": "json_object", "schema": 123}}, "response_format"),
    (CHAT, {"response_format": {"type": "json_object", "schema": {"type": 123}}}, "response_format"),
    (CHAT, {"response_format": {"type": "json_basdasd"}}, "response_format"),
    (CHAT, {"response_format": {"type": "json_schema"}}, "response_format"),
    (COMPLETIONS, {"grammar": "root ::= ("}, "grammar"), (COMPLETIONS, {"regex": "a(b"}, "regex"),
    (CHAT, {"json_schema": {"const": "42"}, "regex": "4+"}, "regex"),
    (CHAT, {"logit_bias": {"hello": -100}}, "logit_bias"), (CHAT, {"presence_penalty": -3}, "presence_penalty")]


@pytest.mark.parametrize("path, extra, field", BAD_REQUESTS, ids=[f"{r[2]}-{i}" for i, r in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_a_400_naming_the_field(server, path, extra, field):
    base = {"messages": BOOK} if path == CHAT else {"prompt": MEANING}
    assert field in openai_error(post(server, path, {**base, "max_tokens": 4, **extra}), 400, field)["message"]


# ---- test_ignore_eos.py; min_p ------------------------------------------------------------------------------------
def test_ignore_eos(client, model):
    prompt = "hello world, hello"
    for ignore_eos, finish in ((False, "stop"), (True, "length")):  # the tiny model ends this prompt early
        want = bmc.generate(model, [prompt], max_new_tokens=32, ignore_eos=ignore_eos)[0]
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0,
                                      extra_body={"ignore_eos": ignore_eos})
        assert (r.choices[0].text, r.choices[0].finish_reason) == (want.text, want.finish_reason) == (want.text, finish)
        assert r.usage.completion_tokens == len(want.token_ids) and (len(want.token_ids) == 32) == ignore_eos


def test_min_p(client, model):
    kw = dict(max_new_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    want = bmc.generate(model, [MEANING], min_p=0.5, **kw)[0].text
    assert want != bmc.generate(model, [MEANING], **kw)[0].text  # min_p changes this sample
    r = client.completions.create(model="tiny", prompt=MEANING, max_tokens=12, temperature=1.0, seed=7,
                                  extra_body={"min_p": 0.5, "ignore_eos": True})
    assert r.choices[0].text == want


# ---- test_chat_completion.py's response_format, json_schema and grammar tests ---------------------------------------
@pytest.mark.parametrize("path, extra, want", [
    (CHAT, {"response_format": {"type": "json_object", "schema": {"const": "42"}}}, '"42"'),
    (CHAT, {"response_format": {"type": "json_object", "schema": {"type": "array", "maxItems": 2, "items": {
        "type": "integer", "minimum": -9, "maximum": 9}}}}, None),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"schema": {"const": "foooooo"}}}},
     '"foooooo"'),
    (CHAT, {"json_schema": {"const": "42"}}, '"42"'), (COMPLETIONS, {"json_schema": {"const": "42"}}, '"42"'),
    (CHAT, {"grammar": 'root ::= "a"{5,5}'}, "aaaaa"), (COMPLETIONS, {"grammar": 'root ::= "a"{5,5}'}, "aaaaa"),
    (COMPLETIONS, {"regex": "[0-9]{2}-x"}, None)])
def test_constrained_output(server, model, path, extra, want):
    base = {"messages": BOOK} if path == CHAT else {"prompt": MEANING}
    r = post(server, path, {**base, "max_tokens": 12, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if path == CHAT else choice["text"]
    if want is not None:
        assert text == want and choice["finish_reason"] == "stop"
    elif "regex" in extra:
        assert re.fullmatch(extra["regex"], text)
    else:  # at most two small integers: it always completes
        value = json.loads(text)
        assert isinstance(value, list) and len(value) <= 2 and all(-9 <= v <= 9 for v in value)


def test_json_schema_streams_deltas_that_join_into_valid_json(client):
    schema = {"type": "object", "properties": {"k": {"type": "string", "enum": ["x", "yy"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["k", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "kn", "schema": schema, "strict": True}}
    chunks = client.chat.completions.create(model="tiny", messages=BOOK, max_tokens=40, temperature=0, stream=True,
                                            response_format=fmt)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model="tiny", messages=BOOK, max_tokens=40, temperature=0,
                                           response_format=fmt)
    assert text == whole.choices[0].message.content
    value = json.loads(text)
    assert value["k"] in ("x", "yy") and 0 <= value["n"] <= 9 and set(value) == {"k", "n"}


# ---- echo with prompt logprobs (lm-eval's local-completions); test_tokenize.py ------------------------------------
def test_echo_scores_the_prompt_as_the_reference_does(server, model):
    """echo + logprobs + max_tokens 0, as lm-eval's loglikelihood requests send it: the prompt comes back with
    each token's logprob (the first null) within 1e-4 of HF's log-softmax, its top alternatives, and nothing
    generated; with max_tokens 3 the completion follows the prompt."""
    import torch

    from .conftest import hf

    ids = model.tokenizer.encode(MEANING)
    with torch.inference_mode():
        ref = torch.log_softmax(hf(model.path)(torch.tensor([ids])).logits[0].float(), dim=-1)
    r = post(server, COMPLETIONS, {"prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    choice, usage = body["choices"][0], body["usage"]
    assert choice["text"] == model.tokenizer.decode(ids) and choice["finish_reason"] == "length"
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(ids)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # and the server's own OpenAPI document allows those nulls (Schemathesis's ST108 found it did not)
    import jsonschema

    spec = httpx.get(server.url + "/openapi.json", timeout=10).json()
    jsonschema.validate(body, {"$ref": "#/components/schemas/CompletionResponse", "components": spec["components"]})
    for j in range(1, len(ids)):
        assert abs(lp["token_logprobs"][j] - float(ref[j - 1, ids[j]])) < 1e-4, j
        top = lp["top_logprobs"][j]
        assert len(top) == 2 and abs(max(top.values()) - float(ref[j - 1].max())) < 1e-4
    want = bmc.generate(model, [MEANING], max_new_tokens=3, ignore_eos=True)[0]
    r = post(server, COMPLETIONS, {"prompt": MEANING, "echo": True, "max_tokens": 3, "logprobs": 1, "temperature": 0,
                                   "ignore_eos": True})
    choice = r.json()["choices"][0]
    assert choice["text"] == MEANING + want.text and len(choice["logprobs"]["tokens"]) == len(ids) + 3
    assert choice["logprobs"]["token_logprobs"][1:len(ids)] == lp["token_logprobs"][1:]


@pytest.mark.parametrize("extra, field", [({"max_tokens": 0}, "max_tokens"), ({"echo": True, "stream": True}, "echo")])
def test_echo_misuse_is_refused(server, extra, field):
    assert field in openai_error(post(server, COMPLETIONS, {"prompt": MEANING, **extra}), 400, field)["message"]


def test_tokenize_and_detokenize(server, model):
    tok = model.tokenizer
    for body in ({"prompt": MEANING}, {"content": MEANING}, {"prompt": MEANING, "add_special_tokens": False}):
        r = post(server, "/tokenize", body)
        assert r.status_code == 200, r.text
        want = tok.encode(MEANING, add_special_tokens=body.get("add_special_tokens", True))
        assert r.json()["tokens"] == want and r.json()["count"] == len(want) and r.json()["max_model_len"] == CTX
    r = post(server, "/tokenize", {"messages": BOOK})
    assert r.json()["tokens"] == tok.encode(tok.apply_chat_template(BOOK, add_generation_prompt=True))
    r = post(server, "/detokenize", {"tokens": tok.encode(MEANING, add_special_tokens=False)})
    assert r.json()["prompt"] == r.json()["content"] == MEANING
    assert "tokens" in openai_error(post(server, "/detokenize", {"tokens": [10**6]}), 400, "tokens")["message"]
    assert openai_error(post(server, "/tokenize", {"prompt": "a", "content": "b"}), 400)["message"]
    assert post(server, "/tokenize", {"prompt": "a"}, headers={}).status_code == 401


# ---- test_tool_call.py: tools, tool_choice, a two-step loop -------------------------------------------------------
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 10}}}}}


@pytest.mark.parametrize("stream, choice", [(False, "required"),
                                           (True, {"type": "function", "function": {"name": "get_weather"}})],
                         ids=["required", "named-streamed"])
def test_a_forced_tool_call_and_its_answer(client, stream, choice):
    """tool_choice required (or the function by name): the reply is a call whose arguments parse and validate,
    finish_reason tool_calls, streamed as OpenAI streams it; the call and the tool's result sent back render and
    get an answer."""
    import jsonschema

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL], tool_choice=choice,
                                       max_tokens=150, temperature=0, stream=stream)
    if stream:
        chunks = list(r)
        deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(deltas) == 1 and finish == ["tool_calls"]
        call = deltas[0].tool_calls[0]
        assert call.index == 0
    else:
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        call = r.choices[0].message.tool_calls[0]
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER_TOOL["function"]["parameters"])
    messages += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    final = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL], tool_choice="none",
                                           max_tokens=8, temperature=0)
    assert final.choices[0].message.tool_calls is None and isinstance(final.choices[0].message.content, str)


def test_tools_render_into_the_prompt_and_auto_replies_stay_text_when_no_call_parses(server, model):
    """With tools (auto) the prompt carries them (more prompt tokens than without); the tiny model's reply holds no
    call, so it comes back as text with finish_reason stop, streamed or not, and equal to generate() on the same
    rendering."""
    from bmc.tools import render_messages

    base = {"messages": BOOK, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    plain = post(server, CHAT, base).json()
    with_tools = post(server, CHAT, {**base, "tools": [WEATHER_TOOL]}).json()
    assert with_tools["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    rendered, _ = render_messages([dict(m) for m in BOOK], [WEATHER_TOOL], template_has_tools=False)
    want = bmc.generate(model, [model.tokenizer.apply_chat_template(rendered, add_generation_prompt=True)],
                        max_new_tokens=8, ignore_eos=True)[0].text
    choice = with_tools["choices"][0]
    assert choice["message"]["content"] == want and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "length"


@pytest.mark.parametrize("extra, field", [
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"messages": [{"role": "tool", "tool_call_id": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages"),
    ({"functions": [{"name": "f"}]}, "functions")])
def test_bad_tool_requests_get_a_400_naming_the_field(server, extra, field):
    r = post(server, CHAT, {"messages": BOOK, "max_tokens": 4, **extra})
    assert field in openai_error(r, 400)["message"] + str(r.json()["error"].get("param")), r.text


# ---- test_completion.py's test_logit_bias; penalties -----------------------------------------------------------------
def test_logit_bias(client, model):
    """-100 bans the tokens greedy decoding would take (none of them comes back), as llama-server's test does; the
    answer is generate()'s with the same bias."""
    plain = bmc.generate(model, [MEANING], max_new_tokens=8, ignore_eos=True)[0].token_ids
    bias = {t: -100.0 for t in plain[:4]}
    want = bmc.generate(model, [MEANING], max_new_tokens=8, ignore_eos=True, logit_bias=bias)[0]
    r = client.completions.create(model="tiny", prompt=MEANING, max_tokens=8, temperature=0, logprobs=0,
                                  logit_bias={str(t): b for t, b in bias.items()}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.text and not set(want.token_ids) & set(bias)


@pytest.mark.parametrize("stream", [False, True])
def test_penalties_as_generate_gives_them(client, model, stream):
    kw = dict(presence_penalty=0.6, frequency_penalty=0.5, repetition_penalty=1.2)
    want = chat_want(model, BOOK, 16, ignore_eos=True, **kw)[0].text
    assert want != chat_want(model, BOOK, 16, ignore_eos=True)[0].text
    r = client.chat.completions.create(model="tiny", messages=BOOK, max_tokens=16, temperature=0, stream=stream,
                                       presence_penalty=0.6, frequency_penalty=0.5,
                                       extra_body={"repetition_penalty": 1.2, "ignore_eos": True})
    text = "".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream else r.choices[0].message.content
    assert text == want


# ---- test_security.py ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("authorization, status", [(None, 401), ("Bearer invalid-key", 401), (f"Basic {KEY}", 401),
                                                   (f"Bearer {KEY}", 200), (f"bearer {KEY}", 200)])
def test_api_key(server, model, authorization, status):
    headers = {} if authorization is None else {"Authorization": authorization}
    r = post(server, COMPLETIONS, {"prompt": MEANING, "max_tokens": 4, "temperature": 0}, headers=headers)
    if status == 401:
        assert openai_error(r, 401)["type"] == "authentication_error"
    else:
        assert r.status_code == 200 and "error" not in r.json()
        assert r.json()["choices"][0]["text"] == bmc.generate(model, [MEANING], max_new_tokens=4)[0].text


@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://web.mydomain.fr"])  # only the first is allowed
def test_cors_preflight(server, origin):
    r = httpx.options(server.url + COMPLETIONS, timeout=10, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"})
    allowed = (r.headers.get("access-control-allow-origin"), r.headers.get("access-control-allow-methods", ""),
               r.headers.get("access-control-allow-headers", "").lower())
    if origin == "http://localhost:3000":
        assert r.status_code == 200 and allowed[0] == origin and "POST" in allowed[1] and "authorization" in allowed[2]
    else:
        assert allowed[0] is None
