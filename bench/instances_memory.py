"""Resident memory of bmc-serve with K instances against one (issue 27: K instances' memory within 1.2x of one
instance, the weights shared). Starts each configuration, sends every instance requests so its weights and
kernels are touched, then sums the proportional set size (PSS: a shared page counts 1/n in each of the n
processes mapping it) over the server's processes. Writes JSON beside the other results.

    python bench/instances_memory.py --instances 1,2 [--model PATH]"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import signal
import subprocess
import sys
import time

import httpx
import psutil

from bmc.platform.ports import free_port



def measure(k: int, share: bool, model: str | None, requests: int) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "bmc.cli.serve", "--port", str(port), "--log-level", "warning", "--instances", str(k)]
    cmd += ["--model", model] if model else []
    cmd += [] if share else ["--no-weights-cache"]
    proc = subprocess.Popen(cmd, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                h = httpx.get(url + "/health", timeout=2)
                if h.status_code == 200 and h.json().get("status", "ok") == "ok":
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"bmc-serve --instances {k} did not start")
            time.sleep(0.5)
        body = {"prompt": "The capital of France is", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(requests) as pool:
            list(pool.map(lambda _: httpx.post(url + "/v1/completions", json=body, timeout=300).raise_for_status(),
                          range(requests)))
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        info = [p.memory_full_info() for p in procs]
        return {"instances": k, "shared_weights": share or k > 1, "processes": len(procs),
                "pss_mib": sum(m.pss for m in info) / 2**20, "rss_mib": sum(m.rss for m in info) / 2**20,
                "uss_mib": sum(m.uss for m in info) / 2**20,
                "per_process_rss_mib": [round(m.rss / 2**20) for m in info]}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--instances", default="1,2")
    p.add_argument("--requests", type=int, default=8, help="concurrent requests before measuring")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu",
                                                 f"instances-memory-{platform.node()}.json"))
    args = p.parse_args()
    rows = [measure(1, False, args.model, args.requests)]
    for k in [int(x) for x in args.instances.split(",") if x]:
        rows.append(measure(k, True, args.model, args.requests))
    base = rows[0]["pss_mib"]
    for r in rows:
        r["pss_vs_one_unshared"] = r["pss_mib"] / base
        print(f"instances {r['instances']} shared {r['shared_weights']!s:5}: PSS {r['pss_mib']:7.0f} MiB "
              f"({r['pss_vs_one_unshared']:.2f}x one unshared instance), RSS {r['rss_mib']:7.0f} MiB over "
              f"{r['processes']} processes", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus", "rows": rows}, f,
                  indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
