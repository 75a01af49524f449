"""Prompt chunks sized by their measured cost beside running rows (issue 44, item 6; measured in
docs/performance.md, "A long prompt joining running streams").

A step computes every decode (and verify) row first and prompt chunks in what is left of max_num_batched_tokens.
A fixed token budget lets a prompt token cost what it costs: 256 of them beside four streams on a 2-core CPU hold
those streams ~150 ms. With an ITL factor f, while rows decode, a step takes the most prompt tokens p for which

    t_rows + p c <= f t_rows,

t_rows the running rows' own step time and c a prompt token's extra time in a step, both measured on this engine's
own steps (moving means: the arithmetic mode, the threads, the machine's load and the prompt's attention over its
earlier columns, which grows along a long prompt, are all in them). Before a step with prompt tokens was timed a
step takes FIRST_CHUNK of them; a step always takes at least one; with no rows running it takes the whole budget
(no stream to keep smooth).

How a prompt is chunked never changes a token (chunked prefill gives whole prefill's bits), so the cut only moves
time between the prompt's first token and the streams' next ones."""
from __future__ import annotations

from dataclasses import dataclass, field

WINDOW = 16  # the moving means: the mean of the first WINDOW steps, then each new step weighs 1 / WINDOW
FIRST_CHUNK = 16  # prompt tokens beside running rows before any such step was timed


def _moving(mean: float, count: int, x: float) -> float:
    return mean + (x - mean) / min(count, WINDOW)


@dataclass
class ChunkBudget:
    """The prompt tokens a step may take beside running rows (module docstring); factor > 1."""

    factor: float
    rows_seconds: float = 0.0  # a step of the running rows alone (moving mean)
    token_seconds: float = 0.0  # a prompt token's extra time in a step beside them (moving mean)
    counts: list[int] = field(default_factory=lambda: [0, 0])

    def prompt_tokens(self, rows: int, budget: int) -> int:
        """How many of `budget` prompt tokens a step with `rows` running decode or verify rows takes."""
        if rows <= 0 or budget <= 1:
            return budget
        if not all(self.counts):  # nothing timed yet to keep within
            return min(budget, FIRST_CHUNK)
        p = int((self.factor - 1.0) * self.rows_seconds / max(self.token_seconds, 1e-9))
        return max(1, min(budget, p))

    def timed(self, rows: int, prompt_tokens: int, seconds: float) -> None:
        """A step with `rows` running rows and `prompt_tokens` prompt tokens took `seconds`."""
        if rows <= 0:
            return
        if prompt_tokens == 0:
            self.counts[0] += 1
            self.rows_seconds = _moving(self.rows_seconds, self.counts[0], seconds)
        elif self.counts[0]:
            self.counts[1] += 1
            extra = max(0.0, seconds - self.rows_seconds) / prompt_tokens
            self.token_seconds = _moving(self.token_seconds, self.counts[1], extra)
