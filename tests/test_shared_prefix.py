"""Shared-prefix attention (bifurcated attention / Hydragen): exact against plain attention over the replicated
prefix + suffix, and identical greedy tokens end to end with sharing on and off; the prefix is stored once."""
from __future__ import annotations

import pytest
import torch

import bmc
from bmc.attention import SharedPrefix, dense_attention, group_bias

from .conftest import transformers  # noqa: F401


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("prefix_len,suffix_len", [(7, 5), (1, 1), (9, 0), (3, 12)])
@pytest.mark.parametrize("t", [1, 3])
def test_exact_against_attention_over_replicated_kv(heads, kv_heads, prefix_len, suffix_len, t):
    torch.manual_seed(prefix_len * 100 + suffix_len * 10 + t)
    groups, per_group, d, L = 2, 3, 8, 2
    B = groups * per_group
    pk = torch.randn(L, 2, groups, kv_heads, prefix_len, d)
    pbias = torch.zeros(groups, 1, 1, prefix_len)
    pbias[1, ..., 0] = torch.finfo(torch.float32).min  # group 1's prompt is one token shorter (left padding)
    group = torch.arange(groups).repeat_interleave(per_group)
    S = suffix_len + t  # the step's own t tokens are in the suffix cache too
    sk = torch.randn(B, kv_heads, S + 2, d)  # 2 masked padding rows (BMC chunk)
    sv = torch.randn(B, kv_heads, S + 2, d)
    sbias = torch.zeros(B, 1, t, S + 2)
    sbias[..., S:] = torch.finfo(torch.float32).min
    causal = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    sbias[:, 0, :, suffix_len:S] = sbias[:, 0, :, suffix_len:S].masked_fill(causal, torch.finfo(torch.float32).min)
    q = torch.randn(B, heads, t, d)
    G = heads // kv_heads
    layer = 1
    shared = SharedPrefix(pk, pbias, group)
    got = shared.attention(q, sk, sv, group_bias(sbias, G), 0.3, layer=layer)
    # reference: every row holds its own copy of the prefix, concatenated before its suffix
    K = torch.cat([pk[layer, 0][group], sk], dim=2)
    V = torch.cat([pk[layer, 1][group], sv], dim=2)
    bias = torch.cat([pbias[group].expand(B, 1, t, prefix_len), sbias], dim=3)
    want = dense_attention(q, K, V, group_bias(bias, G), 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    shared.reorder(torch.tensor([0, 2, 3, 5]))  # rows finish: groups become uneven
    got2 = shared.attention(q[[0, 2, 3, 5]], sk[[0, 2, 3, 5]], sv[[0, 2, 3, 5]], group_bias(sbias[[0, 2, 3, 5]], G),
                            0.3, layer=layer)
    torch.testing.assert_close(got2, want[[0, 2, 3, 5]], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["llama-gqa", "llama-mqa", "opt-pre_norm"])
def test_samples_share_the_prompt_kv_and_keep_greedy_tokens(tiny_dirs, variant):
    model = bmc.load(str(tiny_dirs[variant]))
    prompts = [[5, 17, 33, 80, 101, 7, 9], [40, 41, 42]]
    for kv in ("bmc", "iterative", "upfront"):
        off = bmc.generate(model, prompts, max_new_tokens=12, num_samples=3, ignore_eos=True, kv=kv,
                           share_prefix="off")
        on = bmc.generate(model, prompts, max_new_tokens=12, num_samples=3, ignore_eos=True, kv=kv)
        assert [c.token_ids for c in on] == [c.token_ids for c in off], kv
        cfg = model.config
        per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
        assert on.stats.prefix_groups == 2
        assert on.stats.prefix_kv_bytes == (7 + 3) * per_token  # each prompt's KV once, read in place by 3 rows
        assert off.stats.prefix_kv_bytes == 0


def test_sampling_with_shared_prefix_matches_replicated(gqa_dir):
    model = bmc.load(str(gqa_dir))
    kw = dict(max_new_tokens=10, num_samples=4, temperature=0.8, seed=3, ignore_eos=True)
    on = bmc.generate(model, [[5, 6, 7, 8]], **kw)
    off = bmc.generate(model, [[5, 6, 7, 8]], share_prefix="off", **kw)
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    with pytest.raises(bmc.InvalidRequestError, match="share_prefix"):
        bmc.generate(model, [[5, 6]], max_new_tokens=2, share_prefix="yes")


@pytest.mark.slow
def test_real_model_shared_prefix_identical(real_model):
    prompts = ["Write a haiku about the sea.", "List three prime numbers."]
    off = bmc.generate(real_model, prompts, max_new_tokens=24, num_samples=3, chat=True, share_prefix="off")
    on = bmc.generate(real_model, prompts, max_new_tokens=24, num_samples=3, chat=True)
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    # hierarchical: the chat template's system header is common to both prompts (the second reads the first's), each
    # prompt's own text is read in place by its 3 samples
    assert on.stats.cached_prompt_tokens >= 16 and on.stats.prefix_groups == 1 + 2 and on.stats.prefix_kv_bytes > 0


@pytest.mark.slow
def test_real_model_common_prefix_of_a_batch(real_model):
    shots = "Q: What is the capital of France?\nA: Paris.\nQ: What is the capital of Italy?\nA: Rome.\n"
    prompts = [shots + f"Q: What is the capital of {c}?\nA:" for c in ("Spain", "Germany", "Japan")]
    off = bmc.generate(real_model, prompts, max_new_tokens=8, share_prefix="off")
    on = bmc.generate(real_model, prompts, max_new_tokens=8)
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    assert on.stats.cached_prompt_tokens >= 2 * 20 and on.stats.prefix_groups == 1  # the 2nd and 3rd read the 1st's


COMMON = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]  # 20 tokens


def per_token_bytes(model) -> int:
    cfg = model.config
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4


@pytest.mark.parametrize("variant", ["llama-gqa", "opt-pre_norm"])
def test_common_prefix_of_a_batch_is_stored_once(tiny_dirs, variant):
    model = bmc.load(str(tiny_dirs[variant]))
    prompts = [COMMON + [40], COMMON + [50, 51, 52], COMMON + [60, 61, 62, 63, 64]]
    for kv in ("bmc", "iterative", "upfront"):
        off = bmc.generate(model, prompts, max_new_tokens=12, ignore_eos=True, kv=kv, share_prefix="off")
        on = bmc.generate(model, prompts, max_new_tokens=12, ignore_eos=True, kv=kv)
        assert [c.token_ids for c in on] == [c.token_ids for c in off], kv
        # the first prompt is prefilled and its common 20 tokens cached; the others wait for it and read them in place
        assert on.stats.cached_prompt_tokens == 2 * 20 and on.stats.prefix_groups == 1
        assert on.stats.prefix_kv_bytes == 20 * per_token_bytes(model)
        assert off.stats.cached_prompt_tokens == 0 and off.stats.prefix_kv_bytes == 0


@pytest.mark.parametrize("variant", ["llama-mqa", "opt-post_norm"])
def test_hierarchical_sharing_few_shot_then_samples(tiny_dirs, variant):
    """Hydragen 3.3: the common header once for everyone, each prompt's own text once for its samples."""
    model = bmc.load(str(tiny_dirs[variant]))
    prompts = [COMMON + [40], COMMON + [50, 51, 52], COMMON + [60, 61, 62, 63, 64]]
    for kw in (dict(), dict(temperature=0.9, seed=5)):
        off = bmc.generate(model, prompts, max_new_tokens=10, num_samples=3, ignore_eos=True, share_prefix="off",
                           **kw)
        on = bmc.generate(model, prompts, max_new_tokens=10, num_samples=3, ignore_eos=True, **kw)
        assert [c.token_ids for c in on] == [c.token_ids for c in off], kw
        # the header once; the own parts of the prompts that read it (the first prompt's own part is its last token,
        # which each of its samples holds); each prompt's KV stored once: 21 + 3 + 5 tokens
        assert on.stats.prefix_groups == 1 + 2
        assert on.stats.prefix_kv_bytes == (21 + 3 + 5) * per_token_bytes(model)


def test_common_prefix_edge_cases(gqa_dir):
    model = bmc.load(str(gqa_dir))
    short = bmc.generate(model, [[5, 6, 7, 8], [5, 6, 7, 9]], max_new_tokens=3, ignore_eos=True)
    assert short.stats.cached_prompt_tokens == 0  # below MIN_SHARED_PREFIX: recomputed per row
    same = [COMMON + [40], COMMON + [40]]  # identical prompts: all but the last token shared
    off = bmc.generate(model, same, max_new_tokens=6, ignore_eos=True, share_prefix="off")
    on = bmc.generate(model, same, max_new_tokens=6, ignore_eos=True)
    assert [c.token_ids for c in on] == [c.token_ids for c in off] and on.stats.cached_prompt_tokens == 20


def test_two_segments_equal_attention_over_the_concatenation():
    torch.manual_seed(0)
    L, kvh, d, G, layer = 2, 2, 8, 2, 1
    head = torch.randn(L, 2, 1, kvh, 6, d)  # shared by all 4 rows
    mid = torch.randn(L, 2, 2, kvh, 3, d)  # one per prompt, 2 rows each
    mid_bias = torch.zeros(2, 1, 1, 3)
    mid_bias[1, ..., 0] = torch.finfo(torch.float32).min  # prompt 1's own part is one token shorter
    rows = torch.tensor([0, 0, 1, 1])
    root = SharedPrefix(head, torch.zeros(1, 1, 1, 6), torch.zeros(2, dtype=torch.long))
    root.reorder(rows)
    shared = SharedPrefix(mid, mid_bias, rows, parent=root)
    sk, sv = torch.randn(4, kvh, 5, d), torch.randn(4, kvh, 5, d)
    sbias = torch.zeros(4, 1, 1, 5)
    sbias[..., 4] = torch.finfo(torch.float32).min
    q = torch.randn(4, kvh * G, 1, d)
    got = shared.attention(q, sk, sv, sbias, 0.3, layer=layer)
    K = torch.cat([head[layer, 0].expand(4, -1, -1, -1), mid[layer, 0][rows], sk], dim=2)
    V = torch.cat([head[layer, 1].expand(4, -1, -1, -1), mid[layer, 1][rows], sv], dim=2)
    bias = torch.cat([torch.zeros(4, 1, 1, 6), mid_bias[rows], sbias], dim=3)
    torch.testing.assert_close(got, dense_attention(q, K, V, bias, 0.3), atol=1e-5, rtol=1e-5)
    assert shared.num_groups == 3 and shared.nbytes == (head.numel() + mid.numel()) * 4


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "phi3"])
def test_other_families_share_the_prompt_kv(tmp_path, family):
    """Qwen2 (q/k/v biases), Qwen3 (q/k norms) and Phi-3 (fused projections): samples of each prompt read its KV
    once, natively, with the greedy tokens of replicated KV and of HF generate."""
    from .conftest import hf, hf_greedy
    from .test_phi3 import make_phi3
    from .test_qwen import make_qwen2

    path = make_phi3(tmp_path / family) if family == "phi3" else make_qwen2(tmp_path / family, family=family)
    model = bmc.load(str(path))
    prompts = [[5, 17, 33, 80, 101, 7, 9], [40, 41, 42]]
    kw = dict(max_new_tokens=10, num_samples=3, ignore_eos=True)
    on = bmc.generate(model, prompts, **kw)
    off = bmc.generate(model, prompts, share_prefix="off", **kw)
    assert on.stats.prefix_kv_bytes > 0 and off.stats.prefix_kv_bytes == 0
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    want = hf_greedy(hf(path), prompts, 10)
    assert [c.token_ids for c in on] == [t for t in want for _ in range(3)]
