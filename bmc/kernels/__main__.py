"""`python -m bmc.kernels`: build the C++ kernels now (scripts/setup.sh runs it), so that no later command stalls
for a minute on its first use. Each kernel is one compiler process, so they build side by side (on two cores the
setup waits for the longest build, not for their sum). Without a compiler it says so and exits 0: every kernel has
an exact PyTorch path."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable


def _timed(build: Callable[[], Any]) -> tuple[bool, float]:
    t0 = time.perf_counter()
    ok = build() is not None
    return ok, time.perf_counter() - t0


def main() -> None:
    from .native import native_module
    from .sparq import fused_decode

    kernels = (("native decode step", native_module), ("SparQ attention", fused_decode))
    with ThreadPoolExecutor(max_workers=len(kernels)) as pool:  # each waits on its own g++ process
        futures = [(name, pool.submit(_timed, build)) for name, build in kernels]
        for name, future in futures:
            ok, seconds = future.result()
            state = f"ready ({seconds:.0f} s)" if ok else "unavailable: the PyTorch path runs instead"
            print(f"setup: C++ kernel, {name}: {state}", flush=True)


if __name__ == "__main__":
    main()
