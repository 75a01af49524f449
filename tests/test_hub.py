"""Models by name (bmc/models/hub.py): ORG/NAME and ORG/NAME:FILE.gguf resolved through huggingface_hub's cache, laid
out here by the test as the hub writes it (blobs, snapshots linking to them, refs/main); the hub is never reached."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import bmc
from bmc.errors import ModelLoadError
from bmc.models.hub import is_hub_name, split_name

from .test_gguf import _write as write_tiny_gguf

pytest.importorskip("huggingface_hub")
from huggingface_hub import constants  # noqa: E402
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def put_repo(cache: Path, repo: str, files: dict[str, Path]) -> None:
    """`files` (name in the repo -> a local file) as the hub cache holds a downloaded revision."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(COMMIT)
    snap = root / "snapshots" / COMMIT
    snap.mkdir(parents=True, exist_ok=True)
    (root / "blobs").mkdir(exist_ok=True)
    for i, (name, src) in enumerate(files.items()):
        blob = root / "blobs" / f"{i:040x}"
        shutil.copyfile(src, blob)
        (snap / name).symlink_to(os.path.relpath(blob, snap))


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, gqa_dir):
    cache = tmp_path / "hub"
    put_repo(cache, "tiny-org/tiny-llama", {p.name: p for p in Path(gqa_dir).iterdir() if p.is_file()})
    write_tiny_gguf(str(tmp_path / "tiny.gguf"))
    put_repo(cache, "tiny-org/tiny-gguf", {"tiny-q.gguf": tmp_path / "tiny.gguf", "README.md": tmp_path / "tiny.gguf"})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # the test never reaches the network
    return cache


def test_names_are_told_from_paths(tmp_path, monkeypatch):
    assert split_name("org/name") == ("org/name", None)
    assert split_name("org/name:file.gguf") == ("org/name", "file.gguf")
    assert split_name("org/name:file.bin") is None and split_name("just-a-name") is None
    assert split_name("a/b/c") is None and split_name("dir/model.gguf") is None
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    monkeypatch.chdir(tmp_path)  # given back after the test: later tests start processes from the repository
    assert not is_hub_name("org/name"), "a path that exists is a path"
    assert is_hub_name("org/other")


def test_a_hub_name_loads_the_cached_repo_and_gguf_file(hub_cache, gqa_dir, tmp_path):
    prompts = [[5, 17, 33, 80], [40, 41]]
    want = [c.token_ids for c in bmc.generate(bmc.load(str(gqa_dir)), prompts, max_new_tokens=8, ignore_eos=True)]
    by_name = bmc.load("tiny-org/tiny-llama")
    assert [c.token_ids for c in bmc.generate(by_name, prompts, max_new_tokens=8, ignore_eos=True)] == want
    gguf = bmc.load("tiny-org/tiny-gguf:tiny-q.gguf")
    assert gguf.path.endswith("tiny-q.gguf") and str(hub_cache) in gguf.path
    direct = bmc.generate(bmc.load(str(tmp_path / "tiny.gguf")), prompts, max_new_tokens=8, ignore_eos=True)
    got = bmc.generate(gguf, prompts, max_new_tokens=8, ignore_eos=True)
    assert [c.token_ids for c in got] == [c.token_ids for c in direct]


def test_names_not_in_the_cache_say_what_to_do(hub_cache):
    with pytest.raises(ModelLoadError, match="not in the Hugging Face cache.*HF_HUB_OFFLINE.*hf download"):
        bmc.load("someone/not-here")
    with pytest.raises(ModelLoadError, match="no config.json.*tiny-org/tiny-gguf:FILE.gguf"):
        bmc.load("tiny-org/tiny-gguf")
    with pytest.raises(ModelLoadError, match="model path does not exist: no/such/path.*ORG/NAME"):
        bmc.load("no/such/path")


def test_bmc_models_lists_what_loads_by_name(hub_cache, capsys, tmp_path, monkeypatch):
    from bmc.cli.models import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    weights = tmp_path / "xdg" / "bmc" / "weights"
    weights.mkdir(parents=True)
    (weights / "m-0123.bmcw").write_bytes(b"x" * 1000)
    main(["--json"])
    listed = json.loads(capsys.readouterr().out)
    names = {m["name"]: m for m in listed["models"]}
    assert "tiny-org/tiny-llama" in names and "tiny-org/tiny-gguf:tiny-q.gguf" in names
    assert "tiny-org/tiny-gguf" not in names, "a repo without config.json loads only by its files"
    assert names["tiny-org/tiny-gguf:tiny-q.gguf"]["bytes"] == os.path.getsize(hub_cache / "models--tiny-org--tiny-gguf"
                                                                                / "snapshots" / COMMIT / "tiny-q.gguf")
    assert listed["weights_cache_files"] == [{"file": "m-0123.bmcw", "bytes": 1000}]
    main(["--clear-weights-cache"])
    assert "deleted 1 files" in capsys.readouterr().out and not any(weights.iterdir())
