"""Qwen2/2.5 (q/k/v biases, no o_proj bias, tied embeddings, optional sliding window) and Qwen3 (per-head q/k
RMSNorm before RoPE, explicit head_dim) from HF directories and GGUF files against HF transformers: logits on every
cache, greedy tokens batched with left padding on the native step and the PyTorch path, under speculative decoding,
with a window on every layer or on some layers only."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import bmc
from bmc.kv import KV_STRATEGIES

from .conftest import (assert_chunked_logits_match_hf, assert_greedy_matches_hf, close_gguf, gguf_from_hf, hf, hf_greedy,
                       save_tiny, transformers)

PROMPTS = [[5, 17, 33, 80, 101, 7, 9, 250, 12], [40, 41, 42], [300, 3, 99, 98, 97, 96, 14]]


def make_qwen2(path: Path, seed: int = 0, family: str = "qwen2", **kw) -> Path:
    torch.manual_seed(seed)
    Config, Model = ((transformers.Qwen3Config, transformers.Qwen3ForCausalLM) if family == "qwen3"
                     else (transformers.Qwen2Config, transformers.Qwen2ForCausalLM))
    extra = dict(head_dim=16) if family == "qwen3" else {}  # Qwen3: head_dim other than hidden / heads
    cfg = Config(**dict(dict(vocab_size=320, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rope_theta=1e6,
                             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra), **kw))
    model = Model(cfg).eval()
    with torch.no_grad():  # HF initialises biases to zero and norms to one: make them matter
        for layer in model.model.layers:
            a = layer.self_attn
            for proj in (a.q_proj, a.k_proj, a.v_proj):
                if proj.bias is not None:
                    proj.bias.normal_(0, 0.5)
            for norm in (getattr(a, "q_norm", None), getattr(a, "k_norm", None)):
                if norm is not None:
                    norm.weight.uniform_(0.5, 1.5)
    return save_tiny(path, model, 320)


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def qwen2_dir(request, tmp_path_factory) -> Path:
    return make_qwen2(tmp_path_factory.mktemp(request.param), family=request.param)


@pytest.mark.parametrize("kv", list(KV_STRATEGIES))
def test_logits_match_hf(qwen2_dir, kv):
    model, ref = bmc.load(str(qwen2_dir)), hf(qwen2_dir)
    cfg = model.config
    assert (cfg.attention_bias, cfg.o_bias, cfg.qk_norm) == ((True, False, False) if cfg.model_type == "qwen2"
                                                            else (False, False, True))
    assert_chunked_logits_match_hf(model, ref, PROMPTS[0] + [11, 12, 13, 14, 15], kv, split=9)


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch"])
def test_greedy_batch_matches_hf_generate(qwen2_dir, monkeypatch, native):
    monkeypatch.setenv("BMC_NATIVE", native)
    model, n = bmc.load(str(qwen2_dir)), 14
    assert (model.net.native_decoder() is None) == (native == "0")  # Qwen3's q/k norms run natively too
    assert_greedy_matches_hf(model, qwen2_dir, PROMPTS, n)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_window_on_every_layer_matches_hf(tmp_path, family):
    path = make_qwen2(tmp_path / "w", family=family, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    model = bmc.load(str(path))
    assert model.config.sliding_window == 4
    assert_greedy_matches_hf(model, path, PROMPTS, 16, [dict(kv="bmc", r=3), dict(kv="iterative")])


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch"])
def test_window_on_some_layers_matches_hf(tmp_path, monkeypatch, native):
    """max_window_layers=1: layer 0 attends everything, layer 1 through the window (the layers' own bias)."""
    monkeypatch.setenv("BMC_NATIVE", native)
    path = make_qwen2(tmp_path / "mixed", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    model = bmc.load(str(path))
    assert (model.config.sliding_window, model.config.local_layers) == (4, (False, True))
    assert_greedy_matches_hf(model, path, PROMPTS, 16, [dict(kv="bmc", r=3), dict(kv="upfront"),
                                                       dict(kv="bmc", speculative="ngram", tree="chain:3")])


def test_window_off_means_none(tmp_path):
    off = bmc.load(str(make_qwen2(tmp_path / "off", use_sliding_window=False, sliding_window=4)))
    assert off.config.sliding_window is None  # released configs: use_sliding_window false, full attention


def write_qwen2_gguf(hf_dir: Path, path: Path) -> None:
    """The tiny HF model as llama.cpp's converter writes a qwen2 GGUF: Q/K rows in HF's order (no permute, NEOX
    rope), q/k/v biases, tied embeddings (no output.weight); F32 tensors, no tokenizer."""
    w, cfg, sd = gguf_from_hf(hf_dir, path)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].numpy())
    w.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())
    for i in range(cfg.num_hidden_layers):
        for hf_name, g in names.items():
            for kind in ("weight", "bias"):
                t = sd.get(f"model.layers.{i}.{hf_name}.{kind}")
                if t is not None:
                    w.add_tensor(f"blk.{i}.{g}.{kind}", t.numpy())
    close_gguf(w)


def test_qwen2_gguf_loads_as_the_hf_directory(qwen2_dir, tmp_path):
    from safetensors.torch import load_file

    from bmc.models.gguf import load_gguf

    path = tmp_path / "qwen2.gguf"
    write_qwen2_gguf(qwen2_dir, path)
    config, state, tokenizer = load_gguf(str(path))
    assert config["model_type"] in ("qwen2", "qwen3") and config["tie_word_embeddings"] and tokenizer is None
    hf_sd = load_file(str(qwen2_dir / "model.safetensors"))
    assert set(state) == set(hf_sd) - {"lm_head.weight"}
    for k, v in state.items():
        assert torch.equal(v, hf_sd[k]), k
    from_gguf, from_dir = bmc.load(str(path)), bmc.load(str(qwen2_dir))
    a = bmc.generate(from_gguf, PROMPTS, max_new_tokens=10, ignore_eos=True)
    b = bmc.generate(from_dir, PROMPTS, max_new_tokens=10, ignore_eos=True)
    assert [c.token_ids for c in a] == [c.token_ids for c in b] == hf_greedy(hf(qwen2_dir), PROMPTS, 10)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_quantized_at_load_native_equals_eager(tmp_path, family):
    """q8_0 at load (hidden 64: whole blocks): every matrix holds what the reference quantizer makes of it, and the
    native step (q/k norms and biases included) gives the PyTorch path's greedy tokens."""
    from bmc.models.quant import quantize

    path = make_qwen2(tmp_path / family, family=family, hidden_size=64, intermediate_size=128)
    model = bmc.load(str(path), quant="q8_0")
    assert all(lin.quant == "q8_0" for lin in model.linears()) and model.net.native_decoder() is not None
    down = transformers.AutoModelForCausalLM.from_pretrained(path).model.layers[1].mlp.down_proj.weight.detach()
    assert torch.equal(model.net.layers[1].down.dense_weight(), quantize(down, "q8_0").dequantize().t())
    native = [c.token_ids for c in bmc.generate(model, PROMPTS, max_new_tokens=12, ignore_eos=True)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BMC_NATIVE", "0")
        eager = [c.token_ids for c in bmc.generate(model, PROMPTS, max_new_tokens=12, ignore_eos=True)]
    assert native == eager
