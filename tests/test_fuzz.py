"""Schemathesis against a real bmc-serve, from its own /openapi.json, while greedy streams decode beside it: no 5xx,
every response as documented (status, content type, body and SSE schema), and every stream gives generate()'s
tokens alone. Bounded in time (FUZZ_SECONDS); bench/fuzz_soak.py runs the same for as long as asked.

positive_data_acceptance is left out: a schema cannot say what depends on the loaded model (a prompt longer than its
context, token ids beyond its vocabulary, n above --max-num-seqs), and those are refused with a 400 on purpose. So is the 10 s response-time limit that `--checks all` adds: a request may
ask for thousands of tokens, and speed is measured in benchmarks, not asserted in tests."""
from __future__ import annotations

import os
import subprocess
import threading

import pytest

import bmc

from .conftest import make_llama, transformers  # noqa: F401
from .serving import ServerProcess, schemathesis_command

openai = pytest.importorskip("openai", reason="the fuzz test drives bmc-serve with the openai client")
pytest.importorskip("schemathesis", reason="the fuzz test runs Schemathesis (the test extra)")

FUZZ_SECONDS = int(os.environ.get("BMC_FUZZ_SECONDS", "10"))
KEY = "fuzz-key"
PROMPTS = ["the quick brown fox", "hello world, hello", "a balanced cache allocates"]


def test_schemathesis_finds_nothing_while_streams_decode_exactly(tmp_path):
    tiny = make_llama(tmp_path / "tiny", "gqa", max_pos=512)
    model = bmc.load(str(tiny))
    want = {p: bmc.generate(model, [p], max_new_tokens=40, ignore_eos=True)[0].text for p in PROMPTS}
    srv = ServerProcess(["--model", str(tiny), "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
                         "--api-key", KEY, "--served-model-name", "tiny"])
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, timeout=120, max_retries=0)
        stop = threading.Event()
        mismatches: list[str] = []
        done = [0]

        def streams(prompt: str) -> None:
            while not stop.is_set():
                text = ""
                for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                                                       stream=True, extra_body={"ignore_eos": True}):
                    text += "".join(c.text for c in chunk.choices)
                if text != want[prompt]:
                    mismatches.append(prompt)
                done[0] += 1

        threads = [threading.Thread(target=streams, args=(p,)) for p in PROMPTS]
        for t in threads:
            t.start()
        try:
            fuzz = subprocess.run(schemathesis_command(srv.url, FUZZ_SECONDS, KEY, workers=1, max_examples=50),
                                  capture_output=True, text=True,
                                  timeout=FUZZ_SECONDS + 300)
        finally:
            stop.set()
            for t in threads:
                t.join(120)
        assert fuzz.returncode == 0, fuzz.stdout[-6000:] + fuzz.stderr[-2000:]
        # "No issues found", or a warning (e.g. an operation that only got 4xx in its short budget); never a failure
        assert " passed" in fuzz.stdout and "❌" not in fuzz.stdout, fuzz.stdout[-6000:]
        assert not mismatches and done[0] >= len(PROMPTS)
        assert srv.proc.poll() is None and srv.wait_metric("bmc:num_requests_running", 0) == 0
    finally:
        assert srv.terminate() == 0, srv.output()
