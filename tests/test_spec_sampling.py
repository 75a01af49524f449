"""Lossless speculative sampling: the accept / residual rule against exact enumeration, and the joint distribution
of generated tokens under speculative sampling against the target model's exact distribution (chi-square)."""
from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch

import bmc
from bmc.attention import dense_attention
from bmc.kv import KV_STRATEGIES
from bmc.sampling import Sampler, SamplingParams, draw
from bmc.spec import DRAFTERS, Drafter, NodeResidual, Proposal, TreeSpec

from .conftest import transformers  # noqa: F401  (the tiny models are built with transformers)

PROMPT = [5, 17, 33, 80, 101, 7, 9, 250, 12, 5, 17, 33, 80, 101]


def output_distribution(p: torch.Tensor, q: torch.Tensor | None, order: list[int]) -> torch.Tensor:
    """The exact distribution NodeResidual's walk emits for a fixed candidate order: sum over the first accepted
    candidate, plus the all-rejected mass times the final residual."""
    node = NodeResidual(p, q)
    out = torch.zeros_like(p)
    reach = 1.0  # probability that every earlier candidate was rejected
    for x in order:
        a = node.accept_prob(x)
        out[x] += reach * a
        reach *= 1.0 - a
        node.reject(x)
    return out + reach * node.p


def without_replacement(q: torch.Tensor, k: int) -> list[tuple[list[int], float]]:
    """Every ordered draw of k distinct tokens from q, with its probability."""
    support = [i for i in range(len(q)) if q[i] > 0]
    out = []
    for seq in itertools.permutations(support, k):
        prob, left = 1.0, 1.0
        for x in seq:
            prob *= float(q[x]) / left
            left -= float(q[x])
        out.append((list(seq), prob))
    return out


P_CASES = [
    torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0, 0.0], dtype=torch.float64),  # top-k'ed: two tokens impossible
    torch.tensor([0.05, 0.05, 0.6, 0.1, 0.1, 0.1], dtype=torch.float64),
]
Q_CASES = [
    torch.tensor([0.1, 0.1, 0.1, 0.1, 0.3, 0.3], dtype=torch.float64),  # much of q where p is zero
    torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0, 0.0], dtype=torch.float64),
    torch.tensor([0.05, 0.05, 0.6, 0.1, 0.1, 0.1], dtype=torch.float64),  # q == P_CASES[1]
]


@pytest.mark.parametrize("p", P_CASES)
def test_point_mass_candidates_give_exactly_p(p):
    """Fixed candidates (q = point masses) in any order, including impossible and duplicate tokens."""
    for order in ([0], [3, 0], [4, 2, 0], [1, 1, 5], [2, 3, 1, 0], list(range(6))):
        torch.testing.assert_close(output_distribution(p, None, order), p, atol=1e-12, rtol=0)


@pytest.mark.parametrize("p", P_CASES)
@pytest.mark.parametrize("q", Q_CASES)
def test_candidates_sampled_without_replacement_give_exactly_p(p, q):
    """Averaged over every ordered draw of k siblings from q without replacement, the output is p."""
    for k in (1, 2, 3):
        mix = torch.zeros_like(p)
        for order, prob in without_replacement(q, k):
            mix += prob * output_distribution(p, q, order)
        torch.testing.assert_close(mix, p, atol=1e-12, rtol=0)
        # and it is not p for one fixed order alone (the draft's randomness is part of the identity)
    assert not torch.allclose(output_distribution(P_CASES[0], Q_CASES[0], [4]), P_CASES[0])


def test_accept_prob_and_residual_values():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.6, 0.2], dtype=torch.float64)
    node = NodeResidual(p, q)
    assert node.accept_prob(0) == 1.0 and node.accept_prob(1) == pytest.approx(0.5)
    node.reject(1)
    torch.testing.assert_close(node.p, torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))  # max(p - q, 0)
    torch.testing.assert_close(node.q, torch.tensor([0.5, 0.0, 0.5], dtype=torch.float64))  # q without 1
    det = NodeResidual(p, None)
    assert det.accept_prob(2) == pytest.approx(0.2)
    det.reject(0)
    torch.testing.assert_close(det.p, torch.tensor([0.0, 0.6, 0.4], dtype=torch.float64))


# ---- end to end on a tiny model ------------------------------------------------------------------------------

def target_probs(model, params: SamplingParams, context: list[int]) -> torch.Tensor:
    """The sampling distribution after `context`, from one plain forward."""
    cfg = model.config
    cache = KV_STRATEGIES["iterative"](num_layers=cfg.num_layers, batch_size=1, num_kv_heads=cfg.num_kv_heads,
                                       head_dim=cfg.head_dim, max_length=len(context))
    cache.reserve(len(context))
    with torch.inference_mode():
        logits = model.net(torch.tensor([context]), torch.arange(len(context))[None], cache, dense_attention,
                           cache.attention_bias(len(context)))[:, -1]
    return Sampler(params, torch.device("cpu")).probs(logits)[0].double()


def exact_tables(model, params: SamplingParams, prompt: list[int], n: int):
    """The target's distribution after every reachable generated prefix shorter than n, and the exact joint
    distribution of the first n generated tokens."""
    table: dict[tuple[int, ...], torch.Tensor] = {}
    joint: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], prob: float) -> None:
        if len(prefix) == n:
            joint[prefix] = prob
            return
        p = table[prefix] = target_probs(model, params, prompt + list(prefix))
        for x in torch.nonzero(p).flatten().tolist():
            walk(prefix + (x,), prob * float(p[x]))

    walk((), 1.0)
    return table, joint


def chi_square_ok(samples: list[tuple[int, ...]], joint: dict[tuple[int, ...], float]) -> tuple[float, float]:
    """Pearson's statistic over cells with expected count >= 5 (the rest pooled) and its 0.1% critical value by
    the Wilson-Hilferty approximation (z = 3.0902), accurate to ~1% at these degrees of freedom."""
    n = len(samples)
    counts = Counter(samples)
    assert set(counts) <= set(joint), "a sample outside the target's support"
    big = [c for c in joint if joint[c] * n >= 5]
    pooled_exp = n * (1.0 - sum(joint[c] for c in big))
    pooled_obs = n - sum(counts[c] for c in big)
    stat = sum((counts[c] - n * joint[c]) ** 2 / (n * joint[c]) for c in big)
    cells = len(big)
    if pooled_exp >= 5:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    k = cells - 1
    crit = k * (1 - 2 / (9 * k) + 3.0902 * math.sqrt(2 / (9 * k))) ** 3
    return stat, crit


def test_draw_follows_the_distribution_and_never_picks_impossible_tokens():
    """The sampler's inverse-CDF draw: a chi-square fit per row, zero-probability tokens (leading, inner,
    trailing) never drawn, and a point mass always drawn, also when u lands at the very top of the CDF."""
    p = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0], [0.1, 0.0, 0.0, 0.0, 0.0, 0.9], [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    picks = torch.stack([draw(p, gen) for _ in range(4000)])  # [n, rows]
    assert (p.gather(1, picks.T) > 0).all()
    for row in range(2):
        joint = {(i,): float(p[row, i]) for i in range(6) if p[row, i] > 0}
        stat, crit = chi_square_ok([(int(x),) for x in picks[:, row]], joint)
        assert stat < crit
    assert (picks[:, 2] == 2).all()
    unnormalised = torch.tensor([[0.0, 2.0, 0.0, 0.0]])  # u = rand * total stays below the total
    assert all(int(draw(unnormalised, gen)) == 1 for _ in range(100))


class OracleDrafter(Drafter):
    """Test drafter that knows the target's distributions: at every node it proposes the most likely token, the
    least likely possible one and an impossible one (fixed choices), or with `sample_q` it draws two children
    without replacement from a q far from p (tokens outside p's support included) and reports q."""

    name = "oracle"

    def __init__(self, table, prompt_len: int, sample_q: bool) -> None:
        self.table, self.prompt_len, self.sample_q = table, prompt_len, sample_q
        self.ctx: dict[int, list[int]] = {}
        self.gen = torch.Generator().manual_seed(123)

    def start(self, row: int, context: list[int], sampler=None) -> None:
        self.ctx[row] = list(context)

    def extend(self, row: int, tokens: list[int]) -> None:
        self.ctx[row] += tokens

    def children(self, prefix: tuple[int, ...]) -> tuple[list[int], torch.Tensor | None]:
        p = self.table.get(prefix)
        if p is None:  # an impossible node: nothing below it is ever visited
            return [], None
        support = torch.nonzero(p).flatten().tolist()
        best, worst = max(support, key=lambda x: p[x]), min(support, key=lambda x: p[x])
        outside = next(x for x in range(len(p)) if p[x] == 0)
        if not self.sample_q:
            return [best, worst, outside], None
        q = torch.zeros(len(p), dtype=torch.float32)
        q[[best, worst, outside]] = torch.tensor([0.2, 0.5, 0.3])  # favours the unlikely tokens: many rejections
        picks = torch.multinomial(q, 2, replacement=False, generator=self.gen).tolist()
        return picks, q

    def propose_batch(self, rows: list[int], specs: list[TreeSpec | None]) -> list[Proposal]:
        out = []
        for row, spec in zip(rows, specs):
            prop = Proposal()
            if spec is not None:
                frontier = [(-1, tuple(self.ctx[row][self.prompt_len:]))]
                for _ in range(spec.depth):
                    nxt = []
                    for node, prefix in frontier:
                        kids, q = self.children(prefix)
                        if q is not None:
                            prop.q[node] = q
                        for x in kids:
                            prop.tokens.append(x)
                            prop.parents.append(node)
                            nxt.append((len(prop.tokens) - 1, prefix + (x,)))
                    frontier = nxt
            out.append(prop)
        return out


@pytest.mark.parametrize("sample_q", [False, True], ids=["fixed-candidates", "sampled-candidates"])
def test_speculative_sampling_has_the_target_distribution(gqa_dir, monkeypatch, sample_q):
    model = bmc.load(str(gqa_dir))
    # a nearly flat random model: a low temperature makes the top-3 probabilities unequal (about .5 / .3 / .2)
    params = SamplingParams(temperature=0.05, top_k=3, top_p=0.97 if sample_q else None, seed=7)
    n_tokens, n_samples = 4, 3000
    table, joint = exact_tables(model, params, PROMPT, n_tokens)
    monkeypatch.setitem(DRAFTERS, "oracle", lambda arg, target, sampler: OracleDrafter(table, len(PROMPT), sample_q))
    out = bmc.generate(model, [PROMPT], max_new_tokens=n_tokens, ignore_eos=True, temperature=params.temperature,
                       top_k=params.top_k, top_p=params.top_p, seed=params.seed, num_samples=n_samples,
                       speculative="oracle", tree="dynamic:3x3", spec_grow=True)  # whole trees, not trimmed to the chunk
    sp = out.stats.speculative
    assert 0 < sp.accepted < sp.drafted  # both branches exercised
    stat, crit = chi_square_ok([tuple(c.token_ids) for c in out], joint)
    assert stat < crit, (stat, crit)
    # the check has power at this sample size: the same samples against a joint whose first token is uniform over
    # its support (the rest unchanged) fail it
    p1 = table[()]
    support = int((p1 > 0).sum())
    alt = {k: v / float(p1[k[0]]) / support for k, v in joint.items()}
    assert chi_square_ok([tuple(c.token_ids) for c in out], alt)[0] > crit

def test_speculative_sampling_is_reproducible_and_top_k_1_is_greedy(gqa_dir):
    model = bmc.load(str(gqa_dir))
    prompts = [PROMPT, [40, 41, 42, 40, 41]]
    kw = dict(max_new_tokens=12, ignore_eos=True, speculative="ngram", tree="dynamic:3x4")
    a = bmc.generate(model, prompts, temperature=0.8, seed=3, **kw)
    b = bmc.generate(model, prompts, temperature=0.8, seed=3, **kw)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    greedy = bmc.generate(model, prompts, max_new_tokens=12, ignore_eos=True)
    one = bmc.generate(model, prompts, temperature=1.0, top_k=1, seed=0, **kw)  # p is a point mass: no randomness
    assert [c.token_ids for c in one] == [c.token_ids for c in greedy]
