"""Incremental detokenisation for streaming, with stop strings.

Text is released only when it is final: never half a UTF-8 character (byte-level BPE can
split one across tokens) and never the tail that could still grow into a stop string.
"""
from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.tokens: list[int] = []
        self.emitted = 0      # characters already released
        self.stopped = False  # a stop string was found; the text ends before it
        self.text = ""

    def push(self, tokens: list[int]) -> str:
        """Add tokens; return the newly final text."""
        if self.stopped:
            return ""
        self.tokens.extend(tokens)
        full = self.tokenizer.decode(self.tokens)
        search_from = max(0, self.emitted - self.holdback)
        hits = [i for i in (full.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._release(full, min(hits))
        end = len(full) - self.holdback
        while end > self.emitted and full[end - 1] == "\ufffd":
            end -= 1
        return self._release(full, end)

    def finish(self) -> str:
        """The held-back rest at the end of generation."""
        if self.stopped:
            return ""
        return self._release(self.tokenizer.decode(self.tokens), None)

    def _release(self, full: str, end: int | None) -> str:
        end = len(full) if end is None else end
        if end <= self.emitted:
            return ""
        delta = full[self.emitted:end]
        self.emitted = end
        self.text += delta
        return delta
