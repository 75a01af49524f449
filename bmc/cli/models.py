"""bmc-models: the models this machine can run without a download (the embedded default, the Hugging Face cache's
repos and GGUF files, by the names --model takes) and bmc's weights cache, with sizes."""
from __future__ import annotations

import json
import os
from typing import Any, Sequence

from .common import Parser, fail


def build_parser() -> Parser:
    p = Parser(prog="bmc-models", description=__doc__)
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.add_argument("--clear-weights-cache", action="store_true",
                   help="delete bmc's weights cache (~/.cache/bmc/weights: rebuilt by the next load of each model)")
    return p


def hub_models() -> tuple[str, list[dict[str, Any]]]:
    """(the hub cache's folder, its models by the names --model takes: a repo with a config.json as ORG/NAME, each
    GGUF file as ORG/NAME:FILE.gguf)."""
    try:
        import huggingface_hub as hub
        from huggingface_hub import constants
    except ImportError:
        return "", []
    cache = constants.HF_HUB_CACHE
    if not os.path.isdir(cache):
        return cache, []
    try:
        info = hub.scan_cache_dir(cache)
    except (OSError, ValueError):
        return cache, []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        files: dict[str, int] = {}
        for rev in repo.revisions:
            for f in rev.files:
                files[f.file_name] = f.size_on_disk
        if "config.json" in files:
            size = sum(v for k, v in files.items() if not k.endswith(".gguf"))
            out.append({"name": repo.repo_id, "bytes": size, "where": "hub cache"})
        for name, size in sorted(files.items()):
            if name.endswith(".gguf"):
                out.append({"name": f"{repo.repo_id}:{name}", "bytes": size, "where": "hub cache"})
    return cache, out


def weights_cache() -> tuple[str, list[dict[str, Any]]]:
    from ..models.weight_file import cache_dir

    folder = cache_dir()
    entries = []
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                entries.append({"file": name, "bytes": os.path.getsize(path)})
    return folder, entries


def human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.clear_weights_cache:
        folder, entries = weights_cache()
        freed = 0
        for e in entries:
            try:
                os.remove(os.path.join(folder, e["file"]))
                freed += e["bytes"]
            except OSError as err:
                fail(f"cannot delete {e['file']} in {folder}: {err.strerror}")
        print(f"deleted {len(entries)} files ({human(freed)}) from {folder}")
        return
    models = []
    try:
        from ..models import default_model_path

        path = default_model_path()
        models.append({"name": "(default)", "bytes": os.path.getsize(path), "where": path})
    except Exception:  # noqa: BLE001 (not installed: nothing to list)
        pass
    hub_dir, hub = hub_models()
    models += hub
    folder, cached = weights_cache()
    if args.json:
        print(json.dumps({"models": models, "hub_cache": hub_dir, "weights_cache": folder,
                          "weights_cache_files": cached}, indent=1))
        return
    width = max([len(m["name"]) for m in models] + [10])
    print(f"{'model (--model NAME)':<{width}}  {'size':>9}  where")
    for m in models:
        print(f"{m['name']:<{width}}  {human(m['bytes']):>9}  {m['where']}")
    if not hub:
        print(f"(no models in the Hugging Face cache {hub_dir or '(huggingface_hub not installed)'})")
    total = sum(e["bytes"] for e in cached)
    print(f"weights cache: {len(cached)} files, {human(total)} in {folder} (bmc-models --clear-weights-cache)")


if __name__ == "__main__":
    main()
