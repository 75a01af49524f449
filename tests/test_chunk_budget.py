"""Prompt chunks cut by measured cost beside running rows (bmc/chunk_budget.py, EngineOptions.itl_factor,
bmc-serve --itl-factor): the cut follows the measured times, and a request served under it gets its alone run's
tokens and log-probabilities bit for bit."""
from __future__ import annotations

import math

import pytest
import torch

from bmc.chunk_budget import FIRST_CHUNK, ChunkBudget
from bmc.engine_options import EngineOptions
from bmc.errors import InvalidRequestError
from bmc.scheduler import Scheduler

from .test_scheduler import _tiny_long, assert_served_equals_alone


def test_the_cut_keeps_a_step_within_the_factor_of_the_rows_own():
    b = ChunkBudget(2.0)
    assert b.prompt_tokens(0, 200) == 200  # no row running: the whole budget
    assert b.prompt_tokens(4, 200) == FIRST_CHUNK  # nothing timed yet
    b.timed(4, 0, 0.010)  # the rows alone: 10 ms
    assert b.prompt_tokens(4, 200) == FIRST_CHUNK  # no prompt token timed yet
    b.timed(4, 16, 0.010 + 16 * 0.001)  # 1 ms a prompt token beside them
    assert b.rows_seconds == pytest.approx(0.010) and b.token_seconds == pytest.approx(0.001)
    assert b.prompt_tokens(4, 200) == 10  # 10 ms + 10 x 1 ms = 2 x 10 ms
    assert b.prompt_tokens(4, 7) == 7  # never past the token budget
    assert ChunkBudget(1.5, 0.010, 0.001, [1, 1]).prompt_tokens(4, 200) == 5
    assert ChunkBudget(1.01, 0.010, 0.001, [1, 1]).prompt_tokens(4, 200) == 1  # always some progress
    assert ChunkBudget(2.0, 0.010, 0.0, [1, 1]).prompt_tokens(4, 200) == 200  # prompt tokens that cost nothing
    for _ in range(40):  # the prompt's tokens grow dearer (attention over more columns): the cut follows
        b.timed(4, 10, 0.010 + 10 * 0.004)
    assert b.token_seconds == pytest.approx(0.004, rel=0.05) and b.prompt_tokens(4, 200) in (2, 3)


@pytest.mark.parametrize("factor", [1.0, 0.5, -1.0, math.nan, math.inf])
def test_itl_factor_is_checked(factor):
    with pytest.raises(InvalidRequestError, match="itl_factor must be 0"):
        EngineOptions(itl_factor=factor)


def test_a_long_prompt_beside_running_rows_is_cut_and_served_as_alone(tmp_path):
    """Two requests decode; a 283-token prompt joins under a 512-token budget. With itl_factor=2 its prefill is
    cut into steps (the first of FIRST_CHUNK tokens, then as measured), the rows decode at each of them, each step
    takes no more than the budget's cut, and every request gets its alone run's tokens and log-probabilities,
    exactly (the cut moves time only)."""
    model = _tiny_long(tmp_path, "none")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (9, 14, 283)]
    sched = Scheduler(model, max_num_seqs=3, max_num_batched_tokens=512, itl_factor=2.0)
    assert sched.chunk_budget is not None and Scheduler(model).chunk_budget is None  # off by default
    cuts: list[tuple[int, int]] = []
    prompt_steps: list[tuple[int, int]] = []
    budget = sched.chunk_budget
    cut = budget.prompt_tokens

    def recorded(rows: int, tokens: int) -> int:
        cuts.append((rows, cut(rows, tokens)))
        return cuts[-1][1]

    budget.prompt_tokens = recorded  # type: ignore[method-assign]
    step = sched.step

    def stepped() -> None:
        step()
        if sched.last_step["prompt_tokens"] and sched.last_step["rows"]:
            prompt_steps.append((len(cuts), sched.last_step["prompt_tokens"]))

    sched.step = stepped  # type: ignore[method-assign]
    assert_served_equals_alone(model, prompts, sched, {0: [0, 1], 3: [2]}, 12)
    beside = [(i, n) for i, n in prompt_steps if cuts and cuts[i - 1][0] > 0]
    assert len(beside) >= 2  # the long prompt took several steps beside the running rows
    assert beside[0][1] <= FIRST_CHUNK
    for i, n in beside:
        assert n <= cuts[i - 1][1]
    assert budget.counts[0] > 0 and budget.counts[1] > 0  # both kinds of step were timed
