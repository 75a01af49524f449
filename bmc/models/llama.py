"""Llama family decoder (Llama 1-3, Mistral, Qwen2/2.5, Qwen3, Phi-3, Gemma 1-3, SmolLM): RMSNorm, RoPE, a gated
MLP (SwiGLU, Gemma's GeGLU), MHA/GQA/MQA.

Weights are kept fused (one QKV and one gate+up matrix per layer) so a decode step runs 4 GEMMs per layer.
Gemma's differences are flags of the config (see ModelConfig): its (1 + weight) norms are folded into the weights
here, so every path runs a plain RMSNorm."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ..attention import AttentionFn, causal_attention, dense_attention, group_bias, softcapped_attention
from ..errors import ModelLoadError, UnsupportedModelError
from ..kernels.native import NATIVE_MAX_T, NativeDecoders, native_module, native_supported, or_empty
from .step import StepPart, native_segments
from ..kv import KVCache
from . import decode_cuda
from .config import ModelConfig
from .moe import MOE_ATTRS, load_moe, moe_mlp, set_native_moe
from .ops import Linear, apply_rope, rms_norm, rope_tables, set_native_arithmetic
from .weights import WeightSource


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies, with the `linear` and `llama3` scalings computed as HF transformers does; `local`: the
    window layers' own unscaled RoPE (Gemma 3)."""
    inv = 1.0 / rope_powers(cfg.local_rope_theta if local else cfg.rope_theta, cfg.head_dim)
    s = None if local else cfg.rope_scaling
    if s is None:
        return inv
    if s["rope_type"] == "longrope":
        return longrope_inv_freq(cfg, "short_factor")
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


def rope_powers(theta: float, d: int) -> torch.Tensor:
    """theta ** (2i / d) for i < d/2, in float32 as HF computes it: the inverse frequencies' denominators."""
    return theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)


def longrope_inv_freq(cfg: ModelConfig, which: str) -> torch.Tensor:
    """longrope's inverse frequencies with its short or long per-frequency factors, as transformers computes them."""
    d = cfg.head_dim
    ext = torch.tensor(cfg.rope_scaling[which], dtype=torch.float32)
    if ext.numel() != d // 2:
        raise ModelLoadError(f"longrope {which} has {ext.numel()} entries; head_dim {d} needs {d // 2}")
    return 1.0 / (ext * rope_powers(cfg.rope_theta, d))


def layer_matrices(L: "LlamaLayer") -> list[Any]:
    """A layer's GEMM matrices: attention's, then the dense MLP's or the experts'."""
    return [L.qkv, L.o, *(getattr(L, n) for n in ("gate_up", "down", *MOE_ATTRS) if getattr(L, n) is not None)]


class LlamaLayer:
    def __init__(self, cfg: ModelConfig, w: WeightSource, i: int) -> None:
        p = f"model.layers.{i}."
        hd, h, kvh, D = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size
        I = cfg.intermediate_size
        attn = [p + f"self_attn.{n}_proj" for n in "qkv"]
        if cfg.fused_projections:  # Phi-3 stores [q; k; v] and [gate; up] fused already, in bmc's order
            qkv_wt = w.get_t(p + "self_attn.qkv_proj.weight", ((h + 2 * kvh) * hd, D))
            gate_up_wt = w.get_t(p + "mlp.gate_up_proj.weight", (2 * I, D))
        else:
            qkv_wt = w.cat_t([a + ".weight" for a in attn], [(h * hd, D), (kvh * hd, D), (kvh * hd, D)])
        self.qkv = Linear(
            qkv_wt,
            w.cat([a + ".bias" for a in attn], [(h * hd,), (kvh * hd,), (kvh * hd,)]) if cfg.attention_bias else None)
        self.o = Linear(w.get_t(p + "self_attn.o_proj.weight", (D, h * hd)),
                        w.get(p + "self_attn.o_proj.bias", (D,)) if cfg.o_bias else None)
        mlp = [p + "mlp.gate_proj", p + "mlp.up_proj"]
        self.gate_up: Linear | None = None
        self.down: Linear | None = None
        for name in MOE_ATTRS:
            setattr(self, name, None)
        if cfg.is_moe(i):  # routed experts (moe.py) in place of the dense MLP
            load_moe(self, cfg, w, i)
        else:
            if not cfg.fused_projections:
                gate_up_wt = w.cat_t([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], [(I, D), (I, D)])
            self.gate_up = Linear(gate_up_wt, w.cat([m + ".bias" for m in mlp], [(I,), (I,)]) if cfg.mlp_bias else None)
            self.down = Linear(w.get_t(p + "mlp.down_proj.weight", (D, I)),
                               w.get(p + "mlp.down_proj.bias", (D,)) if cfg.mlp_bias else None)
        def norm(name: str, n: int = D) -> torch.Tensor:
            t = w.get(p + name + ".weight", (n,))
            return (1.0 + t.float()).to(t.dtype) if cfg.norm_plus_one else t  # Gemma: x_hat * (1 + weight)

        self.ln1 = norm("input_layernorm")
        # Gemma 2/3 name the norm of the attention's output post_attention_layernorm and the MLP's input one
        # pre_feedforward_layernorm; Llama's post_attention_layernorm is the MLP's input norm
        self.post_attn_norm = norm("post_attention_layernorm") if cfg.sandwich_norms else None
        self.ln2 = norm("pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm")
        self.post_mlp_norm = norm("post_feedforward_layernorm") if cfg.sandwich_norms else None
        self.qk_width = (h + kvh) * hd  # queries and keys are rotated together, values follow
        # Qwen3's and Gemma 3's per-head RMSNorm of queries and keys (before RoPE); OLMoE's over all heads at once
        q_width, k_width = (h * hd, kvh * hd) if cfg.qk_norm_full else (hd, hd)
        self.q_norm = norm("self_attn.q_norm", q_width) if cfg.qk_norm or cfg.qk_norm_full else None
        self.k_norm = norm("self_attn.k_norm", k_width) if cfg.qk_norm or cfg.qk_norm_full else None
        self.local = cfg.is_local(i)  # attends through the sliding window (some layers only: Gemma 2/3)


NO_SCALES = torch.empty(0)


def set_key_scales(native: Any, cache: KVCache) -> None:
    """The native step's key scales for this cache (kv/smoothing.py): its int8 rows' s, or none."""
    scales = cache.key_scales
    native.set_key_scales(scales.table if scales is not None else NO_SCALES)  # a pointer compare when unchanged


class LlamaModel:
    SMOOTHS_KEYS = True  # int8 caches may store keys as k / s (kv/smoothing.py): this forward applies s

    def __init__(self, cfg: ModelConfig, w: WeightSource) -> None:
        self.cfg = cfg
        D = cfg.hidden_size
        self.layers = [w.finish(f"layers.{i}", LlamaLayer(cfg, w, i)) for i in range(cfg.num_layers)]
        self.norm = w.get("model.norm.weight", (D,))
        if cfg.norm_plus_one:
            self.norm = (1.0 + self.norm.float()).to(self.norm.dtype)
        # the table after the layers, and each big matrix handed to finish() once made: a streaming first load
        # (weight_file.stream_first_load) holds one of them at a time
        embed = w.get_matrix("model.embed_tokens.weight", (cfg.vocab_size, D))
        tied = cfg.tie_word_embeddings or not w.has("lm_head.weight")
        # lm_head is stored [D, V]; a tied embedding table is its transposed view (one copy of the weights), or,
        # quantized, its panels (embed None: embed_tokens dequantizes the rows it looks up)
        self.lm_head = Linear(w.as_linear(embed) if tied else w.get_t("lm_head.weight", (cfg.vocab_size, D)))
        if tied:
            self.embed = self.lm_head.wt.t() if self.lm_head.wt is not None else None
        for lin in [*(lin for L in self.layers for lin in layer_matrices(L)), *([] if tied else [self.lm_head])]:
            if lin.device_q is not None:
                lin.device_q.gemm_only()  # no row lookups: the int4 GEMM's copy is the only one
        # an untied table kept as stored (a GGUF's quantized token_embd): a Linear never multiplied by, whose rows
        # embed_tokens dequantizes as it looks them up (a float32 copy would be 4-8x the file's bytes)
        self.embed_q: Linear | None = None
        if not tied and isinstance(embed, torch.Tensor):
            self.embed = embed
        elif not tied:
            w.finish("net", self)
            self.embed, self.embed_q = None, Linear(w.as_linear(embed))
        del embed
        self.inv_freq = rope_inv_freq(cfg).to(w.device)
        # Gemma 3's window layers rotate with their own base; None: every layer uses inv_freq
        self.local_inv_freq = rope_inv_freq(cfg, local=True).to(w.device) if cfg.local_rope_theta else None
        # longrope (Phi-3/3.5): the long factors' frequencies, taken where a token is past the pretraining context
        longrope = cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "longrope"
        self.long_inv_freq = longrope_inv_freq(cfg, "long_factor").to(w.device) if longrope else None
        self.scale = cfg.attn_scale
        # Gemma's embedding scale, rounded as HF rounds it (float32 first, then the model's dtype): made once here
        self.embed_scale = (torch.tensor(cfg.embed_scale).to(w.dtype).to(w.device) if cfg.embed_scale is not None
                            else None)
        self.native = NativeDecoders()
        self.bf16_prompts = False  # prompt rows in bfloat16 arithmetic on the native step (models.set_activations)
        w.finish("net", self)

    def native_decoder(self) -> Any:
        """The packed C++ decoder for decode/verify steps, or None where it does not apply."""
        return self.native.get(self.layers, self._build_native)

    def _build_native(self) -> Any:
        cfg, L0 = self.cfg, self.layers[0] if self.layers else None
        if L0 is None or not native_supported(L0.ln1.device, L0.ln1.dtype):
            return None
        if not all(isinstance(lin, Linear) for L in self.layers for lin in layer_matrices(L)):
            return None  # quantized drafts keep their own kernels
        none = torch.empty(0)
        dec = native_module().NativeDecoder(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                            cfg.intermediate_size, True, True, cfg.activation, cfg.norm_eps, self.scale)
        if cfg.attn_softcap is not None:
            dec.set_softcap(cfg.attn_softcap)
        if cfg.clip_qkv is not None:
            dec.set_clip_qkv(cfg.clip_qkv)
        tied = (self.embed is not None and self.lm_head.wt is not None
                and self.embed.data_ptr() == self.lm_head.wt.data_ptr())
        linears = [*(lin for L in self.layers for lin in layer_matrices(L)), self.lm_head]
        for lin in linears:
            lin.keep_panels_only()  # the panels are the weights from here on: one copy
        set_native_arithmetic(dec, linears, self.bf16_prompts)
        if tied:
            self.embed = None  # looked up in the LM head's panels
        no_mlp = native_module().Weight(none)
        for i, L in enumerate(self.layers):
            dense = L.router is None
            dec.add_layer(L.ln1, none, L.qkv.native_weight(), or_empty(L.qkv.b), L.o.native_weight(), or_empty(L.o.b),
                          L.ln2, none, L.gate_up.native_weight() if dense else no_mlp,
                          or_empty(L.gate_up.b) if dense else none, L.down.native_weight() if dense else no_mlp,
                          or_empty(L.down.b) if dense else none)
            if not dense:
                set_native_moe(dec, i, L, cfg)
            if L.q_norm is not None:  # Qwen3, Gemma 3
                dec.set_qk_norm(i, L.q_norm, L.k_norm)
            if L.post_attn_norm is not None:  # Gemma 2/3
                dec.set_post_norms(i, L.post_attn_norm, L.post_mlp_norm)
            dec.set_local(i, L.local)
        dec.set_head(self.norm, none, self.lm_head.native_weight(), self.lm_head.out_features)
        return dec

    def rope(self, positions: torch.Tensor, dtype: torch.dtype,
             prompt_len: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed of the forward's positions. longrope (transformers' dynamic update) rotates with the long
        factors where the forward's longest position is past the pretraining context: generate() alone over a row
        does so for its whole prompt when the prompt is longer, then for each generated token past it. So a token
        at position p of a prompt of `prompt_len` tokens is long iff max(prompt_len, p + 1) > that context,
        whichever way the prompt is chunked; without prompt_len (decode steps, verify trees: tokens after the
        prompt) iff p + 1 is."""
        if self.long_inv_freq is None:
            return rope_tables(positions, self.inv_freq, dtype)
        s = self.cfg.rope_scaling
        last = positions + 1
        if prompt_len is not None:
            last = torch.maximum(last, prompt_len.to(positions.device)[:, None])
        long = (last > s["original_max_position_embeddings"])[..., None]
        inv = torch.where(long, self.long_inv_freq, self.inv_freq)  # [B, t, d/2]
        return rope_tables(positions, inv, dtype, s["attention_factor"])

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = F.embedding(tokens, self.embed)
        else:
            table = self.embed_q if self.embed_q is not None else self.lm_head
            x = table.rows(tokens.reshape(-1)).view(*tokens.shape, self.cfg.hidden_size)
        if self.embed_scale is not None:  # Gemma
            x = x * self.embed_scale
        return x

    def final_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma 2's tanh soft-capping of the logits (float32), as HF applies it; else the logits as they are."""
        cap = self.cfg.final_softcap
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    def window_bias(self, cache: KVCache, bias: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The window layers' bias where only some layers have the window and a run can pass it, else None (the
        forward's bias serves every layer)."""
        if cache.window is None or cache.window_every_layer:
            return None
        return cache.window_bias(bias, positions)

    def forward_parts(self, parts: list[StepPart]) -> torch.Tensor | None:
        """Several batches in one native step (decode rows and a prompt chunk: each weight read once for all);
        the logits of every row's last token [sum B, V], or None where the native step cannot run them all."""
        native = self.native_decoder()
        if native is None or not all(p.native_ready() for p in parts):
            return None
        hd, xs, coss, sins, locals_ = self.cfg.head_dim, [], [], [], []
        for p in parts:
            B, t = p.tokens.shape
            x = self.embed_tokens(p.tokens)
            cos, sin = self.rope(p.positions, x.dtype, p.prompt_len)
            xs.append(x)
            coss.append(cos.view(B, t, hd))
            sins.append(sin.view(B, t, hd))
            locals_.append(self.native_local(p.cache, p.bias, p.positions, x.dtype))
        scales = {id(p.cache.key_scales) for p in parts}
        if len(scales) > 1:
            raise ValueError("a step's parts must store their keys with the same channel scales")
        set_key_scales(native, parts[0].cache)
        segments = [native_segments(p.attention) for p in parts]
        return self.final_logits(native.forward_parts(xs, [p.cache.kv for p in parts], [p.bias for p in parts], coss,
                                                      sins, [p.cache.length for p in parts], locals_,
                                                      *(list(s) for s in zip(*segments)),
                                                      [p.prompt_len is not None for p in parts]))

    def native_local(self, cache: KVCache, bias: torch.Tensor, positions: torch.Tensor,
                     dtype: torch.dtype) -> list[torch.Tensor]:
        """The native step's `local` argument: [] where every layer reads the main bias and RoPE, else the window
        layers' [bias (empty: the main one), cos, sin], then, where the cache has either, each row's grid origin
        (a window on every layer: KVCache.grid_origin) and a flag that rows hold masked holes (speculation's)."""
        local = self._window_local(cache, bias, positions, dtype)
        origin = cache.grid_origin()
        if origin is None and not cache.holes:
            return local
        return (local or [torch.empty(0)] * 3) + [or_empty(origin), torch.ones(1) if cache.holes else torch.empty(0)]

    def _window_local(self, cache: KVCache, bias: torch.Tensor, positions: torch.Tensor,
                      dtype: torch.dtype) -> list[torch.Tensor]:
        local_bias = self.window_bias(cache, bias, positions)
        if local_bias is None and self.local_inv_freq is None:
            return []
        if self.local_inv_freq is None:  # empty tables: the main ones
            return [local_bias, torch.empty(0), torch.empty(0)]
        B, t = positions.shape
        cos, sin = rope_tables(positions, self.local_inv_freq, dtype)
        return [or_empty(local_bias), cos.view(B, t, self.cfg.head_dim), sin.view(B, t, self.cfg.head_dim)]

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        attention: AttentionFn,
        bias: torch.Tensor,
        all_logits: bool = False,
        prompt_len: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens, positions: [B, t]; the cache has reserved t columns; bias: cache.attention_bias(t) (plus any
        tree mask); prompt_len [B]: each row's whole prompt length where the tokens are (part of) a prompt (see
        rope()). Returns logits [B, t or 1, V] in float32."""
        cfg = self.cfg
        B, t = tokens.shape
        hd, h, kvh = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        x = self.embed_tokens(tokens)
        cos, sin = self.rope(positions, x.dtype, prompt_len)
        segments = native_segments(attention) if t <= NATIVE_MAX_T and cache.write_at is None else None
        native = self.native_decoder() if segments is not None else None
        if native is not None:
            set_key_scales(native, cache)
            return self.final_logits(native.forward(x, cache.kv, bias, cos.view(B, t, hd), sin.view(B, t, hd),
                                                    cache.length, all_logits, *segments,
                                                    self.native_local(cache, bias, positions, x.dtype),
                                                    prompt_len is not None))
        local_rope = (rope_tables(positions, self.local_inv_freq, x.dtype) if self.local_inv_freq is not None
                      else (cos, sin))
        local_bias = self.window_bias(cache, bias, positions)
        if cfg.attn_softcap is not None:  # Gemma 2: scores capped before the bias; SDPA has no such option
            if attention is not dense_attention and attention is not causal_attention:
                raise UnsupportedModelError(f"attention-logit soft-capping ({cfg.model_type}) runs with dense "
                                            "attention only (no SparQ, window or shared-prefix attention)")
            cap = cfg.attn_softcap
            attention = lambda q, k, v, b, scale, layer=0: softcapped_attention(q, k, v, b, scale, cap)
        if attention is not causal_attention:  # which reads no bias
            bias = group_bias(bias, cfg.group_size)
            local_bias = group_bias(local_bias, cfg.group_size) if local_bias is not None else None
        decoded = not getattr(attention, "reads_stored", False)  # SparQ reads a narrow KV format as stored
        act = F.silu if cfg.activation == "silu" else lambda g: F.gelu(g, approximate="tanh")
        if decode_cuda.applies(self, cache, attention, t):  # CUDA decode: the glue between GEMMs fused
            x = decode_cuda.decode_layers(self, x, (cos, sin), local_rope, cache, attention, bias, local_bias)
            return self.final_logits(self.lm_head(x).float())
        for i, L in enumerate(self.layers):
            a = L.qkv(rms_norm(x, L.ln1, cfg.norm_eps))
            if cfg.qk_norm_full:  # OLMoE: q and k normed across all their heads, then q, k, v clamped
                a = torch.cat((rms_norm(a[..., : h * hd], L.q_norm, cfg.norm_eps),
                               rms_norm(a[..., h * hd : L.qk_width], L.k_norm, cfg.norm_eps), a[..., L.qk_width :]),
                              dim=-1)
                if cfg.clip_qkv is not None:
                    a = a.clamp(-cfg.clip_qkv, cfg.clip_qkv)
            qk = a[..., : L.qk_width].view(B, t, h + kvh, hd)
            if L.q_norm is not None and not cfg.qk_norm_full:
                qk = torch.cat((rms_norm(qk[:, :, :h], L.q_norm, cfg.norm_eps),
                                rms_norm(qk[:, :, h:], L.k_norm, cfg.norm_eps)), dim=2)
            qk = apply_rope(qk, *(local_rope if L.local else (cos, sin)))
            q, k = qk[:, :, :h].transpose(1, 2), qk[:, :, h:].transpose(1, 2)
            if cache.key_scales is not None:  # keys stored as k / s, queries taken as q * s: exact, powers of two
                s_q, inv_s = cache.key_scales.multipliers(i, q.dtype, q.device)
                q, k = q * s_q, k * inv_s
            K, V = cache.update(i, k, a[..., L.qk_width :].view(B, t, kvh, hd).transpose(1, 2), decoded)
            o = attention(q, K, V, local_bias if L.local and local_bias is not None else bias, self.scale, layer=i)
            o = L.o(o.transpose(1, 2).reshape(B, t, h * hd))
            x = x + (rms_norm(o, L.post_attn_norm, cfg.norm_eps) if L.post_attn_norm is not None else o)
            if L.router is not None:
                m = moe_mlp(L, cfg, rms_norm(x, L.ln2, cfg.norm_eps), act)
            else:
                gate, up = L.gate_up(rms_norm(x, L.ln2, cfg.norm_eps)).chunk(2, dim=-1)
                m = L.down(act(gate) * up)
            x = x + (rms_norm(m, L.post_mlp_norm, cfg.norm_eps) if L.post_mlp_norm is not None else m)
        if not all_logits:
            x = x[:, -1:]
        return self.final_logits(self.lm_head(rms_norm(x, self.norm, cfg.norm_eps)).float())
