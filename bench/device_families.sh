#!/usr/bin/env bash
# Model families on a device host (issue 30): the GPU tests (every family on CUDA: caches, graphs, speculative;
# Gemma's windows and soft-caps, Phi-3's longrope switch) and the family/path tests on this CPU's build of the
# kernels, then bench/families.py on the host's physical cores (decode tok/s of each family against a Llama of
# the same shapes: a dedicated 16-core machine is less noisy than the 2-core VM).
# Run with the device tool, carry [".whl", ".devcarry"]. Writes $OUT/families-16core.json and .png.
set -euo pipefail
source bench/device_setup.sh
lscpu | grep -E "Model name|^CPU\(s\)" || true
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_gemma.py tests/test_phi3.py tests/test_qwen.py \
  2>&1 | tail -3
threads=$(python3 -c "from bmc.cli.common import physical_cores; print(physical_cores())")
python3 bench/families.py --threads "$threads" --out "$OUT/families-16core.json" 2>&1 | grep -v Warning
