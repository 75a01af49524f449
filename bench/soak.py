"""Soak test of bmc-serve: many requests of random lengths from concurrent clients, a share cancelled mid-stream
and a share malformed; checks that no well-formed request fails, that the KV in use returns to 0 when idle and
that the server's resident memory stays flat.

    python bench/soak.py --requests 1000 --clients 16        # starts bmc-serve on the default model
    python bench/soak.py --url http://127.0.0.1:8000         # an endpoint already running (no RSS check)
    python bench/soak.py --prefixes 50 --prefix-cache-bytes 20000000   # prompts from 50 shared prefixes, a prefix
                                                             # cache small enough to evict: its bytes stay within it

Writes a JSON summary (bench/results/cpu/soak-<host>.json) and exits 1 if a check fails."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

MALFORMED: list[tuple[str, bytes]] = [
    ("bad json", b"{not json"),
    ("no prompt", json.dumps({"max_tokens": 4}).encode()),
    ("temperature", json.dumps({"prompt": "hi", "temperature": -1}).encode()),
    ("top_p", json.dumps({"prompt": "hi", "top_p": 7}).encode()),
    ("max_tokens", json.dumps({"prompt": "hi", "max_tokens": -3}).encode()),
    ("model", json.dumps({"prompt": "hi", "model": "no-such-model"}).encode()),
    ("context", json.dumps({"prompt": [5] * 9000}).encode()),
    ("prompt type", json.dumps({"prompt": {"x": 1}}).encode()),
]
WORDS = "the a cache memory compute balanced row chunk token model bias padding tree prefix server batch".split()


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def metric(url: str, name: str) -> float:
    return metrics(url, name)[0]


def metrics(url: str, *names: str) -> list[float]:
    """The values of several metrics from one scrape."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return [sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))
            for name in names]


async def one(client: httpx.AsyncClient, url: str, rng: random.Random, args: argparse.Namespace,
              stats: dict[str, Any], kind: str) -> None:
    if kind == "malformed":
        what, body = rng.choice(MALFORMED)
        r = await client.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
        ok = 400 <= r.status_code < 500 and "error" in r.json()
        stats["malformed"] += 1
        stats["malformed_wrong"] += 0 if ok else 1
        if not ok:
            stats["failures"].append(f"malformed {what}: {r.status_code} {r.text[:120]}")
        return
    cancel = kind == "cancel"
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, args.max_prompt_words)))
    if args.prefixes:  # one of the shared prefixes (a system prompt), then the request's own words
        prompt = args.prefix_texts[rng.randrange(args.prefixes)] + " " + prompt
    max_tokens = rng.randint(4 if cancel else 1, args.max_tokens)
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": rng.choice([0.0, 0.0, 0.7]), "seed": rng.randint(0, 1000)}
    if rng.random() < 0.2:
        body["n"] = 2
    # a cancelled stream leaves after 1 .. max_tokens - 1 chunks (logprobs: one chunk per token, none held back)
    stop_after = rng.randint(1, max_tokens - 1) if cancel else None
    if cancel:
        body["logprobs"] = 0
    chunks, done = 0, False
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                stats["failures"].append(f"well-formed got {r.status_code}: {(await r.aread())[:120]!r}")
                return
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                    break
                if line.startswith("data: "):
                    data = json.loads(line[6:])
                    if "error" in data:
                        stats["failures"].append(f"stream error: {data['error']['message'][:120]}")
                        return
                    chunks += 1
                    if stop_after is not None and chunks >= stop_after:
                        break  # leave mid-stream: the server must abort the request
    except httpx.HTTPError as e:
        stats["failures"].append(f"{type(e).__name__}: {e}")
        return
    if cancel and not done:
        stats["cancelled"] += 1
    elif done:
        stats["completed"] += 1
    else:
        stats["failures"].append("stream ended without [DONE]")


async def soak(url: str, args: argparse.Namespace, pid: int | None) -> dict[str, Any]:
    stats: dict[str, Any] = {"completed": 0, "cancelled": 0, "malformed": 0, "malformed_wrong": 0, "failures": [],
                             "prefix_cache_bytes": []}
    rng = random.Random(args.seed)
    n_bad, n_cancel = round(args.requests * args.malformed), round(args.requests * args.cancel)
    kinds = ["malformed"] * n_bad + ["cancel"] * n_cancel + ["plain"] * (args.requests - n_bad - n_cancel)
    rng.shuffle(kinds)  # exact shares, in random order
    left = args.requests
    rss: list[tuple[int, int]] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await one(client, url, rng, args, stats, kinds[left])
            done = args.requests - left
            if pid is not None and done % 50 == 0:
                rss.append((done, rss_kib(pid)))
            if args.prefixes and done % 10 == 0:
                # the budget bounds what running requests do not read in place (pinned bytes are theirs)
                usage, pinned = metrics(url, "bmc:prefix_cache_usage_bytes", "bmc:prefix_cache_pinned_bytes")
                stats["prefix_cache_bytes"].append(usage - pinned)
            if done % 100 == 0:
                print(f"{done} requests sent; completed {stats['completed']}, cancelled {stats['cancelled']}, "
                      f"malformed {stats['malformed']}, failures {len(stats['failures'])}", flush=True)

    t0 = time.time()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=args.clients + 4)) as c:
        await asyncio.gather(*(client_loop(c) for _ in range(args.clients)))
    stats["duration_s"] = time.time() - t0
    deadline = time.time() + 30
    while time.time() < deadline and (metric(url, "bmc:num_requests_running") or metric(url, "bmc:kv_cache_usage_bytes")):
        await asyncio.sleep(0.2)
    stats["idle_running"] = metric(url, "bmc:num_requests_running")
    stats["idle_kv_bytes"] = metric(url, "bmc:kv_cache_usage_bytes")
    if args.prefixes:
        stats["hits"] = metric(url, "bmc:prefix_cache_hits_total")
    stats["rss_kib"] = rss
    return stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url")
    p.add_argument("--model")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--cancel", type=float, default=0.30)
    p.add_argument("--malformed", type=float, default=0.05)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-words", type=int, default=150)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefixes", type=int, default=0, help="prompts start with one of this many shared prefixes")
    p.add_argument("--prefix-words", type=int, default=120, help="words of each shared prefix")
    p.add_argument("--prefix-cache-bytes", type=int, default=None, help="the server's prefix cache budget")
    p.add_argument("--out")
    args = p.parse_args()
    prng = random.Random(args.seed + 1)
    args.prefix_texts = [" ".join(prng.choice(WORDS) for _ in range(args.prefix_words)) for _ in range(args.prefixes)]
    proc, url = None, args.url
    if url is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "bmc.cli.serve", "--port", str(port), "--log-level", "warning",
               "--max-num-seqs", str(args.max_num_seqs)] + (["--model", args.model] if args.model else [])
        if args.prefix_cache_bytes is not None:
            cmd += ["--prefix-cache-bytes", str(args.prefix_cache_bytes)]
        proc = subprocess.Popen(cmd)
        deadline = time.time() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                sys.exit(f"bmc-serve did not start (exit {proc.poll()})")
            time.sleep(0.5)
    try:
        rss0 = rss_kib(proc.pid) if proc else None
        stats = asyncio.run(soak(url, args, proc.pid if proc else None))
        stats["rss_start_kib"] = rss0
        stats["rss_end_kib"] = rss_kib(proc.pid) if proc else None
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            stats_exit = proc.wait(120)
    if proc is not None:
        stats["exit_code"] = stats_exit
    rss = [k for _, k in stats["rss_kib"]]
    half = rss[len(rss) // 2:] if rss else []
    checks = {
        "no well-formed request failed": not stats["failures"],
        "every malformed request got a 4xx error object": stats["malformed_wrong"] == 0,
        "idle: no request running, KV bytes 0": stats["idle_running"] == 0 and stats["idle_kv_bytes"] == 0,
        # flat: the second half of the run grows by under 5 % (the first half includes warm-up allocations)
        "resident memory flat": not half or max(half) <= 1.05 * half[0],
        "SIGTERM exit 0": proc is None or stats["exit_code"] == 0,
    }
    if args.prefixes:
        stats["prefix_cache_hits_tokens"] = hits = stats.pop("hits", None)
        checks["prefix cache within its budget"] = args.prefix_cache_bytes is None or max(
            stats["prefix_cache_bytes"], default=0) <= args.prefix_cache_bytes
        checks["prefix cache hits"] = bool(hits)
    stats["checks"] = checks
    stats["config"] = dict({k: v for k, v in vars(args).items() if k != "prefix_texts"}, host=platform.node(),
                           cpus=os.cpu_count())
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {name}")
    print(f"completed {stats['completed']}, cancelled {stats['cancelled']}, malformed {stats['malformed']}, "
          f"failures {len(stats['failures'])}, {stats['duration_s']:.0f} s; RSS MiB over the run: "
          f"{[round(k / 1024) for k in rss]}")
    out = args.out or os.path.join(os.path.dirname(__file__), "results", "cpu", f"soak-{platform.node()}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(stats, f, indent=1)
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
