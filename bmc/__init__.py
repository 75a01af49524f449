"""bmc: LLM token generation on a KV cache Balanced between Memory and Compute.

    import bmc
    model = bmc.load()                      # the embedded SmolLM2-135M-Instruct
    for c in bmc.generate(model, ["The capital of France is"], max_new_tokens=20):
        print(c.text)

The names below come from bmc/api.py, imported on first use: `import bmc` alone loads neither torch nor the
models, so the command-line tools parse and check their arguments (and answer --help) at once.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["load", "generate", "stream", "perplexity", "GenerateOptions", "generation_config", "Completion",
           "Completions", "TokenEvent", "TokenStream", "Model", "GenerationStats", "BmcError", "InvalidRequestError",
           "ModelLoadError", "UnsupportedModelError"]

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from .api import (BmcError, Completion, Completions, GenerateOptions, GenerationStats, InvalidRequestError,
                      Model, ModelLoadError, Prompts, TokenEvent, TokenStream, UnsupportedModelError, generate,
                      generation_config, load, perplexity, stream)  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in __all__ or name == "Prompts":
        from . import api

        value = getattr(api, name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'bmc' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
