"""Peer engines for bmc-bench, each run in its own virtual environment through a subprocess (their dependencies
pin other torch builds or native libraries; nothing of theirs is imported here).

- llama.cpp through llama-cpp-python: `--llamacpp-python PATH` (that venv's python). The model is the same
  weights as an F32 GGUF, written by `f32_gguf` from the GGUF bmc loads (every metadata field copied, every
  tensor dequantized the way bmc dequantizes it). Batches use llama.cpp's multi-sequence batch API with one KV
  cache per sequence (kv_unified=False: the unified cache is much slower at batch 8 on this machine).
- vLLM's CPU build: `--vllm-python PATH`, on an HF directory written from the same weights.

Both get the same token ids as bmc, generate exactly the requested number of tokens greedily (EOS ignored), and
report per-step timestamps like bmc's engines do."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from .engines import EngineRun

PEER_SCRIPTS = os.path.join(os.path.dirname(__file__), "peer_scripts")


def f32_gguf(src: str, dst: str) -> str:
    """Write `src` (a llama GGUF, any quantization) as an all-F32 GGUF at `dst`; reuses an existing dst."""
    if os.path.exists(dst) and os.path.getmtime(dst) >= os.path.getmtime(src):
        return dst
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(dst + ".part", arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data.reshape([int(n) for n in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(dst + ".part", dst)
    return dst


def hf_dir(model: Any, dst: str) -> str:
    """An HF directory holding the model's weights (for vLLM): the model's own when it came from one, else the
    GGUF converted by transformers, with `architectures` set (vLLM needs it; a GGUF conversion leaves it null)."""
    if not model.path.endswith(".gguf"):
        return model.path
    if os.path.exists(os.path.join(dst, "config.json")):
        return dst
    import torch
    import transformers

    d, f = os.path.split(model.path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    # transformers refuses save_pretrained on a GGUF-loaded model: write its (dequantized) tensors directly
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # one copy; the config says it is tied
    part = dst + ".part"
    os.makedirs(part, exist_ok=True)
    save_file(state, os.path.join(part, "model.safetensors"), metadata={"format": "pt"})
    hf.config.architectures = [type(hf).__name__]
    hf.config.save_pretrained(part)
    cfg_path = os.path.join(part, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)  # the tensors written are plain float32, not GGUF blocks
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=1)
    tok.save_pretrained(part)
    os.replace(part, dst)
    return dst


def run_peer(script: str, python: str, model: str, prompts: list[list[int]], gen_len: int, threads: int,
             env: dict[str, str] | None = None, timeout: float = 3600) -> EngineRun:
    """Run peer_scripts/<script> under `python`; it reads a JSON request and writes tokens + timestamps."""
    with tempfile.TemporaryDirectory() as tmp:
        req, out = os.path.join(tmp, "request.json"), os.path.join(tmp, "result.json")
        with open(req, "w") as f:
            json.dump({"model": model, "prompts": prompts, "gen_len": gen_len, "threads": threads}, f)
        cmd = [python, os.path.join(PEER_SCRIPTS, script), req, out]
        proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise RuntimeError(f"{script} failed (rc {proc.returncode}): " + " | ".join(tail))
        with open(out) as f:
            res: dict[str, Any] = json.load(f)
    return EngineRun(res["engine"], res["tokens"], res["start"], res["steps"], res.get("peak_rss_mb"),
                     res.get("extra", {}))


def check_python(python: str, module: str) -> str | None:
    """None when `python` can import `module`, else why not (for a clear skip message)."""
    if not os.path.exists(python):
        return f"{python} does not exist"
    proc = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True)
    return None if proc.returncode == 0 else f"{python} cannot import {module}: " + proc.stderr.strip()[-200:]


if __name__ == "__main__":  # python -m bmc.bench.peers SRC.gguf DST.gguf
    print(f32_gguf(sys.argv[1], sys.argv[2]))
