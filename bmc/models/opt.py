"""OPT decoder: learned positions (offset 2), LayerNorm, ReLU/GELU MLP, pre- or post-norm, optional
project_in/project_out when word_embed_proj_dim != hidden_size (opt-350m). Multi-head attention only."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..attention import AttentionFn
from ..kernels.native import NATIVE_MAX_T, NativeDecoders, native_module, native_supported, or_empty
from .step import StepPart, native_segments
from ..kv import KVCache
from .config import ModelConfig
from .ops import Linear, set_native_arithmetic
from .weights import WeightSource

POSITION_OFFSET = 2  # OPT's learned position table starts with two unused rows


class OPTLayer:
    def __init__(self, cfg: ModelConfig, w: WeightSource, i: int) -> None:
        p = f"model.decoder.layers.{i}."
        D, F_ = cfg.hidden_size, cfg.intermediate_size
        bias = cfg.enable_bias
        attn = [p + f"self_attn.{n}_proj" for n in "qkv"]
        self.qkv = Linear(w.cat_t([a + ".weight" for a in attn], [(D, D)] * 3),
                          w.cat([a + ".bias" for a in attn], [(D,)] * 3) if bias else None)
        self.o = Linear(w.get_t(p + "self_attn.out_proj.weight", (D, D)),
                        w.get(p + "self_attn.out_proj.bias", (D,)) if bias else None)
        self.ln1_w = w.get(p + "self_attn_layer_norm.weight", (D,))
        self.ln1_b = w.get(p + "self_attn_layer_norm.bias", (D,))
        self.fc1 = Linear(w.get_t(p + "fc1.weight", (F_, D)), w.get(p + "fc1.bias", (F_,)) if bias else None)
        self.fc2 = Linear(w.get_t(p + "fc2.weight", (D, F_)), w.get(p + "fc2.bias", (D,)) if bias else None)
        self.ln2_w = w.get(p + "final_layer_norm.weight", (D,))
        self.ln2_b = w.get(p + "final_layer_norm.bias", (D,))


class OPTModel:
    def __init__(self, cfg: ModelConfig, w: WeightSource) -> None:
        self.cfg = cfg
        D, E = cfg.hidden_size, cfg.word_embed_proj_dim or cfg.hidden_size
        p = "model.decoder."
        self.embed = w.get(p + "embed_tokens.weight", (cfg.vocab_size, E))
        self.pos_embed = w.get(p + "embed_positions.weight", (cfg.max_position_embeddings + POSITION_OFFSET, D))
        self.project_in = Linear(w.get_t(p + "project_in.weight", (D, E))) if E != D else None
        self.project_out = Linear(w.get_t(p + "project_out.weight", (E, D))) if E != D else None
        self.final_ln = (
            (w.get(p + "final_layer_norm.weight", (D,)), w.get(p + "final_layer_norm.bias", (D,)))
            if cfg.final_layer_norm
            else None
        )
        self.layers = [OPTLayer(cfg, w, i) for i in range(cfg.num_layers)]
        # lm_head is stored [E, V]; a tied embedding table is its transposed view (one copy of the weights)
        untied = w.has("lm_head.weight") and not cfg.tie_word_embeddings
        self.lm_head = Linear(w.get_t("lm_head.weight", (cfg.vocab_size, E)) if untied else w.as_linear(self.embed))
        if not untied:  # the LM head's view; quantized: None, rows looked up in its panels (embed_tokens)
            self.embed = self.lm_head.wt.t() if self.lm_head.wt is not None else None
        self.scale = cfg.head_dim**-0.5
        self.act = F.relu if cfg.activation == "relu" else F.gelu
        self.native = NativeDecoders()
        self.bf16_prompts = False  # prompt rows in bfloat16 arithmetic on the native step (models.set_activations)

    def native_decoder(self) -> Any:
        """The packed C++ decoder for decode/verify steps (pre-norm OPT without projections), or None."""
        return self.native.get(self.layers, self._build_native)

    def _build_native(self) -> Any:
        cfg = self.cfg
        if (not self.layers or not native_supported(self.pos_embed.device, self.pos_embed.dtype) or not cfg.do_layer_norm_before
                or self.project_in is not None or self.project_out is not None):
            return None
        if not all(isinstance(getattr(L, n), Linear) for L in self.layers for n in ("qkv", "o", "fc1", "fc2")):
            return None
        none = torch.empty(0)
        act = "relu" if cfg.activation == "relu" else "gelu"
        dec = native_module().NativeDecoder(cfg.hidden_size, cfg.num_heads, cfg.num_heads, cfg.head_dim,
                                            cfg.intermediate_size, False, False, act, cfg.norm_eps, self.scale)
        set_native_arithmetic(dec, [*(getattr(L, n) for L in self.layers for n in ("qkv", "o", "fc1", "fc2")),
                                    self.lm_head], self.bf16_prompts)
        for L in self.layers:
            dec.add_layer(L.ln1_w, L.ln1_b, L.qkv.native_weight(), or_empty(L.qkv.b), L.o.native_weight(),
                          or_empty(L.o.b), L.ln2_w, L.ln2_b, L.fc1.native_weight(), or_empty(L.fc1.b),
                          L.fc2.native_weight(), or_empty(L.fc2.b))
        final_w, final_b = self.final_ln if self.final_ln is not None else (none, none)
        dec.set_head(final_w, final_b, self.lm_head.native_weight(), self.lm_head.out_features)
        return dec

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            return F.embedding(tokens, self.embed)
        return self.lm_head.rows(tokens.reshape(-1)).view(*tokens.shape, self.lm_head.in_features)

    def forward_parts(self, parts: list[StepPart]) -> torch.Tensor | None:
        """As LlamaModel.forward_parts: several batches in one native step, or None."""
        native = self.native_decoder()
        if native is None or not all(p.native_ready() for p in parts):
            return None
        xs = []
        for p in parts:
            x = self.embed_tokens(p.tokens)
            xs.append(x + F.embedding(p.positions + POSITION_OFFSET, self.pos_embed))
        none = torch.empty(0)
        segments = [native_segments(p.attention) for p in parts]
        return native.forward_parts(xs, [p.cache.kv for p in parts], [p.bias for p in parts], [none] * len(parts),
                                    [none] * len(parts), [p.cache.length for p in parts], [[]] * len(parts),
                                    *(list(s) for s in zip(*segments)), [p.prompt_len is not None for p in parts])

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        attention: AttentionFn,
        bias: torch.Tensor,
        all_logits: bool = False,
        prompt_len: torch.Tensor | None = None,  # a prompt's rows (bf16_prompts); OPT's positions are learned
    ) -> torch.Tensor:
        cfg = self.cfg
        B, t = tokens.shape
        D, h, hd, pre, eps = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.do_layer_norm_before, cfg.norm_eps
        x = self.embed_tokens(tokens)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + F.embedding(positions + POSITION_OFFSET, self.pos_embed)
        segments = native_segments(attention) if t <= NATIVE_MAX_T and cache.write_at is None else None
        native = self.native_decoder() if segments is not None else None
        if native is not None:
            none = torch.empty(0)
            return native.forward(x, cache.kv, bias, none, none, cache.length, all_logits, *segments, [],
                                  prompt_len is not None)
        decoded = not getattr(attention, "reads_stored", False)  # SparQ reads a narrow KV format as stored
        for i, L in enumerate(self.layers):
            a = F.layer_norm(x, (D,), L.ln1_w, L.ln1_b, eps) if pre else x
            q, k, v = L.qkv(a).view(B, t, 3 * h, hd).transpose(1, 2).split(h, dim=1)
            K, V = cache.update(i, k, v, decoded)
            o = attention(q, K, V, bias, self.scale, layer=i)
            x = x + L.o(o.transpose(1, 2).reshape(B, t, h * hd))  # h: this rank's heads under tensor parallelism
            if not pre:
                x = F.layer_norm(x, (D,), L.ln1_w, L.ln1_b, eps)
            m = F.layer_norm(x, (D,), L.ln2_w, L.ln2_b, eps) if pre else x
            x = x + L.fc2(self.act(L.fc1(m)))
            if not pre:
                x = F.layer_norm(x, (D,), L.ln2_w, L.ln2_b, eps)
        if not all_logits:
            x = x[:, -1:]
        if self.final_ln is not None:
            x = F.layer_norm(x, (D,), self.final_ln[0], self.final_ln[1], eps)
        if self.project_out is not None:
            x = self.project_out(x)
        return self.lm_head(x).float()
