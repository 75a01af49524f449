#!/usr/bin/env bash
# kv_dtype on a device host: the GPU tests (CUDA graphs with narrow KV among them) and the kv_dtype tests on this
# CPU's AVX-512 build of the kernels, then long-context decode by KV dtype with all 16 cores (bench/kv_dtype.py on
# a SmolLM2-135M-shaped model with random float32 weights: the real GGUF is over the carry limit, and speed does
# not depend on the values; llama.cpp is not on these hosts). Run with the device tool, carry [".whl", ".devcarry"].
set -euo pipefail
source bench/device_setup.sh
lscpu | grep -E "Model name|^CPU\(s\)" || true
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_kv_dtype.py -m "not slow" 2>&1 | tail -3
python3 bench/kv_dtype.py --model /tmp/smollm2-random --chunks 0 --threads "$(python3 -c 'from bmc.cli.common import physical_cores; print(physical_cores())')" \
  --out "$OUT/kv-dtype-16core.json" 2>&1 | grep -v "^bmc:"
