"""bmc-serve against what clients really send (issue 41): values that underflow in float32, bad bodies of every
kind, clients that leave, requests that fail inside the engine, an engine thread that dies, and the wire details
OpenAI's and llama-server's clients rely on. Real processes on 127.0.0.1, real clients, every wait bounded."""
from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import httpx
import pytest

import bmc

from .conftest import make_llama, transformers  # noqa: F401
from .serving import ServerProcess

openai = pytest.importorskip("openai", reason="the server tests drive bmc-serve with the openai client")

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("llama-robust"), "gqa", max_pos=8192)


@pytest.fixture(scope="module")
def model(tiny_dir):
    return bmc.load(str(tiny_dir))


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerProcess(["--model", str(tiny_dir), "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
                         "--api-key", KEY, "--served-model-name", "tiny", "gpt-3.5-turbo",
                         "--allowed-origins", "http://localhost:3000", "--max-body-bytes", "1500000"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=120, max_retries=0)


def stream_completion(client, prompt: str, max_tokens: int, **kw) -> tuple[str, str | None, list]:
    text, finish, chunks = "", None, []
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, **kw):
        chunks.append(chunk)
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    return text, finish, chunks


def post(server, path: str, body, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=60, **kw)


# ---- values a client can send that the kernels see in float32 ---------------------------------------------------
EDGE_SAMPLING = [
    ({"top_p": 5e-324, "logprobs": 0}, 200),  # 0 in float32: the most likely token survives
    ({"top_p": 1e-45}, 200),
    ({"temperature": 1e-40}, 200),  # a float32 denormal: finite once the largest logit is subtracted
    ({"temperature": 1e-300}, 400),  # 0 in float32: refused, with the reason
    ({"temperature": 5e-324, "top_p": 5e-324}, 400),
    ({"min_p": 1.0, "temperature": 2.0}, 200),
    ({"min_p": 5e-324}, 200),
    ({"top_k": 10**30}, 200),
    ({"seed": 2**64 - 1, "temperature": 1.0}, 200),
]


def test_float32_edges_neither_stop_the_engine_nor_touch_a_neighbour(server, client, model):
    """The issue's request ({"top_p": 5e-324, ...}) stopped the engine for good, and temperature=1e-300 failed every
    request decoding beside it. Now each edge value gets a 200 or a 400 naming the field, while a greedy stream
    decodes beside them and still gives generate()'s text alone."""
    want = bmc.generate(model, [LONG], max_new_tokens=120, ignore_eos=True)[0]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        neighbour = pool.submit(stream_completion, client, LONG, 120, extra_body={"ignore_eos": True})
        for extra, status in EDGE_SAMPLING:
            r = post(server, "/v1/completions", {"prompt": "0", "max_tokens": 3, **extra})
            assert r.status_code == status, (extra, r.text)
            if status == 200:
                assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
            else:
                assert r.json()["error"]["type"] == "invalid_request_error" and "float32" in r.text
        text, finish, _ = neighbour.result(timeout=120)
    assert (text, finish) == (want.text, want.finish_reason)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# ---- bodies that are not what the schema says ---------------------------------------------------------------------
def errors_total(server) -> float:
    try:
        return server.metric("bmc:request_errors_total")
    except KeyError:  # no error counted yet
        return 0.0


def raw_post(server, raw: bytes | str, content_type: str | None = "application/json",
             path: str = "/v1/completions") -> httpx.Response:
    headers = dict(AUTH)
    if content_type is not None:
        headers["Content-Type"] = content_type
    return httpx.post(server.url + path, content=raw, headers=headers, timeout=60)


BAD_BODIES = [
    ("lone surrogate", '{"prompt": "\\ud83d", "max_tokens": 2}', "application/json", 400, "surrogate"),
    ("surrogate in chat", '{"messages": [{"role": "user", "content": "a\\udc00"}]}', "application/json", 400,
     "surrogate"),
    ("nested too deep", '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", "application/json", 400, "JSON"),
    ("integer of 5000 digits", '{"prompt": "hi", "seed": ' + "9" * 5000 + "}", "application/json", 400, "JSON"),
    ("not JSON", "{not json", "application/json", 400, "JSON"),
    ("form content type", "prompt=hi", "application/x-www-form-urlencoded", 415, "application/json"),
    ("text content type", '{"prompt": "hi"}', "text/plain", 415, "application/json"),
    ("GBNF grammar that does not parse", '{"prompt": "hi", "grammar": "root ::= ("}', "application/json", 400,
     "grammar"),
    ("GBNF grammar without root", '{"prompt": "hi", "grammar": "x ::= \\"a\\""}', "application/json", 400, "grammar"),
    ("json_schema not a schema", '{"prompt": "hi", "json_schema": {"type": 5}}', "application/json", 400,
     "json_schema"),
    ("json_schema a list", '{"prompt": "hi", "json_schema": [1]}', "application/json", 400, "json_schema"),
    ("regex that does not parse", '{"prompt": "hi", "regex": "(a"}', "application/json", 400, "regex"),
    ("two constraints", '{"prompt": "hi", "regex": "a", "grammar": "root ::= \\"a\\""}', "application/json",
     400, "grammar"),
    ("llama-server n_predict", '{"prompt": "hi", "n_predict": 4}', "application/json", 400, "n_predict"),
    ("legacy functions", '{"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}',
     "application/json", 400, "functions"),
    ("string for a number", '{"prompt": "hi", "temperature": "0.5"}', "application/json", 400, "temperature"),
    ("bool for an integer", '{"prompt": "hi", "max_tokens": true}', "application/json", 400, "max_tokens"),
    ("infinity", '{"prompt": "hi", "temperature": Infinity}', "application/json", 400, "finite"),
    ("too many stop strings", json.dumps({"prompt": "hi", "stop": ["x"] * 65}), "application/json", 400, "stop"),
    ("too many prompts", json.dumps({"prompt": ["hi"] * 1025}), "application/json", 400, "prompt"),
]


@pytest.mark.parametrize("what, raw, content_type, status, needle", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_bodies_get_a_4xx_with_an_openai_error(server, what, raw, content_type, status, needle):
    before = errors_total(server)
    path = "/v1/chat/completions" if '"messages"' in raw else "/v1/completions"
    r = raw_post(server, raw, content_type, path)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error", err
    assert err["code"] is None or isinstance(err["code"], str)
    assert errors_total(server) == before + 1


def test_body_over_the_limit_gets_413_before_it_is_read(server):
    r = raw_post(server, json.dumps({"prompt": "a" * 2_000_000}))
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "request_too_large"


def test_long_prompt_is_tokenized_off_the_event_loop(server):
    """A 1.2 MB prompt takes about a second to tokenize; /health, asked after it was sent, answers first."""
    order: list[str] = []

    def big() -> None:
        r = raw_post(server, json.dumps({"prompt": "hello world " * 100_000, "max_tokens": 1}))
        order.append(f"big:{r.status_code}")

    t = threading.Thread(target=big)
    t.start()
    time.sleep(0.3)  # the body is sent and being tokenized
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    order.append("health")
    t.join(60)
    assert order == ["health", "big:400"]  # the prompt is beyond the context: refused once tokenized


# ---- wire details --------------------------------------------------------------------------------------------------
def test_finish_reason_comes_in_its_own_chunk(client, model):
    want = bmc.generate(model, [LONG], max_new_tokens=5, ignore_eos=True)[0]
    text, finish, chunks = stream_completion(client, LONG, 5, extra_body={"ignore_eos": True})
    assert (text, finish) == (want.text, "length")
    last = chunks[-1].choices[0]
    assert last.finish_reason == "length" and last.text == ""
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    chat = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, temperature=0, stream=True))
    assert chat[-1].choices[0].finish_reason is not None and chat[-1].choices[0].delta.content is None
    assert all(c.choices[0].finish_reason is None for c in chat[:-1])
    content = "".join(c.choices[0].delta.content or "" for c in chat)
    assert content == bmc.generate(model, ["hi"], max_new_tokens=4, chat=True)[0].text


def test_completions_default_to_16_tokens(client):
    r = client.completions.create(model="tiny", prompt="hi", temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_served_model_names_and_model_routes(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny", "gpt-3.5-turbo"]
    assert client.models.retrieve("gpt-3.5-turbo").id == "gpt-3.5-turbo"
    r = httpx.get(server.url + "/v1/models/gpt-9", headers=AUTH, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    alias = client.chat.completions.create(model="gpt-3.5-turbo", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, temperature=0)
    assert alias.model == "gpt-3.5-turbo" and alias.choices[0].finish_reason
    r = post(server, "/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_auth_scheme_any_case_and_method_errors_typed(server):
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30,
                       headers={"Authorization": f"{scheme} {KEY}"})
        assert r.status_code == 200, (scheme, r.text)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=30,
                   headers={"Authorization": f"Basic {KEY}"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(server.url + "/v1/completions", headers=AUTH, timeout=10)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_cors_preflight_for_allowed_origins_only(server, tiny_dir):
    pre = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(server.url + "/v1/chat/completions", headers=pre, timeout=10)  # no key: a preflight has none
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30,
                   headers={**AUTH, "Origin": "http://localhost:3000"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    r = httpx.options(server.url + "/v1/chat/completions", headers={**pre, "Origin": "http://evil.example"},
                      timeout=10)
    assert "access-control-allow-origin" not in r.headers


def test_openapi_documents_the_bodies(server):
    spec = httpx.get(server.url + "/openapi.json", timeout=10).json()
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/ChatCompletionRequest")
    props = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "temperature", "top_p", "min_p", "stop"} <= set(props)
    assert "400" in spec["paths"]["/v1/completions"]["post"]["responses"]


# ---- clients that leave ---------------------------------------------------------------------------------------------
def test_non_streamed_request_is_aborted_when_its_client_leaves(server):
    """With the API key on (its check used to hide the disconnect), a non-streamed request stops generating once
    its client is gone."""
    before = server.metric("bmc:engine_step_seconds_count")  # the engine's steps, not the handler's count
    body = {"prompt": LONG, "max_tokens": 8000, "temperature": 0, "ignore_eos": True}
    server.abandon_request("/v1/completions", body, KEY)
    assert server.wait_metric("bmc:num_requests_running", 0) == 0
    assert server.wait_metric("bmc:kv_cache_usage_bytes", 0) == 0
    assert server.metric("bmc:engine_step_seconds_count") - before < 4000  # aborted, not run to its end


# ---- failures inside the engine -------------------------------------------------------------------------------------
def test_a_request_failing_inside_sampling_fails_alone(tiny_dir, model):
    """A fault injected into one request's sampler: that request gets a 500 (non-streamed) or an error event
    (streamed); greedy streams decoding beside it give generate()'s text alone, and the server goes on."""
    srv = ServerProcess(["--model", str(tiny_dir), "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
                         "--served-model-name", "tiny"], module=("tests.fault_serve", "sampler"))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=120, max_retries=0)
        prompts, lengths = [LONG, "hello world, hello"], [60, 45]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            streams = [pool.submit(stream_completion, client, p, n, extra_body={"ignore_eos": True})
                       for p, n in zip(prompts, lengths)]
            time.sleep(0.3)
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 5, "temperature": 0.7,
                                                             "seed": 666}, timeout=60)
            assert r.status_code == 500 and "injected sampler failure" in r.json()["error"]["message"]
            with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                              json={"prompt": "abc", "max_tokens": 5, "temperature": 0.7, "seed": 666,
                                    "stream": True}) as s:
                events = [x for x in s.iter_lines() if x.startswith("data: ")]
            assert "injected sampler failure" in events[-2] and events[-1] == "data: [DONE]"
            got = [f.result(timeout=120) for f in streams]
        for (text, finish, _), p, n in zip(got, prompts, lengths):
            want = bmc.generate(model, [p], max_new_tokens=n, ignore_eos=True)[0]
            assert (text, finish) == (want.text, want.finish_reason)
        assert srv.wait_metric("bmc:num_requests_running", 0) == 0
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].finish_reason
    finally:
        srv.stop()


def test_an_engine_thread_that_dies_answers_everyone_and_exits_non_zero(tiny_dir):
    """A bug outside any request (injected: the step raises, and so does the recovery): the request in flight gets
    its error, /health turns 503, and the process exits non-zero for its supervisor to restart it."""
    srv = ServerProcess(["--model", str(tiny_dir), "--max-num-seqs", "2", "--max-num-batched-tokens", "16",
                         "--timeout-graceful-shutdown", "5"], module=("tests.fault_serve", "engine"))
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [99, 5, 6], "max_tokens": 3}, timeout=60)
        assert r.status_code == 500 and "injected step failure" in r.json()["error"]["message"]
        deadline = time.monotonic() + 60
        while srv.proc.poll() is None and time.monotonic() < deadline:
            try:
                assert httpx.get(srv.url + "/health", timeout=5).status_code == 503
            except httpx.TransportError:
                break  # already shutting down
            time.sleep(0.05)
        assert srv.proc.wait(60) not in (0, None)
        assert "engine thread died" in srv.output()
    finally:
        srv.stop()


def test_hypothesis_sampling_values_through_the_server(server):
    """Sampling values across float32's edges, sent as a client sends them: a 200 with a finished choice or a 400
    naming the field, never a 5xx; the server is healthy after each."""
    pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    edges = st.one_of(st.sampled_from([0.0, 5e-324, 1e-300, 1e-46, 1.4e-45, 1e-40, 1.1754943e-38, 1e-7, 1.0, 2.0]),
                      st.floats(0.0, 2.0, allow_subnormal=True), st.floats(0.0, 1e-30, allow_subnormal=True))

    @settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(temperature=edges, top_p=st.one_of(st.none(), edges), min_p=st.one_of(st.none(), edges),
           top_k=st.one_of(st.none(), st.integers(-1, 10**20)), logprobs=st.one_of(st.none(), st.integers(0, 5)))
    def check(temperature, top_p, min_p, top_k, logprobs):
        body = {"prompt": "0", "max_tokens": 2, "temperature": temperature, "top_p": top_p, "min_p": min_p,
                "top_k": top_k, "logprobs": logprobs}
        r = post(server, "/v1/completions", {k: v for k, v in body.items() if v is not None})
        assert r.status_code in (200, 400), r.text
        if r.status_code == 200:
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        else:
            assert r.json()["error"]["param"] in ("temperature", "top_p", "min_p", "top_k")

    check()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
