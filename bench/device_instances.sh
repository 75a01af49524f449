#!/usr/bin/env bash
# bmc-serve --instances K on a device host's CPUs (issue 27's 16-core figures): a SmolLM2-135M-shaped model with
# random weights (speed does not depend on the values; the real GGUF is over the device tool's carry limit), its
# config and tokenizer carried in .devcarry/smollm2-shape, the server's wheels in .whl. Writes $OUT/serve-instances-*.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|NUMA" || true
python3 - <<'PY'
import shutil, torch, transformers
src, dst = ".devcarry/smollm2-shape", "/tmp/smollm2-random"
cfg = transformers.AutoConfig.from_pretrained(src)
torch.manual_seed(0)
transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(dst)
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(f"{src}/{f}", dst)
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
