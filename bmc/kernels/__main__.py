"""`python -m bmc.kernels`: build the C++ kernels now (scripts/setup.sh runs it), so that no later command stalls
for a minute on its first use. Without a compiler it says so and exits 0: every kernel has an exact PyTorch path."""
from __future__ import annotations

import time


def main() -> None:
    from ..attention.sparq_kernel import fused_decode
    from .native import native_module

    for name, build in (("native decode step", native_module), ("SparQ attention", fused_decode)):
        t0 = time.perf_counter()
        ok = build() is not None
        state = f"ready ({time.perf_counter() - t0:.0f} s)" if ok else "unavailable: the PyTorch path runs instead"
        print(f"setup: C++ kernel, {name}: {state}", flush=True)


if __name__ == "__main__":
    main()
