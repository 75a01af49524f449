"""Checked access to a checkpoint's tensors: every weight is validated against the shape the config implies."""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..errors import ModelLoadError


class WeightSource:
    def __init__(self, tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype, device: torch.device, origin: str):
        self.tensors, self.dtype, self.device, self.origin = tensors, dtype, device, origin

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        if name not in self.tensors:
            raise ModelLoadError(f"{self.origin}: missing tensor {name!r}")
        t = self.tensors[name]
        if tuple(t.shape) != tuple(shape):
            raise ModelLoadError(
                f"{self.origin}: tensor {name!r} has shape {tuple(t.shape)}, the config implies {tuple(shape)}"
            )
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def cat(self, names: Sequence[str], shapes: Sequence[Sequence[int]]) -> torch.Tensor:
        """Fuse several matrices (q/k/v, gate/up) into one along the output axis: one GEMM instead of several."""
        return torch.cat([self.get(n, s) for n, s in zip(names, shapes)], dim=0).contiguous()

    def get_t(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        """A [out, in] matrix stored transposed, [in, out] contiguous, for `ops.linear`."""
        return self.get(name, shape).t().contiguous()

    def cat_t(self, names: Sequence[str], shapes: Sequence[Sequence[int]]) -> torch.Tensor:
        """`cat` stored transposed: [in, sum(out)]."""
        return self.cat(names, shapes).t().contiguous()


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

    def get_t(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        return torch.empty(tuple(reversed(self._check(name, shape))), dtype=self.dtype, device=self.device)

    def cat_t(self, names: Sequence[str], shapes: Sequence[Sequence[int]]) -> torch.Tensor:
        rows = sum(self._check(n, s)[0] for n, s in zip(names, shapes))
        return torch.empty((*reversed(shapes[0][1:]), rows), dtype=self.dtype, device=self.device)
