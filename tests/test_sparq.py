"""SparQ attention: equal to dense at r = d, k >= S; selections and the GQA variant against brute-force references
written from the paper's definitions; transfers per Eq. 11; the runtime's stateful backend (dimension-major K
mirror grown with BMC chunks, running mean value) against a stateless recomputation, end to end."""
from __future__ import annotations

import math

import pytest
import torch

import bmc
from bmc.attention import ATTENTION_BACKENDS, dense_attention, sparq_attention, sparq_select, sparq_transfers
from bmc.errors import InvalidRequestError

from .conftest import transformers  # noqa: F401

MIN = torch.finfo(torch.float32).min
SHAPES = [(4, 4), (6, 2), (4, 1)]  # (query heads, KV heads): MHA, GQA, MQA


def random_case(seed: int, heads: int, kv_heads: int, S: int = 40, d: int = 16, B: int = 3):
    torch.manual_seed(seed)
    q = torch.randn(B, heads, 1, d) * torch.rand(d) * 3  # uneven components, as real queries have
    K, V = torch.randn(B, kv_heads, S, d), torch.randn(B, kv_heads, S, d)
    bias = torch.zeros(B, 1, 1, S)
    bias[1, ..., :5] = MIN  # row 1 is left-padded by 5
    bias[2, ..., S - 3 :] = MIN  # row 2 sees 3 masked padding rows at the end (a BMC chunk's tail)
    return q, K, V, bias


@pytest.mark.parametrize("heads,kv_heads", SHAPES, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("mean_value", [False, True])
@pytest.mark.parametrize("window", [0, 4])
def test_full_r_and_k_equals_dense(heads, kv_heads, mean_value, window):
    q, K, V, bias = random_case(heads * 10 + kv_heads, heads, kv_heads)
    d, S = K.shape[-1], K.shape[2]
    v_mean = V.mean(2, keepdim=True) if mean_value else None  # alpha = 1 gives it no weight anyway
    got, _ = sparq_attention(q, K, V, bias, 0.25, r=d, k=S, v_mean=v_mean, window=window)
    want = dense_attention(q, K, V, bias, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def brute_selection(q, K, bias, scale, r, k, window):
    """Steps 1 and 2 per (row, KV head) with Python loops, straight from the paper's text."""
    B, H, _, d = q.shape
    kvh, S = K.shape[1], K.shape[2]
    G = H // kvh
    comps, positions, approx = {}, {}, torch.zeros(B, kvh, G, S)
    for b in range(B):
        visible = [j for j in range(S) if bias[b, 0, 0, j] == 0]
        for h in range(kvh):
            qs = [q[b, h * G + g, 0] for g in range(G)]
            mag = sum(x.abs() for x in qs)  # GQA: |q| summed over the group's heads
            top = sorted(range(d), key=lambda i: -float(mag[i]))[:r]
            comps[b, h] = set(top)
            total = torch.zeros(S)
            for g, x in enumerate(qs):
                tau = math.sqrt(d * float(x[top].abs().sum() / x.abs().sum()))
                logits = torch.tensor([float((x[top] * K[b, h, j, top]).sum()) * scale * math.sqrt(d) / tau
                                       for j in range(S)]) + bias[b, 0, 0]
                approx[b, h, g] = torch.softmax(logits, 0)
                total += approx[b, h, g]
            forced = set(range(S - window, S)) & set(visible) if window else set()
            rest = sorted((j for j in visible if j not in forced), key=lambda j: -float(total[j]))
            positions[b, h] = forced | set(rest[: k - len(forced)])
    return comps, positions, approx


@pytest.mark.parametrize("heads,kv_heads", SHAPES, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("r,k,window", [(4, 8, 0), (8, 12, 3), (1, 1, 0)])
def test_selections_match_brute_force(heads, kv_heads, r, k, window):
    q, K, _, bias = random_case(7 + heads, heads, kv_heads)
    d = K.shape[-1]
    scale = d**-0.5
    G = heads // kv_heads
    i1, s_hat, i2 = sparq_select(q.reshape(q.shape[0], kv_heads, G, d), K.transpose(-1, -2), bias, scale, r, k,
                                 window)
    comps, positions, approx = brute_selection(q, K, bias, scale, r, k, window)
    for (b, h), want in comps.items():
        assert set(i1[b, h].tolist()) == want
        assert set(i2[b, h].tolist()) == positions[b, h]
    torch.testing.assert_close(s_hat, approx, rtol=1e-4, atol=1e-6)


def test_masked_padding_never_selected():
    q, K, _, bias = random_case(3, 4, 2)
    d = K.shape[-1]
    visible = (bias[:, 0, 0] == 0).sum(-1)
    for k in (4, 20):
        _, _, i2 = sparq_select(q.reshape(3, 2, 2, d), K.transpose(-1, -2), bias, d**-0.5, 4, k)
        for b in range(3):
            assert torch.all(bias[b, 0, 0, i2[b].flatten()] == 0), f"row {b} chose a masked column (k={k})"
            assert k <= visible[b]


@pytest.mark.parametrize("heads,kv_heads", SHAPES, ids=["mha", "gqa", "mqa"])
def test_output_matches_definition(heads, kv_heads):
    """Eq. 8 + Eq. 10 per head over the chosen positions, with the group sharing its KV head's selection."""
    q, K, V, bias = random_case(11, heads, kv_heads)
    B, d = q.shape[0], q.shape[-1]
    G, scale, r, k = heads // kv_heads, 0.3, 5, 9
    v_mean = torch.randn(B, kv_heads, 1, d)
    got, _ = sparq_attention(q, K, V, bias, scale, r, k, v_mean=v_mean)
    _, positions, approx = brute_selection(q, K, bias, scale, r, k, 0)
    for b in range(B):
        for h in range(kv_heads):
            idx = sorted(positions[b, h])
            for g in range(G):
                x = q[b, h * G + g, 0]
                w = torch.softmax(K[b, h, idx] @ x * scale + bias[b, 0, 0, idx], 0)
                alpha = approx[b, h, g, idx].sum()
                want = alpha * (w @ V[b, h, idx]) + (1 - alpha) * v_mean[b, h, 0]
                torch.testing.assert_close(got[b, h * G + g, 0], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mean_value", [False, True])
def test_transfers_follow_eq_11(mean_value):
    q, K, V, bias = random_case(5, 6, 2)
    B, kvh, S, d = K.shape
    v_mean = V.mean(2, keepdim=True) if mean_value else None
    for r, k in [(4, 8), (16, 40), (2, 100)]:
        _, moved = sparq_attention(q, K, V, bias, 0.3, r, k, v_mean=v_mean)
        assert moved == B * kvh * sparq_transfers(S, r, k, d, mean_value)
    assert sparq_transfers(4096, 32, 128, 128, True) == 4096 * 32 + 2 * 128 * 128 + 4 * 128  # the paper's example


class StatelessSparQ:
    """Reference backend: recomputes everything from the cache each step (no K mirror, mean from scratch)."""

    def __init__(self, cache, opts, group_size):
        self.cache, self.opts = cache, opts.resolve(cache.head_dim, group_size)

    def __call__(self, q, K, V, bias, scale, layer=0):
        S = self.cache.length + q.shape[2]
        if q.shape[2] != 1:
            return dense_attention(q, K, V, bias, scale, layer)
        vis = (self.cache.bias[:, :, 0, :S] == 0).float()
        v_mean = (vis[:, :, None, :] @ V[:, :, :S]) / vis.sum(-1)[..., None, None] if self.opts.mean_value else None
        o = self.opts
        return sparq_attention(q, K[:, :, :S], V[:, :, :S], bias[..., :S], scale, o.r, o.k, None, v_mean,
                               o.local_window)[0]


@pytest.mark.parametrize("variant", ["mha", "gqa"])
@pytest.mark.parametrize("kv", ["bmc", "iterative"])
def test_runtime_backend_equals_stateless_reference(tiny_dirs, monkeypatch, variant, kv):
    """The mirror of K follows the cache through chunk reallocations (r=4) and forked samples; the running mean
    follows left padding; greedy tokens and transfer counts equal a from-scratch recomputation each step."""
    model = bmc.load(str(tiny_dirs[f"llama-{variant}"]))
    monkeypatch.setitem(ATTENTION_BACKENDS, "stateless", lambda cache, opts, g: StatelessSparQ(cache, opts.sparq, g))
    prompts = [[5, 9, 13, 7, 21, 33, 40, 2 + 9, 17, 19, 23, 29], [44, 45, 46, 47, 48]]
    kw = dict(max_new_tokens=20, kv=kv, r=4 if kv == "bmc" else None, ignore_eos=True, sparq_r=3, sparq_k=6,
              num_samples=2)
    fast = bmc.generate(model, prompts, attention="sparq", **kw)
    ref = bmc.generate(model, prompts, attention="stateless", **kw)
    assert [c.token_ids for c in fast] == [c.token_ids for c in ref]
    assert fast.stats.attention_transfers > 0
    assert 0 < fast.stats.attention_compression < 1


def test_window_keeps_first_and_recent(tiny_dirs):
    model = bmc.load(str(tiny_dirs["llama-gqa"]))
    prompt = [[5, 9, 13, 7, 21, 33, 40, 11, 17, 19, 23, 29, 31, 37]]
    long_window = bmc.generate(model, prompt, max_new_tokens=12, attention="window", window_k=64, ignore_eos=True)
    dense = bmc.generate(model, prompt, max_new_tokens=12, ignore_eos=True)
    assert [c.token_ids for c in long_window] == [c.token_ids for c in dense]  # budget >= context: exact
    short = bmc.generate(model, prompt, max_new_tokens=12, attention="window", window_k=20, ignore_eos=True)
    assert short.stats.attention_compression < 1


def test_window_attends_exactly_the_first_and_the_most_recent_positions():
    """Against a brute-force softmax over the chosen positions only: each row's first `sink` visible positions
    (after its left padding) and the last k - sink; a row shorter than the window attends to all it has, once."""
    from bmc.attention.sparq import WindowAttention
    from bmc.kv import KV_STRATEGIES

    torch.manual_seed(0)
    B, H, kvh, d, k, sink, pads = 2, 4, 2, 8, 6, 2, [0, 11]  # row 1 has 5 positions: fewer than k
    cache = KV_STRATEGIES["bmc"](r=8, num_layers=1, batch_size=B, num_kv_heads=kvh, head_dim=d, max_length=32,
                                 left_pad=pads)
    cache.reserve(15)
    cache.update(0, torch.randn(B, kvh, 15, d), torch.randn(B, kvh, 15, d))
    cache.commit(15)
    cache.reserve(1)
    K, V = cache.update(0, torch.randn(B, kvh, 1, d), torch.randn(B, kvh, 1, d))
    q, S, scale = torch.randn(B, H, 1, d), 16, d ** -0.5
    got = WindowAttention(cache, k, sink)(q, K, V, cache.attention_bias(1), scale)
    for b in range(B):
        cols = sorted(set(range(pads[b], pads[b] + sink)) | set(range(S - (k - sink), S)))
        for h in range(H):
            kh = h // (H // kvh)
            p = torch.softmax(K[b, kh, cols] @ q[b, h, 0] * scale, dim=0)
            torch.testing.assert_close(got[b, h, 0], p @ V[b, kh, cols], atol=1e-5, rtol=1e-5)


def test_sparq_errors(tiny_dirs):
    model = bmc.load(str(tiny_dirs["llama-gqa"]))
    with pytest.raises(InvalidRequestError, match="sparq r"):
        bmc.generate(model, [[5, 6, 7]], max_new_tokens=2, attention="sparq", sparq_r=10_000)
    with pytest.raises(InvalidRequestError, match="speculative"):
        bmc.generate(model, [[5, 6, 7]], max_new_tokens=2, attention="sparq", speculative="ngram")
    with pytest.raises(InvalidRequestError, match="unknown attention"):
        bmc.generate(model, [[5, 6, 7]], max_new_tokens=2, attention="sparse")


def test_no_bias_means_all_visible():
    q, K, V, _ = random_case(21, 6, 2)
    zeros = torch.zeros(K.shape[0], 1, 1, K.shape[2])
    a, _ = sparq_attention(q, K, V, zeros, 0.3, 5, 9, v_mean=V.mean(2, keepdim=True), window=3)
    b, _ = sparq_attention(q, K, V, None, 0.3, 5, 9, v_mean=V.mean(2, keepdim=True), window=3)
    torch.testing.assert_close(a, b)


def visible_sets(i2: torch.Tensor, bias: torch.Tensor) -> list[list[int]]:
    """Per (row, KV head): the chosen positions that are not masked, sorted."""
    return [sorted(j for j in heads_row if bias[b, 0, 0, j] == 0) for b, rows in enumerate(i2.tolist())
            for heads_row in rows]


def test_fused_cpu_kernel_matches_the_reference_path():
    """The C++ steps 1-3 (built on first use) choose the same positions and give the same output as the PyTorch
    path, on capacity-sliced K/V and K mirrors with masked columns, for MHA/GQA/MQA, windows, step 3, contexts that
    span several of the kernel's column blocks, and k beyond the visible positions."""
    import shutil

    from bmc.attention.sparq import bias_none
    from bmc.kernels.sparq import fused_decode

    kernel = fused_decode()
    if kernel is None:
        if shutil.which("g++") and shutil.which("ninja"):
            pytest.fail("g++ and ninja are here but the SparQ kernel did not build")
        pytest.skip("no C++ toolchain: SparQ runs its PyTorch path")
    cases = [(50, 60, 16), (700, 720, 64)]  # (written columns S, capacity, head dim): 1 and 3 column blocks
    for seed, (heads, kv_heads) in enumerate(SHAPES):
        for S, cap, d in cases:
            q, K, V, bias = random_case(seed, heads, kv_heads, S=cap, d=d)
            bias[2, ..., S - 3 : S] = MIN  # masked rows inside the written span too
            Kt = K.transpose(-1, -2).contiguous()[..., :S]  # the runtime's mirror, cut to the written columns
            G = heads // kv_heads
            for r, k, window, mean in [(4, 8, 0, False), (8, 20, 5, True), (d, S, 0, True), (2, S - 1, 3, False)]:
                v_mean = V[:, :, :S].mean(2, keepdim=True) if mean else None
                args = (q, K[:, :, :S], V[:, :, :S], bias[..., :S], 0.3, r, k, Kt, v_mean, window)
                fast, moved_fast = sparq_attention(*args, fused=True)
                ref, moved_ref = sparq_attention(*args, fused=False)
                torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-5)
                assert moved_fast == moved_ref
                qg = q.reshape(q.shape[0], kv_heads, G, d)
                _, _, i2 = sparq_select(qg, Kt, bias[..., :S], 0.3, r, k, window)
                mean_arg = bias_none(q.device) if v_mean is None else v_mean[:, :, 0, :]
                _, i2_fast = kernel(qg, K[:, :, :S], V[:, :, :S], Kt, bias_none(q.device), bias[:, 0, 0, :S], mean_arg, S, r,
                                    k, window, 0.3)
                # the same visible positions (k beyond them takes some masked ones, which are interchangeable)
                assert visible_sets(i2_fast, bias) == visible_sets(i2, bias)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "phi3"])
def test_other_families_run_sparq(tmp_path, family):
    """Qwen2, Qwen3 and Phi-3 decode with SparQ: at full rank and k over the context it is dense attention (HF's
    greedy tokens); at r = head_dim / 4 and k = 4 it reads less than dense attention would."""
    from .conftest import hf, hf_greedy
    from .test_phi3 import make_phi3
    from .test_qwen import make_qwen2

    path = make_phi3(tmp_path / family) if family == "phi3" else make_qwen2(tmp_path / family, family=family)
    model = bmc.load(str(path))
    prompts = [[5, 17, 33, 80, 101, 7, 9, 250, 12], [40, 41, 42]]
    full = bmc.generate(model, prompts, max_new_tokens=12, ignore_eos=True, attention="sparq",
                        sparq_r=model.config.head_dim, sparq_k=128)
    assert [c.token_ids for c in full] == hf_greedy(hf(path), prompts, 12)
    cut = bmc.generate(model, prompts, max_new_tokens=12, ignore_eos=True, attention="sparq",
                       sparq_r=max(1, model.config.head_dim // 4), sparq_k=4)
    assert 0 < cut.stats.attention_transfers < cut.stats.attention_dense_transfers


def test_opt_runs_sparq(tiny_dirs):
    """OPT (MHA, learned positions) under SparQ: at full rank and k over the context it is dense attention (the
    tokens of plain decoding); at a quarter of the rank it reads less, with step 3 (MHA: on by default)."""
    model = bmc.load(str(tiny_dirs["opt-pre_norm"]))
    prompts = [[5, 17, 33, 80, 101, 7, 9, 250, 12], [40, 41, 42]]
    plain = bmc.generate(model, prompts, max_new_tokens=12, ignore_eos=True)
    full = bmc.generate(model, prompts, max_new_tokens=12, ignore_eos=True, attention="sparq",
                        sparq_r=model.config.head_dim, sparq_k=128)
    assert [c.token_ids for c in full] == [c.token_ids for c in plain]
    cut = bmc.generate(model, prompts, max_new_tokens=12, ignore_eos=True, attention="sparq",
                       sparq_r=max(1, model.config.head_dim // 4), sparq_k=4)
    assert 0 < cut.stats.attention_transfers < cut.stats.attention_dense_transfers


NARROW = ["bfloat16", "float16", "int8"]


@pytest.mark.parametrize("kv_dtype", NARROW)
@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "pytorch"])
def test_narrow_kv_is_read_as_stored(kv_dtype, fused):
    """Over a narrow KV format's stored rows (the mirror holding the stored values, an int8 one its columns'
    scales), SparQ gives what it gives over the rows' decoded float32 values: the same visible positions chosen,
    the same output within float rounding, and dense attention over the decoded rows at r = d, k = S."""
    from bmc.kv.formats import KV_FORMATS

    fmt = KV_FORMATS[kv_dtype]
    for seed, (heads, kv_heads) in enumerate(SHAPES):
        for S, d in [(40, 16), (600, 64)]:  # 1 and 3 of the kernel's column blocks, tails past its 16-wide tiles
            q, K, V, bias = random_case(seed, heads, kv_heads, S=S, d=d)
            Ks, Vs = fmt.encode(K), fmt.encode(V)
            Kd, Vd = fmt.decode(Ks, torch.float32), fmt.decode(Vs, torch.float32)
            values, kt_scale = fmt.split(Ks)
            Kt = values.transpose(-1, -2).contiguous()
            kt_scale = None if kt_scale is None else kt_scale.contiguous()
            for r, k, window in [(4, 8, 0), (8, 20, 5), (d, S, 0)]:
                got, _ = sparq_attention(q, Ks, Vs, bias, 0.3, r, k, Kt, None, window, fused, fmt, kt_scale)
                ref, _ = sparq_attention(q, Kd, Vd, bias, 0.3, r, k, None, None, window, fused=False)
                torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
                G = heads // kv_heads
                qg = q.reshape(q.shape[0], kv_heads, G, d)
                i2 = sparq_select(qg, Kt, bias, 0.3, r, k, window, kt_scale)[2]
                i2_ref = sparq_select(qg, Kd.transpose(-1, -2), bias, 0.3, r, k, window)[2]
                assert visible_sets(i2, bias) == visible_sets(i2_ref, bias)
            dense = dense_attention(q, Kd, Vd, bias, 0.3)
            full, _ = sparq_attention(q, Ks, Vs, bias, 0.3, d, S, Kt, None, 0, fused, fmt, kt_scale)
            torch.testing.assert_close(full, dense, rtol=1e-4, atol=1e-5)


def test_only_the_chosen_rows_are_decoded():
    """The PyTorch path over int8 rows decodes the k chosen K and V rows per KV head, never the whole span."""
    from bmc.kv.formats import Int8

    decoded_rows = []

    class Spy(Int8):
        def decode(self, s, dtype):
            decoded_rows.append(s.shape[-2])
            return super().decode(s, dtype)

    fmt = Spy()
    q, K, V, bias = random_case(0, 6, 2, S=200, d=16)
    Ks, Vs = fmt.encode(K), fmt.encode(V)
    values, kt_scale = fmt.split(Ks)
    sparq_attention(q, Ks, Vs, bias, 0.3, 4, 12, values.transpose(-1, -2).contiguous(), None, 0, False, fmt,
                    kt_scale.contiguous())
    assert decoded_rows == [12, 12]


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_runtime_mirror_keeps_the_stored_format(tiny_dirs, kv_dtype):
    """Under a narrow kv_dtype the runtime's mirror holds K's stored values (an int8 one, its columns' scales)
    at every decode step, through chunk reallocations and rows leaving the batch (the mirror is rebuilt when the
    cache's layout changes), and greedy SparQ tokens equal those of a stateless SparQ recomputed each step from the
    cache's decoded rows."""
    from bmc.attention import SparQAttention

    model = bmc.load(str(tiny_dirs["llama-gqa"]))
    prompts = [[5, 9, 13, 7, 21, 33, 40, 2 + 9, 17, 19, 23, 29], [44, 45, 46, 47, 48]]
    kw = dict(max_new_tokens=20, r=4, ignore_eos=True, sparq_r=3, sparq_k=6, kv_dtype=kv_dtype)
    checked: list[int] = []

    class Checked(SparQAttention):
        def __call__(self, q, K, V, bias, scale, layer=0):
            out = super().__call__(q, K, V, bias, scale, layer)
            cache, S = self.cache, self.cache.length + q.shape[2]
            assert cache.format.name == kv_dtype
            if q.shape[2] == 1:  # a decode step: the mirror is what the cache stores, column for column
                values, kt_scale = cache.format.split(cache.kv[layer, 0, :, :, :S])
                assert self.Kt[layer].dtype == cache.format.storage
                assert torch.equal(self.Kt[layer][..., :S], values.transpose(-1, -2))
                if kt_scale is None:
                    assert self.Kt_scale[layer] is None
                else:
                    assert torch.equal(self.Kt_scale[layer][..., :S], kt_scale)
                checked.append(S)
            return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(ATTENTION_BACKENDS, "kept", lambda cache, opts, g: Checked(cache, opts.sparq, g))
        mp.setitem(ATTENTION_BACKENDS, "stateless", lambda cache, opts, g: StatelessSparQ(cache, opts.sparq, g))
        fast = bmc.generate(model, prompts, attention="kept", **kw)
        ref = bmc.generate(model, prompts, attention="stateless", **kw)
    assert [c.token_ids for c in fast] == [c.token_ids for c in ref]
    assert len(checked) >= 19 * model.config.num_layers and max(checked) > 16  # past several chunks of r=4
