"""OPT decoder: learned positions (offset 2), LayerNorm, ReLU/GELU MLP, pre- or post-norm, optional
project_in/project_out when word_embed_proj_dim != hidden_size (opt-350m). Multi-head attention only."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import AttentionFn
from ..kv import KVCache
from .config import ModelConfig
from .weights import WeightSource

POSITION_OFFSET = 2  # OPT's learned position table starts with two unused rows


class OPTLayer:
    def __init__(self, cfg: ModelConfig, w: WeightSource, i: int) -> None:
        p = f"model.decoder.layers.{i}."
        D, F_ = cfg.hidden_size, cfg.intermediate_size
        bias = cfg.enable_bias
        attn = [p + f"self_attn.{n}_proj" for n in "qkv"]
        self.wqkv = w.cat([a + ".weight" for a in attn], [(D, D)] * 3)
        self.bqkv = w.cat([a + ".bias" for a in attn], [(D,)] * 3) if bias else None
        self.wo = w.get(p + "self_attn.out_proj.weight", (D, D))
        self.bo = w.get(p + "self_attn.out_proj.bias", (D,)) if bias else None
        self.ln1_w = w.get(p + "self_attn_layer_norm.weight", (D,))
        self.ln1_b = w.get(p + "self_attn_layer_norm.bias", (D,))
        self.w1 = w.get(p + "fc1.weight", (F_, D))
        self.b1 = w.get(p + "fc1.bias", (F_,)) if bias else None
        self.w2 = w.get(p + "fc2.weight", (D, F_))
        self.b2 = w.get(p + "fc2.bias", (D,)) if bias else None
        self.ln2_w = w.get(p + "final_layer_norm.weight", (D,))
        self.ln2_b = w.get(p + "final_layer_norm.bias", (D,))


class OPTModel:
    def __init__(self, cfg: ModelConfig, w: WeightSource) -> None:
        self.cfg = cfg
        D, E = cfg.hidden_size, cfg.word_embed_proj_dim or cfg.hidden_size
        p = "model.decoder."
        self.embed = w.get(p + "embed_tokens.weight", (cfg.vocab_size, E))
        self.pos_embed = w.get(p + "embed_positions.weight", (cfg.max_position_embeddings + POSITION_OFFSET, D))
        self.project_in = w.get(p + "project_in.weight", (D, E)) if E != D else None
        self.project_out = w.get(p + "project_out.weight", (E, D)) if E != D else None
        self.final_ln = (
            (w.get(p + "final_layer_norm.weight", (D,)), w.get(p + "final_layer_norm.bias", (D,)))
            if cfg.final_layer_norm
            else None
        )
        self.layers = [OPTLayer(cfg, w, i) for i in range(cfg.num_layers)]
        self.lm_head = w.get("lm_head.weight", (cfg.vocab_size, E)) if w.has("lm_head.weight") else self.embed
        self.scale = cfg.head_dim**-0.5
        self.act = F.relu if cfg.activation == "relu" else F.gelu

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        attention: AttentionFn,
        bias: torch.Tensor,
        all_logits: bool = False,
    ) -> torch.Tensor:
        cfg = self.cfg
        B, t = tokens.shape
        D, h, hd, pre, eps = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.do_layer_norm_before, cfg.norm_eps
        x = F.embedding(tokens, self.embed)
        if self.project_in is not None:
            x = F.linear(x, self.project_in)
        x = x + F.embedding(positions + POSITION_OFFSET, self.pos_embed)
        for i, L in enumerate(self.layers):
            a = F.layer_norm(x, (D,), L.ln1_w, L.ln1_b, eps) if pre else x
            q, k, v = F.linear(a, L.wqkv, L.bqkv).view(B, t, 3 * h, hd).transpose(1, 2).split(h, dim=1)
            K, V = cache.update(i, k, v)
            o = attention(q, K, V, bias, self.scale)
            x = x + F.linear(o.transpose(1, 2).reshape(B, t, D), L.wo, L.bo)
            if not pre:
                x = F.layer_norm(x, (D,), L.ln1_w, L.ln1_b, eps)
            m = F.layer_norm(x, (D,), L.ln2_w, L.ln2_b, eps) if pre else x
            x = x + F.linear(self.act(F.linear(m, L.w1, L.b1)), L.w2, L.b2)
            if not pre:
                x = F.layer_norm(x, (D,), L.ln2_w, L.ln2_b, eps)
        if not all_logits:
            x = x[:, -1:]
        if self.final_ln is not None:
            x = F.layer_norm(x, (D,), self.final_ln[0], self.final_ln[1], eps)
        if self.project_out is not None:
            x = F.linear(x, self.project_out)
        return F.linear(x, self.lm_head).float()
