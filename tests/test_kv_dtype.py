"""kv_dtype: the KV cache stored as bfloat16, float16 or int8 (bmc/kv/formats.py). The formats' stated error
bound, attention's bound that follows from it, the native step writing and reading the same bytes as the PyTorch
path, and every generation path giving the tokens of the plain run with the same kv_dtype."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import bmc
from bmc.attention import dense_attention
from bmc.engine import GenerationConfig, prefill_alone
from bmc.errors import InvalidRequestError
from bmc.kernels.native import native_module
from bmc.kv import KV_FORMATS, KV_STRATEGIES, kv_format
from bmc.kv.formats import scales
from bmc.scheduler import Scheduler

from .conftest import LLAMA_VARIANTS, OPT_VARIANTS, require_native, skip_unless_isa
from .test_scheduler import PROMPTS, alone, assert_idle, drive, request

NARROW = ["bfloat16", "float16", "int8"]
PAIR = [[5, 17, 33, 80, 101, 7, 9, 250, 12], [40, 41, 42]]


def test_int8_rows_are_within_half_a_step_of_their_values():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 50, 64) * torch.logspace(-3, 3, 50)[None, None, :, None]
    x[0, 0, 0] = 0.0  # an all-zero row: scale 0, reads back as zeros
    fmt = KV_FORMATS["int8"]
    stored = fmt.encode(x)
    assert stored.dtype == torch.int8 and stored.shape == (4, 3, 50, 68)
    back = fmt.decode(stored, torch.float32)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert torch.all((back - x).abs() <= step / 2 * (1 + 1e-5))
    assert torch.equal(back[0, 0, 0], torch.zeros(64))
    assert torch.equal(scales(stored), x.abs().amax(-1, keepdim=True) * (1 / 127.0))
    assert (back - x).abs().max() > 0  # a lossy format: the bound is what is tested, not equality


@pytest.mark.parametrize("name,dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_float_formats_are_torch_casts(name, dtype):
    x = torch.randn(2, 5, 64)
    fmt = KV_FORMATS[name]
    assert torch.equal(fmt.encode(x), x.to(dtype))
    assert torch.equal(fmt.decode(fmt.encode(x), torch.float32), x.to(dtype).float())
    assert fmt.bytes_per_value(64) == 2 and KV_FORMATS["int8"].bytes_per_value(64) == 68 / 64


def test_int8_attention_is_within_the_bound_its_rows_give():
    """softmax(q.K^T * c) V over int8 rows: each score moves by at most eps = c * sum|q| * max(s_k) / 2, so each
    weight by a factor within exp(+-2 eps), and the output by at most (exp(2 eps) - 1) * max|V| + max(s_v) / 2."""
    torch.manual_seed(1)
    fmt = KV_FORMATS["int8"]
    for B, H, S, d in [(2, 3, 40, 64), (1, 1, 300, 128), (3, 2, 7, 64)]:
        q, k, v = torch.randn(B, H, 1, d), torch.randn(B, H, S, d), torch.randn(B, H, S, d) * 3
        c = 1 / math.sqrt(d)
        kq, vq = fmt.decode(fmt.encode(k), torch.float32), fmt.decode(fmt.encode(v), torch.float32)
        exact = dense_attention(q, k, v, torch.zeros(B, 1, 1, S), c)
        approx = dense_attention(q, kq, vq, torch.zeros(B, 1, 1, S), c)
        s_k = k.abs().amax(-1) / 127  # [B, H, S]
        s_v = v.abs().amax(-1) / 127
        eps = c * q.abs().sum(-1) * s_k.amax(-1, keepdim=True) / 2  # [B, H, 1]
        bound = (torch.exp(2 * eps) - 1) * v.abs().amax((-1, -2))[..., None] + s_v.amax(-1, keepdim=True) / 2
        err = (approx - exact).abs().amax(-1)  # [B, H, 1]
        assert torch.all(err <= bound * 1.001 + 1e-6), (err, bound)
        assert err.max() > 0


def int8_dots_decoder(h: int, kvh: int, hd: int):
    """The native attention kernel alone, attending int8 KV in integers (skips where the CPU lacks AVX512-VNNI)."""
    require_native()
    dec = native_module().Attention(h, kvh, hd, hd**-0.5)
    skip_unless_isa(dec.int8_kv_dots(), ("avx512_vnni", "avx512bw"),
                    "integer int8 KV attention needs AVX512-VNNI and AVX512-BW")
    return dec


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("h,kvh,B,t,cap,segment", [
    (9, 3, 4, 1, 200, False),   # GQA, 3 query rows per (row, KV head), a tail of 8 keys after 3 chunks
    (6, 6, 2, 1, 37, False),    # MHA, one row per KV head, 37 keys: partial 16-key and 4-key blocks
    (6, 1, 1, 1, 1000, False),  # MQA at batch 1: the capacity split into spans, merged by maxima and sums
    (6, 2, 3, 2, 77, True),     # 2 queries a row (6 query rows) with their own bias rows, after a shared segment
    (14, 2, 1, 1, 130, False),  # 7 query rows per KV head: the most one scoring pass takes
    (6, 1, 2, 5, 150, False),   # 30 query rows (a verify step under MQA): the keys transposed once, 5 passes
    (9, 3, 1, 40, 100, True),   # 120 query rows (a prompt chunk of 40 tokens) after a shared segment
])
def test_integer_int8_attention_is_within_its_stated_bound(hd, h, kvh, B, t, cap, segment):
    """The native step's integer attention over int8 rows (kernels/cpu/attention.h, attend_i8) against exact attention over
    the same rows decoded. Its stated bound: a query row as 16-bit digits moves each score by at most
    eps = c * max|q| / 32639 / 2 * sum|k| (so each weight by a factor within exp(+-2 eps)), and weights rounded to
    16 bits of their 64-key chunk's largest move the output by at most n * max|V| / 131070 over n keys. It is a
    small part of what int8 rows themselves move attention: asserted under 1/50, measured 1/800 to 1/160, where
    weights of 8 bits (one digit) measured 1/20 to 1/5 and queries of 8 bits up to 1/1. set_int8_kv_dots(False)
    gives the widening path: float32 arithmetic over the widened rows, far closer (measured 1/50 or less)."""
    from .test_native import reference_attention

    dec = int8_dots_decoder(h, kvh, hd)
    fmt, fmin, c = KV_FORMATS["int8"], torch.finfo(torch.float32).min, hd**-0.5
    g = torch.Generator().manual_seed(hd + cap)
    q = torch.randn(B, t, h * hd, generator=g) * 3
    q[0, 0, :hd] = 0.0  # a zero query row: its digits' step is 0
    own = torch.randn(1, 2, B, kvh, cap, hd, generator=g) * torch.logspace(-1, 1, cap)[:, None]
    own[0, :, 0, 0, 5] = 0.0  # an all-zero row: scale 0
    stored = fmt.encode(own)
    rows = fmt.decode(stored, torch.float32)
    bias = torch.zeros(B, 1, t, cap)
    bias[..., cap - 3:] = fmin  # padding columns
    bias[0, 0, :, :4] = fmin  # a left-padded row
    if cap > 130:
        bias[-1, 0, :, 64:128] = fmin  # a whole masked chunk: its weights are all zero
    for i in range(t):
        bias[:, 0, i, cap - 3 - t + i + 1: cap - 3] = fmin  # query i sees the new tokens up to itself
    segs, ref_segs = [], []
    if segment:
        kv = torch.randn(1, 2, 1, kvh, 70, hd, generator=g)
        segs.append((fmt.encode(kv), torch.zeros(1, 1, 1, 70), torch.zeros(B, dtype=torch.long)))
        ref_segs.append((fmt.decode(segs[0][0], torch.float32), segs[0][1], segs[0][2]))
    args = ([s[0] for s in segs], [s[1] for s in segs], [s[2] for s in segs])
    got = dec.attention_step(q, stored, 0, bias, *args)
    exact = reference_attention(q, rows, bias, ref_segs, c)
    unrounded = reference_attention(q, own, bias, [(kv, sb, grp) for (_, sb, grp), kv in
                                                   zip(segs, [kv] if segment else [])], c)
    err = (got - exact).abs()
    q_heads = q.view(B, t, h, hd).abs().amax(-1)  # [B, t, h]
    eps = c * q_heads.amax() / 32639 / 2 * rows.abs().sum(-1).amax()
    v_max = torch.cat([rows[0, 1].reshape(-1)] + [r[0][0, 1].reshape(-1) for r in ref_segs]).abs().max()
    n = cap + (70 if segment else 0)
    bound = (torch.exp(2 * eps) - 1) * v_max + n * v_max / 131070
    assert err.max() <= bound + 1e-5, (float(err.max()), float(bound))
    assert err.max() > 0  # integer arithmetic, not the widening path
    assert err.max() <= 0.02 * (exact - unrounded).abs().max()
    dec.set_int8_kv_dots(False)
    widened = dec.attention_step(q, stored, 0, bias, *args)
    assert (widened - exact).abs().max() < 0.25 * err.max()  # float32 arithmetic over the widened rows


@pytest.mark.parametrize("hd", [64, 128])
def test_integer_int8_attention_bound_holds_for_channel_scaled_keys(hd):
    """With key channel scales (bmc/kv/smoothing.py) the integer attention runs on q * s and the rows of k / s: its
    stated bound holds in those operands (the same formula, over the scaled query and the scaled rows), and the
    scores are those of q against s times the rows (powers of two). The scaling trades: outlier channels move from
    the keys into the queries, so the integer part's error grows (max|q s| sum|k / s| is larger: measured 3-4.5x)
    while what int8 storage moves falls more (1.6-6x), and the whole error falls."""
    from .test_native import reference_attention

    h, kvh, B, t, cap = 9, 3, 2, 1, 150
    dec = int8_dots_decoder(h, kvh, hd)
    fmt, c = KV_FORMATS["int8"], hd**-0.5
    g = torch.Generator().manual_seed(hd)
    q = torch.randn(B, t, h * hd, generator=g) * 3
    k = torch.randn(1, 1, B, kvh, cap, hd, generator=g)
    for j in (3, 17):  # two outlier channels, and their RoPE partners
        k[..., j] *= 40
        k[..., j + hd // 2] *= 40
    v = torch.randn(1, 1, B, kvh, cap, hd, generator=g)
    top = k.abs().amax((0, 1, 2, 4))  # [kvh, hd], as measure_key_scales takes it
    pair = torch.maximum(top[:, : hd // 2], top[:, hd // 2:])
    top = torch.cat([pair, pair], -1)
    s = torch.exp2(torch.ceil(torch.log2(torch.maximum(top, top.amax(-1, keepdim=True) * 2.0**-8))))
    bias = torch.zeros(B, 1, t, cap)
    unrounded = reference_attention(q, torch.cat([k, v], 1), bias, [], c)
    errors = {}
    for scaled in (False, True):
        kq = (q.view(B, t, kvh, h // kvh, hd) * s[:, None]).reshape(B, t, h * hd) if scaled else q
        stored = fmt.encode(torch.cat([k / s[:, None] if scaled else k, v], 1))
        rows = fmt.decode(stored, torch.float32)
        got = dec.attention_step(kq, stored, 0, bias, [], [], [])
        exact = reference_attention(kq, rows, bias, [], c)
        if scaled:  # the kernel's exact answer is q against s times its rows, bit for bit
            rescaled = torch.cat([rows[:, :1] * s[:, None], rows[:, 1:]], 1)
            assert torch.equal(exact, reference_attention(q, rescaled, bias, [], c))
        eps = c * kq.view(B, t, h, hd).abs().amax() / 32639 / 2 * rows[0, 0].abs().sum(-1).amax()
        v_max = rows[0, 1].abs().max()
        bound = (torch.exp(2 * eps) - 1) * v_max + cap * v_max / 131070
        err = (got - exact).abs().max()
        assert 0 < err <= bound, (scaled, float(err), float(bound))
        errors[scaled] = (float(err), float((exact - unrounded).abs().max()), float((got - unrounded).abs().max()))
    (int_plain, store_plain, whole_plain), (int_scaled, store_scaled, whole_scaled) = errors[False], errors[True]
    assert int_scaled > int_plain and store_scaled < store_plain and whole_scaled < 0.7 * whole_plain
    assert int_scaled <= 0.05 * store_scaled  # still a small part of what int8 storage moves (measured <= 1.8 %)


def test_int8_kv_dots_follow_the_environment(gqa_dir, monkeypatch):
    """BMC_INT8_KV_DOTS=0 (the A/B switch) builds decoders that widen int8 rows instead; by default they attend in
    integers where the CPU can."""
    require_native()
    from bmc.kernels.native import native_attention

    int8_dots_decoder(3, 1, 64)  # skips where the CPU cannot
    monkeypatch.setenv("BMC_INT8_KV_DOTS", "0")
    assert not native_attention(3, 1, 64).int8_kv_dots()
    assert not bmc.load(str(gqa_dir)).net.native_decoder().int8_kv_dots()
    monkeypatch.delenv("BMC_INT8_KV_DOTS")
    assert bmc.load(str(gqa_dir)).net.native_decoder().int8_kv_dots()


def test_unknown_kv_dtype_is_refused_by_name():
    with pytest.raises(InvalidRequestError, match="unknown kv_dtype 'int4'"):
        GenerationConfig(kv_dtype="int4")
    with pytest.raises(InvalidRequestError, match="unknown kv_dtype"):
        kv_format("fp8", torch.float32)
    cache = KV_STRATEGIES["upfront"](num_layers=1, batch_size=1, num_kv_heads=1, head_dim=8, max_length=4)
    other = KV_STRATEGIES["upfront"](num_layers=1, batch_size=1, num_kv_heads=1, head_dim=8, max_length=4,
                                     kv_dtype="int8")
    with pytest.raises(ValueError, match="int8 KV cache's rows cannot join a float32 one"):
        cache.place(0, other)


def native_and_eager_step(model, monkeypatch, kv_dtype: str, t: int, tree: bool):
    """Prefill two left-padded prompts eagerly into a cache of `kv_dtype`, then one t-token step natively and one
    eagerly on a copy: (native logits, eager logits, native cache, eager cache)."""
    cfg = model.config
    long_prompt = [(13 * i) % 300 + 3 for i in range(41)]  # capacity > 32: whole 16-key blocks and a tail
    prompts = [long_prompt, [40, 41, 42]]
    B, P = 2, len(long_prompt)
    pads = [P - len(p) for p in prompts]
    make = lambda: KV_STRATEGIES["bmc"](num_layers=cfg.num_layers, batch_size=B, num_kv_heads=cfg.num_kv_heads,  # noqa: E731
                                        head_dim=cfg.head_dim, max_length=P + t, dtype=model.dtype, left_pad=pads,
                                        r=5, kv_dtype=kv_dtype)
    cache = make()
    toks = torch.tensor([[0] * d + p for d, p in zip(pads, prompts)])
    pos = (torch.arange(P)[None] - torch.tensor(pads)[:, None]).clamp(min=0)
    with torch.inference_mode():
        monkeypatch.setenv("BMC_NATIVE", "0")
        cache.reserve(P)
        model.net(toks, pos, cache, dense_attention, cache.attention_bias(P))
        cache.commit(P)
        monkeypatch.delenv("BMC_NATIVE")
        new = torch.randint(3, cfg.vocab_size, (B, t), generator=torch.Generator().manual_seed(t))
        new_pos = pos[:, -1:] + 1 + torch.arange(t)[None]
        visible = None
        if tree:  # a star-shaped draft tree: node i sees the root and itself
            visible = torch.eye(t, dtype=torch.bool)[None].repeat(B, 1, 1)
            visible[:, :, 0] = True
            new_pos = pos[:, -1:] + 1 + (torch.arange(t) > 0).long()[None]
        cache.reserve(t)
        bias = cache.attention_bias(t, visible)
        other = make()
        other.kv, other.bias, other.length = cache.kv.clone(), cache.bias.clone(), cache.length
        native = model.net(new, new_pos, cache, dense_attention, bias, all_logits=True)
        monkeypatch.setenv("BMC_NATIVE", "0")
        ref = model.net(new, new_pos, other, dense_attention, bias.clone(), all_logits=True)
        monkeypatch.delenv("BMC_NATIVE")
    return native, ref, cache, other


@pytest.mark.parametrize("kv_dtype", NARROW)
@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("t,tree", [(1, False), (4, False), (5, True)])
def test_native_step_writes_and_reads_the_eager_bytes(wide_heads, monkeypatch, kv_dtype, hd, t, tree):
    require_native()
    model = bmc.load(wide_heads[hd])
    assert model.net.native_decoder() is not None
    native, ref, c1, c2 = native_and_eager_step(model, monkeypatch, kv_dtype, t, tree)
    assert c1.kv.dtype == KV_FORMATS[kv_dtype].storage
    # the new K/V come from GEMMs whose float sums differ in the last bits: a value at a rounding boundary may be
    # stored one step apart (encode itself is bit-exact: the test below)
    step = c2.read(c2.kv).abs().amax(-1, keepdim=True) / (127 if kv_dtype == "int8" else 64)
    assert torch.all((c1.read(c1.kv) - c2.read(c2.kv)).abs() <= step + 1e-6)
    torch.testing.assert_close(native, ref, atol=2e-5, rtol=2e-5)
    c1.commit(t)
    c1.check_integrity()


@pytest.mark.parametrize("kv_dtype", NARROW)
def test_native_encode_is_the_pytorch_encode_bit_for_bit(kv_dtype):
    require_native()
    mod = native_module()
    torch.manual_seed(3)
    x = torch.randn(500, 64) * torch.logspace(-4, 4, 500)[:, None]
    x[0] = 0.0
    x[1, :] = torch.arange(64) - 31.5  # halves: ties of the int8 rounding (scale 31.5 / 127)
    x[2, :8] = torch.tensor([1.0, 1 + 2**-8, 1 + 3 * 2**-9, -(1 + 2**-8), 65504.0, 1e-8, -1e-6, 3.3e-5])
    fmt = KV_FORMATS[kv_dtype]
    assert torch.equal(mod.encode_kv(x, torch.empty(0, dtype=fmt.storage)), fmt.encode(x))


def greedy(model, kv_dtype: str, **kw) -> list[list[int]]:
    return [c.token_ids for c in bmc.generate(model, PAIR, max_new_tokens=16, ignore_eos=True, kv_dtype=kv_dtype,
                                              **kw)]


@pytest.mark.parametrize("variant", [f"llama-{v}" for v in LLAMA_VARIANTS] + [f"opt-{v}" for v in OPT_VARIANTS])
def test_narrow_kv_moves_logits_little_and_tokens_only_at_near_ties(tiny_dirs, variant):
    """The tiny random models' top two logits are often 5e-4 apart, below what bfloat16 or int8 KV moves them
    (~2e-3): their greedy tokens may part at such a near tie and nowhere else. Logits over the float32 greedy
    sequence (teacher-forced) move by under 1 % of their range."""
    model = bmc.load(str(tiny_dirs[variant]))
    for prompt, plain in zip(PAIR, greedy(model, "auto")):
        seq = prompt + plain
        _, ref = prefill_alone(model, seq, len(seq), all_logits=True)
        top2 = ref[0].topk(2, -1).values
        margin = top2[:, 0] - top2[:, 1]
        for kv_dtype in NARROW:
            _, got = prefill_alone(model, seq, len(seq), all_logits=True, kv_dtype=kv_dtype)
            dev = (got - ref)[0].abs().amax(-1)  # per position
            assert dev.max() <= 0.01 * ref.abs().max(), kv_dtype
            tokens = bmc.generate(model, [prompt], max_new_tokens=16, ignore_eos=True, kv_dtype=kv_dtype)[0].token_ids
            parted = next((i for i, (a, b) in enumerate(zip(tokens, plain)) if a != b), None)
            if parted is not None:
                at = len(prompt) - 1 + parted  # the position whose logits chose the token
                assert margin[at] <= 2 * dev[at], (kv_dtype, parted, float(margin[at]), float(dev[at]))


@pytest.mark.slow
def test_narrow_kv_gives_the_float32_greedy_tokens_on_the_real_model(real_model):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    plain = [c.token_ids for c in bmc.generate(real_model, prompts, max_new_tokens=32)]
    for kv_dtype in NARROW:
        got = [c.token_ids for c in bmc.generate(real_model, prompts, max_new_tokens=32, kv_dtype=kv_dtype)]
        assert got == plain, kv_dtype


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_every_path_gives_the_plain_tokens_of_its_kv_dtype(gqa_dir, monkeypatch, kv_dtype):
    """Caches, chunk sizes, speculation in the padding rows, shared prefixes (samples and a common part) and the
    eager path: each gives what the plain bmc run with the same kv_dtype gives (exact with respect to it)."""
    model = bmc.load(str(gqa_dir))
    plain = greedy(model, kv_dtype, r=4)
    for kv in ("upfront", "iterative"):
        assert greedy(model, kv_dtype, kv=kv) == plain, kv
    assert greedy(model, kv_dtype, r=1) == plain
    spec = bmc.generate(model, PAIR, max_new_tokens=16, ignore_eos=True, kv_dtype=kv_dtype, speculative="ngram",
                        tree="chain:3", r=4)
    assert [c.token_ids for c in spec] == plain
    shared = bmc.generate(model, PAIR, max_new_tokens=16, ignore_eos=True, kv_dtype=kv_dtype, num_samples=2)
    assert [c.token_ids for c in shared] == [plain[0], plain[0], plain[1], plain[1]]
    common = [[3, 4, 5, 6, 7, 8] + p for p in PAIR]  # a leading part common to both prompts: one segment
    a = bmc.generate(model, common, max_new_tokens=12, ignore_eos=True, kv_dtype=kv_dtype, num_samples=2)
    b = bmc.generate(model, common, max_new_tokens=12, ignore_eos=True, kv_dtype=kv_dtype, num_samples=2,
                     share_prefix="off")
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    monkeypatch.setenv("BMC_NATIVE", "0")
    assert greedy(model, kv_dtype, r=4) == plain


def test_int8_kv_holds_about_a_quarter_of_the_bytes(gqa_dir):
    model = bmc.load(str(gqa_dir))
    f32 = bmc.generate(model, PAIR, max_new_tokens=8, ignore_eos=True, kv="upfront").stats
    i8 = bmc.generate(model, PAIR, max_new_tokens=8, ignore_eos=True, kv="upfront", kv_dtype="int8").stats
    d = model.config.head_dim
    assert i8.peak_kv_bytes == pytest.approx(f32.peak_kv_bytes * (d + 4) / (4 * d), rel=1e-6)


def test_served_requests_with_int8_kv_equal_generate_alone(gqa_dir):
    model = bmc.load(str(gqa_dir))
    sched = Scheduler(model, max_num_seqs=3, max_num_batched_tokens=6, r=4, kv_dtype="int8")
    lengths = [14, 6, 9, 11, 3]
    reqs = [request(p, n) for p, n in zip(PROMPTS, lengths)]  # requests without a kv_dtype: the server's is used
    drive(sched, {0: [reqs[0][0]], 2: [reqs[1][0], reqs[2][0]], 5: [reqs[3][0]], 9: [reqs[4][0]]},
          collectors=[c for _, c in reqs])
    for (_, col), p, n in zip(reqs, PROMPTS, lengths):
        assert col.error is None
        assert col.tokens == {0: alone(model, p, n, kv_dtype="int8")}, p
    assert_idle(sched)
    assert sched.cache.format.name == "int8"


def test_cli_kv_dtype(gqa_dir):
    run = lambda *a: subprocess.run([sys.executable, "-m", "bmc.cli.generate", "--model", str(gqa_dir), *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    ok = run("hello there", "--max-new-tokens", "4", "--kv-dtype", "int8", "--ignore-eos")
    assert ok.returncode == 0, ok.stderr
    bad = run("hello", "--kv-dtype", "int3")
    assert bad.returncode == 2 and "--kv-dtype" in bad.stderr and "int3" in bad.stderr


def test_the_memory_check_counts_the_stored_bytes(gqa_dir):
    """A run whose float32 KV would not fit the device's memory but whose int8 KV does is not refused."""
    from bmc.engine import check_kv_fits, device_memory_bytes

    model = bmc.load(str(gqa_dir))
    cfg = model.config
    row_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * 1024  # one row of 1024 positions, float32
    rows = int(device_memory_bytes(model.device) / row_bytes * 2)  # twice what float32 fits, about half for int8
    with pytest.raises(InvalidRequestError, match="GiB of KV cache"):
        check_kv_fits(model, rows, 1024)
    check_kv_fits(model, rows, 1024, "int8")
