"""Incremental detokenisation for streaming, with stop strings.

Text is released only when it is final: never half a UTF-8 character (byte-level BPE and
byte-fallback tokens can split one across tokens; the decoder shows it as U+FFFD until it is
complete) and never the tail that could still grow into a stop string.

Decoding is incremental, as in vLLM and TGI (prefix and read offsets): each push decodes
only a window, the tokens released last time (as context, for decoders whose output depends
on the token before, such as SentencePiece's leading space) and those since, and takes the
text past the context's. The window moves on to the last token that ends a character, so a
push costs the same whatever the length of the stream, and the released text, joined, is
exactly the decode of all the tokens (for decoders that leave a finished character as it is
when more tokens follow, as byte-level BPE's does).

Stops follow OpenAI: the text ends just before the first stop string to be completed (the
earliest end; of two that end together, the longer), and the stop string is not in it. The
tokens end with the one in which the stop string ends; the rest are dropped. With `min_tokens`
(as vLLM's), a stop string completed by one of the first min_tokens - 1 tokens does not count.
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence

INCOMPLETE = "\ufffd"  # what the decoder shows for the bytes of an unfinished character
MAX_SPLIT = 3  # token boundaries to look back for a character's end: an unfinished one has at most 3 bytes


class TextStream:
    """One generation's tokens, pushed a round at a time, as final text and delivered tokens."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.unchecked = max(0, min_tokens - 1)  # tokens still to come that no stop string may end in
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.window: list[int] = []  # the tokens from the context on
        self.read = 0                # window[:read] is context: its text was released before
        self.context = ""            # decode(window[:read])
        self.seen = 0                # characters of the window's new text already scanned
        self.held = ""               # scanned text not yet released: it may begin a stop string
        self.kept = 0                # tokens taken; after a stop, up to the one that completes it
        self.stopped = False         # a stop string was found; the text ends before it

    def push(self, tokens: Sequence[int]) -> tuple[list[int], str]:
        """Add one round's tokens; return those to deliver (all of them, or up to the one
        that completes a stop string) and the newly final text."""
        tokens = list(tokens)
        if self.stopped:
            return [], ""
        if self.unchecked and tokens:  # those first, their text not searched for stop strings
            head, tokens = tokens[:self.unchecked], tokens[self.unchecked:]
            self.unchecked -= len(head)
            released = self._unchecked(lambda: self._push(head)[1])
            out, more = self._push(tokens) if tokens else ([], "")
            return head + out, released + more
        return self._push(tokens)

    def _unchecked(self, run):
        """run() with no stop string searched for (the text it scans is still held back as usual)."""
        stop, self.stop = self.stop, []
        try:
            return run()
        finally:
            self.stop = stop

    def _push(self, tokens: list[int]) -> tuple[list[int], str]:
        before = len(self.window)
        self.window.extend(tokens)
        new_text = self._new_text(len(self.window))
        visible = new_text.rstrip(INCOMPLETE)
        released, stop_end = self._scan(visible[self.seen:])
        self.seen = max(self.seen, len(visible))
        if stop_end is not None:
            end = len(visible) - stop_end  # where the stop string ends, as a position in visible
            take = max(self._token_ending(visible[:end]), before) - before  # of this round's tokens
            self.kept += take
            return tokens[:take], released
        self.kept += len(tokens)
        self._move_on(new_text)
        return tokens, released

    def _move_on(self, new_text: str) -> None:
        """Make the new tokens, up to the last that ends a character, the next push's context:
        the window stays a few tokens long (vLLM's prefix and read offsets)."""
        end, done = len(self.window), new_text
        lowest = max(self.read + 1, end - MAX_SPLIT)
        while done.endswith(INCOMPLETE) and end > lowest:
            end -= 1
            done = self._new_text(end)
        if end <= self.read or done.endswith(INCOMPLETE):
            return  # nothing new, or no character ends near the end (stray bytes): wait for more
        self.seen -= len(done)
        self.window, start = self.window[self.read:], self.read
        self.read = end - start
        self.context = self.tokenizer.decode(self.window[:self.read])

    def finish(self) -> str:
        """The rest of the text at the end of generation, an unfinished last character included.
        (A stop string found only now ends in U+FFFD; it cuts the text, but the tokens are out.)"""
        if self.stopped:
            return ""
        rest = self._new_text(len(self.window))[self.seen:]
        released, stop_end = self._unchecked(lambda: self._scan(rest)) if self.unchecked else self._scan(rest)
        if stop_end is None:
            released, self.held = released + self.held, ""
        return released

    def _new_text(self, end: int) -> str:
        """The text of window[read:end], decoded after the context."""
        return self.tokenizer.decode(self.window[:end])[len(self.context):]

    def _scan(self, text: str) -> tuple[str, int | None]:
        """Look for a stop string ending in `text`, newly visible; return the text now final
        and, on a stop, how many characters of `text` come after the stop string's end."""
        old = len(self.held)
        self.held += text
        hits = []
        for s in self.stop:
            i = self.held.find(s, max(0, old - len(s) + 1))
            if i >= 0:
                hits.append((i + len(s), -len(s)))
        if hits:
            end, minus_len = min(hits)
            self.stopped = True
            released, after = self.held[:end + minus_len], len(self.held) - end
            self.held = ""
            return released, after
        cut = max(0, len(self.held) - self.holdback)
        released, self.held = self.held[:cut], self.held[cut:]
        return released, None

    def _token_ending(self, text: str) -> int:
        """How many of the window's tokens it takes to decode `text` (its new text up to where a
        stop string ends) after the context: the stop string ends in the last of them."""
        target = self.context + text
        for k in range(self.read + 1, len(self.window)):
            if self.tokenizer.decode(self.window[:k]).startswith(target):
                return k
        return len(self.window)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE writes each byte as one printable character: the printable Latin-1 bytes as
    themselves, the other 68 (controls, space, a few more) as the characters from U+0100 on, in
    byte order. Returns character -> byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(0x100 + i): b for i, b in enumerate(others)}}


_BYTE_OF = _byte_level_alphabet()
WORD_MARKER = "\u2581"  # SentencePiece's word start: a space
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """Each token's own bytes, as OpenAI's logprobs report them (`bytes`): a token may hold part
    of a character, which decoding it alone shows as U+FFFD, so they come from the vocabulary:
    a byte-level BPE token's characters mapped back to bytes, a byte-fallback token (<0xE4>) its
    byte, a SentencePiece piece with its word marker as a space; special tokens as decoding them
    alone gives them (the `token` beside these bytes), which is nothing."""

    def __init__(self, tokenizer):
        """`tokenizer`: a `tokenizers.Tokenizer`; one with no vocabulary to read (only `decode`, as
        the benchmark's random models have) gives each token's text decoded alone."""
        self.tokenizer = tokenizer
        self.vocabulary = hasattr(tokenizer, "to_str") and hasattr(tokenizer, "id_to_token")
        spec = json.loads(tokenizer.to_str()) if self.vocabulary else {}
        decoder = json.dumps(spec.get("decoder"), ensure_ascii=False)
        self.byte_level = '"ByteLevel"' in decoder
        self.word_marker = WORD_MARKER in decoder  # Metaspace, or Replace(WORD_MARKER, " ")
        self.special = {t["id"] for t in spec.get("added_tokens", ()) if t.get("special")}

    def __call__(self, token: int) -> bytes:
        piece = self.tokenizer.id_to_token(token) if self.vocabulary else None
        if piece is None or token in self.special:
            return self.tokenizer.decode([token]).encode("utf-8")
        if self.byte_level and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            return bytes([int(fallback[1], 16)])
        return (piece.replace(WORD_MARKER, " ") if self.word_marker else piece).encode("utf-8")
