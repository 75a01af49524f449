"""activations="bfloat16": a prompt's rows on the native step in bfloat16 arithmetic (AMX, AVX512-BF16, or float32
FMAs on bfloat16 values where the CPU has neither). The GEMM against float64 within its stated bound, over every
weight layout, row counts and tails; a row's result independent of the rows beside it; the model's prompt logits
near float32's, its generated tokens' steps in float32; refusals by name."""
from __future__ import annotations

import pytest
import torch

import bmc
from bmc.errors import BmcError
from bmc.kernels.native import native_module, native_supported
from bmc.models.ops import Linear
from bmc.models.quant import QuantWeight, float_panels

from .test_quant import MIXED, MODEL_D, random_matrix

pytestmark = pytest.mark.skipif(not native_supported(torch.device("cpu"), torch.float32),
                                reason="the native CPU step is not built here")


def bf16_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x and w each rounded to bfloat16 (8 significant bits: relative 2^-8 each), K products summed in float32
    (2^-24 each step), the bias added in float32: |y - exact| <= (2^-7 + 2^-16 + K 2^-23) sum_k |x_k w_k|
    + 2^-23 |b + x w|."""
    K = x.shape[-1]
    mag = x.double().abs() @ w.double().abs().t()
    exact = x.double() @ w.double().t() + (0 if b is None else b.double())
    return (2**-7 + 2**-16 + K * 2**-23) * mag + 2**-23 * exact.abs()


def weight(layout: str, n: int, k: int, seed: int) -> tuple[Linear, torch.Tensor]:
    """A Linear [k -> n] in one of the native step's layouts, and its weights' float values [n, k]."""
    if layout in ("float32", "bfloat16", "float16"):
        g = torch.Generator().manual_seed(seed)
        w = (torch.randn(n, k, generator=g) * 0.05).to(getattr(torch, layout))
        lin = Linear(w.float().t().contiguous())
        lin.panels = float_panels(w.float().t().contiguous()).to(w.dtype)
        lin.wt = None
        return lin, w.float()
    if layout == "mixed":
        q = QuantWeight.cat([random_matrix(t, m, k, seed + i, MODEL_D) for i, (t, m) in enumerate(zip(MIXED, (16, 8, 9, 17)))])
    else:
        q = random_matrix(layout, n, k, seed, MODEL_D)
    return Linear(q), q.dequantize()


def bf16_linear(lin: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return native_module().panel_linear(x, lin.native_weight(), lin.out_features, bias, False, True)


LAYOUTS = ["float32", "bfloat16", "float16", "q4_0", "q4_1", "q4_k", "q8_0", "q5_k", "q6_k", "mixed"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 7, 16, 33, 512])
def test_bf16_gemm_within_its_stated_bound(layout, rows):
    """Float layouts at K = 83 (an odd K: a pair and a tile of 32 left part-filled) and 40 outputs (a part-filled
    panel); block layouts at K = 512 (K-quants' super-blocks) and 50 outputs."""
    k, n = (83, 40) if layout in ("float32", "bfloat16", "float16") else (512, 50)
    lin, w = weight(layout, n, k, rows)
    n = lin.out_features
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    b = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 0.1
    got = bf16_linear(lin, x, b).double()
    exact = x.double() @ w.double().t() + b.double()
    err = (got - exact).abs()
    bound = bf16_bound(x, w, b)
    assert (err <= bound).all(), (err / bound).max()
    assert err.max() > 1e-7 * bound.max() / 2**-8  # the values really were rounded to bfloat16
    float32 = native_module().panel_linear(x, lin.native_weight(), n, b, False, False).double()
    torch.testing.assert_close(float32, exact, rtol=1e-5, atol=1e-5)  # and the same weights in float32: exact


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    """Each output row's products are summed in one order whatever the GEMM's row count, so a prompt prefilled
    beside others (a batch, a fused step, tiles padded to 16 or 32 rows) gets the bits it gets alone."""
    lin, _ = weight("bfloat16", 100, 576, 0)
    x = torch.randn(45, 576, generator=torch.Generator().manual_seed(0))
    whole = bf16_linear(lin, x, None)
    for lo, hi in [(0, 1), (3, 10), (7, 40), (44, 45), (0, 33)]:
        assert torch.equal(bf16_linear(lin, x[lo:hi].contiguous(), None), whole[lo:hi]), (lo, hi)


def test_the_path_this_cpu_runs_is_named():
    assert native_module().bf16_path() in ("amx", "avx512-bf16", "emulated")


def test_model_prompts_in_bf16_tokens_in_float32(gqa_dir, monkeypatch):
    """A model with activations="bfloat16": prompt logits near float32's (each matrix within the bound; the layers
    compound it), not equal; a decode step's arithmetic float32 (the same cache and token give float32's logits);
    prompts generated together as each alone (rows never mix arithmetic); unknown values refused."""
    mb, mf = bmc.load(str(gqa_dir), activations="bfloat16"), bmc.load(str(gqa_dir))
    assert mb.activations == "bfloat16" and mb.net.bf16_prompts and not mf.net.bf16_prompts
    from bmc.parallel.tp import prompt_logits

    ids = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 3]
    with torch.inference_mode():
        a, f = prompt_logits(mb, ids), prompt_logits(mf, ids)
    assert 0 < (a - f).abs().max() < 0.02 * (f.max() - f.min())
    prompts = [[5, 6, 7, 8, 9] * 3, [40, 41, 42], list(range(60, 90))]
    together = bmc.generate(mb, prompts, max_new_tokens=10, ignore_eos=True)
    alone = [bmc.generate(mb, [p], max_new_tokens=10, ignore_eos=True)[0] for p in prompts]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    with pytest.raises(BmcError, match="unknown activations"):
        bmc.load(str(gqa_dir), activations="bf16")


@pytest.mark.parametrize("budget", [64, 6], ids=["whole-prompts", "chunked-prefill"])
def test_staggered_requests_equal_generate_alone(gqa_dir, budget):
    """Served under load, prompt chunks beside other requests' decode rows in one fused step: each request's tokens
    are what generate() gives it alone with the same activations."""
    from bmc.scheduler import Scheduler

    from .test_scheduler import PROMPTS, alone, drive, request

    model = bmc.load(str(gqa_dir), activations="bfloat16")
    sched = Scheduler(model, max_num_seqs=3, max_num_batched_tokens=budget, kv="bmc", r=4)
    lengths = [14, 6, 9, 11, 3]
    reqs = [request(p, n) for p, n in zip(PROMPTS, lengths)]
    drive(sched, {0: [reqs[0][0]], 2: [reqs[1][0], reqs[2][0]], 5: [reqs[3][0]], 9: [reqs[4][0]]},
          collectors=[c for _, c in reqs])
    for (_, col), p, n in zip(reqs, PROMPTS, lengths):
        assert col.error is None and col.tokens == {0: alone(model, p, n)}, p
    assert sched.counters.fused_steps >= 1  # decode rows and a prompt chunk shared a step


def test_decode_steps_stay_float32(gqa_dir):
    """Past the prompt, a step's rows are float32: one decode step on the same cache gives the float model's logits
    bit for bit (both caches prefilled by the bfloat16 model)."""
    mb, mf = bmc.load(str(gqa_dir), activations="bfloat16"), bmc.load(str(gqa_dir))
    ids = list(range(20, 45))
    with torch.inference_mode():
        steps = [prefill_then_step(mb, m, ids, 7) for m in (mb, mf)]
    assert torch.equal(steps[0], steps[1])


def prefill_then_step(prefiller: bmc.Model, stepper: bmc.Model, ids: list[int], token: int) -> torch.Tensor:
    from bmc.attention import dense_attention
    from bmc.engine import GenerationConfig, GenerationStats, make_cache, prefill_attention

    n = len(ids)
    cache = make_cache(prefiller, GenerationConfig(kv="upfront"), 1, n + 1, [0], GenerationStats())
    positions = torch.arange(n)[None]
    cache.reserve(n, positions)
    prefiller.net(torch.tensor([ids]), positions, cache, prefill_attention(dense_attention, cache, n),
                  cache.attention_bias(n), prompt_len=torch.tensor([n]))
    cache.commit(n)
    cache.reserve(1, torch.tensor([[n]]))
    return stepper.net(torch.tensor([[token]]), torch.tensor([[n]]), cache, dense_attention, cache.attention_bias(1))


def test_the_cli_flag(gqa_dir, capsys):
    """bmc-generate --activations bfloat16 (its main, in this process) prints what generate() gives that model."""
    from bmc.cli.generate import main

    main(["--model", str(gqa_dir), "--activations", "bfloat16", "--max-new-tokens", "6", "--ignore-eos",
          "--no-weights-cache", "the quick brown fox jumps over the lazy dog again and again"])
    printed = capsys.readouterr().out.strip()
    m = bmc.load(str(gqa_dir), activations="bfloat16")
    want = bmc.generate(m, ["the quick brown fox jumps over the lazy dog again and again"], max_new_tokens=6,
                        ignore_eos=True)[0].text
    assert printed == want.strip()


def test_refused_where_the_native_step_does_not_run(gqa_dir, monkeypatch):
    with pytest.raises(BmcError, match="native CPU step"):
        bmc.load(str(gqa_dir), dtype="bfloat16", activations="bfloat16")


def prompt_attention_case(hd: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """q [B, t, h*d], a float32 cache [1, 2, B, kvh, cap, d] holding 70 earlier keys then the t new ones, and a
    causal bias [B, 1, t, cap] with padding columns and one left-padded row (GQA: 6 query heads on 2 KV heads)."""
    B, h, kvh, cap = 2, 6, 2, 70 + t + 5
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, t, h * hd, generator=g) * 1.5
    kv = torch.randn(1, 2, B, kvh, cap, hd, generator=g)
    kv[:, 1] *= torch.logspace(-1, 1, cap)[:, None]  # values of many magnitudes
    bias = torch.zeros(B, 1, t, cap)
    fmin = torch.finfo(torch.float32).min
    bias[..., 70 + t:] = fmin
    bias[1, 0, :, :9] = fmin  # row 1 left-padded
    for i in range(t):
        bias[:, 0, i, 70 + i + 1: 70 + t] = fmin
    return q, kv, bias, h, kvh


def bf16_prompt_attention(h: int, kvh: int, hd: int, on: bool = True, threads: int = 0):
    attn = native_module().Attention(h, kvh, hd, hd**-0.5)
    attn.set_bf16_prompts(on)
    attn.set_split_threads(threads)
    return attn


@pytest.mark.parametrize("kv_dtype,threads", [("float32", 0), ("float32", 16), ("bfloat16", 0), ("float16", 0)])
@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("t", [1, 7, 16, 33, 130])
def test_bf16_prompt_attention_within_its_stated_bound(hd, t, kv_dtype, threads):
    """A prompt chunk's attention in bfloat16 arithmetic against float64. Bound (attend_bf16.h): each score within
    D = scale (2^-7 + 2^-16 + d 2^-24) sum_e |q_e k_e| of exact, so each weight within e^(2 max D) of its share;
    each weight and value rounded once more (2^-8 each), the products summed in float32 over the keys:
    |o - exact| <= (e^(2 max D) (1 + 2^-7 + 2^-16) (1 + 2^-20) - 1 + (n + 4) 2^-23) sum_j w_j |v_j|.
    Over a float32 cache and the 16-bit ones (widened a chunk at a time first; the reference reads their values),
    and with the capacity split into spans whose partial states are merged (16 planned threads)."""
    from .test_native import reference_attention

    q, kv, bias, h, kvh = prompt_attention_case(hd, t, hd + t)
    stored = kv.to(getattr(torch, kv_dtype))
    kv = stored.float()
    scale = hd**-0.5
    attn = bf16_prompt_attention(h, kvh, hd, threads=threads)
    got = attn.attention_step(q, stored, 0, bias, [], [], [], prompt=True).double()
    exact = reference_attention(q, kv, bias, [], scale).double()
    B, cap, G = q.shape[0], kv.shape[4], h // kvh
    K = kv[0, 0].double().repeat_interleave(G, dim=1)  # [B, h, cap, d]
    V = kv[0, 1].double().repeat_interleave(G, dim=1)
    qh = q.double().view(B, t, h, hd).transpose(1, 2)  # [B, h, t, d]
    scores = qh @ K.transpose(-1, -2) * scale + bias.double()  # [B, h, t, cap]
    w = torch.softmax(scores, dim=-1)
    open_ = bias.double() > torch.finfo(torch.float32).min  # [B, 1, t, cap]
    mag = (qh.abs() @ K.abs().transpose(-1, -2)) * scale * open_
    D = (2**-7 + 2**-16 + hd * 2**-24) * mag.amax(-1, keepdim=True)  # [B, h, t, 1]
    wv = w @ V.abs()  # sum_j w_j |v_j|: [B, h, t, d]
    bound = (torch.exp(2 * D) * (1 + 2**-7 + 2**-16) * (1 + 2**-20) - 1 + (cap + 4) * 2**-23) * wv
    err = (got.view(B, t, h, hd).transpose(1, 2) - exact.view(B, t, h, hd).transpose(1, 2)).abs()
    assert (err <= bound).all(), float((err / bound).max())
    # tighter, against float64 over the operands rounded as the kernel rounds them (q, k, v to bfloat16): what is
    # left is each weight's own rounding (2^-8), the float32 sums of the scores and of the weighted values
    qr, Kr, Vr = (x.bfloat16().double() for x in (qh, K, V))
    scores_r = qr @ Kr.transpose(-1, -2) * scale + bias.double()
    w_r = torch.softmax(scores_r, dim=-1)
    D_r = (hd * 2**-24 + 2**-22) * ((qr.abs() @ Kr.abs().transpose(-1, -2)) * scale * open_).amax(-1, keepdim=True)
    tight = (torch.exp(2 * D_r) * (1 + 2**-8) * (1 + 2**-20) - 1 + (cap + 4) * 2**-23) * (w_r @ Vr.abs())
    err_r = (got.view(B, t, h, hd).transpose(1, 2) - w_r @ Vr).abs()
    assert (err_r <= tight + 2**-24 * exact.abs().max()).all(), float((err_r / tight).max())
    float32 = bf16_prompt_attention(h, kvh, hd, on=False, threads=threads).attention_step(q, stored, 0, bias, [], [],
                                                                                        [], prompt=True)
    float_err = (float32.double() - exact).abs().max()
    assert err.max() > 10 * float_err  # bfloat16 arithmetic really ran


def test_a_prompt_rows_bf16_attention_does_not_depend_on_its_chunk():
    """A prompt row attended in a chunk of 100 rows or of 63 (the same keys, the same bias row) gets the same bits:
    the bfloat16 products keep rows apart. (With more planned threads the capacity may split into spans by the
    chunk's size, which sets the merge order, as on the float path: one thread here keeps one span.)"""
    q, kv, bias, h, kvh = prompt_attention_case(64, 100, 3)
    attn = bf16_prompt_attention(h, kvh, 64, threads=1)
    whole = attn.attention_step(q, kv, 0, bias, [], [], [], prompt=True)
    for lo, hi in [(37, 100), (0, 5), (64, 65)]:
        part = attn.attention_step(q[:, lo:hi].contiguous(), kv, 0, bias[:, :, lo:hi].contiguous(), [], [], [],
                                   prompt=True)
        assert torch.equal(part, whole[:, lo:hi]), (lo, hi)
    decode = attn.attention_step(q[:, 99:100].contiguous(), kv, 0, bias[:, :, 99:100].contiguous(), [], [], [])
    assert not torch.equal(decode, whole[:, 99:100])  # decode and verify rows stay float32


def test_int8_kv_keeps_its_own_arithmetic_in_bf16_prompts():
    """An int8 cache's prompt chunk is attended as without bfloat16 prompts (integers or widened rows): the same bits."""
    from bmc.kv.formats import KV_FORMATS

    q, kv, bias, h, kvh = prompt_attention_case(64, 40, 5)
    stored = KV_FORMATS["int8"].encode(kv)
    on = bf16_prompt_attention(h, kvh, 64).attention_step(q, stored, 0, bias, [], [], [], prompt=True)
    off = bf16_prompt_attention(h, kvh, 64, on=False).attention_step(q, stored, 0, bias, [], [], [], prompt=True)
    assert torch.equal(on, off)
