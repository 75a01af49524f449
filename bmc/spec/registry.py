"""Drafters by name: `speculative="NAME"` or `"NAME:ARG"` picks a factory that builds the drafter for one run."""
from __future__ import annotations

import os
import weakref
from typing import Callable

from ..errors import InvalidRequestError
from ..models import Model, load_model
from ..models.derive import quantize_int8, truncate_layers
from ..sampling import Sampler
from .draft_model import ModelDrafter
from .drafters import Drafter, NGramDrafter

DrafterFactory = Callable[[str | None, Model, Sampler], Drafter]  # (ARG or None, target model, run's sampler)

# Draft models outlive one generate() call: loading a checkpoint or quantizing the target takes seconds.
_DRAFT_MODELS: dict[tuple, tuple[weakref.ref, Model]] = {}


def _cached(target: Model, key: tuple, build: Callable[[], Model]) -> Model:
    key = (id(target), *key)
    hit = _DRAFT_MODELS.get(key)
    if hit is not None and hit[0]() is target:
        return hit[1]
    for k in [k for k, (ref, _) in _DRAFT_MODELS.items() if ref() is None]:  # targets since freed
        del _DRAFT_MODELS[k]
    model = build()
    _DRAFT_MODELS[key] = (weakref.ref(target), model)
    return model


def _ngram(arg: str | None, target: Model, sampler: Sampler) -> Drafter:
    return NGramDrafter()


def _draft_checkpoint(arg: str | None, target: Model, sampler: Sampler) -> Drafter:
    path = os.path.abspath(os.path.expanduser(str(arg)))
    draft = _cached(target, ("draft", path), lambda: load_model(path, dtype=target.dtype, device=target.device))
    if draft.config.vocab_size != target.config.vocab_size:
        raise InvalidRequestError(f"draft model {arg} has a vocabulary of {draft.config.vocab_size} tokens, the "
                                  f"target {target.config.vocab_size}: a draft must share the target's vocabulary")
    return ModelDrafter(draft, sampler)


def _first_layers(arg: str | None, target: Model, sampler: Sampler) -> Drafter:
    n, layers = int(str(arg)), target.config.num_layers
    if not 1 <= n <= layers:
        raise InvalidRequestError(f"speculative='layers:{n}': the target has {layers} layers; use 1 <= N <= {layers}")
    return ModelDrafter(truncate_layers(target, n), sampler)  # shares the target's tensors: nothing to cache


def _int8_self(arg: str | None, target: Model, sampler: Sampler) -> Drafter:
    return ModelDrafter(_cached(target, ("int8",), lambda: quantize_int8(target)), sampler)


DRAFTERS: dict[str, DrafterFactory] = {"ngram": _ngram, "draft": _draft_checkpoint, "layers": _first_layers,
                                       "int8-self": _int8_self}
TAKES_ARG: dict[str, str] = {"draft": "PATH", "layers": "N"}  # drafter name -> what its ARG is (others take none)


def parse_speculative(spec: str) -> tuple[str, str | None]:
    """'ngram' -> ('ngram', None); 'draft:PATH' -> ('draft', 'PATH'). Checks the syntax only (no model loaded)."""
    name, sep, arg = spec.partition(":")
    known = ", ".join(["off", *(f"{n}:{TAKES_ARG[n]}" if n in TAKES_ARG else n for n in DRAFTERS)])
    if name not in DRAFTERS:
        raise InvalidRequestError(f"unknown speculative drafter {spec!r}; choose from {known}")
    if name in TAKES_ARG and not arg:
        raise InvalidRequestError(f"speculative drafter {name!r} needs an argument: {name}:{TAKES_ARG[name]}")
    if name not in TAKES_ARG and sep:
        raise InvalidRequestError(f"speculative drafter {name!r} takes no argument, got {spec!r}")
    if name == "layers" and not (arg.isdigit() and int(arg) >= 1):
        raise InvalidRequestError(f"speculative={spec!r}: N must be an integer >= 1")
    return name, (arg if sep else None)


def make_drafter(spec: str, target: Model, sampler: Sampler) -> Drafter:
    name, arg = parse_speculative(spec)
    return DRAFTERS[name](arg, target, sampler)
