"""A rank's part of a model under tensor parallelism (Megatron's layout with seed 004's head policy): the fused QKV
projection column-parallel over the rank's query and KV heads (sharding.py), the output projection row-parallel
with one all-reduce, the MLP's gate/up (or fc1) column-parallel over a share of the intermediate width and its down
(or fc2) row-parallel with one all-reduce, the LM head split over the vocabulary with one all-gather, so every rank
sees the whole logits and makes the same choices. Embeddings, norms and RoPE are replicated.

The rank runs bmc's PyTorch path (the native CPU step has no collectives): each row-parallel GEMM's partial sums
are all-reduced before they join the residual stream, so the logits equal one rank's within float rounding (the
sums are ordered differently), and the greedy tokens are the same."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..errors import UnsupportedModelError
from ..models import Model
from ..models.ops import Linear
from ..models.weights import ShapeSource
from .sharding import RankHeads, shard_heads, split_even


COLLECTIVE_SECONDS = [0.0]  # time this process spent in the forward's collectives (bench/tp.py reads it)


class RowParallelLinear(Linear):
    """x @ W[rows of this rank] summed over the ranks (one all-reduce); the bias, on rank 0 only, is in the sum."""

    __slots__ = ("group",)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the sum (what __call__ all-reduces): for a fused all-reduce (allreduce_norm.py)."""
        return super().__call__(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = super().__call__(x).contiguous()
        t = time.perf_counter()
        dist.all_reduce(y, group=self.group)
        COLLECTIVE_SECONDS[0] += time.perf_counter() - t
        return y


class VocabParallelHead(Linear):
    """The LM head over this rank's share of the vocabulary (padded to the same width on every rank), the shares
    all-gathered into the whole logits."""

    __slots__ = ("group", "vocab")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = super().__call__(x).contiguous()
        parts = [torch.empty_like(y) for _ in range(dist.get_world_size(self.group))]
        t = time.perf_counter()
        dist.all_gather(parts, y, group=self.group)
        COLLECTIVE_SECONDS[0] += time.perf_counter() - t
        return torch.cat(parts, dim=-1)[..., : self.vocab]


def _linear(cls: type, wt: torch.Tensor, b: torch.Tensor | None, **attrs: Any) -> Linear:
    lin = cls(wt.contiguous(), b.contiguous() if b is not None else None)
    for k, v in attrs.items():
        setattr(lin, k, v)
    return lin


def _columns(lin: Linear, cols: torch.Tensor) -> Linear:
    return _linear(Linear, lin.wt[:, cols], lin.b[cols] if lin.b is not None else None)


def _rows(lin: Linear, rows: torch.Tensor, rank: int, group: Any) -> Linear:
    return _linear(RowParallelLinear, lin.wt[rows], lin.b if rank == 0 else None, group=group)


def _head_columns(heads: tuple[int, ...], hd: int, offset: int = 0) -> list[int]:
    return [offset + h * hd + e for h in heads for e in range(hd)]


def shard_model(model: Model, rank: int, world: int, group: Any = None) -> RankHeads:
    """Turn `model` (loaded whole, PyTorch path: float weights kept as [in, out]) into rank `rank`'s part in place;
    returns its heads. model.config becomes the rank's (its heads, its MLP width); the whole model's stays in
    model.full_config (the cost model and every choice that must agree across ranks read that one)."""
    cfg = model.config
    if cfg.num_experts:
        raise UnsupportedModelError(f"tensor parallelism of a mixture-of-experts model ({cfg.model_type}): experts "
                                    "are not sharded across ranks yet")
    if any(lin.wt is None for lin in model.linears()):
        raise UnsupportedModelError("tensor parallelism runs float weights (quant='none'); quantized weights are "
                                    "not sharded yet")
    heads = shard_heads(cfg.num_heads, cfg.num_kv_heads, world)[rank]
    hd, h, kvh = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    net = model.net
    opt = cfg.model_type == "opt"
    inter = cfg.intermediate_size
    mine = split_even(range(inter), world)[rank]
    if not mine:
        raise UnsupportedModelError(f"an MLP width of {inter} over {world} ranks leaves rank {rank} none")
    q_cols = _head_columns(heads.q_heads, hd)
    k_cols = _head_columns(heads.kv_heads, hd, h * hd)
    v_cols = _head_columns(heads.kv_heads, hd, (h + (h if opt else kvh)) * hd)
    qkv_cols = torch.tensor(q_cols + k_cols + v_cols)
    o_rows = torch.tensor(q_cols)
    mlp = torch.tensor(mine)
    for L in net.layers:
        L.qkv = _columns(L.qkv, qkv_cols)
        L.o = _rows(L.o, o_rows, rank, group)
        if opt:
            L.fc1 = _columns(L.fc1, mlp)
            L.fc2 = _rows(L.fc2, mlp, rank, group)
        else:
            L.gate_up = _columns(L.gate_up, torch.cat([mlp, mlp + inter]))
            L.down = _rows(L.down, mlp, rank, group)
            L.qk_width = (len(heads.q_heads) + len(heads.kv_heads)) * hd
    head = net.lm_head
    V = head.out_features
    width = -(-V // world)
    if net.embed is None or net.embed.data_ptr() == head.wt.data_ptr():  # tied: the lookup keeps the whole table
        net.embed = head.wt.t().contiguous()
    cols = torch.arange(rank * width, (rank + 1) * width)
    wt = torch.zeros(head.wt.shape[0], width, dtype=head.wt.dtype, device=head.wt.device)
    have = cols[cols < V]
    wt[:, : have.numel()] = head.wt[:, have]
    net.lm_head = _linear(VocabParallelHead, wt, None, group=group, vocab=V)
    local = dataclasses.replace(cfg, num_heads=len(heads.q_heads), num_kv_heads=len(heads.kv_heads),
                                intermediate_size=len(mine))
    model.full_config = cfg
    model.config = net.cfg = local
    return heads


class MatrixShapes(ShapeSource):
    """A checkpoint's shapes for a model whose matrices are never allocated whole: every matrix a meta tensor (a
    shape, no memory), every vector (norms, biases) uninitialised memory on the device, and what the model computes
    at load (RoPE's frequencies) real. shard_model then cuts the meta matrices into the rank's parts and fill_random
    allocates only those (a Llama-2-70B shape on 4 GPUs: 35 GB a rank, never the 138 GB of the whole)."""

    def get(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        shape = self._check(name, shape)
        return torch.empty(shape, dtype=self.dtype, device="meta" if len(shape) > 1 else self.device)

    def cat(self, names: Sequence[str], shapes: Sequence[Sequence[int]]) -> torch.Tensor:
        rows = sum(self._check(n, s)[0] for n, s in zip(names, shapes))
        return torch.empty((rows, *shapes[0][1:]), dtype=self.dtype,
                           device="meta" if len(shapes[0]) > 1 else self.device)

    def as_linear(self, w: Any) -> Any:
        return torch.empty(tuple(reversed(w.shape)), dtype=self.dtype, device="meta")  # [in, out], as Linear holds


@torch.no_grad()
def fill_random(model: Model, seed: int = 0) -> None:
    """Weights for a benchmark of a model built from its shapes alone (ShapeSource: untouched memory; MatrixShapes:
    meta matrices, allocated here on the model's device): every matrix N(0, 0.02), every vector (norms) ones, a
    bias zeros. Run after shard_model, so a rank only ever touches its part. Drawn on the model's device (a CPU
    generator would take minutes for a rank of a 70B shape)."""
    dev = model.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    def real(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device=dev) if t.is_meta else t
    net = model.net
    for obj in [net, *net.layers]:
        for name, v in list(vars(obj).items()):
            if isinstance(v, Linear):
                v.wt = real(v.wt).normal_(0.0, 0.02, generator=gen)
                if v.b is not None:
                    v.b = real(v.b).zero_()
            elif isinstance(v, torch.Tensor) and "freq" not in name and v.is_floating_point():
                v = real(v)
                setattr(obj, name, v.normal_(0.0, 0.02, generator=gen) if v.dim() > 1 else v.fill_(1.0))
