#!/usr/bin/env bash
# bmc-serve --instances K on a device host's CPUs (issue 27's 16-core figures), on the random SmolLM2-shaped model
# bench/device_setup.sh makes (carry .whl and .devcarry). Writes $OUT/serve-instances-*.
set -euo pipefail
source bench/device_setup.sh
lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|NUMA" || true
python3 - <<'PY'
from bmc.kernels.native import native_module
print("native kernel:", native_module() is not None)
from bmc.server.router import physical_core_cpus
print("physical cores:", physical_core_cpus())
PY
THREADS=$(python3 -c "from bmc.server.router import physical_core_cpus; print(len(physical_core_cpus()))")
python3 bench/serve.py --model /tmp/smollm2-random --engines bmc --bmc-instances "${INSTANCES:-1,2,4,8}" \
  --threads "$THREADS" --max-num-seqs 32 --max-num-batched-tokens 512 --concurrency "${CONCURRENCY:-8,16,32}" \
  --offline-batch 0 --out "$OUT/serve-instances-16core.json" 2>&1 | grep -v " INFO "
python3 bench/instances_memory.py --model /tmp/smollm2-random --instances "${MEMORY_INSTANCES:-1,2,4}" \
  --out "$OUT/instances-memory-16core.json" 2>&1 | grep -v " INFO "
