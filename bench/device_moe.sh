#!/usr/bin/env bash
# Mixture of experts on a device host (issue 47): the MoE tests on its CPU's build of the kernels and on its GPU,
# then bench/moe.py on a Qwen3-30B-A3B-shaped Q4_0 file (17 GB, written there) on the host's physical cores, bmc
# alone (llama.cpp is not on these hosts). The tokenizer comes from a tokenizer-only GGUF of the default model
# (`python bench/moe.py --tokenizer-only .devcarry/smollm2-tokenizer.gguf` writes it here; the model itself is
# over the carry limit).
# MODES: bmc's modes (bench/moe.py --activations), e.g. "float,int8,int8 BMC_MOE_SPREAD=0"; TESTS_K: a -k filter.
# Run with the device tool, carry [".whl", ".devcarry"]. Writes $OUT/moe-qwen3-30b-a3b.{json,png}.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core" || true
python3 -m pytest -q -p no:cacheprovider tests/test_moe.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tail -3
threads=$(python3 -c "from bmc.cli.common import physical_cores; print(physical_cores())")
python3 bench/moe.py --shape qwen3-30b-a3b --kinds q4_0 --vocab-from .devcarry/smollm2-tokenizer.gguf \
  --threads "$threads" --repeats "${REPEATS:-2}" --tokens "${TOKENS:-32}" --batches 1,8 --dir /tmp/bmc-moe \
  --activations "${MODES:-float,int8}" --out "${OUT:-bench/results/cpu}"
