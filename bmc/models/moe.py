"""Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): a router picks each token's top-k experts, and
the token's MLP output is their outputs weighted by the router's probabilities (plus Qwen2-MoE's shared expert).

A layer holds its experts as two stacked matrices: every expert's fused gate|up along the output axis in one
Linear [D -> E * 2I] and every down projection in another [I -> E * D]. Expert e is output columns [e * 2I, (e+1)
* 2I) and [e * D, (e+1) * D), whole 16-column panels each, so the native step and the PyTorch path both multiply
an expert's rows by a view of the stacked panels; and everything that walks a layer's Linears (quantization,
weight files, byte counts) sees two matrices, however many experts there are. The router and the shared expert's
gate stay in float, as llama.cpp keeps them (`ffn_gate_inp` is never quantized): a quantized router would move
tokens between experts."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import UnsupportedModelError
from .config import ModelConfig
from .ops import Linear
from .weights import WeightSource

PANEL = 16
# attributes a routed layer holds (None on a dense one)
MOE_ATTRS = ("router", "experts_gate_up", "experts_down", "shared_gate_up", "shared_down", "shared_gate")


def expert_names(model_type: str, layer: int, e: int) -> tuple[str, str, str]:
    """HF names of expert e's gate, up and down weights."""
    if model_type == "mixtral":
        p = f"model.layers.{layer}.block_sparse_moe.experts.{e}."
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    p = f"model.layers.{layer}.mlp.experts.{e}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def router_name(cfg: ModelConfig, layer: int) -> str:
    block = "block_sparse_moe" if cfg.model_type == "mixtral" else "mlp"
    return f"model.layers.{layer}.{block}.gate.weight"


def load_moe(layer: Any, cfg: ModelConfig, w: WeightSource, i: int) -> None:
    """Set a routed layer's MOE_ATTRS from the checkpoint."""
    D, E, I = cfg.hidden_size, cfg.num_experts, cfg.expert_intermediate_size
    if D % PANEL or I % PANEL:
        raise UnsupportedModelError(f"{cfg.model_type}: experts of hidden size {D} and width {I}; bmc's stacked "
                                    f"experts need both to be multiples of {PANEL}")
    names = [expert_names(cfg.model_type, i, e) for e in range(E)]
    layer.router = Linear(w.get(router_name(cfg, i), (E, D)).t().contiguous())
    layer.experts_gate_up = Linear(w.cat_t([n for g, u, _ in names for n in (g, u)], [(I, D)] * (2 * E)))
    layer.experts_down = Linear(w.cat_t([d for _, _, d in names], [(D, I)] * E))
    layer.shared_gate_up = layer.shared_down = layer.shared_gate = None
    S = cfg.shared_expert_intermediate_size
    if S:  # Qwen2-MoE
        p = f"model.layers.{i}.mlp.shared_expert"
        layer.shared_gate_up = Linear(w.cat_t([p + ".gate_proj.weight", p + ".up_proj.weight"], [(S, D), (S, D)]))
        layer.shared_down = Linear(w.get_t(p + ".down_proj.weight", (D, S)))
        layer.shared_gate = Linear(w.get(p + "_gate.weight", (1, D)).t().contiguous())
    if layer.experts_gate_up.device_q is not None:
        raise UnsupportedModelError(f"{cfg.model_type}: quantized experts run on the native CPU step (float32 on "
                                    f"a CPU); here ({w.device.type}, {str(w.dtype).split('.')[-1]}) load this model "
                                    "with quant='none'")


def route(logits: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) [n, k] of router logits [n, E], as transformers computes them: the softmax in float32,
    its top k, renormalised where the family does."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, experts = torch.topk(probs, cfg.experts_per_token, dim=-1)
    if cfg.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top, experts


def moe_mlp(layer: Any, cfg: ModelConfig, h: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The routed MLP of normed inputs h [..., D] on the PyTorch path: each chosen expert runs once over the rows
    that chose it, and the weighted outputs are summed in ascending expert order (transformers' order)."""
    D, I = cfg.hidden_size, cfg.expert_intermediate_size
    x = h.reshape(-1, D)
    weights, experts = route(layer.router(x), cfg)
    weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():
        rows, slot = torch.where(experts == e)
        gate, up = layer.experts_gate_up.columns(e * 2 * I, (e + 1) * 2 * I)(x[rows]).chunk(2, dim=-1)
        y = layer.experts_down.columns(e * D, (e + 1) * D)(act(gate) * up)
        out.index_add_(0, rows, y * weights[rows, slot, None])
    if layer.shared_gate_up is not None:  # Qwen2-MoE: sigmoid(gate . x) * shared_expert(x), added to the experts'
        gate, up = layer.shared_gate_up(x).chunk(2, dim=-1)
        out = out + torch.sigmoid(layer.shared_gate(x)) * layer.shared_down(act(gate) * up)
    return out.view(h.shape)


def set_native_moe(dec: Any, i: int, layer: Any, cfg: ModelConfig) -> None:
    """Hand layer i's experts to the native decoder (kernels/cpu/moe.h)."""
    dec.set_moe(i, layer.router.native_weight(), layer.experts_gate_up.native_weight(),
                layer.experts_down.native_weight(), cfg.num_experts, cfg.expert_intermediate_size,
                cfg.experts_per_token, cfg.norm_topk_prob)
    if layer.shared_gate_up is not None:
        dec.set_shared_expert(i, layer.shared_gate_up.native_weight(), layer.shared_down.native_weight(),
                              layer.shared_gate.dense_weight().reshape(-1).contiguous(),
                              cfg.shared_expert_intermediate_size)
