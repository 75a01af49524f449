"""int8 KV with key channel scales (bmc/kv/smoothing.py): keys stored as k / s and queries taken as q * s, s a power
of two per (layer, KV head, channel) measured once per model. On keys with outlier channels (a Qwen2-like model
whose key biases are 40 on two channel pairs) it cuts what int8 moves the logits; the native step and the PyTorch
path agree with it; caches of other scales never exchange rows."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import bmc
from bmc.engine import prefill_alone
from bmc.kv import KV_STRATEGIES
from bmc.kv.smoothing import QUIET_FLOOR, key_scales_for

from .conftest import save_tiny, transformers

OUTLIERS = (3, 17)  # key channels (and their RoPE partners, + head_dim / 2) with a bias of 40
SEQ = [(7 * i + 3) % 300 + 5 for i in range(48)]


@pytest.fixture(scope="module")
def outlier_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 (head_dim 64, GQA) whose key projections have two channel pairs biased to 40, as Qwen2.5's
    are: a per-row int8 scale of about 40 / 127 rounds every other channel of every key to a few levels."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=320, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                   rope_theta=1e4, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                                   pad_token_id=0)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn
            a.q_proj.bias.normal_(0, 0.5)
            a.k_proj.bias.normal_(0, 0.5)
            for c in OUTLIERS:
                for j in (c, c + 32):
                    a.k_proj.bias[j] = 40.0
            a.q_proj.weight.mul_(4.0)  # scores that matter: attention far from uniform
    return save_tiny(tmp_path_factory.mktemp("qwen2-outliers"), model, 320)


def test_scales_are_powers_of_two_shared_by_rope_pairs(outlier_dir):
    model = bmc.load(str(outlier_dir))
    scales = key_scales_for(model)
    assert scales is not None and key_scales_for(model) is scales  # measured once, kept on the model
    s = scales.table
    cfg = model.config
    assert s.shape == (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) and s.dtype == torch.float32
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    assert torch.equal(s[..., :32], s[..., 32:])  # channel j rotates with j + d/2
    for c in OUTLIERS:  # the biased channels get scales ~40 (64), the others far less
        assert (s[..., c] >= 32).all()
    others = [j for j in range(32) if j not in OUTLIERS]
    assert (s[..., others] <= 8).all()
    assert (s >= s.amax(-1, keepdim=True) * QUIET_FLOOR).all()


def _teacher_forced(model, kv_dtype: str) -> torch.Tensor:
    _, logits = prefill_alone(model, SEQ, len(SEQ), all_logits=True, kv_dtype=kv_dtype)
    return logits[0]


def test_channel_scales_cut_what_int8_moves_on_outlier_keys(outlier_dir, monkeypatch):
    """Logits over a sequence with int8 KV against float32 KV: with the scales under a quarter of the deviation
    without them (per-row scales alone), and a live comparison (int8 still moves them)."""
    model = bmc.load(str(outlier_dir))
    ref = _teacher_forced(model, "float32")
    smoothed = (_teacher_forced(model, "int8") - ref).abs().amax()
    monkeypatch.setenv("BMC_KV_SMOOTH", "0")
    assert key_scales_for(model) is None
    plain = (_teacher_forced(model, "int8") - ref).abs().amax()
    assert 0 < smoothed < 0.25 * plain, (float(smoothed), float(plain))


def test_native_step_and_pytorch_path_agree_on_smoothed_keys(outlier_dir, monkeypatch):
    """Prefill, decode and speculative verify with int8 KV and the scales: the native step (which scales q and k in
    C++) gives the PyTorch path's logits and greedy tokens. Its int8 rows widened to float (BMC_INT8_KV_DOTS=0): the
    integer attention differs from the PyTorch path by its own stated bound (tests/test_kv_dtype.py), 5e-4 here."""
    monkeypatch.setenv("BMC_INT8_KV_DOTS", "0")
    model = bmc.load(str(outlier_dir))
    native = _teacher_forced(model, "int8")
    prompts = [SEQ[:20], SEQ[5:12]]
    tokens = [c.token_ids for c in bmc.generate(model, prompts, max_new_tokens=12, ignore_eos=True, kv_dtype="int8")]
    spec = bmc.generate(model, prompts, max_new_tokens=12, ignore_eos=True, kv_dtype="int8", speculative="ngram",
                        tree="chain:3")
    assert [c.token_ids for c in spec] == tokens
    monkeypatch.setenv("BMC_NATIVE", "0")
    torch.testing.assert_close(_teacher_forced(model, "int8"), native, atol=1e-5, rtol=1e-5)
    eager = [c.token_ids for c in bmc.generate(model, prompts, max_new_tokens=12, ignore_eos=True, kv_dtype="int8")]
    assert eager == tokens


def test_rows_never_move_between_caches_of_other_scales(outlier_dir):
    model = bmc.load(str(outlier_dir))
    smoothed, _ = prefill_alone(model, SEQ[:8], 8, kv_dtype="int8")
    assert smoothed.key_scales is key_scales_for(model)
    cfg = model.config
    plain = KV_STRATEGIES["upfront"](num_layers=cfg.num_layers, batch_size=1, num_kv_heads=cfg.num_kv_heads,
                                     head_dim=cfg.head_dim, max_length=16, kv_dtype="int8")
    plain.reserve(8)
    plain.commit(8)
    with pytest.raises(ValueError, match="other channel scales"):
        plain.place(0, smoothed)


def test_float_caches_and_other_families_keep_their_keys(outlier_dir, tiny_dirs):
    """Only int8 caches carry scales; OPT (its own forward) stores int8 keys per row as before."""
    model = bmc.load(str(outlier_dir))
    for kv_dtype in ("float32", "bfloat16"):
        cache, _ = prefill_alone(model, SEQ[:8], 8, kv_dtype=kv_dtype)
        assert cache.key_scales is None
    opt = bmc.load(str(tiny_dirs["opt-pre_norm"]))
    assert key_scales_for(opt) is None


def test_scales_are_measured_once_per_model_and_machine(outlier_dir, monkeypatch, tmp_path):
    """The first load measures and stores them in the cache directory; the next load reads them back (the same
    table) without a calibration prefill; a damaged file is measured again."""
    import bmc.kv.smoothing as smoothing

    monkeypatch.setenv("BMC_CACHE_DIR", str(tmp_path))
    first = key_scales_for(bmc.load(str(outlier_dir))).table
    stored = list(tmp_path.glob("keyscales-*.pt"))
    assert len(stored) == 1

    def no_calibration(model):
        raise AssertionError("measured again")

    monkeypatch.setattr(smoothing, "measure_key_scales", no_calibration)
    assert torch.equal(key_scales_for(bmc.load(str(outlier_dir))).table, first)
    stored[0].write_bytes(b"not a tensor")
    monkeypatch.undo()
    monkeypatch.setenv("BMC_CACHE_DIR", str(tmp_path))
    assert torch.equal(key_scales_for(bmc.load(str(outlier_dir))).table, first)
