#!/usr/bin/env bash
# Issue 27's memory target on a model whose weights are most of a process (a Llama-shaped 1.2B model with random
# float32 weights, 4.9 GB; the SmolLM2 shape's 0.5 GB is outweighed by each process's own ~0.4 GB of Python, torch
# and KV): resident memory (PSS) of one instance holding its weights, one mapping the weights cache, and K = 4
# instances mapping it. Run with the device tool, carry [".whl", ".devcarry"]. Writes $OUT/instances-memory-1b-16core.json.
set -euo pipefail
source bench/device_setup.sh
python3 - <<'PY'
import torch, transformers
cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
                               bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
torch.manual_seed(0)
m = transformers.LlamaForCausalLM(cfg).float()
m.save_pretrained("/tmp/llama-1b-random")
print("params", sum(p.numel() for p in m.parameters()) / 1e9, "B", flush=True)
import shutil
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f".devcarry/smollm2-shape/{f}", "/tmp/llama-1b-random")
PY
python3 bench/instances_memory.py --model /tmp/llama-1b-random --instances 1,4 --requests 4 \
  --out "$OUT/instances-memory-1b-16core.json" 2>&1 | grep -v " INFO "
