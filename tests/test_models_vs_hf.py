"""bmc's Llama and OPT against HF transformers on the same (tiny, random) weights."""
from __future__ import annotations

import pytest
import torch

import bmc
from bmc.attention import SparQAttention, SparQOptions, causal_attention, dense_attention
from bmc.engine import prefill_attention
from bmc.kernels.native import NATIVE_MAX_T
from bmc.kv import KV_STRATEGIES

from .conftest import LLAMA_VARIANTS, OPT_VARIANTS, make_llama, make_opt, transformers

VARIANTS = [f"llama-{v}" for v in LLAMA_VARIANTS] + [f"opt-{v}" for v in OPT_VARIANTS]
PROMPTS = [[5, 17, 33, 80, 101, 7, 9, 250, 12], [40, 41, 42], [300, 2 + 1, 99, 98, 97, 96]]


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def bmc_logits_incremental(model, ids: list[int], kv: str, split: int) -> torch.Tensor:
    """Prefill ids[:split], then feed the rest one token at a time; all logits [len(ids), V]."""
    cache = KV_STRATEGIES[kv](num_layers=model.config.num_layers, batch_size=1, num_kv_heads=model.config.num_kv_heads,
                              head_dim=model.config.head_dim, max_length=len(ids), dtype=model.dtype, **({"r": 3} if kv == "bmc" else {}))
    out = []
    chunks = [ids[:split]] + [[t] for t in ids[split:]]
    with torch.inference_mode():
        for chunk in chunks:
            t = len(chunk)
            start = cache.length
            cache.reserve(t)
            pos = torch.arange(start, start + t)[None]
            logits = model.net(torch.tensor([chunk]), pos, cache, dense_attention, cache.attention_bias(t), all_logits=True)
            cache.commit(t)
            cache.check_integrity()
            out.append(logits[0])
    return torch.cat(out)


def assert_logits_match(ref, path, ids: list[int], kv: str, split: int) -> None:
    """bmc's logits (prefill ids[:split], then one token at a time) equal HF's full forward within 1e-4."""
    with torch.inference_mode():
        expected = ref(torch.tensor([ids])).logits[0]
    got = bmc_logits_incremental(bmc.load(str(path)), ids, kv, split=split)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kv", list(KV_STRATEGIES))
def test_logits_match_hf(tiny_dirs, variant, kv):
    path = tiny_dirs[variant]
    assert_logits_match(hf_model(path), path, PROMPTS[0] + [11, 12, 13, 14, 15], kv, split=len(PROMPTS[0]))


@pytest.mark.parametrize("variant", VARIANTS)
def test_causal_prefill_matches_masked_and_hf(tiny_dirs, variant, monkeypatch):
    """An 87-token prefill into a BMC cache with spare capacity, on the eager path (BMC_NATIVE=0): attention with
    is_causal over the new keys (what generate() picks for an unpadded prefill) gives HF's logits and those of
    the masked attention over the whole capacity; the native step (which prefills prompts of up to NATIVE_MAX_T
    tokens, reading the causal bias) gives HF's logits too."""
    path = tiny_dirs[variant]
    model = bmc.load(str(path))
    g = torch.Generator().manual_seed(len(variant))
    ids = torch.randint(3, model.config.vocab_size, (1, 87), generator=g)
    t = ids.shape[1]
    assert t <= NATIVE_MAX_T
    with torch.inference_mode():
        expected = hf_model(path)(ids).logits[0]
        got = {}
        for native in ("0", "1"):
            monkeypatch.setenv("BMC_NATIVE", native)
            for fn in (causal_attention, dense_attention):
                cache = KV_STRATEGIES["bmc"](num_layers=model.config.num_layers, batch_size=1, r=32,
                                             num_kv_heads=model.config.num_kv_heads, head_dim=model.config.head_dim,
                                             max_length=t + 10, dtype=model.dtype)
                cache.reserve(t)
                assert cache.capacity > t  # masked columns beyond the prompt, which is_causal must not see
                got[native, fn] = model.net(ids, torch.arange(t)[None], cache, fn, cache.attention_bias(t),
                                            all_logits=True)[0]
    torch.testing.assert_close(got["0", causal_attention], expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got["0", causal_attention], got["0", dense_attention], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["1", dense_attention], expected, atol=1e-4, rtol=1e-4)


def test_prefill_attention_is_causal_only_for_an_empty_unpadded_cache(gqa_dir):
    model = bmc.load(str(gqa_dir))
    cfg = model.config

    def cache(left_pad):
        return KV_STRATEGIES["upfront"](num_layers=cfg.num_layers, batch_size=len(left_pad), left_pad=left_pad,
                                        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_length=16)

    assert prefill_attention(dense_attention, cache([0, 0]), 4) is causal_attention
    assert prefill_attention(dense_attention, cache([0, 3]), 4) is dense_attention  # left padding needs the mask
    used = cache([0])
    used.reserve(4)
    used.commit(4)
    assert prefill_attention(dense_attention, used, 4) is dense_attention  # a second chunk sees earlier keys
    sparq = SparQAttention(cache([0]), SparQOptions(), cfg.group_size)
    assert prefill_attention(sparq, cache([0]), 4) is sparq


@pytest.mark.parametrize("variant", ["llama-gqa", "llama-mqa", "llama-llama3_rope", "opt-projected", "opt-pre_norm"])
def test_greedy_batch_matches_hf_generate_and_all_strategies(tiny_dirs, variant):
    path = tiny_dirs[variant]
    model, ref = bmc.load(str(path)), hf_model(path)
    n = 12
    expected = []
    for p in PROMPTS:  # HF one prompt at a time: no padding involved in the reference
        g = ref.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                         pad_token_id=0, eos_token_id=None)
        expected.append(g[0, len(p):].tolist())
    configs = [dict(kv="iterative"), dict(kv="upfront"), dict(kv="bmc", r=1), dict(kv="bmc", r=2),
               dict(kv="bmc", r=5), dict(kv="bmc", r=64), dict(kv="bmc", T=4), dict(kv="bmc")]
    for kw in configs:
        out = bmc.generate(model, PROMPTS, max_new_tokens=n, ignore_eos=True, **kw)
        assert [c.token_ids for c in out] == expected, kw


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
def test_formats_load_identically(tmp_path, safe):
    path = make_llama(tmp_path / "m", "gqa", seed=3, safe=safe)
    assert_logits_match(hf_model(path), path, PROMPTS[0], "bmc", split=len(PROMPTS[0]))


def test_sharded_safetensors(tmp_path):
    torch.manual_seed(5)
    cfg = transformers.OPTConfig(vocab_size=320, hidden_size=48, ffn_dim=96, num_hidden_layers=3,
                                 num_attention_heads=4, max_position_embeddings=64)
    ref = transformers.OPTForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert_logits_match(ref, tmp_path, PROMPTS[2], "iterative", split=len(PROMPTS[2]))


@pytest.mark.parametrize("variant", ["llama-gqa", "opt-projected"])
def test_bfloat16_runs_and_tracks_float32(tiny_dirs, variant):
    ids, path = PROMPTS[0], str(tiny_dirs[variant])
    f32 = bmc_logits_incremental(bmc.load(path), ids, "bmc", split=4)
    bf16 = bmc_logits_incremental(bmc.load(path, dtype="bfloat16"), ids, "bmc", split=4)
    assert bf16.dtype == torch.float32  # logits are always returned in float32
    # bf16 keeps 8 bits of mantissa (0.4 %): the tiny models measured 0.3-0.7 % of the largest logit; 2 % leaves
    # about 3x room
    assert (bf16 - f32).abs().max() < 0.02 * f32.abs().max()


@pytest.mark.skipif(not bmc.models.ops.mkl_packing_available(torch.device("cpu"), torch.float32),
                    reason="this torch build has no MKL packed GEMM")
@pytest.mark.parametrize("variant", ["llama-gqa", "llama-bias_headdim_tied", "opt-projected"])
def test_mkl_packed_weights_match_hf(tiny_dirs, variant, monkeypatch):
    """Decode GEMMs through MKL-packed weights (the eager path's, used at batch >= 2 on long runs when the native
    step is off or does not apply) keep HF's logits and tokens."""
    monkeypatch.setenv("BMC_NATIVE", "0")
    path = tiny_dirs[variant]
    model, ref = bmc.load(str(path)), hf_model(path)
    plain = bmc.generate(model, PROMPTS[:2], max_new_tokens=8, ignore_eos=True)
    model.pack_for_batch(2)
    assert all(lin.packed is not None for lin in model.linears())
    ids = PROMPTS[0] + [11, 12, 13]
    with torch.inference_mode():
        expected = ref(torch.tensor([ids, ids])).logits
        got = model.net(torch.tensor([ids, ids])[:, :1], torch.zeros(2, 1, dtype=torch.long), _cache(model, 2, 1),
                        dense_attention, torch.zeros(2, 1, 1, 1))
    torch.testing.assert_close(got[:, 0], expected[:, 0], atol=1e-4, rtol=1e-4)  # M = 2 rows: the packed path
    packed = bmc.generate(model, PROMPTS[:2], max_new_tokens=8, ignore_eos=True)
    assert [c.token_ids for c in packed] == [c.token_ids for c in plain]
    model.pack_for_batch(0)
    assert all(lin.packed is None for lin in model.linears())


def _cache(model, batch: int, length: int):
    cache = KV_STRATEGIES["upfront"](num_layers=model.config.num_layers, batch_size=batch,
                                     num_kv_heads=model.config.num_kv_heads, head_dim=model.config.head_dim,
                                     max_length=length)
    cache.reserve(length)
    return cache


def test_engine_packs_weights_only_when_it_pays(gqa_dir, monkeypatch):
    import bmc.engine as engine
    from bmc.engine import PACK_MIN_STEPS
    monkeypatch.setenv("BMC_NATIVE", "0")  # MKL packing belongs to the eager path
    model = bmc.load(str(gqa_dir))
    if not model.can_pack:
        import platform

        # PyTorch's x86-64 wheels (the CPU build CI installs) ship MKL: missing packing there is a regression
        assert platform.machine() not in ("x86_64", "AMD64"), "MKL packed GEMM missing on x86-64"
        pytest.skip(f"MKL packed GEMM is x86-only; this is {platform.machine()}")
    bmc.generate(model, PROMPTS[:2], max_new_tokens=8, ignore_eos=True)
    assert model.packed_batch == 0  # too few steps to pay for a re-layout
    out = bmc.generate(model, PROMPTS[:2], max_new_tokens=PACK_MIN_STEPS + 2, ignore_eos=True)
    assert model.packed_batch == 2
    unpacked = bmc.load(str(gqa_dir))
    unpacked.pack_for_batch(0)
    monkeypatch.setattr(engine, "PACK_MIN_STEPS", 10**9)
    ref = bmc.generate(unpacked, PROMPTS[:2], max_new_tokens=PACK_MIN_STEPS + 2, ignore_eos=True)
    assert unpacked.packed_batch == 0
    assert [c.token_ids for c in out] == [c.token_ids for c in ref]
