"""bmc-serve with one fault injected, for the server's failure tests (run as `python -m tests.fault_serve FAULT
ARGS...`; never used outside tests). The faults stand for bugs the server must survive or report:

- sampler: a request with seed 666 raises inside its sampling (a failure inside one request);
- engine: a prompt starting with token 99 raises inside the step, and emptying the cache then fails too, so the
  engine thread dies (a bug outside any request)."""
from __future__ import annotations

import sys

from bmc.cli.serve import main
from bmc.sampling import Sampler
from bmc.scheduler import Scheduler

MAGIC_SEED, MAGIC_TOKEN = 666, 99


def inject(fault: str) -> None:
    if fault == "sampler":
        real_call = Sampler.__call__

        def call(self, logits):
            if self.params.seed == MAGIC_SEED:
                raise RuntimeError("injected sampler failure")
            return real_call(self, logits)

        Sampler.__call__ = call  # type: ignore[method-assign]
    elif fault == "engine":
        real_step = Scheduler.step

        def step(self):
            if any(r.prompt_ids[0] == MAGIC_TOKEN for r in [*self.waiting, *self._inbox]):
                raise RuntimeError("injected step failure")
            return real_step(self)

        def fail_all(self, error):
            self.fail_requests(error)
            raise RuntimeError("injected failure while recovering")

        Scheduler.step = step  # type: ignore[method-assign]
        Scheduler.fail_all = fail_all  # type: ignore[method-assign]
    else:
        raise SystemExit(f"unknown fault {fault!r}")


if __name__ == "__main__":
    inject(sys.argv[1])
    main(sys.argv[2:])
