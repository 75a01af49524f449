"""Phi-3/3.5 (fused qkv_proj and gate_up_proj, its sliding window on every layer) from HF directories against HF
transformers: logits on every cache, greedy tokens batched with left padding on the native step and the PyTorch
path, speculative, windowed; RoPE on part of each head and longrope scaling are refused by name."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import bmc
from bmc.errors import UnsupportedModelError
from bmc.kv import KV_STRATEGIES

from .conftest import assert_chunked_logits_match_hf, assert_greedy_matches_hf, hf, save_tiny, transformers
from .test_qwen import PROMPTS


def make_phi3(path: Path, seed: int = 0, **kw) -> Path:
    torch.manual_seed(seed)
    cfg = transformers.Phi3Config(vocab_size=320, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                  original_max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=0, **kw)
    return save_tiny(path, transformers.Phi3ForCausalLM(cfg).eval(), 320)


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory) -> Path:
    return make_phi3(tmp_path_factory.mktemp("phi3"))


@pytest.mark.parametrize("kv", list(KV_STRATEGIES))
def test_logits_match_hf(phi3_dir, kv):
    model, ref = bmc.load(str(phi3_dir)), hf(phi3_dir)
    assert model.config.fused_projections
    assert_chunked_logits_match_hf(model, ref, PROMPTS[0] + [11, 12, 13, 14, 15], kv, split=9)


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch"])
def test_greedy_batch_matches_hf_generate(phi3_dir, monkeypatch, native):
    monkeypatch.setenv("BMC_NATIVE", native)
    assert_greedy_matches_hf(bmc.load(str(phi3_dir)), phi3_dir, PROMPTS, 14)


def test_window_matches_hf(tmp_path):
    path = make_phi3(tmp_path / "w", sliding_window=5)
    model = bmc.load(str(path))
    assert model.config.sliding_window == 5
    assert_greedy_matches_hf(model, path, PROMPTS, 16, [dict(kv="bmc", r=3), dict(kv="iterative")])


def test_partial_rotary_and_longrope_are_refused(tmp_path):
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
        bmc.load(str(make_phi3(tmp_path / "partial", partial_rotary_factor=0.75)))
    long = {"rope_type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6, "rope_theta": 10000.0}
    with pytest.raises(UnsupportedModelError, match="longrope"):
        bmc.load(str(make_phi3(tmp_path / "long", rope_scaling=long)))
