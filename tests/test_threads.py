"""Decode steps on fewer threads while the cores are busy (platform/threads.py): the governor's decisions on a
simulated clock, and tokens and logits that do not depend on the count a step ran at."""
from __future__ import annotations

import pytest
import torch

import bmc
import bmc.platform.threads as threads_mod
from bmc.platform.threads import PROBE_UP_EVERY, WINDOW, ThreadGovernor


class Machine:
    """A step's wall and CPU time by thread count: `busy` says another process holds a core."""

    def __init__(self) -> None:
        self.busy, self.running, self.wall, self.cpu, self.calls = False, 2, 0.0, 0.0, []

    def set_threads(self, n: int) -> None:
        self.running = n
        self.calls.append(n)

    def step(self, gov: ThreadGovernor) -> None:
        gov.begin()
        if self.busy:  # two threads: each region waits for a descheduled thread; one thread runs alone
            seconds, used = (0.060, 0.070) if self.running == 2 else (0.035, 0.034)
        else:
            seconds, used = (0.020, 0.039) if self.running == 2 else (0.034, 0.034)
        self.wall += seconds
        self.cpu += used
        gov.end()


def governor(m: Machine) -> ThreadGovernor:
    return ThreadGovernor(2, set_threads=m.set_threads, wall_clock=lambda: m.wall, cpu_clock=lambda: m.cpu)


def test_idle_cores_keep_every_thread_and_no_call_is_made():
    m = Machine()
    gov = governor(m)
    for _ in range(20 * WINDOW):
        m.step(gov)
    assert gov.current == 2 and m.calls == [] and gov.changes == 0


def test_a_busy_core_moves_decode_to_one_thread_and_a_free_one_brings_it_back():
    m = Machine()
    gov = governor(m)
    m.busy = True
    for _ in range(3 * WINDOW):
        m.step(gov)
    assert gov.current == 1 and gov.changes == 1
    assert m.running == 2  # put back after every governed step: the rest of the engine runs at the configured count
    m.busy = False
    for _ in range(PROBE_UP_EVERY + 3 * WINDOW):
        m.step(gov)
    assert gov.current == 2 and gov.changes == 2


class NoGain(Machine):
    """Threads kept waiting, but one thread is no faster: every trial of fewer fails."""

    def step(self, gov: ThreadGovernor) -> None:
        gov.begin()
        self.wall += 0.060
        self.cpu += 0.025 * self.running
        gov.end()


def test_a_trial_that_does_not_pay_is_dropped_and_tried_less_often():
    m = NoGain()
    gov = governor(m)
    for _ in range(40 * WINDOW):
        m.step(gov)
    trials = m.calls.count(1) // WINDOW
    assert gov.current == 2 and gov.changes == 0
    assert 2 <= trials < 10  # backing off: far fewer than the 20 a trial every other window would make


@pytest.mark.slow
def test_tokens_and_logits_do_not_depend_on_the_count_a_step_runs_at(real_model, monkeypatch):
    """Decode steps alternate between 1 and 2 threads (a window of one step): every forward's logits equal those
    of the steps all at 2 threads, bit for bit, with contexts long enough that attention splits its keys (where
    the split followed the running count, the one-row case differed)."""
    from bmc import scheduler as S

    model = real_model
    configured = torch.get_num_threads()  # 2 threads run on any machine (on one core they take turns)
    prompts = [" ".join(["the quick brown fox"] * 40), "Once upon a time", "1, 2, 3,", "def f(x):"]
    recorded: list[torch.Tensor] = []
    forward = S.Scheduler._forward
    monkeypatch.setattr(S.Scheduler, "_forward", lambda self, parts: [
        recorded.append(r.clone()) or r for r in forward(self, parts)])
    torch.set_num_threads(2)
    try:
        check_counts_alike(model, prompts, recorded, monkeypatch)
    finally:
        torch.set_num_threads(configured)


def check_counts_alike(model, prompts: list[str], recorded: list[torch.Tensor], monkeypatch) -> None:
    batches = [prompts[:1], prompts]  # one row: attention splits its keys into spans (planned for 2 threads)
    plain = [bmc.generate(model, b, max_new_tokens=24, ignore_eos=True, adaptive_threads=False) for b in batches]
    want, recorded[:] = list(recorded), []
    switched: list[int] = []
    monkeypatch.setattr(threads_mod, "WINDOW", 1)
    monkeypatch.setattr(ThreadGovernor, "_judge", lambda self: (
        setattr(self, "current", 1 if self.current == 2 else 2), switched.append(self.current), setattr(
            self, "_steps", [])))
    governed = [bmc.generate(model, b, max_new_tokens=24, ignore_eos=True) for b in batches]
    assert switched.count(1) >= 20  # decode steps really ran at one thread
    assert [[c.token_ids for c in g] for g in governed] == [[c.token_ids for c in p] for p in plain]
    assert len(recorded) == len(want) and all(torch.equal(a, b) for a, b in zip(recorded, want))
