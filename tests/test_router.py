"""bmc-serve --instances 2 as real processes on 127.0.0.1: the router in front of two pinned engine instances,
driven by the openai client and httpx. Staggered concurrent streams give generate()'s text alone and reach both
instances; each instance's affinity mask is its own core; bad requests and a wrong key pass through as 4xx; a
disconnect frees the row; an instance killed mid-load fails only its own requests, is replaced, and /health says
degraded until it is back. Every wait is bounded."""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time

import httpx
import pytest

import bmc
from bmc.platform.topology import bind_memory_to, nodes_of, parse_cpu_list, physical_core_cpus
from bmc.server.router import STARTUP_GRACE_S, Router, core_sets_for, max_num_seqs

from .conftest import make_llama
from .serving import ServerProcess

openai = pytest.importorskip("openai", reason="the router tests drive bmc-serve with the openai client")

KEY = "test-key"
PROMPTS = ["the quick brown fox", "hello world, hello", "a balanced cache allocates", "speculative decoding"]
# Two instances pinned to two physical cores. A dev machine with one core skips these; CI (two cores) never may: there
# they run, and fail, rather than vanish.
TWO_CORES_MISSING = len(physical_core_cpus()) < 2 and not os.environ.get("CI")
needs_two_cores = pytest.mark.skipif(TWO_CORES_MISSING, reason="two instances need two physical cores")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("llama-router"), "gqa", max_pos=8192)


@pytest.fixture(scope="module")
def model(tiny_dir):
    return bmc.load(str(tiny_dir))


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=5).json()


def wait_health(url: str, status: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            h = health(url)
            if h["status"] == status:
                return h
        except (httpx.TransportError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"/health did not reach {status!r} in {timeout} s")
        time.sleep(0.1)


def metric(url: str, name: str, instance: str) -> float:
    """A sample's value summed over its other labels, for one instance label ("0", "1" or "all")."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and f'instance="{instance}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def router(tiny_dir):
    if TWO_CORES_MISSING:
        pytest.skip("two instances need two physical cores")
    srv = ServerProcess(["--instances", "2", "--model", str(tiny_dir), "--max-num-seqs", "4",
                         "--max-num-batched-tokens", "8", "--api-key", KEY, "--served-model-name", "tiny"],
                        startup_timeout=180)
    wait_health(srv.url, "ok")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(router):
    return openai.OpenAI(base_url=router.url + "/v1", api_key=KEY, timeout=60, max_retries=0)


def stream(client, prompt: str, max_tokens: int, delay: float = 0.0) -> str:
    time.sleep(delay)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
    return "".join(c.choices[0].text for c in out if c.choices)


@needs_two_cores
def test_staggered_streams_equal_generate_alone_on_both_instances(client, model, router):
    before = [metric(router.url, "bmc:generation_tokens_total", i) for i in ("0", "1")]
    lengths = [20, 7, 15, 11]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(stream, client, p, n, 0.05 * i) for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
        got = [f.result(timeout=120) for f in futures]
    for text, p, n in zip(got, PROMPTS, lengths):
        assert text == bmc.generate(model, [p], max_new_tokens=n)[0].text
    after = [metric(router.url, "bmc:generation_tokens_total", i) for i in ("0", "1")]
    assert all(a > b for a, b in zip(after, before)), (before, after)  # the router used both instances
    assert metric(router.url, "bmc:generation_tokens_total", "all") == sum(after)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=0)
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.completion_tokens >= 1


@needs_two_cores
def test_each_instance_is_pinned_to_its_own_core_and_maps_the_shared_weights(router):
    h = health(router.url)
    assert h["status"] == "ok" and len(h["instances"]) == 2
    masks = [os.sched_getaffinity(inst["pid"]) for inst in h["instances"]]
    for inst, mask in zip(h["instances"], masks):
        assert mask == set(inst["cpus"]) and len(mask) == 1
    assert not masks[0] & masks[1]
    assert masks[0] | masks[1] <= set(physical_core_cpus())
    mapped = []  # both instances map one weight file: the weights are in memory once
    for inst in h["instances"]:
        with open(f"/proc/{inst['pid']}/maps") as f:
            mapped.append({line.split()[-1] for line in f if line.rstrip().endswith(".bmcw")})
    assert len(mapped[0]) == 1 and mapped[0] == mapped[1]


@needs_two_cores
def test_bad_requests_and_keys_pass_through(router):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "max_tokens": 4}, headers=auth, timeout=30)
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
    r = httpx.post(router.url + "/v1/completions", content=b"{not json", headers=auth, timeout=30)
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "temperature": -1},
                   headers=auth, timeout=30)
    assert r.status_code == 400
    r = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "x"},
                   headers={"Authorization": "Bearer wrong"}, timeout=30)
    assert r.status_code == 401
    assert httpx.get(router.url + "/v1/models", headers=auth, timeout=30).json()["data"][0]["id"] == "tiny"


@needs_two_cores
def test_a_disconnect_frees_the_row(router):
    body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 5000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert metric(router.url, "bmc:num_requests_running", "all") == 1
    deadline = time.monotonic() + 30
    while metric(router.url, "bmc:num_requests_running", "all") != 0:
        assert time.monotonic() < deadline, "the disconnected request still runs"
        time.sleep(0.05)


@needs_two_cores
def test_a_killed_instance_fails_only_its_requests_and_is_replaced(router, model):
    body = {"model": "tiny", "max_tokens": 1500, "temperature": 0, "stream": True, "ignore_eos": True}
    results: dict[int, tuple[str, bool, str]] = {}
    started = concurrent.futures.ThreadPoolExecutor(4)

    def run(i: int, prompt: str) -> None:
        text, done, err = "", False, ""
        try:
            with httpx.stream("POST", router.url + "/v1/completions", json=dict(body, prompt=prompt), timeout=120,
                              headers={"Authorization": f"Bearer {KEY}"}) as r:
                if r.status_code != 200:  # sent to the instance before it died, refused before its first byte
                    err = json.loads(r.read())["error"]["message"]
                for line in r.iter_lines() if r.status_code == 200 else ():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        err = event["error"]["message"]
                        break
                    text += event["choices"][0]["text"]
        except httpx.HTTPError as e:
            err = repr(e)
        results[i] = (text, done, err)

    victim = health(router.url)["instances"][0]
    before = metric(router.url, "bmc:generation_tokens_total", "0")
    futures = [started.submit(run, i, p) for i, p in enumerate(PROMPTS)]
    deadline = time.monotonic() + 60
    while metric(router.url, "bmc:generation_tokens_total", "0") < before + 10:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(victim["pid"], signal.SIGKILL)
    h = wait_health(router.url, "degraded", timeout=30)
    assert not h["instances"][0]["ready"] and h["instances"][1]["ready"]
    for f in futures:
        f.result(timeout=180)
    failed = [i for i, (_, done, _) in results.items() if not done]
    ok = [i for i, (_, done, _) in results.items() if done]
    assert failed and ok, results  # the two instances each had some of the four
    for i in failed:
        assert "instance 0" in results[i][2]
    for i in ok:
        assert results[i][0] == bmc.generate(model, [PROMPTS[i]], max_new_tokens=1500, ignore_eos=True)[0].text
    h = wait_health(router.url, "ok", timeout=120)
    assert h["instances"][0]["restarts"] == 1 and h["instances"][0]["pid"] != victim["pid"]
    assert os.sched_getaffinity(h["instances"][0]["pid"]) == set(victim["cpus"])
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=KEY, timeout=60, max_retries=0)
    assert stream(client, PROMPTS[0], 6) == bmc.generate(model, [PROMPTS[0]], max_new_tokens=6)[0].text
    assert metric(router.url, "bmc:router_instance_restarts_total", "0") == 1


class Running:  # an instance's process, alive (pick() and health() ask it)
    pid, returncode = 4321, None

    def poll(self) -> int | None:
        return self.returncode


def test_health_is_ok_only_once_every_instance_has_started():
    """At start-up /health answers 503 "starting" until every instance has been ready once: answering 200 with one
    instance up sent a benchmark's whole first wave to it (8 of 16 requests queued there behind whole requests, a
    TTFT of 4.5 s, while the other instance finished loading). After start-up, an instance down (crashed,
    restarting) leaves the router serving on the others: 200 "degraded". An instance that crashed while starting
    counts as started, and one still not up STARTUP_GRACE_S after the first came up (a hung load) no longer holds
    the rest back, so /health is never 503 for ever while requests are served."""
    router = Router([[0], [1]], ["--max-num-seqs", "8"], None)
    a, b = router.instances
    a.proc, b.proc = Running(), Running()
    assert router.health()[0] == 503 and router.health()[1]["status"] == "starting"
    router.instance_up(a)  # as watch() does on a's first /health 200
    status, body = router.health()
    assert (status, body["status"]) == (503, "starting") and [i["ready"] for i in body["instances"]] == [True, False]
    router.instance_up(b)
    assert router.health()[0] == 200 and router.health()[1]["status"] == "ok"
    b.proc.returncode = -9  # b died after start-up: a serves alone
    assert router.health()[0] == 200 and router.health()[1]["status"] == "degraded"
    b.ready, b.proc, b.restarts = False, Running(), 1  # restarted, loading
    assert router.health()[0] == 200 and router.health()[1]["status"] == "degraded"
    a.proc.returncode = -9
    assert router.health()[0] == 503 and router.health()[1]["status"] == "unavailable"

    fresh = Router([[0], [1]], ["--max-num-seqs", "8"], None)
    a, b = fresh.instances
    a.proc, b.proc, a.ready, a.came_up = Running(), Running(), True, True
    b.restarts = 1  # b crashed while starting: serve on a
    assert fresh.health()[0] == 200 and fresh.health()[1]["status"] == "degraded"

    hung = Router([[0], [1]], ["--max-num-seqs", "8"], None)  # b alive but never answering: a hung load
    a, b = hung.instances
    a.proc, b.proc = Running(), Running()
    hung.instance_up(a)
    assert hung.health()[1]["status"] == "starting"
    hung.first_up_at -= STARTUP_GRACE_S + 1  # long after the first came up: serve on a, degraded
    assert hung.health()[0] == 200 and hung.health()[1]["status"] == "degraded"


def test_a_request_goes_to_an_instance_with_a_free_row_before_less_work():
    """Least work outstanding, except that an instance already running --max-num-seqs requests is taken only when
    all are: by work alone, a burst of prompts of unequal lengths could send a 9th request to a full instance
    (queued there behind a whole request) while the other had a row free."""
    assert max_num_seqs(["--model", "m", "--max-num-seqs", "8"]) == 8
    assert max_num_seqs(["--max-num-seqs=3"]) == 3 and max_num_seqs(["--model", "m"]) == 8
    router = Router([[0], [1]], ["--max-num-seqs", "8"], None)
    a, b = router.instances
    for inst in (a, b):
        inst.ready, inst.proc = True, Running()
    assert a.alive and b.alive and a.rows == b.rows == 8
    a.outstanding = {k: 250 for k in range(8)}  # full, 2000 tokens of work
    b.outstanding = {k: 300 for k in range(8, 15)}  # a row free, 2100 tokens of work
    assert a.full and not b.full
    assert router.pick() is b
    b.outstanding[15] = 300  # both full: least work again
    assert router.pick() is a
    a.outstanding.pop(0)  # a row free on a, and less work there too
    assert router.pick() is a


def test_core_sets_and_cpu_lists():
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert core_sets_for(2, "0-7|8-15") == [list(range(8)), list(range(8, 16))]
    for bad in ("", "a-b", "3-1", "1,,x"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)
    with pytest.raises(ValueError, match="2 core sets for 3"):
        core_sets_for(3, "0|1")
    cores = physical_core_cpus()
    assert len(cores) == len(set(cores)) and set(cores) <= os.sched_getaffinity(0)
    sets = core_sets_for(1, None)
    assert sets == [cores]
    with pytest.raises(ValueError, match="physical cores"):
        core_sets_for(len(cores) + 1, None)
    nodes = nodes_of(cores)
    assert nodes and all(n >= 0 for n in nodes)
    online = [0]
    if os.path.exists("/sys/devices/system/node/online"):
        with open("/sys/devices/system/node/online") as f:
            online = parse_cpu_list(f.read().strip())
    if len(online) == 1:  # one node: nothing to bind (a machine of several binds in a subprocess: see the CLI)
        assert bind_memory_to(cores) is None


@pytest.mark.parametrize("args, message", [
    (["--instances", "0"], "--instances"),
    (["--instances", "two"], "--instances"),
    (["--instances", "2", "--cpus", "0"], "core sets for 2 instances"),
    (["--instances", "4096"], "--instances"),
    (["--cpus", "x-y"], "--cpus"),
])
def test_bad_instance_arguments_exit_2_with_one_line(args, message, tiny_dir, capsys):
    """In this process (bmc-serve's main, as its entry point calls it): each is refused before anything starts, so
    a real process would cost the test an interpreter and torch's import each (~3 s) for the same lines; a stray
    exception fails the test as a traceback would."""
    from bmc.cli.serve import main

    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(tiny_dir), "--port", "0", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], err


def _server_pss_mib(srv: ServerProcess, requests: int) -> float:
    """PSS summed over the server's processes after `requests` concurrent requests touched every instance."""
    import psutil

    body = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(requests) as pool:
        list(pool.map(lambda _: httpx.post(srv.url + "/v1/completions", json=body, timeout=300).raise_for_status(),
                      range(requests)))
    root = psutil.Process(srv.proc.pid)
    return sum(p.memory_full_info().pss for p in [root, *root.children(recursive=True)]) / 2**20


def _mapping_kib(pid: int, suffix: str) -> tuple[int, int]:
    """(Rss, Pss) in KiB of process `pid`'s mappings of files ending in `suffix`, from /proc/PID/smaps."""
    rss = pss = 0
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line: range perms offset dev inode [path]
                inside = len(head) >= 6 and head[-1].endswith(suffix)
            elif inside and head[0] == "Rss:":
                rss += int(head[1])
            elif inside and head[0] == "Pss:":
                pss += int(head[1])
    return rss, pss


@pytest.mark.slow
@needs_two_cores
def test_two_instances_of_the_real_model_hold_its_weights_once():
    """Two instances of the default model in fp32 (--quant none: 513 MB of weights) behind the router map one weight
    file: the file's pages are resident once (their PSS summed over the instances is what one instance maps), and
    the two together stay under one instance holding its own weights plus a second weightless runtime."""
    import psutil

    one = ServerProcess(["--log-level", "warning", "--no-weights-cache", "--quant", "none"], startup_timeout=300)
    try:
        single = _server_pss_mib(one, 4)
    finally:
        one.stop()
    two = ServerProcess(["--instances", "2", "--quant", "none"], startup_timeout=300)
    try:
        wait_health(two.url, "ok", timeout=300)
        pair = _server_pss_mib(two, 4)
        pids = [p.pid for p in psutil.Process(two.proc.pid).children(recursive=True)
                if "bmc.cli.serve" in " ".join(p.cmdline())]
        maps = [_mapping_kib(pid, ".bmcw") for pid in pids]
    finally:
        two.stop()
    assert len(maps) == 2 and all(rss > 400 * 1024 for rss, _ in maps), maps  # the weights are the mapping's pages
    assert sum(pss for _, pss in maps) <= 1.05 * max(rss for rss, _ in maps), maps  # ... resident once
    weights_mib = min(rss for rss, _ in maps) / 1024
    assert pair <= single + (single - weights_mib) * 1.2, (pair, single, weights_mib)


@needs_two_cores
def test_sigterm_drains_the_router_and_its_instances(tiny_dir):
    """SIGTERM: the request in flight finishes whole, then the router and every instance exit (the router 0). The
    request streams, and SIGTERM goes once its first token is out: it is in flight then, however fast the tiny
    model is (polling /metrics for it raced a 300-token request that could finish between two polls)."""
    import psutil

    srv = ServerProcess(["--instances", "2", "--model", str(tiny_dir)], startup_timeout=180)
    try:
        wait_health(srv.url, "ok")
        children = psutil.Process(srv.proc.pid).children(recursive=True)
        first_token = threading.Event()

        def run() -> dict:
            body = {"prompt": "hi", "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            usage, done = None, False
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    first_token.set()
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    usage = event.get("usage") or usage
            return {"done": done, "usage": usage}

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(run)
            assert first_token.wait(60), "no token streamed"
            assert srv.terminate(60) == 0
            r = fut.result(timeout=60)
        assert r["done"] and r["usage"]["completion_tokens"] == 2000
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive
    finally:
        srv.stop()
