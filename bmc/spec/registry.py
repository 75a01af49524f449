"""Drafters by name: `speculative="NAME"` or `"NAME:ARG"` picks a factory that builds the drafter for one run."""
from __future__ import annotations

from typing import Callable

from ..errors import InvalidRequestError
from ..models import Model
from ..sampling import Sampler
from .drafters import Drafter, NGramDrafter

DrafterFactory = Callable[[str | None, Model, Sampler], Drafter]  # (ARG or None, target model, run's sampler)


def _ngram(arg: str | None, target: Model, sampler: Sampler) -> Drafter:
    return NGramDrafter()


DRAFTERS: dict[str, DrafterFactory] = {"ngram": _ngram}
TAKES_ARG: dict[str, str] = {}  # drafter name -> what its ARG is (names absent take none)


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
    return name, (arg if sep else None)


def make_drafter(spec: str, target: Model, sampler: Sampler) -> Drafter:
    name, arg = parse_speculative(spec)
    return DRAFTERS[name](arg, target, sampler)
