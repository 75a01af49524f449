"""Mixture-of-experts families (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE, OLMoE) from HF directories
against HF transformers: logits on every cache, greedy tokens batched, every --quant, and refusals by name."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import bmc
from bmc.errors import UnsupportedModelError
from bmc.kv import KV_STRATEGIES
from bmc.models.moe import route

from .conftest import (assert_chunked_logits_match_hf, assert_greedy_matches_hf, hf, save_tiny, skip_unless_isa,
                       transformers)

PROMPTS = [[5, 17, 33, 80, 101, 7, 9, 250, 12], [40, 41, 42], [300, 3, 99, 98, 97, 96, 14]]
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


def make_moe(path: Path, family: str, seed: int = 0, **kw) -> Path:
    """A tiny random model of `family`: 6 experts, top 2 (Qwen2-MoE: a shared expert too, and its second layer
    dense through mlp_only_layers), norms and biases made to matter."""
    torch.manual_seed(seed)
    base = dict(vocab_size=320, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                num_experts_per_tok=2)
    if family == "mixtral":
        Config, Model = transformers.MixtralConfig, transformers.MixtralForCausalLM
        base.update(num_local_experts=6)
    elif family == "qwen2_moe":
        Config, Model = transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM
        base.update(num_experts=6, moe_intermediate_size=32, shared_expert_intermediate_size=96,
                    mlp_only_layers=[1], norm_topk_prob=False)
    elif family == "qwen3_moe":
        Config, Model = transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM
        base.update(num_experts=6, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True)
    else:
        Config, Model = transformers.OlmoeConfig, transformers.OlmoeForCausalLM
        base.update(num_experts=6, clip_qkv=3.0)
    model = Model(Config(**{**base, **kw})).eval()
    with torch.no_grad():  # HF initialises norms to one and biases to zero: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
            elif "gate.weight" in name:  # routers: spread the probabilities so top-k is far from ties
                p.normal_(0, 0.5)
    return save_tiny(path, model, 320)


@pytest.fixture(scope="module", params=FAMILIES)
def moe_dir(request, tmp_path_factory) -> Path:
    return make_moe(tmp_path_factory.mktemp(request.param), request.param)


def test_config_reads_the_routing(moe_dir):
    cfg = bmc.load(str(moe_dir)).config
    assert (cfg.num_experts, cfg.experts_per_token) == (6, 2)
    assert cfg.norm_topk_prob == (cfg.model_type in ("mixtral", "qwen3_moe"))
    assert cfg.shared_expert_intermediate_size == (96 if cfg.model_type == "qwen2_moe" else 0)
    assert [cfg.is_moe(i) for i in range(2)] == ([True, False] if cfg.model_type == "qwen2_moe" else [True, True])
    assert cfg.qk_norm_full == (cfg.model_type == "olmoe")


@pytest.mark.parametrize("kv", list(KV_STRATEGIES))
def test_logits_match_hf(moe_dir, kv):
    assert_chunked_logits_match_hf(bmc.load(str(moe_dir)), hf(moe_dir), PROMPTS[0] + [11, 12, 13, 14, 15], kv,
                                   split=9)


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch"])
def test_greedy_batch_matches_hf_generate(moe_dir, monkeypatch, native):
    monkeypatch.setenv("BMC_NATIVE", native)
    model = bmc.load(str(moe_dir))
    assert (model.net.native_decoder() is None) == (native == "0")
    assert_greedy_matches_hf(model, moe_dir, PROMPTS, 12)


def test_route_follows_transformers():
    """Top-k of the float32 softmax, renormalised only where the family says so."""
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5], [3.0, 0.0, 0.0, 2.9]])
    for norm in (False, True):
        cfg = type("C", (), {"experts_per_token": 2, "norm_topk_prob": norm})()
        w, e = route(logits, cfg)
        p = torch.softmax(logits, -1)
        assert e.tolist() == [[1, 3], [0, 3]]
        expected = p.gather(1, e)
        torch.testing.assert_close(w, expected / expected.sum(-1, keepdim=True) if norm else expected)


def test_experts_not_multiple_of_16_are_refused(tmp_path):
    d = make_moe(tmp_path / "odd", "mixtral", intermediate_size=40)
    with pytest.raises(UnsupportedModelError, match="multiples of 16"):
        bmc.load(str(d))


def _step_logits(model, ids: torch.Tensor) -> torch.Tensor:
    from bmc.attention import dense_attention

    B, t = ids.shape
    cache = KV_STRATEGIES["upfront"](num_layers=model.config.num_layers, batch_size=B,
                                     num_kv_heads=model.config.num_kv_heads, head_dim=model.config.head_dim,
                                     max_length=t + 4, dtype=model.dtype, device=model.device)
    cache.reserve(t)
    ids = ids.to(model.device)
    with torch.inference_mode():
        return model.net(ids, torch.arange(t, device=model.device)[None].expand(B, t), cache, dense_attention,
                         cache.attention_bias(t), all_logits=True).cpu()


@pytest.mark.parametrize("quant", ["auto", "q8_0", "q4_0"])
def test_native_step_equals_the_pytorch_path(moe_dir, monkeypatch, quant):
    """The native step's routed experts (kernels/cpu/moe.h) give the PyTorch path's logits, for every --quant."""
    model = bmc.load(str(moe_dir), quant=quant)
    assert model.net.native_decoder() is not None
    ids = torch.tensor([PROMPTS[0][:7], PROMPTS[2][:7]])
    native = _step_logits(model, ids)
    monkeypatch.setenv("BMC_NATIVE", "0")
    torch.testing.assert_close(native, _step_logits(model, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("quant,activations", [("auto", "float"), ("q8_0", "float"), ("q4_0", "float"),
                                               ("q8_0", "int8"), ("q4_0", "int8")])
def test_experts_spread_over_threads_give_the_same_bits(moe_dir, quant, activations):
    """With fewer chosen experts than threads, the experts' panels are spread over the threads in one region (the
    profile counts such layers); each output is what one thread running each expert whole computes, bit for bit."""
    from .test_quant import _has_int8_dot

    if activations == "int8":
        skip_unless_isa(_has_int8_dot(), ("avx512_vnni", "avx512vbmi"), "int8 activations need AVX512-VNNI and VBMI")
    model = bmc.load(str(moe_dir), quant=quant, activations=activations)
    dec = model.net.native_decoder()
    routed = sum(model.config.is_moe(i) for i in range(model.config.num_layers))
    threads = torch.get_num_threads()
    try:
        for ids in (torch.tensor([[17]]), torch.tensor([[17], [250]])):
            torch.set_num_threads(1)  # one thread: every expert whole (the chosen experts are never fewer)
            whole = _step_logits(model, ids)
            torch.set_num_threads(8)  # 2 or 4 experts chosen: fewer than the threads
            dec.set_profiling(True)
            spread = _step_logits(model, ids)
            layers = dec.profile()["expert_layers_spread"]
            dec.set_profiling(False)
            assert torch.equal(spread, whole), ids.shape
            assert layers == (routed if native_spread_applies() else 0)
    finally:
        torch.set_num_threads(threads)


def native_spread_applies() -> bool:
    """Spreading experts' panels over threads is built where the native step has AVX-512 kernels."""
    from bmc.kernels.native import native_module

    return bool(native_module().experts_spread())


def test_each_chosen_expert_is_read_once_a_step(moe_dir, monkeypatch):
    """The native step runs each expert some row chose once over all those rows (the step's profile counts expert
    runs and their rows), and no other: the routing recorded on the PyTorch path says which experts that is."""
    import bmc.models.moe as moe

    model = bmc.load(str(moe_dir))
    cfg = model.config
    ids = torch.tensor([PROMPTS[0][:7], PROMPTS[2][:7], [9] * 7])
    chosen: list[torch.Tensor] = []
    real_route = moe.route

    def recording(logits, c):
        weights, experts = real_route(logits, c)
        chosen.append(experts)
        return weights, experts

    monkeypatch.setattr(moe, "route", recording)
    monkeypatch.setenv("BMC_NATIVE", "0")
    _step_logits(model, ids)
    monkeypatch.setenv("BMC_NATIVE", "1")
    dec = model.net.native_decoder()
    dec.set_profiling(True)
    _step_logits(model, ids)
    profile = dec.profile()
    routed = sum(cfg.is_moe(i) for i in range(cfg.num_layers))
    assert len(chosen) == routed
    assert profile["expert_runs"] == sum(len(torch.unique(e)) for e in chosen)
    assert profile["expert_rows"] == routed * ids.numel() * cfg.experts_per_token
    assert profile["expert_runs"] <= routed * cfg.num_experts < profile["expert_rows"]  # rows shared their experts


@pytest.mark.parametrize("budget", [64, 6], ids=["whole-prompts", "chunked-prefill"])
def test_served_requests_equal_generate_alone(moe_dir, budget):
    from .test_scheduler import PROMPTS as SERVED, alone, assert_idle, drive, request
    from bmc.scheduler import Scheduler

    model = bmc.load(str(moe_dir))
    sched = Scheduler(model, max_num_seqs=3, max_num_batched_tokens=budget, r=4)
    lengths = [10, 6, 9, 7]
    reqs = [request(p, n) for p, n in zip(SERVED, lengths)]
    drive(sched, {0: [reqs[0][0]], 2: [reqs[1][0], reqs[2][0]], 5: [reqs[3][0]]}, collectors=[c for _, c in reqs])
    for (_, col), p, n in zip(reqs, SERVED, lengths):
        assert col.error is None and col.tokens == {0: alone(model, p, n)}
    assert_idle(sched)


def test_int8_self_draft_keeps_greedy_tokens(moe_dir):
    """speculative='int8-self': every matrix but the routers and experts drafts in int8; greedy output unchanged."""
    model = bmc.load(str(moe_dir))
    plain = bmc.generate(model, PROMPTS, max_new_tokens=10, ignore_eos=True)
    drafted = bmc.generate(model, PROMPTS, max_new_tokens=10, ignore_eos=True, speculative="int8-self", tree="chain:3")
    assert [c.token_ids for c in drafted] == [c.token_ids for c in plain]


def test_tensor_parallelism_is_refused_by_name(moe_dir):
    from bmc.parallel.shard import shard_model

    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
        shard_model(bmc.load(str(moe_dir), quant="none"), 0, 2)


GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
ATTN_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
              "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
              "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "mlp.gate": "ffn_gate_inp",
              "block_sparse_moe.gate": "ffn_gate_inp"}


def write_moe_gguf(hf_dir: Path, path: Path, quant: str | None = None) -> Path:
    """A GGUF file of a tiny MoE directory as llama.cpp's converter writes it: Mixtral as a `llama` file with its
    Q/K rows permuted, every layer's experts stacked into ffn_{gate,up,down}_exps [E, out, in], the expert keys;
    quant="q8_0": every matrix but the routers and the shared expert's gate in Q8_0 blocks."""
    import gguf
    import numpy as np

    from .conftest import close_gguf, gguf_from_hf

    cfg = transformers.AutoConfig.from_pretrained(hf_dir)
    kind = cfg.model_type
    w, cfg, sd = gguf_from_hf(hf_dir, path, arch=GGUF_ARCH[kind])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    E = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    w.add_expert_count(E)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", cfg.intermediate_size))
    if kind == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if kind == "qwen3_moe":
        w.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    if kind == "olmoe" and cfg.clip_qkv is not None:
        w.add_clamp_kqv(cfg.clip_qkv)

    def add(name: str, t: np.ndarray, matrix: bool) -> None:
        if quant and matrix:
            w.add_tensor(name, gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, t)

    def permute(t: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's converter, for `llama` files
        return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    add("token_embd.weight", sd["model.embed_tokens.weight"].numpy(), False)
    add("output_norm.weight", sd["model.norm.weight"].numpy(), False)
    if "lm_head.weight" in sd:
        add("output.weight", sd["lm_head.weight"].numpy(), True)
    for i in range(cfg.num_hidden_layers):
        for hf_name, g in ATTN_NAMES.items():
            for suffix in ("weight", "bias"):
                t = sd.get(f"model.layers.{i}.{hf_name}.{suffix}")
                if t is None:
                    continue
                t = t.numpy()
                if kind == "mixtral" and g in ("attn_q", "attn_k"):
                    t = permute(t, cfg.num_attention_heads if g == "attn_q" else cfg.num_key_value_heads)
                add(f"blk.{i}.{g}.{suffix}", t, t.ndim == 2 and g not in ("ffn_gate_inp", "ffn_gate_inp_shexp"))
        block, parts = (("block_sparse_moe", ("w1", "w3", "w2")) if kind == "mixtral"
                        else ("mlp", ("gate_proj", "up_proj", "down_proj")))
        for g, part in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), parts):
            add(f"blk.{i}.{g}.weight",
                np.stack([sd[f"model.layers.{i}.{block}.experts.{e}.{part}.weight"].numpy() for e in range(E)]), True)
    close_gguf(w)
    return path


def test_gguf_gives_the_directorys_logits(moe_dir, tmp_path):
    """A float GGUF of the model (llama.cpp's names and layouts) gives the HF directory's logits, and a Q8_0 one
    kept as stored gives what quant='q8_0' makes of the directory (the same blocks)."""
    if bmc.load(str(moe_dir)).config.model_type == "qwen2_moe":  # llama.cpp's qwen2moe routes every layer
        moe_dir = make_moe(tmp_path / "routed", "qwen2_moe", mlp_only_layers=[])
    ids = torch.tensor([PROMPTS[0][:7], PROMPTS[2][:7]])
    f32 = bmc.load(str(write_moe_gguf(moe_dir, tmp_path / "f32.gguf")))
    assert f32.config.num_experts == 6
    torch.testing.assert_close(_step_logits(f32, ids), _step_logits(bmc.load(str(moe_dir)), ids), atol=1e-5,
                               rtol=1e-5)
    q8 = bmc.load(str(write_moe_gguf(moe_dir, tmp_path / "q8.gguf", quant="q8_0")))
    assert q8.net.layers[0].experts_gate_up.quant == "q8_0" and q8.net.layers[0].router.quant is None
    torch.testing.assert_close(_step_logits(q8, ids), _step_logits(bmc.load(str(moe_dir), quant="q8_0"), ids),
                               atol=1e-5, rtol=1e-5)


def test_a_steps_bytes_count_the_experts_its_rows_read(moe_dir):
    """One row reads top_k experts of a layer; many rows read nearly all; a step's weight bytes follow."""
    from bmc.analytic.model import expected_experts

    assert expected_experts(64, 8, 1) == pytest.approx(8)
    assert expected_experts(64, 8, 8) == pytest.approx(64 * (1 - (56 / 64) ** 8))
    assert expected_experts(64, 8, 1000) == pytest.approx(64)
    model = bmc.load(str(moe_dir))
    one, eight = model.step_weight_bytes(1), model.step_weight_bytes(8)
    assert one < eight < model.weight_bytes
    assert model.step_weight_bytes(10_000) == pytest.approx(model.weight_bytes)


def test_shared_prefix_and_sparq_keep_greedy_tokens(moe_dir):
    """A prompt's KV read in place by several rows (the common prefix of a batch), and SparQ's approximate
    attention at full rank (exact): the experts see the same rows either way."""
    model = bmc.load(str(moe_dir))
    common = list(range(20, 40))
    prompts = [common + [40], common + [50, 51, 52]]
    off = bmc.generate(model, prompts, max_new_tokens=10, ignore_eos=True, share_prefix="off")
    on = bmc.generate(model, prompts, max_new_tokens=10, ignore_eos=True)
    assert on.stats.cached_prompt_tokens == 20 and on.stats.prefix_groups == 1
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    full = bmc.generate(model, prompts, max_new_tokens=10, ignore_eos=True, attention="sparq",
                        sparq_r=model.config.head_dim, sparq_k=128)
    assert [c.token_ids for c in full] == [c.token_ids for c in off]


def test_quantized_experts_off_the_native_step_are_refused(moe_dir):
    """Quantized experts run on the native step only: bfloat16 with quant='q8_0' is refused by name; bfloat16 with
    float weights runs (the PyTorch path)."""
    with pytest.raises(UnsupportedModelError, match="quantized experts"):
        bmc.load(str(moe_dir), dtype="bfloat16", quant="q8_0")
    ids = torch.tensor([PROMPTS[0][:7]])
    half = _step_logits(bmc.load(str(moe_dir), dtype="bfloat16"), ids).float()
    torch.testing.assert_close(half, _step_logits(bmc.load(str(moe_dir)), ids), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_narrow_kv_gives_every_path_its_plain_tokens(moe_dir, monkeypatch, kv_dtype):
    """A narrow KV cache under the experts: caches, speculation in the padding rows, a shared prefix, served
    requests and the PyTorch path each give what the plain run of the same kv_dtype gives (exact with respect to
    it; the kv_dtype's own bound against float32 is tests/test_kv_dtype.py's)."""
    from .test_scheduler import PROMPTS as SERVED, alone, assert_idle, drive, request
    from bmc.scheduler import Scheduler

    model = bmc.load(str(moe_dir))

    def greedy(**kw) -> list[list[int]]:
        out = bmc.generate(model, PROMPTS, max_new_tokens=10, ignore_eos=True, kv_dtype=kv_dtype, **kw)
        return [c.token_ids for c in out]

    plain = greedy(r=4)
    narrow = bmc.generate(model, PROMPTS, max_new_tokens=4, ignore_eos=True, kv="upfront", kv_dtype=kv_dtype)
    wide = bmc.generate(model, PROMPTS, max_new_tokens=4, ignore_eos=True, kv="upfront")
    assert narrow.stats.peak_kv_bytes < 0.6 * wide.stats.peak_kv_bytes  # the setting is live
    for kw in (dict(kv="upfront"), dict(kv="iterative"), dict(r=1), dict(speculative="ngram", tree="chain:3", r=4)):
        assert greedy(**kw) == plain, kw
    common = [list(range(20, 40)) + p for p in PROMPTS[:2]]
    a = bmc.generate(model, common, max_new_tokens=8, ignore_eos=True, kv_dtype=kv_dtype)
    b = bmc.generate(model, common, max_new_tokens=8, ignore_eos=True, kv_dtype=kv_dtype, share_prefix="off")
    assert a.stats.prefix_groups == 1 and [c.token_ids for c in a] == [c.token_ids for c in b]
    sched = Scheduler(model, max_num_seqs=3, max_num_batched_tokens=6, r=4, kv_dtype=kv_dtype)
    lengths = [9, 6, 8]
    reqs = [request(p, n) for p, n in zip(SERVED, lengths)]
    drive(sched, {0: [reqs[0][0]], 2: [reqs[1][0], reqs[2][0]]}, collectors=[c for _, c in reqs])
    for (_, col), p, n in zip(reqs, SERVED, lengths):
        assert col.error is None and col.tokens == {0: alone(model, p, n, kv_dtype=kv_dtype)}
    assert_idle(sched)
    assert sched.cache.format.name == kv_dtype
    monkeypatch.setenv("BMC_NATIVE", "0")
    assert greedy(r=4) == plain


def write_k_quant_moe_gguf(path: Path, E: int = 8, D: int = 256, I: int = 256, V: int = 320) -> Path:
    """A qwen3moe GGUF with experts as llama.cpp's Q4_K_M stores them: gate and up in Q4_K, down in Q6_K (3-D
    tensors [E, out, in] of super-blocks), the attention in Q4_K and Q6_K, the router and norms in float32."""
    import gguf
    import numpy as np

    from .test_quant import K_TYPES, MODEL_D, random_matrix

    H, KV, hd = 4, 2, 64
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for add, v in ((w.add_block_count, 2), (w.add_context_length, 256), (w.add_embedding_length, D),
                   (w.add_feed_forward_length, I), (w.add_head_count, H), (w.add_head_count_kv, KV),
                   (w.add_key_length, hd), (w.add_value_length, hd), (w.add_layer_norm_rms_eps, 1e-6),
                   (w.add_rope_freq_base, 10000.0), (w.add_vocab_size, V), (w.add_expert_count, E),
                   (w.add_expert_used_count, 2), (w.add_expert_feed_forward_length, I)):
        add(v)
    seed = iter(range(1000))
    rng = np.random.default_rng(0)

    def add_blocks(name: str, kind: str, *dims: int) -> None:
        rows = int(np.prod(dims[:-1]))
        blocks = random_matrix(kind, rows, dims[-1], next(seed), MODEL_D).blocks
        w.add_tensor(name, blocks.reshape(*dims[:-1], -1), raw_dtype=K_TYPES[kind])

    add_blocks("token_embd.weight", "q4_k", V, D)
    add_blocks("output.weight", "q6_k", V, D)
    w.add_tensor("output_norm.weight", np.ones(D, np.float32))
    for i in range(2):
        for name, kind, rows, cols in (("attn_q", "q4_k", H * hd, D), ("attn_k", "q4_k", KV * hd, D),
                                       ("attn_v", "q6_k", KV * hd, D), ("attn_output", "q4_k", D, H * hd)):
            add_blocks(f"blk.{i}.{name}.weight", kind, rows, cols)
        for name, n in (("attn_norm", D), ("ffn_norm", D), ("attn_q_norm", hd), ("attn_k_norm", hd)):
            w.add_tensor(f"blk.{i}.{name}.weight", rng.uniform(0.5, 1.5, n).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", rng.normal(0, 0.5, (E, D)).astype(np.float32))
        add_blocks(f"blk.{i}.ffn_gate_exps.weight", "q4_k", E, I, D)
        add_blocks(f"blk.{i}.ffn_up_exps.weight", "q4_k", E, I, D)
        add_blocks(f"blk.{i}.ffn_down_exps.weight", "q6_k", E, D, I)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_k_quant_experts_run_as_stored(tmp_path, monkeypatch):
    """Q4_K / Q6_K experts (3-D GGUF tensors of super-blocks) are kept as stored in the stacked expert matrices
    and give the tokens of the same file dequantized to float32; the weight file's mapped panels give them too."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("BMC_CACHE_DIR", str(tmp_path / "cache" / "bmc"))
    path = str(write_k_quant_moe_gguf(tmp_path / "q4_k_m.gguf"))
    mq, mf = bmc.load(path), bmc.load(path, quant="none")
    L0 = mq.net.layers[0]
    assert (L0.experts_gate_up.quant, L0.experts_down.quant, L0.router.quant) == ("q4_k", "q6_k", None)
    assert mq.config.model_type == "qwen3_moe" and mq.config.num_experts == 8
    ids = torch.tensor([PROMPTS[0][:7], PROMPTS[2][:7]])
    want = _step_logits(mf, ids)
    assert torch.isfinite(want).all() and want.std() > 0.1  # sane weights: equal tokens below say something
    torch.testing.assert_close(_step_logits(mq, ids), want, atol=1e-4, rtol=1e-4)
    a = bmc.generate(mq, PROMPTS, max_new_tokens=12, ignore_eos=True)
    b = bmc.generate(mf, PROMPTS, max_new_tokens=12, ignore_eos=True)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    bmc.load(path, share_weights=True)  # writes the weight file
    again = bmc.load(path, share_weights=True)  # built from it
    assert getattr(again, "weight_file", None) and again.net.layers[0].experts_down.quant == "q6_k"
    c = bmc.generate(again, PROMPTS, max_new_tokens=12, ignore_eos=True)
    assert [x.token_ids for x in c] == [x.token_ids for x in b]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA/ROCm GPU")
def test_cuda_runs_the_experts_as_hf_does(moe_dir):
    """Float experts on CUDA (the PyTorch path, graphs on): logits within 1e-4 of HF's on CPU, and the greedy
    tokens of the CPU run, batched."""
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu, cpu = bmc.load(str(moe_dir), device="cuda"), bmc.load(str(moe_dir))
    ids = torch.tensor([PROMPTS[0][:7], PROMPTS[2][:7]])
    torch.testing.assert_close(_step_logits(gpu, ids), _step_logits(cpu, ids), atol=1e-4, rtol=1e-4)
    for kv in ("bmc", "upfront"):
        a = bmc.generate(gpu, PROMPTS, max_new_tokens=10, ignore_eos=True, kv=kv)
        b = bmc.generate(cpu, PROMPTS, max_new_tokens=10, ignore_eos=True, kv=kv)
        assert [c.token_ids for c in a] == [c.token_ids for c in b], kv
