"""The CPU topology this process runs on, read once here for every user (the CLIs' thread counts, bmc-serve's
instances and their memory binding, the calibration profile's machine name): physical cores (one logical CPU per
core: hyper-thread siblings share its FPUs), NUMA nodes, CPU lists as Linux writes them."""
from __future__ import annotations

import os
import platform
from typing import Sequence


def physical_cores() -> int:
    """Physical cores this process may run on (one thread per core is fastest)."""
    return max(1, len(physical_core_cpus()))


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (e.g. 0-3,8)")
        a, b = int(lo), int(hi or lo)
        if b < a:
            raise ValueError(f"not a CPU list: {text!r} ({part} runs backwards)")
        cpus.extend(range(a, b + 1))
    if not cpus:
        raise ValueError(f"an empty CPU list: {text!r}")
    return sorted(set(cpus))


def node_of(cpu: int) -> int:
    """The NUMA node of a CPU (0 where the kernel shows none)."""
    d = f"/sys/devices/system/cpu/cpu{cpu}"
    return next((int(n[4:]) for n in (os.listdir(d) if os.path.isdir(d) else [])
                 if n.startswith("node") and n[4:].isdigit()), 0)


def physical_core_cpus() -> list[int]:
    """One logical CPU per physical core among those this process may run on, ordered by (NUMA node, core)."""
    chosen: dict[tuple[int, str, str], int] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(base + "physical_package_id") as f:
                package = f.read().strip()
            with open(base + "core_id") as f:
                core = f.read().strip()
        except OSError:
            package, core = "0", str(cpu)
        chosen.setdefault((node_of(cpu), package, core), cpu)
    return [chosen[k] for k in sorted(chosen, key=lambda k: (k[0], chosen[k]))]


def nodes_of(cpus: Sequence[int]) -> list[int]:
    """The NUMA nodes of these CPUs."""
    return sorted({node_of(cpu) for cpu in cpus})


def numa_nodes() -> list[int]:
    """The NUMA nodes holding CPUs this process may run on."""
    return nodes_of(os.sched_getaffinity(0))


def bind_memory_to(cpus: Sequence[int]) -> list[int] | None:
    """On a machine of several NUMA nodes, bind this process's future allocations to the nodes of `cpus`
    (set_mempolicy MPOL_BIND, as `numactl --membind` does): an instance's KV and buffers then sit beside its
    cores. Returns the nodes bound, or None where there is one node (nothing to do) or the call is refused."""
    try:
        with open("/sys/devices/system/node/online") as f:
            online = parse_cpu_list(f.read().strip())
    except (OSError, ValueError):
        return None
    nodes = nodes_of(cpus)
    if len(online) < 2 or set(nodes) >= set(online):
        return None
    import ctypes

    MPOL_BIND, SYS_SET_MEMPOLICY = 2, 238  # x86-64 syscall number
    bits = 64
    mask = (ctypes.c_ulong * (max(nodes) // bits + 1))()
    for n in nodes:
        mask[n // bits] |= 1 << (n % bits)
    libc = ctypes.CDLL(None, use_errno=True)
    if os.uname().machine != "x86_64" or libc.syscall(SYS_SET_MEMPOLICY, MPOL_BIND, mask, len(mask) * bits + 1) != 0:
        return None
    return nodes


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or what the platform module knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
