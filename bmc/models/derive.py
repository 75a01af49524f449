"""Models derived from a loaded model's own weights, used as speculative drafters ("self-drafts").

- `truncate_layers(model, n)`: the first n decoder layers + the final norm + lm_head. A shallow copy of the network
  whose layer objects and tensors are the target's own (no weight is copied).
- `quantize_int8(model)`: every matrix quantized to int8 per output channel (symmetric, scale = max|w| / 127).

int8 matmul on CPU: fbgemm's dynamic int8 linear (activations quantized per call to 7 bits) was faster than the fp32
GEMMs at every M measured, and `torch._weight_int8pack_mm` (int8 weights, fp32 activations) slower than fp32 (figures:
docs/performance.md, "Figures behind the code's choices"). So `Int8Linear` uses fbgemm where torch has it (x86 CPUs) and otherwise dequantizes on the fly (correct, slower
than the fp32 original). The draft's numerics only change how many drafts get accepted, never the output."""
from __future__ import annotations

import copy
import dataclasses
import warnings

import torch

from . import Model
from .moe import MOE_ATTRS
from .ops import Linear, linear


def _fbgemm_available(device: torch.device) -> bool:
    return (device.type == "cpu" and "fbgemm" in torch.backends.quantized.supported_engines
            and hasattr(torch.ops.quantized, "linear_dynamic"))


class Int8Linear:
    """A Linear's weight in int8 per output channel; called like Linear (x [..., in] -> [..., out])."""

    __slots__ = ("q", "scale", "b", "packed")

    def __init__(self, lin: Linear) -> None:
        w = lin.dense_weight().t().float()  # [out, in] (a quantized target's weights dequantized)
        self.scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        self.q = torch.round(w / self.scale[:, None]).clamp_(-127, 127).to(torch.int8).t().contiguous()  # [in, out]
        self.b = lin.b
        self.packed = None
        if _fbgemm_available(w.device):
            with warnings.catch_warnings():  # torch marks quantized tensors deprecated; fbgemm's int8 GEMM needs one
                warnings.simplefilter("ignore")
                qw = torch._make_per_channel_quantized_tensor(
                    self.q.t().contiguous(), self.scale.double(), torch.zeros(w.shape[0], dtype=torch.long), 0)
                bias = lin.b.float() if lin.b is not None else None
                self.packed = torch.ops.quantized.linear_prepack(qw, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            # reduce_range: 7-bit activations, so fbgemm's 16-bit pair sums cannot saturate on CPUs without VNNI
            return torch.ops.quantized.linear_dynamic(x.float(), self.packed, True).to(x.dtype)
        return linear(x, self.q.to(x.dtype) * self.scale.to(x.dtype), self.b)


def truncate_layers(model: Model, n: int) -> Model:
    """The model's first n layers, final norm and lm_head, sharing every tensor with `model`."""
    net = copy.copy(model.net)
    net.layers = model.net.layers[:n]
    net.cfg = dataclasses.replace(model.config, num_layers=n)
    return Model(config=net.cfg, net=net, tokenizer=model.tokenizer, path=f"{model.path} (first {n} layers)",
                 dtype=model.dtype, device=model.device)


def quantize_int8(model: Model) -> Model:
    """A copy of the model whose matrices are Int8Linear (embeddings, norms and biases stay as they are)."""
    net = copy.copy(model.net)
    net.layers = [copy.copy(layer) for layer in model.net.layers]
    if getattr(net, "embed", False) is None:  # a quantized table read from panels (the LM head's, or its own):
        # a float copy, looked up as a float table is
        table = getattr(net, "embed_q", None) or model.net.lm_head
        net.embed, net.embed_q = table.dense_weight().t(), None
    for obj in [net, *net.layers]:
        for name, value in list(vars(obj).items()):
            # routers and experts stay as they are: experts are run as column slices of their stacked matrices
            if isinstance(value, Linear) and name not in MOE_ATTRS:
                setattr(obj, name, Int8Linear(value))
    return Model(config=model.config, net=net, tokenizer=model.tokenizer, path=f"{model.path} (int8)",
                 dtype=model.dtype, device=model.device)
