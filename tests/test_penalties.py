"""logit_bias and the presence, frequency and repetition penalties: the formula element by element, generate()'s
greedy tokens against a reference loop over HF's logits, rows of one request and requests of one batch kept apart,
and bad values refused by name."""
from __future__ import annotations

import pytest
import torch

import bmc
from bmc.errors import InvalidRequestError
from bmc.sampling import SamplingParams, adjust_logits

from .conftest import hf

PROMPTS = [[5, 17, 33, 80, 101, 7, 9, 5, 17, 33], [40, 41, 42, 40, 41]]
PENALTIES = dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3)


def reference_adjust(logits: list[float], params: SamplingParams, prompt: list[int], out: list[int]) -> list[float]:
    """The definitions, one token at a time: OpenAI's logit_bias, vLLM's repetition penalty over prompt and output,
    OpenAI's frequency and presence penalties over the output."""
    adjusted = list(logits)
    for t, b in params.logit_bias:
        adjusted[t] += b
    for t in range(len(adjusted)):
        if t in prompt or t in out:
            rp = params.repetition_penalty
            adjusted[t] = adjusted[t] / rp if adjusted[t] > 0 else adjusted[t] * rp
        c = out.count(t)
        adjusted[t] -= c * params.frequency_penalty + (c > 0) * params.presence_penalty
    return adjusted


def test_adjust_logits_is_the_definition_element_by_element():
    torch.manual_seed(0)
    V = 40
    params = SamplingParams(logit_bias=((3, -100.0), (7, 2.5), (3, 1.0)), **PENALTIES)
    prompt, outs = [1, 2, 3, 9], [[4, 4, 5], [9, 9, 9, 2]]
    logits = torch.randn(2, V) * 3
    counts = torch.zeros(2, V)
    for r, out in enumerate(outs):
        for t in out:
            counts[r, t] += 1
    seen = torch.zeros(V, dtype=torch.bool)
    seen[prompt] = True
    got = adjust_logits(logits, params, counts, seen)
    for r, out in enumerate(outs):
        want = reference_adjust(logits[r].tolist(), params, prompt, out)
        torch.testing.assert_close(got[r], torch.tensor(want), atol=1e-5, rtol=1e-6)
    assert not torch.equal(got, logits)


def reference_greedy(ref, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    """Greedy decoding with the adjustments applied to HF's logits (one full forward per token, no cache)."""
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            logits = ref(torch.tensor([prompt + out])).logits[0, -1].float().tolist()
            adjusted = reference_adjust(logits, params, prompt, out)
            out.append(max(range(len(adjusted)), key=adjusted.__getitem__))
    return out


@pytest.mark.parametrize("kw", [PENALTIES, dict(presence_penalty=-1.5), dict(frequency_penalty=2.0),
                                dict(repetition_penalty=0.8)], ids=["all", "presence<0", "frequency", "rp<1"])
def test_greedy_with_penalties_equals_the_reference_loop(gqa_dir, kw):
    model, ref = bmc.load(str(gqa_dir)), hf(gqa_dir)
    n = 24
    plain = bmc.generate(model, PROMPTS, max_new_tokens=n, ignore_eos=True)
    got = bmc.generate(model, PROMPTS, max_new_tokens=n, ignore_eos=True, **kw)
    params = SamplingParams(**kw)
    want = [reference_greedy(ref, p, n, params) for p in PROMPTS]
    assert [c.token_ids for c in got] == want
    assert [c.token_ids for c in got] != [c.token_ids for c in plain]  # the penalties did change the output


def test_logit_bias_bans_and_forces_tokens(gqa_dir):
    model = bmc.load(str(gqa_dir))
    plain = bmc.generate(model, PROMPTS, max_new_tokens=12, ignore_eos=True)
    banned = {t: -100.0 for c in plain for t in c.token_ids[:3]}
    got = bmc.generate(model, PROMPTS, max_new_tokens=12, ignore_eos=True, logit_bias=banned)
    assert all(t not in banned for c in got for t in c.token_ids)
    forced = bmc.generate(model, PROMPTS, max_new_tokens=5, ignore_eos=True, logit_bias={250: 100.0})
    assert [c.token_ids for c in forced] == [[250] * 5] * 2


def test_a_penalized_request_leaves_the_others_alone(gqa_dir):
    """Through one scheduler: a plain request beside a penalized one gives its tokens alone, the penalized one
    its own; each sample of a penalized request counts its own tokens (two greedy samples stay equal)."""
    from bmc.engine import GenerationConfig
    from bmc.scheduler import Request, Scheduler

    model = bmc.load(str(gqa_dir))
    alone = [bmc.generate(model, [p], max_new_tokens=16, ignore_eos=True, **kw)[0].token_ids
             for p, kw in ((PROMPTS[0], {}), (PROMPTS[1], PENALTIES))]
    sched = Scheduler(model, max_num_seqs=4, max_length=64)
    got: dict[int, dict[int, list[int]]] = {0: {}, 1: {}}
    for j, (p, kw) in enumerate(((PROMPTS[0], {}), (PROMPTS[1], PENALTIES))):
        gen = GenerationConfig(max_new_tokens=16, ignore_eos=True, num_samples=2, sampling=SamplingParams(**kw))
        sched.add(Request(p, gen, lambda ev, j=j: got[j].setdefault(ev.sample_index, []).append(ev.token_id)))
    for _ in range(200):
        sched.step()
        if not sched.has_work():
            break
    assert got[0] == {0: alone[0], 1: alone[0]} and got[1] == {0: alone[1], 1: alone[1]}


def test_penalized_rows_do_not_speculate_and_give_the_same_tokens(gqa_dir):
    model = bmc.load(str(gqa_dir))
    kw = dict(max_new_tokens=20, ignore_eos=True, **PENALTIES)
    plain = bmc.generate(model, PROMPTS, **kw)
    spec = bmc.generate(model, PROMPTS, speculative="ngram", tree="chain:3", **kw)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]


def test_sampled_rows_are_each_penalized_by_their_own_tokens(gqa_dir, monkeypatch):
    """Samples of one request differ; every adjustment reads, for each row, the counts of that row's own tokens
    so far (seen through the adjustment's arguments), and a seeded run repeats."""
    import bmc.scheduler

    model = bmc.load(str(gqa_dir))
    kw = dict(max_new_tokens=16, ignore_eos=True, temperature=1.5, seed=7, num_samples=3, **PENALTIES)
    calls: list[torch.Tensor] = []

    def recorded(logits, params, counts, prompt_seen):
        calls.append(counts.clone())
        return adjust_logits(logits, params, counts, prompt_seen)

    monkeypatch.setattr(bmc.scheduler, "adjust_logits", recorded)
    a = bmc.generate(model, PROMPTS[:1], **kw)
    samples = [c.token_ids for c in a]
    assert len(set(map(tuple, samples))) > 1
    assert len(calls) == 16  # one adjustment of the request's 3 rows per token
    V = model.config.vocab_size
    for step, counts in enumerate(calls):
        want = torch.stack([torch.bincount(torch.tensor(s[:step], dtype=torch.long), minlength=V).float()
                            for s in samples])
        assert torch.equal(counts, want), step
    b = bmc.generate(model, PROMPTS[:1], **kw)
    assert [c.token_ids for c in b] == samples
    assert all(0 <= t < V for s in samples for t in s)


@pytest.mark.parametrize("kw, field", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(logit_bias={5: 101.0}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"), (dict(logit_bias=[5]), "logit_bias"),
    (dict(logit_bias={100000: 1.0}), "logit_bias")])
def test_bad_values_are_refused_by_name(gqa_dir, kw, field):
    model = bmc.load(str(gqa_dir))
    with pytest.raises(InvalidRequestError, match=field):
        bmc.generate(model, PROMPTS, max_new_tokens=2, **kw)
