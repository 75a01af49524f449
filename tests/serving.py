"""A real bmc-serve process on a free 127.0.0.1 port, for the server tests: started, polled until /health answers
200 (bounded), and stopped by SIGTERM (killed if it does not exit in time)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Sequence

import httpx

from bmc.platform.ports import free_port


class ServerProcess:
    def __init__(self, args: Sequence[str], *, startup_timeout: float = 120.0,
                 module: Sequence[str] = ("bmc.cli.serve",)) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = f"/tmp/bmc-serve-test-{self.port}.log"
        self.log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", *module, "--port", str(self.port),
                                      "--log-level", "warning", *args], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env)
        self.health_codes: list[int] = []
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"bmc-serve exited with {self.proc.returncode}: {self.output()}")
            try:
                code = httpx.get(self.url + "/health", timeout=2).status_code
                self.health_codes.append(code)
                if code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"bmc-serve did not become healthy in {startup_timeout} s: {self.output()}")
            time.sleep(0.05)

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-3000:]

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait for the exit code (SIGKILL after `timeout`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def stop(self) -> None:
        self.terminate(30.0)
        self.log.close()

    def metric(self, name: str) -> float:
        """A gauge or counter's value summed over its label sets, from /metrics."""
        total, found = 0.0, False
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        if not found:
            raise KeyError(name)
        return total

    def abandon_request(self, path: str, body: dict, api_key: str | None = None) -> None:
        """Send a non-streamed request on a raw connection, wait until the engine runs it, then close the connection
        as a client that gives up would (no timing: the close comes once the request is seen running)."""
        data = json.dumps(body).encode()
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{auth}"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", self.port), timeout=30) as sock:
            sock.sendall(head + data)
            if self.wait_metric("bmc:num_requests_running", 1) != 1:
                raise AssertionError("the abandoned request was never seen running")

    def wait_metric(self, name: str, value: float, timeout: float = 30.0) -> float:
        deadline = time.monotonic() + timeout
        while True:
            got = self.metric(name)
            if got == value or time.monotonic() > deadline:
                return got
            time.sleep(0.05)


# Every Schemathesis check but positive_data_acceptance (a schema cannot say what depends on the loaded model: a
# prompt over its context, token ids beyond its vocabulary) and the response-time limit `--checks all` would add.
SCHEMATHESIS_CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
                       "response_headers_conformance,response_schema_conformance,negative_data_rejection,"
                       "missing_required_header,unsupported_method,allow_header_conformance,use_after_free,"
                       "ensure_resource_availability,ignored_auth")


def schemathesis_command(url: str, seconds: int, key: str, *, workers: int, max_examples: int | None = None
                         ) -> list[str]:
    """`st run` against a server's own /openapi.json for at most `seconds`."""
    st = shutil.which("st", path=os.path.dirname(sys.executable)) or shutil.which("st")
    if st is None:
        raise RuntimeError("schemathesis is not installed (scripts/setup.sh --test)")
    cmd = [st, "run", f"{url}/openapi.json", "-H", f"Authorization: Bearer {key}", "--checks", SCHEMATHESIS_CHECKS,
           "--workers", str(workers), "--request-timeout", "300", "--max-time", str(seconds)]
    return cmd + (["--max-examples", str(max_examples)] if max_examples is not None else [])
