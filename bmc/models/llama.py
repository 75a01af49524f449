"""Llama family decoder (Llama 1-3, Mistral-style configs, SmolLM): RMSNorm, RoPE, SwiGLU, MHA/GQA/MQA.

Weights are kept fused (one QKV and one gate+up matrix per layer) so a decode step runs 4 GEMMs per layer."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from ..attention import AttentionFn, group_bias
from ..kv import KVCache
from .config import ModelConfig
from .weights import WeightSource


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with the `linear` and `llama3` scalings computed as HF transformers does."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if s is None:
        return inv
    if s["rope_type"] == "linear":
        return inv / float(s["factor"])
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s.get("original_max_position_embeddings", cfg.max_position_embeddings))
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_ctx / high) * ~(wavelen > old_ctx / low)
    return torch.where(medium, smoothed, scaled)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaLayer:
    def __init__(self, cfg: ModelConfig, w: WeightSource, i: int) -> None:
        p = f"model.layers.{i}."
        hd, h, kvh, D = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size
        attn = [p + f"self_attn.{n}_proj" for n in "qkv"]
        self.wqkv = w.cat([a + ".weight" for a in attn], [(h * hd, D), (kvh * hd, D), (kvh * hd, D)])
        self.bqkv = w.cat([a + ".bias" for a in attn], [(h * hd,), (kvh * hd,), (kvh * hd,)]) if cfg.attention_bias else None
        self.wo = w.get(p + "self_attn.o_proj.weight", (D, h * hd))
        self.bo = w.get(p + "self_attn.o_proj.bias", (D,)) if cfg.attention_bias else None
        I = cfg.intermediate_size
        mlp = [p + "mlp.gate_proj", p + "mlp.up_proj"]
        self.wgu = w.cat([m + ".weight" for m in mlp], [(I, D), (I, D)])
        self.bgu = w.cat([m + ".bias" for m in mlp], [(I,), (I,)]) if cfg.mlp_bias else None
        self.wd = w.get(p + "mlp.down_proj.weight", (D, I))
        self.bd = w.get(p + "mlp.down_proj.bias", (D,)) if cfg.mlp_bias else None
        self.ln1 = w.get(p + "input_layernorm.weight", (D,))
        self.ln2 = w.get(p + "post_attention_layernorm.weight", (D,))
        self.split = (h * hd, kvh * hd, kvh * hd)


class LlamaModel:
    def __init__(self, cfg: ModelConfig, w: WeightSource) -> None:
        self.cfg = cfg
        D = cfg.hidden_size
        self.embed = w.get("model.embed_tokens.weight", (cfg.vocab_size, D))
        self.layers = [LlamaLayer(cfg, w, i) for i in range(cfg.num_layers)]
        self.norm = w.get("model.norm.weight", (D,))
        tied = cfg.tie_word_embeddings or not w.has("lm_head.weight")
        self.lm_head = self.embed if tied else w.get("lm_head.weight", (cfg.vocab_size, D))
        self.inv_freq = rope_inv_freq(cfg).to(w.device)
        self.scale = cfg.head_dim**-0.5

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        attention: AttentionFn,
        bias: torch.Tensor,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """tokens, positions: [B, t]; the cache has reserved t columns; bias: cache.attention_bias(t) (plus any
        tree mask). Returns logits [B, t or 1, V] in float32."""
        cfg = self.cfg
        B, t = tokens.shape
        hd, h, kvh = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        x = F.embedding(tokens, self.embed)
        freqs = positions[..., None].float() * self.inv_freq  # [B, t, hd/2], as HF computes it
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        bias = group_bias(bias, cfg.group_size)
        for i, L in enumerate(self.layers):
            a = F.linear(rms_norm(x, L.ln1, cfg.norm_eps), L.wqkv, L.bqkv)
            q, k, v = a.split(L.split, dim=-1)
            q = q.view(B, t, h, hd)
            k = k.view(B, t, kvh, hd)
            q = (q * cos + rotate_half(q) * sin).transpose(1, 2)
            k = (k * cos + rotate_half(k) * sin).transpose(1, 2)
            K, V = cache.update(i, k, v.view(B, t, kvh, hd).transpose(1, 2))
            o = attention(q, K, V, bias, self.scale)
            x = x + F.linear(o.transpose(1, 2).reshape(B, t, h * hd), L.wo, L.bo)
            gate, up = F.linear(rms_norm(x, L.ln2, cfg.norm_eps), L.wgu, L.bgu).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, L.wd, L.bd)
        if not all_logits:
            x = x[:, -1:]
        return F.linear(rms_norm(x, self.norm, cfg.norm_eps), self.lm_head).float()
