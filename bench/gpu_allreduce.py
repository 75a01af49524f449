"""A decode step's all-reduce on 2+ GPUs, four ways (issue 48, item 1): NCCL eagerly, NCCL captured in a CUDA graph,
torch's symmetric-memory one-shot all-reduce (P2P loads over NVLink, no multicast) captured in a CUDA graph, and
bmc's one-shot all-reduce fused with the residual add and RMSNorm that follow it in a decode step
(bmc/parallel/allreduce_norm.py), against NCCL in a graph followed by bmc's add_rms_norm kernel, the pair it
replaces.

    python bench/gpu_allreduce.py --gpus 2 --out DIR     # bf16 rows of 4096 (Llama-7B's hidden size), B = 1, 8, 32

A tp=N decode step of a Llama-7B shape runs 2 all-reduces a layer (after o and after down), 64 a step: their
latency, not their bandwidth, is what tp=N pays at batch 1. Each way: `--copies` all-reduces captured in one graph
(or run in a row eagerly), the median over 30 replays divided by the copies, on every rank at once (rank 0's figure
reported). Also whether the ways give the same sums (bit for bit). NVLink multicast stays off
(NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1). Writes gpu-allreduce-tp{N}.json and a PNG."""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN = 4096


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD.group_name
    rows = {}
    for B in args.batches:
        n = B * HIDDEN
        torch.manual_seed(rank)
        x = torch.randn(n, device=dev, dtype=torch.bfloat16)
        ref = x.clone()
        dist.all_reduce(ref)
        y = x.clone()
        def nccl() -> None:
            y.copy_(x)
            dist.all_reduce(y)
        row: dict = {"bytes": 2 * n}
        def copy_only() -> None:
            y.copy_(x)
        row["copy_only_graph_us"] = timed(copy_only, True, args.copies)
        row["nccl_eager_us"] = timed(nccl, False, args.copies)
        row["nccl_graph_us"] = timed(nccl, True, args.copies)
        try:  # a build or host without it: said so in the result
            buf = symm_mem.empty(n, device=dev, dtype=torch.bfloat16)
            symm_mem.rendezvous(buf, group)
            out: list[torch.Tensor] = []
            def one_shot() -> None:
                buf.copy_(x)
                out[:] = [torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group)]
            one_shot()
            torch.cuda.synchronize()
            row["symm_same_sums_as_nccl"] = bool(torch.equal(out[0], ref))
            row["symm_one_shot_eager_us"] = timed(one_shot, False, args.copies)
            row["symm_one_shot_graph_us"] = timed(one_shot, True, args.copies)
        except Exception as e:
            row["symm_one_shot_error"] = f"{type(e).__name__}: {e}"[:300]
        if not args.no_fused:
            try:
                row.update(fused_way(B, x, rank, world, group, dev, args.copies))
            except Exception as e:
                row["fused_error"] = f"{type(e).__name__}: {e}"[:300]
        rows[B] = row
        if rank == 0:
            print(f"  B={B:3d} ({2 * n // 1024} KiB): " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                             for k, v in row.items() if k != "bytes"), flush=True)
    if rank == 0:
        report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "gpus": world,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())), "hidden": HIDDEN, "dtype": "bfloat16",
                  "copies": args.copies, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
                  "TORCH_SYMM_MEM_DISABLE_MULTICAST": os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST"),
                  "batches": rows}
        out_dir = Path(args.out)
        (out_dir / f"gpu-allreduce-tp{world}.json").write_text(json.dumps(report, indent=1))
        plot(report, out_dir / f"gpu-allreduce-tp{world}.png")
    dist.barrier()
    dist.destroy_process_group()


def fused_way(B: int, x: torch.Tensor, rank: int, world: int, group: str, dev: torch.device,
              copies: int) -> dict:
    """bmc's fused one-shot all-reduce + add + RMSNorm (bmc/parallel/allreduce_norm.py, the copy of the partial rows
    into its buffer included) against NCCL in a graph + bmc's add_rms_norm: µs a site in a graph of `copies` sites,
    and whether the two give the same (s, y) bit for bit."""
    from bmc.models.fused_triton import add_rms_norm
    from bmc.parallel.allreduce_norm import AllReduceNorm

    D, eps = HIDDEN, 1e-5
    torch.manual_seed(100)  # the residual and the norm's weight: the same on every rank, as in a step
    res = torch.randn(B, 1, D, device=dev, dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(D, device=dev)).to(torch.bfloat16)
    part = x.view(B, 1, D)
    fused_ar = AllReduceNorm(D, torch.bfloat16, dev, max_rows=B)

    def fused() -> None:  # the slots taken in turn, as in a step
        fused_ar.add_norm(res, part, w, eps)

    y = torch.empty(B, 1, D, device=dev, dtype=torch.bfloat16)

    def nccl_norm() -> None:
        y.copy_(part)
        dist.all_reduce(y)
        add_rms_norm(res, y, w, eps)

    fused_ar.begin_step()
    s_out, y_out = fused_ar.add_norm(res, part, w, eps)
    torch.cuda.synchronize()
    dist.barrier()
    y.copy_(part)
    dist.all_reduce(y)
    s_ref, y_ref = add_rms_norm(res, y, w, eps)
    out = {"fused_same_as_nccl_norm": bool(torch.equal(s_out, s_ref) and torch.equal(y_out, y_ref))}
    out["nccl_norm_graph_us"] = timed(nccl_norm, True, copies)
    fused_ar.begin_step()
    out["fused_graph_us"] = timed(fused, True, copies)
    out["fused_eager_us"] = timed(fused, False, copies)
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ways = ["nccl_graph_us", "symm_one_shot_graph_us", "copy_only_graph_us", "nccl_norm_graph_us", "fused_graph_us"]
    bs = list(report["batches"])
    fig, ax = plt.subplots(figsize=(7, 4))
    w = 0.8 / len(ways)
    for j, way in enumerate(ways):
        ax.bar([i + j * w for i in range(len(bs))], [report["batches"][b].get(way, 0) for b in bs], w, label=way)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(bs))], [f"B={b} ({report['batches'][b]['bytes'] // 1024} KiB)" for b in bs])
    ax.set_ylabel("µs per all-reduce")
    ax.set_title(f"bf16 all-reduce of B x {report['hidden']}, {report['gpus']} x {report['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--copies", type=int, default=64, help="all-reduces per graph (a 32-layer step has 64)")
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--no-fused", action="store_true", help="leave out the fused all-reduce + add + RMSNorm")
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
