"""C++ kernels for the CPU, built on first use with torch's cpp_extension (g++ and ninja; cached under
~/.cache/torch_extensions, about a minute the first time). Every kernel has an exact PyTorch fallback: when a build
fails (no compiler) or is switched off, bmc logs it once and runs the eager path."""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shlex
import sys
from typing import Any

log = logging.getLogger("bmc")

# 512-bit auto-vectorisation: GCC's default of 256 bits on AVX-512 parts calls libmvec's 8-wide expf; the 16-wide
# one made shared-prefix attention (one exp per key and query row) measurably faster here.
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp"]
LDFLAGS = ["-fopenmp", "-lmvec"]


def cflags() -> list[str]:
    """CFLAGS, then BMC_KERNEL_CFLAGS (e.g. "-mno-avx512bf16 -mno-amx-tile": the build without an ISA path, whose
    answers the tests compare; part of the build's name)."""
    return CFLAGS + shlex.split(os.environ.get("BMC_KERNEL_CFLAGS", ""))
WING = os.path.join(os.path.dirname(__file__), "cpu")  # the kernels' sources and headers
_built: dict[str, Any] = {}


def build_name(stem: str, source_file: str) -> str:
    """`stem` and a hash of what the build reads: the source, the wing's headers it includes (`#include "cpu/..."`,
    followed through the headers), the headers rendered from Python tables, the flags and torch's version. A changed
    source is a new name, so a stale build in the cache is never loaded."""
    import torch

    digest = hashlib.sha256()
    for path in sources_of(source_file):
        with open(path, "rb") as f:
            digest.update(os.path.basename(path).encode() + b"\0" + f.read())
    for header, text in generated_headers().items():
        digest.update(header.encode() + b"\0" + text.encode())
    digest.update(" ".join(cflags() + LDFLAGS + [torch.__version__]).encode())
    return f"{stem}_{digest.hexdigest()[:12]}"


def sources_of(source_file: str) -> list[str]:
    """The source and every wing header it includes, directly or through another header, in the order first met."""
    seen, todo = [], [source_file]
    while todo:
        path = todo.pop(0)
        if path in seen:
            continue
        seen.append(path)
        with open(path) as f:
            todo += [os.path.join(os.path.dirname(WING), name) for name in _INCLUDE.findall(f.read())]
    return seen


_INCLUDE = re.compile(r'^#include "(cpu/[\w.]+)"', re.MULTILINE)


def generated_headers() -> dict[str, str]:
    """Headers rendered from Python tables, by file name (the kernels include them as `#include "<name>"`)."""
    from .block_kinds import cpp_header

    return {"block_kinds.h": cpp_header()}


def _write(path: str, text: str) -> None:
    """`text` at `path` unless it is there already; atomic: a build beside this one never reads half a header."""
    if os.path.exists(path):
        with open(path) as f:
            if f.read() == text:
                return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_generated(build_dir: str) -> str:
    """The generated headers written under `build_dir`/generated; returns that folder (an include path)."""
    folder = os.path.join(build_dir, "generated")
    for header, text in generated_headers().items():
        _write(os.path.join(folder, header), text)
    return folder


def write_wing(build_dir: str, source_file: str) -> str:
    """The wing headers the source includes, copied under `build_dir`/wing/cpu; returns `build_dir`/wing (an
    include path). The build then names no path of this install: torch's extension versioner hashes the include
    paths, so two installs of the same sources (a clone and a CI checkout) share one build instead of rebuilding
    each other's (the build directory is named by the sources' hash, `build_name`)."""
    folder = os.path.join(build_dir, "wing")
    root = os.path.dirname(WING)
    for path in sources_of(source_file)[1:]:
        with open(path) as f:
            _write(os.path.join(folder, os.path.relpath(path, root)), f.read())
    return folder


def build(stem: str, source_file: str, functions: list[str] | None, switch: str) -> Any:
    """The module compiled from the C++ file `source_file` (named by `build_name`), or None when the environment
    variable `switch` is "0" or the build fails (logged once). `functions=None` means the source has its own
    PYBIND11_MODULE. Called on every use (a GEMM of the PyTorch path, a SparQ step): after the first call, one
    dictionary lookup."""
    if stem in _built:
        return _built[stem]
    _built[stem] = None
    if os.environ.get(switch, "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory, load_inline

        name = build_name(stem, source_file)
        build_dir = _get_build_directory(name, False)
        if not os.path.exists(os.path.join(build_dir, name + ".so")):
            # a minute of silence would look like a hang: say what is happening, once per machine
            sys.stderr.write(f"bmc: compiling the C++ kernel {name} (first use on this machine, about a minute; "
                             f"cached afterwards; {switch}=0 skips it)\n")  # one write: kernels build side by side
            sys.stderr.flush()
        with open(source_file) as f:
            source = f.read()
        includes = [write_wing(build_dir, source_file), write_generated(build_dir)]
        _built[stem] = load_inline(name=name, cpp_sources=[source], functions=functions, extra_cflags=cflags(),
                                   extra_ldflags=LDFLAGS, extra_include_paths=includes, verbose=False)
    except Exception as e:  # no compiler, no ninja, ...: the eager path is exact too, only slower
        lines = [ln for ln in str(e).splitlines() if "error" in ln.lower()] or str(e).splitlines() or [repr(e)]
        log.warning("bmc: C++ kernel %s unavailable (%s); using the PyTorch path (set %s=0 to skip the build)",
                    stem, lines[-1][-300:], switch)
    return _built[stem]
