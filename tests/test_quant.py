"""Quantized weights: GGUF's Q8_0 / Q4_0 / Q4_1 blocks kept as stored (quant="gguf") and q8_0 / q4_0 made at load.

The claim under test: a quantized matrix computes with exactly the float32 weights the `gguf` package dequantizes
it to, so quant="gguf" gives quant="none"'s greedy tokens (and its logits within float32 rounding); our
quantizers write the bytes llama.cpp's reference quantizers (as the `gguf` package implements them) write."""
from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

import bmc
from bmc.errors import BmcError
from bmc.kernels.native import native_module, native_supported
from bmc.models.quant import QuantWeight, quantize

from .conftest import make_llama, require_real_model, skip_unless_isa, transformers  # noqa: F401
from .test_gguf import LAYER_PLAN, Q, _write

pytestmark = pytest.mark.skipif(not native_supported(torch.device("cpu"), torch.float32),
                                reason="quantized weights run on the native CPU step")
KINDS = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1}
HALF_TYPES = {"f16": Q.F16, "bf16": Q.BF16}


def random_blocks(kind: str, shape: tuple[int, int], seed: int = 0) -> QuantWeight:
    x = (np.random.default_rng(seed).standard_normal(shape) * 0.05).astype(np.float32)
    return QuantWeight(kind, shape, gguf.quants.quantize(x, KINDS[kind]))


@pytest.mark.parametrize("kind", KINDS)
def test_panels_dequantize_to_what_gguf_dequantizes(kind):
    w = random_blocks(kind, (50, 96))  # 50 outputs: a partial last panel
    lin = bmc.models.ops.Linear(w)
    assert lin.quant == kind and lin.wt is None
    assert torch.equal(lin.dense_weight(), w.dequantize().t())  # bit for bit
    ids = torch.tensor([0, 7, 16, 49])
    assert torch.equal(native_module().quant_rows(lin.native_weight(), 96, ids), w.dequantize()[ids])


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_quantize_writes_the_reference_quantizers_bytes(kind):
    x = torch.randn(40, 128) * 0.1
    x[3, :32] = 0.0  # an all-zero block: scale 0
    x[5, 7] = 2.5  # a block whose largest value is exact
    np.testing.assert_array_equal(quantize(x, kind).blocks, gguf.quants.quantize(x.numpy(), KINDS[kind]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 8, 9, 13, 40])
def test_quantized_gemm_equals_the_float_gemm_on_the_dequantized_weights(kind, rows):
    w = random_blocks(kind, (50, 96), seed=rows)
    lin = bmc.models.ops.Linear(w, torch.randn(50))
    x = torch.randn(rows, 96)
    want = x @ w.dequantize().t() + lin.b
    got = lin(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    packed = native_module().pack_panels(w.dequantize().t().contiguous())  # the float kernels, same panel values
    torch.testing.assert_close(got, native_module().panel_linear(x, native_module().Weight(packed), 50, lin.b), rtol=1e-6, atol=1e-6)


def uniform_plan(qtype) -> list:
    return [(g, h, qtype if not g.endswith("norm") else Q.F32) for g, h, _ in LAYER_PLAN]


@pytest.mark.parametrize("kind", [*KINDS, *HALF_TYPES])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gguf_blocks_kept_give_the_dequantized_models_tokens(tmp_path, kind, tied):
    path = str(tmp_path / f"{kind}.gguf")
    qtype = {**KINDS, **HALF_TYPES}[kind]
    _write(path, tied=tied, plan=uniform_plan(qtype), embed_type=qtype)
    # quant auto: gguf on a CPU in float32; float activations (a BF16 file's default, "auto", prefills in bfloat16)
    mq, mf = bmc.load(path, activations="float"), bmc.load(path, quant="none")
    assert mq.quant == "gguf" and mf.quant == "none"
    for lq, lf in zip([lin for lin in mq.linears() if lin is not mq.net.embed_q], mf.linears()):
        if lq.quant is not None:
            assert torch.equal(lq.dense_weight(), lf.dense_weight())
    assert sum(lq.quant is not None for lq in mq.linears()) == 4 * 2 + 1 + (not tied)  # every layer matrix and the
    # head (tied: the table in the file's type; untied: output.weight, F16 in these files, and the table on its own)
    if not tied:  # the table kept in the file's type too, its rows dequantized as looked up: gguf's values
        assert mq.net.embed is None and mq.net.embed_q.quant == kind
        ids = torch.tensor([0, 5, 17, 99])
        assert torch.equal(mq.net.embed_q.rows(ids), mf.net.embed[ids])
    assert mq.weight_bytes < 0.6 * mf.weight_bytes  # the matrices 3.8-6.4x smaller; norms and an untied table not
    prompts = [[5, 6, 7, 8, 9] * 3, [40, 41, 42], [100, 3, 99, 98, 97, 96]]
    a = bmc.generate(mq, prompts, max_new_tokens=24, ignore_eos=True)
    b = bmc.generate(mf, prompts, max_new_tokens=24, ignore_eos=True)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    spec = bmc.generate(mq, prompts, max_new_tokens=24, ignore_eos=True, speculative="ngram")
    assert [c.token_ids for c in spec] == [c.token_ids for c in b]


def test_an_untied_quantized_table_stays_quantized_in_the_weights_cache(tmp_path, monkeypatch):
    """An untied token_embd in Q8_0 (Qwen2.5's Q5_0 is widened to Q8_0 blocks) is written to the weights cache as
    its blocks, not as float32 (4x the bytes), and the mapped model gives the float model's tokens."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = str(tmp_path / "untied.gguf")
    _write(path, tied=False, plan=uniform_plan(Q.Q8_0), embed_type=Q.Q8_0)
    mf = bmc.load(path, quant="none")
    bmc.load(path, share_weights=True)  # writes the weight file
    again = bmc.load(path, share_weights=True)  # built from it: nothing dequantized
    assert getattr(again, "weight_file", None) and again.net.embed is None and again.net.embed_q.quant == "q8_0"
    table = again.net.embed_q.panels
    assert table.dtype == torch.int8 and table.numel() < 0.3 * mf.net.embed.numel() * 4  # bytes: ~34/32 a value
    assert table.untyped_storage().nbytes() == os.path.getsize(again.weight_file)  # a view of the mapping
    prompts = [[5, 6, 7, 8, 9] * 3, [40, 41, 42]]
    want = [c.token_ids for c in bmc.generate(mf, prompts, max_new_tokens=16, ignore_eos=True)]
    assert [c.token_ids for c in bmc.generate(again, prompts, max_new_tokens=16, ignore_eos=True)] == want
    int8 = bmc.models.derive.quantize_int8(again)  # the int8-self draft: a float copy of this table, not the head's
    assert torch.equal(int8.net.embed, mf.net.embed) and int8.net.embed_q is None


def test_q4_panels_hold_fp16_scales_exactly():
    """Q4_1 panels keep d and m in fp16 (q4h: 320 bytes a block-panel), Q4_0 panels d alone with the offset -8 d
    implied (q4z: 288 bytes, the file's 18 a block): exact, since GGUF stores them so, at every row count's kernel
    and with int8 activations' offsets; a Q4_0 scale whose -8 d passes fp16's range is held too (nothing stores it)."""
    for kind, width in (("q4_1", 320), ("q4_0", 288)):
        w = random_blocks(kind, (40, 64))
        assert tuple(w.panels().shape) == (3, 2, width) and w.panels().dtype == torch.uint8
        lin = bmc.models.ops.Linear(w)
        assert torch.equal(lin.dense_weight(), w.dequantize().t())
        for m in (1, 3, 6, 9, 40):  # the 1-4 row, 5-8 row and blocked kernels: d q + m as the float weights
            x = torch.randn(m, 64)
            torch.testing.assert_close(lin(x), x @ w.dequantize().t(), rtol=1e-5, atol=1e-5)
    big = w.blocks.copy()
    big[0, 0:2] = np.frombuffer(np.float16(9000.0).tobytes(), np.uint8)  # d = 9000: -8 d = -72000
    big_w = QuantWeight("q4_0", (40, 64), big)
    assert torch.equal(bmc.models.ops.Linear(big_w).dense_weight(), big_w.dequantize().t())


@pytest.mark.parametrize("kind", HALF_TYPES)
def test_16_bit_float_panels_compute_the_float_gemm_bit_for_bit(kind):
    """F16 / BF16 matrices kept as stored: gguf's values, and the native GEMM (widening each weight as it is
    loaded) equals the float32 panels' GEMM exactly at every row count's kernel (1-4, 5-8, blocked)."""
    N, K = 50, 96
    x = (np.random.default_rng(3).standard_normal((N, K)) * 0.05).astype(np.float32)
    w = QuantWeight(kind, (N, K), gguf.quants.quantize(x, HALF_TYPES[kind]).reshape(N, -1).view(np.uint8))
    want = torch.from_numpy(gguf.quants.dequantize(w.blocks, HALF_TYPES[kind]).astype(np.float32)).view(N, K)
    assert torch.equal(w.dequantize(), want) and 0 < (want - torch.from_numpy(x)).abs().max() < 1e-3
    lin = bmc.models.ops.Linear(w, torch.randn(N))
    assert lin.quant == kind and lin.panels.dtype == {"f16": torch.float16, "bf16": torch.bfloat16}[kind]
    assert torch.equal(lin.dense_weight(), want.t()) and torch.equal(lin.rows(torch.tensor([0, 17, 49])), want[[0, 17, 49]])
    packed = native_module().pack_panels(want.t().contiguous())
    for rows in (1, 3, 4, 5, 8, 9, 17, 33):
        xs = torch.randn(rows, K)
        assert torch.equal(lin(xs), native_module().panel_linear(xs, native_module().Weight(packed), N, lin.b, False)), rows
    q8 = random_blocks("q8_0", (16, K))
    assert not QuantWeight.can_cat([w, q8]) and QuantWeight.can_cat([w, w]) and QuantWeight.can_cat([q8, q8])


def test_mixed_types_and_the_weights_cache(tmp_path, monkeypatch):
    """LAYER_PLAN mixes float types (F16, BF16) with quantized ones within q|k|v and gate|up: those fused matrices
    are dequantized (float), the others kept; a weights-cache round trip maps the quantized panels and computes the same."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = str(tmp_path / "mixed.gguf")
    _write(path)
    mq, mf = bmc.load(path), bmc.load(path, quant="none")
    kinds = {name: getattr(mq.net.layers[0], name).quant for name in ("qkv", "o", "gate_up", "down")}
    assert kinds == {"qkv": None, "o": "q4_1", "gate_up": None, "down": "f16"}
    shared = bmc.load(path, share_weights=True)
    again = bmc.load(path, share_weights=True)  # built from the weight file: no dequantization
    assert getattr(again, "weight_file", None) and again.net.layers[0].o.quant == "q4_1"
    want = bmc.generate(mf, [[5, 6, 7]], max_new_tokens=16, ignore_eos=True)[0].token_ids
    for m in (mq, shared, again):
        assert bmc.generate(m, [[5, 6, 7]], max_new_tokens=16, ignore_eos=True)[0].token_ids == want


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_quantize_at_load_an_hf_directory(tmp_path, kind):
    """quant='q8_0' / 'q4_0' on an HF directory: every GEMM matrix holds what quantize() makes of it (the
    reference quantizer's bytes), and the model runs: the eager and native paths agree."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    m = bmc.load(str(tmp_path), quant=kind)
    assert m.quant == kind and all(lin.quant == kind for lin in m.linears())
    down = hf.model.layers[1].mlp.down_proj.weight.detach()
    assert torch.equal(m.net.layers[1].down.dense_weight(), quantize(down, kind).dequantize().t())
    out = bmc.generate(m, [[5, 6, 7, 8]], max_new_tokens=12, ignore_eos=True)[0].token_ids
    with pytest.MonkeyPatch.context() as mp:  # the same weights through the eager path (Linear -> panel_linear)
        mp.setenv("BMC_NATIVE", "0")
        eager = bmc.generate(m, [[5, 6, 7, 8]], max_new_tokens=12, ignore_eos=True)[0].token_ids
    assert out == eager and len(out) == 12


def test_refused_where_it_cannot_run(tmp_path, gqa_dir, monkeypatch):
    """Refused by name: a quant that needs a GGUF file, an unknown one, a matrix that is not whole blocks. (Where
    the native step does not run, an explicit quant runs on torch ops: test_torch_ops_path_*.)"""
    with pytest.raises(BmcError, match="not a GGUF file"):
        bmc.load(str(gqa_dir), quant="gguf")
    with pytest.raises(BmcError, match="unknown quant"):
        bmc.load(str(gqa_dir), quant="q3_k")
    with pytest.raises(BmcError, match="whole blocks of 32"):  # the tiny GQA model's hidden size is 48
        bmc.load(str(gqa_dir), quant="q8_0")
    monkeypatch.setenv("BMC_NATIVE", "0")
    path = str(tmp_path / "m.gguf")
    _write(path, plan=uniform_plan(Q.Q8_0))
    assert bmc.load(path).quant == "none"  # auto without the native step: dequantized, as before


def test_cli_flag(tmp_path, capsys):
    """--quant and --activations from the command line (the CLI's own main, in this process): a run, and bad
    values refused in one line with exit 2."""
    from bmc.cli.generate import main

    path = str(tmp_path / "m.gguf")
    _write(path, plan=uniform_plan(Q.Q4_1))
    common = ["--model", path, "--no-weights-cache", "-t", str(torch.get_num_threads()), "--max-new-tokens", "4"]
    main([*common, "--quant", "gguf", "hello"])
    assert capsys.readouterr().out.strip()
    if native_module().has_int8_dot():
        main([*common, "--activations", "int8", "hello"])
        assert capsys.readouterr().out.strip()
    for args, message in ((["--quant", "int3", "hi"], "--quant"),
                          ([*common, "--quant", "none", "--activations", "int8", "hi"], "activations='int8'")):
        with pytest.raises(SystemExit) as e:
            main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_default_model_as_stored_gives_the_float_models_tokens(real_model):
    path = require_real_model()
    mq, mf = bmc.load(path, quant="gguf"), bmc.load(path, quant="none")
    assert real_model.quant == "gguf"  # the default
    assert mq.weight_bytes < 120e6 < 500e6 < mf.weight_bytes
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "List three prime numbers:"]
    a = bmc.generate(mq, prompts, max_new_tokens=32)
    b = bmc.generate(mf, prompts, max_new_tokens=32)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


LOAD_RSS = """
import gc, sys, torch
import bmc.kernels.native as kn
kn.native_module()  # the runtime: torch and the kernel, before the model
def rss():
    with open("/proc/self/status") as f:
        d = dict(line.split(":", 1) for line in f)
    return int(d["VmRSS"].split()[0]) * 1024, int(d["VmHWM"].split()[0]) * 1024
base = rss()[0]
import bmc
from bmc.models import trim_heap
m = bmc.load(quant=sys.argv[1], share_weights=False)
now, peak = rss()
weights, tokenizer = m.weight_bytes, m.tokenizer
del m
gc.collect()
trim_heap()
print(weights, now - base, peak - base, rss()[0] - base)
"""


@pytest.mark.slow
def test_the_default_model_as_stored_is_resident_once():
    """Loaded as stored, the default model costs its quantized weights (~106 MiB) plus its tokenizer above the bare
    runtime, not the 1.1 GB of fp32 weights and panels: resident <= 250 MB above the runtime after the load. And the
    load streams (issue 28's peak target): each matrix is re-laid into panels a slice of rows at a time, dropping
    the GGUF file's mapped pages as it goes, so the peak above what stays without the model (the runtime and the
    tokenizer, ~26 MiB) is <= 1.2x the weights, plus 16 MiB of allocator slack (measured here: 1.21x, no slack
    used: 381 MiB peak, 253 without the model; before the streaming load the peak was 526 MiB)."""
    from .conftest import require_real_model

    require_real_model()
    out = subprocess.run([sys.executable, "-c", LOAD_RSS, "gguf"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    weights, resident, peak, without_model = (int(x) for x in out.stdout.split())
    assert weights < 120e6 and resident <= 250e6, (weights, resident)
    assert peak - without_model <= 1.2 * weights + 16 * 2**20, (weights, peak, without_model)


def test_opt_quantized_at_load(tmp_path):
    """OPT (pre-norm, tied embeddings) with q8_0: every matrix quantized, the tied table looked up in the LM head's
    panels, native and eager paths agree."""
    torch.manual_seed(0)
    cfg = transformers.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                 vocab_size=320, max_position_embeddings=256, word_embed_proj_dim=64)
    hf = transformers.OPTForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    m = bmc.load(str(tmp_path), quant="q8_0")
    assert m.net.embed is None and all(lin.quant == "q8_0" for lin in m.linears())
    table = hf.model.decoder.embed_tokens.weight.detach()
    ids = torch.tensor([[3, 17, 319]])
    assert torch.equal(m.net.embed_tokens(ids)[0], quantize(table, "q8_0").dequantize()[ids[0]])
    out = bmc.generate(m, [[5, 6, 7, 8]], max_new_tokens=10, ignore_eos=True)[0].token_ids
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BMC_NATIVE", "0")
        assert bmc.generate(m, [[5, 6, 7, 8]], max_new_tokens=10, ignore_eos=True)[0].token_ids == out


K_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}
K_TYPES = {"q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K, **KINDS}


def random_kquant(kind: str, n: int, k: int, seed: int = 0, d: tuple[float, float] = (0.001, 0.01)) -> np.ndarray:
    """Valid K-quant super-blocks with random quants, scales and mins (gguf cannot quantize them): [n, k/256*bytes].
    Every bit pattern is a valid block once its fp16 scales are finite; their range `d` sets the weights' size
    (the default makes weights of ~1, which a model's activations cannot take: models use MODEL_D)."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n, k // 256, K_BYTES[kind]), dtype=np.uint8)
    scale = lambda: rng.uniform(*d, (n, k // 256)).astype(np.float16).view(np.uint8).reshape(n, k // 256, 2)
    if kind == "q6_k":  # ql, qh, 16 int8 scales, then d
        b[..., 208:210] = scale()
    else:  # d, dmin, then the packed scales and mins
        b[..., 0:2], b[..., 2:4] = scale(), scale()
    return b.reshape(n, -1)


MODEL_D = (6.2e-5, 1.2e-4)  # fp16 super-block scales that give weights of ~0.03-0.1: a model's sane activations


def random_matrix(kind: str, n: int, k: int, seed: int = 0, d: tuple[float, float] = (0.001, 0.01)) -> QuantWeight:
    if kind in K_BYTES:
        return QuantWeight(kind, (n, k), random_kquant(kind, n, k, seed, d))
    x = (np.random.default_rng(seed).standard_normal((n, k)) * 0.05).astype(np.float32)
    return QuantWeight(kind, (n, k), gguf.quants.quantize(x, K_TYPES[kind]))


MIXED = ["q4_k", "q6_k", "q5_k", "q8_0"]  # a Q4_K_M file's fused q|k|v can be Q4_K, Q4_K and Q6_K


@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k", "mixed"])
def test_k_quant_panels_dequantize_to_what_gguf_dequantizes(kind):
    """Q4_K as Q4 panels; Q5_K, Q6_K and a fused matrix of parts in different types as Q8X panels: bit for bit."""
    if kind == "mixed":
        w = QuantWeight.cat([random_matrix(t, n, 512, i) for i, (t, n) in enumerate(zip(MIXED, (32, 24, 8, 17)))])
    else:
        w = random_matrix(kind, 50, 512)  # 50 outputs: a partial last panel
    lin = bmc.models.ops.Linear(w)
    assert lin.quant == kind and lin.wt is None
    assert lin.panels.dtype == (torch.uint8 if kind == "q4_k" else torch.int8)
    assert lin.panels.shape[-1] == (384 if kind == "q4_k" else 704)
    assert torch.equal(lin.dense_weight(), w.dequantize().t())
    ids = torch.tensor([0, 7, 16, 31, 32, 49])
    assert torch.equal(native_module().quant_rows(lin.native_weight(), 512, ids), w.dequantize()[ids])


@pytest.mark.parametrize("kind", ["q5_k", "q6_k", "mixed"])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 7, 8, 9, 40])
def test_q8x_gemm_equals_the_float_gemm_on_the_dequantized_weights(kind, rows):
    """Every path of the Q8X GEMM (1-4 rows: scales applied per half block; 5-8: dequantized in registers; more:
    into a buffer): within float32 rounding of the GEMM over gguf's dequantized weights. The K-quants' random
    scales make weights of ~1, so the bound is relative to the sum of |x w|."""
    if kind == "mixed":
        w = QuantWeight.cat([random_matrix(t, n, 512, rows + i) for i, (t, n) in enumerate(zip(MIXED, (16, 8, 9, 17)))])
    else:
        w = random_matrix(kind, 50, 512, seed=rows)
    b = torch.randn(w.shape[0])
    lin = bmc.models.ops.Linear(w, b)
    x = torch.randn(rows, 512)
    dense = w.dequantize().double()
    want = x.double() @ dense.t() + b.double()
    scale = x.double().abs() @ dense.abs().t() + b.double().abs()
    err = (lin(x).double() - want).abs()
    assert (err <= 2e-6 * scale).all(), (err / scale).max()
    assert err.max() > 0 or rows == 1  # the comparison is live: float32 sums of 512 terms round somewhere


def _write_llama_gguf(path: str, plan: dict[str, str], D: int = 256, I: int = 512, V: int = 300, L: int = 2) -> None:
    """A llama GGUF whose matrices are random blocks of the types `plan` names (per tensor kind; token_embd too)."""
    w = gguf.GGUFWriter(path, "llama")
    for add, v in ((w.add_block_count, L), (w.add_context_length, 256), (w.add_embedding_length, D),
                   (w.add_feed_forward_length, I), (w.add_head_count, 4), (w.add_head_count_kv, 2),
                   (w.add_layer_norm_rms_eps, 1e-6), (w.add_rope_freq_base, 10000.0), (w.add_vocab_size, V)):
        add(v)
    seed = iter(range(100))

    def add(name: str, kind: str, n: int, k: int) -> None:
        w.add_tensor(name, random_matrix(kind, n, k, next(seed), MODEL_D).blocks, raw_dtype=K_TYPES[kind])

    add("token_embd.weight", plan["token_embd"], V, D)
    w.add_tensor("output_norm.weight", np.ones(D, np.float32))
    shapes = {"attn_q": (D, D), "attn_k": (128, D), "attn_v": (128, D), "attn_output": (D, D), "ffn_gate": (I, D),
              "ffn_up": (I, D), "ffn_down": (D, I)}
    for i in range(L):
        for name, (n, k) in shapes.items():
            add(f"blk.{i}.{name}.weight", plan.get(name, plan["default"]), n, k)
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", np.ones(D, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


PLANS = {
    "q4_k": ({"default": "q4_k", "token_embd": "q4_k"}, {"q4_k"}),
    # llama.cpp's Q4_K_M: Q6_K for attn_v, ffn_down and the output; Q5_K_M: Q5_K, with Q6_K in the same places
    "q4_k_m": ({"default": "q4_k", "token_embd": "q6_k", "attn_v": "q6_k", "ffn_down": "q6_k"},
               {"q4_k", "q6_k", "mixed"}),
    "q5_k_m": ({"default": "q5_k", "token_embd": "q6_k", "attn_v": "q6_k", "ffn_down": "q6_k", "ffn_up": "q8_0"},
               {"q5_k", "q6_k", "mixed"}),
}


@pytest.mark.parametrize("plan", PLANS)
def test_a_k_quant_gguf_runs_as_stored(tmp_path, plan, monkeypatch):
    """A llama GGUF of K-quants, mixed as llama.cpp's _M files mix them: every matrix kept as stored (a fused
    q|k|v or gate|up of parts in different types as one Q8X matrix), the tokens of the same file dequantized, also
    from the weights cache's mapped panels."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = str(tmp_path / f"{plan}.gguf")
    types, kinds = PLANS[plan]
    _write_llama_gguf(path, types)
    mq, mf = bmc.load(path), bmc.load(path, quant="none")
    assert {lin.quant for lin in mq.linears()} == kinds and mq.net.embed is None
    prompts = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45]]
    from bmc.parallel.tp import prompt_logits

    with torch.inference_mode():  # sane weights: finite logits, so equal tokens say something
        assert torch.isfinite(prompt_logits(mf, prompts[1])).all()
    a = bmc.generate(mq, prompts, max_new_tokens=12, ignore_eos=True)
    b = bmc.generate(mf, prompts, max_new_tokens=12, ignore_eos=True)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    bmc.load(path, share_weights=True)  # writes the weight file
    again = bmc.load(path, share_weights=True)  # built from it
    assert getattr(again, "weight_file", None) and {lin.quant for lin in again.linears()} == kinds
    c = bmc.generate(again, prompts, max_new_tokens=12, ignore_eos=True)
    assert [x.token_ids for x in c] == [x.token_ids for x in b]


@pytest.mark.parametrize("kind", ["q8_0", "q4_1", "q4_k", "q6_k", "mixed"])
def test_torch_ops_weights_dequantize_to_what_gguf_dequantizes(kind):
    """Where the native step does not run (CUDA, bfloat16, BMC_NATIVE=0), a quantized matrix stays in its blocks'
    values on the device and torch ops dequantize it per GEMM: bit for bit gguf's float32 weights."""
    from bmc.models.quant_torch import TorchQuantWeight

    if kind == "mixed":
        w = QuantWeight.cat([random_matrix(t, n, 512, i) for i, (t, n) in enumerate(zip(MIXED, (32, 24, 8, 17)))])
    else:
        w = random_matrix(kind, 50, 512)
    tq = TorchQuantWeight(w, torch.device("cpu"), torch.float32)
    assert torch.equal(tq.dense(), w.dequantize())
    ids = torch.tensor([0, 7, 16, 31, 49])
    assert torch.equal(tq.dense(ids), w.dequantize()[ids])
    lin = bmc.models.ops.Linear(tq, torch.randn(w.shape[0]))
    assert lin.quant == kind and lin.wt is None and lin.panels is None
    x = torch.randn(3, 512)
    torch.testing.assert_close(lin(x), x @ w.dequantize().t() + lin.b, rtol=1e-5, atol=1e-4)
    assert sum(t.numel() * t.element_size() for t in tq.tensors()) < 0.4 * w.dequantize().numel() * 4
    as_bf16 = TorchQuantWeight(w, torch.device("cpu"), torch.bfloat16)
    assert torch.equal(as_bf16.dense(), w.dequantize().to(torch.bfloat16))  # what quant="none" loads in bf16


@pytest.mark.parametrize("plan", ["q4_k_m", "q5_k_m"])
def test_torch_ops_path_gives_the_dequantized_models_tokens(tmp_path, plan, monkeypatch):
    """A K-quant GGUF loaded with quant="gguf" where the native step does not run: every matrix held quantized
    (the tied embedding looked up from the LM head's blocks), logits within float32 rounding of quant="none"'s
    and its greedy tokens; in bfloat16, within bfloat16's rounding."""
    monkeypatch.setenv("BMC_NATIVE", "0")
    path = str(tmp_path / f"{plan}.gguf")
    _write_llama_gguf(path, PLANS[plan][0])
    mq, mf = bmc.load(path, quant="gguf"), bmc.load(path, quant="none")
    assert all(lin.device_q is not None for lin in mq.linears()) and mq.net.embed is None
    assert mq.weight_bytes < 0.5 * mf.weight_bytes
    prompts = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45]]
    a = bmc.generate(mq, prompts, max_new_tokens=12, ignore_eos=True)
    b = bmc.generate(mf, prompts, max_new_tokens=12, ignore_eos=True)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    from bmc.parallel.tp import prompt_logits

    with torch.inference_mode():
        want = prompt_logits(mf, prompts[1])  # the K-quants' random scales make logits of ~10: a relative bound
        torch.testing.assert_close(prompt_logits(mq, prompts[1]), want, rtol=1e-5, atol=2e-5 * want.abs().max().item())
        hq, hf = bmc.load(path, quant="gguf", dtype="bfloat16"), bmc.load(path, quant="none", dtype="bfloat16")
        assert all(lin.device_q is not None for lin in hq.linears())
        torch.testing.assert_close(prompt_logits(hq, prompts[1]).float(), prompt_logits(hf, prompts[1]).float(),
                                   rtol=0.02, atol=0.05 * prompt_logits(hf, prompts[1]).float().abs().max().item())


def _has_int8_dot() -> bool:
    mod = native_module()  # None under BMC_NATIVE=0 (the module is skipped then, but still collected)
    return mod is not None and bool(mod.has_int8_dot())


@pytest.fixture
def int8_dot() -> None:
    """Skip where this CPU lacks AVX512-VNNI and VBMI; fail where it has them and the kernel does not use them."""
    skip_unless_isa(_has_int8_dot(), ("avx512_vnni", "avx512vbmi"), "int8 activations need AVX512-VNNI and VBMI")


@pytest.mark.usefixtures("int8_dot")
@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q4_k", "q8_0", "q5_k", "q6_k", "mixed"])
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_int8_activations_gemm_within_its_stated_bound(kind, rows):
    """activations="int8": each row's block of 32 activations becomes x~ = dx * qx (dx = max|x| / 127, qx rounded)
    and the GEMM computes w . x~ exactly (the offsets' factor from x~ too), so per output |y - exact| <=
    sum_k |w_k| dx / 2, plus float32 rounding (1e-5 of sum |x w|)."""
    if kind == "mixed":
        w = QuantWeight.cat([random_matrix(t, n, 512, rows + i, MODEL_D)
                             for i, (t, n) in enumerate(zip(MIXED, (16, 8, 9, 17)))])
    else:
        w = random_matrix(kind, 50, 512, rows, MODEL_D)
    lin = bmc.models.ops.Linear(w, torch.randn(50))
    x = torch.randn(rows, 512)
    exact = x.double() @ w.dequantize().double().t() + lin.b.double()
    lin.int8_activations = True
    got = lin(x).double()
    dx = x.view(rows, 16, 32).abs().amax(-1).double() / 127  # [rows, blocks]
    wsum = w.dequantize().double().abs().view(w.shape[0], 16, 32).sum(-1)  # [50, blocks]: sum_k |w_k| per block
    bound = (dx / 2) @ wsum.t() + 1e-5 * (x.double().abs() @ w.dequantize().double().abs().t() + lin.b.abs().double())
    err = (got - exact).abs()
    assert (err <= bound).all(), (err / bound).max()
    assert err.max() > 1e-4  # the activations really were quantized
    lin.int8_activations = False
    torch.testing.assert_close(lin(x).double(), exact, rtol=1e-5, atol=1e-4)  # and float again exact


@pytest.mark.usefixtures("int8_dot")
@pytest.mark.parametrize("K", [32, 576, 1536, 32 * 37])
def test_int8_activations_round_x_as_stated(K):
    """The rounding of x the int8 GEMMs take (the native step's quantize_rows; the CUDA mode, quant_i8x.py, states
    the same formula and its tests hold it there): per block of 32, dx = max|x| / 127 and qx = x * (127 / max|x|)
    rounded to nearest even, both divisions IEEE (no reciprocal), and dx * sum(qx); bit for bit, with blocks of
    zeros, ties and 16-block groups with and without a tail."""
    from bmc.kernels.native import native_module

    g = torch.Generator().manual_seed(K)
    x = torch.randn(7, K, generator=g) * torch.logspace(-3, 3, 7)[:, None]
    x[1, :32] = 0  # dx = 0: qx = 0
    x[2, :32] = torch.arange(32) - 15.5  # max 16.5: x * 127 / 16.5 puts some values on .5
    x[3, 5] = float(2**-126)  # a subnormal-adjacent value beside normal ones
    qx, dx, xs = native_module().quantize_activations(x)
    xb = x.view(7, -1, 32)
    amax = xb.abs().amax(-1)
    c127 = torch.full_like(amax, 127.0)  # tensor / tensor: IEEE division (x / 127.0 may multiply by 1/127)
    want_dx = amax / c127
    inv = torch.where(amax > 0, c127 / torch.where(amax > 0, amax, c127), torch.zeros_like(amax))
    want_q = torch.round(xb * inv[..., None])  # to nearest even
    assert torch.equal(dx, want_dx)
    assert torch.equal(qx.view(7, -1, 32).float(), want_q)
    assert torch.equal(xs, want_dx * want_q.sum(-1))
    assert (qx[1, :32] == 0).all() and dx[1, 0] == 0


@pytest.mark.usefixtures("int8_dot")
def test_int8_activations_model_and_refusals(tmp_path, gqa_dir):
    """A Q4_0 model (its LM head Q8_0) with activations="int8": the native decode step and the PyTorch path (which call the same
    GEMM) give the same tokens; logits stay near the float activations' (a few % of their range on this random
    model); refused by name without Q4 matrices or with an unknown value."""
    path = str(tmp_path / "q4.gguf")
    _write(path, plan=uniform_plan(Q.Q4_0), embed_type=Q.Q4_0)
    m8, mf = bmc.load(path, activations="int8"), bmc.load(path)
    quantized = [lin for lin in m8.linears() if lin.quant not in (None, *HALF_TYPES)]
    assert m8.activations == "int8" and len(quantized) >= 8 and all(lin.int8_activations for lin in quantized)
    head = [lin for lin in m8.linears() if lin.quant == "f16"]  # output.weight: a 16-bit float stays float
    assert len(head) == 1 and not head[0].int8_activations
    prompts = [[5, 6, 7, 8, 9] * 3, [40, 41, 42]]
    native = bmc.generate(m8, prompts, max_new_tokens=16, ignore_eos=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BMC_NATIVE", "0")
        eager = bmc.generate(m8, prompts, max_new_tokens=16, ignore_eos=True)
    assert [c.token_ids for c in native] == [c.token_ids for c in eager]
    from bmc.parallel.tp import prompt_logits

    with torch.inference_mode():
        a, b = prompt_logits(m8, prompts[0]), prompt_logits(mf, prompts[0])
    assert 0 < (a - b).abs().max() < 0.05 * (b.max() - b.min())
    with pytest.raises(BmcError, match="quantized matrices"):
        bmc.load(str(gqa_dir), activations="int8")
    with pytest.raises(BmcError, match="unknown activations"):
        bmc.load(path, activations="fp8")


@pytest.mark.slow
@pytest.mark.usefixtures("int8_dot")
def test_int8_activations_perplexity_of_the_default_model(real_model):
    """The default model as stored (Q4_1) with int8 activations, prefill included: perplexity within 1 % of the
    float activations' on held-out text (measured: bench/quant.py --activations int8)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics)[:40])
    ppl = {act: bmc.perplexity(bmc.load(activations=act), text, context=256, max_chunks=4).ppl
           for act in ("float", "int8")}
    assert ppl["int8"] != ppl["float"] and abs(ppl["int8"] / ppl["float"] - 1) < 0.01, ppl


@pytest.mark.usefixtures("int8_dot")
def test_a_branching_tree_gives_plain_tokens_with_int8_activations():
    """A branching verify tree (dynamic:4x6: a node's siblings masked among its ancestors) gives plain decoding's
    tokens on the default model with int8 activations, where an ulp in an attention output can move an activation
    across a rounding step. Free text, 160 tokens: before the tree's nodes numbered their keys without their
    siblings' columns, the two parted at token 93 (bench/spec_auto.py found it)."""
    require_real_model()
    model = bmc.load(activations="int8")
    prompt = ["Write a short story about a dragon who learns to bake bread."]
    kw = dict(max_new_tokens=160, ignore_eos=True, chat=True)
    plain = bmc.generate(model, prompt, **kw)
    tree = bmc.generate(model, prompt, speculative="ngram", tree="dynamic:4x6", **kw)
    assert tree.stats.speculative.verify_steps > 0
    assert tree[0].token_ids == plain[0].token_ids


@pytest.mark.usefixtures("int8_dot")
def test_int8_activation_tokens_do_not_depend_on_the_cache_growth(tmp_path):
    """With int8 activations a 1e-7 difference in an attention output can move an activation across a rounding
    step. A capacity of whole 16-key score blocks computes every key's score as a larger capacity does, so the
    auto-T cache (r rounded to whole blocks), a cache growing 16 columns at a time and the upfront buffer give the
    same logits, bit for bit, at every step."""
    from bmc.attention import dense_attention
    from bmc.kv import KV_STRATEGIES, whole_score_blocks

    assert [whole_score_blocks(r, 100) for r in (1, 7, 16, 17, 99)] == [16, 16, 16, 32, 100]
    path = str(tmp_path / "q4.gguf")
    _write(path, plan=uniform_plan(Q.Q4_0), embed_type=Q.Q4_0)
    model = bmc.load(path, activations="int8")
    cfg = model.config
    ids = torch.tensor([[5, 6, 7, 8, 9] * 3 + list(range(20, 60))] * 2)
    runs = []
    for kind, kw in (("upfront", {}), ("bmc", {"r": 16}), ("bmc", {"r": 48})):
        cache = KV_STRATEGIES[kind](num_layers=cfg.num_layers, batch_size=2, num_kv_heads=cfg.num_kv_heads,
                                    head_dim=cfg.head_dim, max_length=ids.shape[1] + 7, dtype=model.dtype, **kw)
        logits = []
        with torch.inference_mode():
            cache.reserve(15)
            logits.append(model.net(ids[:, :15], torch.arange(15)[None].repeat(2, 1), cache, dense_attention,
                                    cache.attention_bias(15)))
            cache.commit(15)
            for i in range(15, ids.shape[1]):
                cache.reserve(1)
                logits.append(model.net(ids[:, i : i + 1], torch.full((2, 1), i), cache, dense_attention, cache.bias))
                cache.commit(1)
        runs.append(torch.cat(logits, 1))
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    auto = bmc.generate(model, [ids[0, :15].tolist()], max_new_tokens=40, ignore_eos=True)
    up = bmc.generate(model, [ids[0, :15].tolist()], max_new_tokens=40, ignore_eos=True, kv="upfront")
    assert auto.stats.r % 16 == 0 or auto.stats.r == auto.stats.max_length
    assert auto[0].token_ids == up[0].token_ids


def test_the_kernels_are_built_from_the_one_table_of_block_kinds():
    """C++ reads the block kinds Python lays weights out by (block_kinds.py, rendered into the build), and every
    GGUF type kept as stored names one of them or a 16-bit float dtype."""
    from bmc.kernels.block_kinds import BLOCK_KINDS
    from bmc.models.quant import GGUF_TYPES, block_kind_of

    assert native_module().block_kinds() == [
        (k.name, k.block_bytes, k.quants_at, k.vector_at("d_hi"), k.vector_at("m"), k.scale_bytes == 2, k.nibbles)
        for k in BLOCK_KINDS]
    for name, t in GGUF_TYPES.items():
        assert (t.panel is None) != (t.half is None), name
        if t.panel is not None:  # the panels made for the type are the kind's layout (zero blocks: valid in each)
            blocks = np.zeros((20, 256 // t.block_values * t.block_bytes), np.uint8)
            p = QuantWeight(name, (20, 256), blocks).panels()
            assert p.dtype == block_kind_of(name).storage and p.shape[-1] == block_kind_of(name).block_bytes


def test_quantized_panels_are_refused_without_their_kind_or_with_another():
    """The kernels take a weight's block kind from the caller: panels without one, or with a kind whose layout
    they do not have, are refused by name, never read as a kind guessed from their width."""
    mod = native_module()
    w = random_blocks("q8_0", (32, 64))
    lin = bmc.models.ops.Linear(w)
    x = torch.randn(2, 64)
    want = mod.panel_linear(x, lin.native_weight(), 32, None)
    torch.testing.assert_close(want, x @ w.dequantize().t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="quantized panels need their block kind"):
        mod.panel_linear(x, mod.Weight(lin.panels), 32, None)
    with pytest.raises(RuntimeError, match="not q4h panels"):
        mod.panel_linear(x, mod.Weight(lin.panels, block_kind_code("q4h")), 32, None)
    with pytest.raises(RuntimeError, match="no block kind 9"):
        mod.quant_rows(mod.Weight(lin.panels, 9), 64, torch.tensor([0]))


def block_kind_code(name: str) -> int:
    from bmc.kernels.block_kinds import BLOCK_KIND

    return BLOCK_KIND[name].code


@pytest.mark.parametrize("activations", ["int8", "float"])
@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0", "q4_k", "q6_k"])
def test_quantized_gemms_give_a_row_the_same_bits_at_any_row_count(kind, activations):
    """A row's output does not depend on the rows beside it (1, 3, 9, 33, 64 or 130 at once): each row count's
    kernel sums the same terms in the same order and rounds them alike (an implied offset included: Q4_0's -8 d;
    K-quants' two scales a block). With float activations the panels stream through the 1-8 row kernels at every
    row count (their sums were once re-associated by the compiler in the 1-row Q8 kernel alone, and past 64 rows
    the panels were dequantized: rows summed apart)."""
    if activations == "int8" and not native_module().has_int8_dot():
        pytest.skip("int8 activations need AVX512-VNNI and AVX512-VBMI")
    if activations == "float" and not _factored_q4():
        pytest.skip("float rows take the 1-8 row kernels on AVX-512 builds only")
    w = random_matrix(kind, 64, 256, 0, MODEL_D) if kind in K_BYTES else random_blocks(kind, (64, 256))
    lin = bmc.models.ops.Linear(w)
    lin.int8_activations = activations == "int8"
    x = torch.randn(130, 256, generator=torch.Generator().manual_seed(1))
    one = torch.cat([lin(x[i : i + 1]) for i in range(130)])
    assert torch.equal(torch.cat([lin(x[i : i + 3]) for i in range(0, 130, 3)]), one)
    assert torch.equal(torch.cat([lin(x[:9]), lin(x[9:42]), lin(x[42:106]), lin(x[106:])]), one)
    assert torch.equal(lin(x), one)
    if activations == "float":  # and within the bound of the dequantized float GEMM
        torch.testing.assert_close(one, x @ w.dequantize().t(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16"])
def test_float_panels_give_a_row_the_same_bits_at_any_row_count(kind):
    """Float32 and 16-bit panels: a row's output is one FMA chain over k in order at every row count's kernel (1-2
    rows on 4 panels, 3-4 on one, 5-8 wide, blocked past 8), so it does not depend on the rows beside it. Before,
    the 1-4 row kernel summed even and odd k apart and the others did not."""
    if not _factored_q4():
        pytest.skip("the register blockings are AVX-512's")
    N, K = 80, 96
    w = (torch.randn(N, K, generator=torch.Generator().manual_seed(2)) * 0.05).numpy()
    if kind == "f32":
        mod = native_module()
        weight = mod.Weight(mod.pack_panels(torch.from_numpy(w).t().contiguous()))
        f = lambda xs: mod.panel_linear(xs, weight, N, None, False)  # noqa: E731
    else:
        raw = gguf.quants.quantize(w, HALF_TYPES[kind]).reshape(N, -1).view(np.uint8)
        f = bmc.models.ops.Linear(QuantWeight(kind, (N, K), raw))
    x = torch.randn(130, K, generator=torch.Generator().manual_seed(1))
    one = torch.cat([f(x[i : i + 1]) for i in range(130)])
    for step in (2, 3, 4, 5, 8, 9, 64):
        assert torch.equal(torch.cat([f(x[i : i + step]) for i in range(0, 130, step)]), one), step
    assert torch.equal(f(x), one)


def test_weight_bytes_are_what_a_step_reads(tiny_dirs):
    """An untied embedding table is looked up a row at a time: not in weight_bytes; a tied one is the LM head,
    read whole, and counted once."""
    untied, tied = bmc.load(str(tiny_dirs["llama-gqa"])), bmc.load(str(tiny_dirs["llama-bias_headdim_tied"]))
    for model in (untied, tied):
        net = model.net
        head = net.lm_head.panels if net.lm_head.wt is None else net.lm_head.wt
        layers = sum(t.numel() * t.element_size() for L in net.layers for v in vars(L).values()
                     for t in ((v.wt if v.wt is not None else v.panels, v.b) if isinstance(v, bmc.models.ops.Linear)
                               else (v,)) if isinstance(t, torch.Tensor))
        rest = sum(t.numel() * t.element_size() for name, t in vars(net).items()
                   if isinstance(t, torch.Tensor) and name not in ("embed", "embed_q", "pos_embed"))
        assert model.weight_bytes == layers + head.numel() * head.element_size() + rest
    assert untied.net.embed is not None  # a float table of its own, which the sum above leaves out


@pytest.fixture(scope="module")
def q4_heads(tmp_path_factory) -> dict[int, str]:
    """Tiny GQA Llamas (3 query heads over one KV head) of head_dim 64 and 128 whose every matrix is whole blocks
    of 32 (so quant="q4_0" takes them all)."""
    from .conftest import save_tiny

    out = {}
    for hd in (64, 128):
        torch.manual_seed(hd)
        cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=3, num_key_value_heads=1, head_dim=hd,
                                       max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                       tie_word_embeddings=True)
        out[hd] = str(save_tiny(tmp_path_factory.mktemp(f"q4-hd{hd}"), transformers.LlamaForCausalLM(cfg).eval(), 320))
    return out


def _factored_q4() -> bool:
    """Whether float rows multiply quantized panels as stored, 8 rows a call (linear.h's gemm_quant): the AVX-512
    build's kernels (experts_spread answers for the same build)."""
    mod = native_module()
    return mod is not None and bool(mod.experts_spread())


@pytest.mark.parametrize("activations", ["int8", "float"])
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("model_of", ["gguf-hd16", "hf-hd64", "hf-hd128", "hf-hd64-q8_0"])
def test_verify_rows_are_the_decode_rows_bits(tmp_path, q4_heads, model_of, kv_dtype, activations):
    """A verify step's rows are the bits of the same tokens decoded one at a time (float or int8 KV), so
    speculation gives plain decoding's tokens: with int8 activations, and with float ones on Q4 and Q8_0 weights (a
    row's GEMM sums are the same in a call of 1 or of up to 64 rows; 5-8 rows once took another kernel whose sums
    differed, and the 1-row Q8 kernel once summed in a compiler-chosen tree). A step's attention scores a verify tree's rows by the decode rows' dot products, whatever their
    count (a prompt's 8 or more rows a KV head: one matrix product, which sums in another order and once moved an
    int8 activation across a rounding step: 0.65 in a logit). The cache grows in whole 16-key score blocks, as the
    scheduler's do (see the cache-growth test above)."""
    import copy

    from bmc.attention import dense_attention
    from bmc.engine import GenerationConfig, GenerationStats, make_cache

    if activations == "int8" and not _has_int8_dot():
        pytest.skip("int8 activations need AVX512-VNNI and VBMI")
    if activations == "float" and not _factored_q4():
        pytest.skip("float rows take the 1-4 row quantized kernels on AVX-512 builds only")
    if model_of == "gguf-hd16":
        path = str(tmp_path / "q4.gguf")
        _write(path, plan=uniform_plan(Q.Q4_0), embed_type=Q.Q4_0, tied=True)
        model = bmc.load(path, activations=activations)
    else:
        head_dim, _, quant = model_of[5:].partition("-")
        model = bmc.load(q4_heads[int(head_dim)], quant=quant or "q4_0", activations=activations)
    g, vocab = torch.Generator().manual_seed(3), model.config.vocab_size
    prompt = torch.randint(3, vocab, (21,), generator=g).tolist()
    chain = torch.randint(3, vocab, (6,), generator=g).tolist()  # 6 rows a query head: 12-18 a KV head
    with torch.inference_mode():
        cache = make_cache(model, GenerationConfig(kv="bmc", r=16, kv_dtype=kv_dtype), 1, 48, [0], GenerationStats())
        cache.reserve(len(prompt))
        model.net(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache, dense_attention,
                  cache.attention_bias(len(prompt)), prompt_len=torch.tensor([len(prompt)]))
        cache.commit(len(prompt))
        tree = copy.deepcopy(cache)
        decoded = []
        for i, tok in enumerate(chain):
            cache.reserve(1)
            decoded.append(model.net(torch.tensor([[tok]]), torch.tensor([[len(prompt) + i]]), cache,
                                     dense_attention, cache.attention_bias(1))[0, -1])
            cache.commit(1)
        tree.reserve(len(chain))
        verified = model.net(torch.tensor([chain]), torch.arange(len(prompt), len(prompt) + len(chain))[None], tree,
                             dense_attention, tree.attention_bias(len(chain)), all_logits=True)[0]
    assert model.net.lm_head.quant in ("q4_0", "q8_0")  # the LM head's GEMM on quantized panels too
    assert torch.equal(verified, torch.stack(decoded))
    text = [5, 6, 7, 8, 9, 10] * 4
    plain = bmc.generate(model, [text], max_new_tokens=24, ignore_eos=True, kv_dtype=kv_dtype)
    spec = bmc.generate(model, [text], max_new_tokens=24, ignore_eos=True, kv_dtype=kv_dtype, speculative="ngram",
                        tree="chain:4")
    assert spec[0].token_ids == plain[0].token_ids
