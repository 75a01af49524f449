"""A free TCP port on 127.0.0.1, for the processes bmc starts (server instances, tensor-parallel groups) and for
the tests and benchmarks that start servers."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A port the kernel just handed out on 127.0.0.1 (free now; the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
