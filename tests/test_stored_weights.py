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
    stored, widened = bmc.load(str(path)), bmc.load(str(path), quant="none")
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
