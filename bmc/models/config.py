"""One config dataclass for every supported family, parsed from an HF config.json dict."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ModelLoadError, UnsupportedModelError

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "phi3")
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
    if kind not in ("linear", "llama3"):
        raise UnsupportedModelError(f"unsupported rope scaling {kind!r}; bmc implements default, linear, llama3")
    scaling["rope_type"] = kind
    return theta, scaling


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    """The window every layer attends with, or None. Mistral: `sliding_window` alone (transformers' MistralModel
    ignores `layer_types`). Qwen2: only with `use_sliding_window`, on the layers `layer_types` marks (by default
    those from `max_window_layers` on); windows on some layers only are refused, never run as full attention.
    Llama has none (transformers' LlamaModel ignores the field)."""
    kind = cfg["model_type"]
    if kind in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window", False) or cfg.get("sliding_window") is None:
            return None
        n = int(cfg["num_hidden_layers"])
        types = cfg.get("layer_types") or ["sliding_attention" if i >= int(cfg.get("max_window_layers", 28))
                                           else "full_attention" for i in range(n)]
        if set(types) == {"full_attention"}:
            return None
        if set(types) != {"sliding_attention"}:
            raise UnsupportedModelError(
                f"{kind} with a sliding window on some layers only (use_sliding_window with max_window_layers="
                f"{cfg.get('max_window_layers')}, layer_types {sorted(set(types))}) is not supported yet")
    window = cfg.get("sliding_window") if kind in ("mistral", "qwen2", "qwen3", "phi3") else None
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelLoadError(f"sliding_window must be a positive integer or null, got {window!r}")
    return window


def _parse_llama(cfg: dict[str, Any]) -> ModelConfig:
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ModelLoadError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"unsupported hidden_act {act!r} for a llama model (only silu)")
    theta, scaling = _rope(cfg)
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor={partial} (RoPE on part of each head) is not supported yet")
    window = _sliding_window(cfg)
    qkv_bias = cfg["model_type"] == "qwen2" or bool(cfg.get("attention_bias", False))  # Qwen2: always, o_proj none
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
        qk_norm=cfg["model_type"] == "qwen3",
        fused_projections=cfg["model_type"] == "phi3",
        sliding_window=window,
        activation="silu",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg),
        pad_token_id=cfg.get("pad_token_id"),
    )


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
