"""Pieces the CLIs share: thread count, error exits."""
from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn


MAX_THREADS = 1024  # more is a typo, not a machine


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-threads share a core's FPUs: one thread per core is fastest)."""
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cores: set[tuple[str, str]] = set()
    try:
        phys = core = ""
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, val = line.partition(":")
                key, val = key.strip(), val.strip()
                if key == "physical id":
                    phys = val
                elif key == "core id":
                    core = val
                elif not key and core:
                    cores.add((phys, core))
                    core = ""
        if core:
            cores.add((phys, core))
    except OSError:
        pass
    return max(1, min(allowed, len(cores) or allowed))


def fail(message: str) -> NoReturn:
    """One clear line on stderr and exit code 2, as argparse does for bad arguments."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


class Parser(argparse.ArgumentParser):
    """argparse with a bad argument reported in one line (no usage block), exit 2, as every other bad input."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (--help lists the options)", file=sys.stderr)
        sys.exit(2)
