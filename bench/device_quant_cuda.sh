#!/usr/bin/env bash
# Quantized weights on CUDA (issue 28): the GPU tests (quant="gguf" through torch ops included), then
# bench/quant_cuda.py on a SmolLM2-135M-shaped model with random weights (the real GGUF is over the carry limit):
# torch's low-bit GEMMs against dequantize-then-GEMM on its shapes, and decode tok/s and memory per quant and dtype.
# Run with the device tool, carry [".whl", ".devcarry"]. Writes $OUT/quant-cuda.json and .png.
set -euo pipefail
source bench/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "quantized or graph_buckets" 2>&1 | tail -3 || true
python3 bench/quant_cuda.py --model /tmp/smollm2-random --out "$OUT/quant-cuda.json"
