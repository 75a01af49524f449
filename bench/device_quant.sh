#!/usr/bin/env bash
# Quantized weights on a device host (16-core figures of issue 28, and its GPU and CPU tests): the tests first
# (GPU, quantization, perplexity, Qwen3 and Phi-3 on this CPU's build of the kernels), then bmc's decode tok/s at
# batch 1 and 8 on a SmolLM2-135M-shaped model with random weights (the real GGUF is over the carry limit):
# quant none, q8_0 and q4_0 made at load. llama.cpp is not on these hosts: ratios to it are this machine's only.
# Run with the device tool, carry [".whl", ".devcarry"]. Writes $OUT/quant-decode-16core.json.
set -euo pipefail
source bench/device_setup.sh
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | sed 's/\(Flags:\).*\(avx512[a-z_]*\).*/\1 ... \2 .../' || true
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_quant.py tests/test_perplexity.py \
  tests/test_qwen.py tests/test_phi3.py 2>&1 | tail -3
python3 - <<'PY'
import json, os, torch
dst = "/tmp/smollm2-random"
import bmc
from bmc.cli.common import physical_cores
from bmc.cli.generate import synthetic_prompts
threads = physical_cores()
torch.set_num_threads(threads)
rows = {}
for quant in ("none", "q8_0", "q4_0"):
    m = bmc.load(dst, quant=quant)
    prompts = synthetic_prompts(m, 8, 32)
    bmc.generate(m, prompts[:1], max_new_tokens=4, ignore_eos=True)
    rows[quant] = {"weight_bytes": m.weight_bytes}
    for b in (1, 8):
        rows[quant][f"decode_b{b}"] = max(bmc.generate(m, prompts[:b], max_new_tokens=128, ignore_eos=True)
                                          .stats.decode_tokens_per_s for _ in range(3))
    print(quant, rows[quant], flush=True)
host = open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": \t")
with open(os.path.join(os.environ["OUT"], "quant-decode-16core.json"), "w") as f:
    json.dump({"host": host, "threads": threads, "model": "SmolLM2-135M shape, random weights, HF dir",
               "gen": 128, "prompt": 32, "rows": rows}, f, indent=1)
PY
