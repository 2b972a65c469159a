"""Fuzzing both APIs with malformed messages from a fixed seed: the verifier's Link stream and
Info, and the drafter's public Generation API (Generate and GenerateOnce).

Every message goes out as raw bytes on a generic call (no client-side serializer), so garbage
reaches the servers as it is: random bytes, truncated and bit-flipped valid messages, and
valid messages with one field made wrong (token ids outside the vocabulary, huge or negative
sizes, tree buffers that do not add up or point outside their tree, wrong session ids and
rounds, duplicate entries, invalid UTF-8, oversize fields). Every answer must be a clean
status (`CLEAN`), never INTERNAL or UNKNOWN, with a one-line message; a malformed entry of a
well-formed link message gets its own per-session result, so many ride in one message and
each is checked. The servers log no traceback, and afterwards serve a valid request exactly
as before, with every session slot free again.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import struct
import time
from collections.abc import Callable

import grpc
import pytest
import torch

from common.config import load_draft_config
from common.wire import VERIFIED_COLUMNS, unpack_ints
from common.rpc import (
    GENERATION_SERVICE,
    VERIFIER_SERVICE,
    pb,
    pb_grpc,
)
from drafter_svc.server import DrafterConfig, DrafterEngine
from drafter_svc.server import serve as serve_drafter
from tests.servers import ServerThread
from verifier_svc.server import VerifierConfig
from verifier_svc.server import serve as serve_verifier

SEED = 20250611
MAX_SESSIONS, MAX_SEQ_LEN, MAX_TREE_NODES = 4, 128, 17
MAX_LINK_ENTRIES = 2 * MAX_SESSIONS + 16  # VerifierConfig.max_link_entries
MAX_PROMPT_BYTES = 2048
# Malformed messages per family; at least 10,000 in all.
COUNTS = {"link messages": 2200, "link entries": 4200, "link trees": 1200, "info": 400, "generate": 2400}
CLEAN = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
         grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE,
         grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.ALREADY_EXISTS}
CLEAN_VALUES = {code.value[0] for code in CLEAN}
PROMPT = [5, 17, 42, 99, 3]


# -- the services -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(qwen3_pair):
    target, draft = qwen3_pair
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    return target, draft, load_draft_config(draft).target_layer_ids, vocab


@pytest.fixture(scope="module")
def verifier(pair):
    target, draft, layers, _ = pair
    config = VerifierConfig(target_dir=str(target), feature_layer_ids=layers, projection_dir=str(draft),
                            host="127.0.0.1", port=0, max_sessions=MAX_SESSIONS, max_seq_len=MAX_SEQ_LEN,
                            max_tree_nodes=MAX_TREE_NODES, max_message_mb=1)
    with ServerThread(lambda: serve_verifier(config)) as running:
        yield running


@pytest.fixture(scope="module")
def drafter(pair, verifier):
    target, draft, _, _ = pair
    config = DrafterConfig(draft_dir=str(draft), target_dir=str(target), verifier=f"127.0.0.1:{verifier.port}",
                           host="127.0.0.1", port=0, tree_budget=4, max_new_tokens=2, verifier_wait_s=10,
                           max_message_mb=1, max_prompt_bytes=MAX_PROMPT_BYTES, max_concurrent=MAX_SESSIONS)
    engine = DrafterEngine.start(config, torch.float32)
    with ServerThread(lambda: serve_drafter(engine, "127.0.0.1", 0)) as running:
        yield running


VALID_REQUEST = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), max_new_tokens=6)


@pytest.fixture(scope="module")
def reference(drafter_channel) -> list[int]:
    """A valid request's greedy tokens before any fuzzing."""
    return list(pb_grpc.GenerationStub(drafter_channel).GenerateOnce(VALID_REQUEST, timeout=60).token_ids)


@pytest.fixture
def no_tracebacks(caplog):
    """The servers log no traceback (and no ERROR record with exc_info) during the test."""
    caplog.set_level(logging.WARNING)
    yield
    bad = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, [r.getMessage() for r in bad[:5]]
    assert "Traceback" not in caplog.text


class Tally:
    """The status of every answer of one family; fails on the first unclean one."""

    def __init__(self, family: str):
        self.family, self.codes, self.sent = family, {}, 0

    def status(self, code: grpc.StatusCode, details: str, what) -> None:
        self.sent += 1
        assert code in CLEAN, (self.family, code, details, what)
        assert "\n" not in (details or "") and "Traceback" not in (details or ""), details
        self.codes[code.name] = self.codes.get(code.name, 0) + 1

    def result(self, result: pb.SessionResult, what) -> None:
        """A per-session result of a link reply: an Error must carry a clean code."""
        if result.WhichOneof("kind") == "error":
            assert result.error.code in CLEAN_VALUES, (self.family, result.error, what)
            self.status(_code(result.error.code), result.error.message, what)
        else:
            self.status(grpc.StatusCode.OK, "", what)

    def check(self, expected: int, refused_at_least: float = 0.9) -> None:
        assert self.sent == expected, (self.family, self.sent, expected)
        refused = expected - self.codes.get("OK", 0)
        assert refused >= refused_at_least * expected, (self.family, self.codes)


def _code(value: int) -> grpc.StatusCode:
    return next(c for c in grpc.StatusCode if c.value[0] == value)


def rpc_code(call: Callable[[], object]) -> tuple[grpc.StatusCode, str, object]:
    try:
        return grpc.StatusCode.OK, "", call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", None


# -- building blocks ------------------------------------------------------------------------------


def packed(values: list[int], width: int = 8) -> pb.PackedInts:
    fmt = {1: "b", 2: "h", 4: "i", 8: "q"}[width]
    return pb.PackedInts(data=struct.pack(f"<{len(values)}{fmt}", *values), width=width)


@dataclasses.dataclass
class TreeSpec:
    """A tree entry of a hand-built LinkRequest (they travel as columns: `link_message`)."""
    session_id: int
    round: int
    num_nodes: int


def link_message(entries: list[pb.SessionEntry | TreeSpec], trees: list[tuple[list[int], list[int], list[int]]] = (),
                 step: int = 1) -> pb.LinkRequest:
    """A LinkRequest of these entries, the trees among them as columns, whose buffers are the given
    trees' (tokens, next_token, next_sibling), concatenated."""
    msg = pb.LinkRequest(step=step, entries=[e for e in entries if isinstance(e, pb.SessionEntry)])
    specs = [(e, i) for i, e in enumerate(entries) if isinstance(e, TreeSpec)]
    if specs:
        columns = [[e.session_id for e, _ in specs], [e.round for e, _ in specs], [e.num_nodes for e, _ in specs],
                   [i for _, i in specs]]
        msg.trees.fields.CopyFrom(packed([v for column in columns for v in column]))
    for i, name in enumerate(("tokens", "next_token", "next_sibling")):
        getattr(msg, f"tree_{name}").CopyFrom(packed([v for t in trees for v in t[i]]))
    return msg


def in_order(reply: pb.LinkResponse) -> list[pb.SessionResult]:
    """A reply's results in message order: its Verified columns (as results of no kind, with
    their session ids) among its other `results`."""
    fields = unpack_ints(reply.verified.fields, max_count=1 << 20, what="verified").reshape(VERIFIED_COLUMNS, -1)
    column = dict(zip(fields[-1].tolist(), fields[0].tolist()))
    rest = iter(reply.results)
    return [pb.SessionResult(session_id=column[i]) if i in column else next(rest)
            for i in range(len(column) + len(reply.results))]


def open_entry(sid: int, layers, prompt=PROMPT, **sampling) -> pb.SessionEntry:
    return pb.SessionEntry(session_id=sid, open=pb.Open(prompt_token_ids=prompt, feature_layer_ids=layers,
                                                        sampling=pb.SamplingParams(**sampling)))


def tree_entry(sid: int, rnd: int, nodes: int) -> TreeSpec:
    return TreeSpec(sid, rnd, nodes)


def small_tree(root: int) -> tuple[list[int], list[int], list[int]]:
    """root -> 11 -> 13, root -> 12 (a valid tree)."""
    return [root, 11, 12, 13], [1, 3, -1, -1], [-1, 2, -1, -1]


def random_bytes(rng: random.Random, low: int = 1, high: int = 200) -> bytes:
    return rng.randbytes(rng.randrange(low, high))


def truncated(rng: random.Random, data: bytes) -> bytes:
    return data[:rng.randrange(1, len(data))]


def flipped(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randrange(1, 5)):
        out[rng.randrange(len(out))] = rng.randrange(256)
    return bytes(out)


def broken_utf8(data: bytes, marker: str) -> bytes:
    """`data` with the string `marker` (in a string field) replaced by invalid UTF-8 of its length."""
    assert data.count(marker.encode()) == 1
    return data.replace(marker.encode(), b"\xff\xfe" + b"\x80" * (len(marker) - 2))


def bad_sampling(rng: random.Random) -> dict:
    return rng.choice([
        {"temperature": -rng.uniform(1e-3, 1e9)}, {"temperature": math.nan}, {"temperature": math.inf},
        {"top_k": -rng.randrange(1, 2**31)}, {"top_p": 0.0}, {"top_p": 1 + rng.uniform(1e-6, 1e9)},
        {"top_p": -rng.uniform(0, 10)}, {"top_p": math.nan}, {"seed": rng.randrange(2**63, 2**64)},
    ])


# Valid, if extreme, sampling: sessions opened with these must sample like any other.
EXTREME_SAMPLING = [{}, {"temperature": 1.1e-5, "seed": 1}, {"temperature": 1e308, "seed": 2**63 - 1},
                    {"temperature": 1.0, "top_k": 2**31 - 1}, {"temperature": 0.7, "top_p": 5e-324},
                    {"temperature": 2.0, "top_k": 1, "top_p": 1e-300, "seed": 0}]


def out_of_vocab(rng: random.Random, vocab: int) -> int:
    return rng.choice([vocab, vocab + rng.randrange(1, 2**40), -rng.randrange(1, 2**62), 2**63 - 1, -(2**63)])


# -- 1. the verifier: whole link messages ---------------------------------------------------------


def malformed_link_message(rng: random.Random, layers, vocab: int) -> bytes:
    """A message the verifier cannot take as a whole: the link ends with a clean status."""
    valid = link_message([open_entry(1, layers), tree_entry(2, 1, 4), pb.SessionEntry(session_id=3, close=pb.Close())],
                         [small_tree(7)]).SerializeToString()
    kind = rng.randrange(8)
    if kind == 0:
        return random_bytes(rng)
    if kind == 1:
        return truncated(rng, valid)
    if kind == 2:
        return flipped(rng, valid)
    if kind == 3:  # more entries than the link allows
        n = MAX_LINK_ENTRIES + rng.randrange(1, 200)
        return link_message([pb.SessionEntry(session_id=i + 1, close=pb.Close()) for i in range(n)]).SerializeToString()
    if kind == 4:  # a session id outside [1, 2^63)
        sid = rng.choice([0, 2**63, 2**64 - 1, rng.randrange(2**63, 2**64)])
        return link_message([open_entry(sid, layers)]).SerializeToString()
    if kind == 5:  # invalid UTF-8 in the traceparent
        msg = link_message([open_entry(1, layers)])
        msg.entries[0].open.traceparent = "MARKER-TRACEPARENT"
        return broken_utf8(msg.SerializeToString(), "MARKER-TRACEPARENT")
    if kind == 6:  # a field of the wrong wire type, or an unterminated varint
        return rng.choice([b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x12\x05\x08", b"\x0a\x80",
                           b"\x12" + bytes([rng.randrange(128, 256)]) * rng.randrange(1, 12)])
    # kind 7: an entry whose length prefix claims more bytes than follow
    entry = open_entry(1, layers).SerializeToString()
    return b"\x12" + _varint(len(entry) + rng.randrange(1, 1000)) + entry


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def test_malformed_link_messages(verifier_channel, pair, reference, no_tracebacks):
    _, _, layers, vocab = pair
    rng, tally = random.Random(SEED), Tally("link messages")
    link = verifier_channel.stream_stream(f"/{VERIFIER_SERVICE}/Link")
    for _ in range(COUNTS["link messages"]):
        data = malformed_link_message(rng, layers, vocab)
        code, details, replies = rpc_code(lambda data=data: list(link(iter([data]), timeout=30)))
        for reply in replies or ():
            for r in in_order(pb.LinkResponse.FromString(reply)):  # it parsed after all: its results are clean
                if r.WhichOneof("kind") == "error":
                    assert r.error.code in CLEAN_VALUES, r.error
        tally.status(code, details, data[:64])
    tally.check(COUNTS["link messages"], refused_at_least=0.6)
    assert tally.codes.get("INVALID_ARGUMENT", 0) > COUNTS["link messages"] // 2


def test_oversize_link_and_info_messages(verifier_channel, no_tracebacks):
    link = verifier_channel.stream_stream(f"/{VERIFIER_SERVICE}/Link")
    info = verifier_channel.unary_unary(f"/{VERIFIER_SERVICE}/Info")
    big = link_message([]).SerializeToString() + pb.LinkRequest(
        tree_tokens=pb.PackedInts(data=b"\1" * (1 << 20), width=1)).SerializeToString()
    for call in (lambda: list(link(iter([big]), timeout=30)), lambda: info(b"\x0a" + b"\xff" * (1 << 20), timeout=30)):
        code, details, _ = rpc_code(call)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)


# -- 2. the verifier: malformed entries of well-formed link messages ------------------------------


def malformed_entry(rng: random.Random, sid: int, layers, vocab: int
                    ) -> tuple[pb.SessionEntry, tuple[list[int], list[int], list[int]] | None]:
    """One bad entry (an open, or a tree of a session that is not open) and its tree's buffers."""
    kind = rng.randrange(11)
    if kind == 0:  # prompt ids outside the vocabulary
        prompt = list(PROMPT)
        prompt[rng.randrange(len(prompt))] = out_of_vocab(rng, vocab)
        return open_entry(sid, layers, prompt), None
    if kind == 1:
        return open_entry(sid, layers, []), None
    if kind == 2:  # a prompt that leaves no room in max_seq_len, up to far past it
        return open_entry(sid, layers, [1] * rng.choice([MAX_SEQ_LEN, MAX_SEQ_LEN + 1, 4096])), None
    if kind == 3:
        return open_entry(sid, layers, **bad_sampling(rng)), None
    if kind == 4:  # feature layers the verifier does not return
        wrong = rng.choice([[0], [1, 2, 3], [2**32 - 1], list(layers) + [0], list(reversed(layers)) + [5]])
        return open_entry(sid, wrong), None
    if kind == 5:  # an entry that is neither open, extend nor close
        return pb.SessionEntry(session_id=sid), None
    if kind == 6:  # a tree for a session that is not open
        return tree_entry(sid, rng.randrange(2**32), 4), small_tree(rng.randrange(vocab))
    if kind == 7:  # a tree of 0 nodes, or more than the verifier takes
        n = rng.choice([0, MAX_TREE_NODES + 1, MAX_TREE_NODES + rng.randrange(2, 40)])
        return tree_entry(sid, 1, n), ([1] * n, [-1] * n, [-1] * n)
    if kind == 8:  # an oversize traceparent on an open that is bad anyway
        return pb.SessionEntry(session_id=sid, open=pb.Open(prompt_token_ids=[], traceparent="x" * 20000)), None
    if kind == 9:  # an open that asks for raw features of a single huge layer id
        return open_entry(sid, [rng.randrange(2**31, 2**32)]), None
    return open_entry(sid, layers, [out_of_vocab(rng, vocab)] * rng.randrange(1, 64)), None


def test_malformed_link_entries(verifier_channel, pair, no_tracebacks):
    """Many bad entries per message on one long-lived link, each answered with its own error;
    duplicate session ids in a message too."""
    _, _, layers, vocab = pair
    rng, tally = random.Random(SEED + 1), Tally("link entries")
    stub = pb_grpc.VerifierStub(verifier_channel)
    sent, step, next_sid = 0, 0, 1
    requests: list[pb.LinkRequest] = []
    request_entries: dict[int, list[pb.SessionEntry | TreeSpec]] = {}  # each step's entries, trees among them
    while sent < COUNTS["link entries"]:
        batch = min(MAX_LINK_ENTRIES, COUNTS["link entries"] - sent)
        entries, trees = [], []
        duplicate = rng.random() < 0.2 and batch >= 2
        for i in range(batch):
            entry, tree = malformed_entry(rng, next_sid, layers, vocab)
            if duplicate and i == batch - 1:  # the last entry repeats the first one's session id
                entry.session_id = entries[0].session_id
            else:
                next_sid += 1
            entries.append(entry)
            if tree is not None:
                trees.append(tree)
        step += 1
        requests.append(link_message(entries, trees, step))
        request_entries[step] = entries
        sent += batch
    replies = stub.Link(iter(requests), timeout=120)
    for request, reply in zip(requests, replies, strict=True):
        assert reply.step == request.step
        results = in_order(reply)
        assert len(results) == len(request_entries[request.step]), (request, reply)
        for entry, r in zip(request_entries[request.step], results):
            assert r.session_id == entry.session_id
            tally.result(r, entry)
    tally.check(COUNTS["link entries"], refused_at_least=1.0)
    assert {"INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION"} <= set(tally.codes), tally.codes


# -- 3. the verifier: malformed trees of open sessions ---------------------------------------------


def malformed_tree(rng: random.Random, root: int, vocab: int) -> tuple[int, tuple[list[int], list[int], list[int]]]:
    """A bad tree for an open session whose tree must start from `root`, in round 1: (round, buffers)."""
    tokens, next_token, next_sibling = (list(b) for b in small_tree(root))
    kind = rng.randrange(10)
    if kind == 9:  # now and then a valid tree, sampled with its session's (extreme) sampling
        return 1, (tokens, next_token, next_sibling)
    if kind == 0:
        tokens[rng.randrange(1, 4)] = out_of_vocab(rng, vocab)
    elif kind == 1:  # a child index outside the tree
        next_token[rng.randrange(4)] = rng.choice([4, 5, 2**31 - 1, -2, -(2**62)])
    elif kind == 2:  # a sibling index outside the tree, or the root with a sibling
        next_sibling[rng.randrange(4)] = rng.choice([4, 9, -7, 2**40])
    elif kind == 3:  # a cycle: a leaf's child is the root, its parent or itself
        next_token[3] = rng.choice([0, 1, 3])
    elif kind == 4:  # a node with two parents
        next_token[2] = 3
    elif kind == 5:  # the wrong root
        tokens[0] = (root + rng.randrange(1, vocab)) % vocab
    elif kind == 6:  # a round out of order
        return rng.choice([0, 2, 3, 2**32 - 1]), (tokens, next_token, next_sibling)
    elif kind == 7:  # a node nobody reaches
        next_sibling[1] = -1
    else:  # the root's token outside the vocabulary
        tokens[0] = out_of_vocab(rng, vocab)
    return 1, (tokens, next_token, next_sibling)


def test_malformed_trees_of_open_sessions(verifier_channel, pair, no_tracebacks):
    """Open MAX_SESSIONS sessions (with extreme but valid sampling), send each a bad tree (which
    fails and closes it; now and then a valid one, which is verified), reopen, again."""
    _, _, layers, vocab = pair
    rng, tally = random.Random(SEED + 2), Tally("link trees")
    link = LinkDriver(pb_grpc.VerifierStub(verifier_channel))
    roots: dict[int, int] = {}
    next_sid = 1
    try:
        while tally.sent < COUNTS["link trees"]:
            opens = [open_entry(next_sid + i, layers, [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))],
                                **rng.choice(EXTREME_SAMPLING)) for i in range(MAX_SESSIONS - len(roots))]
            next_sid += len(opens)
            for r in link.send(link_message(opens)).results:
                assert r.WhichOneof("kind") == "prefilled", r
                roots[r.session_id] = r.prefilled.token
            batch = list(roots.items())[: COUNTS["link trees"] - tally.sent]
            entries, trees = [], []
            for sid, root in batch:
                rnd, tree = malformed_tree(rng, root, vocab)
                entries.append(tree_entry(sid, rnd, len(tree[0])))
                trees.append(tree)
            results = in_order(link.send(link_message(entries, trees)))
            assert [r.session_id for r in results] == [e.session_id for e in entries]
            for entry, r in zip(entries, results):
                tally.result(r, entry)
                if r.WhichOneof("kind") == "error":
                    del roots[r.session_id]
                else:  # the mutation left a valid tree: the session goes on; close it
                    link.send(link_message([pb.SessionEntry(session_id=r.session_id, close=pb.Close())]))
                    del roots[r.session_id]
    finally:
        link.end()
    tally.check(COUNTS["link trees"], refused_at_least=0.8)


class LinkDriver:
    """One Link call, a message and its reply at a time."""

    def __init__(self, stub: pb_grpc.VerifierStub):
        import queue

        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._call = stub.Link(iter(self._requests.get, None), timeout=300)
        self._step = 0

    def send(self, message: pb.LinkRequest) -> pb.LinkResponse:
        self._step += 1
        message.step = self._step
        self._requests.put(message)
        reply = next(self._call)
        if reply.notice:  # first tokens ahead of a reply that completes prompts: the reply follows
            assert reply.step == self._step and all(r.WhichOneof("kind") == "prefilled" for r in reply.results)
            reply = next(self._call)
        assert reply.step == self._step and not reply.notice
        return reply

    def end(self) -> None:
        self._requests.put(None)
        assert list(self._call) == []


# -- 4. the verifier's Info --------------------------------------------------------------------


def test_malformed_info_requests(verifier_channel, no_tracebacks):
    rng, tally = random.Random(SEED + 3), Tally("info")
    info = verifier_channel.unary_unary(f"/{VERIFIER_SERVICE}/Info")
    for i in range(COUNTS["info"]):
        data = random_bytes(rng) if i % 2 else rng.choice([b"\x0a\xff", b"\x08", b"\x12\x7f", b"\xff\xff\xff"])
        code, details, _ = rpc_code(lambda data=data: info(data, timeout=10))
        tally.status(code, details, data[:32])
    tally.check(COUNTS["info"], refused_at_least=0.5)  # random bytes may be a valid empty message + unknown fields


# -- 5. the drafter's Generation API --------------------------------------------------------------


def malformed_request(rng: random.Random, vocab: int) -> bytes:
    valid = pb.GenerateRequest(text="hello world", max_new_tokens=2, stop=["x"])
    kind = rng.randrange(15)
    if kind == 0:
        return random_bytes(rng)
    if kind == 1:
        return truncated(rng, valid.SerializeToString())
    if kind == 2:
        return flipped(rng, valid.SerializeToString())
    if kind == 3:  # invalid UTF-8 in a string field
        field = rng.choice(["text", "stop", "content", "role", "kwarg-key", "kwarg-value"])
        req = pb.GenerateRequest(max_new_tokens=2)
        if field == "text":
            req.text = "MARKER-UTF8"
        elif field == "stop":
            req.token_ids.ids[:] = PROMPT
            req.stop.append("MARKER-UTF8")
        else:
            message = req.chat.messages.add(role="user", content="hi")
            if field == "content":
                message.content = "MARKER-UTF8"
            elif field == "role":
                message.role = "MARKER-UTF8"
            elif field == "kwarg-key":
                req.chat.template_kwargs["MARKER-UTF8"] = "x"
            else:
                req.chat.template_kwargs["k"] = "MARKER-UTF8"
        return broken_utf8(req.SerializeToString(), "MARKER-UTF8")
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), max_new_tokens=2)
    if kind == 4:
        req.token_ids.ids[rng.randrange(len(PROMPT))] = out_of_vocab(rng, vocab)
    elif kind == 5:
        req.token_ids.ids[:] = rng.choice([[], [1] * MAX_SEQ_LEN, [1] * rng.randrange(MAX_SEQ_LEN, 50000)])
    elif kind == 6:
        req.stop_token_ids.append(out_of_vocab(rng, vocab))
    elif kind == 7:
        req.sampling.CopyFrom(pb.SamplingParams(**bad_sampling(rng)))
    elif kind == 8:
        req.tree_budget = rng.choice([MAX_TREE_NODES, MAX_TREE_NODES + 1, 2**32 - 1])
    elif kind == 9:
        req.ClearField("token_ids")  # no prompt at all
    elif kind == 10:
        req.max_new_tokens = 0
    elif kind == 11:  # a text prompt past max_prompt_bytes
        req.text = rng.choice(["a", "é", "\U0001F600"]) * (MAX_PROMPT_BYTES + rng.randrange(1, 5000))
    elif kind == 12:  # an empty text
        req.text = ""
    elif kind == 14:  # valid, if extreme: oversize stop fields, extreme sampling, no drafting
        change = rng.randrange(5)
        if change == 0:
            req.stop[:] = rng.choice([[""], ["a" * 100_000], ["ab"] * 20_000])
        elif change == 1:
            req.stop_token_ids[:] = [rng.randrange(vocab) for _ in range(rng.randrange(1, 20_000))]
        elif change == 2:
            req.sampling.CopyFrom(pb.SamplingParams(**rng.choice(EXTREME_SAMPLING)))
        elif change == 3:
            req.tree_budget = rng.choice([0, MAX_TREE_NODES - 1])
        else:
            req.text = "\0\U0010ffff " * rng.randrange(1, 100)
    else:  # a chat whose template render fails or that is empty
        req.chat.CopyFrom(pb.Chat(messages=[pb.ChatMessage(role="user", content="x" * (MAX_PROMPT_BYTES + 1))]))
    return req.SerializeToString()


def test_malformed_generation_requests(drafter_channel, pair, reference, no_tracebacks):
    _, _, _, vocab = pair
    rng, tally = random.Random(SEED + 4), Tally("generate")
    once = drafter_channel.unary_unary(f"/{GENERATION_SERVICE}/GenerateOnce")
    stream = drafter_channel.unary_stream(f"/{GENERATION_SERVICE}/Generate")
    for i in range(COUNTS["generate"]):
        data = malformed_request(rng, vocab)
        call = (lambda data=data: once(data, timeout=60)) if i % 2 else (lambda data=data: list(stream(data, timeout=60)))
        code, details, _ = rpc_code(call)
        tally.status(code, details, data[:64])
    tally.check(COUNTS["generate"], refused_at_least=0.85)


# -- afterwards --------------------------------------------------------------------------------


def test_at_least_ten_thousand_messages():
    assert sum(COUNTS.values()) >= 10_000


def test_both_services_serve_as_before(verifier_channel, drafter_channel, drafter, reference):
    """After the fuzzing: every verifier slot free, the drafter idle, a valid request as before."""
    stub = pb_grpc.VerifierStub(verifier_channel)
    deadline = time.monotonic() + 30
    while (free := stub.Info(pb.InfoRequest(), timeout=10).free_sessions) != MAX_SESSIONS:
        assert time.monotonic() < deadline, f"free_sessions stuck at {free}"
        time.sleep(0.05)
    assert list(pb_grpc.GenerationStub(drafter_channel).GenerateOnce(VALID_REQUEST, timeout=60).token_ids) == reference
    scheduler = drafter.server.engine.scheduler
    assert not scheduler._running and not scheduler._waiting and scheduler._queued == 0
