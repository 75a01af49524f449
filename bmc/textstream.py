"""Incremental detokenization for streaming, with stop strings.

Decoding a growing id list from scratch every token is quadratic, and decoding tokens one by one breaks
multi-byte characters and the leading-space rules of SentencePiece-style decoders. So, as TGI and vLLM do, each
push decodes a short window that starts a few tokens back, and emits only the part past the previous window;
text that could still become the start of a stop string is held back until it cannot."""
from __future__ import annotations

from .tokenizer import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # confirmed text (stop string and what follows it removed)
        self.emitted = 0
        self.searched = 0  # stop strings were looked for up to here

    def push(self, token_id: int, final: bool = False) -> tuple[str, bool]:
        """Add one token; return (new text to show, whether a stop string ended the text)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        window = decode(self.ids[self.prefix_offset :])
        if len(window) > len(prefix) and (final or not window.endswith("\ufffd")):
            self.text += window[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.stop:
            start = max(0, self.searched - self.hold)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            self.searched = len(self.text)
            if hits:
                self.text = self.text[: min(hits)]
                return self.flush(), True
        if final:
            return self.flush(), False
        safe = max(self.emitted, len(self.text) - self.hold)
        delta, self.emitted = self.text[self.emitted : safe], safe
        return delta, False

    def flush(self) -> str:
        delta, self.emitted = self.text[self.emitted :], len(self.text)
        return delta
