"""Read a llama-, qwen2-, qwen3- or phi3-architecture GGUF file as an HF-style config dict, a float32 HF-named state dict and a Tokenizer.

Tensors are dequantized with the `gguf` package; the tokenizer is rebuilt from the vocabulary in the file's
metadata with the `tokenizers` library, the same way transformers' GGUF converter does it, so both tokenize alike.
"""
from __future__ import annotations

import math
import os
import re
from typing import Any, Callable

import numpy as np
import torch

from ..errors import BmcError, ModelLoadError, UnsupportedModelError
from ..tokenizer import Tokenizer
from .gguf_file import GGUFFile
from .quant import GGUF_TYPES, QuantWeight, q5_0_as_q8_0

# GGUF tensor names (llama.cpp) -> HF llama names.
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Phi-3 stores q|k|v and gate|up fused, as its HF checkpoints do (llama.cpp's `phi3`: attn_qkv, and ffn_up holding
# gate then up)
_PHI3_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# arch -> HF model_type. llama.cpp's converter permutes Q/K rows for GGML's interleaved rope in `llama` files only
# (Mistral included); qwen2 keeps HF's rotate-half layout (llama.cpp's llama_model_rope_type: NEOX).
_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma": "gemma", "gemma2": "gemma2",
          "gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "olmoe": "olmoe"}
# mixture-of-experts files (a `llama` file with experts is Mixtral): every expert of a layer in one 3-D tensor
# [E, out, in], the router ffn_gate_inp [E, D], Qwen2-MoE's shared expert as *_shexp; whether the top-k weights are
# renormalised, where the file does not say (`expert_weights_norm`), is llama.cpp's choice for the arch
_EXPERTS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
_MOE_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
              "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
              "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}
# Gemma 2/3's sandwich norms: llama.cpp's ffn_norm is the MLP's input norm there too (HF pre_feedforward_layernorm);
# HF's post_attention_layernorm is the attention output's norm
_GEMMA2_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                 "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# llama.cpp's layer count of the 27B Gemma 2 / 3, whose query scale is hidden / heads instead of head_dim (the
# models' query_pre_attn_scalar, which GGUF does not store: llama.cpp hard-codes the same rule)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_PERMUTED_QK = {"llama"}
_ROPE_FREQS = "rope_freqs.weight"  # llama3 rope scaling baked into per-frequency divisors by llama.cpp
_LONGROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's longrope

# Split regexes of transformers' GGUF converter (integrations/gguf/gguf_tokenizer_mapping.py), keyed by
# `tokenizer.ggml.pre`; any other value gets GPT-2's own byte-level regex, as there.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"], _LLAMA3_SPLIT),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _QWEN2_SPLIT),
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def load_gguf(path: str, *, shapes_only: bool = False, keep_blocks: bool = False
              ) -> tuple[dict[str, Any], dict[str, Any], Tokenizer | None]:
    """(HF LlamaConfig-style dict, float32 state dict with HF names and [out, in] shapes, tokenizer or None).
    shapes_only: the state dict holds tensors on the meta device (names and shapes, nothing read or dequantized),
    for a model whose weights come from its weight file (weight_file.py). keep_blocks: matrices stored as Q8_0,
    Q4_0 or Q4_1 come as QuantWeights of the file's blocks (quant="gguf"), not dequantized."""
    import gguf

    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: no such GGUF file")
    try:
        reader = GGUFFile(path)  # gguf.GGUFReader's fields and tensors, parsed ~25x faster
        meta, tensors = reader.fields, reader.tensors
    except Exception as e:  # the parser fails with assorted errors on a truncated or non-GGUF file
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None

    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise UnsupportedModelError(f"{path}: GGUF architecture {arch!r} is not supported (bmc reads "
                                    f"{', '.join(repr(a) for a in _ARCHS)})")
    config = _config(path, meta, tensors, arch)

    def read(name: str) -> np.ndarray:
        t = tensors[name]
        try:
            # A plain ndarray view: numpy's memmap subclass makes gguf's row-by-row dequantize several times slower.
            w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        except NotImplementedError:
            raise UnsupportedModelError(
                f"{path}: tensor {name} has type {t.tensor_type.name}, which gguf cannot dequantize") from None
        # GGUF lists dims innermost first; HF's [out, in] is that reversed.
        return w.reshape(tuple(int(d) for d in reversed(t.shape)))

    n_layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    expected: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        expected["output.weight"] = (vocab, hidden)
    layer_shapes = {
        "attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
        "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, heads * head_dim),
        "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden), "ffn_down": (hidden, inter),
        "attn_norm": (hidden,), "ffn_norm": (hidden,)}
    layer_names = _LAYER_NAMES
    experts = config.get("num_local_experts", 0)
    if experts:
        E, Ie, S = experts, config["moe_intermediate_size"], config.get("shared_expert_intermediate_size", 0)
        for dense in ("ffn_gate", "ffn_up", "ffn_down"):
            del layer_shapes[dense]
        layer_shapes.update(ffn_gate_inp=(E, hidden), ffn_gate_exps=(E, Ie, hidden), ffn_up_exps=(E, Ie, hidden),
                            ffn_down_exps=(E, hidden, Ie))
        if S:
            layer_shapes.update(ffn_gate_shexp=(S, hidden), ffn_up_shexp=(S, hidden), ffn_down_shexp=(hidden, S),
                                ffn_gate_inp_shexp=(1, hidden))
        mixtral = config["model_type"] == "mixtral"
        layer_names = {**_LAYER_NAMES, **_MOE_NAMES, **({"ffn_gate_inp": "block_sparse_moe.gate"} if mixtral else {})}
    if arch in ("gemma2", "gemma3"):
        layer_shapes.update(post_attention_norm=(hidden,), post_ffw_norm=(hidden,))
        layer_names = _GEMMA2_NAMES
    if arch == "phi3":
        for fused in ("attn_q", "attn_k", "attn_v", "ffn_gate"):
            del layer_shapes[fused]
        layer_shapes.update(attn_qkv=((heads + 2 * kv_heads) * head_dim, hidden), ffn_up=(2 * inter, hidden))
        layer_names = _PHI3_NAMES
    for i in range(n_layers):
        expected.update({f"blk.{i}.{k}.weight": s for k, s in layer_shapes.items()})
        if arch in ("qwen2", "qwen2moe"):  # q/k/v biases
            expected.update({f"blk.{i}.{k}.bias": (layer_shapes[k][0],) for k in ("attn_q", "attn_k", "attn_v")})
        if arch in ("qwen3", "gemma3", "qwen3moe"):  # per-head q/k norms
            expected.update({f"blk.{i}.{k}.weight": (head_dim,) for k in ("attn_q_norm", "attn_k_norm")})
        if arch == "olmoe":  # q/k norms over all heads
            expected.update({f"blk.{i}.attn_q_norm.weight": (heads * head_dim,),
                             f"blk.{i}.attn_k_norm.weight": (kv_heads * head_dim,)})

    missing = [n for n in expected if n not in tensors]
    if missing:
        raise ModelLoadError(f"{path}: missing tensors {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    # Anything else (biases, MoE experts of a Mixtral-as-llama file, ...) would be silently dropped: refuse.
    extra = [n for n in tensors if n not in expected and n != _ROPE_FREQS and n not in _LONGROPE_FACTORS]
    if extra:
        raise UnsupportedModelError(
            f"{path}: tensors bmc's llama does not implement: {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")

    state: dict[str, Any] = {}
    try:
        for name, shape in expected.items():
            m = _LAYER_RE.fullmatch(name)
            if m and m.group(2) in _EXPERTS:  # one 3-D tensor: each expert's matrix under its HF name
                state.update(_expert_matrices(reader, name, shape, config["model_type"], int(m.group(1)),
                                              _EXPERTS[m.group(2)], keep_blocks, shapes_only, read))
                continue
            hf_name = (_TOP_NAMES[name] if m is None
                       else f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}")
            kind = tensors[name].tensor_type.name.lower()
            widen = kind == "q5_0"  # kept as the Q8_0 blocks of the same values (quant.q5_0_as_q8_0)
            if widen:
                kind = "q8_0"
            if keep_blocks and len(shape) == 2 and kind in GGUF_TYPES and shape[1] % GGUF_TYPES[kind].block_values == 0:
                if shapes_only:
                    state[hf_name] = QuantWeight(kind, shape, None)
                    continue
                n_head = (heads if m.group(2) == "attn_q" else kv_heads) if (
                    m and m.group(2) in ("attn_q", "attn_k") and arch in _PERMUTED_QK) else None
                # read when the model takes it: a widened or re-ordered copy lives only while its panels are made
                state[hf_name] = DeferredBlocks(kind, shape, lambda name=name, kind=kind, shape=shape, widen=widen,
                                                n_head=n_head: _read_blocks(reader, name, kind, shape, widen, n_head))
                continue
            if shapes_only:
                state[hf_name] = torch.empty(shape, dtype=torch.float32, device="meta")
                continue
            w = read(name)
            if m and m.group(2) == "ffn_gate_inp_shexp":  # llama.cpp stores the [1, D] gate as a [D] vector too
                w = w.reshape(shape) if w.size == shape[1] else w
            if w.shape != shape:
                raise ModelLoadError(f"{path}: tensor {name} has shape {list(w.shape)}, config implies {list(shape)}")
            if m and m.group(2) in ("attn_q", "attn_k") and arch in _PERMUTED_QK:
                w = _unpermute_rows(w, heads if m.group(2) == "attn_q" else kv_heads)
            if arch in ("gemma", "gemma2", "gemma3") and name.endswith("norm.weight"):
                # llama.cpp's converter stores Gemma's norms as 1 + weight (rounded: the low bits of a small weight
                # are gone); the subtraction is exact for stored values in [0.5, 2] (Sterbenz), so the factor
                # 1 + weight that every path folds back is the file's value, the one HF multiplies by
                w = w.astype(np.float32) - np.float32(1.0)
            # Dequantized arrays are fresh; F32 ones are read-only views of the file's memmap and get copied.
            state[hf_name] = torch.from_numpy(np.require(w, np.float32, ["C", "W"]))
            reader.release(tensors[name].data)
    except (ValueError, IndexError) as e:  # tensor data runs past the end of a truncated file
        raise ModelLoadError(f"{path}: cannot read tensor data ({type(e).__name__}: {e})") from None

    freqs = read(_ROPE_FREQS) if _ROPE_FREQS in tensors else None
    config["rope_scaling"] = _rope_scaling(path, meta, freqs, config["rope_theta"], head_dim, arch)
    if all(n in tensors for n in _LONGROPE_FACTORS):  # Phi-3 128k / Phi-3.5: longrope as llama.cpp's converter
        # writes it (its per-frequency factors as tensors, the attention factor and the pretraining context as keys)
        long, short = (read(n).astype(np.float64).reshape(-1).tolist() for n in _LONGROPE_FACTORS)
        config["rope_scaling"] = {"rope_type": "longrope", "long_factor": long, "short_factor": short,
                                  "original_max_position_embeddings": meta.get(f"{arch}.rope.scaling.original_context_length"),
                                  "attention_factor": meta.get(f"{arch}.rope.scaling.attn_factor")}
    try:
        tokenizer = _tokenizer(path, meta)
    except BmcError:
        raise
    except Exception as e:  # `tokenizers` rejects inconsistent vocabularies/merges with a bare Exception
        raise ModelLoadError(f"{path}: cannot build the tokenizer from its metadata ({e})") from None
    reader.fields.clear()  # the vocabulary's ~100k strings: the tensors' release callbacks keep the reader alive
    return config, state, tokenizer


def _expert_matrices(reader: GGUFFile, name: str, shape: tuple[int, ...], model_type: str, layer: int, which: str,
                     keep_blocks: bool, shapes_only: bool, read: Callable[[str], np.ndarray]) -> dict[str, Any]:
    """Expert e's [out, in] matrix of the 3-D tensor `name` [E, out, in], under the HF name
    moe.expert_names gives it: blocks kept as stored (rows [e * out, (e+1) * out) of the tensor, read when the model
    takes them) or float32 values."""
    from .moe import expert_names

    E, out, k = shape
    slot = ("gate", "up", "down").index(which)
    names = [expert_names(model_type, layer, e)[slot] for e in range(E)]
    kind = reader.tensors[name].tensor_type.name.lower()
    widen = kind == "q5_0"
    kind = "q8_0" if widen else kind
    if keep_blocks and kind in GGUF_TYPES and k % GGUF_TYPES[kind].block_values == 0:
        if shapes_only:
            return {n: QuantWeight(kind, (out, k), None) for n in names}
        return {n: DeferredBlocks(kind, (out, k), lambda e=e: _read_blocks(reader, name, kind, (E * out, k), widen,
                                                                             None, rows=(e * out, (e + 1) * out)))
                for e, n in enumerate(names)}
    if shapes_only:
        return {n: torch.empty((out, k), dtype=torch.float32, device="meta") for n in names}
    w = read(name)
    if w.shape != shape:
        raise ModelLoadError(f"{name}: tensor has shape {list(w.shape)}, config implies {list(shape)}")
    whole = torch.from_numpy(np.require(w, np.float32, ["C", "W"]))
    reader.release(reader.tensors[name].data)
    return {n: whole[e] for e, n in enumerate(names)}


class DeferredBlocks:
    """A matrix's blocks read (and widened or re-ordered) only when the model asks for it (WeightSource._entry):
    a load holds one such copy at a time, not the whole file's worth beside the panels made from them."""

    def __init__(self, kind: str, shape: tuple[int, ...], read: Callable[[], QuantWeight]) -> None:
        self.kind, self.shape, self._read = kind, tuple(shape), read

    def load(self) -> QuantWeight:
        return self._read()


def _read_blocks(reader: GGUFFile, name: str, kind: str, shape: tuple[int, ...], widen: bool,
                 n_head: int | None, rows: tuple[int, int] | None = None) -> QuantWeight:
    """The tensor's blocks as an [N, K] QuantWeight of `shape`; rows: only rows [r0, r1) of it (one expert)."""
    data = reader.tensors[name].data
    blocks = np.asarray(data).reshape(shape[0], -1).view(np.uint8)  # F16 comes as float16
    if rows is not None:
        blocks = blocks[rows[0] : rows[1]]
        shape = (rows[1] - rows[0], shape[1])
    if widen:
        blocks = q5_0_as_q8_0(blocks)
    if n_head is not None:
        blocks = _unpermute_rows(blocks, n_head)
    blocks = np.ascontiguousarray(blocks)
    release = None
    if np.shares_memory(blocks, data):  # a view of the file: its pages dropped once made panels
        release = reader.release
    elif rows is None:  # (an expert's widened copy leaves the tensor's pages to the other experts)
        reader.release(data)
    return QuantWeight(kind, shape, blocks, release=release)


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's converter permute of Q/K rows: it reorders each head's rows from HF's rotate-half layout
    (first half, second half) into interleaved pairs (x0, x_half, x1, x_half+1, ...) for GGML's rope. Inverse of
    its `w.reshape(n_head, 2, d, ...).swapaxes(1, 2)`; transformers undoes it the same way."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _config(path: str, meta: dict[str, Any], tensors: dict[str, Any], arch: str) -> dict[str, Any]:
    def get(key: str, default: Any = ModelLoadError) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is ModelLoadError:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts; llama needs them all equal
        if len(set(kv_heads)) != 1:
            raise UnsupportedModelError(f"{path}: per-layer KV head counts {sorted(set(kv_heads))} not supported")
        kv_heads = kv_heads[0]
    embd = tensors.get("token_embd.weight")
    vocab = meta.get(f"{arch}.vocab_size") or (int(embd.shape[-1]) if embd is not None else None)
    if vocab is None:
        raise ModelLoadError(f"{path}: no {arch}.vocab_size and no token_embd.weight tensor")
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    eos = list(dict.fromkeys(int(e) for e in eos))  # EOT (e.g. <|eot_id|>) also ends a turn in llama.cpp
    extra: dict[str, Any] = _moe_config(path, meta, arch)
    if arch in ("gemma", "gemma2", "gemma3"):
        extra.update(_gemma_config(meta, arch, hidden, heads, int(get("attention.key_length", hidden // heads)),
                                   int(get("block_count"))))
    if arch == "phi3":  # its window, and RoPE on part of each head (Phi-4-mini), which ModelConfig refuses by name
        head_dim = int(get("attention.key_length", hidden // heads))
        extra["sliding_window"] = meta.get("phi3.attention.sliding_window")
        rope_dim = int(get("rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            extra["partial_rotary_factor"] = rope_dim / head_dim
    return {
        "model_type": _ARCHS[arch],
        "architectures": [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
                           "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                           "gemma3": "Gemma3ForCausalLM"}.get(arch, "LlamaForCausalLM")],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(get("attention.key_length", hidden // heads if arch in ("phi3", "gemma", "gemma2", "gemma3")
                            else get("rope.dimension_count", hidden // heads))),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_scaling": None,  # filled in by _rope_scaling once the tensors are read
        "hidden_act": "gelu_pytorch_tanh" if arch.startswith("gemma") else "silu",
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": (eos[0] if len(eos) == 1 else eos) if eos else None,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "attention_bias": False,
        "mlp_bias": False,
    } | extra


def _moe_config(path: str, meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """The HF config fields of a mixture-of-experts file (llama.cpp's expert_* keys), or {} for a dense one."""
    experts = int(meta.get(f"{arch}.expert_count", 0) or 0)
    if not experts:
        if arch in ("qwen2moe", "qwen3moe", "olmoe"):
            raise ModelLoadError(f"{path}: a {arch} file without {arch}.expert_count")
        return {}
    if arch not in _NORM_TOPK:
        raise UnsupportedModelError(f"{path}: experts in a {arch} file are not supported")
    gating = meta.get(f"{arch}.expert_gating_func", 1)
    if gating != 1:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise UnsupportedModelError(f"{path}: expert gating function {gating} (bmc routes by softmax only)")
    if meta.get(f"{arch}.expert_shared_count", 0) and arch != "qwen2moe":
        raise UnsupportedModelError(f"{path}: shared experts in a {arch} file are not supported")
    ff = meta.get(f"{arch}.feed_forward_length")
    expert_ff = int(meta.get(f"{arch}.expert_feed_forward_length", ff or 0))
    out: dict[str, Any] = {
        "model_type": "mixtral" if arch == "llama" else _ARCHS[arch],
        "architectures": [{"llama": "MixtralForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                           "qwen3moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}[arch]],
        "num_local_experts": experts,
        "num_experts_per_tok": int(meta.get(f"{arch}.expert_used_count", 0)),
        "moe_intermediate_size": expert_ff,
        "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", _NORM_TOPK[arch])),
    }
    if arch in ("llama", "olmoe"):  # one width: the experts'
        out["intermediate_size"] = expert_ff
    if arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = int(meta.get(f"{arch}.expert_shared_feed_forward_length", 0))
        out["qkv_bias"] = True
    if arch == "olmoe":
        out["clip_qkv"] = meta.get("olmoe.attention.clamp_kqv")
    return out


def _gemma_config(meta: dict[str, Any], arch: str, hidden: int, heads: int, head_dim: int,
                  layers: int) -> dict[str, Any]:
    """Gemma's HF config fields from llama.cpp's metadata and its defaults (src/models/gemma2.cpp, gemma3.cpp):
    Gemma 2 windows every other layer (4096 unless stored) and caps scores and logits; Gemma 3 windows five of every
    six layers when a window is stored, with its own RoPE base there (10000 unless `rope.freq_base_swa`)."""
    out: dict[str, Any] = {}
    if arch == "gemma":
        return out
    window = meta.get(f"{arch}.attention.sliding_window", 4096 if arch == "gemma2" else None)
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if isinstance(pattern, list):  # per layer: whether it is a window layer
        local = [bool(x) for x in pattern]
    else:
        local = [i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    if window:
        out.update(sliding_window=int(window),
                   layer_types=["sliding_attention" if x else "full_attention" for x in local])
    else:
        out.update(sliding_window=None)
    if arch == "gemma2":
        out.update(attn_logit_softcapping=meta.get("gemma2.attn_logit_softcapping"))
    else:
        out.update(rope_local_base_freq=float(meta.get("gemma3.rope.freq_base_swa", 10000.0)))
    out.update(final_logit_softcapping=meta.get(f"{arch}.final_logit_softcapping"),
               query_pre_attn_scalar=hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim)
    return out


def _rope_scaling(path: str, meta: dict[str, Any], freqs: np.ndarray | None, theta: float,
                  head_dim: int, arch: str = "llama") -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear"))  # older: scale_linear
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    if freqs is None and kind != "llama3":
        if kind in (None, "none", "linear") and (factor is None or factor == 1.0):
            return None
        if kind in (None, "linear"):
            return {"rope_type": "linear", "factor": float(factor)}
        raise UnsupportedModelError(f"{path}: rope scaling type {kind!r} is not supported (linear, llama3)")

    # llama3: llama.cpp's converter writes no metadata for it, only `rope_freqs` = per-frequency divisors
    # 1 (high freq) .. factor (low freq), smoothly interpolated between. Rebuild HF's parameters from those.
    low, high = meta.get(f"{arch}.rope.scaling.low_freq_factor"), meta.get(f"{arch}.rope.scaling.high_freq_factor")
    orig = int(orig or 8192)  # llama.cpp computes rope_freqs with 8192 unless the HF config says otherwise
    if freqs is not None:
        freqs = freqs.astype(np.float64).reshape(-1)
        if freqs.shape[0] != head_dim // 2:
            raise ModelLoadError(f"{path}: {_ROPE_FREQS} has {freqs.shape[0]} entries, expected {head_dim // 2}")
        if np.allclose(freqs, 1.0):
            return None
        factor = float(factor or freqs.max())
        # In the smooth band 1/f = (1 - s)/factor + s with s = (orig/wavelength - low) / (high - low): linear in
        # orig/wavelength, so a line fit through the band gives low and high.
        u = orig * theta ** (-np.arange(0, head_dim, 2) / head_dim) / (2 * math.pi)
        band = (freqs > 1 + 1e-4) & (freqs < factor * (1 - 1e-4))
        if (low is None or high is None) and band.sum() >= 2:
            s = (1 / freqs[band] - 1 / factor) / (1 - 1 / factor)
            slope, intercept = np.polyfit(s, u[band], 1)
            low, high = round(float(intercept), 4), round(float(intercept + slope), 4)
    return {"rope_type": "llama3", "factor": float(factor or 8.0), "low_freq_factor": float(low or 1.0),
            "high_freq_factor": float(high or 4.0), "original_max_position_embeddings": orig}


def _tokenizer(path: str, meta: dict[str, Any]) -> Tokenizer | None:
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as Backend

    kind, tokens = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        return None
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]] if "tokenizer.ggml.merges" in meta else None

    if kind == "gpt2":
        # Byte-level BPE. A token not already spelled in GPT-2's byte alphabet (e.g. a raw special token with a
        # space) is re-spelled into it, and a control token that isn't is a llama.cpp mislabel: not made special.
        alphabet = _bytes_to_unicode()
        spelled = set(alphabet.values())
        vocab = {t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode()): i for i, t in enumerate(tokens)}
        backend = Backend(models.BPE(vocab, merges or [], dropout=None, continuing_subword_prefix="",
                                     end_of_word_suffix="", fuse_unk=False))
        split = _PRE_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else \
            pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        backend.decoder = decoders.ByteLevel()
        specialable = lambda t: set(t) <= spelled  # noqa: E731
    elif kind == "llama":
        # Sentencepiece vocabulary as BPE with byte fallback; merges from the file or derived from the scores.
        vocab = {t: i for i, t in enumerate(tokens)}
        if merges is None:
            merges = _merges_from_scores(vocab, dict(zip(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))))
        backend = Backend(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True, dropout=None))
        # transformers ignores tokenizer.ggml.add_space_prefix (always prepends); we honour a False, as llama.cpp does.
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first" if prefix else "never",
                                                         split=False)
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        backend.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
        specialable = lambda t: True  # noqa: E731
    else:
        raise UnsupportedModelError(f"{path}: tokenizer model {kind!r} is not supported (gpt2, llama)")

    def token(key: str) -> tuple[int | None, str | None]:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return (int(i), tokens[int(i)]) if i is not None and 0 <= int(i) < len(tokens) else (None, None)

    (bos_id, bos), (eos_id, eos), (pad_id, _), (unk_id, _) = token("bos"), token("eos"), token("padding"), token("unknown")
    # Control tokens (and the named special ones) must stay whole and be skippable on decode; user-defined ones
    # (e.g. <think>) stay whole but are ordinary text.
    special_ids = {i for i, t in enumerate(types) if t == _CONTROL and specialable(tokens[i])}
    special_ids |= {i for i in (bos_id, eos_id, pad_id, unk_id) if i is not None and specialable(tokens[i])}
    backend.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True) for i in sorted(special_ids)])
    backend.add_tokens([AddedToken(tokens[i], normalized=False, special=False)
                        for i, t in enumerate(types) if t == _USER_DEFINED])

    # BOS/EOS go in through the post-processor, as transformers does it (so add_bos below stays False).
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")) and bos_id is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    specials = ([(bos, bos_id)] if add_bos else []) + ([(eos, eos_id)] if add_eos and eos != bos else [])
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    eos_ids = list(dict.fromkeys(int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
                                 if k in meta))
    return Tokenizer(backend=backend, bos_token_id=bos_id, eos_token_ids=eos_ids, pad_token_id=pad_id, add_bos=False,
                     chat_template=meta.get("tokenizer.chat_template"), bos_token=bos, eos_token=eos)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (byte-level BPE spells every token with it)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a sentencepiece vocabulary: every split of a token into two tokens, best score first
    (transformers' `generate_merges`, same order, so ties break the same way)."""
    merges: list[tuple[str, str, float]] = []
    for piece, score in scores.items():
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]
