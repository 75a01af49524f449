"""`bmc-serve --tp N`: the server process is rank 0 and runs the scheduler; ranks 1..N-1 (followers, spawned worker
processes) each run a scheduler of their own over their part of the model, fed the same requests and the same
cancellations at the same steps. The scheduler's choices read only the requests, the whole model's config and the
all-gathered logits, so every rank makes the same ones and their forwards meet in the same collectives; nobody
decides for the others. A sampled request without a seed gets one on rank 0 before the followers see it.

Each step rank 0 sends the step's intake (new requests, cancellations) down a pipe to every follower; a follower
answers with a digest of the tokens its step emitted, and rank 0 compares it with its own a step later (without
waiting): a rank that drifts, fails or dies stops the engine with TensorParallelError naming it (the server then
answers every request in flight and exits non-zero for a restart), as a collective it never joins would."""
from __future__ import annotations

import collections
import dataclasses
import logging
import random
import time
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from ..engine import GenerationConfig
from ..engine_options import EngineOptions
from ..platform.ports import free_port
from ..scheduler import Request, Scheduler, TokenOutput
from .tp import POLL_S, TensorParallelError, _threads, load_rank, reporting_rank, stop_ranks

log = logging.getLogger("bmc.server")


@dataclass(frozen=True)
class Arrival:
    """A request as a follower rebuilds it."""

    key: int
    prompt_ids: list[int]
    gen: GenerationConfig
    logprobs: int | None
    cache_salt: str | None
    cache_prompt: bool
    prompt_logprobs: bool


class StepDigest:
    """What a step emitted, folded into one number: (request key, sample, token) of every output in order."""

    def __init__(self) -> None:
        self.value = 0

    def add(self, key: int, out: TokenOutput | BaseException) -> None:
        item = (key, out.sample_index, out.token_id) if isinstance(out, TokenOutput) else (key, type(out).__name__)
        self.value = zlib.crc32(repr(item).encode(), self.value)


def _follow(rank: int, world: int, init: str, path: str | None, dtype: str, device: str, threads: int,
            timeout_s: float, conn: Any) -> None:
    torch.set_num_threads(threads)
    with reporting_rank(conn):  # an error goes to rank 0, which stops the engine with it
        model = load_rank(path, rank, world, dtype=dtype, device=device, timeout_s=timeout_s, init=init)
        conn.send(("ready", None))
        cmd, options = conn.recv()
        if cmd != "start":
            return
        scheduler = Scheduler(model, options.replace(max_queue=None))  # rank 0 refuses; here every request fits
        conn.send(("started", None))
        requests: dict[int, Request] = {}
        while True:
            cmd, args = conn.recv()
            if cmd == "stop":
                break
            arrivals, cancels = args
            digest = StepDigest()
            for a in arrivals:
                emit = (lambda key: lambda out: digest.add(key, out))(a.key)
                req = Request(a.prompt_ids, a.gen, emit, logprobs=a.logprobs, device=model.device,
                              cache_salt=a.cache_salt, cache_prompt=a.cache_prompt, prompt_logprobs=a.prompt_logprobs)
                requests[a.key] = req
                scheduler.add(req)
            for key in cancels:
                if key in requests:
                    scheduler.abort(requests[key])
            scheduler.step()
            for key in [k for k, r in requests.items() if r.done]:
                del requests[key]
            conn.send(("step", digest.value))


class FollowerRanks:
    """Ranks 1..world-1 of a served model, started before rank 0 joins the group (they wait for it there)."""

    def __init__(self, path: str | None, world: int, *, dtype: str, device: str, init: str, timeout_s: float,
                 threads: int | None = None) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.world, self.conns, self.procs = world, [], []
        for rank in range(1, world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_follow, args=(rank, world, init, path, dtype, device, threads or _threads(world),
                                                  timeout_s, child), daemon=True, name=f"bmc-tp-rank{rank}")
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self.sent = 0  # steps sent and not yet checked
        self.checked = 0  # steps every follower answered with rank 0's digest
        self.pending: list[collections.deque[int]] = [collections.deque() for _ in self.conns]  # digests to check

    def wait(self, kind: str, doing: str, timeout_s: float) -> None:
        """Every follower's next answer, which must be `kind` (an error, an exit or silence raise)."""
        deadline = time.monotonic() + timeout_s
        for i, conn in enumerate(self.conns):
            while not conn.poll(POLL_S):
                if not self.procs[i].is_alive():
                    raise self._failed(i, f"exited (code {self.procs[i].exitcode}) while {doing}")
                if time.monotonic() > deadline:
                    raise self._failed(i, f"did not answer within {timeout_s:.0f} s while {doing}")
            self._expect(i, conn.recv(), kind, doing)

    def start(self, options: EngineOptions, timeout_s: float) -> None:
        """Every follower builds its scheduler with these options."""
        for conn in self.conns:
            conn.send(("start", options))
        self.wait("started", "building its scheduler", timeout_s)

    def step(self, arrivals: list[Arrival], cancels: list[int]) -> None:
        for i, conn in enumerate(self.conns):
            if not self.procs[i].is_alive():
                raise self._failed(i, f"exited (code {self.procs[i].exitcode})")
            try:
                conn.send(("step", (arrivals, cancels)))
            except OSError as e:  # it died just now: its pipe is broken
                self.procs[i].join(POLL_S)
                code = self.procs[i].exitcode
                raise self._failed(i, f"exited (code {code})" if code is not None else f"could not be sent the step ({e})")
        self.sent += 1

    def check(self, digests: collections.deque[int], wait_s: float | None = None) -> None:
        """Compare the followers' answered steps with rank 0's digests of the same steps (oldest first); raise
        TensorParallelError on a follower that failed, exited or drifted. wait_s: wait for every step sent."""
        deadline = time.monotonic() + (wait_s or 0.0)
        for i, conn in enumerate(self.conns):
            while len(self.pending[i]) < self.sent:
                if not conn.poll(POLL_S if wait_s else 0):
                    if not self.procs[i].is_alive():
                        raise self._failed(i, f"exited (code {self.procs[i].exitcode})")
                    if wait_s is None:
                        break
                    if time.monotonic() > deadline:
                        raise self._failed(i, f"did not answer a step within {wait_s:.0f} s")
                    continue
                try:
                    reply = conn.recv()
                except (EOFError, OSError):
                    raise self._failed(i, "closed its pipe")
                self.pending[i].append(self._expect(i, reply, "step", "running a step"))
        answered = min(len(p) for p in self.pending)
        for _ in range(answered):
            mine = digests.popleft()
            for i, p in enumerate(self.pending):
                if p.popleft() != mine:
                    raise self._failed(i, "emitted other tokens than rank 0 (the ranks drifted apart)")
        self.sent -= answered
        self.checked += answered

    def _expect(self, i: int, reply: tuple[str, Any], kind: str, doing: str) -> Any:
        got, value = reply
        if got == "error":
            raise self._failed(i, f"failed while {doing}: {value}")
        if got != kind:
            raise self._failed(i, f"answered {got!r} while {doing}")
        return value

    def _failed(self, i: int, what: str) -> TensorParallelError:
        error = TensorParallelError(f"tensor parallel rank {i + 1} {what}")
        self.close()
        return error

    def close(self) -> None:
        stop_ranks(self.conns, self.procs)


class TensorParallelScheduler(Scheduler):
    """Rank 0's scheduler: the server's, unchanged for its clients; each step's intake goes to the followers too."""

    def __init__(self, model: Any, options: EngineOptions, followers: FollowerRanks) -> None:
        super().__init__(model, options)
        self.followers = followers
        self._cancels: list[Request] = []
        self._keys: dict[int, int] = {}  # id(request) -> its key on every rank
        self._next_key = 0
        self._digests: collections.deque[int] = collections.deque()
        self._digest = StepDigest()

    def add(self, request: Request) -> None:
        s = request.gen.sampling
        if not s.greedy and s.seed is None:  # every rank draws the same tokens
            request.gen = dataclasses.replace(request.gen, sampling=dataclasses.replace(s, seed=random.randrange(2**62)))
            request.sampler = type(request.sampler)(request.gen.sampling, self.model.device)
        super().add(request)

    def abort(self, request: Request) -> None:
        """Cancelled at the next step's intake, on every rank at once."""
        with self._lock:
            self._cancels.append(request)
        self.wakeup.set()

    def _intake(self) -> None:
        self.followers.check(self._digests)
        with self._lock:
            new, cancels = list(self._inbox), self._cancels
            self._inbox.clear()
            self._cancels = []
        arrivals = []
        for req in new:
            key = self._next_key
            self._next_key += 1
            self._keys[id(req)] = key
            req.emit = self._recording(req.emit, key)
            arrivals.append(Arrival(key, list(req.prompt_ids), req.gen, req.logprobs, req.cache_salt,
                                    req.cache_prompt, req.prompt_logprobs is not None))
        for req in cancels:
            req.cancelled = True
        self.followers.step(arrivals, [self._keys[id(r)] for r in cancels if id(r) in self._keys])
        self.waiting.extend(new)
        self._digest = StepDigest()
        self._digests.append(0)

    def step(self) -> None:
        super().step()
        self._digests[-1] = self._digest.value
        for done in [k for k in self._keys if k not in self._requests]:
            del self._keys[done]

    def _recording(self, emit: Any, key: int) -> Any:
        def record(out: TokenOutput | BaseException) -> None:
            self._digest.add(key, out)
            emit(out)
        return record

    def fail_all(self, error: BaseException) -> None:
        """A step that raised on rank 0 may have left the followers elsewhere: the group cannot go on."""
        self.fail_requests(error)
        self.followers.close()
        if isinstance(error, TensorParallelError):
            raise error
        raise TensorParallelError(f"the tensor parallel engine stopped: {type(error).__name__}: {error}") from error

    def sync(self, timeout_s: float = 60.0) -> None:
        """Wait until every follower answered every step sent, and check them (with the engine thread idle)."""
        self.followers.check(self._digests, wait_s=timeout_s)

    def close_ranks(self) -> None:
        self.followers.close()


def load_served(path: str | None, tp: int, *, dtype: str, device: str, options: EngineOptions,
                timeout_s: float = 120.0, load_timeout_s: float = 600.0) -> tuple[Any, TensorParallelScheduler]:
    """Rank 0's part of the model (loaded in this process) and its scheduler, with ranks 1..tp-1 started beside it.
    The prefix cache is served where every rank holds as many KV heads as the others (then their cached bytes, and so
    their evictions, agree); otherwise it is off, said in the log."""
    init = f"tcp://127.0.0.1:{free_port()}"
    followers = FollowerRanks(path, tp, dtype=dtype, device=device, init=init, timeout_s=timeout_s,
                              threads=torch.get_num_threads())  # each rank as many threads as this one
    try:
        model = load_rank(path, 0, tp, dtype=dtype, device=device, timeout_s=timeout_s, init=init)
        followers.wait("ready", "loading the model", load_timeout_s)
        options = even_prefix_cache(model.full_config, tp, options)
        followers.start(options, load_timeout_s)
        return model, TensorParallelScheduler(model, options, followers)
    except BaseException:
        followers.close()
        raise


def even_prefix_cache(config: Any, tp: int, options: EngineOptions) -> EngineOptions:
    """The options with the prefix cache off where the ranks' KV-head counts differ."""
    from .sharding import shard_heads

    kv_heads = {len(part.kv_heads) for part in shard_heads(config.num_heads, config.num_kv_heads, tp)}
    if not options.prefix_cache_bytes or len(kv_heads) == 1:
        return options
    log.warning("prefix cache off: %d KV heads do not split evenly over %d ranks (their cached bytes would differ)",
                config.num_kv_heads, tp)
    return options.replace(prefix_cache_bytes=0)
