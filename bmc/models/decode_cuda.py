"""The Llama family's decode step on CUDA with its glue fused: per layer the four GEMMs, the attention and three
small kernels (fused_triton.py) instead of ~30 (issue 48, item 3; measured in docs/performance.md, "Batch-1 decode
step on CUDA").

A layer runs: add_rms_norm (the residual add of the previous sublayer and this one's norm, one kernel), the QKV
GEMM, rope_write (RoPE of q and k, k and v into the cache at the step's column), the attention (dense attention as
fused_triton.decode_attention, any other the step's own, on the cache's views), the o GEMM, add_rms_norm, the
gate|up GEMM, silu_mul, the down GEMM; the last layer's residual add carries the final norm. Under
activations="int8" (`Glue`) the norms, silu_mul and the attention also write the next GEMM's int8 rows, so no
GEMM rounds its own input. The eager step and the CUDA graph's run the same kernels, so graphs replay the eager
step's tokens; on Hopper and later each Triton kernel is launched while the one before it runs (gdc.py).

MODE picks the glue: "triton" (default), "compile" (the same torch ops as the plain path, each piece through
torch.compile without its own CUDA graphs: bmc captures its graphs itself; for measurement), "off" (the plain
path in llama.py). Env BMC_CUDA_FUSED sets it at import."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

from .ops import apply_rope, rms_norm

if TYPE_CHECKING:
    from ..attention import AttentionFn
    from ..kv import KVCache
    from .llama import LlamaModel

MODE = os.environ.get("BMC_CUDA_FUSED", "triton")
# the decode attention under MODE "triton": "triton" (fused_triton.decode_attention) or "sdpa" (the step's own)
ATTENTION = os.environ.get("BMC_CUDA_DECODE_ATTENTION", "triton")
COMPILE_MODE = os.environ.get("BMC_CUDA_FUSED_COMPILE", "default")  # measured ahead of max-autotune-no-cudagraphs
_triton_ok: bool | None = None


def triton_ok() -> bool:
    global _triton_ok
    if _triton_ok is None:
        try:
            import triton  # noqa: F401

            _triton_ok = True
        except ImportError:
            _triton_ok = False
    return _triton_ok


def applies(net: "LlamaModel", cache: "KVCache", attention: "AttentionFn", t: int) -> bool:
    """Decode rows (one token each) of a plain Llama-family layer stack on CUDA, the cache in the model's dtype,
    an attention that takes decoded K and V: what the fused glue covers. Everything else runs llama.py's loop."""
    cfg = net.cfg
    return (MODE != "off" and t == 1 and cache.device.type == "cuda" and cache.same_dtype
            and not getattr(attention, "reads_stored", False) and cfg.attn_softcap is None and not cfg.qk_norm
            and not cfg.num_experts
            and not cfg.sandwich_norms and cfg.activation == "silu" and cfg.head_dim % 2 == 0
            and cache.kv.stride(-1) == 1 and (MODE == "compile" or triton_ok()))


def step_attention(attention: "AttentionFn") -> "AttentionFn":
    """The attention the fused step runs for `attention`: the Triton decode attention in place of the dense one
    (MODE and ATTENTION "triton"), else `attention` itself (bench/gpu.py asks too)."""
    from ..attention import dense_attention

    if MODE == "triton" and ATTENTION == "triton" and attention is dense_attention:
        from .fused_triton import decode_attention

        return decode_attention
    return attention


# the plain path's ops, for MODE "compile" (and as the tests' references)
def add_rms_norm_ref(x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = x if r is None else x + r
    return s, rms_norm(s, w, eps)


def rope_write_ref(a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, heads: int,
                   kv_heads: int, col: torch.Tensor) -> torch.Tensor:
    B, hd = a.shape[0], kv.shape[-1]
    qk = apply_rope(a[..., : (heads + kv_heads) * hd].view(B, 1, heads + kv_heads, hd), cos, sin)
    kv[0].index_copy_(2, col, qk[:, :, heads:].transpose(1, 2))
    kv[1].index_copy_(2, col, a[..., (heads + kv_heads) * hd:].view(B, 1, kv_heads, hd).transpose(1, 2))
    return qk[:, :, :heads].transpose(1, 2)


def silu_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


_compiled: dict[str, Callable[..., Any]] = {}


def _glue() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    if MODE == "compile":
        if not _compiled:
            for name, fn in (("norm", add_rms_norm_ref), ("rope", rope_write_ref), ("silu", silu_mul_ref)):
                _compiled[name] = torch.compile(fn, mode=COMPILE_MODE)
        return _compiled["norm"], _compiled["rope"], _compiled["silu"]
    from .fused_triton import add_rms_norm, rope_write, silu_mul

    return add_rms_norm, rope_write, silu_mul


class Glue(NamedTuple):
    """What differs between the float step and the activations="int8" one: the norms' output for the next GEMM
    (a tensor, or its int8 rows), the GEMM on it, the MLP's activation, and whether the attention writes the o
    GEMM's int8 rows itself."""
    norm: Callable[..., Any]  # (x, r, w, eps) -> (x + r, the next GEMM's input)
    gemm: Callable[..., torch.Tensor]  # (Linear, input) -> [B, 1, N]
    act: Callable[..., Any]  # the gate|up output -> the down GEMM's input
    int8_rows: bool  # qkv, gate|up and down take int8 rows (quant_i8x.Int8Rows) from the glue
    attention_rounds_o: bool  # the attention writes the o GEMM's int8 rows (else the o GEMM rounds its input)


def glue_for(layers: Any, attention: "AttentionFn", head_dim: int, B: int, dtype: torch.dtype) -> Glue:
    """Under activations="int8" (every layer's qkv, gate|up and down on the int8-x GEMV) the norms and silu_mul
    also write their outputs' int8 rows (quant_i8x.py), and the attention the o GEMM's where it is the Triton
    one, so no GEMM takes a rounding kernel of its own: the same values as the GEMMs' own rounding, bit for bit
    (the plain path's tokens)."""
    norm, _, silu_mul = _glue()
    if not (MODE == "triton" and all(lin.int8_activations for L in layers for lin in (L.qkv, L.gate_up, L.down))):
        return Glue(norm, lambda lin, a: lin(a), silu_mul, False, False)
    from .fused_triton import add_rms_norm_int8, decode_attention, int8_rows_fit, silu_mul_int8

    def norm8(x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, Any]:
        s, _, rows = add_rms_norm_int8(x, r, w, eps)
        return s, rows

    rounds_o = (attention is decode_attention and int8_rows_fit(head_dim)
                and all(L.o.int8_activations for L in layers))
    return Glue(norm8, lambda lin, rows: lin.int8_rows(rows, dtype).view(B, 1, -1), silu_mul_int8, True, rounds_o)


def decode_layers(net: "LlamaModel", x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                  local_rope: tuple[torch.Tensor, torch.Tensor], cache: "KVCache", attention: "AttentionFn",
                  bias: torch.Tensor, local_bias: torch.Tensor | None) -> torch.Tensor:
    """x [B, 1, D] (the embeddings) through every layer; returns the final norm's output [B, 1, D]. bias and
    local_bias as llama.py's loop reads them (grouped for the attention)."""
    cfg = net.cfg
    B = x.shape[0]
    hd, h, kvh, eps = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.norm_eps
    final_norm, rope_write, _ = _glue()
    attention = step_attention(attention)
    col: int | torch.Tensor = cache.write_at if cache.write_at is not None else cache.length
    if MODE == "compile" and not isinstance(col, torch.Tensor):
        col = torch.tensor([col], device=x.device)
    layers = net.layers
    glue = glue_for(layers, attention, hd, B, x.dtype)
    attend_o: Callable[..., Any] | None = None  # the attention that writes the o GEMM's int8 rows
    if glue.attention_rounds_o:
        from .fused_triton import decode_attention_int8

        attend_o = decode_attention_int8
    # tensor parallel (bmc/parallel): o's and down's partial sums all-reduced inside the norm after them, one
    # kernel, where the rank has it and the step is small enough; else the row-parallel Linear all-reduces (NCCL)
    # (its arithmetic after the sum is the Triton add_rms_norm's, so MODE "triton" only)
    fused_ar = getattr(net, "tp_allreduce", None)
    if fused_ar is not None and (MODE != "triton" or glue.int8_rows or not fused_ar.fits(x)):
        fused_ar = None
    row_gemm, after_sum, last_sum = glue.gemm, glue.norm, final_norm
    if fused_ar is not None:
        fused_ar.begin_step()
        row_gemm = lambda lin, inp: lin.partial(inp)  # noqa: E731
        after_sum = last_sum = fused_ar.add_norm
    x, a = glue.norm(x, None, layers[0].ln1, eps)  # a: the next GEMM's input (a tensor, or its int8 rows)
    for i, L in enumerate(layers):
        kv = cache.kv[i]
        cos, sin = local_rope if L.local else rope
        q = rope_write(glue.gemm(L.qkv, a), cos, sin, kv, h, kvh, col)
        b = local_bias if L.local and local_bias is not None else bias
        if attend_o is not None:
            o = glue.gemm(L.o, attend_o(q, kv[0], kv[1], b, net.scale))
        else:
            o = row_gemm(L.o, attention(q, kv[0], kv[1], b, net.scale, layer=i).transpose(1, 2).reshape(B, 1, h * hd))
        x, a = after_sum(x, o, L.ln2, eps)
        m = row_gemm(L.down, glue.act(glue.gemm(L.gate_up, a)))
        last = i + 1 == len(layers)
        x, a = (last_sum if last else after_sum)(x, m, net.norm if last else layers[i + 1].ln1, eps)
    return a
