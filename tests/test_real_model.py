"""The embedded SmolLM2-135M-Instruct (GGUF, Q4_1 dequantized to float32) against HF transformers on the same file."""
from __future__ import annotations

import pytest
import torch

import bmc

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three primary colors and explain, in one sentence each, why they are called primary.",
]
NEW = 24


@pytest.fixture(scope="module")
def hf_reference(hf_real_model):
    """HF greedy tokens, one prompt at a time (no padding anywhere in the reference)."""
    model, tok = hf_real_model
    out = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        # eos_token_id=None: generate exactly NEW tokens without suppressing EOS (min_new_tokens would mask it)
        g = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append((ids[0].tolist(), g[0, ids.shape[1]:].tolist()))
    return out


def test_tokenization_matches_hf(real_model, hf_reference):
    assert [real_model.tokenizer.encode(p) for p in PROMPTS] == [ids for ids, _ in hf_reference]


def test_prefill_logits_match_hf(real_model, hf_real_model):
    model, tok = hf_real_model
    ids = tok(PROMPTS[3], return_tensors="pt").input_ids
    with torch.inference_mode():
        ref = model(ids).logits[0, -1]
    ours = bmc.generate(real_model, [ids[0].tolist()], max_new_tokens=1)
    ref_top = int(ref.argmax())
    assert ours[0].token_ids == [ref_top]
    from bmc.kv import BMCCache
    from bmc.attention import dense_attention

    cfg = real_model.config
    cache = BMCCache(r=16, num_layers=cfg.num_layers, batch_size=1, num_kv_heads=cfg.num_kv_heads,
                     head_dim=cfg.head_dim, max_length=ids.shape[1])
    with torch.inference_mode():
        cache.reserve(ids.shape[1])
        logits = real_model.net(ids, torch.arange(ids.shape[1])[None], cache, dense_attention,
                                cache.attention_bias(ids.shape[1]))
    torch.testing.assert_close(logits[0, -1], ref, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("kv", ["bmc", "iterative", "upfront"])
def test_batched_greedy_matches_hf_one_at_a_time(real_model, hf_reference, kv):
    out = bmc.generate(real_model, PROMPTS, max_new_tokens=NEW, ignore_eos=True, kv=kv, **({"T": 4} if kv == "bmc" else {}))
    for c, (_, expected) in zip(out, hf_reference):
        assert c.token_ids == expected, (kv, c.prompt_index, real_model.tokenizer.decode(c.token_ids))


def test_chat_template_and_eos(real_model):
    out = bmc.generate(real_model, ["What is the capital of France? Answer in one word."], max_new_tokens=40, chat=True)
    c = out[0]
    assert c.finish_reason == "stop" and c.token_ids[-1] in real_model.tokenizer.eos_token_ids
    assert "Paris" in c.text


@pytest.mark.slow
def test_token_bytes_rebuild_split_characters(real_model):
    """OpenAI's logprobs `bytes`: a token holding part of a UTF-8 character gives that part (the served chat
    logprobs use it), and a text's tokens' bytes put together are the text's UTF-8."""
    tok = real_model.tokenizer
    text = "héllo wörld 日本語 🙂 done\n  spaces"
    ids = tok.encode(text, add_special_tokens=False)
    parts = [tok.token_bytes(i) for i in ids]
    assert b"".join(parts) == text.encode("utf-8")
    assert any(not _is_utf8(p) for p in parts)  # some token splits a character: its bytes are not text alone


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
