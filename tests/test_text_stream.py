"""Streaming detokenisation: the streamed text is exactly the decode of all tokens, a push
costs the same however long the stream, and stop strings cut the text and the tokens the
same way however the tokens are split into rounds."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from common.checkpoint import load_tokenizer
from drafter_svc.text_stream import TextStream, TokenBytes

SHIPPED = Path(__file__).resolve().parent.parent / "models" / "default" / "target"
# Multi-byte characters, so that byte-level tokens split them.
TEXT = "Grüße aus Köln: 3 € für 日本語の本 🙂🚀, naïve café — done. "


@pytest.fixture(scope="module", params=["tiny", "shipped"])
def tokenizer(request, tiny_tokenizer):
    return tiny_tokenizer if request.param == "tiny" else load_tokenizer(SHIPPED)


class CountingTokenizer:
    """Counts the tokens each decode call is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids)


def byte_tokens(tokenizer, text: str) -> list[int]:
    """`text` as one byte-level token per UTF-8 byte (GPT-2's byte-to-character map)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    ids = [tokenizer.token_to_id(char[b]) for b in text.encode()]
    assert None not in ids and tokenizer.decode(ids) == text
    return ids


def rounds(ids: list[int], rng: random.Random, most: int = 8) -> list[list[int]]:
    """`ids` cut into rounds of random sizes, as a scheduler delivers them."""
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, most)
        out.append(ids[i:i + n])
        i += n
    return out


def stream(tokenizer, chunks, stop=(), min_tokens=0) -> tuple[list[int], list[str], TextStream]:
    """Push every chunk; the delivered tokens, the text pieces (the finish last), the stream."""
    text = TextStream(tokenizer, stop, min_tokens)
    tokens, pieces = [], []
    for chunk in chunks:
        got, delta = text.push(chunk)
        tokens += got
        pieces.append(delta)
    pieces.append(text.finish())
    return tokens, pieces, text


def sequences(tokenizer, rng: random.Random, count: int) -> list[list[int]]:
    """Random token ids (special tokens and stray bytes included) and encoded text."""
    vocab = tokenizer.get_vocab_size()
    out = [[rng.randrange(vocab) for _ in range(rng.randint(1, 120))] for _ in range(count)]
    encoded = tokenizer.encode(TEXT * 3).ids
    out += [encoded[rng.randrange(len(encoded)):][:rng.randint(1, 80)] for _ in range(count)]
    return out


def test_streamed_text_is_the_decode_of_all_tokens(tokenizer):
    rng = random.Random(0)
    for ids in sequences(tokenizer, rng, 150):
        full = tokenizer.decode(ids)
        tokens, pieces, _ = stream(tokenizer, rounds(ids, rng))
        assert tokens == ids
        assert "".join(pieces) == full
        so_far = ""
        for piece in pieces[:-1]:  # nothing released is taken back: no half character shown early
            so_far += piece
            assert full.startswith(so_far)


def test_an_unfinished_character_is_held_until_complete(tiny_tokenizer):
    euro = byte_tokens(tiny_tokenizer, "€")
    text = TextStream(tiny_tokenizer)
    assert text.push(euro[:1])[1] == "" and text.push(euro[1:2])[1] == ""
    assert text.push(euro[2:])[1] == "€"
    half = TextStream(tiny_tokenizer)
    assert half.push(euro[:2])[1] == "" and half.finish() == tiny_tokenizer.decode(euro[:2])


def decoded_per_push(tokenizer, ids: list[int], round_size: int) -> tuple[int, int]:
    """(most, total) tokens decoded by one push, over a stream of rounds of round_size."""
    counting = CountingTokenizer(tokenizer)
    text, most = TextStream(counting, stop=["never appears"]), 0
    for i in range(0, len(ids), round_size):
        before = counting.decoded
        text.push(ids[i:i + round_size])
        most = max(most, counting.decoded - before)
    return most, counting.decoded


def test_a_push_costs_the_same_however_long_the_stream(tokenizer):
    ids = tokenizer.encode(TEXT * 400).ids
    assert len(ids) >= 5000
    short_most, short_total = decoded_per_push(tokenizer, ids[:500], 4)
    long_most, long_total = decoded_per_push(tokenizer, ids[:5000], 4)
    assert long_most <= short_most <= 64  # a window of a few tokens, not the stream
    assert long_total <= 12 * short_total  # linear: ten times the tokens, about ten times the work


def test_random_tokens_keep_the_window_small(tokenizer):
    rng = random.Random(1)
    ids = [rng.randrange(tokenizer.get_vocab_size()) for _ in range(5000)]
    most, total = decoded_per_push(tokenizer, ids, 4)
    assert most <= 64 and total <= 6 * len(ids)


def reference_stop(tokenizer, ids: list[int], stop: str) -> tuple[list[int], str]:
    """The tokens up to the first whose decode completes `stop`, and the text before it."""
    full = tokenizer.decode(ids)
    k = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))
    return ids[:k], full[:full.index(stop)]


def test_stop_strings_cut_text_and_tokens_whatever_the_rounds(tokenizer):
    rng = random.Random(2)
    checked = 0
    for ids in sequences(tokenizer, rng, 100):
        full = tokenizer.decode(ids)
        start = rng.randrange(len(full))
        stop = full[start:start + rng.randint(1, 6)]
        if "\ufffd" in stop:
            continue
        want_tokens, want_text = reference_stop(tokenizer, ids, stop)
        for chunks in (rounds(ids, rng), rounds(ids, rng, 2), [[t] for t in ids], [ids]):
            tokens, pieces, text = stream(tokenizer, chunks + [[7, 8, 9]], [stop])  # a late round: ignored
            assert text.stopped and text.kept == len(want_tokens)
            assert tokens == want_tokens
            assert "".join(pieces) == want_text
        checked += 1
    assert checked > 100


def reference_stop_from(tokenizer, ids: list[int], stop: str, min_tokens: int) -> tuple[list[int], str, bool]:
    """vLLM's min_tokens for stop strings: the first occurrence that the first min_tokens - 1
    tokens do not complete; the tokens up to the one that completes it, the text before it, and
    whether there is one (else all the tokens and the whole text)."""
    full = tokenizer.decode(ids)
    floor = len(tokenizer.decode(ids[:min_tokens - 1]).rstrip("\ufffd")) if min_tokens > 1 else 0
    i = full.find(stop, max(0, floor - len(stop) + 1))
    if i < 0:
        return ids, full, False
    k = next(k for k in range(1, len(ids) + 1) if tokenizer.decode(ids[:k])[i:i + len(stop)] == stop)
    return ids[:k], full[:i], True


def test_stop_strings_count_from_min_tokens_whatever_the_rounds(tokenizer):
    """A stop string that one of the first min_tokens - 1 tokens completes does not stop the
    stream (vLLM's min_tokens); the first completed later does, however the rounds are cut."""
    rng = random.Random(3)
    checked = skipped = 0
    for ids in sequences(tokenizer, rng, 100):
        full = tokenizer.decode(ids)
        start = rng.randrange(len(full))
        stop = full[start:start + rng.randint(1, 4)]
        if "\ufffd" in stop:
            continue
        min_tokens = rng.randint(1, len(ids) + 2)
        want_tokens, want_text, stops = reference_stop_from(tokenizer, ids, stop, min_tokens)
        skipped += reference_stop(tokenizer, ids, stop)[0] != want_tokens
        for chunks in (rounds(ids, rng), rounds(ids, rng, 2), [[t] for t in ids], [ids]):
            tokens, pieces, text = stream(tokenizer, chunks, [stop], min_tokens)
            assert tokens == want_tokens, (ids, stop, min_tokens, chunks)
            assert "".join(pieces) == want_text
            assert text.stopped == stops
        checked += 1
    assert checked > 100 and skipped > 10, (checked, skipped)


def test_a_stop_string_split_over_rounds_and_characters(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = tok.encode("price: 3 € each, then more text").ids
    stop = "3 €"
    want_tokens, want_text = reference_stop(tok, ids, stop)
    assert want_text == "price: "
    for split in range(1, len(want_tokens)):  # the stop string's tokens cut at every place
        chunks = [ids[:split], ids[split:]]
        tokens, pieces, _ = stream(tok, chunks, [stop])
        assert tokens == want_tokens and "".join(pieces) == want_text
    # "€" as its three byte tokens, split over two rounds: the stop ends in the third, and
    # the tokens after it in the same round are dropped.
    head, euro, tail = tok.encode("a 3 ").ids, byte_tokens(tok, "€"), tok.encode(" b").ids
    tokens, pieces, text = stream(tok, [head + euro[:1], euro[1:] + tail], [stop])
    assert tokens == head + euro and text.kept == len(tokens)
    assert "".join(pieces) == "a "


def test_the_first_stop_to_end_wins(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = byte_tokens(tok, "xabcde")
    for chunks in ([ids], [[t] for t in ids], [ids[:3], ids[3:]]):
        tokens, pieces, _ = stream(tok, chunks, ["abcd", "c"])
        assert "".join(pieces) == "xab" and tokens == ids[:4]  # "c" ends first
        tokens, pieces, _ = stream(tok, chunks, ["c", "bc"])
        assert "".join(pieces) == "xa" and tokens == ids[:4]  # both end at "c": the longer wins


def test_text_before_a_possible_stop_is_held(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = byte_tokens(tok, "hello")
    text = TextStream(tok, ["lo!"])
    released = "".join(text.push([t])[1] for t in ids)
    assert released == "hel"  # "lo" could begin the stop string
    assert text.finish() == "lo" and not text.stopped


def test_token_bytes_make_up_the_text(tokenizer):
    """Each token's own bytes, joined, are the text's UTF-8, also where a token holds part of a
    character (which decoding it alone shows as U+FFFD)."""
    token_bytes = TokenBytes(tokenizer)
    split = byte_tokens(tokenizer, TEXT)
    assert any("\ufffd" in tokenizer.decode([t]) for t in split)
    for ids in (tokenizer.encode(TEXT).ids, split):
        assert b"".join(token_bytes(t) for t in ids) == TEXT.encode()
    assert all(token_bytes(t) == tokenizer.decode([t]).encode() for t in tokenizer.encode("def f(x):\n\treturn x").ids)


def test_token_bytes_of_sentencepiece_style_pieces():
    """Pieces with SentencePiece's word marker and byte-fallback pieces (Llama's tokenizers)."""
    from tokenizers import Tokenizer, decoders, models
    vocab = {"<unk>": 0, "<s>": 1, "\u2581hello": 2, "\u2581": 3, "x": 4, "<0xE4>": 5, "<0xB8>": 6, "<0x96>": 7}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(["<s>"])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    token_bytes = TokenBytes(tok)
    ids = [1, 2, 3, 5, 6, 7, 4]
    assert b"".join(token_bytes(t) for t in ids) == " hello \u4e16x".encode() == tok.decode(ids).encode()
    assert token_bytes(5) == b"\xe4" and token_bytes(1) == b""
