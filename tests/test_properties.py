"""Property-based tests (hypothesis): random argument combinations, sensible and absurd, thrown at generate() and
at bmc-generate. generate() returns completions that respect max_new_tokens or raises one of bmc's typed errors;
bmc-generate exits 0 with output or exits 2 with one line and no traceback; neither hangs. The examples are
derandomized: the same every run, so a CI failure reproduces (raise max_examples locally to search further)."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest

import bmc
from bmc.errors import BmcError

hypothesis = pytest.importorskip("hypothesis", reason="the property tests need hypothesis (the test extra)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1.0, 2.0]))
SMALL_INTS = st.one_of(st.integers(-3, 12), st.sampled_from([10**9, -(10**9)]))
KVS = st.sampled_from(["bmc", "upfront", "iterative", "paged", ""])
SPECULATIVE = st.sampled_from(["off", "ngram", "layers:1", "layers:0", "layers:99", "int8-self", "draft:/nope", "x"])
TREES = st.sampled_from(["dynamic:4x6", "chain:3", "static:8", "chain:0", "dynamic:0x0", "bogus"])


@pytest.fixture(scope="module")
def model(tiny_dirs):
    return bmc.load(str(tiny_dirs["llama-gqa"]))


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(max_new_tokens=SMALL_INTS, temperature=FLOATS, top_k=st.one_of(st.none(), SMALL_INTS),
       top_p=st.one_of(st.none(), FLOATS), seed=st.one_of(st.none(), st.integers(-5, 2**40)),
       num_samples=SMALL_INTS, kv=KVS, r=st.one_of(st.none(), SMALL_INTS), speculative=SPECULATIVE, tree=TREES,
       attention=st.sampled_from(["dense", "sparq", "window", "flash"]),
       prompts=st.sampled_from([[[5, 17, 33]], [[5, 17, 33], [40]], [[]], [], [[10**6]], [[-1]], ["hello"]]))
def test_generate_returns_or_raises_a_typed_error(model, max_new_tokens, temperature, top_k, top_p, seed,
                                                 num_samples, kv, r, speculative, tree, attention, prompts):
    try:
        out = bmc.generate(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                           top_p=top_p, seed=seed, num_samples=num_samples, kv=kv, r=r, speculative=speculative,
                           tree=tree, attention=attention)
    except BmcError:
        return
    assert max_new_tokens >= 1 and num_samples >= 1 and math.isfinite(temperature)
    assert len(out) == len(prompts) * num_samples
    for c in out:
        assert 1 <= len(c.token_ids) <= max_new_tokens
        assert all(0 <= t < model.config.vocab_size for t in c.token_ids)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(max_new_tokens=st.integers(1, 12), num_samples=st.integers(1, 3), r=st.one_of(st.none(), st.integers(1, 40)),
       speculative=st.sampled_from(["off", "ngram", "layers:1"]), tree=st.sampled_from(["dynamic:4x6", "chain:3"]),
       prompts=st.lists(st.lists(st.integers(3, 319), min_size=1, max_size=20), min_size=1, max_size=3))
def test_valid_greedy_arguments_generate_the_same_tokens_on_every_cache(model, max_new_tokens, num_samples, r,
                                                                        speculative, tree, prompts):
    """Arguments inside their ranges never raise, and greedy tokens are identical on every KV strategy, with or
    without speculation (the plain iterative cache is the reference)."""
    kw = dict(max_new_tokens=max_new_tokens, num_samples=num_samples, ignore_eos=True)
    ref = [c.token_ids for c in bmc.generate(model, prompts, kv="iterative", **kw)]
    assert all(len(t) == max_new_tokens for t in ref)
    for kv in ("upfront", "bmc"):
        out = bmc.generate(model, prompts, kv=kv, r=r if kv == "bmc" else None, speculative=speculative, tree=tree,
                           **kw)
        assert [c.token_ids for c in out] == ref, (kv, r, speculative)


FLAG_VALUES = {
    "--max-new-tokens": ["4", "0", "-2", "x", "1e9"], "--temperature": ["0", "0.7", "nan", "-1", "inf"],
    "--top-k": ["5", "0", "-1"], "--top-p": ["0.9", "0", "1.5"], "--seed": ["1", "-3", "abc"],
    "--num-samples": ["2", "0"], "--kv": ["bmc", "upfront", "nope"], "--r": ["4", "0"], "--T": ["2", "-1"],
    "--speculative": ["ngram", "layers:1", "bogus"], "--tree": ["chain:2", "bogus"], "--attention": ["sparq", "x"],
    "--threads": ["1", "0", "5000"], "--batch-size": ["2", "0"], "--prompt-file": ["/nonexistent", "/", "/dev/null"],
    "--dtype": ["float32", "int3"],
}
SWITCHES = ["--stream", "--json", "--ignore-eos", "--chat", "--no-weights-cache"]


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flags=st.dictionaries(st.sampled_from(sorted(FLAG_VALUES)), st.integers(0, 4), max_size=4),
       switches=st.lists(st.sampled_from(SWITCHES), unique=True, max_size=2),
       prompt=st.sampled_from(["Hi", "", "ünïcödé ✓"]))
def test_bmc_generate_exits_0_with_output_or_2_with_one_line(tiny_dirs, flags, switches, prompt):
    args = [sys.executable, "-m", "bmc.cli.generate", "--model", str(tiny_dirs["llama-gqa"])]
    for flag, i in flags.items():
        values = FLAG_VALUES[flag]
        args += [flag, values[i % len(values)]]
    if "--prompt-file" not in flags:
        args.append(prompt)
    args += switches
    if "--max-new-tokens" not in flags:
        args += ["--max-new-tokens", "4"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=180)  # a hang fails here
    assert "Traceback" not in r.stderr, (args, r.stderr[-2000:])
    if r.returncode == 0:
        assert r.stdout.strip() or prompt == "", args
    else:
        assert r.returncode == 2, (args, r.returncode, r.stderr[-2000:])
        lines = [line for line in r.stderr.splitlines() if line.strip() and not line.startswith("bmc: compiling")]
        assert len(lines) == 1, (args, r.stderr)


def test_a_kv_cache_beyond_memory_is_refused_before_allocating(model):
    """Found by the property test: num_samples=10**9 asked the allocator for 1.2 TB (an untyped RuntimeError, or
    the OOM killer); now a typed error says what it would need."""
    from bmc.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="GiB of KV cache"):
        bmc.generate(model, [[5, 17, 33]], max_new_tokens=2, num_samples=10**9)


# Sampling values at float32's edges: what a client can send that the kernels see rounded (denormals, values that
# round to 0, huge ones). Each either is refused with InvalidRequestError or samples a token the distribution gives
# weight to; never an id out of the vocabulary, never NaN.
FLOAT32_EDGES = st.one_of(
    st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 1e-46, 1.4e-45, 1e-40, 1.1754943e-38, 1e-30, 1e-7, 0.5, 1.0, 2.0,
                     3.4e38, 1e308]),
    st.floats(min_value=0.0, max_value=2.0, allow_subnormal=True),
    st.floats(min_value=0.0, max_value=1e-30, allow_subnormal=True))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(temperature=FLOAT32_EDGES, top_p=st.one_of(st.none(), FLOAT32_EDGES), min_p=st.one_of(st.none(), FLOAT32_EDGES),
       top_k=st.one_of(st.none(), st.integers(1, 10**6)), scale=st.sampled_from([1.0, 1e4, 1e30, 1e37]))
def test_sampler_at_float32_edges_gives_a_token_or_a_typed_error(temperature, top_p, min_p, top_k, scale):
    import torch

    from bmc.sampling import Sampler, SamplingParams

    try:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=3)
    except bmc.InvalidRequestError as e:
        assert str(e)
        return
    logits = torch.randn(4, 97, generator=torch.Generator().manual_seed(0)) * scale
    sampler = Sampler(params, torch.device("cpu"))
    ids = sampler(logits)
    assert ids.shape == (4,) and bool(((ids >= 0) & (ids < 97)).all())
    if not params.greedy:
        probs = sampler.probs(logits)
        assert not bool(probs.isnan().any())
        assert bool((probs.gather(1, ids[:, None]) > 0).all())  # never a token the distribution excludes
        broken = logits.clone()
        broken[0, 5] = float("nan")  # a model's non-finite logits: the request fails with a typed error
        with pytest.raises(BmcError, match="outside"):
            sampler(broken)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(temperature=FLOAT32_EDGES, top_p=st.one_of(st.none(), FLOAT32_EDGES), min_p=st.one_of(st.none(), FLOAT32_EDGES))
def test_generate_at_float32_edges(model, temperature, top_p, min_p):
    try:
        out = bmc.generate(model, [[5, 17, 33]], max_new_tokens=4, temperature=temperature, top_p=top_p, min_p=min_p,
                           seed=1, ignore_eos=True)
    except bmc.InvalidRequestError as e:
        assert "float32" in str(e) or "must be" in str(e)
        return
    assert len(out[0].token_ids) == 4 and all(0 <= t < model.config.vocab_size for t in out[0].token_ids)


PENALTY_EDGES = st.one_of(FLOAT32_EDGES, FLOAT32_EDGES.map(lambda x: -x), st.sampled_from([float("nan"), float("inf")]))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(presence=PENALTY_EDGES, frequency=PENALTY_EDGES, repetition=PENALTY_EDGES, bias=PENALTY_EDGES,
       bias_id=st.integers(-2, 200), temperature=st.sampled_from([0.0, 1e-30, 0.7, 2.0]),
       scale=st.sampled_from([1.0, 1e4, 1e30]))
def test_logit_adjustments_at_float32_edges_give_a_token_or_a_typed_error(presence, frequency, repetition, bias,
                                                                          bias_id, temperature, scale):
    """Penalties and logit_bias anywhere a client can put them: refused by name, or every row gets a token in the
    vocabulary (or the request fails with a typed error when the logits themselves overflow)."""
    import torch

    from bmc.sampling import Sampler, SamplingParams, adjust_logits

    try:
        params = SamplingParams(temperature=temperature, seed=3, presence_penalty=presence,
                                frequency_penalty=frequency, repetition_penalty=repetition,
                                logit_bias=((bias_id, bias),))
        params.check_vocab(97)
    except bmc.InvalidRequestError as e:
        assert str(e).split(" ", 1)[0] in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                                           "logit_bias", "temperature")
        return
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 97, generator=g) * scale
    counts = torch.randint(0, 4, (3, 97), generator=g).float()
    seen = torch.rand(97, generator=g) < 0.2
    adjusted = adjust_logits(logits, params, counts, seen)
    assert adjusted.dtype == torch.float32 and not bool(adjusted.isnan().any())
    try:
        ids = Sampler(params, torch.device("cpu"))(adjusted)
    except BmcError:
        assert not bool(adjusted.isfinite().all())  # only an overflow of huge logits fails, and typed
        return
    assert bool(((ids >= 0) & (ids < 97)).all())
