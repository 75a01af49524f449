"""The scheduler on its own thread, and the bridge that hands its tokens to asyncio handlers.

torch releases the GIL inside its kernels and the native step, so HTTP parsing, tokenization and SSE writing on
the event loop run beside the decode steps instead of between them."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Callable

from ..engine import GenerationConfig
from ..scheduler import Request, Scheduler, TokenOutput

log = logging.getLogger("bmc.server")
SLOW_STEP_S = 0.25  # steps slower than this are logged at debug level with their phases


class Mailbox:
    """The outputs of one engine step, handed to the event loop in one call: one wake-up of the HTTP side per
    step instead of one per token and row (each is a self-pipe write and a loop iteration taking CPU from the
    step's threads)."""

    def __init__(self) -> None:
        self.items: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue, Any]] = []

    def post(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item: Any) -> None:
        self.items.append((loop, queue, item))

    def flush(self) -> None:
        if not self.items:
            return
        items, self.items = self.items, []
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for loop, queue, item in items:
            by_loop.setdefault(loop, []).append((queue, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
                pass


def _deliver(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)


class EngineThread:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.mailbox = Mailbox()
        self.on_step: Callable[[float], None] = lambda seconds: None  # the server's step-time histogram
        self.on_death: Callable[[BaseException], None] = lambda error: None  # the server exits non-zero
        self.error: BaseException | None = None  # why the thread died, if it did
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="bmc-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self.scheduler.wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a bug: no request may wait forever, and a supervisor must see the death
            self.error = e
            log.critical("the engine thread died: %s: %s", type(e).__name__, e, exc_info=True)
            try:
                self.scheduler.close(e)
                self.mailbox.flush()
            finally:
                self.on_death(e)

    def _loop(self) -> None:
        s = self.scheduler
        while not self._stopping:
            if not s.has_work():
                s.wakeup.wait(0.5)
                s.wakeup.clear()
                continue
            t0 = time.perf_counter()
            try:
                s.step()
            except Exception as e:  # outside any one request: fail those in flight, keep serving
                log.exception("engine step failed")
                s.fail_all(e)  # if this raises too, the thread dies (above)
            self.mailbox.flush()
            took = time.perf_counter() - t0
            self.on_step(took)
            if took > SLOW_STEP_S:
                log.debug("slow step %.0f ms: %s", took * 1e3, s.last_step)


class RequestGroup:
    """The bmc requests of one HTTP request (one per prompt), whose outputs arrive on one asyncio queue as
    (prompt_index, TokenOutput | exception)."""

    def __init__(self, engine: EngineThread, loop: asyncio.AbstractEventLoop) -> None:
        self.scheduler, self.mailbox, self.loop = engine.scheduler, engine.mailbox, loop
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.requests: list[Request] = []

    def _emitter(self, prompt_index: int):
        def emit(out: TokenOutput | BaseException) -> None:  # on the engine thread, inside a step
            self.mailbox.post(self.loop, self.queue, (prompt_index, out))
        return emit

    def submit(self, prompts: list[list[int]], gen: GenerationConfig, logprobs: int | None, *,
               cache_salt: str | None = None, cache_prompt: bool = True, score_prompt: bool = False) -> None:
        """Queue every prompt; if one is refused (queue full, too long) the ones already queued are aborted.
        score_prompt: each prompt token's logprob (and the top `logprobs`) is kept (echo with logprobs)."""
        try:
            for i, ids in enumerate(prompts):
                req = Request(ids, gen, self._emitter(i), logprobs=logprobs, device=self.scheduler.model.device,
                              cache_salt=cache_salt, cache_prompt=cache_prompt, prompt_logprobs=score_prompt,
                              prompt_top=logprobs or 0)
                self.scheduler.add(req)
                self.requests.append(req)
        except Exception:
            self.abort()
            raise

    def abort(self) -> None:
        for req in self.requests:
            if not req.done:
                self.scheduler.abort(req)
