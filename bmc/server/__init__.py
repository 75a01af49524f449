"""bmc-serve: an OpenAI-compatible HTTP server over the continuous-batching scheduler (bmc/scheduler.py)."""
from .app import ServeOptions, build_app

__all__ = ["ServeOptions", "build_app"]
