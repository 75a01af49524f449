"""Qwen2/2.5 (q/k/v biases, no o_proj bias, tied embeddings, optional sliding window) from HF directories against
HF transformers: logits on every cache, greedy tokens batched with left padding on the native step and the
PyTorch path, under speculative decoding, with its window on every layer; a window on some layers only is refused."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import bmc
from bmc.attention import dense_attention
from bmc.engine import prefill_attention
from bmc.errors import UnsupportedModelError
from bmc.kv import KV_STRATEGIES

from .conftest import save_tiny, transformers

PROMPTS = [[5, 17, 33, 80, 101, 7, 9, 250, 12], [40, 41, 42], [300, 3, 99, 98, 97, 96, 14]]


def make_qwen2(path: Path, seed: int = 0, **kw) -> Path:
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=320, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   rope_theta=1e6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                                   pad_token_id=0, **kw)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises biases to zero: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return save_tiny(path, model, 320)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    return make_qwen2(tmp_path_factory.mktemp("qwen2"))


def hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(ref, prompts, n: int) -> list[list[int]]:
    out = []
    for p in prompts:
        g = ref.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
        out.append(g[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("kv", list(KV_STRATEGIES))
def test_logits_match_hf(qwen2_dir, kv):
    model, ref = bmc.load(str(qwen2_dir)), hf(qwen2_dir)
    assert model.config.attention_bias and not model.config.o_bias
    ids = PROMPTS[0] + [11, 12, 13, 14, 15]
    with torch.inference_mode():
        expected = ref(torch.tensor([ids])).logits[0]
        cache = KV_STRATEGIES[kv](num_layers=2, batch_size=1, num_kv_heads=2, head_dim=12, max_length=len(ids),
                                  **({"r": 3} if kv == "bmc" else {}))
        got, start = [], 0
        for chunk in [ids[:9]] + [[t] for t in ids[9:]]:
            t = len(chunk)
            pos = torch.arange(start, start + t)[None]
            start += t
            cache.reserve(t, pos)
            got.append(model.net(torch.tensor([chunk]), pos, cache, prefill_attention(dense_attention, cache, t),
                                 cache.attention_bias(t), all_logits=True)[0])
            cache.commit(t)
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch"])
def test_greedy_batch_matches_hf_generate(qwen2_dir, monkeypatch, native):
    monkeypatch.setenv("BMC_NATIVE", native)
    model, n = bmc.load(str(qwen2_dir)), 14
    expected = hf_greedy(hf(qwen2_dir), PROMPTS, n)
    for kw in [dict(kv="iterative"), dict(kv="upfront"), dict(kv="bmc", r=3), dict(kv="bmc"),
               dict(kv="bmc", speculative="ngram", tree="chain:3")]:
        out = bmc.generate(model, PROMPTS, max_new_tokens=n, ignore_eos=True, **kw)
        assert [c.token_ids for c in out] == expected, kw


def test_window_on_every_layer_matches_hf(tmp_path):
    path = make_qwen2(tmp_path / "w", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    model = bmc.load(str(path))
    assert model.config.sliding_window == 4
    expected = hf_greedy(hf(path), PROMPTS, 16)
    for kw in [dict(kv="bmc", r=3), dict(kv="iterative")]:
        out = bmc.generate(model, PROMPTS, max_new_tokens=16, ignore_eos=True, **kw)
        assert [c.token_ids for c in out] == expected, kw


def test_window_on_some_layers_is_refused_and_off_means_none(tmp_path):
    with pytest.raises(UnsupportedModelError, match="max_window_layers"):
        bmc.load(str(make_qwen2(tmp_path / "mixed", use_sliding_window=True, sliding_window=4, max_window_layers=1)))
    off = bmc.load(str(make_qwen2(tmp_path / "off", use_sliding_window=False, sliding_window=4)))
    assert off.config.sliding_window is None  # released configs: use_sliding_window false, full attention
