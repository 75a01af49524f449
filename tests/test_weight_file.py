"""Weights mapped from a shared file (bmc.load(share_weights=True), what bmc-serve --instances gives each instance):
the same tokens as the model's own weights on the native and eager paths, the tensors views of one read-only
mapping with the native step's panels in it, the file written once and mapped again by the next load, a new
file when the source changes, and a corrupt file rewritten."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import bmc
from bmc.models.weight_file import _slots, weight_file_path

PROMPTS = [[5, 17, 33, 80, 101, 7, 9], [40, 41, 42]]


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def tokens(model, **kw):
    return [c.token_ids for c in bmc.generate(model, PROMPTS, max_new_tokens=12, ignore_eos=True, **kw)]


@pytest.mark.parametrize("variant", ["llama-gqa", "opt-pre_norm"])
def test_shared_weights_give_the_same_tokens(tiny_dirs, variant, monkeypatch):
    own = bmc.load(str(tiny_dirs[variant]))
    shared = bmc.load(str(tiny_dirs[variant]), share_weights=True)
    assert tokens(shared) == tokens(own)
    assert tokens(shared, speculative="ngram") == tokens(own)
    monkeypatch.setenv("BMC_NATIVE", "0")
    assert tokens(shared) == tokens(own)


def test_the_tensors_are_views_of_one_read_only_mapping(tiny_dirs):
    model = bmc.load(str(tiny_dirs["llama-gqa"]), share_weights=True)
    path = model.weight_file
    assert path == weight_file_path(model) and os.path.exists(path)
    size = os.path.getsize(path)
    mapped = [t for _, owner, attr, index in _slots(model)
              for t in [getattr(owner, attr) if index is None else getattr(owner, attr)[index]]]
    bases = {t.untyped_storage().data_ptr() for t in mapped}
    assert len(bases) == 1  # every weight, panels included, in the one mapping
    assert all(t.untyped_storage().nbytes() == size for t in mapped)
    with open("/proc/self/maps") as f:  # mapped read-only and shared: no process can write another's weights
        perms = {line.split()[1] for line in f if line.rstrip().endswith(path)}
    assert perms and all(p.startswith("r-") and p.endswith("s") for p in perms), perms
    if model.net.native_decoder() is not None:
        assert all(lin.panels is not None for lin in model.linears())
    own = bmc.load(str(tiny_dirs["llama-gqa"]))
    def by_name(m):
        return {name: getattr(o, a) if i is None else getattr(o, a)[i] for name, o, a, i in _slots(m)}

    mine, theirs = by_name(own), by_name(model)
    assert set(mine) <= set(theirs)  # plus the panels
    for name, t in mine.items():  # the same values, views (a tied embedding) included
        assert torch.equal(t, theirs[name]), name


def test_a_second_load_maps_the_file_written_by_the_first(tiny_dirs):
    first = bmc.load(str(tiny_dirs["llama-gqa"]), share_weights=True)
    stamp = os.stat(first.weight_file).st_mtime_ns
    second = bmc.load(str(tiny_dirs["llama-gqa"]), share_weights=True)
    assert second.weight_file == first.weight_file and os.stat(first.weight_file).st_mtime_ns == stamp
    assert tokens(second) == tokens(first)


def test_a_changed_source_gets_a_new_file_and_a_corrupt_one_is_rewritten(tiny_dirs, tmp_path):
    import shutil

    src = tmp_path / "model"
    shutil.copytree(tiny_dirs["llama-gqa"], src)
    own = tokens(bmc.load(str(src)))
    first = bmc.load(str(src), share_weights=True).weight_file
    os.utime(src / "config.json", ns=(1, 1))  # touched, the same bytes: the same file
    assert bmc.load(str(src), share_weights=True).weight_file == first
    with open(src / "config.json", "a") as f:  # other bytes (the same model): another file
        f.write("\n")
    second = bmc.load(str(src), share_weights=True).weight_file
    assert second != first
    with open(second, "r+b") as f:  # garbage over the header
        f.write(b"\0" * 64)
    again = bmc.load(str(src), share_weights=True)
    assert again.weight_file == second and tokens(again) == own
    with open(second, "r+b") as f:  # a header that parses, data cut short
        f.truncate(os.path.getsize(second) // 2)
    again = bmc.load(str(src), share_weights=True)
    assert tokens(again) == own
    assert np.fromfile(second, dtype=np.uint8, count=11).tobytes() == b"BMCWEIGHTS\n"


def test_a_gguf_model_starts_from_its_weight_file_without_dequantizing(tmp_path, monkeypatch):
    """The second load of a GGUF file reads only its metadata and maps the weight file the first wrote (the fast
    start): no tensor is dequantized, and the tokens and logits are the first load's. A changed file is loaded
    from its tensors again."""
    import gguf

    from .test_gguf import _write

    path = str(tmp_path / "tiny.gguf")
    _write(path)
    own = bmc.load(path)
    first = bmc.load(path, share_weights=True)
    calls = []
    real = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    fast = bmc.load(path, share_weights=True)
    assert not calls and fast.weight_file == first.weight_file
    ids = [[3, 5, 7, 11, 13]]
    assert [c.token_ids for c in bmc.generate(fast, ids, max_new_tokens=10, ignore_eos=True)] == \
        [c.token_ids for c in bmc.generate(own, ids, max_new_tokens=10, ignore_eos=True)]
    _write(path, tied=True)  # other bytes at the same path: loaded from its tensors again
    again = bmc.load(path, share_weights=True)
    assert calls and again.weight_file != first.weight_file


def test_an_unwritable_cache_falls_back_to_own_weights(tiny_dirs, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    model = bmc.load(str(tiny_dirs["llama-gqa"]), share_weights=True)
    assert getattr(model, "weight_file", None) is None
    assert "weights cache unavailable" in capsys.readouterr().err
    assert tokens(model) == tokens(bmc.load(str(tiny_dirs["llama-gqa"])))


def test_the_cache_is_keyed_by_content_and_bounded(tiny_dirs, tmp_path, monkeypatch):
    """The same model at two paths (two virtualenvs) is one weight file; past BMC_WEIGHTS_CACHE_MAX the least
    recently used files go, the one in use stays."""
    import shutil

    from bmc.models import weight_file as wf

    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(tiny_dirs["llama-gqa"], a)
    shutil.copytree(tiny_dirs["llama-gqa"], b)
    first = bmc.load(str(a), share_weights=True)
    assert bmc.load(str(b), share_weights=True).weight_file == first.weight_file
    folder = os.path.dirname(first.weight_file)
    old = []
    for i in range(3):  # older entries, used longest ago first
        p = os.path.join(folder, f"old{i}-0000000000000000.bmcw")
        with open(p, "wb") as f:
            f.write(b"\0" * 1000)
        os.utime(p, ns=(i + 1, i + 1))
        old.append(p)
    size = os.path.getsize(first.weight_file)
    others = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if n.endswith(".bmcw")) \
        - size - 3000
    deleted = wf.evict(first.weight_file, limit=size + others + 1500)
    assert deleted == old[:2] and os.path.exists(old[2]) and os.path.exists(first.weight_file)
    assert wf.evict(first.weight_file, limit=0) and os.listdir(folder).count(os.path.basename(first.weight_file)) == 1
    monkeypatch.setenv("BMC_WEIGHTS_CACHE_MAX", "8G")
    assert wf.cache_max_bytes() == 8 << 30
    monkeypatch.setenv("BMC_WEIGHTS_CACHE_MAX", "1500")
    assert wf.cache_max_bytes() == 1500


def _quantized_plan() -> list:
    from .test_gguf import LAYER_PLAN, Q

    return [(g, h, Q.Q4_1 if not g.endswith("norm") else Q.F32) for g, h, _ in LAYER_PLAN]


def test_a_first_gguf_load_streams_each_layer_into_the_file(tmp_path, monkeypatch):
    """The first load of a quantized GGUF (bmc.load(share_weights=True)) writes each layer to the weight file as
    soon as it is built and keeps only placeholders of it (no memory) until the file is mapped: when a layer is
    handed over, every earlier layer holds no weights of its own. The result is the model: the tokens of its own
    weights, a file the next load maps, nothing left behind."""
    import gguf

    from bmc.models import weight_file

    from .test_gguf import _write

    path = str(tmp_path / "tiny.gguf")
    _write(path, plan=_quantized_plan(), embed_type=gguf.GGMLQuantizationType.Q8_0)
    held: list[list[int]] = []
    real_finish = weight_file.StreamingSource.finish

    def finish(self, prefix, obj):
        if prefix.startswith("layers."):
            i = int(prefix.split(".")[1])
            held.append([j for j in range(i) if any(t.numel() and min(t.stride(), default=1) > 0 for t in (
                weight_file._get(o, a, k) for _, o, a, k in weight_file._object_slots("x", built[j])))])
            built.append(obj)
        return real_finish(self, prefix, obj)

    built: list = []
    monkeypatch.setattr(weight_file.StreamingSource, "finish", finish)
    first = bmc.load(path, share_weights=True)
    assert len(held) == first.config.num_layers and all(h == [] for h in held), held
    assert first.weight_file and not [f for f in os.listdir(os.path.dirname(first.weight_file)) if f.endswith(".tmp")]
    own = bmc.load(path)
    ids = [[3, 5, 7, 11, 13], [40, 41, 42]]
    want = [c.token_ids for c in bmc.generate(own, ids, max_new_tokens=10, ignore_eos=True)]
    assert [c.token_ids for c in bmc.generate(first, ids, max_new_tokens=10, ignore_eos=True)] == want
    again = bmc.load(path, share_weights=True)  # maps what the stream wrote
    assert again.weight_file == first.weight_file
    assert [c.token_ids for c in bmc.generate(again, ids, max_new_tokens=10, ignore_eos=True)] == want


def test_a_stream_that_fails_leaves_nothing_and_the_load_goes_on(tmp_path, monkeypatch):
    import gguf

    from bmc.models import weight_file

    from .test_gguf import _write

    path = str(tmp_path / "tiny.gguf")
    _write(path, plan=_quantized_plan(), embed_type=gguf.GGMLQuantizationType.Q8_0)

    def refuse(self, prefix, obj):
        raise ValueError("a layout that does not fit")

    monkeypatch.setattr(weight_file.StreamingSource, "finish", refuse)
    model = bmc.load(path, share_weights=True)  # written whole by share_weights instead
    folder = os.path.dirname(model.weight_file)
    assert not [f for f in os.listdir(folder) if f.endswith(".tmp")]
    ids = [[3, 5, 7, 11, 13]]
    assert [c.token_ids for c in bmc.generate(model, ids, max_new_tokens=8, ignore_eos=True)] == \
        [c.token_ids for c in bmc.generate(bmc.load(path), ids, max_new_tokens=8, ignore_eos=True)]


def test_a_first_load_peaks_near_one_file_of_memory(tmp_path):
    """A fresh process's first load of a 90 MB GGUF (llama.cpp's Q4_K_M mix on a shape whose rows are not whole
    K-quant super-blocks: Q5_0, Q8_0, Q4_K, Q6_K) peaks at most 1.4x the file above its runtime (torch and bmc
    imported), the panels streamed to the weights cache; writing them whole after the load measured 2.0x
    (bench/load_memory.py reports the real models)."""
    import importlib.util
    import json
    import subprocess
    import sys

    spec = importlib.util.spec_from_file_location(
        "load_memory", os.path.join(os.path.dirname(__file__), "..", "bench", "load_memory.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    path = str(tmp_path / "model.gguf")
    bench.write_qwen_shaped(path, dict(layers=12, hidden=768, ffn=2048, vocab=32000, heads=12, kv_heads=4))
    from bmc.kernels.native import native_module

    builds = os.path.dirname(os.path.dirname(native_module().__file__))  # this process's kernel build, not a new one
    out = subprocess.run([sys.executable, "-c", bench.CHILD, path], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TORCH_EXTENSIONS_DIR=builds))
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    file_mib = os.path.getsize(path) / 2**20
    assert r["peak_mib"] - r["runtime_mib"] <= 1.4 * file_mib, (r, file_mib)
