"""llama.cpp's own server tests (ggml-org/llama.cpp, tools/server/tests/unit/) ported to bmc-serve's OpenAI routes:
the behaviour each checks, rewritten in this suite's style against a real bmc-serve process, greedy and seeded
outputs compared with bmc.generate() alone instead of llama.cpp's regexes over a trained model's text.

Ported (llama.cpp file::test -> ours):
- test_basic.py::test_server_start_simple, test_server_models, test_server_model_aliases_and_tags;
  test_security.py::test_access_public_endpoint -> test_health_models_and_aliases (bmc keeps /v1/models behind
  the key, and answers 404 for a model it does not serve where llama-server answers any name)
- test_completion.py::test_completion, test_completion_stream, test_completion_with_openai_library,
  test_completion_stream_with_openai_library, test_consistent_result_different_batch_size (a 61-token prompt
  prefilled in 32-token chunks) -> test_completion_equals_generate
- test_completion.py::test_completion_stream_vs_non_stream -> test_stream_and_non_stream_agree
- test_completion.py::test_consistent_result_same_seed, test_cache_vs_nocache_prompt -> test_same_seed_same_text
- test_completion.py::test_different_result_different_seed -> test_different_seeds_different_text
- test_completion.py::test_completion_with_tokens_input -> test_token_id_prompts
- test_completion.py::test_completion_parallel_slots -> test_parallel_requests_equal_generate_alone
- test_completion.py::test_n_probs, test_n_probs_stream -> test_completion_logprobs
- test_completion.py::test_cancel_request -> test_client_leaving_stops_a_non_streamed_request
- test_completion.py::test_completion_stream_with_openai_library_stops -> test_stop_strings
- test_completion.py::test_nocache_long_input_prompt; test_ctx_shift.py::test_ctx_shift_disabled_long_prompt;
  test_chat_completion.py::test_context_size_exceeded, test_context_size_exceeded_stream -> test_beyond_the_context
- test_ctx_shift.py::test_ctx_shift_disabled_short_prompt (n_predict -1), test_ctx_shift_disabled_stream
  -> test_chat_without_max_tokens_runs_to_the_context_end
- test_chat_completion.py::test_chat_completion, test_chat_completion_with_openai_library -> test_chat_equals_generate
- test_chat_completion.py::test_chat_completion_stream -> test_chat_stream_chunks
- test_chat_completion.py::test_chat_completions_multiple_choices -> test_chat_n_choices
- test_chat_completion.py::test_logprobs, test_logprobs_stream -> test_chat_logprobs
- test_chat_completion.py::test_invalid_chat_completion_req -> test_invalid_messages (not the user/assistant/
  assistant case: whether roles must alternate is the model's chat template's call, and the tiny one allows it)
- test_chat_completion.py::test_completion_with_response_format (its invalid and json cases),
  test_completion_with_json_schema, test_completion_with_grammar, test_logit_bias; test_completion.py::test_logit_bias
  -> test_llama_server_only_fields_are_refused_by_name (bmc implements none of them: a 400 naming the field)
- test_ignore_eos.py -> test_ignore_eos; test_metrics.py's sampling request (top_k, min_p) -> test_min_p
- test_security.py::test_incorrect_api_key, test_correct_api_key, test_openai_library_correct_api_key
  -> test_wrong_or_missing_key, test_correct_key; test_security.py::test_cors_options -> test_cors_preflight

Not ported (llama-server-only, no OpenAI route in bmc): /tokenize, /detokenize (test_tokenize.py), /props and
/slots (test_basic.py::test_server_props, test_server_slots), /infill, /embedding, /rerank, lora, tool calls
(test_tool_call.py, test_small_test.py), grammar/JSON-constrained output, /apply-template and __verbose prompts
(test_chat_template*), assistant prefill, return_progress, timings/timings_per_token, response_fields,
post_sampling_probs, n_probs/return_tokens fields, the prompt cache and its metrics (test_metrics.py, bmc keeps no
prompt cache), context shift (bmc refuses instead), speculative drafts (covered in test_server.py), the web UI and
its assets, the X-Api-Key header (Anthropic's), media paths, IPv4/IPv6 host families, split GGUF downloads, the
router/stream-resume and sleep/idle tests.

Ported and passing: 23 tests (38 cases); not applicable: the above (llama-server endpoints and fields).
"""
from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

import bmc

from .conftest import make_llama, transformers  # noqa: F401
from .serving import ServerProcess

openai = pytest.importorskip("openai", reason="the server tests drive bmc-serve with the openai client")

KEY = "sk-this-is-the-secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CTX = 2048
MEANING = "I believe the meaning of life is"
LONG_PROMPT = "Write a joke about AI from a very long prompt which will not be truncated"  # 61 tokens: 2 chunks
BOOK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("llama-llamacpp"), "gqa", max_pos=CTX)


@pytest.fixture(scope="module")
def model(tiny_dir):
    return bmc.load(str(tiny_dir))


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerProcess(["--model", str(tiny_dir), "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
                         "--api-key", KEY, "--served-model-name", "tiny", "gpt-3.5-turbo",
                         "--allowed-origins", "http://localhost:3000"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=120, max_retries=0)


def post(server, path: str, body, headers=AUTH, timeout=60) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=timeout)


def sse(server, path: str, body) -> list[str]:
    """The `data:` payloads of a streamed request, [DONE] included."""
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def chat_want(model, messages, n: int | None, **kw):
    """generate() on the chat template's rendering, as the server renders it (n None: to the context's end); and
    the prompt's token count."""
    text = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    n_prompt = len(model.tokenizer.encode(text))
    return bmc.generate(model, [text], max_new_tokens=n or CTX - n_prompt, **kw)[0], n_prompt


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    assert err["code"] is None or isinstance(err["code"], str)
    if param is not None:
        assert err["param"] == param, err
    return err


# ---- test_basic.py ------------------------------------------------------------------------------------------------
def test_health_models_and_aliases(server, client):
    r = httpx.get(server.url + "/health", timeout=10)  # open without the key
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert [(m.id, m.object) for m in client.models.list().data] == [("tiny", "model"), ("gpt-3.5-turbo", "model")]
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    for name in ("tiny", "gpt-3.5-turbo"):
        assert client.completions.create(model=name, prompt=MEANING, max_tokens=2, temperature=0).model == name
    assert_openai_error(post(server, "/v1/completions", {"model": "davinci-002", "prompt": MEANING}), 404, "model")


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


def test_stream_and_non_stream_agree(client):
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=42)):
        whole = client.completions.create(model="tiny", prompt=MEANING, max_tokens=8, **kw).choices[0].text
        parts = client.completions.create(model="tiny", prompt=MEANING, max_tokens=8, stream=True, **kw)
        assert "".join(c.choices[0].text for c in parts) == whole, kw


def test_same_seed_same_text(client, model):
    """Seed 42 at temperature 1: four requests one after the other (cache_prompt on and off: a hint with no effect
    on the tokens) and four side by side all give generate()'s text."""
    want = bmc.generate(model, [MEANING], max_new_tokens=16, temperature=1.0, seed=42)[0].text

    def one(cache_prompt) -> str:
        extra = {} if cache_prompt is None else {"cache_prompt": cache_prompt}
        return client.completions.create(model="tiny", prompt=MEANING, max_tokens=16, temperature=1.0, seed=42,
                                         extra_body=extra).choices[0].text

    alone = [one(c) for c in (None, True, False, True)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(one, [None] * 4, timeout=120))
    assert alone + together == [want] * 8


def test_different_seeds_different_text(client, model):
    texts = [client.completions.create(model="tiny", prompt=MEANING, max_tokens=16, temperature=1.0, seed=s,
                                       extra_body={"ignore_eos": True}).choices[0].text for s in range(4)]
    assert len(set(texts)) == 4
    assert texts == [bmc.generate(model, [MEANING], max_new_tokens=16, temperature=1.0, seed=s, ignore_eos=True)[0].text
                     for s in range(4)]


def test_token_id_prompts(server, client, model):
    ids = model.tokenizer.encode(MEANING)
    want = bmc.generate(model, [MEANING], max_new_tokens=8)[0].text
    assert client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0).choices[0].text == want
    r = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=8, temperature=0)
    assert [(c.index, c.text) for c in r.choices] == [(0, want), (1, want)]
    # llama-server also takes strings mixed with ids; OpenAI's schema does not, and bmc refuses them
    for mixed in ([ids, MEANING], [1, 2, MEANING, 3]):
        assert_openai_error(post(server, "/v1/completions", {"prompt": mixed, "max_tokens": 2}), 400, "prompt")


@pytest.mark.parametrize("n_requests", [3, 6], ids=["fewer-than-seqs", "more-than-seqs"])
def test_parallel_requests_equal_generate_alone(server, client, model, n_requests):
    prompts = ["Write a very long book.", "Write another a poem.", "What is LLM?", "The sky is blue and I love it.",
               "Write another very long music lyrics.", "Write a very long joke."][:n_requests]

    def one(prompt: str) -> str:
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=1.0,
                                         seed=42).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(n_requests) as pool:
        got = list(pool.map(one, prompts, timeout=120))
    assert got == [bmc.generate(model, [p], max_new_tokens=24, temperature=1.0, seed=42)[0].text for p in prompts]
    assert server.wait_metric("bmc:num_requests_running", 0) == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_logprobs(server, model, stream):
    body = {"prompt": MEANING, "logprobs": 10, "temperature": 0, "max_tokens": 5, "ignore_eos": True}
    if stream:
        events = sse(server, "/v1/completions", body)
        parts = [json.loads(e)["choices"][0]["logprobs"] for e in events[:-1]]
        assert events[-1] == "[DONE]" and parts[-1] is None  # the finish chunk carries none
        assert len(parts) == 6 and all(len(p["tokens"]) == 1 for p in parts[:-1])
        lp = {k: sum((p[k] for p in parts[:-1]), []) for k in ("tokens", "token_logprobs", "top_logprobs")}
    else:
        lp = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    want = bmc.generate(model, [MEANING], max_new_tokens=5, ignore_eos=True)[0]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert lp["tokens"] == [model.tokenizer.decode([t], skip_special_tokens=False) for t in want.token_ids]
    for token, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        # keyed by text, so tokens that decode alike (partial UTF-8 bytes) share an entry: at most 10
        assert chosen <= 0 and 1 <= len(top) <= 10 and token in top and max(top.values()) <= chosen + 1e-5


def test_client_leaving_stops_a_non_streamed_request(server):
    """The client gives up after 1 s on a ~2000-token request: its row is freed and the engine stops stepping for
    it (steps are counted by the engine thread, so a request left running would add ~2000)."""
    steps = server.metric("bmc:engine_step_seconds_count")
    body = {"prompt": MEANING, "max_tokens": CTX - 64, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", body, timeout=httpx.Timeout(1.0, connect=10))
    assert server.wait_metric("bmc:num_requests_running", 0) == 0
    assert server.wait_metric("bmc:kv_cache_usage_bytes", 0) == 0
    assert server.metric("bmc:engine_step_seconds_count") - steps < CTX - 64 - 1


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


@pytest.mark.parametrize("path, body, field", [("/v1/completions", {"prompt": MEANING * 80}, "prompt"),
                                               ("/v1/chat/completions", {"messages": BOOK * 100}, "messages"),
                                               ("/v1/completions", {"prompt": MEANING, "max_tokens": CTX}, "max_tokens")],
                         ids=["prompt", "messages", "max_tokens"])
def test_beyond_the_context(server, path, body, field):
    """A prompt longer than the context, streamed or not: a 400 before any token, naming the field at fault (for
    chat `messages`, as OpenAI names it); so is max_tokens beyond the room the prompt leaves."""
    for stream in (False, True):
        err = assert_openai_error(post(server, path, {**body, "stream": stream}), 400)
        assert "context" in err["message"] and err["type"] == "invalid_request_error"
        assert err["param"] == field, err


def test_chat_without_max_tokens_runs_to_the_context_end(client, model):
    messages = [{"role": "user", "content": "Hi how are you"}]
    text, finish, usage = "", None, None
    for chunk in client.chat.completions.create(model="tiny", messages=messages, temperature=0, stream=True,
                                                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
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


@pytest.mark.parametrize("messages, flat, sampling", [
    (BOOK, BOOK, {"temperature": 0}), (TURNS, TURNS, {"temperature": 0}), (PARTS, BOOK, {"temperature": 0}),
    (BOOK, BOOK, {"temperature": 0.8, "seed": 42})], ids=["system-user", "turns", "text-parts", "seeded"])
def test_chat_equals_generate(client, model, messages, flat, sampling):
    want, n_prompt = chat_want(model, flat, 8, **sampling)
    r = client.chat.completions.create(model="gpt-3.5-turbo", messages=messages, max_tokens=8, **sampling)
    assert "cmpl" in r.id and r.model == "gpt-3.5-turbo" and r.object == "chat.completion"
    c = r.choices[0]
    assert (c.message.role, c.message.content, c.finish_reason) == ("assistant", want.text, want.finish_reason)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, len(want.token_ids))


def test_chat_stream_chunks(server, model):
    want, n_prompt = chat_want(model, BOOK, 8)
    events = sse(server, "/v1/chat/completions", {"model": "gpt-3.5-turbo", "messages": BOOK, "max_tokens": 8,
                                                  "temperature": 0, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl")
    assert all(c["model"] == "gpt-3.5-turbo" and c["object"] == "chat.completion.chunk" for c in chunks)
    first, *middle, finish, usage = chunks
    assert first["choices"][0]["delta"]["role"] == "assistant" and not first["choices"][0]["delta"].get("content")
    assert all("role" not in c["choices"][0]["delta"] and c["choices"][0]["finish_reason"] is None for c in middle)
    assert "".join(c["choices"][0]["delta"]["content"] for c in middle) == want.text
    assert finish["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": want.finish_reason}]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": len(want.token_ids),
                                                         "total_tokens": n_prompt + len(want.token_ids)}


def test_chat_n_choices(client, model):
    want, _ = chat_want(model, BOOK, 8)
    r = client.chat.completions.create(model="tiny", messages=BOOK, max_tokens=8, n=2, temperature=0)
    assert [(c.index, c.message.role, c.message.content, c.finish_reason) for c in r.choices] == [
        (i, "assistant", want.text, want.finish_reason) for i in range(2)]
    assert r.usage.completion_tokens == 2 * len(want.token_ids)


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


INVALID_MESSAGES = [None, "string", [123], [{}], [{"role": 123}], [{"role": "system", "content": 123}],
                    [{"role": "system", "content": "test"}, {}]]


@pytest.mark.parametrize("messages", INVALID_MESSAGES, ids=[json.dumps(m) for m in INVALID_MESSAGES])
def test_invalid_messages(server, messages):
    assert_openai_error(post(server, "/v1/chat/completions", {"messages": messages}), 400, "messages")


REFUSED = [("/v1/completions", {"n_predict": 8}, "n_predict"),
           ("/v1/chat/completions", {"grammar": 'root ::= "a"{5,5}'}, "grammar"),
           ("/v1/chat/completions", {"json_schema": {"const": "42"}}, "json_schema"),
           ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
           ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                          "json_schema": {"schema": {"const": "x"}}}}, "response_format"),
           ("/v1/chat/completions", {"response_format": {"type": "sound"}}, "response_format"),
           ("/v1/chat/completions", {"logit_bias": {"5": -100}}, "logit_bias")]


@pytest.mark.parametrize("path, extra, field", REFUSED, ids=[f"{r[2]}-{i}" for i, r in enumerate(REFUSED)])
def test_llama_server_only_fields_are_refused_by_name(server, path, extra, field):
    base = {"messages": BOOK} if "chat" in path else {"prompt": MEANING}
    err = assert_openai_error(post(server, path, {**base, "max_tokens": 4, **extra}), 400, field)
    assert field in err["message"]


# ---- test_ignore_eos.py, test_metrics.py --------------------------------------------------------------------------
def test_ignore_eos(client, model):
    prompt = "hello world, hello"
    eos = bmc.generate(model, [prompt], max_new_tokens=32)[0]
    assert eos.finish_reason == "stop"  # the tiny model ends this prompt early
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (
        eos.text, "stop", len(eos.token_ids))
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0,
                                  extra_body={"ignore_eos": True})
    want = bmc.generate(model, [prompt], max_new_tokens=32, ignore_eos=True)[0]
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (want.text, "length", 32)


def test_min_p(client, model):
    kw = dict(max_new_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    want = bmc.generate(model, [MEANING], min_p=0.5, **kw)[0].text
    assert want != bmc.generate(model, [MEANING], **kw)[0].text  # min_p changes this sample
    r = client.completions.create(model="tiny", prompt=MEANING, max_tokens=12, temperature=1.0, seed=7,
                                  extra_body={"min_p": 0.5, "ignore_eos": True})
    assert r.choices[0].text == want


# ---- test_security.py ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("authorization", [None, "Bearer invalid-key", f"Basic {KEY}"], ids=["none", "wrong", "basic"])
def test_wrong_or_missing_key(server, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    r = post(server, "/v1/completions", {"prompt": MEANING}, headers=headers)
    assert assert_openai_error(r, 401)["type"] == "authentication_error"


def test_correct_key(server, model):
    for scheme in ("Bearer", "bearer"):
        r = post(server, "/v1/completions", {"prompt": MEANING, "max_tokens": 4, "temperature": 0},
                 headers={"Authorization": f"{scheme} {KEY}"})
        assert r.status_code == 200 and "error" not in r.json()
        assert r.json()["choices"][0]["text"] == bmc.generate(model, [MEANING], max_new_tokens=4)[0].text
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=60, max_retries=0)
    r = c.chat.completions.create(model="gpt-3.5-turbo", max_tokens=4, messages=[
        {"role": "system", "content": "You are a chatbot."}, {"role": "user", "content": "What is the meaning of life?"}])
    assert len(r.choices) == 1 and r.choices[0].message.role == "assistant"


@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://web.mydomain.fr"])
def test_cors_preflight(server, origin):
    r = httpx.options(server.url + "/v1/completions", timeout=10, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"})
    if origin == "http://localhost:3000":  # the one --allowed-origins names
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
    else:
        assert "access-control-allow-origin" not in r.headers
