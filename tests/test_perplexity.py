"""bmc.perplexity and bmc-perplexity against a direct computation with HF transformers: the same chunks, the
second half of each scored, BOS replacing each chunk's first token where the tokenizer adds one."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import bmc
from bmc.errors import InvalidRequestError

from .conftest import CORPUS, transformers  # noqa: F401

TEXT = " ".join(CORPUS) * 6


def hf_perplexity(model_dir, text: str, context: int) -> float:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = bmc.load(str(model_dir)).tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    bos = tok.encode("a")[0] if len(tok.encode("a")) > len(tok.encode("a", add_special_tokens=False)) else None
    nll, n = 0.0, 0
    with torch.inference_mode():
        for c in range(len(ids) // context):
            chunk = torch.tensor([ids[c * context : (c + 1) * context]])
            targets = chunk[0, context // 2 + 1 :].clone()
            if bos is not None:
                chunk[0, 0] = bos
            logp = torch.log_softmax(hf(chunk).logits[0, context // 2 : -1].double(), -1)
            nll -= float(logp.gather(-1, targets[:, None]).sum())
            n += len(targets)
    return math.exp(nll / n)


@pytest.mark.parametrize("batch", [1, 3])
def test_perplexity_equals_a_direct_computation_with_transformers(gqa_dir, batch):
    model = bmc.load(str(gqa_dir))
    seen = []
    res = bmc.perplexity(model, TEXT, context=32, batch=batch, progress=lambda d, n, p: seen.append((d, n)))
    want = hf_perplexity(gqa_dir, TEXT, 32)
    assert res.ppl == pytest.approx(want, rel=1e-4)
    n_chunks = len(model.tokenizer.encode(TEXT, add_special_tokens=False)) // 32
    assert res.chunks == n_chunks >= 4 and seen == [(i + 1, n_chunks) for i in range(n_chunks)]
    assert res.scored_tokens == n_chunks * (32 - 1 - 16) and 0 < res.ppl_stderr < res.ppl
    assert res.chunk_ppl[-1] == pytest.approx(res.ppl)


def test_bad_arguments(gqa_dir):
    model = bmc.load(str(gqa_dir))
    with pytest.raises(InvalidRequestError, match="at least one chunk"):
        bmc.perplexity(model, "too short", context=32)
    with pytest.raises(InvalidRequestError, match="context"):
        bmc.perplexity(model, TEXT, context=4)
    with pytest.raises(InvalidRequestError, match="context"):
        bmc.perplexity(model, TEXT, context=10**6)


def test_cli(gqa_dir, tmp_path):
    f = tmp_path / "text.txt"
    f.write_text(TEXT, encoding="utf-8")
    r = subprocess.run([sys.executable, "-m", "bmc.cli.perplexity", str(f), "--model", str(gqa_dir), "-c", "32",
                        "--chunks", "3", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    import json

    out = json.loads(r.stdout)
    assert out["chunks"] == 3 and out["ppl"] > 1 and "[3]" in r.stderr
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00abc")
    from .conftest import run_side_by_side

    cases = (([str(tmp_path / "bin.txt")], "not UTF-8"), ([str(tmp_path)], "directory"),
             ([str(tmp_path / "none.txt")], "cannot read"), ([str(f), "--chunks", "0"], "--chunks"))
    procs = run_side_by_side([[sys.executable, "-m", "bmc.cli.perplexity", *args, "--model", str(gqa_dir)]
                              for args, _ in cases])
    for (args, message), r in zip(cases, procs):
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_scored_chunk_keeps_only_its_last_logits():
    """A step scoring several chunks (-b 4) holds one chunk's [t, V] logits at a time: what the step keeps of a
    scored chunk is its last position's logits in storage of their own (a view kept all of them: Gemma 3's 262k
    vocabulary took perplexity -b 4 from 1.7 to 3.5 GB)."""
    from types import SimpleNamespace

    import torch

    from bmc.scheduler import Scheduler

    req = SimpleNamespace(prompt_logprobs=[], prompt_ids=[3, 1, 4, 1, 5, 9], next_logprobs=None, prompt_top=2,
                          prompt_top_logprobs=[])
    logits = torch.randn(1, 6, 50, generator=torch.Generator().manual_seed(0))
    last = Scheduler._score_prompt(SimpleNamespace(request=req, done=0), 6, logits)
    assert torch.equal(last, logits[:, -1]) and last.untyped_storage().nbytes() == 50 * 4
    lp = torch.log_softmax(logits[0], dim=-1)
    assert req.prompt_logprobs == pytest.approx([float(lp[i, req.prompt_ids[i + 1]]) for i in range(5)], abs=1e-6)
    assert torch.equal(req.next_logprobs, lp[-1])
    top = torch.topk(lp[:5], 2, dim=-1)  # the echo's alternatives: each scored position's two most likely tokens
    assert [[t for t, _ in pos] for pos in req.prompt_top_logprobs] == top.indices.tolist()


def test_a_scored_chunk_is_prefilled_in_rows_its_logits_budget_allows(gqa_dir, monkeypatch):
    """A scored prompt is prefilled SCORED_LOGITS_BYTES of logits at a time (8 bytes a row and vocabulary entry:
    the logits and their log-softmax), whatever --batch-size and --ctx-size ask (an eighth of the available memory
    where that is less): a 262k vocabulary at -c 512 holds 256 MiB, not 1 GiB, per chunk. The perplexity is the
    one computed from whole chunks."""
    from bmc import scheduler

    model = bmc.load(str(gqa_dir))
    whole = bmc.perplexity(model, TEXT, context=64, batch=3)
    V = model.config.vocab_size
    assert scheduler.scored_chunk_rows(262144) == 128 and scheduler.scored_chunk_rows(262144, 1 << 30) == 64
    assert scheduler.scored_chunk_rows(V, 0) == 16  # never fewer rows than 16
    monkeypatch.setattr(scheduler, "SCORED_LOGITS_BYTES", 8 * V * 20)  # 20 rows a scored chunk
    widths = []
    real = scheduler.Scheduler._chunk_part
    monkeypatch.setattr(scheduler.Scheduler, "_chunk_part", lambda self, p, t: widths.append(t) or real(self, p, t))
    small = bmc.perplexity(model, TEXT, context=64, batch=3)
    assert max(widths) == 20 and sum(widths) == small.chunks * 63
    assert small.ppl == pytest.approx(whole.ppl, rel=1e-6) and small.scored_tokens == whole.scored_tokens
