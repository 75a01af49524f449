"""bmc-calibrate: measure copy bandwidth and attention throughput for the analytic model (see issue 3)."""
from __future__ import annotations

import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    print("error: bmc-calibrate is not implemented yet; bmc uses the paper's C'=0.1 until it is", file=sys.stderr)
    sys.exit(2)
