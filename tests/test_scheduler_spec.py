"""Speculative decoding (prompt lookup and draft models) and approximate attention (SparQ, the window baseline)
inside the continuous batch: served tokens against generate() alone, with requests joining, leaving and being
cancelled around the verify steps."""
from __future__ import annotations

import pytest
import torch

import bmc
from bmc.attention import ATTENTION_BACKENDS, AttentionOptions, SparQOptions
from bmc.engine import GenerationConfig
from bmc.errors import InvalidRequestError, ModelLoadError
from bmc.sampling import SamplingParams
from bmc.scheduler import Request, Scheduler

from .test_scheduler import PROMPTS, Collector, alone, assert_idle, drive, request

# Prompts that repeat themselves: prompt lookup finds continuations, and the tiny model's greedy loops copy them.
LOOPING = [[5, 6, 7, 8] * 4, [40, 41, 42, 43, 44] * 3, [9, 250, 12] * 5, PROMPTS[0], [60, 61] * 6]


@pytest.mark.parametrize("kv", ["bmc", "upfront"])
def test_speculative_serving_equals_plain_generate_alone(gqa_dir, kv):
    """Greedy rows verify ngram trees in the batch cache's padding rows; a sampled request and a cancelled one
    share the batch. Every greedy request's tokens are plain greedy generate()'s; the sampled one's are its
    seeded generate()'s; drafts were accepted; the drafter forgets every row that left."""
    model = bmc.load(str(gqa_dir))
    sched = Scheduler(model, max_num_seqs=3, max_num_batched_tokens=64, kv=kv, r=4 if kv == "bmc" else None,
                      speculative="ngram", tree="dynamic:2x3")
    lengths = [24, 10, 17, 12, 20]
    reqs = [request(p, n) for p, n in zip(LOOPING, lengths)]
    sampled, scol = request(LOOPING[1], 9, temperature=0.9, seed=3)
    cancelled, ccol = request(LOOPING[2], 30)
    arrivals = {0: [reqs[0][0], cancelled], 1: [reqs[1][0]], 3: [reqs[2][0], sampled], 6: [reqs[3][0]],
                9: [reqs[4][0]]}
    drive(sched, arrivals, cancels={5: [cancelled]}, collectors=[c for _, c in reqs] + [scol, ccol])
    for (req, col), p, n in zip(reqs, LOOPING, lengths):
        assert col.error is None and col.finish == {0: "length"}
        assert col.tokens == {0: alone(model, p, n)}, p
    assert scol.tokens == {0: alone(model, LOOPING[1], 9, temperature=0.9, seed=3)}
    assert ccol.error is None and 0 < len(ccol.tokens.get(0, [])) < 30
    stats = sched.spec.stats
    assert stats.verify_steps > 0 and stats.accepted > 0
    assert sched.counters.generation_tokens > sched.counters.decode_steps  # more than one token per step somewhere
    assert not sched.spec.drafter.ctx and not sched._drafting
    assert_idle(sched)


def test_speculation_leaves_room_for_prompts_waiting(gqa_dir):
    """With prompts waiting, the trees take at most half the token budget: a long prompt still prefills in
    chunks while the running rows speculate, and both equal generate() alone."""
    model = bmc.load(str(gqa_dir))
    sched = Scheduler(model, max_num_seqs=2, max_num_batched_tokens=12, speculative="ngram", tree="dynamic:4x4")
    long_prompt = list(range(20, 60))
    (a, ca), (b, cb) = request(LOOPING[0], 30), request(long_prompt, 5)
    drive(sched, {0: [a], 3: [b]}, collectors=[ca, cb])
    assert ca.tokens == {0: alone(model, LOOPING[0], 30)} and cb.tokens == {0: alone(model, long_prompt, 5)}
    first_b = cb.steps[0]
    assert first_b - 3 >= 40 // 11  # the prompt took several chunks (at most 11 tokens each) ...
    assert set(range(3, first_b + 1)) <= set(ca.steps)  # ... and `a` got tokens at every step meanwhile
    assert sched.spec.stats.verify_steps > 0
    assert_idle(sched)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_sparq_serving_equals_sparq_generate_alone(gqa_dir, kv_dtype):
    """SparQ decode attention over the batch cache: each row picks its own top-k of its own columns (other rows'
    columns and padding are masked out of the selection), so a request's tokens equal generate(attention='sparq')
    alone with the same r and k; over an int8 cache too, which it reads as stored."""
    model = bmc.load(str(gqa_dir))
    opts = AttentionOptions(sparq=SparQOptions(r=4, k=6))
    sched = Scheduler(model, max_num_seqs=3, max_num_batched_tokens=64, r=4, attention="sparq",
                      attention_options=opts, kv_dtype=kv_dtype)
    lengths = [20, 8, 15, 11, 6]
    reqs = [request(p, n) for p, n in zip(PROMPTS, lengths)]
    arrivals = {0: [reqs[0][0]], 2: [reqs[1][0], reqs[2][0]], 5: [reqs[3][0]], 9: [reqs[4][0]]}
    drive(sched, arrivals, collectors=[c for _, c in reqs])
    for (req, col), p, n in zip(reqs, PROMPTS, lengths):
        assert col.error is None
        assert col.tokens == {0: alone(model, p, n, attention="sparq", sparq_r=4, sparq_k=6, kv_dtype=kv_dtype)}, p
    assert sched.decode_attention.transfers < sched.decode_attention.dense_transfers  # it did read less
    assert_idle(sched)


@pytest.mark.parametrize("kind", ["layers:1", "int8-self"])
def test_draft_model_serving_equals_plain_generate_alone(gqa_dir, kind):
    """A draft model's KV cache takes rows as they join (prefilled beside it, joined in one regroup) and drops them
    as they leave: greedy requests joining at different steps, and a cancelled one, give plain greedy generate()'s
    tokens; a sampled request whose distribution is a point mass (top_k=1) verifies by rejection sampling and
    gives them too."""
    model = bmc.load(str(gqa_dir))
    sched = Scheduler(model, max_num_seqs=3, max_num_batched_tokens=64, r=4, speculative=kind, tree="dynamic:2x3")
    lengths = [16, 9, 12, 10]
    reqs = [request(p, n) for p, n in zip(LOOPING, lengths)]
    col = Collector()
    point = Request(list(LOOPING[4]), GenerationConfig(max_new_tokens=11, ignore_eos=True, sampling=SamplingParams(
        temperature=1.0, top_k=1, seed=5)), col)
    cancelled, ccol = request(LOOPING[2], 30)
    arrivals = {0: [reqs[0][0], cancelled], 2: [reqs[1][0]], 4: [reqs[2][0], point], 7: [reqs[3][0]]}
    drive(sched, arrivals, cancels={3: [cancelled]}, collectors=[c for _, c in reqs] + [col, ccol])
    for (req, c), p, n in zip(reqs, LOOPING, lengths):
        assert c.error is None and c.tokens == {0: alone(model, p, n)}, p
    assert col.error is None and col.tokens == {0: alone(model, LOOPING[4], 11)}
    stats = sched.spec.stats
    assert stats.verify_steps > 0 and stats.accepted > 0
    drafter = sched.spec.drafter
    assert set(drafter.pending) <= drafter.gone and not sched._drafting
    assert_idle(sched)


def test_sparq_with_its_mirror_and_mean_and_the_window_baseline_are_served(tiny_dirs, monkeypatch):
    """SparQ as generate() runs it (the dimension-major K mirror, the mean-value step) and the local-window
    baseline, in the continuous batch: their state by column is rebuilt when rows join and leave, so every
    request's tokens equal a stateless SparQ that recomputes everything from the cache each step, run alone. (An
    MHA model: SparQ's mean-value step is on by default there.)"""
    from .test_sparq import StatelessSparQ

    model = bmc.load(str(tiny_dirs["llama-mha"]))
    monkeypatch.setitem(ATTENTION_BACKENDS, "stateless", lambda cache, opts, g: StatelessSparQ(cache, opts.sparq, g))
    sparq = SparQOptions(r=4, k=6)
    lengths = [20, 8, 15, 11, 6]
    for attention, opts, ref in (("sparq", AttentionOptions(sparq=sparq), dict(attention="stateless", sparq_r=4,
                                                                               sparq_k=6)),
                                 ("window", AttentionOptions(window_k=7), dict(attention="window", window_k=7))):
        sched = Scheduler(model, max_num_seqs=3, max_num_batched_tokens=64, r=4, attention=attention,
                          attention_options=opts)
        reqs = [request(p, n) for p, n in zip(PROMPTS, lengths)]
        arrivals = {0: [reqs[0][0]], 2: [reqs[1][0], reqs[2][0]], 5: [reqs[3][0]], 9: [reqs[4][0]]}
        drive(sched, arrivals, collectors=[c for _, c in reqs])
        for (req, col), p, n in zip(reqs, PROMPTS, lengths):
            assert col.error is None
            assert col.tokens == {0: alone(model, p, n, **ref)}, (attention, p)
        attn = sched.decode_attention
        assert 0 < attn.transfers < attn.dense_transfers
        if attention == "sparq":
            assert attn.opts.mean_value and attn.opts.k_twice and attn.rebuilds > 0
        assert_idle(sched)


@pytest.mark.parametrize("kw, message", [
    (dict(speculative="draft:/nonexistent/model"), "/nonexistent/model"),
    (dict(attention="sparq", speculative="ngram"), "speculative"),
    (dict(speculative="bogus"), "unknown speculative"),
])
def test_what_is_not_served_is_refused_by_name(gqa_dir, kw, message):
    model = bmc.load(str(gqa_dir))
    with pytest.raises((InvalidRequestError, ModelLoadError), match=message):
        Scheduler(model, **kw)


def test_a_failing_drafter_costs_drafts_not_requests(gqa_dir, monkeypatch):
    """A draft model's forward that raises (out of memory, say) fails no request and stops no engine: those steps
    decode without drafts, and every request still gets plain greedy generate()'s tokens."""
    model = bmc.load(str(gqa_dir))
    sched = Scheduler(model, max_num_seqs=2, max_num_batched_tokens=64, r=4, speculative="layers:1",
                      tree="chain:3")
    drafter = sched.spec.drafter
    real = drafter.propose_batch
    calls = []

    def flaky(rows, specs):
        calls.append(1)
        if len(calls) % 2:
            raise RuntimeError("draft forward failed")
        return real(rows, specs)

    monkeypatch.setattr(drafter, "propose_batch", flaky)
    reqs = [request(p, n) for p, n in zip(LOOPING[:3], [12, 9, 10])]
    drive(sched, {0: [reqs[0][0]], 2: [reqs[1][0]], 5: [reqs[2][0]]}, collectors=[c for _, c in reqs])
    for (req, col), p, n in zip(reqs, LOOPING, [12, 9, 10]):
        assert col.error is None and col.tokens == {0: alone(model, p, n)}
    assert sched.counters.draft_failures > 0 and sched.spec.stats.verify_steps > 0
    assert_idle(sched)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_a_row_beside_speculating_rows_gets_its_alone_logprobs_bit_for_bit(tmp_path, kv_dtype):
    """Rows that accept different counts in a verify step leave the shorter ones masked columns (holes: every row
    writes at the same column); attention numbers a decode row's keys without them, so a row that reports
    logprobs (and so never speculates) served beside a greedy row speculating on a repetitive prompt gets the
    log-probabilities of its run alone, bit for bit."""
    from .test_scheduler import LogprobCollector, _tiny_long, drive

    model = _tiny_long(tmp_path, "none")
    g = torch.Generator().manual_seed(3)
    copy = torch.randint(3, 320, (20,), generator=g).tolist() * 8  # ngram drafts accepted, several a step
    own = torch.randint(3, 320, (50,), generator=g).tolist()

    def run(sched: Scheduler, prompts: list[list[int]], threads: int) -> LogprobCollector:
        cols = [LogprobCollector() for _ in prompts]
        reqs = [Request(list(p), GenerationConfig(max_new_tokens=60, ignore_eos=True), c, logprobs=1 if p is own
                        else None) for p, c in zip(prompts, cols)]
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(threads)
            drive(sched, {0: reqs}, collectors=cols)
        finally:
            torch.set_num_threads(before)
        return cols[-1]

    alone = run(Scheduler(model, max_num_seqs=1, max_num_batched_tokens=512, kv_dtype=kv_dtype), [own], 1)
    sched = Scheduler(model, max_num_seqs=2, max_num_batched_tokens=64, speculative="ngram", kv_dtype=kv_dtype)
    served = run(sched, [copy, own], 2)
    assert sched.spec.stats.accepted > 0  # the neighbour speculated and accepted drafts, leaving holes
    assert served.error is None and served.tokens == alone.tokens
    assert served.logprobs == alone.logprobs  # floats compared exactly
