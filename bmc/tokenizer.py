"""One small tokenizer class over real libraries: `tokenizers` (tokenizer.json or a GGUF vocabulary)
and `sentencepiece` (tokenizer.model). Chat formatting renders the model's own jinja2 template."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

from .errors import ModelLoadError


@dataclass
class Tokenizer:
    backend: Any  # tokenizers.Tokenizer or sentencepiece.SentencePieceProcessor
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    add_bos: bool = False  # prepend BOS ourselves (only when the backend does not already do it)
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None

    @property
    def is_sentencepiece(self) -> bool:
        return hasattr(self.backend, "EncodeAsIds")

    @property
    def vocab_size(self) -> int:
        if self.is_sentencepiece:
            return int(self.backend.GetPieceSize())
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.is_sentencepiece:
            ids = list(self.backend.EncodeAsIds(text))
        else:
            # encode_batch releases the GIL while it works, encode does not for all of it: a long prompt tokenized
            # on a server's worker thread would otherwise stall its event loop
            ids = list(self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (OpenAI's logprobs `bytes`): a token that holds part of a UTF-8
        character gives that part, not a replacement character. Byte-level BPE pieces map back through GPT-2's
        byte alphabet, `<0xNN>` pieces (byte fallback) are their byte, '▁' is a space; else the decoded text."""
        piece = (self.backend.IdToPiece(token_id) if self.is_sentencepiece else self.backend.id_to_token(token_id))
        if piece is None:
            return b""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        if not self.is_sentencepiece and "ByteLevel" in repr(self.backend.decoder):
            table = _byte_level_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if "\u2581" in piece:
            return piece.replace("\u2581", " ").encode("utf-8")
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def logprob_text(self, token_id: int) -> str:
        """A token as the logprobs' `token` shows it: its text, or where its bytes are not whole UTF-8 (a part of a
        character) `bytes:\\xNN...`, as OpenAI writes them, so that two such tokens never read as the same "\ufffd"."""
        raw = self.token_bytes(token_id)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return self.decode([token_id], skip_special_tokens=False)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if self.is_sentencepiece:
            if skip_special_tokens:
                special = {self.bos_token_id, self.pad_token_id, *self.eos_token_ids}
                ids = [i for i in ids if i not in special]
            return self.backend.DecodeIds(ids)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **variables: Any) -> str:
        """Render the model's chat template (jinja2, as HF transformers does; `variables` such as `tools` are the
        template's too). Raises if the model has none."""
        if not self.chat_template:
            raise ModelLoadError("this model has no chat template: give one with --chat-templa"
                                 "te NAME|FILE (built in: chatml, llama3, gemma; in Python, model.tokenizer.chat_template = bmc.chat_templates.chat_template(NAME))")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **variables,
        )


def _token_text(entry: Any) -> str | None:
    if entry is None:
        return None
    if isinstance(entry, dict):  # {"content": "<s>", ...} form of tokenizer_config.json
        return entry.get("content")
    return str(entry)


def load_hf_tokenizer(model_dir: str, config: dict[str, Any]) -> Tokenizer | None:
    """tokenizer.json (preferred) or tokenizer.model from an HF directory; None if neither exists."""
    tok_cfg: dict[str, Any] = {}
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            tok_cfg = json.load(f)
    template = tok_cfg.get("chat_template")
    template_path = os.path.join(model_dir, "chat_template.jinja")
    if template is None and os.path.exists(template_path):
        with open(template_path, encoding="utf-8") as f:
            template = f.read()
    if isinstance(template, list):  # list of named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])

    json_path = os.path.join(model_dir, "tokenizer.json")
    sp_path = os.path.join(model_dir, "tokenizer.model")
    if os.path.exists(json_path):
        from tokenizers import Tokenizer as HFTokenizer

        backend: Any = HFTokenizer.from_file(json_path)
        add_bos = False  # tokenizer.json's post-processor adds BOS itself when the model wants it
        token_to_id = backend.token_to_id
    elif os.path.exists(sp_path):
        import sentencepiece

        backend = sentencepiece.SentencePieceProcessor(model_file=sp_path)
        add_bos = bool(tok_cfg.get("add_bos_token", True))
        token_to_id = lambda t: (backend.PieceToId(t) if t is not None else None)  # noqa: E731
    else:
        return None

    bos_text = _token_text(tok_cfg.get("bos_token"))
    eos_text = _token_text(tok_cfg.get("eos_token"))
    bos_id = token_to_id(bos_text) if bos_text else None
    if bos_id is None:
        bos_id = config.get("bos_token_id")
    eos_ids: list[int] = []
    if eos_text and token_to_id(eos_text) is not None:
        eos_ids.append(int(token_to_id(eos_text)))
    cfg_eos = config.get("eos_token_id")
    for e in cfg_eos if isinstance(cfg_eos, list) else [cfg_eos]:
        if e is not None and int(e) not in eos_ids:
            eos_ids.append(int(e))
    pad_text = _token_text(tok_cfg.get("pad_token"))
    pad_id = token_to_id(pad_text) if pad_text else config.get("pad_token_id")
    return Tokenizer(
        backend=backend,
        bos_token_id=bos_id,
        eos_token_ids=eos_ids,
        pad_token_id=pad_id,
        add_bos=add_bos,
        chat_template=template,
        bos_token=bos_text,
        eos_token=eos_text,
    )


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: each of the 256 bytes is one printable character in its pieces."""
    global _BYTE_LEVEL
    if _BYTE_LEVEL is None:
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                     *range(ord("\u00ae"), ord("\u00ff") + 1)]
        chars, extra = {}, 0
        for b in range(256):
            if b in printable:
                chars[chr(b)] = b
            else:
                chars[chr(256 + extra)] = b
                extra += 1
        _BYTE_LEVEL = chars
    return _BYTE_LEVEL


_BYTE_LEVEL: dict[str, int] | None = None
