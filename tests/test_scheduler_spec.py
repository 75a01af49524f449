"""Speculative decoding and SparQ inside the continuous batch: served tokens against generate() alone, with
requests joining, leaving and being cancelled around the verify steps."""
from __future__ import annotations

import pytest

import bmc
from bmc.attention import AttentionOptions, SparQOptions
from bmc.errors import InvalidRequestError
from bmc.scheduler import Scheduler

from .test_scheduler import PROMPTS, alone, assert_idle, drive, request

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


@pytest.mark.parametrize("kw, message", [
    (dict(speculative="draft:/x"), "not served"),
    (dict(speculative="layers:1"), "not served"),
    (dict(attention="window"), "not served"),
    (dict(attention="sparq", attention_options=AttentionOptions(sparq=SparQOptions(mean_value=True))), "mean-value"),
    (dict(attention="sparq", speculative="ngram"), "speculative"),
    (dict(speculative="bogus"), "unknown speculative"),
])
def test_what_is_not_served_is_refused_by_name(gqa_dir, kw, message):
    model = bmc.load(str(gqa_dir))
    with pytest.raises(InvalidRequestError, match=message):
        Scheduler(model, **kw)
