#!/usr/bin/env bash
# The one-GPU device host: its 16-core Xeon (AMX) for issue 44's bfloat16 figures and its GPU for issue 48's, in
# stages (each bounded by its own timeout; a failed one does not stop the next). Run with the device tool, carry
# [".whl"]. Logs and JSON under $OUT.
#   bash bench/device_one.sh build        # the C++ kernel's build alone (over 200 s on that Xeon in session 39)
#   bash bench/device_one.sh bf16-tests   # tests/test_bf16_arith.py on the Xeon's build (AMX), then with BMC_AMX=0
#   bash bench/device_one.sh bf16-bench   # bench/bf16_prefill.py --decode ${DECODE:-64} (TinyLlama shape, 16 threads)
#   bash bench/device_one.sh int8-gemm    # bench/int8_gemm.py: bmc's VNNI int8 GEMMs against torch._int_mm (AMX-INT8)
#   bash bench/device_one.sh gpu-sdpa     # the attention determinism test (and with cuDNN: it should fail),
#                                         # bench/gpu_sdpa.py, bench/gpu_determinism.py --modes default,no-ahead
#   bash bench/device_one.sh gpu-attn     # the Triton decode attention's tests, bench/gpu_sdpa.py (it, SDPA, cuDNN)
#   bash bench/device_one.sh gpu-attn-configs  # bench/gpu_attn_configs.py: the decode attention's launch choices
#   bash bench/device_one.sh gpu-b1       # bench/gpu.py, 7B shape batch 1 (HF in the run), then --quant none,q8_0,q4_0
#   bash bench/device_one.sh gpu-gemv     # bench/gpu_quant.py at M = 1 (the GEMVs' block shapes), the quantized tests
#   bash bench/device_one.sh gpu-tests    # tests/test_gpu.py and tests/test_graph_arena.py, whole
#   bash bench/device_one.sh gpu-i8x      # bench/gpu_i8x.py: a Q4_0 GEMV with int8 activations (dp4a), M = 1
#   bash bench/device_one.sh gpu-int8     # activations="int8" on CUDA: its tests, then bench/gpu.py --quant
#                                         # none,q8_0,q8_0+int8,q4_0,q4_0+int8 (7B shape, batch $B, default 1;
#                                         # $QUANTS another list, e.g. with /off rows: kernels launched in turn)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
lscpu | grep -E "Model name|^CPU\(s\)" || true
grep -o -w -E "amx_bf16|amx_tile|avx512_bf16" /proc/cpuinfo | sort -u | tr '\n' ' '; echo
for stage in "$@"; do
  t0=$(date +%s)
  case $stage in
    build)
      timeout ${T_BUILD:-420} python3 -c "from bmc.kernels.native import native_module as m; print(m().bf16_path())" \
        2>&1 | tail -2 ;;
    bf16-tests)
      timeout ${T_TESTS:-240} python3 -m pytest -q -p no:cacheprovider -rs tests/test_bf16_arith.py 2>&1 \
        | tee "$OUT/bf16-tests-amx.log" | tail -4
      BMC_AMX=0 timeout ${T_TESTS:-240} python3 -m pytest -q -p no:cacheprovider -rs tests/test_bf16_arith.py \
        -k "attention or chunk or bound" 2>&1 | tee "$OUT/bf16-tests-noamx.log" | tail -4 ;;
    bf16-bench)
      timeout ${T_BENCH:-420} python3 bench/bf16_prefill.py --out "$OUT/bf16" --decode ${DECODE:-64} --repeats ${REPEATS:-3} 2>&1 \
        | grep -v -E "Warning|it/s" | tee "$OUT/bf16-bench.log" ;;
    int8-gemm)
      timeout ${T_BENCH:-420} python3 bench/int8_gemm.py --out "$OUT/int8-gemm" 2>&1 | grep -v Warning \
        | tee "$OUT/int8-gemm.log" ;;
    gpu-sdpa)
      timeout 60 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py -k same_bits 2>&1 \
        | tee "$OUT/sdpa-test.log" | tail -3
      BMC_CUDA_SDPA=cudnn timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k same_bits 2>&1 \
        | tee "$OUT/sdpa-test-cudnn.log" | tail -3
      timeout ${T_SDPA:-150} python3 bench/gpu_sdpa.py --gen 128 --caps 384,4096 --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/gpu-sdpa.log"
      timeout 100 python3 bench/gpu_determinism.py --modes default --out "$OUT" 2>&1 | grep -v Warning \
        | tee "$OUT/determinism.log" ;;
    gpu-attn)
      timeout ${T_TESTS:-200} python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py \
        -k "decode_attention or same_bits or fused" 2>&1 | tee "$OUT/attn-tests.log" | tail -5
      timeout ${T_SDPA:-240} python3 bench/gpu_sdpa.py --gen 128 --caps 384,4096 --out "$OUT" 2>&1 | grep -v Warning \
        | tee "$OUT/gpu-sdpa.log" ;;
    gpu-i8x)
      timeout ${T_I8X:-420} python3 bench/gpu_i8x.py --out "$OUT/gpu-i8x" 2>&1 | grep -v Warning \
        | tee "$OUT/gpu-i8x.log" ;;
    gpu-int8)
      timeout ${T_TESTS:-300} python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py \
        -k "int8 or triton_gemv or int4 or quantized or fused or launched_ahead or decode_attention" 2>&1 | tee "$OUT/int8-tests.log" | tail -8
      timeout ${T_Q:-480} python3 bench/gpu.py --quant ${QUANTS:-none,q8_0,q8_0+int8,q4_0,q4_0+int8} --batch ${B:-1} \
        --total 384 --prompt 128 --repeats 2 --graph-warmup --no-hf --engines bmc --no-iterative --out "$OUT/int8" \
        2>&1 | grep -v Warning | tail -25 | tee "$OUT/gpu-int8-B${B:-1}.log" ;;
    gpu-attn-configs)
      timeout ${T_CONF:-420} python3 bench/gpu_attn_configs.py --out "$OUT" 2>&1 | grep -v Warning \
        | tee "$OUT/gpu-attn-configs.log" ;;
    gpu-b1)
      timeout ${T_B1:-240} python3 bench/gpu.py --batch 1 --total 384 --prompt 128 --repeats 2 --graph-warmup \
        --engines bmc --no-iterative --out "$OUT" 2>&1 | grep -v Warning | tail -25 | tee "$OUT/gpu-b1.log"
      timeout ${T_Q:-200} python3 bench/gpu.py --quant none,q8_0,q4_0 --batch 1 --total 384 --prompt 128 \
        --repeats 2 --graph-warmup --no-hf --engines bmc --no-iterative --out "$OUT/quant" 2>&1 | grep -v Warning \
        | tail -25 | tee "$OUT/gpu-quant.log" ;;
    gpu-gemv)
      timeout ${T_GEMV:-330} python3 bench/gpu_quant.py --Ms ${GEMV_MS:-1} --quick --out "$OUT/gpu-quant" 2>&1 | grep -v Warning \
        | tee "$OUT/gpu-quant-m1.log"
      timeout ${T_TESTS:-120} python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py \
        -k "quantized or triton or int4 or int8 or gguf" 2>&1 | tee "$OUT/quant-tests.log" | tail -5 ;;
    gpu-tests)
      timeout ${T_TESTS:-400} python3 -m pytest -q -p no:cacheprovider -rs -x tests/test_gpu.py tests/test_graph_arena.py \
        2>&1 | tee "$OUT/gpu-tests.log" | tail -8 ;;
  esac
  echo "== stage $stage: $(( $(date +%s) - t0 )) s"
done
