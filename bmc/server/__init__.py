"""bmc-serve: an OpenAI-compatible HTTP server over the continuous-batching scheduler (bmc/scheduler.py)."""
from __future__ import annotations

from typing import Any

__all__ = ["ServeOptions", "build_app"]


def __getattr__(name: str) -> Any:  # lazily: the CLI reads server.limits before it knows FastAPI is installed
    if name in __all__:
        from . import app

        return getattr(app, name)
    raise AttributeError(name)
