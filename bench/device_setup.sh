# Sourced by bench/device_*.sh on a device host: bmc's server wheels (carried in .whl) into /tmp/site, and a
# SmolLM2-135M-shaped model with random weights at /tmp/smollm2-random (speed does not depend on the values; the
# real GGUF is over the device tool's carry limit), its config and tokenizer carried in .devcarry/smollm2-shape.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 - <<'PY'
import shutil, torch, transformers
src, dst = ".devcarry/smollm2-shape", "/tmp/smollm2-random"
cfg = transformers.AutoConfig.from_pretrained(src)
torch.manual_seed(0)
transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(dst)
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(f"{src}/{f}", dst)
PY
