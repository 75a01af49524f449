"""tree="auto": each verify step's draft trees sized from measurement, not a fixed shape.

A step of m token rows costs cost(m) seconds (RowCosts: the model's own forward timed at m rows on a scratch
cache, once per model, machine, arithmetic and thread count, and stored beside the calibration profile). Node i of a
row's proposal (nodes in draft order, parents first, so the first n nodes are a tree) is accepted with probability
p_i, counted online over this engine's verify steps (AutoTree.rates: an untried node is taken to be as good as the
node before it, so rows whose drafts keep being right try deeper trees and keep them only where they pay). The step's trees are cut to the n nodes that maximise the expected tokens a
second,

    rows_drafting * (1 + sum_{i<n} p_i) / cost(batch_rows * (1 + n)),

Sequoia's / dynamic-tree objective (expected accepted tokens per unit of measured step time); n = 0 is plain decoding,
so a drafter that does not pay is not used. Greedy tokens do not depend on the tree (verification is exact), and
sampled ones keep the model's distribution."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .tree import TreeSpec

AUTO_PROPOSAL = TreeSpec(4, 8, 32)  # what a drafter proposes under tree="auto" (four continuations of 8 tokens)
MEASURED_ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 33, 48, 64)
COSTS_VERSION = 4  # 3: float rows on Q4 panels factored up to 64 rows (linear.h), cheaper at 5-64; 4: 8 rows a call


@dataclass(frozen=True)
class RowCosts:
    """Seconds of one step of the model by its token rows, measured at `rows` (increasing)."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]

    def at(self, m: int) -> float:
        """cost(m): linear between measured points, the last segment's slope beyond them."""
        rows, secs = self.rows, self.seconds
        if m <= rows[0]:
            return secs[0] * m / rows[0]
        for (r0, s0), (r1, s1) in zip(zip(rows, secs), zip(rows[1:], secs[1:])):
            if m <= r1:
                return s0 + (s1 - s0) * (m - r0) / (r1 - r0)
        r0, r1, s0, s1 = rows[-2], rows[-1], secs[-2], secs[-1]
        return s1 + max(s1 - s0, 0.0) / (r1 - r0) * (m - r1)


@functools.lru_cache(maxsize=256)
def tree_costs(costs: RowCosts, batch_rows: int, top: int) -> tuple[float, ...]:
    """cost(batch_rows * (1 + n)) for n = 0..top: a step's forward with n-node trees, the same for every step of a
    batch (AutoTree.nodes looked each up per step: 0.16 ms of a 3.4 ms int8 step in Python)."""
    return tuple(costs.at(batch_rows * (1 + n)) for n in range(top + 1))


HOT, COLD = 1, 0  # a row whose last verify step accepted at least two drafts (or all, when fewer), or not


@dataclass
class AutoTree:
    """The online acceptance counts and the choice of n (module docstring). A row is hot after a verify step that
    accepted at least two of its drafts (or all of a shorter tree: it is copying, and its next draft is likely right),
    cold otherwise (and when new); node i's rate is counted apart for the two, over the drafting rows of the steps
    whose trees reached i + 1 nodes, whether or not the row proposed it (a drafter that finds nothing to propose
    lowers it)."""

    costs: RowCosts
    seen: list[list[int]] = field(default_factory=lambda: [[0] * AUTO_PROPOSAL.size for _ in range(2)])
    accepted: list[list[int]] = field(default_factory=lambda: [[0] * AUTO_PROPOSAL.size for _ in range(2)])
    state: dict[int, int] = field(default_factory=dict)  # row key -> HOT or COLD
    guess: dict[int, int] = field(default_factory=dict)  # row key -> its drafter's next token, in a step not verified
    streak: dict[int, int] = field(default_factory=dict)  # row key -> its guesses right in a row
    chosen: list[int] = field(default_factory=list)  # n of each step (stats)
    # seconds a step took beyond cost(its rows), averaged apart for plain [0] and verify [1] steps (timed): a verify
    # step's drafting, tree and acceptance work, which the forward's curve does not hold
    residual: list[float] = field(default_factory=lambda: [0.0, 0.0])
    timed_steps: list[int] = field(default_factory=lambda: [0, 0])
    draft_cost: float = 0.0  # seconds a verify step's drafter takes (drafted)
    draft_steps: int = 0
    _rates: dict[tuple[int, int], list[float]] = field(default_factory=dict, init=False, repr=False, compare=False)
    # (rates() as computed, until the counts change)

    def rates(self, state: int, n: int) -> list[float]:
        """The acceptance estimates of nodes 0..n-1: node 0 Laplace's (accepted + 1) / (rows + 2); node i with a
        prior mean (weight one row) of its predecessor's rate times node 0's (each draft token right as often as
        the first, given the ones before it), and never above its predecessor's rate (on the first continuation,
        the first eight nodes, a node is accepted only after its parent). A node of another continuation (past the
        first eight) is accepted only where the first continuation was wrong: its prior is its predecessor's rate
        times one less node 0's. So rows whose drafts keep being right try deeper trees and keep them only where
        they pay, and untried nodes never promise more tokens than a tree can give: rows turned hot by two right
        guesses once verified 32-node trees at batch 8 (7x a plain step) for one continuation's tokens."""
        kept = self._rates.get((state, n))
        if kept is not None:
            return kept
        out: list[float] = []
        for i in range(n):
            seen, acc = self.seen[state][i], self.accepted[state][i]
            if i == 0:
                r = (acc + 1) / (seen + 2)
            else:
                prior = out[-1] * (out[0] if i != AUTO_PROPOSAL.depth else 1.0 - out[0])
                r = min((acc + prior) / (seen + 1), out[-1])
            out.append(r)
        self._rates[state, n] = out
        return out

    def nodes(self, batch_rows: int, keys: list[int], most: int) -> int:
        """The node count (0..most) of the step's trees; batch_rows: rows of the verify forward (every slot of the
        batch), keys: the rows that may draft."""
        states = [self.state.get(k, COLD) for k in keys]
        hot = sum(states)
        top = max(0, min(most, AUTO_PROPOSAL.size))
        cost = tree_costs(self.costs, batch_rows, top)
        best_n, best = 0, len(keys) / cost[0]
        gain = float(len(keys))
        hot_rates, cold_rates = self.rates(HOT, top), self.rates(COLD, top)
        extra = self.verify_overhead()
        for n in range(1, top + 1):
            gain += hot * hot_rates[n - 1] + (len(keys) - hot) * cold_rates[n - 1]
            value = gain / (cost[n] + extra)
            if value > best:
                best_n, best = n, value
        self.chosen.append(best_n)
        return best_n

    def record(self, outcomes: list[tuple[int, list[int]]], nodes: int) -> None:
        """One step of trees cut at `nodes`: each drafting row's key and accepted path (0 = the root, j = node
        j - 1; [0] where it proposed nothing)."""
        self._rates.clear()
        for key, path in outcomes:
            state = self.state.get(key, COLD)
            on_path = set(path[1:])
            for i in range(min(nodes, AUTO_PROPOSAL.size)):
                self.seen[state][i] += 1
                self.accepted[state][i] += (i + 1) in on_path
            self.state[key] = HOT if len(on_path) >= min(2, nodes) else COLD
            self.guess.pop(key, None)

    def timed(self, rows: int, seconds: float, verified: bool) -> None:
        """A decode step of `rows` forward rows took `seconds` in all (drafting, the forward, acceptance): its time
        beyond cost(rows) joins the plain or the verify steps' mean (the first 16 steps', then a moving one)."""
        k = int(verified)
        self.timed_steps[k] += 1
        self.residual[k] = _moving_mean(self.residual[k], self.timed_steps[k], seconds - self.costs.at(rows))

    def drafted(self, seconds: float) -> None:
        """A verify step's drafter took `seconds` (the mean of the first 16, then a moving one)."""
        self.draft_steps += 1
        self.draft_cost = _moving_mean(self.draft_cost, self.draft_steps, seconds)

    def verify_overhead(self) -> float:
        """Seconds a verify step costs beyond its forward, more than a plain step does. Before any plain step was
        timed, its drafter's own time: drafts that keep paying may never let a plain step be timed, and a dear
        drafter (a draft model's forwards) must show all the same."""
        if self.timed_steps[0] and self.timed_steps[1]:
            return max(0.0, self.residual[1] - self.residual[0])
        return self.draft_cost

    def guessed(self, key: int, token: int) -> None:
        """A cheap drafter's first token for a row whose step decodes plainly (tested by `observe`)."""
        self.guess[key] = token

    def observe(self, key: int, token: int) -> None:
        """The token a row decoded after a guessed step: the first node would have been accepted (greedy) where it
        equals the guess, counted for node 0 of the row's state; two right in a row turn a cold row hot (one is
        often a common word), a wrong one turns a hot row cold. A hot row whose verify steps failed decodes plainly
        and is guessed for too: without this its state's rate, low from those steps, never heard of the guesses
        that came right, and the row never drafted again (a Q4_0 copy prompt: plain in 66 of 80 steps)."""
        guess = self.guess.pop(key, None)
        if guess is None:
            return
        right = guess == token
        state = self.state.get(key, COLD)
        for n in [n for s, n in self._rates if s == state]:
            del self._rates[state, n]
        self.seen[state][0] += 1
        self.accepted[state][0] += right
        self.streak[key] = self.streak.get(key, 0) + 1 if right else 0
        if state == HOT and not right:
            self.state[key] = COLD
        elif self.streak[key] >= 2:
            self.state[key], self.streak[key] = HOT, 0

    def forget(self, key: int) -> None:
        self.state.pop(key, None)
        self.guess.pop(key, None)
        self.streak.pop(key, None)


def _moving_mean(mean: float, count: int, x: float) -> float:
    """The mean of the first 16 values, then a moving one (count: values so far, x the newest included)."""
    return mean + (x - mean) / min(count, 16)


def row_costs(model: Any, remeasure: bool = False) -> RowCosts:
    """The model's step cost by token rows: kept on the model, else read from the cache directory, else measured
    (about a second for a small model) and stored there; remeasure (bmc-calibrate --model): measured and stored
    whatever is kept."""
    cached = getattr(model, "_row_costs", None)
    if cached is not None and not remeasure:
        return cached
    from ..analytic.profile import cache_dir

    key = _costs_key(model)
    path = cache_dir() / f"rows-{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]}.json"
    costs = None
    try:
        data = json.loads(path.read_text())
        if data.get("key") == key and not remeasure:
            costs = RowCosts(tuple(data["rows"]), tuple(data["seconds"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if costs is None:
        costs = measure_row_costs(model)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, "rows": list(costs.rows), "seconds": list(costs.seconds)}))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache: measured again next time
    model._row_costs = costs
    return costs


def _costs_key(model: Any) -> list:
    from ..analytic.profile import identity

    ident = identity(model.device, model.dtype)
    return [COSTS_VERSION, ident, str(getattr(model, "path", "")), getattr(model, "quant", ""),
            getattr(model, "activations", ""), torch.get_num_threads(), model.config.num_layers,
            model.config.hidden_size, model.config.vocab_size]


@torch.inference_mode()
def measure_row_costs(model: Any, rows: tuple[int, ...] = MEASURED_ROWS, context: int = 64,
                      repeats: int = 3) -> RowCosts:
    """Median seconds of the model's forward over m new token rows (all logits, as a verify step) after `context`
    cached positions, on a scratch cache of one row, for each m in `rows`."""
    from ..attention import dense_attention
    from ..engine import prefill_attention
    from ..kv import KV_STRATEGIES

    cfg = model.config
    most = max(rows)
    cache = KV_STRATEGIES["upfront"](num_layers=cfg.num_layers, batch_size=1, num_kv_heads=cfg.num_kv_heads,
                                     head_dim=cfg.head_dim, max_length=context + most, dtype=model.dtype,
                                     device=model.device)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (1, context + most), generator=gen).to(model.device)
    pos = torch.arange(context, device=model.device)[None]
    cache.reserve(context, pos)
    model.net(tokens[:, :context], pos, cache, prefill_attention(dense_attention, cache, context),
              cache.attention_bias(context), all_logits=False)
    cache.commit(context)
    seconds = []
    for m in rows:
        times = []
        for _ in range(repeats + 1):  # the first a warm-up (buffers of this row count)
            pos = torch.arange(context, context + m, device=model.device)[None]
            cache.reserve(m, pos)
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.net(tokens[:, context : context + m], pos, cache, dense_attention, cache.attention_bias(m),
                      all_logits=True)
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)  # nothing committed: the next forward writes the same columns
        seconds.append(statistics.median(times[1:]))
    return RowCosts(tuple(rows), tuple(seconds))
