"""An HF checkpoint's bfloat16 / float16 matrices kept in 16 bits (quant="stored", the default where the native step
runs): half the bytes of float32, computed with the very float32 values HF's float32 forward uses."""
from __future__ import annotations

import pytest
import torch
import transformers

import bmc
from bmc.errors import BmcError
from bmc.kernels.native import native_supported

from .conftest import LLAMA_VARIANTS, logits_by_chunks, save_tiny

pytestmark = pytest.mark.skipif(not native_supported(torch.device("cpu"), torch.float32),
                                reason="the native CPU step does not build here")
IDS = [1, 17, 93, 5, 250, 41, 8, 77, 3, 199, 64, 12]


def half_llama(path, variant: str, dtype: torch.dtype):
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                   **LLAMA_VARIANTS[variant])
    return save_tiny(path, transformers.LlamaForCausalLM(cfg).to(dtype).eval(), 320)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["gqa", "bias_headdim_tied"])
def test_a_16_bit_checkpoint_is_kept_in_16_bits_with_hfs_float32_logits(tmp_path, dtype, variant):
    path = half_llama(tmp_path / "m", variant, dtype)
    # float activations: a bfloat16 checkpoint's default ("auto") prefills in bfloat16 (the test below)
    stored, widened = bmc.load(str(path), activations="float"), bmc.load(str(path), quant="none")
    assert stored.quant == "stored" and widened.quant == "none"
    linears = [lin for lin in stored.linears() if lin is not stored.net.embed_q]
    assert linears and all(lin.panels is not None and lin.panels.dtype == dtype for lin in linears)
    assert sum(lin.panels.nbytes for lin in linears) * 2 == sum(lin.panels.nbytes for lin in widened.linears())
    if widened.net.embed is not None and stored.net.embed is None:  # an untied table: kept in 16 bits too, its
        # rows widened exactly as looked up
        assert stored.net.embed_q.panels.dtype == dtype
        ids = torch.tensor(IDS[:4])
        assert torch.equal(stored.net.embed_q.rows(ids), widened.net.embed[ids])
    got = logits_by_chunks(stored, IDS, "bmc", split=5)
    # the float32 GEMM on the same values: bit for bit what quant="none" computes
    assert torch.equal(got, logits_by_chunks(widened, IDS, "bmc", split=5))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    prompt = [IDS[:6]]
    out = bmc.generate(stored, prompt, max_new_tokens=8, ignore_eos=True)
    hf_out = hf.generate(torch.tensor(prompt), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out[0].token_ids == hf_out[0, 6:].tolist()


def test_quant_stored_on_a_float32_checkpoint_changes_nothing_and_gguf_is_refused_by_name(tmp_path, gqa_dir):
    m = bmc.load(str(gqa_dir), quant="stored")
    assert m.quant == "stored" and all(lin.panels is None or lin.panels.dtype == torch.float32 for lin in m.linears())
    with pytest.raises(BmcError, match="quant='stored'"):
        bmc.load(str(gqa_dir), quant="gguf")


def test_auto_activations_run_a_bfloat16_checkpoints_prompts_in_bfloat16(tmp_path, gqa_dir):
    """activations="auto" (the default): a bfloat16 checkpoint, kept in 16 bits, prefills its prompts in bfloat16
    arithmetic where the CPU has it (AMX or AVX512-BF16): the checkpoint's own precision, at its speed; decode steps
    stay float32. A float16 or float32 checkpoint, or quantized weights, stay float (exact; bfloat16 or int8
    arithmetic on them is an opt-in), and so does a CPU that would only emulate bfloat16. Its greedy tokens are HF's
    float32 and HF's bfloat16 ones at every step before the first whose float32 margin between the top two logits
    is within 4x the larger prompt-logit deviation (bmc's bfloat16 prompts, HF's bfloat16 forward)."""
    from bmc.kernels.native import native_module

    fast = native_module().bf16_path() != "emulated"
    path = half_llama(tmp_path / "bf16", "gqa", torch.bfloat16)
    auto, exact = bmc.load(str(path)), bmc.load(str(path), activations="float")
    assert auto.activations == ("bfloat16" if fast else "float") and auto.net.bf16_prompts == fast
    assert exact.activations == "float" and not exact.net.bf16_prompts
    assert bmc.load(str(path), quant="q8_0").activations == "float"
    assert bmc.load(str(path), quant="none").activations == "float"  # widened to float32: a float32 model
    assert bmc.load(str(half_llama(tmp_path / "f16", "gqa", torch.float16))).activations == "float"
    assert bmc.load(str(gqa_dir)).activations == "float"
    if not fast:
        return
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.bfloat16).eval()
    prompt = [168, 80, 205, 27, 40, 277, 51, 190, 301, 32]  # float32's top two apart by 0.02 or more for 12 steps
    with torch.no_grad():
        want = hf32(torch.tensor([prompt])).logits[0]
        hf_dev = (hf16(torch.tensor([prompt])).logits[0].float() - want).abs().max().item()
        steps = hf32.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                              output_scores=True, return_dict_in_generate=True)
        hf16_tokens = hf16.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                                    do_sample=False)[0, len(prompt):].tolist()
    bmc_dev = (logits_by_chunks(auto, prompt, "bmc", split=len(prompt)) - want).abs().max().item()
    assert 0 < bmc_dev < 0.02 * (want.max() - want.min()).item()  # bfloat16 prompts: near float32, not equal
    bound = 4 * max(bmc_dev, hf_dev)
    margins = [s[0].topk(2).values for s in steps.scores]
    sure = next((i for i, m in enumerate(margins) if (m[0] - m[1]).item() <= bound), len(margins))
    assert sure >= 3, f"only {sure} steps clear the bound {bound:.4f}: the test would compare too little"
    ref = steps.sequences[0, len(prompt):].tolist()
    got = bmc.generate(auto, [prompt], max_new_tokens=12, ignore_eos=True)[0].token_ids
    assert got[:sure] == ref[:sure] == hf16_tokens[:sure]
