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
        assert on.stats.prefix_kv_bytes == 2 * 7 * per_token  # each prompt's KV once (padded to the longest)
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
    assert on.stats.prefix_groups == 2 and on.stats.prefix_kv_bytes > 0
