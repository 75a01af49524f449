"""The weights of a loaded model in one file, memory-mapped read-only: every process that maps it shares one copy
in the page cache (bmc-serve --instances K holds the weights once, not K times).

The file holds each distinct tensor storage of the model once (a tied embedding and the LM head share theirs),
and, on a CPU in float32, the native step's 16-column panels of every GEMM weight, so that the native decoder
reads the mapping instead of packing a private copy. After `share_weights(model)` the model's tensors are views
of the mapping; its own copies are freed. Tensors the running paths never read (the eager layout of the GEMM
weights, when the native step runs every step) stay on disk: mapped pages become resident only when touched.

The file is keyed by the source's content (its SHA-256, computed once per path, size, modification time and
inode and remembered in the cache's index.json), the dtype, the quantization and FORMAT_VERSION: the same model in
two virtualenvs is one file, a changed source or format writes a new one; a file that does not parse is
rewritten. Writers take a lock, so K processes starting together write it once and map the same file. The cache is
bounded: past BMC_WEIGHTS_CACHE_MAX bytes (default 16 GiB; "8G" and "500M" too) the least recently used files go
(a process mapping one keeps its pages: Linux frees them when the last mapping ends)."""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import time
import warnings
from typing import Any, Iterator

import numpy as np
import torch

from .ops import Linear
from .weights import ShapeSource, WeightSource

FORMAT_VERSION = 6  # 2: Q5_K / Q6_K / mixed fused matrices kept as q8x panels; 3: F16 / BF16 kept in 16 bits;
# 4: Q4_0 / Q4_1 in q4h panels (fp16 scales); 5: an untied quantized embedding kept quantized (net.embed_q);
# 6: Q4_0 in q4z panels (its offset implied)
MAGIC = b"BMCWEIGHTS\n"
ALIGN = 4096  # page-aligned tensors: the mapping hands out whole pages


def cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "bmc", "weights")


def weight_file_path(model: Any) -> str:
    return weight_file_for(model.path, model.dtype, model.quant)


DEFAULT_CACHE_MAX = 16 << 30
INDEX_ENTRIES = 1000  # paths remembered in index.json (the oldest forgotten first: hashed again if seen again)


def weight_file_for(source: str, dtype: torch.dtype, quant: str = "none") -> str:
    key = json.dumps([content_digest(source), str(dtype), quant, FORMAT_VERSION])
    return os.path.join(cache_dir(), f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.bmcw")  # no path in it


def _identity(path: str) -> list:
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ino]


def content_digest(source: str) -> str:
    """SHA-256 of the source's bytes (a directory: of its files' names and bytes), from the cache's index when this
    path, size, modification time and inode were hashed before."""
    files = ([source] if os.path.isfile(source) else
             sorted(os.path.join(source, f) for f in os.listdir(source) if os.path.isfile(os.path.join(source, f))))
    ident = json.dumps([_identity(f) for f in files])
    index_path = os.path.join(cache_dir(), "index.json")
    index = _read_json(index_path)
    if ident in index:
        return index[ident]
    digest = hashlib.sha256()
    for f in files:
        digest.update(os.path.basename(f).encode() + b"\0" if len(files) > 1 else b"")
        with open(f, "rb") as fh:
            while chunk := fh.read(8 << 20):
                digest.update(chunk)
    value = digest.hexdigest()
    index[ident] = value
    while len(index) > INDEX_ENTRIES:
        index.pop(next(iter(index)))
    try:
        os.makedirs(os.path.dirname(index_path), exist_ok=True)
        tmp = f"{index_path}.{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(index, fh)
        os.replace(tmp, index_path)  # atomic: a reader never sees half of it
    except OSError:
        pass  # a read-only cache: hashed again next time
    return value


def _read_json(path: str) -> dict:
    try:
        with open(path) as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def cache_max_bytes() -> int:
    """BMC_WEIGHTS_CACHE_MAX: bytes, or a number with K, M, G or T; default 16 GiB."""
    raw = os.environ.get("BMC_WEIGHTS_CACHE_MAX", "").strip().upper()
    if not raw:
        return DEFAULT_CACHE_MAX
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(raw[-1:], 1)
    try:
        return int(float(raw[:-1] if scale > 1 else raw) * scale)
    except ValueError:
        warnings.warn(f"bmc: BMC_WEIGHTS_CACHE_MAX={raw!r} is not a size; using {DEFAULT_CACHE_MAX >> 30} GiB")
        return DEFAULT_CACHE_MAX


def touch(path: str) -> None:
    """Mark a weight file used now: its access time (its modification time stays: it says when it was written)."""
    try:
        os.utime(path, ns=(time.time_ns(), os.stat(path).st_mtime_ns))
    except OSError:
        pass


def evict(keep: str, limit: int | None = None) -> list[str]:
    """Delete the least recently used weight files (by access time: a use touches its file) until the cache
    holds at most `limit` bytes (default cache_max_bytes()); `keep` (the file just used) stays whatever its size.
    Returns the deleted files."""
    limit = cache_max_bytes() if limit is None else limit
    folder = os.path.dirname(keep)
    entries = []
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.endswith(".bmcw") and os.path.isfile(path):
            st = os.stat(path)
            entries.append((st.st_atime_ns, st.st_size, path))
    total = sum(size for _, size, _ in entries)
    deleted = []
    for _, size, path in sorted(entries):
        if total <= limit:
            break
        if os.path.abspath(path) == os.path.abspath(keep):
            continue
        try:
            os.remove(path)
            if os.path.exists(path + ".lock"):
                os.remove(path + ".lock")
        except OSError:
            continue
        total -= size
        deleted.append(path)
    return deleted


def load_mapped(source: str, dtype: torch.dtype, quant: str = "none") -> Any | None:
    """A GGUF model built straight from its weight file, nothing read from the source but its metadata (config and
    tokenizer): the fast start. None where there is no readable weight file for it or it does not fit.
    quant: as resolved by models.resolve_quant ("none", "gguf", "q8_0", "q4_0")."""
    from . import model_from_tensors
    from .gguf import load_gguf

    if not source.endswith(".gguf") or not os.path.isfile(source):
        return None
    path = weight_file_for(source, dtype, quant)
    header = _read_header(path)
    if header is None:
        return None
    config, shapes, tokenizer = load_gguf(source, shapes_only=True, keep_blocks=quant == "gguf")
    model = model_from_tensors(config, shapes, tokenizer, origin=source, dtype=dtype, device="cpu",
                               source_type=ShapeSource, quant=quant)
    try:
        map_weight_file(model, path, header)
    except ValueError:
        return None
    if not getattr(model, "weight_file", None) or any(
            _get(owner, attr, index).untyped_storage().nbytes() != os.path.getsize(path)
            for _, owner, attr, index in _slots(model)):
        return None  # the file lacks a tensor this model has: load from the source
    touch(path)
    return model


class StreamingSource(WeightSource):
    """A WeightSource that writes each finished part of the model (a layer, then the net's own tensors: finish())
    into the weight file being written, where the shape model's layout puts it, and leaves the part zero-byte
    placeholders of the same shapes: a first load holds one layer's panels at a time, not the model's, and the
    mapping of the finished file replaces the placeholders (stream_first_load)."""

    def __init__(self, tensors: Any, *, fd: int, header: dict[str, Any], **kw: Any) -> None:
        super().__init__(tensors, **kw)
        self.fd, self.header = fd, header
        self.entries: dict[str, list[dict[str, Any]]] = {}
        for e in header["entries"]:  # a tuple's tensors are listed in order under one name
            self.entries.setdefault(e["name"], []).append(e)
        self.written: set[str] = set()

    def finish(self, prefix: str, obj: Any) -> Any:
        seen: dict[str, int] = {}
        for name, owner, attr, index in _object_slots(prefix, obj):
            t = _get(owner, attr, index)
            k = seen[name] = seen.get(name, -1) + 1
            if f"{name}#{k}" in self.written:  # finished earlier (a part may be handed over more than once)
                continue
            e = self.entries.get(name, [])[k] if k < len(self.entries.get(name, [])) else None
            if (e is None or list(t.shape) != e["size"] or str(t.dtype).split(".")[-1] != e["dtype"]
                    or e["stride"] != _contiguous_strides(t.shape)):
                raise ValueError(f"{name}: the model's tensor does not fit its shape model's layout")
            data = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
            pos = self.header["storages"][e["storage"]]["offset"] + e["offset"] * t.element_size()
            while data:
                n = os.pwrite(self.fd, data, pos)
                data, pos = data[n:], pos + n
            self.written.add(f"{name}#{k}")
            _set(owner, attr, index, torch.empty((), dtype=t.dtype).expand(t.shape))
        return obj


def _contiguous_strides(shape: Any) -> list[int]:
    strides, step = [], 1
    for n in reversed(list(shape)):
        strides.append(step)
        step *= max(int(n), 1)
    return strides[::-1]


def stream_first_load(source: str, dtype: torch.dtype, quant: str) -> Any | None:
    """The first load of a GGUF file on a CPU: its weight file is laid out from the shape model, and each layer is
    written to it as soon as it is built and then dropped, so the load's resident memory holds one layer's panels
    (not the file's worth of panels beside the file's own pages); the model then maps the file. None where this
    does not apply (not a GGUF; matrices kept in float, whose panels write_weight_file makes): load_model and
    share_weights instead. Writers take the cache's lock, as share_weights does."""
    from . import model_from_tensors
    from .gguf import DeferredBlocks, load_gguf
    from .quant import QuantWeight

    if not source.endswith(".gguf") or not os.path.isfile(source) or quant != "gguf":
        return None
    path = weight_file_for(source, dtype, quant)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    model = None
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one writer; the others wait and map what it wrote
        if _read_header(path) is None:
            config, tensors, tokenizer = load_gguf(source, keep_blocks=True)  # nothing read yet but metadata
            shapes = {k: QuantWeight(v.kind, v.shape, None) if isinstance(v, DeferredBlocks) else v
                      for k, v in tensors.items()}
            shape_model = model_from_tensors(config, shapes, None, origin=source, dtype=dtype, device="cpu",
                                             source_type=ShapeSource, quant=quant)
            if any(lin.wt is not None for lin in shape_model.linears()):
                return None
            header, _ = _layout(shape_model)
            del shape_model, shapes
            tmp = f"{path}.{os.getpid()}.tmp"
            sources: list[StreamingSource] = []

            def streaming(tensors: Any, **kw: Any) -> StreamingSource:
                sources.append(StreamingSource(tensors, fd=f.fileno(), header=header, **kw))
                return sources[-1]

            try:
                with open(tmp, "wb") as f:
                    _write_header(f, header)
                    model = model_from_tensors(config, tensors, tokenizer, origin=source, dtype=dtype, device="cpu",
                                               source_type=streaming, quant=quant)  # type: ignore[arg-type]
                    del tensors
                    if len(sources[0].written) != len(header["entries"]):
                        raise ValueError(f"{len(header['entries']) - len(sources[0].written)} tensors not written")
                os.replace(tmp, path)
                map_weight_file(model, path, header)
            except ValueError:
                return None
            finally:
                if os.path.exists(tmp):  # a failed write leaves nothing behind
                    os.remove(tmp)
    if model is None:  # another process wrote it meanwhile
        model = load_mapped(source, dtype, quant)
        if model is None:
            return None
    _mapped(path)
    return model


def _slots(model: Any) -> Iterator[tuple[str, Any, str, int | None]]:
    """(name, owner, attribute, tuple index) of every tensor the model's net holds: its own attributes, its layers',
    and those of their Linear weights (wt, b, panels)."""
    net = model.net
    for prefix, obj in [("net", net), *((f"layers.{i}", L) for i, L in enumerate(net.layers))]:
        yield from _object_slots(prefix, obj)


def _object_slots(prefix: str, obj: Any) -> Iterator[tuple[str, Any, str, int | None]]:
    for attr, v in list(vars(obj).items()):
        if isinstance(v, torch.Tensor):
            yield f"{prefix}.{attr}", obj, attr, None
        elif isinstance(v, Linear):
            for sub in ("wt", "b", "panels"):
                if isinstance(getattr(v, sub), torch.Tensor):
                    yield f"{prefix}.{attr}.{sub}", v, sub, None
        elif isinstance(v, tuple):
            for j, x in enumerate(v):
                if isinstance(x, torch.Tensor):
                    yield f"{prefix}.{attr}", obj, attr, j


def _get(owner: Any, attr: str, index: int | None) -> torch.Tensor:
    v = getattr(owner, attr)
    return v if index is None else v[index]


def _set(owner: Any, attr: str, index: int | None, t: torch.Tensor) -> None:
    if index is None:
        setattr(owner, attr, t)
    else:
        v = list(getattr(owner, attr))
        v[index] = t
        setattr(owner, attr, tuple(v))


def _add_panels(model: Any) -> None:
    """The native step's panels of every GEMM weight (CPU, float32, where the native kernel builds)."""
    from ..kernels.native import native_module, native_supported

    if not native_supported(model.device, model.dtype):
        return
    mod = native_module()
    for lin in model.linears():
        if lin.panels is None and lin.wt.dim() == 2:
            lin.panels = mod.pack_panels(lin.wt)


def write_weight_file(model: Any, path: str) -> None:
    """Every distinct storage once, page-aligned, after a JSON header; written to a temporary name and renamed."""
    _add_panels(model)
    header, blobs = _layout(model)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        _write_header(f, header)
        for b, s in zip(blobs, header["storages"]):
            f.seek(s["offset"])
            f.write(memoryview(b.numpy()))
    os.replace(tmp, path)


def _write_header(f: Any, header: dict[str, Any]) -> None:
    text = json.dumps(header).encode()
    if len(text) > header["reserved"]:
        raise AssertionError("weight file header outgrew its reserved space")
    f.write(MAGIC + len(text).to_bytes(8, "little") + text)
    f.truncate(header["size"])


def _layout(model: Any) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The file's header for the model's tensors (each distinct storage once, page-aligned) and those storages
    as uint8 tensors, in the header's order."""
    storages: dict[int, tuple[int, torch.Tensor]] = {}  # storage data_ptr -> (index, a uint8 view of all of it)
    entries = []
    for name, owner, attr, index in _slots(model):
        t = _get(owner, attr, index)
        if t.device.type != "cpu":
            raise ValueError("weight files hold CPU tensors only")
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in storages:
            storages[key] = (len(storages), torch.empty(0, dtype=torch.uint8).set_(st))
        entries.append({"name": name, "storage": storages[key][0], "offset": t.storage_offset(),
                        "size": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype).split(".")[-1]})
    blobs = [b for _, b in sorted(storages.values(), key=lambda x: x[0])]
    header = {"version": FORMAT_VERSION, "entries": entries, "storages": []}
    # offsets depend on the header's length: lay out with a generous fixed header size
    header_bytes = len(json.dumps(header)) + 64 * len(blobs) + 4096
    pos = (len(MAGIC) + 8 + header_bytes + ALIGN - 1) // ALIGN * ALIGN
    for b in blobs:
        header["storages"].append({"offset": pos, "nbytes": b.numel()})
        pos = (pos + b.numel() + ALIGN - 1) // ALIGN * ALIGN
    header["reserved"], header["size"] = header_bytes, pos
    return header, blobs


def _read_header(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                return None
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        size = os.path.getsize(path)
        if header.get("version") != FORMAT_VERSION or any(s["offset"] + s["nbytes"] > size for s in header["storages"]):
            return None
        return header
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _resolve(model: Any, name: str) -> tuple[Any, str]:
    """The object and attribute a file entry's name points at ('net.norm', 'layers.3.qkv.wt', ...)."""
    parts = name.split(".")
    if parts[0] == "net":
        obj, rest = model.net, parts[1:]
    elif parts[0] == "layers" and len(parts) > 2 and parts[1].isdigit() and int(parts[1]) < len(model.net.layers):
        obj, rest = model.net.layers[int(parts[1])], parts[2:]
    else:
        raise ValueError(f"no such weight: {name}")
    for part in rest[:-1]:
        obj = getattr(obj, part)
    if not hasattr(obj, rest[-1]):
        raise ValueError(f"no such weight: {name}")
    return obj, rest[-1]


def map_weight_file(model: Any, path: str, header: dict[str, Any]) -> None:
    """Replace the model's tensors by read-only views of the file's mapping (same values; an in-place write to a
    weight faults instead of changing another process's weights). Raises ValueError, changing nothing, where
    the file does not fit the model."""
    mapping = np.memmap(path, dtype=np.uint8, mode="r")
    with warnings.catch_warnings():  # torch warns that the array is not writable: that is the point
        warnings.simplefilter("ignore", UserWarning)
        whole = torch.from_numpy(mapping)
    plan: list[tuple[Any, str, int | None, torch.Tensor]] = []
    seen: dict[str, int] = {}
    for e in header["entries"]:
        s = header["storages"][e["storage"]]
        base = whole[s["offset"] : s["offset"] + s["nbytes"]].view(getattr(torch, e["dtype"]))
        # as_strided counts its offset from the start of the whole mapping, not from base
        t = base.as_strided(e["size"], e["stride"], base.storage_offset() + e["offset"])
        owner, attr = _resolve(model, e["name"])
        old = getattr(owner, attr)
        index = None
        if isinstance(old, tuple):  # a tuple's tensors are listed in order under one name
            index = seen[e["name"]] = seen.get(e["name"], -1) + 1
            old = old[index]
        if old is None and attr == "wt" and isinstance(owner, Linear) and owner.panels is not None:
            continue  # a weight kept as panels only (the native step built): its eager layout is not needed
        if old is None and attr == "panels" and isinstance(owner, Linear):  # panels the model has not built
            k, n = owner.wt.shape
            if tuple(t.shape) != ((n + 15) // 16, k, 16) or t.dtype != owner.wt.dtype:
                raise ValueError(f"weight file {path}: {e['name']} does not fit the model")
            old = t
        if not isinstance(old, torch.Tensor) or old.shape != t.shape or old.dtype != t.dtype:
            raise ValueError(f"weight file {path}: {e['name']} does not fit the model")
        plan.append((owner, attr, index, t))
    for owner, attr, index, t in plan:
        _set(owner, attr, index, t)
    for lin in model.linears():
        lin.packed, lin.packed_m = None, 0  # MKL copies of the old tensors
    from ..kernels.native import NativeDecoders

    model.net.native = NativeDecoders()  # a decoder built before holds private panels: build it from the mapping
    model.weight_file = path


def share_weights(model: Any, path: str | None = None) -> str:
    """Map the model's weights from its weight file (written first if missing or unreadable), freeing the
    model's own copies. Returns the file's path."""
    if model.device.type != "cpu":
        raise ValueError("shared weight files are for CPU models")
    path = path or weight_file_path(model)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one writer; the others wait and map what it wrote
        header = _read_header(path)
        if header is not None:
            try:
                map_weight_file(model, path, header)
            except ValueError:
                header = None
        if header is None:
            write_weight_file(model, path)
            header = _read_header(path)
            if header is None:
                raise OSError(f"could not write the weight file {path}")
            map_weight_file(model, path, header)
    _mapped(path)
    return path


def _mapped(path: str) -> None:
    """A model now maps `path`: mark it used, keep the cache within its bound, free what the mapping replaced."""
    touch(path)
    try:
        evict(path)
    except OSError:
        pass
    _release_freed_memory()


def _release_freed_memory() -> None:
    """glibc keeps freed heap memory for reuse; hand the freed weights back to the system now (and the panel
    arena's last chunk, which its mapped replacements no longer use)."""
    from .quant import PANEL_ARENA

    PANEL_ARENA.drop()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
