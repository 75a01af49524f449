"""generate() as a client of the engine's step loop (bmc/offline.py): it runs Scheduler.step, and each prompt of a
call gets what it gets alone (greedy and seeded sampling, with samples), whatever else is in the call."""
from __future__ import annotations

import pytest

import bmc
from bmc.offline import prompt_tokens_to_cache
from bmc.scheduler import Scheduler

HEADER = [(13 * i) % 290 + 7 for i in range(24)]


def test_generate_and_stream_run_on_the_step_loop(gqa_dir, monkeypatch):
    model = bmc.load(str(gqa_dir))
    steps = []
    real = Scheduler.step
    monkeypatch.setattr(Scheduler, "step", lambda self: (steps.append(1), real(self))[1])
    out = bmc.generate(model, [[5, 6, 7], [8, 9]], max_new_tokens=6, ignore_eos=True)
    assert len(steps) >= 6 and [len(c.token_ids) for c in out] == [6, 6]
    steps.clear()
    events = list(bmc.stream(model, [[5, 6, 7]], max_new_tokens=4, ignore_eos=True))
    assert len(events) == 4 and len(steps) >= 4
    for kw in (dict(attention="window", window_k=8), dict(attention="sparq", sparq_r=2, sparq_k=4),
               dict(speculative="layers:1", temperature=0.7, seed=1)):  # every option: no other loop is left
        steps.clear()
        out = bmc.generate(model, [[5, 6, 7], [8, 9]], max_new_tokens=5, ignore_eos=True, **kw)
        assert len(steps) >= 2 and [len(c.token_ids) for c in out] == [5, 5], kw


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.8, seed=3), dict(temperature=0.9, top_k=20, seed=11,
                                                                          num_samples=3)],
                         ids=["greedy", "seeded", "samples"])
def test_each_prompt_gets_what_it_gets_alone(gqa_dir, kw):
    model = bmc.load(str(gqa_dir))
    prompts = [HEADER + [40], [5, 17, 33], HEADER + [50, 51, 52], list(range(60, 90))]
    together = bmc.generate(model, prompts, max_new_tokens=10, ignore_eos=True, **kw)
    n = kw.get("num_samples", 1)
    assert len(together) == len(prompts) * n
    for i, prompt in enumerate(prompts):
        alone = bmc.generate(model, [prompt], max_new_tokens=10, ignore_eos=True, **kw)
        assert [c.token_ids for c in alone] == [c.token_ids for c in together[i * n : (i + 1) * n]], i
    assert together.stats.cached_prompt_tokens == len(HEADER)  # the second header prompt read the first's


def test_the_call_caches_only_what_another_row_reads():
    a, b, c = HEADER + [1], HEADER[:20] + [2, 3], [9] * 30
    assert prompt_tokens_to_cache([a, b, c], 1) == [20, 20, 0]  # a and b share 20 tokens; c shares nothing
    assert prompt_tokens_to_cache([a, [9] * 5], 1) == [0, 0]
    assert prompt_tokens_to_cache([a, c], 2) == [len(a), len(c)]  # samples read their whole prompt


def test_half_precision_samples_read_their_prompt_in_place(gqa_dir):
    """The cached segments' bias is in the model's dtype (a float32 bias against bfloat16 scores raised)."""
    model = bmc.load(str(gqa_dir), dtype="bfloat16")
    prompts = [HEADER + [40], HEADER + [50, 51]]
    on = bmc.generate(model, prompts, max_new_tokens=6, num_samples=2, ignore_eos=True)
    off = bmc.generate(model, prompts, max_new_tokens=6, num_samples=2, ignore_eos=True, share_prefix="off")
    assert on.stats.prefix_kv_bytes > 0 and [c.token_ids for c in on] == [c.token_ids for c in off]


def test_a_call_that_ends_in_its_prefill_reports_the_prefill(gqa_dir):
    """max_new_tokens=1: every request's one token comes from its prefill step, so the call's time is prefill time
    (bmc-generate --benchmark --max-new-tokens 1 printed 0 tok/s), and no decode time is counted."""
    model = bmc.load(str(gqa_dir))
    out = bmc.generate(model, [list(range(5, 60)), list(range(7, 40))], max_new_tokens=1, ignore_eos=True)
    s = out.stats
    assert [len(c.token_ids) for c in out] == [1, 1]
    assert s.prefill_seconds > 0 and s.prefill_tokens_per_s > 0 and s.decode_seconds == 0
    assert s.decode_tokens == 0
    assert s.peak_kv_bytes > 0  # the prompts' caches were held while their prefill ran
