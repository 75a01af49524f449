#!/usr/bin/env bash
# Tensor parallelism on a multi-GPU device host (issue 48, items 1 and 4), run with the device tool (carry .whl):
#   bash bench/device_tp.sh tests     # the TP GPU tests (tp=2, and tp=4 where 4 GPUs are there)
#   bash bench/device_tp.sh 7b        # bench/gpu_tp.py, Llama-2-7B shape, tp=1,2[,4], batch 1 and 32, profiled
#   bash bench/device_tp.sh 70b       # bench/gpu_tp.py, Llama-2-70B shape, tp=4 (or 2 on H200s), batch 1 and 32
#   bash bench/device_tp.sh suite     # the GPU tests: tests/test_gpu.py, test_graph_arena.py, test_tp.py -m gpu
#   bash bench/device_tp.sh ahead     # the GPU test of steps run ahead (tests/test_gpu.py -k run_ahead)
#   bash bench/device_tp.sh determinism  # bench/gpu_determinism.py: bf16 batch-32 decode run to run, per mode
# 7b and 70b run each batch with run_ahead on and off (--no-ahead-too).
# Stages in the order given; each bounded by its own timeout, a failed one does not stop the next. Logs and JSON
# under $OUT. NVLink multicast stays off (the hosts require it).
set -uo pipefail
# .whl: the wheels the image lacks for the server and tests (bench/device_wheels.sh); .whl2, where carried, more
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  $(ls .whl2/*.whl 2>/dev/null)
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
       NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
N=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
nvidia-smi topo -m 2>/dev/null | head -$((N + 1))
TPS=1,2
[ "$N" -ge 4 ] && TPS=1,2,4
BIG=4
[ "$N" -lt 4 ] && BIG=$N
for stage in "$@"; do
  t0=$(date +%s)
  case $stage in
    tests) timeout ${T_TESTS:-300} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_tp.py -rs 2>&1 \
             | tee "$OUT/tp-tests.log" | tail -12 ;;
    7b) timeout ${T_7B:-300} python3 bench/gpu_tp.py --shape 7b --tps $TPS --batches 1,32 --profile --no-ahead-too \
          --out "$OUT/gpu-tp-7b.json" 2>&1 | grep -v Warning | tee "$OUT/gpu-tp-7b.log" ;;
    70b) timeout ${T_70B:-300} python3 bench/gpu_tp.py --shape 70b --tps $BIG --batches 1,32 --no-ahead-too \
           --out "$OUT/gpu-tp-70b.json" 2>&1 | grep -v Warning | tee "$OUT/gpu-tp-70b.log" ;;
    ahead) timeout ${T_AHEAD:-120} python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py -k run_ahead 2>&1 \
             | tee "$OUT/ahead-tests.log" | tail -4 ;;
    suite) timeout ${T_SUITE:-480} python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py \
             tests/test_graph_arena.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -8
           timeout ${T_TESTS:-300} python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_tp.py 2>&1 \
             | tee "$OUT/tp-tests.log" | tail -8 ;;
    determinism) timeout ${T_DET:-400} python3 bench/gpu_determinism.py --out "$OUT" 2>&1 | grep -v Warning \
                   | tee "$OUT/determinism.log" ;;
  esac
  echo "== stage $stage: $(( $(date +%s) - t0 )) s"
done
