"""Decode steps run one ahead of their tokens (bmc/run_ahead.py; on by default over CUDA graphs, forced on here on
the CPU, where the same scheduler code runs): every request gives the tokens, text and finish reasons of
generate() alone, through stop strings, EOS, cancels at every step, sampled and penalised rows beside greedy ones
(which stop the running ahead), and kept conversation turns (staggered joins and leaves: test_scheduler.py)."""
from __future__ import annotations

import random

import pytest

import bmc
from bmc.prefix_cache import BLOCK
from bmc.sampling import SamplingParams
from bmc.scheduler import Request, Scheduler
from bmc.engine import GenerationConfig

from .conftest import transformers  # noqa: F401
from .test_scheduler import PROMPTS, Collector, alone, assert_idle, drive, request


def test_greedy_samples_stop_strings_and_eos_run_ahead_as_generate_gives_them(gqa_dir):
    """Two greedy samples of one prompt (a row finishes while its sibling is one step behind in being read), a
    stop string, EOS honoured: each equal to generate() alone with run_ahead off, and generate(run_ahead=True)
    equal to both."""
    model = bmc.load(str(gqa_dir))
    text = "the quick brown fox"
    ref = bmc.generate(model, [text], max_new_tokens=16, ignore_eos=True)[0]
    stop = ref.text[4:7] if len(ref.text) > 8 else ref.text[-2:]
    want = bmc.generate(model, [text], max_new_tokens=16, stop=stop)[0]
    sched = Scheduler(model, max_num_seqs=4, max_num_batched_tokens=32, run_ahead=True)
    (a, ca) = request(model.tokenizer.encode(text), 16, ignore_eos=False, stop=[stop])
    (b, cb) = request(PROMPTS[2], 9, n=2)
    (c, cc) = request(PROMPTS[0], 12, ignore_eos=False)
    drive(sched, {0: [b, c], 1: [a]}, collectors=[ca, cb, cc])
    assert ca.tokens[0] == want.token_ids and ca.text[0] == want.text and ca.finish[0] == want.finish_reason
    assert cb.tokens == {0: alone(model, PROMPTS[2], 9), 1: alone(model, PROMPTS[2], 9)}
    plain = bmc.generate(model, [PROMPTS[0]], max_new_tokens=12)[0]
    assert cc.tokens == {0: plain.token_ids} and cc.finish == {0: plain.finish_reason}
    assert sched.counters.ahead_steps > 0
    on, off = (bmc.generate(model, [PROMPTS[0], PROMPTS[2], text], max_new_tokens=10, stop=stop, run_ahead=run)
               for run in (True, False))
    assert [(g.token_ids, g.text, g.finish_reason) for g in on] == [
        (g.token_ids, g.text, g.finish_reason) for g in off]
    assert on.stats.ahead_steps > 0 and off.stats.ahead_steps == 0


@pytest.mark.parametrize("at", range(0, 12))
def test_cancel_at_every_step_while_running_ahead(gqa_dir, at):
    """The victim emits nothing after the step it was cancelled at (its token read one step late is read before the
    cancel takes it out), the others equal generate() alone, everything is freed."""
    model = bmc.load(str(gqa_dir))
    sched = Scheduler(model, max_num_seqs=2, max_num_batched_tokens=16, r=4, run_ahead=True)
    reqs = [request(PROMPTS[0], 10), request(PROMPTS[2], 12), request(PROMPTS[4], 6)]
    victim, vcol = reqs[1]
    drive(sched, {0: [reqs[0][0], victim], 4: [reqs[2][0]]}, cancels={at: [victim]},
          collectors=[c for _, c in reqs])
    assert all(s <= at for s in vcol.steps) and vcol.error is None
    for (req, col), p, n in [(reqs[0], PROMPTS[0], 10), (reqs[2], PROMPTS[4], 6)]:
        assert col.tokens == {0: alone(model, p, n)}
    assert_idle(sched)


def test_sampled_and_penalised_rows_beside_greedy_ones_stop_the_running_ahead(gqa_dir):
    """A sampled row's draw and a penalised row's logits are the host's: while one is in the batch no step runs
    ahead, and all three equal generate() alone."""
    model = bmc.load(str(gqa_dir))
    sched = Scheduler(model, max_num_seqs=3, max_num_batched_tokens=32, run_ahead=True)
    greedy = request(PROMPTS[0], 20)
    sampled = request(PROMPTS[1], 6, temperature=0.8, seed=3)
    col = Collector()
    penalised = Request(list(PROMPTS[3]), GenerationConfig(
        max_new_tokens=5, ignore_eos=True, sampling=SamplingParams(repetition_penalty=1.3)), col)
    drive(sched, {0: [greedy[0]], 6: [sampled[0]], 14: [penalised]}, collectors=[greedy[1], sampled[1], col])
    assert greedy[1].tokens == {0: alone(model, PROMPTS[0], 20)}
    assert sampled[1].tokens == {0: bmc.generate(model, [PROMPTS[1]], max_new_tokens=6, ignore_eos=True,
                                                 temperature=0.8, seed=3)[0].token_ids}
    assert col.tokens == {0: bmc.generate(model, [PROMPTS[3]], max_new_tokens=5, ignore_eos=True,
                                          repetition_penalty=1.3)[0].token_ids}
    ahead_rows = sched.counters.ahead_steps
    assert 0 < ahead_rows < sched.counters.decode_steps  # greedy alone ran ahead, not beside the others


def test_a_conversation_kept_turn_by_turn_while_running_ahead(gqa_dir):
    """A finished turn is kept in the prefix cache from the columns before the step run ahead for nothing: the
    next turn reads it and equals generate() alone."""
    model = bmc.load(str(gqa_dir))
    sched = Scheduler(model, max_num_seqs=2, max_num_batched_tokens=32, prefix_cache_bytes=64 << 20,
                      run_ahead=True)
    rng = random.Random(1)
    history = [rng.randrange(5, 300) for _ in range(2 * BLOCK + 3)]
    for turn in range(3):
        history += [rng.randrange(5, 300) for _ in range(9)]
        req, col = request(history, 7)
        drive(sched, {0: [req]}, collectors=[col])
        assert col.tokens == {0: alone(model, history, 7)}, turn
        if turn:
            assert req.cached_tokens == (len(history) - 9 - 1) // BLOCK * BLOCK, turn
        history += col.tokens[0]
    assert sched.counters.ahead_steps > 0


def test_a_request_added_mid_step_changes_nothing_until_the_next_intake(gqa_dir):
    """Whether a step runs ahead depends on the step's own state, not on requests other threads add while it runs
    (they join at the next intake): a request added in the middle of a step leaves every step's emissions as when
    it is added just after that step. Tensor-parallel followers take requests only at intake, so rank 0 deciding
    otherwise would make the ranks emit in other steps and stop the engine (parallel/serve.py's digests)."""
    model = bmc.load(str(gqa_dir))
    runs = []
    for mid_step in (False, True):
        sched = Scheduler(model, max_num_seqs=3, max_num_batched_tokens=32, run_ahead=True)
        (a, ca), (b, cb) = request(PROMPTS[0], 16), request(PROMPTS[1], 6)
        sched.add(a)
        steps: list[list[int]] = []
        chunk_parts = sched._chunk_parts

        def arriving(budget, step=[0]):  # noqa: B006 (the step counter)
            if mid_step and step[0] == 5:
                sched.add(b)  # after this step's intake, before its decision to run ahead
            step[0] += 1
            return chunk_parts(budget)

        sched._chunk_parts = arriving
        for i in range(60):
            if not mid_step and i == 6:
                sched.add(b)
            before = (len(ca.tokens.get(0, [])), len(cb.tokens.get(0, [])))
            sched.step()
            steps.append([len(ca.tokens.get(0, [])) - before[0], len(cb.tokens.get(0, [])) - before[1]])
            if i > 6 and not sched.has_work():
                break
        assert ca.tokens == {0: alone(model, PROMPTS[0], 16)} and cb.tokens == {0: alone(model, PROMPTS[1], 6)}
        runs.append(steps)
    assert runs[0] == runs[1]
