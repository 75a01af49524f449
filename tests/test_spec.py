"""Speculative decoding: tree masks and compaction against brute-force references, and greedy output identical
to plain greedy for every drafter, tree shape, KV strategy and batch size."""
from __future__ import annotations

import random

import pytest
import torch

import bmc
from bmc.attention import dense_attention
from bmc.errors import InvalidRequestError
from bmc.kv import KV_STRATEGIES
from bmc.spec import NGramDrafter, TreeSpec, build_trie, greedy_accept, tree_visibility

from .conftest import transformers  # noqa: F401  (the tiny models are built with transformers)

# Repetitive prompts so that prompt lookup finds matches and the trees get accepted in part.
PROMPTS = [[5, 17, 33, 80, 101, 7, 9, 250, 12, 5, 17, 33, 80, 101], [40, 41, 42, 40, 41],
           [300, 3, 99, 98, 97, 96, 300, 3, 99, 98]]


def random_parents(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(-1, i) for i in range(n)]  # any earlier node (or the root) as parent


def ancestors(parents: list[int], i: int) -> list[int]:
    """Verify positions (root 0, node j -> j + 1) on the path root .. node i, by following parents."""
    path = [i + 1]
    while parents[i] != -1:
        i = parents[i]
        path.append(i + 1)
    return [0] + path[::-1]


def test_tree_visibility_matches_explicit_ancestor_lists():
    rng = random.Random(0)
    rows = [random_parents(rng, n) for n in (7, 7, 7)]
    visible, depth = tree_visibility(torch.tensor(rows))
    for b, par in enumerate(rows):
        assert visible[b, 0].tolist() == [True] + [False] * 7
        for i in range(7):
            anc = set(ancestors(par, i))
            assert {j for j in range(8) if visible[b, i + 1, j]} == anc
            assert depth[b, i + 1] == len(anc) - 1


def test_greedy_accept_walks_the_matching_branch():
    # root -> a(10) -> b(11); root -> c(12) -> d(13); node order a, c, b, d
    tokens, parents, valid = [[10, 12, 11, 13]], [[-1, -1, 0, 1]], [[True] * 4]
    preds = [[12, 0, 13, 0, 77]]  # by verify position (root 0, node i -> i + 1): at root the target wants 12 (node c), after c it wants 13 (node d), then 77
    assert greedy_accept(tokens, parents, valid, preds) == [[0, 2, 4]]
    assert greedy_accept(tokens, parents, [[True, False, True, True]], preds) == [[0]]  # c invalid: nothing taken
    assert greedy_accept(tokens, parents, valid, [[5, 0, 0, 0, 0]]) == [[0]]


def test_ngram_drafter_proposes_what_followed_the_suffix():
    d = NGramDrafter(max_n=2)
    d.start(0, [1, 2, 3, 4, 1, 2, 5, 6, 1, 2])
    tokens, parents = d.propose(0, TreeSpec(width=2, depth=2, size=4))
    # latest match of (1, 2) is followed by 5 6, the earlier one by 3 4
    assert (tokens, parents) == ([5, 6, 3, 4], [-1, 0, -1, 2])
    d.extend(0, [5])
    assert d.propose(0, TreeSpec(1, 3, 3)) == ([6, 1, 2], [-1, 0, 1])
    assert build_trie([[1, 2, 3], [1, 2, 4], [5]], size=10) == ([1, 2, 3, 4, 5], [-1, 0, 1, 1, -1])
    assert build_trie([[1, 2, 3], [1, 4]], size=3) == ([1, 2, 3], [-1, 0, 1])


def test_tree_spec_parsing():
    assert TreeSpec.parse("chain:5") == TreeSpec(1, 5, 5)
    assert TreeSpec.parse("dynamic:3x4") == TreeSpec(3, 4, 12)
    for bad in ("chain", "static:0", "dynamic:0x3", "chain:-1", "balanced:4"):
        with pytest.raises(InvalidRequestError):
            TreeSpec.parse(bad)


def test_accept_compacts_each_rows_path_in_place():
    cache = KV_STRATEGIES["bmc"](r=8, num_layers=2, batch_size=2, num_kv_heads=1, head_dim=2, max_length=16)
    cache.reserve(3)
    cache.kv[:, :, :, :, :3] = 1.0
    cache.commit(3)
    cache.reserve(5)  # a verify block of 5 columns (root + 4 nodes) at columns 3..7
    for j in range(5):
        cache.kv[:, :, :, :, 3 + j] = 10.0 + j
    m = cache.accept([[0, 2, 4], [0]], 5)
    assert m == 3 and cache.length == 6
    assert cache.kv[0, 0, 0, 0, 3:6, 0].tolist() == [10.0, 12.0, 14.0]  # row 0: root, node 1, node 3
    assert cache.kv[0, 0, 1, 0, 3, 0].item() == 10.0  # row 1 kept only its root
    assert cache.bias[0, 0, 0, :8].tolist() == [0.0] * 6 + [cache.min_value] * 2
    assert cache.bias[1, 0, 0, :8].tolist() == [0.0] * 4 + [cache.min_value] * 4  # a hole at 4, 5
    cache.check_integrity()


def tree_logits_vs_brute_force(model, context: list[int], parents: list[int], tokens: list[int]) -> None:
    """Verify-forward logits of every tree node == a plain forward over context + the node's ancestor path."""
    cfg = model.config
    cache = KV_STRATEGIES["bmc"](r=4, num_layers=cfg.num_layers, batch_size=1, num_kv_heads=cfg.num_kv_heads,
                                 head_dim=cfg.head_dim, max_length=64)
    with torch.inference_mode():
        ctx, root = context[:-1], context[-1]
        cache.reserve(len(ctx))
        model.net(torch.tensor([ctx]), torch.arange(len(ctx))[None], cache, dense_attention,
                  cache.attention_bias(len(ctx)))
        cache.commit(len(ctx))
        visible, depth = tree_visibility(torch.tensor([parents]))
        t = len(tokens) + 1
        cache.reserve(t)
        got = model.net(torch.tensor([[root] + tokens]), len(ctx) + depth, cache, dense_attention,
                        cache.attention_bias(t, visible), all_logits=True)[0]
        for i in range(len(tokens)):
            path = [([root] + tokens)[j] for j in ancestors(parents, i)]
            full = ctx + path
            c2 = KV_STRATEGIES["iterative"](num_layers=cfg.num_layers, batch_size=1, num_kv_heads=cfg.num_kv_heads,
                                            head_dim=cfg.head_dim, max_length=64)
            c2.reserve(len(full))
            want = model.net(torch.tensor([full]), torch.arange(len(full))[None], c2, dense_attention,
                             c2.attention_bias(len(full)))[0, -1]
            torch.testing.assert_close(got[i + 1], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ["llama-gqa", "opt-pre_norm"])
def test_tree_attention_equals_attention_over_each_nodes_ancestors(tiny_dirs, variant):
    model = bmc.load(str(tiny_dirs[variant]))
    rng = random.Random(1)
    parents = random_parents(rng, 9)
    tokens = [rng.randrange(3, 300) for _ in parents]
    tree_logits_vs_brute_force(model, PROMPTS[0], parents, tokens)


@pytest.mark.parametrize("variant", ["llama-gqa", "llama-mqa", "opt-projected"])
def test_speculative_greedy_is_identical_to_plain_greedy(tiny_dirs, variant):
    model = bmc.load(str(tiny_dirs[variant]))
    for prompts in (PROMPTS[:1], PROMPTS):
        ref = bmc.generate(model, prompts, max_new_tokens=30, ignore_eos=True)
        want = [c.token_ids for c in ref]
        for kv, extra in (("bmc", dict(r=8)), ("bmc", dict(r=3)), ("iterative", {}), ("upfront", {})):
            for tree in ("chain:1", "chain:4", "dynamic:3x4", "static:12", "auto"):
                for grow in (False, True):
                    out = bmc.generate(model, prompts, max_new_tokens=30, ignore_eos=True, kv=kv, speculative="ngram",
                                       tree=tree, spec_grow=grow, **extra)
                    assert [c.token_ids for c in out] == want, (kv, extra, tree, grow)
                    sp = out.stats.speculative
                    assert sp.accepted <= sp.drafted
                    assert tree == "auto" or (sp.verify_steps > 0 and sp.drafted > 0)  # auto verifies what pays
    # prompt lookup may never be right on a random model; a drafter that is the whole target always is, so the
    # compaction of accepted paths runs on every strategy
    exact = f"layers:{model.config.num_layers}"
    for kv, extra in (("bmc", dict(r=8)), ("iterative", {}), ("upfront", {})):
        for tree in ("chain:4", "dynamic:3x4", "auto"):
            out = bmc.generate(model, PROMPTS, max_new_tokens=30, ignore_eos=True, kv=kv, speculative=exact,
                               tree=tree, **extra)
            assert [c.token_ids for c in out] == want, (kv, tree)
            sp = out.stats.speculative
            if tree == "auto":  # a drafter as dear as the target stops paying once its steps are timed, but its
                # first trees were verified, every top-ranked node accepted
                assert sp.verify_steps >= 1 and sp.accepted > 0 and sp.rank_accepted[0] == sp.rank_visits[0], (kv, sp)
            else:
                assert sp.mean_accepted_length > 2, (kv, tree)  # trees trimmed to free rows


def test_speculative_respects_eos_stop_and_length(gqa_dir):
    """An EOS or a stop string that lands inside an accepted draft path ends the row there, as in plain decoding."""
    model = bmc.load(str(gqa_dir))
    spec_kw = dict(speculative="ngram", tree="dynamic:2x5")
    free = bmc.generate(model, PROMPTS, max_new_tokens=17, ignore_eos=True)
    assert bmc.generate(model, PROMPTS, max_new_tokens=17, ignore_eos=True, **spec_kw).stats.speculative.accepted > 0
    eos = free[0].token_ids[6]
    stop = model.tokenizer.decode(free[1].token_ids[8:10])
    model.tokenizer.eos_token_ids.append(eos)
    try:
        plain = bmc.generate(model, PROMPTS, max_new_tokens=17, stop=[stop])
        spec = bmc.generate(model, PROMPTS, max_new_tokens=17, stop=[stop], **spec_kw)
    finally:
        model.tokenizer.eos_token_ids.remove(eos)
    assert plain[0].finish_reason == "stop" and len(plain[0].token_ids) <= 7  # the EOS (or an earlier stop) hit
    assert plain[1].finish_reason == "stop" and len(plain[1].token_ids) <= 10  # the stop string (or an EOS) hit
    assert [(c.token_ids, c.finish_reason, c.text) for c in spec] == [
        (c.token_ids, c.finish_reason, c.text) for c in plain]
    assert all(len(c.token_ids) <= 17 for c in spec)


def test_speculative_rejects_bad_drafters_and_trees(gqa_dir):
    model = bmc.load(str(gqa_dir))
    with pytest.raises(InvalidRequestError, match="drafter"):
        bmc.generate(model, PROMPTS, max_new_tokens=4, speculative="nope")
    with pytest.raises(InvalidRequestError, match="takes no argument"):
        bmc.generate(model, PROMPTS, max_new_tokens=4, speculative="ngram:3")
    with pytest.raises(InvalidRequestError, match="tree"):
        bmc.generate(model, PROMPTS, max_new_tokens=4, speculative="ngram", tree="wide")


def _auto_with(costs, rate: float):
    from bmc.spec.auto import AutoTree

    auto = AutoTree(costs)
    for state in (0, 1):  # evidence: 1000 rows at every node, each node accepted at `rate`
        auto.seen[state] = [1000] * len(auto.seen[state])
        auto.accepted[state] = [int(1000 * rate)] * len(auto.seen[state])
    return auto


def test_auto_picks_smaller_trees_when_verify_rows_are_dear():
    """tree="auto" maximises expected tokens per measured second: with rows nearly free (a step bound by reading
    the weights) it verifies deep trees, with each row costing about a step it verifies few nodes or none, and with
    drafts rarely right it drafts less than when they are usually right."""
    from bmc.spec.auto import RowCosts

    cheap = RowCosts((1, 4, 33), (1.0, 1.05, 1.3))
    dear = RowCosts((1, 4, 33), (1.0, 3.6, 30.0))
    for rate in (0.9, 0.5):
        n_cheap, n_dear = _auto_with(cheap, rate).nodes(1, [0], 32), _auto_with(dear, rate).nodes(1, [0], 32)
        assert n_cheap >= 16 and n_dear < n_cheap, (rate, n_cheap, n_dear)
    assert _auto_with(dear, 0.05).nodes(1, [0], 32) == 0  # drafts that do not pay are not verified
    assert _auto_with(dear, 0.9).nodes(1, [0], 32) > _auto_with(dear, 0.3).nodes(1, [0], 32)
    mid = RowCosts((1, 4, 33), (1.0, 1.6, 12.0))
    assert _auto_with(mid, 0.7).nodes(8, list(range(8)), 32) < _auto_with(mid, 0.7).nodes(1, [0], 32)  # a batch of
    # 8: each node costs 8 rows of the same curve, further up it
    assert _auto_with(dear, 0.9).nodes(1, [0], 3) <= 3  # never past the token budget's cap


def test_auto_does_not_promise_untried_nodes_more_than_a_tree_gives():
    """Rows turned hot by right guesses alone (node 0 right 14 of 15 times, no deeper node tried yet), 8 of them, on
    the step-cost curve measured for the default model (float, 2 threads: a row costs about 1.3 ms past 8 rows, a
    plain step of 8 rows 14 ms): untried nodes are taken to be right as often as node 0 given their parents, and
    another continuation's only where the first was wrong, so auto verifies at most the first continuation (9
    rows a sequence; here none: 8 rows already make the step compute-bound), not the whole 32-node proposal (136 rows, 225 ms, for what one continuation can give: the
    first verify step of a batch of 8 copying rows took that before). With the same evidence at every node
    (counted, not assumed) the deep continuation is still verified."""
    from bmc.spec.auto import AUTO_PROPOSAL, HOT, AutoTree, RowCosts

    curve = RowCosts((1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 33, 48, 64),
                     (0.0045, 0.0057, 0.0068, 0.0081, 0.0095, 0.0112, 0.0141, 0.0203, 0.0273, 0.0403, 0.0553,
                      0.0783, 0.1027))
    auto = AutoTree(curve)
    auto.seen[HOT][0], auto.accepted[HOT][0] = 15, 14
    rows = list(range(8))
    for key in rows:
        auto.state[key] = HOT
    n = auto.nodes(8, rows, AUTO_PROPOSAL.size)
    assert n <= AUTO_PROPOSAL.depth, n
    assert auto.nodes(1, [0], AUTO_PROPOSAL.size) >= 4  # one row: its rows are cheap beside a step, it drafts deep
    counted = _auto_with(curve, 0.99)
    assert counted.nodes(1, [0], AUTO_PROPOSAL.size) >= AUTO_PROPOSAL.depth


def test_auto_rows_turn_hot_and_cold_from_what_their_drafts_got():
    from bmc.spec.auto import COLD, HOT, AutoTree, RowCosts

    auto = AutoTree(RowCosts((1, 2), (1.0, 2.0)))
    assert auto.state.get(7, COLD) == COLD
    auto.record([(7, [0, 1, 2, 3])], 4)  # three of four drafts accepted: copying
    assert auto.state[7] == HOT and auto.seen[COLD][:5] == [1, 1, 1, 1, 0] and auto.accepted[COLD][:4] == [1, 1, 1, 0]
    auto.record([(7, [0])], 4)
    assert auto.state[7] == COLD and auto.seen[HOT][:4] == [1, 1, 1, 1] and auto.accepted[HOT][:4] == [0, 0, 0, 0]
    for token in (42, 43):  # steps decoded plainly: the cheap drafter's first token, checked against what came
        auto.guessed(7, 42)
        auto.observe(7, token)
    assert auto.state[7] == COLD and auto.seen[COLD][0] == 3 and auto.accepted[COLD][0] == 2
    for _ in range(2):  # two right in a row: copying again
        auto.guessed(7, 42)
        auto.observe(7, 42)
    assert auto.state[7] == HOT and auto.accepted[COLD][0] == 4
    # a hot row decoding plainly (its hot rate low from failed verifies) is guessed for too: a right guess counts
    # for the hot state's node 0 (so its rate can recover and the row draft again), a wrong one turns it cold
    hot_seen, hot_acc = auto.seen[HOT][0], auto.accepted[HOT][0]
    auto.guessed(7, 42)
    auto.observe(7, 42)
    assert auto.state[7] == HOT and (auto.seen[HOT][0], auto.accepted[HOT][0]) == (hot_seen + 1, hot_acc + 1)
    auto.guessed(7, 42)
    auto.observe(7, 43)
    assert auto.state[7] == COLD and auto.seen[HOT][0] == hot_seen + 2 and auto.seen[COLD][0] == 5
    auto.forget(7)
    assert 7 not in auto.state


def test_auto_counts_a_verify_steps_own_overhead():
    """Steps timed beyond the forward's curve: what a verify step takes more than a plain one is added to every
    tree's cost, so a draft right 10 % of the time stops being verified where its extra row is nearly free but the
    verify step's own work is not."""
    from bmc.spec.auto import COLD, AutoTree, RowCosts

    auto = AutoTree(RowCosts((1, 2, 3, 4, 8), (1.0, 1.05, 1.3, 1.5, 2.5)))
    auto.seen[COLD][0], auto.accepted[COLD][0] = 98, 10  # node 0 right about 11 % of the time
    assert auto.verify_overhead() == 0.0 and auto.nodes(1, [0], 8) >= 1  # untimed: the curve alone says verify
    auto.timed(2, 1.30, verified=True)  # no plain step yet: the drafter's own time stands for the overhead
    assert auto.verify_overhead() == 0.0
    auto.drafted(0.01)
    assert auto.verify_overhead() == pytest.approx(0.01)
    auto.timed(2, 1.30, verified=True)
    for _ in range(5):
        auto.timed(1, 1.02, verified=False)  # plain steps: 0.02 beyond cost(1)
        auto.timed(2, 1.30, verified=True)  # verify steps of 2 rows: 0.25 beyond cost(2)
    assert auto.verify_overhead() == pytest.approx(0.23)
    assert auto.nodes(1, [0], 8) == 0


def test_auto_counts_a_dear_drafter_before_any_plain_step():
    """A drafter whose proposals are right but dear (a draft model's forwards: 30x a step): with no plain step timed
    yet, its own time is the verify steps' overhead, so auto stops drafting instead of drafting on at a fraction of
    plain speed because it never took a plain step to compare with."""
    from bmc.spec.auto import COLD, HOT, AutoTree, RowCosts

    auto = AutoTree(RowCosts((1, 2, 3, 4, 8), (1.0, 1.05, 1.3, 1.5, 2.5)))
    for state in (COLD, HOT):
        auto.seen[state] = [100] * len(auto.seen[state])
        auto.accepted[state] = [90] * len(auto.seen[state])  # drafts right 90 % of the time
    assert auto.nodes(1, [0], 8) >= 2
    for _ in range(4):
        auto.drafted(30.0)  # the draft model's forwards
        auto.timed(3, 1.3 + 30.0, verified=True)  # verify steps: 30 beyond cost(3)
    assert auto.verify_overhead() == pytest.approx(30.0)
    assert auto.nodes(1, [0], 8) == 0


def test_auto_costs_are_measured_once_and_stored(gqa_dir):
    from bmc.spec.auto import MEASURED_ROWS, row_costs

    model = bmc.load(str(gqa_dir))
    costs = row_costs(model)
    assert costs.rows == MEASURED_ROWS and all(s > 0 for s in costs.seconds)
    again = bmc.load(str(gqa_dir))  # another model object: read from the cache directory, not measured
    assert row_costs(again) == costs


def test_auto_falls_back_to_a_fixed_tree_when_timing_fails(gqa_dir, monkeypatch, caplog):
    from bmc import scheduler

    model = bmc.load(str(gqa_dir))
    want = [c.token_ids for c in bmc.generate(model, PROMPTS, max_new_tokens=12, ignore_eos=True)]

    def broken(model):
        raise RuntimeError("no memory for the scratch cache")

    monkeypatch.setattr(scheduler, "row_costs", broken)
    out = bmc.generate(model, PROMPTS, max_new_tokens=12, ignore_eos=True, speculative="ngram")
    assert [c.token_ids for c in out] == want and out.stats.speculative.verify_steps > 0  # chain:4 ran
    assert "could not time" in caplog.text


@pytest.mark.slow
def test_real_model_speculative_identical_and_accepting(real_model):
    """On text the model copies from its prompt, prompt lookup gets accepted and the output is unchanged."""
    passage = ("The quick brown fox jumps over the lazy dog while the cat sleeps on the warm windowsill and the rain "
               "falls softly on the garden outside.")
    text = passage + "\n" + passage + "\n" + passage[:40]
    plain = bmc.generate(real_model, [text], max_new_tokens=48)
    spec = bmc.generate(real_model, [text], max_new_tokens=48, speculative="ngram")
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert spec.stats.speculative.mean_accepted_length > 3.0  # measured 5.7: the continuation copies the passage
    batch = [text, "Copy this list exactly: alpha, bravo, charlie, delta, echo, foxtrot, golf, hotel, india."]
    plain_b = bmc.generate(real_model, batch, max_new_tokens=32, chat=True)
    for tree in ("chain:6", "dynamic:4x6"):
        spec_b = bmc.generate(real_model, batch, max_new_tokens=32, chat=True, speculative="ngram", tree=tree)
        assert [c.token_ids for c in spec_b] == [c.token_ids for c in plain_b], tree


def test_auto_rates_follow_every_count_they_are_kept_across():
    """rates() is kept between the counts' changes (AutoTree.nodes asks for it every step): a record() and an
    observe() are seen at once, the same numbers as computed afresh."""
    from bmc.spec.auto import COLD, HOT, AutoTree, RowCosts

    auto = AutoTree(RowCosts((1, 2, 4), (1.0, 1.2, 1.6)))
    fresh = lambda state, n: AutoTree.rates(AutoTree(auto.costs, auto.seen, auto.accepted), state, n)  # noqa: E731
    before = list(auto.rates(COLD, 4)), list(auto.rates(HOT, 4))
    auto.guessed(7, 11)
    auto.observe(7, 11)  # a right guess: cold node 0 up
    assert auto.rates(COLD, 4) == fresh(COLD, 4) and auto.rates(COLD, 4)[0] > before[0][0]
    auto.record([(7, [0, 1, 2])], 4)  # row 7 accepted nodes 0 and 1
    assert auto.rates(HOT, 4) == fresh(HOT, 4) and auto.rates(COLD, 4) == fresh(COLD, 4)
    assert auto.rates(COLD, 4) != before[0]
