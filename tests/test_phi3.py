"""Phi-3/3.5 (fused qkv_proj and gate_up_proj, its sliding window on every layer) from HF directories against HF
transformers: logits on every cache, greedy tokens batched with left padding on the native step and the PyTorch
path, speculative, windowed, longrope (HF's dynamic switch, from HF directories and GGUF); RoPE on part of each head
is refused by name."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from packaging.version import Version

import bmc
from bmc.errors import UnsupportedModelError
from bmc.kv import KV_STRATEGIES

from .conftest import (GREEDY_SETTINGS, assert_chunked_logits_match_hf, assert_greedy_matches_hf, close_gguf,
                       gguf_from_hf, hf, hf_greedy, save_tiny, transformers)
from .test_qwen import PROMPTS


def make_phi3(path: Path, seed: int = 0, **kw) -> Path:
    torch.manual_seed(seed)
    cfg = transformers.Phi3Config(**{**dict(vocab_size=320, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                            original_max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
                                            pad_token_id=0), **kw})
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


def test_partial_rotary_is_refused(tmp_path):
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
        bmc.load(str(make_phi3(tmp_path / "partial", partial_rotary_factor=0.75)))


# longrope with a pretraining context of 12 in a context of 128 (attention factor sqrt(1 + ln 10.7 / ln 12) = 1.4):
# PROMPTS[0] (9 tokens) starts short and turns long while it decodes, LONG_PROMPT starts long
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0],
            "long_factor": [2.0, 3.0, 5.0, 8.0, 13.0, 21.0], "rope_theta": 10000.0,
            "original_max_position_embeddings": 12}
LONG_PROMPT = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]


def longrope_reference(path: Path, prompts, n: int) -> list[list[int]]:
    """HF's greedy tokens by its definition of longrope: each token from one forward over the whole sequence so far
    (long factors once it is past the switch). transformers 5.24's generate gives these (checked below where it is
    installed); 5.17's, on the device hosts, gives other tokens after the switch while its forward agrees."""
    ref, out = hf(path), []
    with torch.inference_mode():
        for p in prompts:
            ids = list(p)
            for _ in range(n):
                ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(p):])
    return out


@pytest.fixture(scope="module")
def longrope_dir(tmp_path_factory) -> Path:
    return make_phi3(tmp_path_factory.mktemp("longrope"), rope_scaling=LONGROPE, original_max_position_embeddings=12)


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch"])
def test_longrope_matches_hf(longrope_dir, monkeypatch, native):
    """HF's dynamic longrope: a prompt past the pretraining context is rotated long as a whole, a shorter one
    short until generation passes it. Logits of one forward over 20 tokens (long) within 1e-4 on every cache;
    greedy tokens of prompts on both sides of it, batched, on every cache and under speculation (trees that
    straddle the switch)."""
    monkeypatch.setenv("BMC_NATIVE", native)
    model = bmc.load(str(longrope_dir))
    s = model.config.rope_scaling
    assert s["rope_type"] == "longrope" and s["original_max_position_embeddings"] == 12
    assert abs(s["attention_factor"] - (1 + math.log(128 / 12) / math.log(12)) ** 0.5) < 1e-12
    for kv in KV_STRATEGIES:
        assert_chunked_logits_match_hf(model, hf(longrope_dir), LONG_PROMPT + [3, 4, 5, 6, 7], kv, split=9)
    prompts = [PROMPTS[0], LONG_PROMPT, PROMPTS[1]]
    want = longrope_reference(longrope_dir, prompts, 14)
    for kw in GREEDY_SETTINGS:
        assert [c.token_ids for c in bmc.generate(model, prompts, max_new_tokens=14, ignore_eos=True, **kw)] == want, kw
    if Version(transformers.__version__) >= Version("5.24"):
        assert hf_greedy(hf(longrope_dir), prompts, 14) == want  # its generate recomputes at the switch


def test_longrope_sparq_refused_across_the_switch(longrope_dir):
    model = bmc.load(str(longrope_dir))
    with pytest.raises(bmc.InvalidRequestError, match="longrope's switch"):
        bmc.generate(model, [PROMPTS[0]], max_new_tokens=8, attention="sparq")
    ok = bmc.generate(model, [PROMPTS[0]], max_new_tokens=3, attention="sparq", sparq_r=12, sparq_k=64)
    assert len(ok[0].token_ids) == 3  # on one side of it: fine


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_longrope_served_rows_switch_as_generate_alone(longrope_dir, speculative):
    """In the continuous batch: a long prompt prefilled in chunks of 4 (the first ones inside the pretraining
    context) is rotated long as a whole; short prompts switch while they decode (their KV recomputed in the batch
    cache, drafts stopping at the switch). Each request's tokens equal generate()'s alone, and HF's."""
    from bmc.scheduler import Scheduler

    from .test_scheduler import alone, drive, request

    model = bmc.load(str(longrope_dir))
    sched = Scheduler(model, max_num_seqs=3, max_num_batched_tokens=4 if speculative == "off" else 16, r=4,
                      speculative=speculative)
    prompts = [LONG_PROMPT, PROMPTS[0], PROMPTS[1]]
    reqs = [request(p, 14) for p in prompts]
    drive(sched, {0: [reqs[0][0]], 2: [reqs[1][0]], 3: [reqs[2][0]]}, collectors=[c for _, c in reqs])
    want = longrope_reference(longrope_dir, prompts, 14)
    for (_, col), p, w in zip(reqs, prompts, want):
        assert col.error is None and col.tokens == {0: alone(model, p, 14)} == {0: w}
    assert sched.counters.relongs == 2  # the two short prompts, once each


def write_phi3_gguf(model_dir: Path, path: Path, qtype=None) -> None:
    """A `phi3` GGUF of an HF directory's tensors, named as llama.cpp's converter names them (attn_qkv, ffn_up holding
    gate and up fused, no Q/K permute: Phi-3 rotates halves as HF does); matrices as `qtype` when given."""
    import gguf

    w, cfg, sd = gguf_from_hf(model_dir, path, "phi3")
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    if cfg.sliding_window is not None:
        w.add_sliding_window(cfg.sliding_window)
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "longrope":  # as the converter: factors as tensors, its own attention factor
        orig = rope["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(cfg.max_position_embeddings / orig) / math.log(orig)))
        w.add_tensor("rope_factors_long.weight", torch.tensor(rope["long_factor"], dtype=torch.float32).numpy())
        w.add_tensor("rope_factors_short.weight", torch.tensor(rope["short_factor"], dtype=torch.float32).numpy())

    def put(name: str, t: torch.Tensor) -> None:
        x = t.float().numpy()
        if qtype is not None and x.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, x)

    names = {"self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    put("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf_name, g in names.items():
            put(f"blk.{i}.{g}.weight", sd[f"model.layers.{i}.{hf_name}.weight"])
    close_gguf(w)


@pytest.mark.parametrize("window", [None, 5], ids=["full", "window"])
def test_phi3_gguf_matches_hf(tmp_path, window):
    """A `phi3` GGUF written from the HF tensors loads to the same model: logits and greedy tokens against HF."""
    d = make_phi3(tmp_path / "hf", sliding_window=window)
    path = tmp_path / "phi3.gguf"
    write_phi3_gguf(d, path)
    model = bmc.load(str(path))
    assert model.config.model_type == "phi3" and model.config.fused_projections
    assert model.config.sliding_window == window
    assert_chunked_logits_match_hf(model, hf(d), PROMPTS[0] + [11, 12, 13, 14, 15], "bmc", split=9, window=window)
    assert_greedy_matches_hf(model, d, PROMPTS, 14, [dict(kv="bmc", r=3), dict(kv="upfront")])


def test_longrope_gguf_matches_hf(longrope_dir, tmp_path):
    """A longrope `phi3` GGUF (rope_factors_long/short tensors, attn_factor and the pretraining context as keys)
    loads to the HF directory's RoPE and gives HF's greedy tokens on both sides of the switch."""
    path = tmp_path / "long.gguf"
    write_phi3_gguf(longrope_dir, path)
    model = bmc.load(str(path))
    want = bmc.load(str(longrope_dir)).config.rope_scaling
    got = model.config.rope_scaling
    for key in ("long_factor", "short_factor"):  # float32 in the file, as transformers computes with them
        assert torch.equal(torch.tensor(got[key], dtype=torch.float32), torch.tensor(want[key], dtype=torch.float32))
    assert got["original_max_position_embeddings"] == 12
    assert abs(got["attention_factor"] - want["attention_factor"]) < 1e-6  # stored as float32
    got = bmc.generate(model, [PROMPTS[0], LONG_PROMPT], max_new_tokens=14, ignore_eos=True, kv="bmc", r=3)
    assert [c.token_ids for c in got] == longrope_reference(longrope_dir, [PROMPTS[0], LONG_PROMPT], 14)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0"])
def test_phi3_gguf_quantized_blocks_run_as_stored(tmp_path, qtype):
    """Q8_0 matrices of a phi3 GGUF (hidden 64: whole blocks) stay quantized, fused q|k|v and gate|up included, and
    give the tokens of the same file dequantized; Q5_0 ones are kept as the Q8_0 blocks of the same values."""
    import gguf

    from bmc.models.quant import q5_0_as_q8_0

    x = torch.randn(16, 96).numpy() * 3
    q5 = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q5_0)
    assert (gguf.quants.dequantize(q5_0_as_q8_0(q5), gguf.GGMLQuantizationType.Q8_0)
            == gguf.quants.dequantize(q5, gguf.GGMLQuantizationType.Q5_0)).all()

    torch.manual_seed(0)
    cfg = transformers.Phi3Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                  original_max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    d = save_tiny(tmp_path / "hf64", transformers.Phi3ForCausalLM(cfg).eval(), 320)
    path = tmp_path / "phi3-q8.gguf"
    write_phi3_gguf(d, path, getattr(gguf.GGMLQuantizationType, qtype))
    mq, mf = bmc.load(str(path)), bmc.load(str(path), quant="none")
    assert {L.qkv.quant for L in mq.net.layers} == {L.gate_up.quant for L in mq.net.layers} == {"q8_0"}
    a = bmc.generate(mq, PROMPTS, max_new_tokens=12, ignore_eos=True)
    b = bmc.generate(mf, PROMPTS, max_new_tokens=12, ignore_eos=True)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
