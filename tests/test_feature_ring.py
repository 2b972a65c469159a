"""The shared-memory ring of a link's feature rows (common/feature_ring.py): its positions and
checks on both sides, and the drafter's link reading rows out of it and checking what the
verifier says of them (the services end to end: tests/test_e2e.py, tests/test_verifier_server.py)."""
from __future__ import annotations

import collections
import os
import random

import pytest
import torch

from common.feature_ring import HEADER, PREFIX, RingError, RingOffer, RingReader, RingWriter
from common.protocol import OpenEntry, Prefilled, SamplingParams, StatusError, StepResult, TreeEntry, Verified
from common.rpc import pb
from common.wire import RingPlace, encode_link_response, feature_bytes
from drafter_svc.link import GrpcLink
from tests.test_link import VOCAB, WIDTH, _CannedStub, chain, features


def _mapped(tmp_path, capacity: int) -> tuple[RingWriter, RingReader]:
    writer = RingWriter(capacity, str(tmp_path))
    reader = RingReader(writer.offer())
    writer.answered(mapped=True)
    return writer, reader


def test_rows_cross_in_order_through_many_laps_without_overwriting_unread_ones(tmp_path):
    """Replies of random sizes, read up to three behind their writing (a pipelining drafter), over
    many laps of a small ring: every reply reads back as written, even after later ones were
    written; a reply without room goes inline (None), and room comes back with the releases."""
    rng = random.Random(7)
    writer, reader = _mapped(tmp_path, 4096)
    unread: collections.deque[tuple[int, torch.Tensor]] = collections.deque()
    inline = placed = 0
    for _ in range(2000):
        if unread and (len(unread) > 3 or rng.random() < 0.5):
            at, rows = unread.popleft()
            got = torch.frombuffer(bytearray(reader.rows(at, rows.numel())), dtype=torch.uint8)
            assert torch.equal(got, rows)
            reader.done(at + rows.numel())
            writer.release(reader.read_to)
            continue
        rows = torch.randint(0, 256, (rng.randint(1, 1800),), dtype=torch.uint8)
        at = writer.reserve(rows.numel())
        if at is None:
            inline += 1
            assert unread  # only unread rows take the room
            continue
        writer.write(at, rows)
        unread.append((at, rows))
        placed += 1
    assert writer.head > 100 * writer.capacity and placed > 500 and inline > 50


def test_reserve_checks_room_and_wraps_to_the_next_lap(tmp_path):
    writer = RingWriter(1000, str(tmp_path))
    assert writer.reserve(10) is None  # not mapped yet
    writer.answered(mapped=True)
    assert writer.reserve(0) is None and writer.reserve(1001) is None
    assert writer.reserve(600) == 0
    assert writer.reserve(500) is None  # 600 unread + 500 > 1000
    writer.release(600)
    assert writer.reserve(500) == 1000  # would pass the end at 600: the next lap
    assert writer.reserve(400) is None  # the lap's first 500 are unread, and the skipped 400 are not room
    writer.release(1500)
    assert writer.reserve(400) == 1500
    with pytest.raises(RingError, match="outside"):
        writer.release(1400)  # back
    with pytest.raises(RingError, match="outside"):
        writer.release(1901)  # past the rows reserved


def test_the_file_is_private_named_and_unlinked_once_answered(tmp_path):
    writer = RingWriter(1 << 20, str(tmp_path))
    (name,) = os.listdir(tmp_path)
    assert name.startswith(PREFIX) and os.stat(writer.path).st_mode & 0o777 == 0o600
    assert os.path.getsize(writer.path) == HEADER + (1 << 20)
    writer.answered(mapped=False)
    assert os.listdir(tmp_path) == [] and writer.reserve(8) is None
    other = RingWriter(1 << 20, str(tmp_path))
    other.close()  # the link ended before the drafter answered
    assert os.listdir(tmp_path) == []


def test_the_reader_maps_only_the_ring_offered(tmp_path):
    writer = RingWriter(4096, str(tmp_path))
    offer = writer.offer()
    for bad, needle in [(RingOffer(offer.path, offer.capacity, bytes(16)), "header differs"),
                        (RingOffer(offer.path, 8192, offer.nonce), "not a feature ring"),
                        (RingOffer(offer.path, offer.capacity, b"short"), "nonce"),
                        (RingOffer(str(tmp_path / "elsewhere"), offer.capacity, offer.nonce), "at"),
                        (RingOffer("relative/" + os.path.basename(offer.path), offer.capacity, offer.nonce), "at"),
                        (RingOffer(offer.path, 0, offer.nonce), "0 bytes")]:
        with pytest.raises(RingError, match=needle):
            RingReader(bad)
    with pytest.raises(FileNotFoundError):  # another host: no such file
        RingReader(RingOffer(str(tmp_path / (PREFIX + "0" * 32)), offer.capacity, offer.nonce))
    reader = RingReader(offer)
    reader.done(100)
    # before the rows read, empty, larger than the ring, past its end
    for at, nbytes in [(99, 8), (100, 0), (100, 4097), (4000, 200), (3 * 4096 + 4090, 8)]:
        with pytest.raises(RingError):
            reader.rows(at, nbytes)
    assert len(reader.rows(4096 + 100, 8)) == 8  # any later lap


# -- the drafter's link over a ring ------------------------------------------------------------


def _sent(link: GrpcLink) -> list[pb.LinkRequest]:
    """The messages the link has sent (its canned verifier leaves them in its request queue)."""
    out = []
    while not link._requests.empty():
        out.append(pb.LinkRequest.FromString(link._requests.get_nowait()))
    return out


def _offer_reply(step: int, writer: RingWriter, results) -> bytes:
    return encode_link_response(step, results, WIDTH, torch.float32, offer=writer.offer()).data


OPEN = [OpenEntry(1, [4, 5], SamplingParams(), "", (1,))]  # a session that takes features: the link asks for a ring


def _opened(rows: torch.Tensor) -> list[StepResult]:
    return [StepResult(1, Prefilled(11, rows, 64))]


def test_the_link_maps_the_offer_reads_rows_from_the_ring_and_releases_them(tmp_path):
    writer = RingWriter(1 << 16, str(tmp_path))
    rows = [features(3, i) for i in range(2)]
    results = [_opened(rows[0]), [StepResult(1, Verified([4, 5], 6, rows[1], 1))]]
    writer.mapped = True  # as the verifier sets it on the link's release, which the canned stub skips
    place = RingPlace(writer, writer.reserve(feature_bytes(results[1], WIDTH, torch.float32)))
    stub = _CannedStub([_offer_reply(1, writer, results[0]),
                        encode_link_response(2, results[1], WIDTH, torch.float32, place=place)])
    link = GrpcLink(stub, vocab_size=VOCAB, feature_dim=WIDTH, max_seq_len=64)
    link.send(OPEN)
    assert torch.equal(link.receive()[0].outcome.features, rows[0])  # inline, with the offer
    link.send([TreeEntry(1, 1, chain([11, 4, 5]))])
    got = link.receive()[0].outcome.features
    assert torch.equal(got, rows[1])
    writer.write(place.at, torch.zeros(3, WIDTH))  # the rows were copied out: released, reusable
    assert torch.equal(got, rows[1])
    link.send([TreeEntry(1, 2, chain([6, 4, 5]))])
    first, second, third = _sent(link)
    assert first.feature_ring and not first.HasField("ring_released")
    assert not second.feature_ring and second.ring_released == 0  # mapped, nothing read from it yet
    assert third.ring_released == place.at + 3 * WIDTH * 4


def test_a_link_asks_for_a_ring_only_with_a_session_that_takes_features(tmp_path):
    """Plain decoding's sessions take no features: their link asks for no ring until one does."""
    link = GrpcLink(_CannedStub([]), vocab_size=VOCAB, feature_dim=WIDTH, max_seq_len=64)
    link.send([OpenEntry(1, [4, 5], SamplingParams(), "", ())])
    link.send([OpenEntry(2, [4, 5], SamplingParams(), "", (1,))])
    link.send([OpenEntry(3, [4, 5], SamplingParams(), "", (1,))])
    assert [m.feature_ring for m in _sent(link)] == [False, True, False]


def test_a_link_that_cannot_map_the_offer_refuses_it(tmp_path):
    writer = RingWriter(1 << 16, str(tmp_path))
    os.unlink(writer.path)  # as from another host
    result = _opened(features(2, 0))
    stub = _CannedStub([_offer_reply(1, writer, result)])
    link = GrpcLink(stub, vocab_size=VOCAB, feature_dim=WIDTH, max_seq_len=64)
    link.send(OPEN)
    assert torch.equal(link.receive()[0].outcome.features, result[0].outcome.features)
    link.send([TreeEntry(1, 1, chain([11, 4]))])
    _, second = _sent(link)
    assert second.ring_refused and not second.HasField("ring_released")


@pytest.mark.parametrize("case, needle", [("rows in a ring not mapped", "not mapped"),
                                          ("an offer unasked", "offered unasked"),
                                          ("rows past the ring", "at ring position")])
def test_bad_ring_replies_end_the_link(tmp_path, case, needle):
    """Rows said to lie in a ring the link has not mapped, an offer it did not ask for, or rows
    outside the ring end the link (INTERNAL): nothing of them reaches the draft."""
    writer = RingWriter(1 << 12, str(tmp_path))
    writer.mapped = True
    opened, verified = _opened(features(2, 0)), [StepResult(1, Verified([4], 6, features(2, 1), 1))]

    def in_ring(step: int, results) -> bytes:
        return encode_link_response(step, results, WIDTH, torch.float32,
                                    place=RingPlace(writer, writer.reserve(2 * WIDTH * 4))).data

    if case == "rows in a ring not mapped":
        replies, asks = [in_ring(1, opened)], True
    elif case == "an offer unasked":
        replies, asks = [_offer_reply(1, writer, opened)], False
    else:
        message = pb.LinkResponse.FromString(in_ring(2, verified))
        message.features_at = 3 * 4096 + 4090  # its 56 bytes would pass the ring's end
        replies, asks = [_offer_reply(1, writer, opened), message.SerializeToString()], True
    link = GrpcLink(_CannedStub(replies), vocab_size=VOCAB, feature_dim=WIDTH, max_seq_len=64, feature_ring=asks)
    link.send(OPEN)
    with pytest.raises(StatusError, match=needle) as info:
        link.receive()
        link.send([TreeEntry(1, 1, chain([11, 4]))])
        link.receive()
    assert info.value.status == "INTERNAL"
