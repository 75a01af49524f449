"""Draft-model drafters (another checkpoint, the target's first layers, the target in int8): proposals against
brute-force forwards, rows leaving the batch, greedy output identical to plain greedy, sampling distribution."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import bmc
from bmc.errors import InvalidRequestError
from bmc.models.derive import Int8Linear, quantize_int8, truncate_layers
from bmc.sampling import Sampler, SamplingParams
from bmc.spec import TreeSpec
from bmc.spec.draft_model import ModelDrafter

from .conftest import make_llama, save_tiny, transformers
from .test_spec import PROMPTS
from .test_spec_sampling import PROMPT, chi_square_ok, exact_tables, target_probs

GREEDY = Sampler(SamplingParams(), torch.device("cpu"))


@pytest.fixture(scope="module")
def other_seed_dir(tmp_path_factory) -> Path:
    """The gqa variant with other random weights: same vocabulary, disagrees with the target almost everywhere."""
    return make_llama(tmp_path_factory.mktemp("llama-gqa-seed1"), "gqa", seed=1)


def greedy_continuation(model, context: list[int], n: int) -> list[int]:
    return bmc.generate(model, [context], max_new_tokens=n, ignore_eos=True)[0].token_ids


def test_chain_proposal_is_the_drafts_greedy_continuation_as_rows_leave_and_join(gqa_dir):
    draft = bmc.load(str(gqa_dir))
    contexts = {0: PROMPTS[0], 1: PROMPTS[1], 2: PROMPTS[2]}
    d = ModelDrafter(draft, GREEDY)
    for row, ctx in contexts.items():
        d.start(row, ctx)
    chain = TreeSpec.parse("chain:5")
    first = d.propose_batch([0, 1, 2], [chain] * 3)
    for row, prop in zip([0, 1, 2], first):
        assert prop.tokens == greedy_continuation(draft, contexts[row], 5)
        assert prop.parents == [-1, 0, 1, 2, 3] and prop.q == {}
    # rows accept different counts (2 of the drafts + one other token, none + one), then row 1 leaves the batch
    d.extend(0, first[0].tokens[:2] + [7])
    d.extend(2, [11])
    d.forget(1)
    contexts[0] = contexts[0] + first[0].tokens[:2] + [7]
    contexts[2] = contexts[2] + [11]
    again = d.propose_batch([0, 2], [chain, TreeSpec.parse("chain:2")])
    assert again[0].tokens == greedy_continuation(draft, contexts[0], 5)
    assert again[1].tokens == greedy_continuation(draft, contexts[2], 2)  # capped depth
    # a row that starts after the first proposal joins the draft's cache (the engine's rows join at any step)
    d.extend(0, [again[0].tokens[0], 9])
    d.extend(2, [13])
    contexts[0] = contexts[0] + [again[0].tokens[0], 9]
    contexts[2] = contexts[2] + [13]
    d.start(3, PROMPTS[1][:3])
    late = d.propose_batch([2, 3, -1, 0], [chain, chain, None, chain])
    assert late[0].tokens == greedy_continuation(draft, contexts[2], 5)
    assert late[1].tokens == greedy_continuation(draft, PROMPTS[1][:3], 5)
    assert late[2].tokens == []  # no draft asked for an id that is not a row
    assert late[3].tokens == greedy_continuation(draft, contexts[0], 5)
    d.cache.check_integrity()


def test_dynamic_tree_children_are_the_drafts_top_tokens(gqa_dir):
    draft = bmc.load(str(gqa_dir))
    d = ModelDrafter(draft, GREEDY)
    d.start(0, PROMPTS[0])
    prop = d.propose_batch([0], [TreeSpec.parse("dynamic:3x3")])[0]
    assert len(prop.tokens) == 9
    params = SamplingParams(temperature=1.0)  # plain softmax: the ranking the greedy drafter uses
    paths: dict[int, list[int]] = {-1: []}
    for i, (x, p) in enumerate(zip(prop.tokens, prop.parents)):
        assert p < i
        paths[i] = paths[p] + [x]
    root = target_probs(draft, params, PROMPTS[0])
    assert sorted(x for x, p in zip(prop.tokens, prop.parents) if p == -1) == sorted(root.topk(3).indices.tolist())
    for i, p in enumerate(prop.parents):
        if p >= 0:  # every deeper node is among its parent's top 3, siblings in rank order
            probs = target_probs(draft, params, PROMPTS[0] + paths[p])
            assert prop.tokens[i] in probs.topk(3).indices.tolist()
    for p in set(prop.parents):
        kids = [x for x, q in zip(prop.tokens, prop.parents) if q == p]
        probs = target_probs(draft, params, PROMPTS[0] + paths[p])
        assert [float(probs[x]) for x in kids] == sorted((float(probs[x]) for x in kids), reverse=True)


@pytest.mark.parametrize("kind", ["layers:1", "int8-self", "draft:other", "draft:same"])
def test_draft_model_greedy_is_identical_to_plain_greedy(gqa_dir, other_seed_dir, kind):
    model = bmc.load(str(gqa_dir))
    spec = {"draft:other": f"draft:{other_seed_dir}", "draft:same": f"draft:{gqa_dir}"}.get(kind, kind)
    for prompts in (PROMPTS[:1], PROMPTS):
        want = [c.token_ids for c in bmc.generate(model, prompts, max_new_tokens=24, ignore_eos=True)]
        for tree in ("chain:4", "dynamic:3x3", "static:8x3"):
            for extra in (dict(r=8), dict(r=5, spec_grow=True), dict(kv="iterative")):
                out = bmc.generate(model, prompts, max_new_tokens=24, ignore_eos=True, speculative=spec, tree=tree,
                                   **extra)
                assert [c.token_ids for c in out] == want, (tree, extra)
                sp = out.stats.speculative
                assert sp.drafted > 0
                if kind in ("draft:same", "int8-self") and tree == "chain:4":
                    assert sp.accepted >= 0.9 * sp.drafted  # (nearly) the target itself: its chain gets accepted
                if kind == "draft:other":
                    assert sp.accepted < 0.2 * sp.drafted  # unrelated weights: the rejection path is exercised


def test_draft_model_greedy_on_opt(tiny_dirs):
    model = bmc.load(str(tiny_dirs["opt-pre_norm"]))
    want = [c.token_ids for c in bmc.generate(model, PROMPTS, max_new_tokens=16, ignore_eos=True)]
    for spec in ("layers:1", "int8-self"):
        out = bmc.generate(model, PROMPTS, max_new_tokens=16, ignore_eos=True, speculative=spec, tree="dynamic:2x3")
        assert [c.token_ids for c in out] == want, spec


@pytest.mark.parametrize("kind,tree", [("layers:1", "dynamic:2x3"), ("int8-self", "dynamic:2x3"),
                                       ("int8-self", "static:6x3:0.5,0.3,0.1")])
def test_draft_model_sampling_has_the_target_distribution(gqa_dir, kind, tree):
    """Children drawn without replacement from the draft's distribution (q reported), verified by rejection."""
    model = bmc.load(str(gqa_dir))
    params = SamplingParams(temperature=0.05, top_k=3, seed=11)
    n_tokens, n_samples = 4, 2000
    _, joint = exact_tables(model, params, PROMPT, n_tokens)
    out = bmc.generate(model, [PROMPT], max_new_tokens=n_tokens, ignore_eos=True, temperature=params.temperature,
                       top_k=params.top_k, seed=params.seed, num_samples=n_samples, speculative=kind,
                       tree=tree, spec_grow=True)
    sp = out.stats.speculative
    assert 0 < sp.accepted < sp.drafted
    stat, crit = chi_square_ok([tuple(c.token_ids) for c in out], joint)
    assert stat < crit, (stat, crit)


def test_bad_draft_requests(gqa_dir, tmp_path):
    model = bmc.load(str(gqa_dir))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    small = save_tiny(tmp_path / "vocab300", transformers.LlamaForCausalLM(cfg).eval(), 300)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        bmc.generate(model, PROMPTS, max_new_tokens=4, speculative=f"draft:{small}")
    for bad, msg in (("layers:0", "N must be"), ("layers:x", "N must be"), ("layers:3", "has 2 layers"),
                     ("draft", "needs an argument"), ("int8-self:2", "takes no argument")):
        with pytest.raises(InvalidRequestError, match=msg):
            bmc.generate(model, PROMPTS, max_new_tokens=4, speculative=bad)
    with pytest.raises(bmc.ModelLoadError):
        bmc.generate(model, PROMPTS, max_new_tokens=4, speculative=f"draft:{tmp_path / 'missing'}")


def test_self_drafts_share_or_quantize_the_targets_weights(gqa_dir):
    model = bmc.load(str(gqa_dir))
    cut = truncate_layers(model, 1)
    assert cut.config.num_layers == 1 and cut.net.layers[0] is model.net.layers[0]
    assert cut.net.lm_head is model.net.lm_head and len(model.net.layers) == 2
    q = quantize_int8(model)
    if model.net.embed is not None:  # a table of its own stays (no copy); one read from the LM head's panels is copied
        assert q.net.embed is model.net.embed
    lin = model.net.layers[0].qkv
    assert isinstance(q.net.layers[0].qkv, Int8Linear) and model.net.layers[0].qkv is lin
    x = torch.randn(2, 3, lin.in_features)
    want = lin(x)
    got = q.net.layers[0].qkv(x)
    assert got.shape == want.shape
    assert float((got - want).norm() / want.norm()) < 0.02  # int8 weights and 7-bit activations: ~1% error


@pytest.mark.slow
def test_real_model_layers_draft_identical(real_model):
    text = "The quick brown fox jumps over the lazy dog. The quick brown fox"
    plain = bmc.generate(real_model, [text, "def fibonacci(n):"], max_new_tokens=24, ignore_eos=True)
    for tree in ("chain:4", "dynamic:3x4"):
        spec = bmc.generate(real_model, [text, "def fibonacci(n):"], max_new_tokens=24, ignore_eos=True,
                            speculative="layers:12", tree=tree)
        assert [c.token_ids for c in spec] == [c.token_ids for c in plain], tree
        assert spec.stats.speculative.accepted > 0
