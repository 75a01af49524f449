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
    assert b.prompt_tokens(4, 200) == 10  # 10 ms + 10 x 1 ms = 2 x 10 ms
    assert b.prompt_tokens(4, 7) == 7  # never past the token budget

    def timed(factor: float, token_s: float) -> ChunkBudget:
        c = ChunkBudget(factor)
        c.timed(4, 0, 0.010)
        c.timed(4, 10, 0.010 + 10 * token_s)
        return c

    assert timed(1.5, 0.001).prompt_tokens(4, 200) == 5
    assert timed(1.01, 0.001).prompt_tokens(4, 200) == 1  # always some progress
    assert timed(2.0, 0.0).prompt_tokens(4, 200) == 200  # prompt tokens that cost nothing
    for _ in range(4):
        b.timed(4, 0, 0.010)
        b.timed(4, 16, 0.010 + 16 * 0.001)
    b.timed(4, 0, 0.5)  # one slow step (a first call's set-up) moves nothing: medians
    b.timed(4, 10, 0.010 + 10 * 0.050)
    assert b.prompt_tokens(4, 200) == 10
    for _ in range(20):  # the prompt's tokens grow dearer (attention over more columns): the cut follows
        b.timed(4, 10, 0.010 + 10 * 0.004)
    assert b.prompt_tokens(4, 200) == 2


@pytest.mark.parametrize("factor", [1.0, 0.5, -1.0, math.nan, math.inf, 1e7])
def test_itl_factor_is_checked(factor):
    with pytest.raises(InvalidRequestError, match="itl_factor must be 0"):
        EngineOptions(itl_factor=factor)
    for ok in (0.0, 1.0001, 2.0, 1e6):
        assert EngineOptions(itl_factor=ok).itl_factor == ok


def test_itl_factor_is_refused_where_a_chunk_is_a_forward_of_its_own(gqa_dir, monkeypatch):
    """The cost model holds where a chunk shares the native step's forward with the running rows; elsewhere (no
    native step: CUDA, the PyTorch path) and under tensor parallelism the option is refused by name."""
    import bmc

    model = bmc.load(str(gqa_dir))
    assert Scheduler(model, itl_factor=2.0).chunk_budget is not None
    monkeypatch.setattr(model.net, "native_decoder", lambda: None)
    with pytest.raises(InvalidRequestError, match="itl_factor needs the native CPU step"):
        Scheduler(model, itl_factor=2.0)
    monkeypatch.setattr(model, "full_config", model.config)
    with pytest.raises(InvalidRequestError, match="itl_factor under tensor parallelism"):
        Scheduler(model, itl_factor=2.0)


def test_a_long_prompt_beside_running_rows_is_cut_and_served_as_alone(tmp_path):
    """Two requests decode; a 283-token prompt joins under a 512-token budget. With itl_factor=2 its prefill is
    cut into steps (the first of FIRST_CHUNK tokens, then as measured: here a step of the rows alone and a prompt
    token beside them are timed as 10 and 1 ms, so 10 tokens a step), the rows decode at each of them, and every
    request gets its alone run's tokens and log-probabilities, exactly (the cut moves time only)."""
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

    def timed(running: int, prompt_tokens: int, seconds: float) -> None:  # steps timed as stated, not as run
        ChunkBudget.timed(budget, running, prompt_tokens, 0.010 + 0.001 * prompt_tokens)

    budget.prompt_tokens = recorded  # type: ignore[method-assign]
    budget.timed = timed  # type: ignore[method-assign]
    step = sched.step

    def stepped() -> None:
        step()
        if sched.last_step["prompt_tokens"] and sched.last_step["rows"]:
            prompt_steps.append((len(cuts), sched.last_step["prompt_tokens"]))

    sched.step = stepped  # type: ignore[method-assign]
    assert_served_equals_alone(model, prompts, sched, {0: [0, 1], 3: [2]}, 12)
    beside = [n for i, n in prompt_steps if cuts[i - 1][0] > 0]
    assert len(beside) >= 3 and beside[0] == FIRST_CHUNK and set(beside[1:-1]) == {10} and beside[-1] <= 10, beside
