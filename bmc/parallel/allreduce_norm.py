"""Tensor parallelism on CUDA: a row-parallel GEMM's all-reduce fused with the residual add and RMSNorm that follow
it in a decode step (decode_cuda.py), one kernel over torch's symmetric memory where NCCL's all-reduce and bmc's
add_rms_norm kernel ran (docs/performance.md, "A decode step's all-reduce, in a graph or not": 7.15 against
9.80 µs a sublayer at batch 1 on two H200s, the same bits; slower from batch 32, so batches up to MAX_ROWS only).

Each rank copies its partial rows into its slot of a symmetric buffer; program `row` sets its flag in each peer's
signal pad, waits for each peer's flag in its own (and clears it: pads stay zero between uses, as torch's own
kernels leave them), sums the W partial rows in rank order in float32 (every rank the same bits; at W = 2 NCCL's
sum, bit for bit), rounds the sum to the dtype, and does add_rms_norm's arithmetic with it. Two slots, taken in
turn from slot 0 at every step's start (a step has two sites a layer, so an even count): a rank writes a slot again
only two sites later, past the barrier of the site between, which no peer passes before it has read that slot and
cleared its flag. NVLink multicast is not used (the device hosts require it off). The signal pads are this module's
alone: torch's own symmetric-memory ops on the same buffer would use the same words."""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("bmc.tp")

MAX_ROWS = 8  # decode rows a step up to which the fused kernel runs (one program a row; NCCL's is faster at 32)


def _kernel() -> Any:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from ..models.gdc import wait_and_release

    @triton.jit(do_not_specialize=["slot"])
    def allreduce_add_rms_norm(bufs_ptr, sigs_ptr, x_ptr, w_ptr, s_ptr, y_ptr, slot, D, eps, me: tl.constexpr,
                               W: tl.constexpr, BMAX: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr,
                               GDC: tl.constexpr):
        wait_and_release(GDC)
        row = tl.program_id(0)
        for p in tl.static_range(W):
            if p != me:
                peer_sig = tl.load(sigs_ptr + p).to(tl.pointer_type(tl.int32))
                tl.atomic_xchg(peer_sig + (slot * W + me) * BMAX + row, 1, sem="release", scope="sys")
        my_sig = tl.load(sigs_ptr + me).to(tl.pointer_type(tl.int32))
        for p in tl.static_range(W):
            if p != me:
                while tl.atomic_cas(my_sig + (slot * W + p) * BMAX + row, 1, 0, sem="acquire", scope="sys") != 1:
                    pass
        tl.debug_barrier()  # every thread's reads below after the waiting thread's acquire (not left to the compiler)
        off = tl.arange(0, BLOCK)
        mask = off < D
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(W):
            buf = tl.load(bufs_ptr + p).to(tl.pointer_type(x_ptr.dtype.element_ty))
            acc += tl.load(buf + (slot * BMAX + row) * D + off, mask=mask, other=0, volatile=True).to(tl.float32)
        x = tl.load(x_ptr + row * D + off, mask=mask, other=0)
        r = acc.to(x.dtype)
        # from here add_rms_norm's arithmetic (fused_triton._add_rms_norm_kernel), rounding where it rounds
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(s_ptr + row * D + off, x, mask=mask)
        h = x.to(tl.float32)
        inv = libdevice.rsqrt(tl.sum(h * h, axis=0) / D + eps)
        w = tl.load(w_ptr + off, mask=mask, other=0).to(tl.float32)
        if ROUND:
            y = w * (h * inv).to(x.dtype).to(tl.float32)
        else:
            y = h * inv * w
        tl.store(y_ptr + row * D + off, y.to(y_ptr.dtype.element_ty), mask=mask)

    return allreduce_add_rms_norm


_KERNEL: list[Any] = []


class AllReduceNorm:
    """A rank's fused all-reduce + add + RMSNorm for decode steps of up to max_rows rows of width `hidden`."""

    def __init__(self, hidden: int, dtype: torch.dtype, device: torch.device, group: Any = None,
                 max_rows: int = MAX_ROWS) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.hidden, self.dtype, self.max_rows = hidden, dtype, max_rows
        self.buf = symm_mem.empty(2, max_rows, hidden, dtype=dtype, device=device)
        hdl = symm_mem.rendezvous(self.buf, self.group.group_name)
        need = 2 * self.world * max_rows * 4
        if getattr(hdl, "signal_pad_size", need) < need:
            raise RuntimeError(f"a signal pad of {hdl.signal_pad_size} bytes; {need} needed")
        self.bufs = torch.tensor(list(hdl.buffer_ptrs), dtype=torch.int64, device=device)
        self.sigs = torch.tensor(list(hdl.signal_pad_ptrs), dtype=torch.int64, device=device)
        self.slot = 0
        if not _KERNEL:
            _KERNEL.append(_kernel())

    def fits(self, x: torch.Tensor) -> bool:
        """Whether a step of x [B, 1, D] takes the fused kernel (the same answer on every rank: B, D and dtype
        are the same there)."""
        return x.shape[0] <= self.max_rows and x.shape[-1] == self.hidden and x.dtype == self.dtype

    def begin_step(self) -> None:
        self.slot = 0

    def add_norm(self, x: torch.Tensor, partial: torch.Tensor, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, rms_norm(s, w, eps)) with s = x + (partial summed over the ranks): add_rms_norm(x, all_reduce(partial))
        in one kernel. x, partial [B, 1, D]."""
        import triton

        from ..models import gdc

        B, D = x.shape[0], self.hidden
        slot = self.slot
        self.slot ^= 1
        self.buf[slot, :B].copy_(partial.reshape(B, D))
        x2 = x.reshape(B, D).contiguous()
        s, y = torch.empty_like(x2), torch.empty_like(x2)
        block = triton.next_power_of_2(D)
        on, kw = gdc.launch(x.device)
        _KERNEL[0][(B,)](self.bufs, self.sigs, x2, w, s, y, slot, D, eps, me=self.rank, W=self.world,
                         BMAX=self.max_rows, ROUND=x.dtype != torch.float32, BLOCK=block, GDC=on,
                         num_warps=min(16, max(4, block // 512)), **kw)
        return s.view(x.shape), y.view(x.shape)


def attach(model: Any, group: Any = None) -> None:
    """Give a CUDA rank's model its AllReduceNorm (net.tp_allreduce), where every rank can build one (decided
    together: a rank alone on the fused path would wait for ever); otherwise the step keeps NCCL. Two ranks only:
    there its sums are NCCL's bit for bit (tested on two H200s); with more, NCCL's order differs by algorithm, so
    steps on the fused path and on NCCL's would part in the last bits, and it has not run on 4 GPUs."""
    net, dev = model.net, model.device
    ok, err = 1, ""
    fused = None
    world = dist.get_world_size(group if group is not None else dist.group.WORLD)
    try:
        if world != 2:
            raise RuntimeError(f"{world} ranks (built for 2)")
        fused = AllReduceNorm(model.config.hidden_size, model.dtype, dev, group)
    except Exception as e:  # more than two ranks, a torch without symmetric memory, or a host without P2P
        ok, err = 0, f"{type(e).__name__}: {e}"
    flag = torch.tensor([ok], device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    if int(flag.item()) == 1:
        net.tp_allreduce = fused
    else:
        net.tp_allreduce = None
        log.info("tensor parallel decode keeps NCCL's all-reduce (fused all-reduce + norm unavailable: %s)",
                 err or "on another rank")
