"""Tensor-parallel worker processes driven like one model: `bmc.load(path, tp=N)` starts N ranks (torch
multiprocessing, spawn), each joins a torch.distributed group (gloo on CPU ranks, NCCL on GPUs), loads the model
and keeps its part of it (shard.py); `bmc.generate(model, ...)` sends the request to every rank, each runs the same
engine over its own heads and cache (the same choices everywhere: the logits are all-gathered and every choice
reads them or the whole model's config), and rank 0's completions come back.

A rank that fails stops the group: its error comes back, and the others fail their next collective within
`timeout` seconds (gloo's), so the call raises TensorParallelError naming the rank, never hangs. A rank that dies
(killed, out of memory) is seen by the caller as an exited process within a poll interval.

Under torchrun (RANK and WORLD_SIZE set), `bmc.load(path, tp=N)` returns this process's part instead and every
process runs generate() itself.

The ranks are spawned (a CUDA context and OpenMP pools do not survive fork): each imports the caller's main module
again, so a script calls bmc.load(..., tp=N) under `if __name__ == "__main__":`, as with any spawned pool."""
from __future__ import annotations

import contextlib
import datetime
import os
import random
import time
from typing import Any, Iterator

import torch

from ..errors import BmcError, InvalidRequestError
from ..platform.ports import free_port

POLL_S = 0.2
EVERY_RANK = ("rank_info",)  # commands whose every rank's reply comes back (the others: rank 0's)


class TensorParallelError(BmcError):
    """A rank failed, died or did not answer: the group is stopped."""



def _threads(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)


def _join_group(rank: int, world: int, device: str, timeout_s: float, init: str | None) -> torch.device:
    import torch.distributed as dist

    dev = torch.device(f"cuda:{rank % max(1, torch.cuda.device_count())}" if device == "cuda" else device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=init, rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    return dev


def load_rank(path: str | None, rank: int, world: int, *, dtype: str | torch.dtype, device: str,
              timeout_s: float, init: str | None = None, random_weights: bool = False) -> Any:
    """This process's part of the model, in its torch.distributed group (joined here when not yet).
    random_weights: `path` is a directory with a config.json alone; the rank builds its part of such a model with
    random weights, never allocating the whole (bench/tp.py's Llama-2-7B and bench/gpu_tp.py's 70B shapes)."""
    os.environ["BMC_NATIVE"] = "0"  # the PyTorch path: the native step has no collectives
    from ..models import load_model
    from .shard import fill_random, shard_model

    dev = _join_group(rank, world, device, timeout_s, init)
    if random_weights:
        from .shard import MatrixShapes

        model = shape_model(path, dtype, dev, MatrixShapes)  # the matrices meta until the rank's parts are cut
    else:
        model = load_model(path, dtype=dtype, device=dev, quant="none")
    if world > 1:
        shard_model(model, rank, world)
    if random_weights:
        fill_random(model)
    if world > 1 and dev.type == "cuda":  # decode steps' all-reduces fused with the norms after them
        from .allreduce_norm import attach

        attach(model)
    return model


def shape_model(path: str, dtype: str | torch.dtype, device: torch.device, source_type: Any = None) -> Any:
    """A model of the config.json in `path` with uninitialised weights (no page touched until written; with
    source_type=shard.MatrixShapes, its matrices meta tensors: no memory at all)."""
    import json

    import transformers

    from ..models import model_from_tensors
    from ..models.weights import ShapeSource

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with torch.device("meta"):  # the names and shapes of the checkpoint, no memory
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    shapes = dict(hf.state_dict())
    return model_from_tensors(config, shapes, origin=path, dtype=dtype, device=device,
                             source_type=source_type or ShapeSource)


def _run(model: Any, cmd: str, args: Any) -> Any:
    import bmc

    if cmd == "generate":
        prompts, kw = args
        return bmc.generate(model, prompts, **kw)
    if cmd == "logits":
        return prompt_logits(model, args)
    if cmd == "collective_seconds":  # read and reset (bench/tp.py)
        from .shard import COLLECTIVE_SECONDS

        seconds, COLLECTIVE_SECONDS[0] = COLLECTIVE_SECONDS[0], 0.0
        return seconds
    if cmd == "profile":  # bench/gpu_tp.py: every rank profiles the same call (their collectives meet)
        prompts, kw = args
        return profiled_generate(model, prompts, kw)
    if cmd == "rank_info":  # bench/gpu_tp.py: what this rank reads a step, and its last graph replayed alone
        from ..graphs import graph_store

        info = {"weight_bytes": model.weight_bytes, "device": str(model.device),
                "fused_allreduce": getattr(model.net, "tp_allreduce", None) is not None}
        if model.device.type == "cuda":
            store = graph_store(model)
            info.update(device_name=torch.cuda.get_device_name(model.device), graph_captures=store.captures,
                        replay_ms=store.replay_ms(args or 50))
        return info
    raise ValueError(f"unknown command {cmd!r}")


def profiled_generate(model: Any, prompts: Any, kw: dict[str, Any]) -> list[tuple[str, float, float | None]]:
    """bmc.generate() under torch.profiler: (name, start µs, duration µs) of each GPU kernel, and (cudaGraphLaunch,
    start, None) of each graph launch, on one clock (bench/gpu_tp.py reads a step's kernels between launches)."""
    import json
    import tempfile

    import bmc
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        bmc.generate(model, prompts, **kw)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    return [(e["name"], e["ts"], e.get("dur") if e.get("cat") == "kernel" else None) for e in events
            if e.get("cat") == "kernel" or e.get("name") == "cudaGraphLaunch"]


@torch.inference_mode()
def prompt_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """The logits of every position of `ids` from one prefill (float32, [len, vocab], on the CPU)."""
    from ..engine import prefill_alone

    _, out = prefill_alone(model, list(ids), prompt_len=len(ids), all_logits=True)
    return out[0].float().cpu()


@contextlib.contextmanager
def reporting_rank(conn: Any) -> Iterator[None]:
    """A rank process's body: an error is sent down its pipe (the caller raises it with the rank's name), a closed
    pipe or an interrupt ends it quietly, and it leaves its process group on the way out."""
    import torch.distributed as dist

    try:
        yield
    except (EOFError, KeyboardInterrupt):
        pass
    except BaseException as e:
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except Exception:
            pass
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _worker(rank: int, world: int, init: str, path: str | None, dtype: str, device: str, threads: int,
            timeout_s: float, random_weights: bool, conn: Any) -> None:
    torch.set_num_threads(threads)
    with reporting_rank(conn):
        model = load_rank(path, rank, world, dtype=dtype, device=device, timeout_s=timeout_s, init=init,
                          random_weights=random_weights)
        conn.send(("ready", (model.full_config, model.tokenizer) if rank == 0 else None))
        while True:
            cmd, args = conn.recv()
            if cmd == "stop":
                break
            try:
                out = _run(model, cmd, args)
            except InvalidRequestError as e:  # the request's fault, raised on every rank before any collective
                conn.send(("invalid", e))
                continue
            conn.send(("ok", out if rank == 0 or cmd in EVERY_RANK else None))


def stop_ranks(conns: list[Any], procs: list[Any]) -> None:
    """Ask each live rank to stop, then wait for it (killed if it does not exit within 5 s)."""
    for conn, p in zip(conns, procs):
        if p.is_alive():
            try:
                conn.send(("stop", None))
            except Exception:
                pass
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


class TensorParallelModel:
    """N ranks driven like one model (see the module's docstring); close() (or the process's exit) stops them."""

    def __init__(self, path: str | None, tp: int, *, dtype: str = "float32", device: str = "cpu",
                 threads: int | None = None, timeout_s: float = 120.0, load_timeout_s: float = 600.0,
                 random_weights: bool = False) -> None:
        import torch.multiprocessing as mp

        if tp < 2:
            raise InvalidRequestError(f"tp must be >= 2 for tensor parallelism, got {tp}")
        if device == "cuda" and torch.cuda.device_count() < tp:
            raise InvalidRequestError(f"tp={tp} on CUDA needs {tp} GPUs; torch sees {torch.cuda.device_count()}")
        self.tp, self.timeout_s = tp, timeout_s
        ctx = mp.get_context("spawn")
        init = f"tcp://127.0.0.1:{free_port()}"
        self.conns, self.procs = [], []
        for rank in range(tp):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(rank, tp, init, path, str(dtype).replace("torch.", ""), device,
                                                  threads or _threads(tp), timeout_s, random_weights, child),
                            daemon=True, name=f"bmc-tp-rank{rank}")
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        replies = self._collect(load_timeout_s, "loading the model")
        self.config, self.tokenizer = replies[0]
        self.device = torch.device(device)
        self.path = path

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    def generate(self, prompts: Any, **kw: Any) -> Any:
        """bmc.generate() on every rank; rank 0's completions. A sampled request without a seed gets one here, so
        every rank draws the same tokens."""
        if kw.get("temperature", 0.0) > 0 and kw.get("seed") is None:
            kw["seed"] = random.randrange(2**31)
        return self._call("generate", (prompts, kw), "generating")

    def logits(self, ids: list[int]) -> torch.Tensor:
        """The logits of every position of one prompt, [len, vocab] float32 (each rank's share gathered)."""
        return self._call("logits", list(ids), "computing logits")

    def collective_seconds(self) -> float:
        """Seconds rank 0 spent in all-reduces and all-gathers since the last call."""
        return self._call("collective_seconds", None, "reading its clock")

    def rank_info(self, reps: int = 50) -> list[dict[str, Any]]:
        """Each rank's weight bytes and, on CUDA, its graphs captured and its last graph's replay alone (median ms of
        `reps`, every rank replaying at once)."""
        return self._call("rank_info", reps, "reporting", every=True)

    def profile(self, prompts: Any, kw: dict[str, Any]) -> list[tuple[str, float, float | None]]:
        """generate() profiled on every rank; rank 0's kernels and graph launches (profiled_generate)."""
        return self._call("profile", (prompts, kw), "profiling")

    def _call(self, cmd: str, args: Any, doing: str, every: bool = False) -> Any:
        if not self.procs:
            raise TensorParallelError("the tensor parallel group was stopped")
        for rank, conn in enumerate(self.conns):
            try:
                conn.send((cmd, args))
            except OSError as e:  # a rank that died before the call: its pipe is broken
                raise self._stop(f"tensor parallel rank {rank} could not be sent the call ({e}) while {doing}")
        replies = self._collect(None, doing)
        return replies if every else replies[0]

    def _collect(self, timeout_s: float | None, doing: str) -> list[Any]:
        """Every rank's reply; TensorParallelError (the group stopped) when one reports an error, exits or, with a
        timeout, does not answer in time."""
        replies: list[Any] = [None] * self.tp
        invalid: list[InvalidRequestError] = []
        waiting = set(range(self.tp))
        deadline = time.monotonic() + timeout_s if timeout_s is not None else None
        while waiting:
            for rank in sorted(waiting):
                conn = self.conns[rank]
                try:
                    ready = conn.poll(POLL_S / self.tp)
                    kind, value = conn.recv() if ready else (None, None)
                except (EOFError, OSError):  # closed, or reset by a rank that was killed
                    ready, kind, value = True, "error", "its pipe closed"
                if ready:
                    if kind == "error":
                        raise self._stop(f"tensor parallel rank {rank} failed while {doing}: {value}")
                    if kind == "invalid":
                        invalid.append(value)
                    replies[rank] = value
                    waiting.discard(rank)
                elif not self.procs[rank].is_alive():
                    raise self._stop(f"tensor parallel rank {rank} exited (code {self.procs[rank].exitcode}) "
                                     f"while {doing}")
            if deadline is not None and time.monotonic() > deadline:
                self.close()
                raise self._stop(f"tensor parallel ranks {sorted(waiting)} did not answer within {timeout_s:.0f} s "
                                 f"while {doing}")
        if invalid:
            if len(invalid) < self.tp:  # some ranks went on: they wait in a collective that will not come
                raise self._stop(f"the request was refused on {len(invalid)} of {self.tp} ranks: {invalid[0]}")
            raise invalid[0]  # refused everywhere before any collective: the group stays up
        return replies

    def _stop(self, what: str) -> TensorParallelError:
        """Stop the group; the error to raise, naming first the ranks that died (a peer's failed collective is
        usually their echo)."""
        time.sleep(POLL_S)  # a dead peer's exit is seen a moment after the survivors' connection errors
        dead = [f"rank {r} exited (code {p.exitcode})" for r, p in enumerate(self.procs)
                if not p.is_alive() and f"rank {r} exited" not in what]
        self.close()
        return TensorParallelError("; ".join(dead + [what]))

    def close(self) -> None:
        stop_ranks(self.conns, self.procs)
        self.procs = [p for p in self.procs if p.is_alive()]

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
