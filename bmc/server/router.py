"""bmc-serve --instances K: K engine processes, each pinned to its own cores, behind one OpenAI endpoint (the BMC
paper's BMC_MI). This process holds no model: it starts the instances (each a plain bmc-serve on a private
127.0.0.1 port, pinned with --cpus), routes every request to the instance with the least work outstanding,
relays its response (SSE included) byte for byte, merges /metrics, and replaces an instance that dies.

Why processes: each instance runs its own scheduler, batch cache and OpenMP pool on its own cores, so a step of
one never waits on the threads of another (the paper credits BMC_MI with "a balance in the per core and system
utilization"); a crash (killed, out of memory) takes down one instance's requests, not the endpoint.

Work outstanding = the prompt characters / 4 (a token estimate: the router does not tokenize) plus the max_tokens
of every request the router sent to an instance and has not seen finish. An instance with as many requests
outstanding as its --max-num-seqs is chosen only when every instance is that full."""
from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.middleware.cors import CORSMiddleware
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..platform.ports import free_port
from ..platform.topology import parse_cpu_list, physical_core_cpus
from .gate import RequestGate
from .limits import DEFAULT_MAX_BODY_BYTES
from .protocol import APIError

log = logging.getLogger("bmc.router")

RESTART_BACKOFF_S = 1.0  # before restarting an instance that died (a crash loop must not spin)
# /health says "starting" until every instance is up, but no longer than this after the first came up: instances
# load the same weights, so one still loading that long after a sibling is hung, and the rest serve without it
STARTUP_GRACE_S = 300.0



@dataclass
class Instance:
    index: int
    cpus: list[int]
    argv: list[str]  # bmc-serve's arguments shared by every instance (model, cache, batch options)
    port: int = 0
    proc: subprocess.Popen | None = None
    ready: bool = False
    came_up: bool = False  # ready at least once since the router started (start-up is over for it)
    outstanding: dict[int, int] = field(default_factory=dict)  # request key -> its estimated tokens
    restarts: int = 0
    started_at: float = 0.0
    last_pick: int = -1  # when the router last chose it: ties go to the one idle longest (round robin when idle)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def work(self) -> int:
        return sum(self.outstanding.values())

    @property
    def rows(self) -> int:
        """Its --max-num-seqs: requests it runs at once (the rest wait in its queue)."""
        return max_num_seqs(self.argv)

    @property
    def full(self) -> bool:
        return len(self.outstanding) >= self.rows

    def start(self) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "bmc.cli.serve", *self.argv, "--host", "127.0.0.1", "--port", str(self.port),
               "--cpus", ",".join(map(str, self.cpus))]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        self.ready = False
        self.started_at = time.monotonic()
        log.info("instance %d: pid %d on cpus %s, port %d", self.index, self.proc.pid, self.cpus, self.port)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def estimate_tokens(body: dict[str, Any]) -> int:
    prompt = body.get("prompt", body.get("messages", ""))
    chars = len(json.dumps(prompt)) if not isinstance(prompt, str) else len(prompt)
    n = body.get("n", 1) if isinstance(body.get("n", 1), int) else 1
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    return chars // 4 + max(1, n) * (limit if isinstance(limit, int) and limit > 0 else 256)


def max_num_seqs(argv: Sequence[str]) -> int:
    """--max-num-seqs in an instance's arguments (bmc-serve's default, 8, where absent)."""
    for i, a in enumerate(argv):
        if a == "--max-num-seqs" and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--max-num-seqs="):
            return int(a.split("=", 1)[1])
    return 8


class Router:
    def __init__(self, core_sets: Sequence[Sequence[int]], argv: Sequence[str], api_key: str | None) -> None:
        self.instances = [Instance(i, list(cpus), list(argv)) for i, cpus in enumerate(core_sets)]
        self.api_key = api_key
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        self.stopping = False
        self._keys = iter(range(1 << 62))
        self._picks = 0
        self.first_up_at: float | None = None  # when the first instance came up (time.monotonic)

    def start(self) -> None:
        for inst in self.instances:
            inst.start()

    async def watch(self) -> None:
        """Health of every instance twice a second: a started one becomes ready when its /health answers 200; one
        whose process exited is restarted (its in-flight requests already failed on their closed connections)."""
        while not self.stopping:
            for inst in self.instances:
                if not inst.alive:
                    if inst.proc is not None and not self.stopping:
                        code = inst.proc.returncode
                        log.error("instance %d (pid %d) exited with %s; restarting it", inst.index, inst.proc.pid, code)
                        inst.ready = False
                        inst.outstanding.clear()
                        inst.restarts += 1
                        await asyncio.sleep(RESTART_BACKOFF_S)
                        inst.start()
                    continue
                if not inst.ready:
                    try:
                        r = await self.client.get(inst.url + "/health", timeout=1.0)
                        if r.status_code == 200:
                            self.instance_up(inst)
                        if inst.ready:
                            log.info("instance %d ready after %.1f s", inst.index, time.monotonic() - inst.started_at)
                    except httpx.HTTPError:
                        pass
            await asyncio.sleep(0.5)

    def instance_up(self, inst: Instance) -> None:
        """`inst` answered /health 200: ready, and (the first time) up since the router started."""
        inst.ready = inst.came_up = True
        if self.first_up_at is None:
            self.first_up_at = time.monotonic()

    def starting(self) -> bool:
        """Start-up: some instance has neither come up nor crashed trying, and the first came up less than
        STARTUP_GRACE_S ago (a sibling still loading long after that is hung: serve without it)."""
        if all(i.came_up or i.restarts for i in self.instances):
            return False
        return self.first_up_at is None or time.monotonic() - self.first_up_at < STARTUP_GRACE_S

    def pick(self) -> Instance | None:
        ready = [i for i in self.instances if i.ready and i.alive]
        if not ready:
            return None
        # an instance with a free row first: by work alone, a burst of prompts of unequal lengths could put a 9th
        # request on a full instance (queued there behind a whole request) while the other had a row free
        chosen = min(ready, key=lambda i: (i.full, i.work, len(i.outstanding), i.last_pick))
        self._picks += 1
        chosen.last_pick = self._picks
        return chosen

    def stop(self) -> None:
        """SIGTERM to every instance (each drains its running requests), then wait for them."""
        self.stopping = True
        for inst in self.instances:
            if inst.alive:
                inst.proc.send_signal(signal.SIGTERM)
        for inst in self.instances:
            if inst.proc is not None:
                try:
                    inst.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    inst.proc.kill()

    # ---- requests -----------------------------------------------------------------------------------------
    async def forward(self, request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        inst = self.pick()
        if inst is None:
            return error(503, "no engine instance is ready", {"Retry-After": "1"})
        key = next(self._keys)
        inst.outstanding[key] = estimate_tokens(body) if isinstance(body, dict) else 1
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        try:
            upstream = await self.client.send(
                self.client.build_request("POST", inst.url + path, content=raw, headers=headers), stream=True)
        except httpx.HTTPError as e:
            inst.outstanding.pop(key, None)
            return error(502, f"engine instance {inst.index} is unreachable ({type(e).__name__})")
        content_type = upstream.headers.get("content-type", "application/json")
        passed = {k: v for k, v in upstream.headers.items() if k.lower() in ("retry-after", "www-authenticate")}

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:  # the instance died mid-response
                msg = f"engine instance {inst.index} failed while answering ({type(e).__name__}); retry the request"
                if content_type.startswith("text/event-stream"):
                    yield ("data: " + json.dumps(APIError(502, msg).body()) + "\n\n").encode()
            finally:
                inst.outstanding.pop(key, None)
                await upstream.aclose()

        if not content_type.startswith("text/event-stream"):  # read it whole: a dead instance becomes a 502
            try:
                data = await upstream.aread()
            except httpx.HTTPError as e:
                return error(502, f"engine instance {inst.index} failed while answering ({type(e).__name__}); "
                             "retry the request")
            finally:
                inst.outstanding.pop(key, None)
                await upstream.aclose()
            return Response(data, status_code=upstream.status_code, media_type=content_type, headers=passed)
        return StreamingResponse(relay(), status_code=upstream.status_code, media_type=content_type, headers=passed)

    async def metrics(self) -> bytes:
        """Every instance's samples with an `instance` label, then the sums over instances (instance="all") of
        the gauges and counters, and the router's own: instances ready, restarts."""
        lines: list[str] = []
        seen_meta: set[str] = set()
        totals: dict[str, float] = {}
        sample = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")
        for inst in self.instances:
            if not inst.ready:
                continue
            try:
                text = (await self.client.get(inst.url + "/metrics", timeout=5.0)).text
            except httpx.HTTPError:
                continue
            for line in text.splitlines():
                if line.startswith("#"):
                    if line not in seen_meta:
                        seen_meta.add(line)
                        lines.append(line)
                    continue
                m = sample.match(line)
                if not m:
                    continue
                name, labels, value = m.group(1), (m.group(2) or "{}")[1:-1], m.group(3)
                labels = f'instance="{inst.index}"' + ("," + labels if labels else "")
                lines.append(f"{name}{{{labels}}} {value}")
                if not (name.endswith("_bucket") or name.endswith("_created")):
                    total_key = name + "{" + labels.split(",", 1)[1] if "," in labels else name + "{"
                    totals[total_key] = totals.get(total_key, 0.0) + float(value)
        for k, v in totals.items():
            name, rest = k.split("{", 1)
            lines.append(f'{name}{{instance="all"{"," + rest if rest else ""}}} {v}')
        lines.append("# HELP bmc:router_instances_ready Engine instances answering requests")
        lines.append("# TYPE bmc:router_instances_ready gauge")
        lines.append(f"bmc:router_instances_ready {sum(i.ready and i.alive for i in self.instances)}")
        lines.append("# HELP bmc:router_instance_restarts_total Engine instances restarted after they died")
        lines.append("# TYPE bmc:router_instance_restarts_total counter")
        for inst in self.instances:
            lines.append(f'bmc:router_instance_restarts_total{{instance="{inst.index}"}} {inst.restarts}')
            lines.append(f'bmc:router_instance_outstanding_tokens{{instance="{inst.index}"}} {inst.work}')
        return ("\n".join(lines) + "\n").encode()

    def health(self) -> tuple[int, dict[str, Any]]:
        states = [{"instance": i.index, "cpus": i.cpus, "pid": i.proc.pid if i.proc else None,
                   "ready": i.ready and i.alive, "restarts": i.restarts} for i in self.instances]
        ready = sum(s["ready"] for s in states)
        # Not ready before every instance has come up once (or crashed trying): a client that starts on the first
        # 200 would otherwise send its whole first wave to one instance and queue half of it behind whole requests
        if self.starting():
            return 503, {"status": "starting", "instances": states}
        status = "ok" if ready == len(states) else "degraded" if ready else "unavailable"
        return (200 if ready else 503), {"status": status, "instances": states}


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(APIError(status, message).body(), status_code=status, headers=headers)


def build_router_app(core_sets: Sequence[Sequence[int]], argv: Sequence[str], api_key: str | None, *,
                     allowed_origins: Sequence[str] | None = None,
                     max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The instances check every request themselves; the router checks what it must before it buffers a body
    (its size, the key, the content type) and answers CORS preflights."""
    router = Router(core_sets, argv, api_key)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        router.start()
        watcher = asyncio.create_task(router.watch())
        yield
        router.stopping = True
        watcher.cancel()
        await asyncio.get_running_loop().run_in_executor(None, router.stop)
        await router.client.aclose()

    app = FastAPI(title="bmc-serve (router)", lifespan=lifespan, strict_content_type=False)
    app.state.router = router
    app.add_middleware(RequestGate, api_key=api_key, max_body_bytes=max_body_bytes)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return error(e.status_code, str(e.detail), dict(e.headers or {}))

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = router.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await router.metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    @app.get("/v1/models/{model_id:path}")
    async def models(request: Request) -> Response:
        inst = router.pick()
        if inst is None:
            return error(503, "no engine instance is ready", {"Retry-After": "1"})
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        r = await router.client.get(inst.url + request.url.path, headers=headers)
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.forward(request, "/v1/chat/completions")

    return app


def core_sets_for(instances: int, cpus_spec: str | None) -> list[list[int]]:
    """The core set of each instance: `--cpus` as given ('0-7|8-15'), else the physical cores this process may run
    on (one logical CPU per core: hyper-thread siblings left out), grouped by NUMA node, split into `instances`
    contiguous groups of near-equal size."""
    if cpus_spec:
        sets = [parse_cpu_list(part) for part in cpus_spec.split("|")]
        if len(sets) != instances:
            raise ValueError(f"--cpus gives {len(sets)} core sets for {instances} instances")
        return sets
    cores = physical_core_cpus()
    if instances > len(cores):
        raise ValueError(f"{instances} instances need at least {instances} physical cores; this process has "
                         f"{len(cores)} ({cores})")
    sets, start = [], 0
    for i in range(instances):
        size = (len(cores) - start) // (instances - i)
        sets.append(cores[start : start + size])
        start += size
    return sets
