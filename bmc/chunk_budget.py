"""Prompt chunks sized by their measured cost beside running rows (issue 44, item 6; measured in
docs/performance.md, "A long prompt joining running streams").

A step computes every decode (and verify) row first and prompt chunks in what is left of max_num_batched_tokens.
A fixed token budget lets a prompt token cost what it costs: 256 of them beside four streams on a 2-core CPU hold
those streams ~250 ms. With an ITL factor f, while rows decode, a step takes the most prompt tokens p for which

    t_rows + p c <= f t_rows,

t_rows the running rows' own step time and c a prompt token's extra time in a step beside them, both medians over
this engine's last WINDOW steps of each kind (the arithmetic mode, the threads, the machine's load and the prompt's
attention over its earlier columns, which grows along a long prompt, are all in them; a median, so that one slow
step, a first call's set-up, moves neither). Before a step with prompt tokens was timed a step takes FIRST_CHUNK of
them; a step always takes at least one; with no rows running it takes the whole budget (no stream to keep smooth).

The model has no fixed cost per chunk: it holds where a step is one forward over the rows and the chunk together
(the native CPU step's forward_parts), not where a chunk is a forward of its own, which reads every weight again
(the scheduler refuses the option there). How a prompt is chunked never changes a token (chunked prefill gives whole
prefill's bits), so the cut only moves time between the prompt's first token and the streams' next ones."""
from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field

WINDOW = 16  # steps of each kind the medians are taken over
FIRST_CHUNK = 16  # prompt tokens beside running rows before any such step was timed


@dataclass
class ChunkBudget:
    """The prompt tokens a step may take beside running rows (module docstring); factor > 1."""

    factor: float
    rows_steps: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=WINDOW))
    token_costs: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=WINDOW))

    def prompt_tokens(self, running: int, budget: int) -> int:
        """How many of `budget` prompt tokens a step takes beside `running` decode or verify rows (their count
        matters only as none or some: their time is measured, not modelled)."""
        if running <= 0 or budget <= 1:
            return budget
        if not self.rows_steps or not self.token_costs:  # nothing timed yet to keep within
            return min(budget, FIRST_CHUNK)
        room = (self.factor - 1.0) * statistics.median(self.rows_steps)
        p = int(room / max(statistics.median(self.token_costs), 1e-9))
        return max(1, min(budget, p))

    def timed(self, running: int, prompt_tokens: int, seconds: float) -> None:
        """A step beside `running` rows with `prompt_tokens` prompt tokens took `seconds`."""
        if running <= 0:
            return
        if prompt_tokens == 0:
            self.rows_steps.append(seconds)
        elif self.rows_steps:
            self.token_costs.append(max(0.0, seconds - statistics.median(self.rows_steps)) / prompt_tokens)
