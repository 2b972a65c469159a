"""Feature rows packed as fp8 for the link (common.feature_wire): the rounding stays within fp8's
bounds on fresh random rows, the layout is the documented one, and the drafter refuses packed
rows it cannot trust or did not ask for."""
from __future__ import annotations

import struct

import pytest
import torch

from common.config import load_draft_config
from common.feature_wire import (FP8, FP8_MAX, MODEL_DTYPE, SCALE_BYTES, FeatureReader, feature_reader, pack_rows,
                                 scales_of, unpack_rows, wire_rows)
from common.protocol import Extended, ExtendEntry, OpenEntry, Prefilled, SamplingParams, StepResult, TreeEntry, Verified
from common.rpc import pb
from common.tree import DraftTree
from common.wire import WireError, decode_link_response, encode_link_response
from verifier_svc.server import VerifierConfig, load_verifier

F = 64


def random_rows(rows: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Rows of very different magnitudes: some tiny, some with one large outlier, one all zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, F, generator=g) * torch.logspace(-4, 4, rows)[:, None]
    x[0] = 0.0
    x[1, 5] = 3e4  # an outlier, as residual streams have
    return x.to(dtype)


def reference_unpack(packed: torch.Tensor) -> torch.Tensor:
    """Plain reading of the layout: F fp8 bytes, then a little-endian float32 scale, per row."""
    out = torch.empty(packed.shape[0], packed.shape[1] - SCALE_BYTES, dtype=torch.float64)
    for i, row in enumerate(packed.tolist()):
        (scale,) = struct.unpack("<f", bytes(row[-SCALE_BYTES:]))
        values = torch.tensor(row[:-SCALE_BYTES], dtype=torch.uint8).view(torch.float8_e4m3fn).double()
        out[i] = values * scale
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_rows_round_trip_within_fp8_rounding(dtype, seed):
    x = random_rows(12, seed, dtype if dtype != torch.float16 else torch.float32).to(dtype)
    packed = pack_rows(x)
    assert packed.dtype == torch.uint8
    assert packed.shape == (12, F + SCALE_BYTES) == (12, wire_rows(F, FP8, torch.float32)[0])
    scales = scales_of(packed)
    amax = x.float().abs().amax(-1)
    assert torch.equal(scales, amax * (1.0 / FP8_MAX)) and scales[0] == 0  # as a GPU computes it
    got = unpack_rows(packed, "cpu", torch.float32).double()
    assert torch.equal(got, reference_unpack(packed).float().double())  # the documented layout
    want = x.double()
    # Round to nearest in e4m3: half a unit in the last place of 3 mantissa bits (2^-4 relative)
    # for normal values, half of the subnormal step (2^-9 of the scale) below 2^-6 of it.
    bound = want.abs() * 2.0 ** -4 + scales.double()[:, None] * 2.0 ** -10
    assert ((got - want).abs() <= bound * (1 + 1e-6)).all()
    assert torch.equal(got[0], torch.zeros(F, dtype=torch.float64))
    assert (got.abs().amax(-1) - want.abs().amax(-1)).abs().le(want.abs().amax(-1) * 1e-6).all()  # the max is exact


def test_packing_keeps_leading_dimensions_and_empty_rows():
    x = torch.randn(3, 4, F, generator=torch.Generator().manual_seed(5))
    packed = pack_rows(x)
    assert packed.shape == (3, 4, F + SCALE_BYTES)
    assert torch.equal(packed.reshape(12, -1), pack_rows(x.reshape(12, F)))
    assert pack_rows(torch.empty(0, F)).shape == (0, F + SCALE_BYTES)
    assert unpack_rows(pack_rows(torch.empty(0, F)), "cpu", torch.bfloat16).shape == (0, F)
    assert pack_rows(torch.empty(2, 0)).shape == (2, SCALE_BYTES)
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_rows(torch.ones(2, 6))


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0])
def test_a_bad_scale_is_refused(scale):
    packed = pack_rows(random_rows(4, 3))
    packed[2, -SCALE_BYTES:] = torch.tensor(list(struct.pack("<f", scale)), dtype=torch.uint8)
    with pytest.raises(ValueError, match="scale"):
        unpack_rows(packed, "cpu", torch.float32)


def test_packed_rows_of_a_width_that_is_not_a_multiple_of_4_are_refused():
    packed = pack_rows(random_rows(4, 3))
    with pytest.raises(ValueError, match="multiple of 4"):  # their scales would not lie aligned
        unpack_rows(packed[:, 2:].contiguous(), "cpu", torch.float32)


def _reply(rows: torch.Tensor, width: int, dtype: torch.dtype) -> pb.LinkResponse:
    results = [StepResult(1, Verified([4, 5], 6, rows[:3], 2)), StepResult(2, Prefilled(8, rows[3:7], 64)),
               StepResult(3, Extended(rows[7:9]))]
    return pb.LinkResponse.FromString(encode_link_response(1, results, width, dtype).data)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return unpack_rows(t, "cpu", torch.float32)


PACKED = FeatureReader(True, _unpack)  # as `feature_reader(FP8, "cpu", torch.float32)` reads them


def test_a_packed_reply_decodes_to_each_sessions_unpacked_rows():
    x = random_rows(9, 4)
    packed = pack_rows(x)
    got = decode_link_response(_reply(packed, F + SCALE_BYTES, torch.uint8), vocab_size=50, feature_dim=F,
                               max_feature_rows=100, reader=PACKED)
    rows = _unpack(packed)
    assert torch.equal(got[0].outcome.features, rows[:3]) and torch.equal(got[1].outcome.features, rows[3:7])
    assert torch.equal(got[2].outcome.features, rows[7:9])
    empty = pb.LinkResponse.FromString(encode_link_response(2, [], F + SCALE_BYTES, torch.uint8).data)
    assert decode_link_response(empty, vocab_size=50, feature_dim=F, max_feature_rows=100,
                                reader=PACKED) == []


def test_packed_rows_to_a_drafter_that_reads_the_model_dtype_and_back_are_refused():
    x = random_rows(9, 6)
    with pytest.raises(WireError, match="floating-point"):  # packed rows F + 4 wide, to a drafter expecting F + 4
        decode_link_response(_reply(pack_rows(x), F + SCALE_BYTES, torch.uint8), vocab_size=50,
                             feature_dim=F + SCALE_BYTES, max_feature_rows=100)
    with pytest.raises(WireError, match="packed rows"):  # float rows as wide as packed ones
        decode_link_response(_reply(torch.zeros(9, F + SCALE_BYTES), F + SCALE_BYTES, torch.float32),
                             vocab_size=50, feature_dim=F, max_feature_rows=100, reader=PACKED)
    with pytest.raises(WireError, match="expected"):  # model-dtype rows to a drafter expecting packed ones
        decode_link_response(_reply(x, F, torch.float32), vocab_size=50, feature_dim=F, max_feature_rows=100,
                             reader=PACKED)
    bad = pack_rows(x)
    bad[4, -SCALE_BYTES:] = torch.tensor(list(struct.pack("<f", float("nan"))), dtype=torch.uint8)
    with pytest.raises(WireError, match="scale"):
        decode_link_response(_reply(bad, F + SCALE_BYTES, torch.uint8), vocab_size=50, feature_dim=F,
                             max_feature_rows=100, reader=PACKED)


def test_a_packing_verifier_sends_the_packed_rows_of_the_plain_one(qwen3_pair):
    """Prefills, chunked prefills and verify steps: the rows a verifier with `--feature-wire fp8`
    sends are the packed rows of those a verifier in the model's dtype sends."""
    layers = tuple(load_draft_config(qwen3_pair[1]).target_layer_ids)
    config = VerifierConfig(target_dir=str(qwen3_pair[0]), feature_layer_ids=layers, projection_dir=str(qwen3_pair[1]),
                            max_sessions=3, max_seq_len=128, max_tree_nodes=17)
    plain, packing = load_verifier(config), load_verifier(config)
    packing.runner.feature_wire = FP8
    opens = [("L", OpenEntry(1, [5, 17, 42, 99, 3], SamplingParams(), "", layers)),
             ("L", OpenEntry(2, list(range(60, 70)), SamplingParams(), "", layers, more=True)),
             ("L", OpenEntry(3, [7, 300], SamplingParams(0.9, 20, 1.0, 4), "", layers))]
    steps = [opens, [("L", ExtendEntry(2, list(range(70, 90))))]]
    roots = {}
    for entries in steps:
        for a, b in zip(plain.step(entries), packing.step(entries)):
            assert type(a.outcome) is type(b.outcome) and isinstance(a.outcome, (Prefilled, Extended))
            assert b.outcome.features.dtype == torch.uint8 and a.outcome.features.shape[0] > 0
            assert torch.equal(b.outcome.features, pack_rows(a.outcome.features))
            if isinstance(a.outcome, Prefilled):
                assert a.outcome.token == b.outcome.token
                roots[a.session_id] = a.outcome.token
    g = torch.Generator().manual_seed(0)
    for rnd in range(1, 5):
        entries = []
        for sid, root in sorted(roots.items()):
            n = int(torch.randint(1, 12, (1,), generator=g))
            parents = [-1] + [int(torch.randint(0, i + 1, (1,), generator=g)) for i in range(n)]
            tokens = [root] + torch.randperm(plain.vocab_size, generator=g)[:n].tolist()
            entries.append(("L", TreeEntry(sid, rnd, DraftTree.from_parents(tokens, parents))))
        for a, b in zip(plain.step(entries), packing.step(entries)):
            assert isinstance(a.outcome, Verified)
            assert (a.outcome.accepted_tokens, a.outcome.next_token) == (b.outcome.accepted_tokens,
                                                                         b.outcome.next_token)
            assert torch.equal(b.outcome.features, pack_rows(a.outcome.features))
            roots[a.session_id] = a.outcome.next_token


def test_the_acceptance_bench_rounds_rows_as_the_drafter_unpacks_them():
    """bench/acceptance.py --feature-wire fp8 rounds the target's features inside its forward (a CUDA
    graph holds no host check): the values must be those `unpack_rows` gives the drafter."""
    from bench.acceptance import as_sent

    for dtype in (torch.float32, torch.bfloat16):
        x = random_rows(10, 7).to(dtype).reshape(2, 5, F)
        want = unpack_rows(pack_rows(x).reshape(10, -1), "cpu", dtype).reshape(2, 5, F)
        assert torch.equal(as_sent(x), want)


def test_the_reader_a_drafter_gets_for_each_format_and_device():
    plain = feature_reader(MODEL_DTYPE, torch.device("cpu"), torch.float32)
    assert plain == FeatureReader()  # on a CPU the rows stay where they are
    packed = feature_reader(FP8, torch.device("cpu"), torch.bfloat16)
    rows = pack_rows(random_rows(3, 8))
    assert packed.packed and torch.equal(packed.to_draft(rows), unpack_rows(rows, "cpu", torch.bfloat16))
    on_gpu = feature_reader(MODEL_DTYPE, torch.device("cuda"), torch.bfloat16)  # one copy to the device per reply
    assert not on_gpu.packed and on_gpu.to_draft is not None
