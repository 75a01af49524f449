"""Checked access to a checkpoint's tensors: every weight is validated against the shape the config implies."""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence, Union

import torch

from ..errors import ModelLoadError
from .gguf import DeferredBlocks
from .quant import QuantWeight, is_half, quantize

if TYPE_CHECKING:
    from .quant_torch import TorchQuantWeight


Matrix = Union[torch.Tensor, QuantWeight]


class WeightSource:
    """quantize: "q8_0" / "q4_0" quantizes every GEMM matrix (get_t, cat_t, as_linear) at load; a QuantWeight in
    `tensors` (a GGUF file's blocks kept as stored) is handed to the GEMM as it is."""

    def __init__(self, tensors: Mapping[str, Matrix], *, dtype: torch.dtype, device: torch.device, origin: str,
                 quantize: str | None = None, activations: str = "float"):
        self.tensors, self.dtype, self.device, self.origin = tensors, dtype, device, origin
        self.quantize = quantize
        self.activations = activations  # "int8": CUDA's quantized matrices kept for the int8-x GEMV (quant_i8x.py)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def finish(self, prefix: str, obj: object) -> object:
        """A part of the model (a layer "layers.N", then the net "net") has taken all its tensors: nothing to do
        here (weight_file.StreamingSource writes it out)."""
        return obj

    def _entry(self, name: str, shape: Sequence[int]) -> Matrix:
        if name not in self.tensors:
            raise ModelLoadError(f"{self.origin}: missing tensor {name!r}")
        t = self.tensors[name]
        if isinstance(t, DeferredBlocks):
            t = t.load()
        if tuple(t.shape) != tuple(shape):
            raise ModelLoadError(
                f"{self.origin}: tensor {name!r} has shape {tuple(t.shape)}, the config implies {tuple(shape)}"
            )
        return t

    def get(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        """A tensor in the model's dtype (a quantized matrix dequantized)."""
        t = self._entry(name, shape)
        if isinstance(t, QuantWeight):
            t = t.dequantize()
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def get_matrix(self, name: str, shape: Sequence[int]) -> Matrix:
        """A matrix for the GEMMs or a tied embedding: a QuantWeight as stored, else get()'s tensor."""
        t = self._entry(name, shape)
        return t if isinstance(t, QuantWeight) else self.get(name, shape)

    def cat(self, names: Sequence[str], shapes: Sequence[Sequence[int]]) -> torch.Tensor:
        """Fuse several matrices (q/k/v, gate/up) into one along the output axis: one GEMM instead of several."""
        return torch.cat([self.get(n, s) for n, s in zip(names, shapes)], dim=0).contiguous()

    def get_t(self, name: str, shape: Sequence[int]) -> Matrix:
        """A [out, in] matrix for Linear: stored transposed, [in, out] contiguous, for `ops.linear`; or quantized."""
        return self.as_linear(self.get_matrix(name, shape))

    def cat_t(self, names: Sequence[str], shapes: Sequence[Sequence[int]]) -> Matrix:
        """`cat` for Linear: [in, sum(out)], or quantized blocks stacked when every part is kept quantized (parts of
        different types as one "mixed" matrix)."""
        parts = [self.get_matrix(n, s) for n, s in zip(names, shapes)]
        if all(isinstance(p, QuantWeight) for p in parts) and QuantWeight.can_cat(parts):  # type: ignore[arg-type]
            return self.as_linear(QuantWeight.cat(parts))  # type: ignore[arg-type]
        return self.as_linear(self.cat(names, shapes))

    def as_linear(self, w: Matrix) -> "Matrix | TorchQuantWeight":
        """An [out, in] matrix as Linear takes it: kept quantized, quantized now, or transposed [in, out].
        Quantized where the native CPU step does not run (CUDA; a CPU in bfloat16 or with BMC_NATIVE=0): held on
        the device for torch ops to dequantize per GEMM (quant_torch.py)."""
        if not isinstance(w, QuantWeight) and self.quantize is not None:
            w = quantize(w, self.quantize)
        if isinstance(w, QuantWeight):
            from ..kernels.native import native_supported

            if not native_supported(self.device, self.dtype) and is_half(w.kind):  # torch's own GEMM
                return w.dequantize().to(device=self.device, dtype=self.dtype).t().contiguous()
            if not native_supported(self.device, self.dtype):
                from .quant_torch import TorchQuantWeight

                return TorchQuantWeight(w, self.device, self.dtype, int8_activations=self.activations == "int8")
            return w
        return w.t().contiguous()


class ShapeSource(WeightSource):
    """The shapes of a checkpoint's tensors without their values: every tensor handed out is uninitialised memory
    of the right shape (untouched pages cost nothing), for a model whose weights a weight file then replaces
    (weight_file.load_mapped). Names and shapes are checked as WeightSource checks them."""

    def get(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        super_shape = self._check(name, shape)
        return torch.empty(super_shape, dtype=self.dtype, device=self.device)

    def _check(self, name: str, shape: Sequence[int]) -> tuple[int, ...]:
        if name not in self.tensors:
            raise ModelLoadError(f"{self.origin}: missing tensor {name!r}")
        if tuple(self.tensors[name].shape) != tuple(shape):
            raise ModelLoadError(
                f"{self.origin}: tensor {name!r} has shape {tuple(self.tensors[name].shape)}, the config implies "
                f"{tuple(shape)}")
        return tuple(shape)

    def cat(self, names: Sequence[str], shapes: Sequence[Sequence[int]]) -> torch.Tensor:
        rows = sum(self._check(n, s)[0] for n, s in zip(names, shapes))
        return torch.empty((rows, *shapes[0][1:]), dtype=self.dtype, device=self.device)

    def get_matrix(self, name: str, shape: Sequence[int]) -> Matrix:
        t = self.tensors.get(name)
        if isinstance(t, QuantWeight):
            self._check(name, shape)
            return t
        return self.get(name, shape)

    def as_linear(self, w: Matrix) -> Matrix:
        if isinstance(w, QuantWeight):
            return w
        if self.quantize is not None:  # the shapes of what quantize() would make, without the work
            return QuantWeight(self.quantize, tuple(w.shape), None)  # type: ignore[arg-type]
        return torch.empty(tuple(reversed(w.shape)), dtype=self.dtype, device=self.device)
