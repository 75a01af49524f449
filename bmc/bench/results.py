"""Where the scripts under bench/ write what they measured: one JSON per run and the PNG drawn from it."""
from __future__ import annotations

import json
import os
import platform
from typing import Any, Callable


def write_result(result: dict[str, Any], out: str | None, script: str, name: str,
                 plot: Callable[[dict[str, Any], str], None] | None = None) -> str:
    """The result as JSON at `out`, by default bench/results/cpu/{name}-{host}.json beside `script` (the calling
    script's __file__), and plot(result, same path with .png) when given. Returns the JSON's path."""
    out = out or os.path.join(os.path.dirname(script), "results", "cpu", f"{name}-{platform.node()}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    if plot is not None:
        plot(result, out[:-5] + ".png")
    print(f"wrote {out}", flush=True)
    return out
