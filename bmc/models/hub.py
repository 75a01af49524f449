"""Models by name: `ORG/NAME` (an HF repo: its config, tokenizer and safetensors) or `ORG/NAME:FILE.gguf` (one GGUF
file of a repo), resolved through huggingface_hub into its cache, as transformers and llama.cpp's `-hf` do. The local
cache is read first (a name already downloaded loads with no network); HF_HOME / HF_HUB_CACHE and HF_HUB_OFFLINE are
huggingface_hub's own. Nothing here imports torch."""
from __future__ import annotations

import os
import re

from ..errors import ModelLoadError

# an HF repo id: ORG/NAME of letters, digits, '-', '_', '.' (not a path that exists: that is loaded as a path)
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HF_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja"]  # what an HF directory load reads


def split_name(spec: str) -> tuple[str, str | None] | None:
    """(repo id, GGUF file or None) when `spec` names a hub model, else None."""
    repo, _, file = spec.partition(":")
    if not _REPO.match(repo) or (file and not file.endswith(".gguf")) or repo.endswith(".gguf"):
        return None
    return repo, file or None


def is_hub_name(spec: str) -> bool:
    return not os.path.exists(os.path.expanduser(spec)) and split_name(spec) is not None


def model_source(spec: str) -> str:
    """A local path for `spec`: itself when it exists, else the hub cache's copy of the named model (downloaded
    unless it is there already or the hub is off). Raises ModelLoadError saying what to do."""
    path = os.path.expanduser(spec)
    if os.path.exists(path):
        return path
    name = split_name(spec)
    if name is None:
        raise ModelLoadError(f"model path does not exist: {spec} (a model on the Hugging Face hub is named ORG/NAME, "
                             "or ORG/NAME:FILE.gguf for one GGUF file of a repo)")
    repo, file = name
    try:
        import huggingface_hub as hub
        from huggingface_hub import constants
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise ModelLoadError(f"{spec} names a hub model, and huggingface_hub is not installed: "
                             "`pip install huggingface_hub`, or pass a local path") from None

    def fetch(local_only: bool) -> str:
        if file is not None:
            return hub.hf_hub_download(repo, file, local_files_only=local_only)
        folder = hub.snapshot_download(repo, allow_patterns=HF_FILES, local_files_only=local_only)
        if not os.path.exists(os.path.join(folder, "config.json")):
            raise ModelLoadError(f"{repo} has no config.json (not a transformers model): for a repo of GGUF files, "
                                 f"name one, {repo}:FILE.gguf")
        return folder

    try:
        return fetch(local_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError):
        pass
    cache = constants.HF_HUB_CACHE
    if constants.HF_HUB_OFFLINE:
        raise ModelLoadError(f"{spec} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set: download "
                             f"it where the hub is reachable (`hf download {repo}{' ' + file if file else ''}`), "
                             "or pass a local path")
    try:
        return fetch(local_only=False)
    except (HfHubHTTPError, OSError, ValueError, LocalEntryNotFoundError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelLoadError(f"{spec}: not in the Hugging Face cache ({cache}) and not downloaded ({reason}); "
                             "check the name and the network, or pass a local path") from None
