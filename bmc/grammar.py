"""Constrained decoding through llguidance: a JSON schema, any JSON object, a regular expression or a Lark/GBNF
grammar becomes a token matcher per row; each step the row's allowed tokens mask its logits before greedy or
sampled selection, and the chosen token advances its matcher. A row whose grammar is complete stops ("stop").

Why llguidance (not xgrammar): both give masks far below a decode step on this CPU (bench/grammar_masks.py,
docs/performance.md, "Constrained decoding"); llguidance is one small wheel with no dependencies, where xgrammar
pulls in triton and its own FFI runtime."""
from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .errors import InvalidRequestError, UnsupportedModelError

if TYPE_CHECKING:
    from .models import Model

KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf")
# JSON as json.dumps writes it, one space after "," and ":" and no other whitespace: the style models have seen
# most, and no room for a model to spin in newlines (a schema's "x-guidance" options override these)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match: `kind` one of KINDS, `source` the schema (JSON text) or the pattern or
    grammar text (empty for json_object: any JSON object)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"grammar kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if not isinstance(self.source, str):
            raise InvalidRequestError(f"a {self.kind} grammar is given as text, got {type(self.source).__name__}")

    @staticmethod
    def json_schema(schema: dict[str, Any] | str | bool) -> "GrammarSpec":
        """A JSON schema (a dict or its JSON text); True: any JSON object."""
        if schema is True:
            return GrammarSpec("json_object")
        if isinstance(schema, dict):
            return GrammarSpec("json_schema", json.dumps(schema))
        if isinstance(schema, str):
            return GrammarSpec("json_schema", schema)
        raise InvalidRequestError(f"json_schema must be a dict, its JSON text, or True, got {type(schema).__name__}")


def _library() -> Any:
    try:
        import llguidance
    except ImportError as e:  # a dependency: only a broken install lacks it
        raise UnsupportedModelError(f"constrained decoding needs llguidance ({e}); pip install llguidance") from e
    return llguidance


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of a spec (not yet checked)."""
    llg = _library()
    if spec.kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE)
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.source)
        except ValueError as e:
            raise InvalidRequestError(f"json_schema is not valid JSON: {e}") from None
        except RecursionError:
            raise InvalidRequestError("json_schema is nested too deeply to read") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(f"json_schema must be a JSON object, got {type(schema).__name__}")
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
        except (ValueError, RecursionError) as e:
            raise InvalidRequestError(f"json_schema cannot be compiled: {e}") from None
    if spec.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "gbnf":
        from llguidance.gbnf_to_lark import gbnf_to_lark
        try:
            lark = gbnf_to_lark(spec.source)
        except Exception as e:  # the converter raises bare Exceptions for a rule it cannot find
            raise InvalidRequestError(f"grammar (GBNF) cannot be compiled: {e}") from None
        return llg.LLMatcher.grammar_from_lark(lark)
    return llg.LLMatcher.grammar_from_lark(spec.source)


_lock = threading.Lock()


def tokenizer_for(model: "Model") -> Any:
    """The model's llguidance tokenizer (built once per model: about 0.2 s), over the model's whole logits row
    (ids past the tokenizer's vocabulary are never allowed)."""
    tok = model.tokenizer
    if tok is None:
        raise InvalidRequestError("constrained decoding needs the model's tokenizer; this model has none")
    if tok.is_sentencepiece:
        raise InvalidRequestError("constrained decoding is not supported for sentencepiece tokenizers yet "
                                  "(tokenizer.model); models with a tokenizer.json or a GGUF vocabulary are")
    with _lock:  # the server's handler threads and the engine thread may ask at once
        cached = model.__dict__.get("_llg_tokenizer")
        if cached is None:
            llg = _library()
            cached = model.__dict__["_llg_tokenizer"] = llg.LLTokenizer(
                tok.backend.to_str(), n_vocab=model.config.vocab_size, eos_token=list(tok.eos_token_ids) or None)
        return cached


def check_grammar(model: "Model", spec: GrammarSpec) -> str:
    """The spec's grammar, validated against the model's tokenizer: InvalidRequestError saying why it cannot be
    compiled (a 400 on the server)."""
    text = grammar_text(spec)
    llg = _library()
    error, messages = llg.LLMatcher.validate_grammar_with_warnings(text, tokenizer_for(model))
    if error:
        raise InvalidRequestError(f"{spec.kind} cannot be compiled: {messages[0] if messages else 'invalid'}")
    return text


# masks are computed here while the engine thread runs the next forward (llguidance lets go of the GIL)
_masks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bmc-grammar-masks")


class RowMatcher:
    """One row's matcher: the tokens it allows next, and the tokens it is given. After each token the next mask
    is started on a worker thread (`consume`), so it is computed beside the step's forward, not after it."""

    def __init__(self, model: "Model", grammar: str) -> None:
        llg = _library()
        self.matcher = llg.LLMatcher(tokenizer_for(model), grammar)
        if self.matcher.is_error():
            raise InvalidRequestError(f"the grammar cannot be compiled: {self.matcher.get_error()}")
        self.mask = torch.zeros(1, (model.config.vocab_size + 31) // 32, dtype=torch.int32)
        self.pending: Future | None = None
        self.finished = False  # the grammar is complete: nothing but EOS may follow

    def _fill(self) -> None:
        # what llguidance.torch.fill_next_token_bitmask does, without importing that module: it compiles a kernel
        # with torch.compile at import, which loads dynamo (seconds, in every process that constrains a request)
        row = self.mask[0]
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed tokens as bits (int32 words, llguidance's layout) into bitmask[row]."""
        if self.pending is None:
            self._fill()
        else:
            self.pending.result()
            self.pending = None
        bitmask[row] = self.mask[0]

    def consume(self, token: int) -> None:
        """Advance past `token` (a token the mask allowed) and start the next mask."""
        if self.pending is not None:  # a mask nobody read (the row's step failed): done before the matcher moves
            self.pending.result()
            self.pending = None
        if not self.matcher.consume_token(token):
            raise InvalidRequestError(f"token {token} breaks the request's grammar: {self.matcher.get_error()}")
        self.finished = bool(self.matcher.is_stopped())  # read now: the worker holds the matcher until its mask is read
        if not self.finished:
            self.pending = _masks.submit(self._fill)


def apply_masks(logits: torch.Tensor, matchers: list[RowMatcher]) -> torch.Tensor:
    """[n, V] float32 logits with every token a row's matcher forbids at -inf (a new tensor). The bits are unpacked
    by numpy and selected by torch.where: about 4x faster than a masked_fill over a vocabulary of 49152."""
    n, V = logits.shape
    bitmask = torch.zeros(n, (V + 31) // 32, dtype=torch.int32)
    for i, m in enumerate(matchers):
        m.fill_mask(bitmask, i)
    # int32 words, little-endian: token t is bit t % 8 of byte t // 8
    allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little").view(np.bool_)[:, :V]
    return torch.where(torch.from_numpy(allowed).to(logits.device), logits,
                       torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
