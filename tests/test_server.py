"""bmc-serve as a real process on 127.0.0.1, driven by the official openai client and httpx: staggered concurrent
streams give generate()'s text alone, chat, n with a seed, every bad request, disconnects freeing their rows,
/health, /metrics, the API key, a full queue, and SIGTERM draining. Every wait is bounded."""
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
PROMPTS = ["the quick brown fox", "hello world, hello", "a balanced cache allocates", "speculative decoding",
           "the lazy dog"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny GQA Llama with a long context, so a request can run long enough to be cancelled mid-way."""
    return make_llama(tmp_path_factory.mktemp("llama-long"), "gqa", max_pos=8192)


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerProcess(["--model", str(tiny_dir), "--max-num-seqs", "4", "--max-num-batched-tokens", "8",
                         "--api-key", KEY, "--served-model-name", "tiny"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def model(tiny_dir):
    return bmc.load(str(tiny_dir))


def stream_text(client, prompt: str, max_tokens: int, delay: float = 0.0) -> tuple[str, str]:
    return _stream_model(client, "tiny", prompt, max_tokens, delay)


def test_staggered_concurrent_streams_equal_generate_alone(client, model, server):
    lengths = [20, 7, 15, 11, 18]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(stream_text, client, p, n, 0.05 * i) for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
        got = [f.result(timeout=120) for f in futures]
    for (text, finish), p, n in zip(got, PROMPTS, lengths):
        want = bmc.generate(model, [p], max_new_tokens=n)[0]
        assert (text, finish) == (want.text, want.finish_reason), p
    assert server.wait_metric("bmc:num_requests_running", 0) == 0


def test_non_streaming_and_usage(client, model):
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=9, temperature=0)
    want = bmc.generate(model, [PROMPTS[0]], max_new_tokens=9)[0]
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(model.tokenizer.encode(PROMPTS[0]))
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_token_id_prompt_and_several_prompts(client, model):
    ids = [[5, 17, 33, 80], [40, 41, 42]]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    want = [bmc.generate(model, [p], max_new_tokens=6, ignore_eos=True)[0].text for p in ids]
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want


def test_chat_streaming_and_not(client, model):
    messages = [{"role": "user", "content": "hello world"}]
    want = bmc.generate(model, ["hello world"], max_new_tokens=10, chat=True)[0]
    r = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10, temperature=0)
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    text, usage = "", None
    for chunk in client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += c.delta.content or ""
    assert text == want.text
    assert usage is not None and usage.completion_tokens == len(want.token_ids)


def test_n_with_seed_equals_generate(client, model):
    kw = dict(max_new_tokens=8, temperature=0.9, seed=11, num_samples=3, ignore_eos=True)
    want = [c.text for c in bmc.generate(model, [PROMPTS[2]], share_prefix="off", **kw)]
    r = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=8, temperature=0.9, seed=11, n=3,
                                  extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want
    again = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=8, temperature=0.9, seed=11, n=3,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]


def test_logprobs(client):
    r = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # greedy: the chosen token is the most likely (the legacy format keys alternatives by text, so tokens that
        # decode alike, e.g. partial UTF-8 bytes, share one entry)
        assert chosen <= 0 and 1 <= len(top) <= 3 and all(v <= chosen + 1e-6 for v in top.values())
        assert token in top
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(e.top_logprobs) == 2 for e in content)


BAD_REQUESTS = [
    ("missing prompt", "/v1/completions", {"max_tokens": 4}, 400),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400),
    ("temperature < 0", "/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400),
    ("temperature NaN", "/v1/completions", {"prompt": "hi", "temperature": "nan"}, 400),
    ("top_p 0", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400),
    ("top_p > 1", "/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400),
    ("top_k not int", "/v1/completions", {"prompt": "hi", "top_k": 2.5}, 400),
    ("max_tokens 0", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("max_tokens huge", "/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, 400),
    ("prompt over context", "/v1/completions", {"prompt": [5] * 8200}, 400),
    ("token id out of vocab", "/v1/completions", {"prompt": [5, 100000]}, 400),
    ("n over max-num-seqs", "/v1/completions", {"prompt": "hi", "n": 50}, 400),
    ("presence_penalty > 2", "/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, 400),
    ("frequency_penalty NaN", "/v1/completions", {"prompt": "hi", "frequency_penalty": "nan"}, 400),
    ("repetition_penalty 0", "/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400),
    ("logit_bias key not an id", "/v1/completions", {"prompt": "hi", "logit_bias": {"the": 5}}, 400),
    ("logit_bias id out of vocab", "/v1/completions", {"prompt": "hi", "logit_bias": {"100000": 5}}, 400),
    ("logit_bias huge key", "/v1/completions", {"prompt": "hi", "logit_bias": {"9" * 5000: 5}}, 400),
    ("logit_bias > 100", "/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, 400),
    ("stop not strings", "/v1/completions", {"prompt": "hi", "stop": [1, 2]}, 400),
    ("stream_options without stream", "/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404),
    ("no messages", "/v1/chat/completions", {"messages": []}, 400),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400),
    ("content not text", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400),
    ("body not an object", "/v1/completions", [1, 2], 400),
]


@pytest.mark.parametrize("what, path, body, status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(server, what, path, body, status):
    raw = json.dumps(body).replace('"nan"', "NaN")
    r = httpx.post(server.url + path, content=raw, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and (err["code"] is None or isinstance(err["code"], str))


def test_malformed_json_auth_and_routes(server, client):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers=auth, timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=30).status_code == 401
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=30,
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # open without a key
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(server.url + "/v1/nothing", headers=auth, timeout=10).status_code == 404
    # the server still serves after all of that
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].finish_reason


def test_disconnect_frees_the_row(server):
    """A client that leaves mid-stream: its request is aborted and its row and KV freed (gauges back to 0)."""
    before = server.metric("bmc:engine_step_seconds_count")  # the engine's steps, not the handler's count
    body = {"prompt": PROMPTS[0], "max_tokens": 8000, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert server.metric("bmc:num_requests_running") == 1
        assert server.metric("bmc:num_kv_rows") == 1
    assert server.wait_metric("bmc:num_requests_running", 0) == 0
    assert server.wait_metric("bmc:kv_cache_usage_bytes", 0) == 0
    assert server.metric("bmc:num_kv_rows") == 0
    assert server.metric("bmc:engine_step_seconds_count") - before < 4000  # aborted, not run to its end


def test_metrics_names(server, client):
    client.completions.create(model="tiny", prompt="hi", max_tokens=3)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ("bmc:num_requests_running", "bmc:num_requests_waiting", "bmc:kv_cache_usage_bytes",
                 "bmc:prompt_tokens_total", "bmc:generation_tokens_total", "bmc:time_to_first_token_seconds_bucket",
                 "bmc:inter_token_latency_seconds_bucket", "bmc:e2e_request_latency_seconds_count",
                 "bmc:request_queue_time_seconds_sum", "bmc:request_success_total"):
        assert name in text, name
    assert server.metric("bmc:time_to_first_token_seconds_count") >= 1


def test_full_queue_answers_503_and_sigterm_drains(tiny_dir):
    srv = ServerProcess(["--model", str(tiny_dir), "--max-num-seqs", "1", "--max-num-batched-tokens", "8",
                         "--max-queue", "0"])
    try:
        # logprobs: a chunk for every token, even one whose text is pending (a partial UTF-8 character)
        body = {"prompt": PROMPTS[0], "max_tokens": 2000, "temperature": 0, "stream": True, "ignore_eos": True,
                "logprobs": 0}
        lines: list[str] = []

        def consume() -> None:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                lines.extend(r.iter_lines())

        t = threading.Thread(target=consume)
        t.start()
        assert srv.wait_metric("bmc:num_requests_running", 1) == 1
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.headers.get("retry-after")
        assert r.json()["error"]["code"] == "service_unavailable"
        code = srv.terminate(60)  # the running stream finishes, then the process exits 0
        t.join(60)
        assert code == 0, srv.output()
        data = [x for x in lines if x.startswith("data: ")]
        assert data[-1] == "data: [DONE]" and len(data) == 2002  # 2000 tokens, the finish chunk, [DONE]
        last = json.loads(data[-2][6:])["choices"][0]
        assert last["finish_reason"] == "length" and last["text"] == "" and last["logprobs"] is None
    finally:
        srv.stop()


def test_a_failing_request_gets_500_and_the_server_goes_on(gqa_dir, monkeypatch):
    """An exception inside one request (injected into its prefill) answers that request 500 with the reason."""
    from fastapi.testclient import TestClient

    from bmc.scheduler import Scheduler
    from bmc.engine_options import EngineOptions
    from bmc.server import ServeOptions, build_app

    real = Scheduler._chunk_part

    def chunk(self, p, t):
        if p.request.prompt_ids[0] == 99:
            raise RuntimeError("injected failure")
        return real(self, p, t)

    monkeypatch.setattr(Scheduler, "_chunk_part", chunk)
    app = build_app(ServeOptions(model=str(gqa_dir), engine=EngineOptions(max_num_seqs=2, max_num_batched_tokens=16)))
    with TestClient(app) as c:
        deadline = time.monotonic() + 60
        while c.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        r = c.post("/v1/completions", json={"prompt": [99, 5, 6], "max_tokens": 3})
        assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
        ok = c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"]


@pytest.mark.slow
def test_real_model_staggered_streams_equal_generate_alone(real_model, real_server):
    """SmolLM2 behind bmc-serve (default budget 256: the long prompt is prefilled in 3 chunks between the others'
    decode steps): five staggered streams, chat included, each gives generate()'s greedy text alone; /health said
    503 while the model loaded."""
    srv = real_server
    assert srv.health_codes[0] in (503, 200) and 503 in srv.health_codes  # loading took a while
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=300, max_retries=0)
    doc = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(80))
    prompts = ["The capital of France is", doc + " The colour of item 7 is", "def fibonacci(n):",
               "Once upon a time", "List three prime numbers:"]
    lengths = [24, 12, 20, 16, 18]

    def chat(delay: float) -> str:
        time.sleep(delay)
        out = ""
        for chunk in client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi!"}],
                                                    max_tokens=20, temperature=0, stream=True):
            out += "".join(c.delta.content or "" for c in chunk.choices)
        return out

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(_stream_model, client, "smol", p, n, 0.3 * i)
                   for i, (p, n) in enumerate(zip(prompts, lengths))]
        chat_future = pool.submit(chat, 0.5)
        got = [f.result(timeout=600) for f in futures]
        got_chat = chat_future.result(timeout=600)
    for (text, finish), p, n in zip(got, prompts, lengths):
        want = bmc.generate(real_model, [p], max_new_tokens=n)[0]
        assert (text, finish) == (want.text, want.finish_reason), p[-40:]
    assert got_chat == bmc.generate(real_model, ["Hi!"], max_new_tokens=20, chat=True)[0].text
    assert srv.wait_metric("bmc:num_requests_running", 0) == 0
    assert srv.wait_metric("bmc:kv_cache_usage_bytes", 0) == 0


def _stream_model(client, name: str, prompt: str, max_tokens: int, delay: float) -> tuple[str, str]:
    time.sleep(delay)
    text, finish = "", None
    for chunk in client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True):
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("flags, metric", [(["--speculative", "ngram", "--tree", "dynamic:2x4"],
                                            "bmc:spec_decode_num_accepted_tokens_total"),
                                           (["--speculative", "layers:1", "--tree", "dynamic:2x3"],
                                            "bmc:spec_decode_num_draft_tokens_total"),
                                           (["--attention", "sparq", "--sparq-r", "4", "--sparq-k", "6"], None)],
                         ids=["speculative-ngram", "speculative-draft-model", "sparq"])
def test_speculative_and_sparq_serving_equal_generate_alone(tiny_dir, model, flags, metric):
    """bmc-serve --speculative ngram / layers:1 (a draft model whose cache follows the batch's rows): staggered greedy
    streams give plain greedy generate()'s text, with drafts verified (the metric counts them); --attention sparq:
    each gives generate(attention='sparq')'s text."""
    srv = ServerProcess(["--model", str(tiny_dir), "--max-num-seqs", "3", "--max-num-batched-tokens", "48",
                         "--served-model-name", "tiny", *flags])
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=60, max_retries=0)
        prompts = ["abc abc abc abc abc", "hello world, hello world, hello", *PROMPTS[2:]]
        lengths = [24, 16, 20, 12, 18]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(stream_text, client, p, n, 0.05 * i) for i, (p, n) in enumerate(zip(prompts, lengths))]
            got = [f.result(timeout=120) for f in futures]
        sparq = dict(attention="sparq", sparq_r=4, sparq_k=6) if "sparq" in flags else {}
        for (text, finish), p, n in zip(got, prompts, lengths):
            want = bmc.generate(model, [p], max_new_tokens=n, **sparq)[0]
            assert (text, finish) == (want.text, want.finish_reason), p
        if metric is not None:
            assert srv.metric(metric) > 0 and srv.metric("bmc:spec_decode_num_drafts_total") > 0
        assert srv.wait_metric("bmc:num_requests_running", 0) == 0
    finally:
        srv.stop()


@pytest.mark.parametrize("flags, message", [(["--attention", "local"], "invalid choice"),
                                            (["--speculative", "draft:/nonexistent/x"], "does not exist"),
                                            (["--speculative", "bogus"], "unknown speculative"),
                                            (["--attention", "sparq", "--sparq-k", "0"], "sparq k must be >= 1"),
                                            (["--max-num-seqs", "4", "--max-num-batched-tokens", "4"],
                                             "--max-num-batched-tokens (4) must exceed --max-num-seqs (4)"),
                                            (["--attention", "sparq", "--speculative", "ngram"], "speculative"),
                                            (["--speculative", "ngram", "--tree", "bush:3"], "unknown tree"),
                                            (["--itl-factor", "1"], "--itl-factor must be 0 (off) or in (1, 1e6]"),
                                            (["--itl-factor", "nan"], "--itl-factor must be 0 (off)"),
                                            (["--tp", "0"], "--tp must be in [1, "),
                                            (["--tp", "2", "--instances", "2"], "--tp with --instances is not built"),
                                            (["--tp", "2", "--quant", "q8_0"], "not sharded yet"),
                                            (["--tp", "2", "--activations", "int8"], "not sharded yet")])
def test_serve_refuses_what_it_does_not_serve(flags, message, capsys):
    """Refused before anything loads, with exit code 2 (the CLI's own main, in this process: no server starts)."""
    from bmc.cli.serve import main

    with pytest.raises(SystemExit) as exit_:
        main(flags)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err


def test_int8_kv_server_streams_equal_generate_alone(tiny_dir, model):
    """bmc-serve --kv-dtype int8: concurrent streams give what generate(kv_dtype="int8") gives each alone."""
    srv = ServerProcess(["--model", str(tiny_dir), "--max-num-seqs", "3", "--max-num-batched-tokens", "8",
                         "--served-model-name", "tiny", "--kv-dtype", "int8"])
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=60, max_retries=0)
        card = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]
        assert card["kv_cache_dtype"] == "int8"  # the batch cache stores int8 rows (the tiny model's tokens agree)
        lengths = [14, 6, 10, 12]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(_stream_model, client, "tiny", p, n, 0.05 * i)
                       for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
            got = [f.result(timeout=120) for f in futures]
        for (text, finish), p, n in zip(got, PROMPTS, lengths):
            want = bmc.generate(model, [p], max_new_tokens=n, kv_dtype="int8")[0]
            assert (text, finish) == (want.text, want.finish_reason), p
    finally:
        assert srv.terminate() == 0


def test_ctx_size_caps_what_a_request_may_ask_and_is_reported(tiny_dir, model):
    """-c/--ctx-size bounds prompt + max_tokens (and the KV cache with it) below the model's 8192: a request within
    gets generate()'s tokens, one beyond gets a 400 naming the flag, /v1/models reports the cap."""
    srv = ServerProcess(["--model", str(tiny_dir), "-c", "40", "--max-num-seqs", "2", "--served-model-name", "tiny"])
    try:
        card = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]
        assert card["max_model_len"] == 40
        assert "json_schema" in card["capabilities"]["structured_outputs"] and card["capabilities"]["echo"]
        prompt = [5, 17, 33, 80, 101, 7, 9]
        ok = httpx.post(srv.url + "/v1/completions", timeout=60,
                        json={"model": "tiny", "prompt": prompt, "max_tokens": 33, "temperature": 0})
        assert ok.status_code == 200, ok.text
        want = bmc.generate(model, [prompt], max_new_tokens=33)[0]
        assert ok.json()["choices"][0]["text"] == want.text
        over = httpx.post(srv.url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": prompt, "max_tokens": 34, "temperature": 0})
        assert over.status_code == 400 and "--ctx-size" in over.json()["error"]["message"]
        assert over.json()["error"]["code"] == "context_length_exceeded"
    finally:
        srv.stop()
