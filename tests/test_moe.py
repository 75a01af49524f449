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

from .conftest import assert_chunked_logits_match_hf, assert_greedy_matches_hf, hf, save_tiny, transformers

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
                                     max_length=t + 4, dtype=model.dtype)
    cache.reserve(t)
    with torch.inference_mode():
        return model.net(ids, torch.arange(t)[None].expand(B, t), cache, dense_attention, cache.attention_bias(t),
                         all_logits=True)


@pytest.mark.parametrize("quant", ["auto", "q8_0", "q4_0"])
def test_native_step_equals_the_pytorch_path(moe_dir, monkeypatch, quant):
    """The native step's routed experts (kernels/cpu/moe.h) give the PyTorch path's logits, for every --quant."""
    model = bmc.load(str(moe_dir), quant=quant)
    assert model.net.native_decoder() is not None
    ids = torch.tensor([PROMPTS[0][:7], PROMPTS[2][:7]])
    native = _step_logits(model, ids)
    monkeypatch.setenv("BMC_NATIVE", "0")
    torch.testing.assert_close(native, _step_logits(model, ids), atol=1e-5, rtol=1e-5)


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
