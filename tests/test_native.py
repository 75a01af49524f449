"""The native CPU decode step (bmc/kernels) against the eager PyTorch path and HF transformers."""
from __future__ import annotations

import functools

import pytest
import torch

import bmc
from bmc.attention import dense_attention
from bmc.kernels.native import NATIVE_MAX_T, native_module
from bmc.kv import KV_STRATEGIES

from .conftest import LLAMA_VARIANTS, OPT_VARIANTS, require_native, transformers

VARIANTS = [f"llama-{v}" for v in LLAMA_VARIANTS] + [f"opt-{v}" for v in OPT_VARIANTS]


@pytest.fixture
def eager(monkeypatch):
    """Run a block on the eager path: `with eager(): ...`."""
    class Switch:
        def __enter__(self):
            monkeypatch.setenv("BMC_NATIVE", "0")

        def __exit__(self, *exc):
            monkeypatch.delenv("BMC_NATIVE", raising=False)
    return Switch


def step_both_ways(model, eager, prompts: list[list[int]], t: int, tree: bool):
    """Prefill left-padded prompts eagerly, then run one t-token step natively and eagerly on copies of the cache.
    Returns (native logits, eager logits, native cache, eager cache)."""
    B, P = len(prompts), max(len(p) for p in prompts)
    cfg = model.config
    pads = [P - len(p) for p in prompts]
    cache = KV_STRATEGIES["bmc"](num_layers=cfg.num_layers, batch_size=B, num_kv_heads=cfg.num_kv_heads,
                                 head_dim=cfg.head_dim, max_length=P + t, dtype=model.dtype, left_pad=pads, r=5)
    toks = torch.tensor([[0] * d + p for d, p in zip(pads, prompts)])
    pos = (torch.arange(P)[None] - torch.tensor(pads)[:, None]).clamp(min=0)
    with torch.inference_mode():
        with eager():
            cache.reserve(P)
            model.net(toks, pos, cache, dense_attention, cache.attention_bias(P))
            cache.commit(P)
        new = torch.randint(3, cfg.vocab_size, (B, t), generator=torch.Generator().manual_seed(t))
        new_pos = pos[:, -1:] + 1 + torch.arange(t)[None]
        visible = None
        if tree:  # node i sees the root and itself only: a star-shaped draft tree, depth positions 1
            visible = torch.eye(t, dtype=torch.bool)[None].repeat(B, 1, 1)
            visible[:, :, 0] = True
            new_pos = pos[:, -1:] + 1 + (torch.arange(t) > 0).long()[None]
        cache.reserve(t)
        bias = cache.attention_bias(t, visible)
        other = KV_STRATEGIES["bmc"](num_layers=cfg.num_layers, batch_size=B, num_kv_heads=cfg.num_kv_heads,
                                     head_dim=cfg.head_dim, max_length=P + t, dtype=model.dtype, left_pad=pads, r=5)
        other.kv, other.bias, other.length = cache.kv.clone(), cache.bias.clone(), cache.length
        native = model.net(new, new_pos, cache, dense_attention, bias, all_logits=True)
        with eager():
            ref = model.net(new, new_pos, other, dense_attention, bias.clone(), all_logits=True)
    return native, ref, cache, other


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("t,tree", [(1, False), (4, False), (5, True)])
def test_native_step_equals_eager(tiny_dirs, eager, variant, t, tree):
    require_native()
    model = bmc.load(str(tiny_dirs[variant]))
    native, ref, c1, c2 = step_both_ways(model, eager, [[5, 17, 33, 80, 101, 7], [40, 41, 42]], t, tree)
    torch.testing.assert_close(native, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(c1.kv, c2.kv, atol=1e-5, rtol=1e-5)  # the same K/V written at the same columns
    uses_native = not variant.startswith("opt-") or variant == "opt-pre_norm"  # post-norm / projected OPT: eager
    assert (model.net.native_decoder() is not None) == uses_native


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("t", [1, 3])
def test_native_vectorised_head_dims_match_hf(wide_heads, eager, hd, t):
    require_native()
    path = wide_heads[hd]
    model = bmc.load(path)
    long_prompt = [(13 * i) % 300 + 3 for i in range(37)]  # capacity > 32: whole 16-key score blocks + a tail
    native, ref, c1, _ = step_both_ways(model, eager, [long_prompt, [40, 41]], t, tree=False)
    assert c1.capacity > 32
    torch.testing.assert_close(native, ref, atol=2e-5, rtol=2e-5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = [5, 17, 33, 80, 101, 7, 9, 11, 12, 13]
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0, -1]
    got = bmc.generate(model, [ids[:-1]], max_new_tokens=1, ignore_eos=True)  # prefill 9 tokens natively
    assert got[0].token_ids == [int(hf(torch.tensor([ids[:-1]])).logits[0, -1].argmax())]
    cache = KV_STRATEGIES["upfront"](num_layers=2, batch_size=1, num_kv_heads=1, head_dim=hd, max_length=len(ids))
    with torch.inference_mode():
        cache.reserve(len(ids))
        logits = model.net(torch.tensor([ids]), torch.arange(len(ids))[None], cache, dense_attention,
                           cache.attention_bias(len(ids)))
    torch.testing.assert_close(logits[0, -1], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv", list(KV_STRATEGIES))
@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_native_greedy_tokens_equal_eager(tiny_dirs, eager, kv, speculative):
    require_native()
    model = bmc.load(str(tiny_dirs["llama-gqa"]))
    prompts = [[5, 17, 33, 80, 101, 7, 9, 250, 12, 5, 17, 33], [40, 41, 42], [300, 3, 99, 98, 97, 96]]
    kw = dict(max_new_tokens=40, ignore_eos=True, kv=kv, speculative=speculative, tree="chain:4")
    got = bmc.generate(model, prompts, **kw)
    with eager():
        ref = bmc.generate(model, prompts, **kw)
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    assert got.stats.decode_kernel == "native-cpu" and ref.stats.decode_kernel == "torch"


@pytest.mark.parametrize("M", [1, 3, 6, 8, 9, 17, 20])
@pytest.mark.parametrize("K,N", [(16, 16), (37, 50), (64, 3), (40, 150)])
def test_panel_linear_equals_matmul(M, K, N):
    require_native()
    mod = native_module()
    g = torch.Generator().manual_seed(M * K + N)
    x, w, b = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g), torch.randn(N, generator=g)
    packed = mod.pack_panels(w)
    assert packed.shape == ((N + 15) // 16, K, 16)
    torch.testing.assert_close(mod.panel_linear(x, mod.Weight(packed), N, b), torch.addmm(b, x, w), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mod.panel_linear(x, mod.Weight(packed), N, None), x @ w, atol=1e-5, rtol=1e-5)


def test_stream_read_reads_every_line():
    """The benchmarks' read-bandwidth probe must touch every 256-byte step of the buffer, on every thread's share:
    a single set byte anywhere shows in what it returns."""
    require_native()
    mod = native_module()
    x = torch.zeros(3 * 4096 * 256 + 512, dtype=torch.uint8)  # more than one parallel_for grain
    assert mod.stream_read(x) == 0
    for at in (0, 255, 4096 * 256 - 1, 4096 * 256 + 64, x.numel() - 1):
        x[at] = 0x40
        assert mod.stream_read(x) != 0, at
        x[at] = 0


@pytest.mark.parametrize("shape", [(8, 1, 49152), (1, 1), (3, 15), (3, 16), (2, 4, 17), (5, 1000)])
def test_native_argmax_equals_torch(shape):
    """Greedy decoding's argmax: the first index of the maximum (ties), of the first NaN, +-inf, odd lengths."""
    require_native()
    from bmc.kernels.native import argmax

    g = torch.Generator().manual_seed(sum(shape))
    for trial in range(6):
        x = torch.randn(*shape, generator=g)
        n = shape[-1]
        if trial == 1 and n > 2:  # a tie: the first of two equal maxima, in different lanes
            x[..., n // 3], x[..., n - 1] = 1e4, 1e4
        if trial == 2:
            x[..., -1] = float("inf")
        if trial == 3 and n > 1:  # NaN wins, the first one
            x[..., n - 1], x[..., n // 2] = float("nan"), float("nan")
        if trial == 4:
            x.fill_(float("-inf"))
        if trial == 5:
            x = x.round()  # many ties
        got = argmax(x)
        assert got.dtype == torch.long and got.shape == x.shape[:-1]
        assert torch.equal(got, x.argmax(dim=-1)), (shape, trial)


def reference_attention(q, own, bias, segments, scale):
    """Brute force in float64: each row's keys are its segments' groups then its own cache, KV heads repeated."""
    B, t, _ = q.shape
    kvh, d = own.shape[3], own.shape[5]
    h = q.shape[2] // d
    out = torch.empty(B, t, h, d, dtype=torch.float64)
    for b in range(B):
        ks = [kv[0, 0, grp[b]] for kv, _, grp in segments] + [own[0, 0, b]]
        vs = [kv[0, 1, grp[b]] for kv, _, grp in segments] + [own[0, 1, b]]
        K, V = (torch.cat(x, dim=1).double().repeat_interleave(h // kvh, dim=0) for x in (ks, vs))  # [h, n, d]
        for i in range(t):
            bias_row = torch.cat([sb[grp[b], 0, 0] for _, sb, grp in segments]
                                 + [bias[b, 0, i if bias.shape[2] > 1 else 0]]).double()
            qi = q[b, i].view(h, d).double()
            w = torch.softmax(torch.einsum("hd,hnd->hn", qi, K) * scale + bias_row, dim=-1)
            out[b, i] = torch.einsum("hn,hnd->hd", w, V)
    return out.view(B, t, h * d).float()


@pytest.mark.parametrize("hd", [64, 128, 24])
@pytest.mark.parametrize("t", [1, 3])
def test_attention_step_equals_brute_force(hd, t):
    """One layer's native attention (what bmc-calibrate and the benchmarks time), with and without two levels of
    shared segments (groups read by several rows, chunk boundaries inside them, masked columns), GQA, a padded
    own cache and a per-query bias for t > 1."""
    require_native()
    mod = native_module()
    g = torch.Generator().manual_seed(hd + t)
    h, kvh, B, cap = 6, 2, 5, 37
    dec = mod.Attention(h, kvh, hd, hd**-0.5)  # the kernel alone, no decoder
    q = torch.randn(B, t, h * hd, generator=g)
    own = torch.randn(1, 2, B, kvh, cap, hd, generator=g)
    bias = torch.zeros(B, 1, t if t > 1 else 1, cap)
    bias[..., 30:] = torch.finfo(torch.float32).min  # padding rows of the chunk
    bias[1, 0, :, :4] = torch.finfo(torch.float32).min  # a left-padded row
    if t > 1:
        bias[:, 0, 0, 29] = torch.finfo(torch.float32).min  # a tree mask: query 0 does not see the last node
    segs = []
    for groups, length, grp in ((1, 150, [0] * B), (2, 70, [0, 1, 1, 0, 1])):
        sb = torch.zeros(groups, 1, 1, length)
        sb[-1, ..., :3] = torch.finfo(torch.float32).min
        segs.append((torch.randn(1, 2, groups, kvh, length, hd, generator=g), sb, torch.tensor(grp)))
    for used in ([], segs[:1], segs):
        got = dec.attention_step(q, own, 0, bias, [s[0] for s in used], [s[1] for s in used], [s[2] for s in used])
        torch.testing.assert_close(got, reference_attention(q, own, bias, used, hd**-0.5), atol=2e-5, rtol=1e-4)
    with pytest.raises(RuntimeError, match="reads group"):
        dec.attention_step(q, own, 0, bias, [segs[1][0]], [segs[1][1]], [torch.tensor([0, 1, 2, 0, 1])])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("t", [1, 40])
def test_a_rows_cached_segments_give_the_bits_of_the_same_keys_in_its_own_cache(kv_dtype, t):
    """A row that alone reads cached segments (a 250- and a 115-token node: chunks and 256-key spans cross their
    ends and the start of its own columns) gets the bits it gets with the same keys in its own cache, as a decode
    row (and beside another row that reads no segment, in a batch with left padding) and as a prompt chunk; in
    float32, bfloat16 and int8 KV. A segment two decode rows read (Hydragen's case: each chunk of its whole spans
    read once for both) gives the same bits too."""
    require_native()
    mod = native_module()
    h, kvh, hd, lens, tail = 6, 2, 64, (250, 115), 90
    g = torch.Generator().manual_seed(t)
    total = sum(lens) + tail
    keys = torch.randn(1, 2, 1, kvh, total, hd, generator=g)
    if kv_dtype == torch.int8:  # rows as the cache stores them: int8 values and a float32 scale a row
        from bmc.kv.formats import KV_FORMATS

        keys = KV_FORMATS["int8"].encode(keys)
    else:
        keys = keys.to(kv_dtype)
    q = torch.randn(2, t, h * hd, generator=g)
    fmin = torch.finfo(torch.float32).min
    causal = torch.zeros(t, total)
    causal[:, total - t:] = torch.full((t, t), fmin).triu(1)  # the prompt chunk's own last t keys, causally
    causal[:, 3:7] = fmin  # a few masked keys inside the first node (its bias masks them)
    whole_bias = causal[None, None].clone()
    dec = mod.Attention(h, kvh, hd, hd**-0.5)
    prompt = t > 1
    alone = dec.attention_step(q[:1].contiguous(), keys, 0, whole_bias, [], [], [], prompt=prompt)
    cut = [0, lens[0], sum(lens)]
    segs = [(keys[..., a:a + n, :].contiguous(), causal[:1, a:a + n].reshape(1, 1, 1, n).clone(),
             torch.tensor([0, -1])) for a, n in zip(cut, lens)]
    # row 0 reads the segments and its own last keys; row 1 (no segments) its own 200 keys, left-padded to fit
    cap = max(tail, 200)
    own = torch.zeros(1, 2, 2, kvh, cap, keys.shape[-1], dtype=keys.dtype)
    own[:, :, 0, :, cap - tail:] = keys[:, :, 0, :, sum(lens):]
    own[:, :, 1, :, cap - 200:] = keys[:, :, 0, :, :200]
    bias = torch.full((2, 1, t, cap), fmin)
    bias[0, 0, :, cap - tail:] = causal[:, sum(lens):]
    bias[1, 0, :, cap - 200:] = 0
    got = dec.attention_step(q, own, 0, bias, [s[0] for s in segs], [s[1] for s in segs], [s[2] for s in segs],
                             prompt=prompt)
    assert torch.equal(got[0], alone[0])
    if t == 1:  # both rows read the segments: their first whole span walked once for both
        shared = [(s[0], s[1], torch.tensor([0, 0])) for s in segs]
        both = dec.attention_step(q, own, 0, bias, [s[0] for s in shared], [s[1] for s in shared],
                                  [s[2] for s in shared])
        assert torch.equal(both[0], alone[0])


def _stored_as(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """Keys or values as a cache of kv_dtype stores them (int8: the int8 KV format's rows)."""
    if kv_dtype == torch.int8:
        from bmc.kv.formats import KV_FORMATS

        return KV_FORMATS["int8"].encode(x)
    return x.to(kv_dtype)


def _hole_kernel(h: int, kvh: int, hd: int, seed: int, kv_dtype: torch.dtype):
    """The native attention kernel alone (no decoder), a seeded generator, and the cache's encoding of kv_dtype."""
    require_native()
    return (native_module().Attention(h, kvh, hd, hd**-0.5), torch.Generator().manual_seed(seed),
            functools.partial(_stored_as, kv_dtype=kv_dtype))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_row_with_holes_gets_the_bits_of_its_keys_without_them(kv_dtype):
    """Masked columns inside a decode row (holes: where rows accepted different counts of a verify step), with
    `holes` set, are left out of the row's key numbering: the same bits as the keys alone, at holes before, across
    and after chunk and span boundaries (the hole columns hold NaN, so a hole read would show)."""
    h, kvh, hd, fmin = 6, 2, 64, torch.finfo(torch.float32).min
    dec, g, stored = _hole_kernel(h, kvh, hd, 9, kv_dtype)

    for n, at, holes in ((100, 10, 1), (200, 64, 5), (300, 70, 64), (300, 250, 9), (300, 280, 3)):
        keys = torch.randn(1, 2, 1, kvh, n, hd, generator=g)
        q = torch.randn(1, 1, h * hd, generator=g)
        alone = dec.attention_step(q, stored(keys), 0, torch.zeros(1, 1, 1, n), [], [], [])
        filler = torch.full((1, 2, 1, kvh, holes, hd), float("nan") if kv_dtype != torch.int8 else 1e4)
        kv = torch.cat([keys[..., :at, :], filler, keys[..., at:, :]], dim=4)
        bias = torch.zeros(1, 1, 1, n + holes)
        bias[..., at:at + holes] = fmin
        got = dec.attention_step(q, stored(kv), 0, bias, [], [], [], holes=True)
        assert torch.equal(got, alone), (n, at, holes)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_branching_trees_nodes_get_the_bits_of_their_keys_decoded_alone(kv_dtype):
    """A verify tree's node masks its siblings' columns, which sit among its ancestors' (a branching tree: a
    dynamic tree's nodes in breadth-first order). Each node's query gets the bits of the same query decoded alone
    over its keys: the cache's, its ancestors' and its own, one after another, so speculation with such a tree gives
    plain decoding's tokens. With holes in the cache before the tree too; the masked columns hold NaN, so a read
    would show. Contexts put the tree before, across and after chunk (64) and span (256) boundaries."""
    h, kvh, hd, fmin = 6, 2, 64, torch.finfo(torch.float32).min
    dec, g, stored = _hole_kernel(h, kvh, hd, 11, kv_dtype)

    parent = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 7]  # breadth-first: node i's parent, node 0 the step's own token
    t = len(parent)
    for context, holes in ((40, 0), (60, 0), (250, 3), (300, 0), (500, 70)):
        n = context + holes + t
        kv = torch.randn(1, 2, 1, kvh, n, hd, generator=g)
        filler = float("nan") if kv_dtype != torch.int8 else 1e4
        bias = torch.zeros(1, 1, t, n)
        if holes:  # a cache hole in the middle of the context
            kv[..., context // 2:context // 2 + holes, :] = filler
            bias[..., context // 2:context // 2 + holes] = fmin
        tree0 = context + holes
        ancestors = []
        for i in range(t):
            chain, a = [], i
            while a >= 0:
                chain.append(a)
                a = parent[a]
            ancestors.append(chain[::-1])
            bias[0, 0, i, tree0:] = fmin
            bias[0, 0, i, [tree0 + a for a in chain]] = 0.0
        q = torch.randn(1, t, h * hd, generator=g)
        got = dec.attention_step(q, stored(kv), 0, bias, [], [], [])
        keep = [c for c in range(tree0) if bias[0, 0, 0, c] == 0]
        for i in range(t):
            cols = keep + [tree0 + a for a in ancestors[i]]
            alone = dec.attention_step(q[:, i:i + 1], stored(kv[..., cols, :]), 0, torch.zeros(1, 1, 1, len(cols)),
                                       [], [], [])
            assert torch.equal(got[:, i:i + 1], alone), (context, holes, i)


@pytest.mark.parametrize("kvh", [1, 2, 6])
@pytest.mark.parametrize("hd,t", [(64, 1), (64, 5), (24, 5)])
def test_attention_step_split_capacity_and_wide_scores(kvh, hd, t):
    """Batch 1 over a capacity of several key chunks: the capacity is split into spans attended in parallel and
    merged by their maxima and sums; from 8 query rows per KV head (a verify step's tree under GQA/MQA) the scores
    are one matrix product over transposed key panels, with a partial last panel. Masked padding, a left-padded
    start, a tree mask, and a shared segment in front."""
    require_native()
    mod = native_module()
    g = torch.Generator().manual_seed(kvh * 100 + hd + t)
    h, cap, fmin = 6, 300, torch.finfo(torch.float32).min
    dec = mod.Attention(h, kvh, hd, hd**-0.5)  # the kernel alone, no decoder
    q = torch.randn(1, t, h * hd, generator=g)
    own = torch.randn(1, 2, 1, kvh, cap, hd, generator=g)
    bias = torch.zeros(1, 1, t, cap)
    bias[..., 290:] = fmin
    bias[..., :5] = fmin
    for i in range(t - 1):
        bias[0, 0, i, 285 + i + 1: 290] = fmin  # query i sees the tree nodes up to itself
    seg = (torch.randn(1, 2, 1, kvh, 90, hd, generator=g), torch.zeros(1, 1, 1, 90), torch.tensor([0]))
    for used in ([], [seg]):
        got = dec.attention_step(q, own, 0, bias, [s[0] for s in used], [s[1] for s in used], [s[2] for s in used])
        torch.testing.assert_close(got, reference_attention(q, own, bias, used, hd**-0.5), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kvh,t", [(2, 1), (1, 1), (1, 19)])
def test_attention_step_many_rows_on_a_shared_segment(kvh, t):
    """A shared segment read by many rows of one group (32 samples of a prompt; a tree of 19 nodes under MQA): the
    rows of a group and KV head are attended together with their queries transposed into 16-row panels (slices of
    up to 96 rows, a partial last panel, more than 6 panels per slice at t = 19); the group's first chunk is wholly
    masked and its last is partial."""
    require_native()
    mod = native_module()
    g = torch.Generator().manual_seed(kvh + t)
    h, hd, B, cap, fmin = 6, 64, 37 if t == 1 else 2, 9, torch.finfo(torch.float32).min
    dec = mod.Attention(h, kvh, hd, hd**-0.5)  # the kernel alone, no decoder
    q = torch.randn(B, t, h * hd, generator=g)
    own = torch.randn(1, 2, B, kvh, cap, hd, generator=g)
    bias = torch.zeros(B, 1, t if t > 1 else 1, cap)
    bias[..., 4 + t:] = fmin
    groups, length = 2, 203
    sb = torch.zeros(groups, 1, 1, length)
    sb[0, ..., :70] = fmin  # more than a whole chunk of left padding
    grp = torch.tensor([b % 3 // 2 for b in range(B)])  # two groups of different sizes
    seg = (torch.randn(1, 2, groups, kvh, length, hd, generator=g), sb, grp)
    got = dec.attention_step(q, own, 0, bias, [seg[0]], [seg[1]], [seg[2]])
    torch.testing.assert_close(got, reference_attention(q, own, bias, [seg], hd**-0.5), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("threads", [1, 3, 8, 16])
@pytest.mark.parametrize("B", [1, 6])
def test_attention_step_any_thread_count(threads, B):
    """The keys are split into spans by the thread count (at batch 1: one span of the 5-6 chunks at 1 thread, 3
    at 3 threads, one chunk a span at 16), each span attended into its own partial state and the partials merged:
    the same exact attention for every count."""
    require_native()
    mod = native_module()
    g = torch.Generator().manual_seed(threads * 10 + B)
    h, kvh, hd, cap, fmin = 6, 2, 64, 300, torch.finfo(torch.float32).min
    dec = mod.Attention(h, kvh, hd, hd**-0.5)  # the kernel alone, no decoder
    q = torch.randn(B, 1, h * hd, generator=g)
    own = torch.randn(1, 2, B, kvh, cap, hd, generator=g)
    bias = torch.zeros(B, 1, 1, cap)
    bias[..., 280:] = fmin
    sb = torch.zeros(2, 1, 1, 330)
    sb[1, ..., :100] = fmin
    seg = (torch.randn(1, 2, 2, kvh, 330, hd, generator=g), sb, torch.tensor([b % 2 for b in range(B)]))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for used in ([], [seg]):
            got = dec.attention_step(q, own, 0, bias, [s[0] for s in used], [s[1] for s in used],
                                     [s[2] for s in used])
            torch.testing.assert_close(got, reference_attention(q, own, bias, used, hd**-0.5), atol=2e-5, rtol=1e-4)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("max_t", [None, 64], ids=["native-prefill", "eager-prefill"])
def test_prefill_chunks_native_or_eager_match(tiny_dirs, eager, monkeypatch, max_t):
    """A 100-token prompt is prefilled by the native step (within NATIVE_MAX_T) or, with the limit lowered below
    it, on torch's GEMMs; either way the tokens are the eager path's and the decode after it is native."""
    require_native()
    import bmc.models.llama as llama_module
    if max_t is not None:
        monkeypatch.setattr(llama_module, "NATIVE_MAX_T", max_t)
    model = bmc.load(str(tiny_dirs["llama-gqa"]))
    prompt = [(7 * i) % 300 + 3 for i in range(100)]
    got = bmc.generate(model, [prompt], max_new_tokens=8, ignore_eos=True)
    assert got.stats.decode_kernel == "native-cpu"
    with eager():
        ref = bmc.generate(model, [prompt], max_new_tokens=8, ignore_eos=True)
    assert got[0].token_ids == ref[0].token_ids


@pytest.mark.parametrize("variant", ["llama-gqa", "llama-mqa", "opt-pre_norm"])
def test_native_shared_prefix_equals_eager(tiny_dirs, eager, variant):
    """Hierarchical shared segments (a common header, then each prompt's text for its samples) attended natively in
    one softmax with each row's own cache give the eager LSE-merged path's tokens, and the same sampled tokens."""
    require_native()
    model = bmc.load(str(tiny_dirs[variant]))
    header = [(11 * i) % 300 + 3 for i in range(20)]  # >= MIN_SHARED_PREFIX tokens common to all prompts
    prompts = [header + [5, 17, 33, 80], header + [40, 41], header + [300, 3, 99, 98, 97]]
    for kw in (dict(), dict(temperature=0.8, seed=3)):
        got = bmc.generate(model, prompts, max_new_tokens=12, ignore_eos=True, num_samples=3, **kw)
        with eager():
            ref = bmc.generate(model, prompts, max_new_tokens=12, ignore_eos=True, num_samples=3, **kw)
        assert [c.token_ids for c in got] == [c.token_ids for c in ref]
        assert got.stats.cached_prompt_tokens == 2 * 20 and got.stats.prefix_groups == 1 + len(prompts)
        assert got.stats.decode_kernel == "native-cpu"


def test_native_step_replaces_mkl_packing(gqa_dir):
    """With the native step the eager path's MKL re-layout is never made (it would double the weights' memory)."""
    require_native()
    model = bmc.load(str(gqa_dir))
    assert not model.can_pack
    bmc.generate(model, [[5, 17, 33], [40, 41]], max_new_tokens=4, ignore_eos=True)
    assert model.packed_batch == 0 and all(lin.packed is None for lin in model.linears())


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_native_step_over_a_cache_growing_in_place_equals_a_contiguous_one(gqa_dir, kv_dtype):
    """The native step reads and writes a cache whose slabs are max_length columns apart (grow_in_place) as it
    does a contiguous one: prefill, decode steps across growths and a 3-token step give the same logits, bit for
    bit."""
    require_native()
    model = bmc.load(str(gqa_dir))
    cfg = model.config
    assert model.net.native_decoder() is not None
    runs = []
    for in_place in (False, True):
        cache = KV_STRATEGIES["bmc"](num_layers=cfg.num_layers, batch_size=2, num_kv_heads=cfg.num_kv_heads,
                                     head_dim=cfg.head_dim, max_length=40, dtype=model.dtype, r=3, kv_dtype=kv_dtype)
        cache.grow_in_place = in_place
        tok, pos, logits = torch.tensor([[5, 9, 13, 7, 21], [44, 45, 46, 47, 48]]), torch.arange(5)[None].repeat(2, 1), []
        with torch.inference_mode():
            for step in range(12):
                t = tok.shape[1]
                cache.reserve(t)
                out = model.net(tok, pos, cache, dense_attention, cache.attention_bias(t), all_logits=True)
                cache.commit(t)
                logits.append(out)
                nxt = out[:, -1].argmax(-1, keepdim=True)
                tok = nxt.repeat(1, 3) if step == 6 else nxt  # one 3-token step among the decode steps
                pos = pos[:, -1:] + 1 + torch.arange(tok.shape[1])[None]
        cache.check_integrity()
        if in_place:
            assert cache.slab_columns == 40 > cache.capacity and cache.allocations > 3
        runs.append(logits)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_a_build_reads_its_headers_from_its_own_directory(tmp_path, monkeypatch):
    """The wing headers a source includes are copied into the build directory and included from there, so no path
    of this install reaches the compiler's arguments (torch's versioner hashes them: two installs of the same
    sources would otherwise rebuild each other's kernel)."""
    import bmc.kernels as kernels

    wing = tmp_path / "pkg" / "cpu"
    wing.mkdir(parents=True)
    (wing / "simd.h").write_text('#include "cpu/ops.h"\n// simd\n')
    (wing / "ops.h").write_text("// ops\n")
    (wing / "unused.h").write_text("// included by nothing\n")
    source = tmp_path / "pkg" / "step.cpp"
    source.write_text('#include "cpu/simd.h"\n')
    monkeypatch.setattr(kernels, "WING", str(wing))
    build = tmp_path / "build"
    folder = kernels.write_wing(str(build), str(source))
    assert folder == str(build / "wing")
    assert sorted(p.name for p in (build / "wing" / "cpu").iterdir()) == ["ops.h", "simd.h"]
    assert (build / "wing" / "cpu" / "simd.h").read_text() == '#include "cpu/ops.h"\n// simd\n'
    (wing / "ops.h").write_text("// ops v2\n")  # a new source is a new build name; its directory gets the new text
    kernels.write_wing(str(build), str(source))
    assert (build / "wing" / "cpu" / "ops.h").read_text() == "// ops v2\n"


def test_the_build_is_named_by_what_it_reads(tmp_path, monkeypatch):
    """A kernel build's name hashes its source, every header of the wing and the flags: changing any of them names
    another build, so a stale one in the cache is never loaded (no hand-bumped version)."""
    import bmc.kernels as kernels

    wing = tmp_path / "cpu"
    wing.mkdir()
    (wing / "simd.h").write_text("// v1\n")
    source = tmp_path / "step.cpp"
    source.write_text('#include "cpu/simd.h"\n')
    monkeypatch.setattr(kernels, "WING", str(wing))
    names = {kernels.build_name("step", str(source))}
    assert kernels.build_name("step", str(source)) in names  # the same sources, the same name
    (wing / "simd.h").write_text("// v2\n")
    names.add(kernels.build_name("step", str(source)))
    source.write_text('#include "cpu/simd.h"\n// changed\n')
    names.add(kernels.build_name("step", str(source)))
    monkeypatch.setattr(kernels, "CFLAGS", [*kernels.CFLAGS, "-DNEW_FLAG"])
    names.add(kernels.build_name("step", str(source)))
    monkeypatch.setenv("BMC_KERNEL_CFLAGS", "-mno-avx512bf16 -mno-amx-tile")  # a build without an ISA path
    assert kernels.cflags()[-2:] == ["-mno-avx512bf16", "-mno-amx-tile"]
    names.add(kernels.build_name("step", str(source)))
    monkeypatch.delenv("BMC_KERNEL_CFLAGS")
    (wing / "unused.h").write_text("// included by nothing\n")
    assert kernels.build_name("step", str(source)) in names  # a header it does not include changes nothing
    import bmc.kernels.block_kinds as block_kinds

    monkeypatch.setattr(block_kinds, "cpp_header", lambda: "// another table of block kinds\n")
    names.add(kernels.build_name("step", str(source)))  # the generated headers are read too
    assert len(names) == 6 and all(n.startswith("step_") for n in names)
    assert kernels.sources_of(str(source)) == [str(source), str(wing / "simd.h")]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 3])
def test_a_decode_rows_attention_is_the_same_bits_alone_in_a_batch_and_at_any_threads(kv_dtype, t):
    """Decode and verify rows split their capacity into spans of a fixed size (simd.h's SPAN_CHUNKS) counted from
    their first key, merged in order: a row attended alone (its capacity just past its length, a multiple of 16
    or not) gives the same bits as in a batch whose longer rows raise the capacity (its extra keys masked), at 1 or
    2 threads, planned for 16. Before, the split was chosen per step from the batch and threads (batch 1 split,
    larger batches not). Also run on the AVX2 build (test_the_avx2_build_compiles_and_computes)."""
    require_native()
    mod = native_module()
    h, kvh, hd, length = 9, 3, 64, 700
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, t, h * hd, generator=g)
    kv = torch.randn(1, 2, 3, kvh, 1600, hd, generator=g).to(kv_dtype)
    lengths = [1600, length, 1200]
    bias = torch.zeros(3, 1, t, 1600)
    for b, n in enumerate(lengths):
        bias[b, :, :, n:] = torch.finfo(torch.float32).min
        for i in range(t):  # a verify tree's rows see the keys before theirs (a chain)
            bias[b, :, i, n - t + i + 1 : n] = torch.finfo(torch.float32).min
    attn = mod.Attention(h, kvh, hd, hd**-0.5)
    batch = attn.attention_step(q, kv, 0, bias, [], [], [])
    for alone_cap in (length + 3, (length + 15) // 16 * 16):  # a last chunk of 63 keys (a SIMD tail) and of 64
        alone = attn.attention_step(q[1:2].contiguous(), kv[:, :, 1:2, :, :alone_cap].contiguous(), 0,
                                    bias[1:2, :, :, :alone_cap].contiguous(), [], [], [])
        assert torch.equal(alone[0], batch[1]), alone_cap
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            attn.set_split_threads(16 if n == 1 else 0)
            assert torch.equal(attn.attention_step(q, kv, 0, bias, [], [], []), batch), n
    finally:
        torch.set_num_threads(threads)
    want = reference_attention(q.double(), kv.double(), bias.double(), [], hd**-0.5).float().view(3, t, h * hd)
    torch.testing.assert_close(batch, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_rows_attention_is_the_same_bits_however_the_prompt_is_chunked(kv_dtype):
    """A prompt's rows: the same fixed spans folded in order, and scores as a matrix product at any row count
    (fewer than 8 rows a KV head once took dot products, which sum in another order), so a prompt attended whole,
    in chunks of 7 / 100 / 193 rows, or beside a longer prompt in a batch gives each row the same bits, at 1 or 2
    threads."""
    require_native()
    mod = native_module()
    h, kvh, hd, n = 9, 3, 64, 300
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, n, h * hd, generator=g)
    kv = torch.randn(1, 2, 2, kvh, 640, hd, generator=g).to(kv_dtype)
    causal = torch.full((n, 640), torch.finfo(torch.float32).min).triu(1)
    bias = torch.stack([causal, torch.full((n, 640), torch.finfo(torch.float32).min)])[:, None].clone()
    bias[1, 0, :, :n] = causal[:, :n]
    bias[1, 0, :, n:] = torch.finfo(torch.float32).min
    bias[0, 0, :, 304:] = torch.finfo(torch.float32).min  # row 0: its own prompt only, 340 keys of padding
    attn = mod.Attention(h, kvh, hd, hd**-0.5)
    alone_cap = 304
    whole = attn.attention_step(q[:1].contiguous(), kv[:, :, :1, :, :alone_cap].contiguous(), 0,
                                bias[:1, :, :, :alone_cap].contiguous(), [], [], [], prompt=True)
    parts = [attn.attention_step(q[:1, lo:hi].contiguous(), kv[:, :, :1, :, :alone_cap].contiguous(), 0,
                                 bias[:1, :, lo:hi, :alone_cap].contiguous(), [], [], [], prompt=True)
             for lo, hi in ((0, 7), (7, 107), (107, 300))]
    assert torch.equal(torch.cat(parts, dim=1), whole)
    threads = torch.get_num_threads()
    try:
        for nthreads in (1, 2):
            torch.set_num_threads(nthreads)
            batch = attn.attention_step(q, kv, 0, bias, [], [], [], prompt=True)
            assert torch.equal(batch[:1], whole), nthreads
    finally:
        torch.set_num_threads(threads)
    want = reference_attention(q[:1].double(), kv[:, :, :1].double(), bias[:1].double(), [], hd**-0.5)
    torch.testing.assert_close(whole, want.float().view(1, n, h * hd), rtol=1e-5, atol=1e-5)


AVX2_CHECK = """
import sys, torch
import bmc
from bmc.kernels.native import native_module
from tests.test_native import reference_attention
mod = native_module()
assert mod is not None, "the AVX2 build failed"
assert not mod.experts_spread()  # the AVX-512 paths are compiled out
w, x = torch.randn(40, 64), torch.randn(7, 64)
y = mod.panel_linear(x, mod.Weight(mod.pack_panels(w.t().contiguous())), 40, None, False)
torch.testing.assert_close(y, x @ w.t(), rtol=1e-5, atol=1e-5)
q, kv = torch.randn(2, 1, 4 * 64), torch.randn(1, 2, 2, 2, 300, 64)
bias = torch.zeros(2, 1, 1, 300)
bias[0, ..., 200:] = torch.finfo(torch.float32).min
got = mod.Attention(4, 2, 64, 64**-0.5).attention_step(q, kv, 0, bias, [], [], [])
want = reference_attention(q.double(), kv.double(), bias.double(), [], 64**-0.5).float().view(2, 1, 256)
torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
from tests.test_quant import random_blocks
qw = random_blocks("q4_1", (40, 64))
lin = bmc.models.ops.Linear(qw)
for m in (1, 3, 9):
    xs = torch.randn(m, 64)
    torch.testing.assert_close(lin(xs), xs @ qw.dequantize().t(), rtol=1e-5, atol=1e-5)
# a row's attention the same bits alone and in a batch (its last chunk a SIMD tail alone), and a prompt chunked
from tests.test_native import (test_a_decode_rows_attention_is_the_same_bits_alone_in_a_batch_and_at_any_threads
                               as decode_rows, test_a_prompt_rows_attention_is_the_same_bits_however_the_prompt_is_chunked
                               as prompt_rows)
decode_rows(torch.float32, 1)
decode_rows(torch.bfloat16, 3)
prompt_rows(torch.float32)
# and a row's GEMM output the same bits at any row count (the tests' AVX-512 guard lifted: AVX2 dequantizes a
# group of panels once for all rows, then one float chain per output)
import tests.test_quant as tq
tq._factored_q4 = lambda: True
for kind in ("q4_0", "q4_1", "q8_0", "q4_k", "q6_k"):
    tq.test_quantized_gemms_give_a_row_the_same_bits_at_any_row_count(kind, "float")
for kind in ("f32", "f16", "bf16"):
    tq.test_float_panels_give_a_row_the_same_bits_at_any_row_count(kind)
print("avx2 ok")
"""


def test_the_avx2_build_compiles_and_computes():
    """The kernel built without AVX-512 (`BMC_KERNEL_CFLAGS=-mno-avx512f`: what an AVX2-only CPU builds) compiles,
    its float GEMM, attention and quantized GEMM agree with their references, a decode row's attention is the
    same bits alone and in a batch (the AVX2 score tail summed apart from its blocks until session 41), and a
    row's GEMM output is the same bits at any row count, quantized and float panels. A session once used an
    AVX-512-only name in a shared header and the AVX2 build failed, leaving such CPUs on the slow PyTorch path;
    nothing else here builds it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    require_native()
    env = dict(os.environ, BMC_KERNEL_CFLAGS="-mno-avx512f", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", AVX2_CHECK], env=env, capture_output=True, text=True, timeout=600,
                         cwd=str(Path(__file__).resolve().parents[1]))
    assert out.returncode == 0 and "avx2 ok" in out.stdout, out.stderr[-3000:]
