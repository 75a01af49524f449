"""Mistral's sliding window against HF transformers: a tiny random MistralForCausalLM whose window (5) is far shorter
than the test lengths, on every cache strategy, batched with left padding, on the native step and the PyTorch path,
under speculative decoding, with several samples of a prompt and with SparQ at full rank; and the config checks."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import bmc
from bmc.attention import causal_attention, dense_attention
from bmc.engine import prefill_attention
from bmc.errors import ModelLoadError
from bmc.kv import KV_STRATEGIES
from bmc.models.config import ModelConfig

from .conftest import assert_chunked_logits_match_hf, hf, hf_greedy, save_tiny, transformers

WINDOW = 5
PROMPTS = [[5, 17, 33, 80, 101, 7, 9, 250, 12], [40, 41, 42], [300, 3, 99, 98, 97, 96, 14]]
CONFIGS = [dict(kv="iterative"), dict(kv="upfront"), dict(kv="bmc", r=1), dict(kv="bmc", r=3), dict(kv="bmc", r=64),
           dict(kv="bmc")]


def make_mistral(path: Path, window: int | None, kv_heads: int = 2, seed: int = 0, hidden: int = 48) -> Path:
    torch.manual_seed(seed)
    cfg = transformers.MistralConfig(vocab_size=320, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128,
                                     sliding_window=window, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return save_tiny(path, transformers.MistralForCausalLM(cfg).eval(), 320)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory) -> Path:
    return make_mistral(tmp_path_factory.mktemp("mistral-w5"), WINDOW)


@pytest.fixture(scope="module")
def hf_mistral(mistral_dir):
    return hf(mistral_dir)


def test_window_changes_the_reference(mistral_dir, hf_mistral, tmp_path):
    """The test model is one where the window matters: without it HF generates other tokens."""
    unwindowed = make_mistral(tmp_path / "nowin", None)
    ref_full = hf(unwindowed)
    assert hf_greedy(ref_full, PROMPTS, 16) != hf_greedy(hf_mistral, PROMPTS, 16)


@pytest.mark.parametrize("kv", list(KV_STRATEGIES))
@pytest.mark.parametrize("split", [3, 12])  # prefill shorter / longer than the window, then one token at a time
def test_logits_match_hf(mistral_dir, hf_mistral, kv, split):
    model = bmc.load(str(mistral_dir))
    ids = PROMPTS[0] + [11, 12, 13, 14, 15, 16, 18, 19]
    assert_chunked_logits_match_hf(model, hf_mistral, ids, kv, split, window=WINDOW)


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch"])
def test_greedy_batch_matches_hf_generate_on_every_cache(mistral_dir, hf_mistral, monkeypatch, native):
    monkeypatch.setenv("BMC_NATIVE", native)
    model, n = bmc.load(str(mistral_dir)), 16
    expected = hf_greedy(hf_mistral, PROMPTS, n)
    for kw in CONFIGS:
        out = bmc.generate(model, PROMPTS, max_new_tokens=n, ignore_eos=True, **kw)
        assert [c.token_ids for c in out] == expected, kw


@pytest.mark.parametrize("tree", ["chain:3", "dynamic:2x3"])
def test_speculative_greedy_matches_hf(mistral_dir, hf_mistral, tree):
    """Prompt-lookup drafts on a repetitive prompt (so trees are accepted and rows accept different counts,
    leaving holes where column and position differ) give HF's tokens."""
    model, n = bmc.load(str(mistral_dir)), 20
    prompts = [[7, 8, 9, 10, 7, 8, 9, 10, 7, 8], [20, 21, 20, 21, 20]]
    expected = hf_greedy(hf_mistral, prompts, n)
    for kv in ("bmc", "upfront", "iterative"):
        out = bmc.generate(model, prompts, max_new_tokens=n, ignore_eos=True, kv=kv, speculative="ngram", tree=tree)
        assert [c.token_ids for c in out] == expected, kv
        assert out.stats.speculative.accepted > 0, kv  # drafts were accepted: the window met moved columns


def test_samples_and_common_prefix_match_hf(mistral_dir, hf_mistral):
    """Several samples of a prompt and a long common prefix: a window the run passes keeps every row's own KV
    (a shared segment cannot take a per-row window), and the tokens stay HF's."""
    model, n = bmc.load(str(mistral_dir)), 12
    common = list(range(30, 50))
    prompts = [common + [5, 6], common + [7]]
    expected = hf_greedy(hf_mistral, prompts, n)
    out = bmc.generate(model, prompts, max_new_tokens=n, ignore_eos=True, num_samples=2)
    assert [c.token_ids for c in out] == [e for e in expected for _ in range(2)]
    assert out.stats.prefix_kv_bytes == 0 and out.stats.cached_prompt_tokens == 0


def test_sparq_at_full_rank_matches_hf(mistral_dir, hf_mistral):
    model, n = bmc.load(str(mistral_dir)), 14
    expected = hf_greedy(hf_mistral, PROMPTS, n)
    out = bmc.generate(model, PROMPTS, max_new_tokens=n, ignore_eos=True, attention="sparq",
                       sparq_r=model.config.head_dim, sparq_k=128)
    assert [c.token_ids for c in out] == expected


def test_window_out_of_reach_is_plain_causal(mistral_dir):
    """Within the window nothing is masked: the cache carries no window and the prefill stays causal."""
    model = bmc.load(str(mistral_dir))
    short = bmc.generate(model, [[3, 4]], max_new_tokens=2, ignore_eos=True)
    assert len(short[0].token_ids) == 2
    cache = KV_STRATEGIES["bmc"](num_layers=2, batch_size=1, num_kv_heads=2, head_dim=12, max_length=32, r=8,
                                 window=WINDOW)
    assert prefill_attention(dense_attention, cache, WINDOW) is causal_attention
    assert prefill_attention(dense_attention, cache, WINDOW + 1) is dense_attention
    with pytest.raises(ValueError, match="positions"):
        cache.reserve(3)


def test_config_reads_the_window_only_where_hf_does():
    base = dict(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    assert ModelConfig.from_hf(dict(base, model_type="mistral", sliding_window=7)).sliding_window == 7
    assert ModelConfig.from_hf(dict(base, model_type="mistral", sliding_window=None)).sliding_window is None
    assert ModelConfig.from_hf(dict(base, model_type="llama", sliding_window=7)).sliding_window is None  # HF ignores it
    for bad in (0, -3, 2.5, "4096", True):
        with pytest.raises(ModelLoadError, match="sliding_window"):
            ModelConfig.from_hf(dict(base, model_type="mistral", sliding_window=bad))


def test_integrity_names_a_column_back_inside_the_window():
    cache = KV_STRATEGIES["bmc"](num_layers=1, batch_size=2, num_kv_heads=1, head_dim=4, max_length=16, r=4,
                                 window=3, left_pad=[0, 2])
    cache.reserve(6, (torch.arange(6)[None] - torch.tensor([[0], [2]])).clamp(min=0))
    cache.commit(6)
    for p in (6, 7):
        cache.reserve(1, torch.tensor([[p], [p - 2]]))
        cache.commit(1)
    cache.check_integrity()
    # row 0's query at position 7 sees positions 5..7 only: columns 0..4 masked; row 1 (pad 2) sees 3..5
    assert (cache.bias[0, 0, 0, :8] == 0).tolist() == [False] * 5 + [True] * 3
    assert (cache.bias[1, 0, 0, :8] == 0).tolist() == [False] * 5 + [True] * 3
    cache.bias[0, ..., 1].fill_(0.0)
    with pytest.raises(AssertionError, match="left the sliding window"):
        cache.check_integrity()


@pytest.mark.parametrize("kv", ["bmc", "iterative", "upfront"])
def test_long_run_cache_stops_growing_past_the_window(mistral_dir, hf_mistral, kv):
    """60 tokens with a window of 5: the columns that left every row's window are left behind at each
    reallocation, so a BMC cache holds about window + r columns, not the run's length; tokens stay HF's."""
    model, n = bmc.load(str(mistral_dir)), 60
    expected = hf_greedy(hf_mistral, PROMPTS, n)
    out = bmc.generate(model, PROMPTS, max_new_tokens=n, ignore_eos=True, kv=kv, **({"r": 4} if kv == "bmc" else {}))
    assert [c.token_ids for c in out] == expected
    if kv != "upfront":  # upfront allocates the whole run at once and never reallocates
        longest = max(map(len, PROMPTS)) + n
        assert out.stats.peak_kv_bytes < 0.5 * longest * 2 * 2 * 12 * 4 * 2 * len(PROMPTS)


def test_dead_prefix_counts_columns_no_row_reads():
    cache = KV_STRATEGIES["bmc"](num_layers=1, batch_size=2, num_kv_heads=1, head_dim=4, max_length=64, r=4,
                                 window=3, left_pad=[0, 2])
    cache.reserve(6, (torch.arange(6)[None] - torch.tensor([[0], [2]])).clamp(min=0))
    cache.commit(6)
    assert cache.dead_prefix() == 0  # the kept bias holds the prefill's first query's window: nothing left yet
    cache.reserve(1, torch.tensor([[6], [4]]))  # queries at 6 and 4 read positions 4..6 and 2..4: column 4 on
    cache.commit(1)
    assert cache.dead_prefix() == 4
    assert cache.dead_prefix(torch.tensor([1])) == 4 and cache.dead_prefix(torch.tensor([0])) == 4
    for p in range(7, 14):
        cache.reserve(1, torch.tensor([[p], [p - 2]]))
        cache.commit(1)
        cache.check_integrity()
    # 14 columns written per row; reallocations at the chunk boundaries left the dead ones behind, and of what is
    # kept only the last 3 columns are read (both rows' queries sit at the last column)
    assert cache.length < 14 and cache.capacity <= 3 + 4 + 4
    assert cache.dead_prefix() == cache.length - 3


def test_quantized_window_model_native_equals_eager(tmp_path):
    """Mistral with its window and q8_0 weights (hidden 64): past the window, the native step and the PyTorch path
    give the same greedy tokens, every cache."""
    path = make_mistral(tmp_path / "q", WINDOW, hidden=64)
    model = bmc.load(str(path), quant="q8_0")
    assert model.config.sliding_window == WINDOW and {lin.quant for lin in model.linears()} == {"q8_0"}
    for kv in ("bmc", "iterative", "upfront"):
        native = [c.token_ids for c in bmc.generate(model, PROMPTS, max_new_tokens=16, ignore_eos=True, kv=kv)]
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("BMC_NATIVE", "0")
            eager = [c.token_ids for c in bmc.generate(model, PROMPTS, max_new_tokens=16, ignore_eos=True, kv=kv)]
        assert native == eager, kv


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "bfloat16"])
def test_window_on_every_layer_gives_served_requests_their_alone_logprobs_bit_for_bit(tmp_path, kv_dtype):
    """A window on every layer (Mistral, Phi-3): the cache drops the columns that left every row's window, so a row's
    first key can be gone, and each query's first open key is its own window's start; the attention counts a row's
    span and chunk grid from its position 0 all the same (dropped keys read as masked ones). A 300-token prompt
    past a window of 100 and a 60-token one joining two steps later, prefilled in chunks of a 40-token budget beside
    each other's decode rows at 2 threads, decode 40 tokens each with the log-probabilities of each run alone (whole
    prefill, 1 thread), bit for bit, over float32, int8 and bfloat16 KV; and the long prompt chunked alone gives its
    whole prefill's."""
    from bmc.scheduler import Scheduler

    from .test_scheduler import assert_chunked_equals_whole, assert_served_equals_alone

    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                     max_position_embeddings=1024, sliding_window=100, bos_token_id=1, eos_token_id=2,
                                     pad_token_id=0)
    model = bmc.load(str(save_tiny(tmp_path / "m", transformers.MistralForCausalLM(cfg).eval(), 320)))
    assert model.net.native_decoder() is not None and model.config.sliding_window == 100
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (300, 60)]
    if kv_dtype == "auto":
        assert_chunked_equals_whole(model, prompts[0], 40)
    sched = Scheduler(model, max_num_seqs=2, max_num_batched_tokens=40, kv_dtype=kv_dtype)
    assert_served_equals_alone(model, prompts, sched, {0: [0], 2: [1]}, 40, kv_dtype=kv_dtype)
