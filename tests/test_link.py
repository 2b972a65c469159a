"""The drafter's checks of what the verifier sends back (common.wire, drafter_svc.link), and
the link codec's round trip: nothing from the wire reaches the draft model unchecked."""
from __future__ import annotations

import collections
import threading
import time
import types

import grpc
import numpy as np
import pytest
import torch

from common.protocol import (CloseEntry, Extended, ExtendEntry, OpenEntry, Prefilled, SamplingParams, StatusError,
                             StepResult, TokenLogprob, TreeEntry, Verified)
from common.rpc import decode_message, pb
from common import wire
from common.tree import DraftTree
from common.wire import (LinkLimits, WireError, decode_link_request, decode_link_response, encode_link_request,
                         encode_link_response, parse_link_response)
from drafter_svc.link import check_results

VOCAB, WIDTH = 50, 6


def chain(tokens: list[int]) -> DraftTree:
    return DraftTree.from_parents(tokens, list(range(-1, len(tokens) - 1)))


def features(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("seed", range(5))
def test_packed_ints_are_the_same_bytes_from_a_list_an_array_and_a_tensor(seed):
    """`write_ints` packs short tensors and arrays as lists, long ones through numpy: the same
    narrowest width and bytes from every form, and they read back as the values."""
    rng = np.random.default_rng(seed)
    for count in (0, 1, wire.FEW_INTS, wire.FEW_INTS + 1, 1000):
        for bound in (100, 30_000, 2**31 - 1, 2**63 - 1):
            values = rng.integers(-bound, bound, size=count, dtype=np.int64, endpoint=True)
            packed = [wire.pack_ints(form) for form in (values.tolist(), values, torch.from_numpy(values),
                                                         torch.from_numpy(values).to(torch.int32)
                                                         if bound < 2**31 else torch.from_numpy(values))]
            assert all(p.width == packed[0].width and p.data == packed[0].data for p in packed), (count, bound)
            assert wire.unpack_ints(packed[0], max_count=count, what="x").tolist() == values.tolist()
            want = next(w for w in (1, 2, 4, 8) if all(-(2 ** (8 * w - 1)) <= v < 2 ** (8 * w - 1) for v in
                                                          values.tolist()))
            assert packed[0].width == want


def test_request_round_trip():
    entries = [OpenEntry(3, [1, 2, 3], SamplingParams(0.5, 4, 0.9, 7), "tp", (0, 2), 5), TreeEntry(1, 2, chain([4, 5, 6])),
               CloseEntry(9), TreeEntry(2, 1, chain([7])), OpenEntry(4, [1], SamplingParams(), logprobs=0, more=True),
               ExtendEntry(5, [8, 9], more=True, traceparent="tp5"), ExtendEntry(6, [10])]
    got = decode_link_request(encode_link_request(11, entries), LinkLimits(max_entries=8, max_tree_nodes=4))
    assert [type(e) for e in got] == [OpenEntry, TreeEntry, CloseEntry, TreeEntry, OpenEntry, ExtendEntry, ExtendEntry]
    assert got[0] == entries[0] and got[4:] == entries[4:]
    assert encode_link_request(1, entries[:1]).entries[0].open.logprobs == 5
    for e, g in ((entries[1], got[1]), (entries[3], got[3])):
        assert (g.session_id, g.round) == (e.session_id, e.round)
        for field in ("tokens", "next_token", "next_sibling"):
            assert torch.equal(getattr(g.tree, field), getattr(e.tree, field))


def test_response_round_trip_keeps_each_sessions_rows():
    rows = features(7, 0)
    results = [StepResult(1, Verified([4, 5], 6, rows[:3], 2)), StepResult(2, StatusError("NOT_FOUND", "gone")),
               StepResult(3, Prefilled(8, rows[3:7], 64)), StepResult(4, Verified([], 9, rows[:0], 1)),
               StepResult(5, Extended(rows[2:6]))]
    got = decode_link_response(_response(results, step=5), vocab_size=VOCAB, feature_dim=WIDTH, max_feature_rows=100)
    assert [r.session_id for r in got] == [1, 2, 3, 4, 5]
    assert isinstance(got[4].outcome, Extended) and torch.equal(got[4].outcome.features, rows[2:6])
    assert got[0].outcome.accepted_tokens == [4, 5] and torch.equal(got[0].outcome.features, rows[:3])
    assert (got[1].outcome.status, got[1].outcome.message) == ("NOT_FOUND", "gone")
    assert got[2].outcome.token == 8 and torch.equal(got[2].outcome.features, rows[3:7])
    assert got[3].outcome.features.shape == (0, WIDTH)


def test_results_and_trees_whose_fields_are_all_zero_keep_their_kind():
    """A result or tree whose every value but its session id is protobuf's default (token 0,
    round 0, nothing accepted, no rows) still says what it is."""
    results = [StepResult(1, Verified([], 0, features(0, 0), 0)), StepResult(2, Prefilled(0, features(0, 0), 0))]
    reply = encode_link_response(0, results, WIDTH, torch.float32)
    assert reply.results == ((1, "verified"), (2, "prefilled"))
    got = decode_link_response(_response(results, step=0), vocab_size=VOCAB, feature_dim=WIDTH, max_feature_rows=1)
    assert isinstance(got[0].outcome, Verified) and (got[0].outcome.next_token, got[0].outcome.round) == (0, 0)
    assert isinstance(got[1].outcome, Prefilled) and got[1].outcome.token == 0
    request = encode_link_request(0, [TreeEntry(1, 0, chain([0]))])
    (tree,) = decode_link_request(request, LinkLimits(max_entries=1, max_tree_nodes=1))
    assert isinstance(tree, TreeEntry) and (tree.round, tree.tree.num_nodes, tree.tree.tokens.tolist()) == (0, 1, [0])


def _random_result(rng: np.random.Generator, sid: int, rows: torch.Tensor) -> StepResult:
    """One of each kind of result at random, with rows of `rows` where it has any."""
    kind = rng.integers(5)
    n = int(rng.integers(0, 4))
    if kind <= 1:  # Verified, some with logprobs, some without features
        tokens = rng.integers(0, VOCAB, n + 1).tolist()
        with_rows = rng.random() < 0.8
        logprobs = [lp(t) for t in tokens] if kind == 1 else None
        return StepResult(sid, Verified(tokens[:-1], tokens[-1], rows[: n + 1] if with_rows else rows[:0],
                                        int(rng.integers(0, 2**32)), logprobs))
    if kind == 2:
        token = int(rng.integers(VOCAB))
        return StepResult(sid, Prefilled(token, rows[:n], 64, [lp(token)] if n % 2 else None))
    if kind == 3:
        return StepResult(sid, Extended(rows[:n]))
    return StepResult(sid, StatusError("NOT_FOUND", f"gone {sid}"))


def test_replies_of_any_mix_of_results_keep_their_order():
    """Verified results travel as columns and the others as messages: the drafter reads them
    back in the verifier's order, each with its own values and rows."""
    rng = np.random.default_rng(0)
    for trial in range(200):
        count = int(rng.integers(0, 9))
        results = [_random_result(rng, sid, features(4, 100 * trial + sid)) for sid in range(1, count)]
        got = decode_link_response(_response(results), vocab_size=VOCAB, feature_dim=WIDTH, max_feature_rows=100)
        assert [r.session_id for r in got] == [r.session_id for r in results]
        for want, have in zip(results, got):
            w, h = want.outcome, have.outcome
            assert type(h) is type(w)
            if isinstance(w, StatusError):
                assert (h.status, h.message) == (w.status, w.message)
                continue
            assert torch.equal(h.features, w.features)
            if isinstance(w, Verified):
                assert (h.accepted_tokens, h.next_token, h.round, h.logprobs) == (
                    w.accepted_tokens, w.next_token, w.round, w.logprobs)
            elif isinstance(w, Prefilled):
                assert (h.token, h.max_seq_len, h.logprobs) == (w.token, w.max_seq_len, w.logprobs)


def test_requests_of_any_mix_of_entries_keep_their_order():
    """Trees travel as columns and the other entries as messages: the verifier reads them back
    in the drafter's order, each tree with its own buffers, round and trace context."""
    rng = np.random.default_rng(1)
    limits = LinkLimits(max_entries=16, max_tree_nodes=8)
    for _ in range(200):
        entries = []
        traced = rng.random() < 0.5
        for sid in range(1, int(rng.integers(0, 12))):
            kind = rng.integers(4)
            if kind <= 1:
                tokens = rng.integers(0, VOCAB, int(rng.integers(1, 9))).tolist()
                entries.append(TreeEntry(sid, int(rng.integers(0, 2**32)), chain(tokens), f"tp{sid}" if traced else ""))
            elif kind == 2:
                entries.append(OpenEntry(sid, [1, 2], SamplingParams(), f"o{sid}", (0, 1)))
            else:
                entries.append(CloseEntry(sid))
        got = decode_link_request(encode_link_request(1, entries), limits)
        assert [(type(g), g.session_id) for g in got] == [(type(e), e.session_id) for e in entries]
        for e, g in zip(entries, got):
            if isinstance(e, TreeEntry):
                assert (g.round, g.traceparent) == (e.round, e.traceparent)
                assert all(torch.equal(getattr(g.tree, f), getattr(e.tree, f))
                           for f in ("tokens", "next_token", "next_sibling"))
            else:
                assert g == e


def _column_spoilers():
    """Ways to spoil a reply's Verified columns (fields as a [7, n] list of lists, accepted tokens
    as a list), and what the refusal says."""
    def positions(value):
        return lambda f, t: f[6].__setitem__(slice(None), value)

    return {
        "positions not increasing": (positions([1, 0]), "not increasing"),
        "position past the results": (positions([0, 3]), "not increasing"),
        "negative position": (positions([-1, 0]), "not increasing"),
        "session id 0": (lambda f, t: f[0].__setitem__(0, 0), "out of range"),
        "negative round": (lambda f, t: f[1].__setitem__(0, -1), "out of range"),
        "negative count": (lambda f, t: f[2].__setitem__(0, -1), "out of range"),
        "count past the tokens": (lambda f, t: f[2].__setitem__(0, 5), "feature rows"),
        "tokens short": (lambda f, t: t.pop(), "accepted tokens"),
        "token outside the vocabulary": (lambda f, t: t.__setitem__(0, VOCAB), "outside the vocabulary"),
        "bonus outside the vocabulary": (lambda f, t: f[3].__setitem__(1, -1), "outside the vocabulary"),
        "rows neither 0 nor 1 + accepted": (lambda f, t: f[4].__setitem__(1, 1), "feature rows"),
        "a logprobs flag of 2": (lambda f, t: f[5].__setitem__(0, 2), "logprobs"),
        "a flag without its logprobs": (lambda f, t: f[5].__setitem__(1, 1), "logprobs"),
        "ragged": (lambda f, t: f[6].pop(), "rows of one per item"),
    }


@pytest.mark.parametrize("case", list(_column_spoilers()))
def test_bad_verified_columns_are_refused(case):
    spoil, needle = _column_spoilers()[case]
    results = [StepResult(1, Verified([4, 5], 6, features(3, 0), 2)), StepResult(2, StatusError("NOT_FOUND", "x")),
               StepResult(3, Verified([7], 8, features(2, 1), 1))]
    reply = _response(results)
    fields = wire.unpack_ints(reply.verified.fields, max_count=100, what="x").reshape(7, -1).tolist()
    tokens = wire.unpack_ints(reply.verified.accepted_tokens, max_count=100, what="x").tolist()
    spoil(fields, tokens)
    reply.verified.fields.CopyFrom(wire.pack_ints([v for row in fields for v in row]))
    reply.verified.accepted_tokens.CopyFrom(wire.pack_ints(tokens))
    with pytest.raises(WireError, match=needle):
        decode_link_response(reply, vocab_size=VOCAB, feature_dim=WIDTH, max_feature_rows=100)


@pytest.mark.parametrize("spoil, needle", [
    (lambda f, msg: f[3].__setitem__(slice(None), [2, 1]), "not increasing"),
    (lambda f, msg: f[3].__setitem__(1, 3), "not increasing"),
    (lambda f, msg: f[0].__setitem__(0, 0), "outside"),
    (lambda f, msg: msg.trees.traceparents.append("one"), "trace contexts"),
    (lambda f, msg: f.__setitem__(0, f[0][:1]), "rows of one per item"),
], ids=["positions swapped", "position past the entries", "session id 0", "one trace context for two trees",
        "ragged"])
def test_bad_tree_columns_are_refused(spoil, needle):
    """Columns that cannot be read fail the message (the link), as a framing error does."""
    msg = encode_link_request(1, [TreeEntry(1, 1, chain([3, 4])), CloseEntry(5), TreeEntry(2, 1, chain([6]))])
    fields = wire.unpack_ints(msg.trees.fields, max_count=100, what="x").reshape(4, -1).tolist()
    spoil(fields, msg)
    msg.trees.fields.CopyFrom(wire.pack_ints([v for row in fields for v in row]))
    with pytest.raises(WireError, match=needle):
        decode_link_request(msg, LinkLimits(max_entries=8, max_tree_nodes=4))


def test_a_tree_of_a_bad_round_or_node_count_fails_alone():
    """A tree column's round outside uint32, or a node count that cannot frame, fails that tree
    (or every tree, when the buffers cannot be cut), not the message."""
    msg = encode_link_request(1, [TreeEntry(1, 1, chain([3, 4])), OpenEntry(5, [1], SamplingParams()),
                                  TreeEntry(2, 1, chain([6]))])
    fields = wire.unpack_ints(msg.trees.fields, max_count=100, what="x").reshape(4, -1).tolist()
    fields[1][0] = 2**32
    msg.trees.fields.CopyFrom(wire.pack_ints([v for row in fields for v in row]))
    got = decode_link_request(msg, LinkLimits(max_entries=8, max_tree_nodes=4))
    assert got[0].outcome.status == "INVALID_ARGUMENT" and "round" in got[0].outcome.message
    assert isinstance(got[1], OpenEntry) and isinstance(got[2], TreeEntry)
    fields[1][0], fields[2][0] = 1, -2
    msg.trees.fields.CopyFrom(wire.pack_ints([v for row in fields for v in row]))
    got = decode_link_request(msg, LinkLimits(max_entries=8, max_tree_nodes=4))
    assert all(got[i].outcome.status == "INVALID_ARGUMENT" and "node count" in got[i].outcome.message for i in (0, 2))
    assert isinstance(got[1], OpenEntry)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_encoded_reply_is_the_message_with_its_features_appended(dtype):
    """The serialised reply (features appended by hand) parses as protobuf's own message would,
    and lists each result's session and kind for the link's timers."""
    rows = features(5, 0).to(dtype)
    results = [StepResult(1, Verified([4, 5], 6, rows[:3], 2)), StepResult(2, StatusError("NOT_FOUND", "gone")),
               StepResult(3, Prefilled(8, rows[3:5], 64)), StepResult(4, Extended(rows[:0]))]
    reply = encode_link_response(3, results, WIDTH, dtype, step_seconds=0.25)
    msg = pb.LinkResponse.FromString(reply.data)
    want = pb.LinkResponse.FromString(reply.data)
    want.ClearField("features")
    want.features.dtype, want.features.data = str(dtype).removeprefix("torch."), rows.view(torch.uint8).numpy().tobytes()
    want.features.shape[:] = [5, WIDTH]
    assert msg == want and msg.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)
    assert (msg.step, msg.step_seconds, len(msg.results)) == (3, 0.25, 3)  # the Verified one in columns
    assert reply.results == ((1, "verified"), (2, "error"), (3, "prefilled"), (4, "extended"))
    empty = pb.LinkResponse.FromString(encode_link_response(4, results[1:2], WIDTH, dtype).data)
    assert list(empty.features.shape) == [0, WIDTH] and empty.features.data == b""


def _parsed_whole(data: bytes):
    """(message, features' data) as protobuf parses `data`, or the ValueError it raises."""
    try:
        msg = decode_message(pb.LinkResponse, data)
    except ValueError as exc:
        return exc
    return msg, msg.features.data


def _parsed_by_view(data: bytes):
    """The same from parse_link_response: its message with the data put back from the view."""
    try:
        msg, view = parse_link_response(data)
    except ValueError as exc:
        return exc
    if view is not None:
        assert msg.features.data == b""
        msg.features.data = bytes(view)
    return msg, msg.features.data


def _replies() -> list[bytes]:
    rows = features(6, 3)
    results = [StepResult(1, Verified([4, 5], 6, rows[:3], 2, [lp(4), lp(5), lp(6)])),
               StepResult(2, StatusError("NOT_FOUND", "gone")), StepResult(3, Prefilled(8, rows[3:6], 64))]
    ours = encode_link_response(7, results, WIDTH, torch.float32, step_seconds=0.5).data
    protobufs = pb.LinkResponse.FromString(ours).SerializeToString()  # the features in field order, mid-message
    return [ours, protobufs]


@pytest.fixture
def views_of_any_size(monkeypatch):
    monkeypatch.setattr(wire, "VIEW_MIN_BYTES", 0)


def test_replies_parse_with_their_features_as_a_view(views_of_any_size):
    """Our replies and protobuf's own serialisation: the features' data is a view into the
    received bytes (no copy), and everything else is what protobuf parses."""
    for data in _replies():
        msg, view = parse_link_response(data)
        assert view is not None and view.obj is data
        whole = decode_message(pb.LinkResponse, data)
        assert bytes(view) == whole.features.data and len(view) == 6 * WIDTH * 4
        msg.features.data = bytes(view)
        assert msg == whole


def test_small_replies_are_parsed_whole():
    data = _replies()[0]
    assert len(data) < wire.VIEW_MIN_BYTES and parse_link_response(data)[1] is None
    assert _parsed_by_view(data) == _parsed_whole(data)


def test_unusual_and_corrupt_replies_parse_as_protobuf_parses_them(views_of_any_size):
    """Two features fields (protobuf merges them), and thousands of random corruptions of valid
    replies: parse_link_response gives exactly protobuf's message, or refuses what protobuf
    refuses. (Not always with the same words: where a corruption runs past its field, what the
    parser reads next differs once the features' data is cut out.)"""
    ours, protobufs = _replies()
    twice = ours + ours
    assert parse_link_response(twice)[1] is None  # not one features field: parsed whole
    assert _parsed_by_view(twice) == _parsed_whole(twice)
    rng = np.random.default_rng(0)
    outcomes = collections.Counter()
    for _ in range(3000):
        data = bytearray(ours if rng.random() < 0.5 else protobufs)
        for _ in range(int(rng.integers(1, 4))):
            if len(data) < 2:
                break
            at = int(rng.integers(1, len(data)))
            if rng.random() < 0.15:
                del data[at:]  # truncated
            else:
                data[at] = int(rng.integers(256))
        data = bytes(data)
        whole, by_view = _parsed_whole(data), _parsed_by_view(data)
        if isinstance(whole, ValueError):
            assert isinstance(by_view, ValueError), by_view
            outcomes["refused"] += 1
        else:
            assert by_view == whole
            outcomes["parsed"] += 1
    assert outcomes["refused"] > 100 and outcomes["parsed"] > 100, outcomes


def lp(token: int, value: float = -0.5, top=((1, -0.25), (2, -0.5))) -> TokenLogprob:
    return TokenLogprob(token, value, tuple(top))


def test_logprobs_round_trip():
    """float32 values (what the verifier computes) come back exactly; unset stays None."""
    results = [StepResult(1, Verified([4, 5], 6, features(3, 0), 2, [lp(4), lp(5, -1.5, ()), lp(6, -0.125)])),
               StepResult(2, Prefilled(8, features(2, 1), 64, [lp(8, 0.0, ((8, 0.0),))])),
               StepResult(3, Verified([7], 9, features(2, 2), 1))]
    got = decode_link_response(_response(results), vocab_size=VOCAB, feature_dim=WIDTH, max_feature_rows=100)
    assert got[0].outcome.logprobs == results[0].outcome.logprobs
    assert got[1].outcome.logprobs == results[1].outcome.logprobs
    assert got[2].outcome.logprobs is None


@pytest.mark.parametrize("logprobs, needle", [
    ([lp(4)], "logprobs for 1 tokens"),
    ([lp(4), lp(6, top=((VOCAB, -1.0),))], "outside the vocabulary"),
    ([lp(4), lp(6, 0.5)], "finite number <= 0"),
    ([lp(4), lp(6, float("nan"))], "finite number <= 0"),
    ([lp(4), lp(6, top=((1, float("-inf")),))], "finite number <= 0"),
    ([lp(4), lp(6, top=tuple((i, -1.0) for i in range(21)))], "top logprobs"),
])
def test_bad_logprobs_are_refused(logprobs, needle):
    reply = _response([StepResult(1, Verified([4], 6, features(2, 0), 1, logprobs))])
    with pytest.raises(WireError, match=needle):
        decode_link_response(reply, vocab_size=VOCAB, feature_dim=WIDTH, max_feature_rows=100)


def test_top_counts_must_match_the_ids():
    reply = _response([StepResult(1, Verified([4], 6, features(2, 0), 1, [lp(4), lp(6)]))])
    reply.verified.logprobs[0].top_counts[1] = 3
    with pytest.raises(WireError, match="top logprobs"):
        decode_link_response(reply, vocab_size=VOCAB, feature_dim=WIDTH, max_feature_rows=100)


def _response(results, width=WIDTH, step=1) -> pb.LinkResponse:
    """The reply the verifier would send, parsed as the drafter parses it."""
    return pb.LinkResponse.FromString(encode_link_response(step, results, width, torch.float32).data)


@pytest.mark.parametrize("results, needle", [
    ([StepResult(1, Verified([VOCAB], 1, features(2, 1), 1))], "outside the vocabulary"),
    ([StepResult(1, Verified([1], -1, features(2, 1), 1))], "outside the vocabulary"),
    ([StepResult(1, Prefilled(VOCAB + 3, features(2, 1), 8))], "outside the vocabulary"),
    ([StepResult(1, Verified([1, 2], 3, features(2, 1), 1))], "feature rows"),
])
def test_bad_replies_are_refused(results, needle):
    with pytest.raises(WireError, match=needle):
        decode_link_response(_response(results), vocab_size=VOCAB, feature_dim=WIDTH, max_feature_rows=100)


def test_feature_width_and_row_count_are_checked():
    reply = _response([StepResult(1, Verified([1], 2, features(2, 0), 1))])
    with pytest.raises(WireError, match="expected"):
        decode_link_response(reply, vocab_size=VOCAB, feature_dim=WIDTH + 1, max_feature_rows=100)
    reply.features.shape[:] = [3, WIDTH]  # more rows claimed than the data holds
    with pytest.raises(WireError):
        decode_link_response(reply, vocab_size=VOCAB, feature_dim=WIDTH, max_feature_rows=100)


def test_check_results_matches_replies_to_entries():
    tree = chain([4, 5, 6])
    entries = [OpenEntry(1, [1], SamplingParams()), TreeEntry(2, 3, tree), CloseEntry(5)]
    good = [StepResult(1, Prefilled(3, features(1, 0), 16)), StepResult(2, Verified([5, 6], 7, features(3, 0), 3))]
    check_results(entries, good)
    bad_cases = [
        good[:1],  # a result missing
        [good[1], good[0]],  # out of order
        [good[0], StepResult(2, Verified([5], 6, features(2, 0), 2))],  # answers another round
        [good[0], StepResult(2, Verified([5, 6, 7], 8, features(4, 0), 3))],  # more accepted than the tree holds
        [StepResult(1, Verified([], 3, features(1, 0), 1)), good[1]],  # a Verified for an open
        [good[0], StepResult(2, Prefilled(3, features(1, 0), 16))],  # a Prefilled for a tree
    ]
    for results in bad_cases:
        with pytest.raises(StatusError) as err:
            check_results(entries, results)
        assert err.value.status == "INTERNAL"


def test_check_results_matches_prompt_chunks():
    """A chunk with more to come is answered by an Extended, the last one by the Prefilled."""
    entries = [OpenEntry(1, [1, 2], SamplingParams(), more=True), ExtendEntry(2, [3], more=True), ExtendEntry(3, [4])]
    extended, prefilled = Extended(features(1, 0)), Prefilled(3, features(1, 0), 16)
    check_results(entries, [StepResult(1, extended), StepResult(2, extended), StepResult(3, prefilled)])
    for bad in ([StepResult(1, prefilled), StepResult(2, extended), StepResult(3, prefilled)],
                [StepResult(1, extended), StepResult(2, extended), StepResult(3, extended)],
                [StepResult(1, extended), StepResult(2, Verified([], 3, features(1, 0), 1)),
                 StepResult(3, prefilled)]):
        with pytest.raises(StatusError, match="answers no"):
            check_results(entries, bad)


class _CannedCall:
    """A raw Link stream's replies, cancellable like a gRPC call."""

    def __init__(self, replies):
        self._replies = iter(replies)
        self.cancelled = False

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._replies)

    def cancel(self):
        self.cancelled = True


class _CannedStub:
    """A `verifier_stub` whose raw Link stream answers each message with the next canned reply
    (an EncodedReply, or bytes: a notice)."""

    def __init__(self, replies):
        self.replies = [r if isinstance(r, bytes) else r.data for r in replies]
        self.call = None

    def Link(self, requests):
        self.call = _CannedCall(self.replies)
        return self.call


SAMPLING = SamplingParams()
PROMPT_END = [OpenEntry(1, [4, 5, 6], SAMPLING, "", (1,)), ExtendEntry(2, [7, 8]), TreeEntry(3, 1, chain([3, 4])),
              OpenEntry(4, [9, 10], SAMPLING, "", (1,), more=True)]
PROMPT_END_RESULTS = [StepResult(1, Prefilled(11, features(3, 0), 64)), StepResult(2, Prefilled(12, features(2, 1), 64)),
                      StepResult(3, Verified([4], 13, features(2, 2), 1)), StepResult(4, Extended(features(2, 3)))]


def _notice(results, step=1) -> bytes:
    return encode_link_response(step, results, WIDTH, torch.float32, notice=True).data


def test_a_notice_of_first_tokens_reaches_on_notice_before_the_reply():
    """The verifier's notice (the first tokens of the prompts a message completes, without
    features) goes to `on_notice` while the link waits for the reply, which follows as usual."""
    from drafter_svc.link import GrpcLink
    from common.wire import encode_link_notice

    notice = encode_link_notice(1, PROMPT_END_RESULTS, WIDTH, torch.float32)
    reply = encode_link_response(1, PROMPT_END_RESULTS, WIDTH, torch.float32)
    link = GrpcLink(_CannedStub([notice, reply]), vocab_size=VOCAB, feature_dim=WIDTH, max_seq_len=64)
    link.send(PROMPT_END)
    noticed = []
    results = link.receive(on_notice=noticed.append)
    assert [[(r.session_id, r.outcome.token, r.outcome.features.shape[0]) for r in n] for n in noticed] == \
        [[(1, 11, 0), (2, 12, 0)]]
    assert [r.session_id for r in results] == [1, 2, 3, 4] and results[0].outcome.features.shape[0] == 3
    link = GrpcLink(_CannedStub([notice, reply]), vocab_size=VOCAB, feature_dim=WIDTH, max_seq_len=64)
    link.send(PROMPT_END)  # without on_notice, the notice is checked and dropped
    assert [r.session_id for r in link.receive()] == [1, 2, 3, 4]
    # No notice for prompts completed without features (plain decoding): their reply is small.
    assert encode_link_notice(1, [StepResult(1, Prefilled(1, features(0, 0), 64))], WIDTH, torch.float32) is None


@pytest.mark.parametrize("notices, needle", [
    ([_notice([StepResult(3, Prefilled(11, features(0, 0), 64))])], "does not end the prompt"),
    ([_notice([StepResult(4, Prefilled(11, features(0, 0), 64))])], "does not end the prompt"),
    ([_notice([StepResult(1, Prefilled(11, features(0, 0), 64))] * 2)], "or twice"),
    ([_notice([StepResult(1, Prefilled(11, features(1, 0), 64))])], "only first tokens"),
    ([_notice([StepResult(3, Verified([4], 13, features(0, 2), 1))])], "only first tokens"),
    ([_notice([StepResult(1, Prefilled(VOCAB, features(0, 0), 64))])], "outside the vocabulary"),
    ([_notice([StepResult(1, Prefilled(11, features(0, 0), 64))], step=2)], "reply to step 2"),
    ([_notice([StepResult(1, Prefilled(11, features(0, 0), 64))])] * 2, "a second notice"),
])
def test_bad_notices_end_the_link(notices, needle):
    """A notice for a session the message does not complete, with features, with another
    result, a bad token, for another step, or twice, ends the link (INTERNAL): nothing of it
    reaches a client."""
    from drafter_svc.link import GrpcLink

    stub = _CannedStub([*notices, encode_link_response(1, PROMPT_END_RESULTS, WIDTH, torch.float32)])
    link = GrpcLink(stub, vocab_size=VOCAB, feature_dim=WIDTH, max_seq_len=64)
    link.send(PROMPT_END)
    noticed = []
    with pytest.raises(StatusError, match=needle) as info:
        link.receive(on_notice=noticed.append)
    assert info.value.status == "INTERNAL" and stub.call.cancelled and len(noticed) <= 1


@pytest.mark.parametrize("seconds, kept", [(0.0125, 0.0125), (float("nan"), 0.0), (-1.0, 0.0), (float("inf"), 0.0),
                                           (1e9, 0.0)])
def test_the_verifiers_step_time_is_kept_only_when_plausible(seconds, kept):
    """LinkResponse.step_seconds and held_seconds only feed statistics; a bad value becomes unknown
    (0), the results stand."""
    from drafter_svc.link import GrpcLink

    reply = encode_link_response(1, [StepResult(1, Verified([4], 5, features(2, 1), 1))], WIDTH, torch.float32,
                                 step_seconds=seconds, held_seconds=2 * seconds)
    link = GrpcLink(_CannedStub([reply]), vocab_size=VOCAB, feature_dim=WIDTH, max_seq_len=64)
    link.send([TreeEntry(1, 1, chain([3, 4]))])
    results = link.receive()
    assert results[0].outcome.next_token == 5 and link.verifier_step_s == kept
    assert (link.link_s > 0) == (kept > 0)  # the link's own time is known only with the verifier's hold


def test_the_links_time_runs_to_the_replys_arrival_not_its_late_read():
    """A reader thread takes each reply as it comes: read late (the scheduler was drafting), the
    message's link time is still its round trip to the arrival less the verifier's hold, plus
    the decoding; the round trip itself, taken at the read, is longer."""
    from drafter_svc.link import GrpcLink

    reply = encode_link_response(1, [StepResult(1, Verified([4], 5, features(2, 1), 1))], WIDTH, torch.float32,
                                 step_seconds=0.001, held_seconds=0.001)
    link = GrpcLink(_CannedStub([reply]), vocab_size=VOCAB, feature_dim=WIDTH, max_seq_len=64)
    start = time.perf_counter()
    link.send([TreeEntry(1, 1, chain([3, 4]))])
    time.sleep(0.3)
    assert link.receive()[0].outcome.next_token == 5
    assert time.perf_counter() - start >= 0.3 and 0 < link.link_s < 0.15


class _StepVerifier:
    """A TreeVerifier's begin / finish, recorded: each step is a real `PendingStep` (a prompt
    chunk here stands for a verify whose logits its finish reads: exclusive) whose results are
    its entries' session ids."""

    def __init__(self):
        self.calls = []
        self.runner = types.SimpleNamespace(features_on_device=False, warmed=None)
        self.runner.take_device_trees = lambda max_nodes: vars(self.runner).update(features_on_device=True,
                                                                                   warmed=max_nodes)
        self.limits = types.SimpleNamespace(max_tree_nodes=33)

    def begin(self, entries):
        from verifier_svc.tree_verifier import PendingStep

        ids = [e.session_id for _, e in entries]
        self.calls.append(("begin", ids))
        step = PendingStep(keys=frozenset((owner, e.session_id) for owner, e in entries), size=len(entries))
        if any(isinstance(e, ExtendEntry) for _, e in entries):
            step.verify = types.SimpleNamespace(launched=types.SimpleNamespace(exclusive=True))
        return step

    def finish(self, step):
        ids = sorted(key[1] for key in step.keys)
        self.calls.append(("finish", ids))
        return [StepResult(i, Extended(features=torch.zeros(0, 2))) for i in ids]

    def close_owner(self, owner):
        self.calls.append(("close", owner))


def test_local_link_verifies_between_send_and_receive():
    """Send begins a step, receive finishes it; a step touching other sessions begins beside an
    unfinished one, one touching the same session or after an exclusive step waits for it (the
    earlier steps finish first); replies come in order; close finishes what is in flight."""
    from drafter_svc.link import LocalLink

    verifier = _StepVerifier()
    link = LocalLink(verifier)
    assert verifier.runner.features_on_device  # the features stay where the draft model reads them
    assert verifier.runner.warmed == 33  # the place kernel compiled for every tree size it may take
    link.send([CloseEntry(1)])
    link.send([CloseEntry(2)])  # another session: begins beside it
    assert verifier.calls == [("begin", [1]), ("begin", [2])] and link.in_flight == 2
    link.send([CloseEntry(1)])  # session 1 again: the unfinished steps finish first, in order
    assert verifier.calls[2:] == [("finish", [1]), ("finish", [2]), ("begin", [1])]
    assert [r.session_id for r in link.receive()] == [1]
    assert [r.session_id for r in link.receive()] == [2]
    assert verifier.calls[5:] == []  # both were finished already
    link.send([ExtendEntry(3, [1, 2], False)])  # a prompt chunk (exclusive), beside session 1's step
    link.send([CloseEntry(4)])  # waits for the exclusive one
    assert verifier.calls[5:] == [("begin", [3]), ("finish", [1]), ("finish", [3]), ("begin", [4])]
    assert [r.session_id for r in link.receive()] == [1]
    link.close()
    assert verifier.calls[-2:] == [("finish", [4]), ("close", "local")] and link.in_flight == 0


class _Cancelled(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.CANCELLED

    def details(self):
        return "Locally cancelled by application!"


class _SilentCall:
    """A Link stream that answers nothing until cancelled (a verifier stopped, a link that stalls),
    then fails as gRPC's does."""

    def __init__(self):
        self.cancelled = threading.Event()

    def __iter__(self):
        return self

    def __next__(self):
        self.cancelled.wait(10)
        raise _Cancelled()

    def cancel(self):
        self.cancelled.set()


def test_closing_the_link_ends_a_receive_that_waits():
    """A receive waiting on the stream's reader thread ends when another thread closes the link,
    with UNAVAILABLE ("verifier link lost"), not the cancellation's own status."""
    from drafter_svc.link import GrpcLink

    stub = types.SimpleNamespace(call=_SilentCall())
    stub.Link = lambda requests: stub.call
    link = GrpcLink(stub, vocab_size=VOCAB, feature_dim=WIDTH, max_seq_len=64)
    link.send([TreeEntry(1, 1, chain([3, 4]))])
    errors = []
    waiter = threading.Thread(target=lambda: _catch(link.receive, errors))
    waiter.start()
    time.sleep(0.1)
    link.close()
    waiter.join(5)
    assert not waiter.is_alive() and stub.call.cancelled.is_set()
    assert len(errors) == 1 and errors[0].status == "UNAVAILABLE" and "link lost" in str(errors[0])


def _catch(fn, errors):
    try:
        fn()
    except StatusError as exc:
        errors.append(exc)


class _InfoRefused(grpc.RpcError):
    """Info's UNAVAILABLE with a reason (a verifier whose model worker has stalled)."""

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "the model worker has made no progress for 31 s"


class _StalledStub:
    """A verifier whose Link replies never come and whose Info answers while `alive` (after that,
    raises `refusal`, or no answer)."""

    def __init__(self, refusal: grpc.RpcError | None = None):
        self.alive, self.asked, self.call, self.refusal = True, 0, None, refusal

    def Link(self, requests):
        self.call = _SilentCall()
        return self.call

    def Info(self, request, timeout):
        self.asked += 1
        if not self.alive:
            raise self.refusal or grpc.RpcError("no answer")
        return pb.InfoResponse()


@pytest.mark.parametrize("refused", [False, True], ids=["silent", "refused"])
def test_a_stalled_link_is_lost_once_the_verifier_does_not_answer_info(monkeypatch, refused):
    """No reply for STALL_PROBE_S: the link asks the verifier for its Info; while it answers (a long
    prefill) the link waits on, and once it does not, the link is dropped and the receive fails
    with UNAVAILABLE (so its sessions re-open, and health says not serving), not after gRPC's
    keepalive, which took 80 s."""
    from drafter_svc import link as link_module
    monkeypatch.setattr(link_module, "STALL_PROBE_S", 0.05)
    stub = _StalledStub(_InfoRefused() if refused else None)
    link = link_module.GrpcLink(stub, vocab_size=VOCAB, feature_dim=WIDTH, max_seq_len=64)
    link.send(PROMPT_END)
    failed = []
    receiving = threading.Thread(target=lambda: failed.append(pytest.raises(StatusError, link.receive)))
    receiving.start()
    deadline = time.monotonic() + 10
    while stub.asked < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stub.asked >= 3 and receiving.is_alive() and not stub.call.cancelled.is_set()
    stub.alive = False
    receiving.join(10)
    assert not receiving.is_alive() and stub.call.cancelled.is_set()
    error = failed[0].value
    assert error.status == "UNAVAILABLE" and error.message.startswith("the verifier does not answer: no reply for "), \
        error.message
    assert error.message.endswith("and Info got UNAVAILABLE: the model worker has made no progress for 31 s" if refused
                                  else "and Info got no answer within 2 s"), error.message
