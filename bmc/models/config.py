"""One config dataclass for every supported family, parsed from an HF config.json dict."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import ModelLoadError, UnsupportedModelError

MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", *MOE)
GEMMA = ("gemma", "gemma2", "gemma3_text")
SUPPORTED_MODEL_TYPES = (*LLAMA_LIKE, "opt")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    # llama family
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False  # biases on the q, k, v projections
    o_bias: bool = False  # a bias on the output projection (Llama's attention_bias sets both; Qwen2 has q/k/v only)
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on each query and key head, before RoPE
    fused_projections: bool = False  # Phi-3: qkv_proj and gate_up_proj stored fused
    # keys a query attends: positions in (q - sliding_window, q] (Mistral); None = the whole causal past
    sliding_window: int | None = None
    # which layers the window applies to where only some do (Gemma 2/3, Qwen2's max_window_layers); None = all
    local_layers: tuple[bool, ...] | None = None
    local_rope_theta: float | None = None  # Gemma 3: the window layers' own RoPE base (default scaling)
    # Gemma: RMSNorm scales by (1 + weight) (folded into the weights at load), embeddings scaled by
    # sqrt(hidden_size), a norm after attention and after the MLP as well as before (Gemma 2/3), tanh soft-capping
    # of attention scores and of the final logits (Gemma 2), and a query scale of query_pre_attn_scalar**-0.5
    norm_plus_one: bool = False
    embed_scale: float | None = None
    sandwich_norms: bool = False
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    # mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): each token runs the experts_per_token experts its
    # router's softmax ranks highest, their outputs weighted by those probabilities (renormalised to sum to 1 where
    # norm_topk_prob), plus Qwen2-MoE's shared expert gated by a sigmoid; moe_layers: which layers route (Qwen's
    # decoder_sparse_step / mlp_only_layers; None: every layer), the others keep a dense MLP of intermediate_size
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] | None = None
    # OLMoE: the q and k RMSNorms span the whole projection (all heads), and q, k, v are clamped to +-clip_qkv
    qk_norm_full: bool = False
    clip_qkv: float | None = None
    # opt
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int | None = None
    enable_bias: bool = True
    final_layer_norm: bool = True
    activation: str = "silu"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    pad_token_id: int | None = None

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 = MHA, num_heads = MQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def attn_scale(self) -> float:
        """What query-key products are scaled by before the softmax."""
        return (self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5

    def is_moe(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a routed mixture of experts."""
        return self.num_experts > 0 and (self.moe_layers is None or self.moe_layers[layer])

    def is_local(self, layer: int) -> bool:
        """Whether `layer` attends through the sliding window (when the model has one)."""
        return self.sliding_window is not None and (self.local_layers is None or self.local_layers[layer])

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r}; bmc implements {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            return _parse_opt(cfg) if model_type == "opt" else _parse_llama(cfg)
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None


def _eos_ids(cfg: dict[str, Any]) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """transformers >= 5 writes `rope_parameters`; older configs write rope_theta + rope_scaling."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind == "su":  # Phi-3's first name for longrope
        kind = "longrope"
    if kind not in ("linear", "llama3", "longrope"):
        raise UnsupportedModelError(f"unsupported rope scaling {kind!r}; bmc implements default, linear, llama3, "
                                    "longrope")
    scaling["rope_type"] = kind
    if kind == "longrope":
        _longrope(cfg, scaling)
    return theta, scaling


def _longrope(cfg: dict[str, Any], scaling: dict[str, Any]) -> None:
    """Fill in longrope's parameters as transformers derives them (Phi-3/3.5): the pretraining context, the factor
    (the context ratio unless given) and the attention factor sqrt(1 + ln(factor) / ln(original context))."""
    for key in ("short_factor", "long_factor"):
        if not isinstance(scaling.get(key), list):
            raise ModelLoadError(f"longrope rope scaling needs a list {key!r}")
    orig = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if not orig:
        raise ModelLoadError("longrope rope scaling needs original_max_position_embeddings")
    orig = int(orig)
    factor = scaling.get("factor")
    if factor is None:
        factor = int(cfg.get("max_position_embeddings", orig)) / orig
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    scaling.update(original_max_position_embeddings=orig, factor=float(factor), attention_factor=float(attention))


def _layer_types(cfg: dict[str, Any], default: list[bool]) -> tuple[bool, ...]:
    """Which layers are "sliding_attention" by `layer_types`, else by the family's default pattern."""
    types = cfg.get("layer_types")
    if types is None:
        return tuple(default)
    n = int(cfg["num_hidden_layers"])
    if len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(f"layer_types {sorted(set(types))} ({len(types)} for {n} layers): bmc implements "
                                    "sliding_attention and full_attention, one per layer")
    return tuple(t == "sliding_attention" for t in types)


def _gemma3_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """Gemma 3's two RoPEs: the global layers' (base 1e6 by default, maybe linearly scaled) and the window layers'
    (`rope_local_base_freq`, 1e4 by default, unscaled). transformers >= 5 writes them as `rope_parameters` keyed by
    layer type."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full = dict(params["full_attention"] or {})
        local = dict(params.get("sliding_attention") or {})
        full.setdefault("rope_theta", 1e6)
        local_theta = float(local.get("rope_theta", 1e4))
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"Gemma 3 window layers with rope_type {local['rope_type']!r} (only default)")
        theta, scaling = _rope({"rope_parameters": full})
        return theta, scaling, local_theta
    theta, scaling = _rope(dict(cfg, rope_theta=cfg.get("rope_theta", 1e6)))
    return theta, scaling, float(cfg.get("rope_local_base_freq", 1e4))


def _sliding_window(cfg: dict[str, Any]) -> tuple[int | None, tuple[bool, ...] | None]:
    """The window and the layers it applies to (None: every layer), or (None, None). Mistral: `sliding_window`
    on every layer (transformers' MistralModel ignores `layer_types`). Qwen2/3: only with `use_sliding_window`, on
    the layers `layer_types` marks (by default those from `max_window_layers` on). Gemma 2: every other layer from
    the first, Gemma 3: five of every six (`sliding_window_pattern`), or as `layer_types` says. Llama has none
    (transformers' LlamaModel ignores the field)."""
    kind, n = cfg["model_type"], int(cfg["num_hidden_layers"])
    if kind in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window", False) or cfg.get("sliding_window") is None:
            return None, None
        local = _layer_types(cfg, [i >= int(cfg.get("max_window_layers", 28)) for i in range(n)])
    elif kind == "gemma2":
        local = _layer_types(cfg, [(i + 1) % 2 == 1 for i in range(n)])
    elif kind == "gemma3_text":
        pattern = int(cfg.get("sliding_window_pattern", 6))
        local = _layer_types(cfg, [(i + 1) % pattern != 0 for i in range(n)])
    elif kind in ("qwen2_moe", "qwen3_moe"):
        if cfg.get("use_sliding_window", False):  # real checkpoints leave it off; Qwen2-MoE's pattern is its own
            raise UnsupportedModelError(f"{kind} with use_sliding_window is not supported")
        return None, None
    elif kind in ("mistral", "mixtral", "phi3"):
        local = (True,) * n
    else:
        return None, None
    window = cfg.get("sliding_window")
    if window is None or not any(local):
        return None, None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelLoadError(f"sliding_window must be a positive integer or null, got {window!r}")
    return window, None if all(local) else local


def _parse_llama(cfg: dict[str, Any]) -> ModelConfig:
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ModelLoadError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    kind = cfg["model_type"]
    gemma = kind in GEMMA
    act_field = "hidden_activation" if kind in ("gemma2", "gemma3_text") else "hidden_act"  # what HF reads
    act = cfg.get(act_field) or ("gelu_pytorch_tanh" if gemma else "silu")
    if kind == "gemma" and act == "gelu":  # transformers reads Gemma's legacy "gelu" as the tanh approximation
        act = "gelu_pytorch_tanh"
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise UnsupportedModelError(f"unsupported {act_field} {act!r} for {kind} (silu, gelu_pytorch_tanh)")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention (Gemma 3 embedding models) is not supported")
    theta, scaling, local_theta = _gemma3_rope(cfg) if kind == "gemma3_text" else (*_rope(cfg), None)
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor={partial} (RoPE on part of each head) is not supported yet")
    window, local_layers = _sliding_window(cfg)
    # Qwen2: always, o_proj none; Qwen2-MoE: as its qkv_bias says (on unless written off)
    qkv_bias = (kind == "qwen2" or (kind == "qwen2_moe" and bool(cfg.get("qkv_bias", True)))
                or bool(cfg.get("attention_bias", False)))
    softcaps = [cfg.get("attn_logit_softcapping"), cfg.get("final_logit_softcapping")] if gemma else [None, None]
    return ModelConfig(
        model_type=cfg["model_type"],
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(cfg["intermediate_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=qkv_bias,
        o_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=kind in ("qwen3", "gemma3_text", "qwen3_moe"),
        fused_projections=kind == "phi3",
        sliding_window=window,
        local_layers=local_layers,
        local_rope_theta=local_theta if window is not None else None,
        norm_plus_one=gemma,
        embed_scale=hidden**0.5 if gemma else None,
        sandwich_norms=kind in ("gemma2", "gemma3_text"),
        attn_softcap=float(softcaps[0]) if softcaps[0] is not None else None,
        final_softcap=float(softcaps[1]) if softcaps[1] is not None else None,
        query_pre_attn_scalar=(float(cfg.get("query_pre_attn_scalar", 256)) if kind in ("gemma2", "gemma3_text")
                               else None),
        activation="gelu_tanh" if act == "gelu_pytorch_tanh" else "silu",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg),
        pad_token_id=cfg.get("pad_token_id"),
        **(_moe(cfg) if kind in MOE else {}),
    )


def _moe(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from an HF config, read as transformers reads them."""
    kind, n = cfg["model_type"], int(cfg["num_hidden_layers"])
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if experts < 1 or not 1 <= top_k <= experts:
        raise ModelLoadError(f"{kind}: num_experts_per_tok={top_k} must be in [1, num_experts={experts}]")
    moe_layers = None
    inter = int(cfg["intermediate_size"])
    shared = 0
    if kind in ("qwen2_moe", "qwen3_moe"):
        step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or [])
        routed = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))
        moe_layers = None if all(routed) else routed
        inter = int(cfg["moe_intermediate_size"])
        shared = int(cfg["shared_expert_intermediate_size"]) if kind == "qwen2_moe" else 0
    clip = cfg.get("clip_qkv") if kind == "olmoe" else None
    return dict(num_experts=experts, experts_per_token=top_k, expert_intermediate_size=inter,
                norm_topk_prob=kind == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=shared, moe_layers=moe_layers, qk_norm_full=kind == "olmoe",
                clip_qkv=float(clip) if clip is not None else None)


def _parse_opt(cfg: dict[str, Any]) -> ModelConfig:
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    act = cfg.get("activation_function", "relu")
    if act not in ("relu", "gelu"):
        raise UnsupportedModelError(f"unsupported OPT activation_function {act!r} (relu, gelu)")
    if not cfg.get("layer_norm_elementwise_affine", True):
        raise UnsupportedModelError("OPT with layer_norm_elementwise_affine=False is not supported")
    pre_norm = bool(cfg.get("do_layer_norm_before", True))
    return ModelConfig(
        model_type="opt",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=int(cfg["ffn_dim"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        norm_eps=1e-5,
        do_layer_norm_before=pre_norm,
        word_embed_proj_dim=int(cfg.get("word_embed_proj_dim") or hidden),
        enable_bias=bool(cfg.get("enable_bias", True)),
        final_layer_norm=pre_norm and not cfg.get("_remove_final_layer_norm", False),
        activation=act,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg),
        pad_token_id=cfg.get("pad_token_id"),
    )
