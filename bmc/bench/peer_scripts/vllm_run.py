"""Greedy decoding with vLLM's CPU build, run in its own venv by bmc-bench: `python vllm_run.py req.json out.json`.
Imports nothing from bmc. vLLM returns whole completions, so the prefill is timed by a separate 1-token run and
the decode time is the full run's minus it; per-step latencies are not available.
Environment as the peers' setup found it on this machine: VLLM_CPU_KVCACHE_SPACE=2, both cores bound,
gpu_memory_utilization=0.3 (the VM's NUMA node reports ~9.5 GiB)."""
import json
import os
import resource
import sys
import time


def main(req_path: str, out_path: str) -> None:
    req = json.load(open(req_path))
    prompts, G, threads = req["prompts"], req["gen_len"], req["threads"]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    P = max(len(p) for p in prompts)
    llm = LLM(model=req["model"], dtype="float32", max_model_len=P + G + 8, gpu_memory_utilization=0.3,
              max_num_seqs=max(len(prompts), 1), seed=0)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate(inputs, SamplingParams(max_tokens=4, **greedy), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    llm.generate(inputs, SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
    prefill = time.perf_counter() - t
    start = time.perf_counter()
    outs = llm.generate(inputs, SamplingParams(max_tokens=G, **greedy), use_tqdm=False)
    end = time.perf_counter()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    json.dump({"engine": "vllm", "tokens": tokens, "start": start, "steps": [start + prefill, end],
               "peak_rss_mb": rss, "extra": {"decode_steps": G - 1, "prefill_timed_separately": True}},
              open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
