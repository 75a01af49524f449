"""How many threads a decode step runs on, following the cores' load.

A decode step forks its threads about a hundred times (one parallel region per GEMM and attention call), and each
region waits for its slowest thread. Beside another busy process, one of the threads is often descheduled, so every
region waits a time slice for it and the step slows several times over, far below what one thread alone gives
(docs/performance.md, "Threads beside a busy process"). The governor notices this from the step itself: a step
whose process CPU time is well below threads x wall time had threads waiting to run. It then tries one thread
fewer for a window of steps and keeps it where the steps ran faster; from a lower count it tries one more now and
then, so the threads come back when the cores are free again.

Only decode steps are governed, and only where their results do not depend on the thread count (the native step's
decode: each output is computed by one thread whatever the count; tests/test_threads.py checks the tokens).
Everything else runs at the configured count: `end()` puts it back after every governed step."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

WINDOW = 12  # steps a count is judged over
LOW_UTILIZATION = 0.75  # CPU time / (threads x wall) under which threads were kept waiting
FASTER = 0.95  # a trial count is kept when its median step takes at most this share of the current one's
PROBE_UP_EVERY = 240  # decode steps between two tries of one thread more, below the configured count
MAX_HOLD = 32  # windows a failed trial down waits at most before the next (the wait doubles per failure)


class ThreadGovernor:
    def __init__(self, threads: int, *, set_threads: Callable[[int], None] = torch.set_num_threads,
                 wall_clock: Callable[[], float] = time.perf_counter,
                 cpu_clock: Callable[[], float] = time.process_time) -> None:
        self.threads = threads  # the configured count: every step that is not governed runs at it
        self.current = threads  # what governed steps run at now
        self._set, self._wall, self._cpu = set_threads, wall_clock, cpu_clock
        self._trial: int | None = None  # a count on trial, and the current count's steps it is compared against
        self._baseline: list[float] = []
        self._steps: list[tuple[float, float]] = []  # (wall, utilization) of the window's steps
        self._since_probe = 0
        self._hold, self._held = 0, 0  # windows to wait before trying fewer threads again, and waited so far
        self._started: tuple[float, float] | None = None
        self.changes = 0  # times `current` changed (for logs and tests)

    @property
    def running(self) -> int:
        return self._trial if self._trial is not None else self.current

    def begin(self) -> None:
        """A governed step starts: run it at the current (or trial) count."""
        if self.running != self.threads:
            self._set(self.running)
        self._started = (self._wall(), self._cpu())

    def end(self) -> None:
        """The governed step is done: record it, decide, and put the configured count back."""
        if self._started is None:
            return
        wall, cpu = self._wall() - self._started[0], self._cpu() - self._started[1]
        self._started = None
        if self.running != self.threads:
            self._set(self.threads)
        if wall > 0:
            self._steps.append((wall, cpu / (self.running * wall)))
        if len(self._steps) >= WINDOW:
            self._judge()

    def _judge(self) -> None:
        median_wall = statistics.median(w for w, _ in self._steps)
        utilization = statistics.median(u for _, u in self._steps)
        self._since_probe += len(self._steps)
        self._steps = []
        if self._trial is not None:  # the trial's window against the window before it
            if median_wall <= FASTER * statistics.median(self._baseline):
                self.current, self.changes, self._hold = self._trial, self.changes + 1, 0
            elif self._trial < self.current:  # fewer threads did not pay: wait longer before trying again
                self._hold, self._held = min(MAX_HOLD, max(1, 2 * self._hold)), 0
            self._trial, self._baseline = None, []
            return
        self._held += 1
        if self.current > 1 and utilization < LOW_UTILIZATION and self._held > self._hold:
            self._trial, self._baseline = self.current - 1, [median_wall]
        elif self.current < self.threads and self._since_probe >= PROBE_UP_EVERY:
            self._trial, self._baseline, self._since_probe = self.current + 1, [median_wall], 0
