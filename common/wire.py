"""Conversions between engine messages and protobuf, with validation of what arrives.

Tensors travel as raw little-endian bytes + dtype + shape (never pickled); tree buffers as
packed integers of the narrowest width that holds them, one array per field for all the
trees of a link message; features as one tensor per link message. Every decoder checks
sizes against limits before allocating, and raises `WireError` (a ValueError) with a clear
message, or, for one bad entry of a link message, a per-session error result.
"""
from __future__ import annotations

import array
import itertools
import math
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from common.feature_ring import RingOffer, RingWriter
from common.feature_wire import SCALE_BYTES, FeatureReader
from common.protocol import (ALWAYS, MAX_LOGPROBS, MAX_TOKEN_BIAS, CloseEntry, Entry, Extended, ExtendEntry, OpenEntry,
                             Prefilled, SamplingParams, StatusError, StepResult, TokenBias, TokenLogprob, TreeEntry,
                             Verified)
from common.rpc import decode_message, pb
from common.staging import stack_rows
from common.tree import DraftTree


class WireError(ValueError):
    """A message that cannot be decoded: wrong sizes, dtypes or values."""


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "uint8": torch.uint8}  # uint8: packed feature rows (common.feature_wire)
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_INT_DTYPES = {w: np.dtype(f"<i{w}") for w in (1, 2, 4, 8)}  # little-endian, by byte width
_ARRAY_CODES = {array.array(code).itemsize: code for code in "qlihb"}  # the array module's, by byte width


def _tensor_kind(msg: pb.Tensor) -> tuple[torch.dtype, list[int], int, int]:
    """A tensor message's (dtype, shape, elements, bytes per element), checked."""
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise WireError(f"unknown tensor dtype {msg.dtype!r}; expected one of {sorted(_DTYPES)}")
    shape = list(msg.shape)
    if any(d < 0 for d in shape):
        raise WireError(f"negative tensor dimension in shape {shape}")
    count = 1
    for d in shape:
        count *= d
    return dtype, shape, count, torch.empty(0, dtype=dtype).element_size()


def tensor_bytes(msg: pb.Tensor) -> int:
    """The bytes of the tensor a message describes (its data may lie elsewhere: a feature ring)."""
    _, _, count, itemsize = _tensor_kind(msg)
    return count * itemsize


def decode_tensor(msg: pb.Tensor, *, max_elements: int, data: bytes | memoryview | None = None) -> torch.Tensor:
    """The tensor a message holds, a view of its data; `data` stands in for msg.data when given
    (`parse_link_response`'s view of the features, or their rows in a feature ring)."""
    dtype, shape, count, itemsize = _tensor_kind(msg)
    if count > max_elements:
        raise WireError(f"tensor of {count} elements exceeds the limit of {max_elements}")
    if data is None:
        data = msg.data  # each read of a bytes field makes a new bytes object: read it once
    if len(data) != count * itemsize:
        raise WireError(f"tensor data is {len(data)} bytes, shape {shape} of {msg.dtype} needs {count * itemsize}")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    # A view of those bytes, not a copy (features run to megabytes per step): it is read-only,
    # which torch warns about, and every reader only copies out of it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=dtype).reshape(shape)


FEW_INTS = 256  # up to this many, `write_ints` packs a tensor's or array's values as a list


def write_ints(field: pb.PackedInts, values: torch.Tensor | np.ndarray | Sequence[int]) -> None:
    """Signed little-endian integers in the narrowest of 1, 2, 4 or 8 bytes, into a message's field.
    (numpy, or for a list the array module, not torch: a link message's few hundred integers cost
    microseconds, not tens of them; a few of them go as a list: numpy's reductions cost more.)"""
    if isinstance(values, (torch.Tensor, np.ndarray)) and values.ndim == 1 and values.shape[0] <= FEW_INTS:
        values = values.tolist()
    if isinstance(values, (torch.Tensor, np.ndarray)):
        a = np.asarray(values.cpu().numpy() if isinstance(values, torch.Tensor) else values, dtype=np.int64)
        lo, hi = (int(a.min()), int(a.max())) if a.size else (0, 0)
    else:
        lo, hi = (min(values), max(values)) if len(values) else (0, 0)
    width = 1 if -128 <= lo and hi < 128 else next(  # (the common case first: a generator costs a microsecond)
        w for w in (2, 4, 8) if -(2 ** (8 * w - 1)) <= lo and hi < 2 ** (8 * w - 1))
    if isinstance(values, (torch.Tensor, np.ndarray)):
        field.data = a.astype(_INT_DTYPES[width]).tobytes()
    else:
        packed = array.array(_ARRAY_CODES[width], values)
        if sys.byteorder == "big":
            packed.byteswap()
        field.data = packed.tobytes()
    field.width = width


def pack_ints(values: torch.Tensor | np.ndarray | Sequence[int]) -> pb.PackedInts:
    msg = pb.PackedInts()
    write_ints(msg, values)
    return msg


def _int_array(msg: pb.PackedInts, *, max_count: int, what: str) -> np.ndarray:
    """A PackedInts' values as they lie in it (a read-only view), checked against `max_count`; an
    unset one holds none."""
    if not msg.width and not msg.data:
        return np.empty(0, dtype=np.int64)
    if msg.width not in _INT_DTYPES:
        raise WireError(f"{what}: integer width {msg.width} is not 1, 2, 4 or 8")
    data = msg.data
    if len(data) % msg.width:
        raise WireError(f"{what}: {len(data)} bytes is not a multiple of width {msg.width}")
    count = len(data) // msg.width
    if count > max_count:
        raise WireError(f"{what}: {count} values exceed the limit of {max_count}")
    return np.frombuffer(data, dtype=_INT_DTYPES[msg.width])


def unpack_ints(msg: pb.PackedInts, *, max_count: int, what: str) -> torch.Tensor:
    return torch.from_numpy(_int_array(msg, max_count=max_count, what=what).astype(np.int64))


def _columns(msg: pb.PackedInts, rows: int, *, max_count: int, what: str) -> list[list[int]]:
    """A PackedInts of `rows` rows of one value per item, row-major: the rows, as lists (a
    message's few columns are checked faster in Python than through numpy's per-call cost)."""
    values = _int_array(msg, max_count=rows * max_count, what=what)
    if values.shape[0] % rows:
        raise WireError(f"{what}: {values.shape[0]} values are not {rows} rows of one per item")
    return values.reshape(rows, -1).tolist()


def _merge_order(positions: list[int], others: int, what: str) -> list[bool] | None:
    """Whether each of the `len(positions) + others` items in message order is a column one
    (True), given the column items' increasing indices among them; None when all are. Raises
    WireError when the indices do not fit."""
    total = len(positions) + others
    if positions and (positions[0] < 0 or positions[-1] >= total
                      or not all(a < b for a, b in zip(positions, positions[1:]))):
        raise WireError(f"{what}: indices {positions[:8]} are not increasing within the {total} items")
    if not others:
        return None
    order = [False] * total
    for i in positions:
        order[i] = True
    return order


@dataclass(frozen=True)
class LinkLimits:
    """What a verifier accepts in one LinkRequest."""
    max_entries: int      # entries per message
    max_tree_nodes: int   # nodes per tree, root included


MAX_SESSION_ID = 2**63 - 1


TREE_COLUMNS = 4  # LinkRequest.trees.fields: session id, round, num_nodes, position
VERIFIED_COLUMNS = 7  # LinkResponse.verified.fields: session id, round, accepted, next token, rows, logprobs, position
MAX_ROUND = 2**32 - 1
MAX_ACCEPTED = 1 << 20  # tokens one Verified result may accept (a bound for the checks; trees are far smaller)


def encode_link_request(step: int, entries: Sequence[Entry]) -> pb.LinkRequest:
    """One drafter step as a LinkRequest: its trees as columns (`pb.Trees`), their buffers
    concatenated in their order; the other entries as messages."""
    msg = pb.LinkRequest(step=step)
    trees: list[TreeEntry] = []
    positions = []
    for index, e in enumerate(entries):
        if isinstance(e, TreeEntry):
            trees.append(e)
            positions.append(index)
        elif isinstance(e, OpenEntry):
            entry = msg.entries.add(session_id=e.session_id, open=pb.Open(
                prompt_token_ids=e.prompt_ids, sampling=encode_sampling(e.sampling), traceparent=e.traceparent,
                feature_layer_ids=e.feature_layer_ids, more=e.more, bias_token_ids=[b.token for b in e.token_bias],
                bias_values=[b.value for b in e.token_bias], bias_until=[b.until for b in e.token_bias]))
            if e.logprobs is not None:
                entry.open.logprobs = e.logprobs
            if e.output_start != ALWAYS:
                entry.open.output_start = e.output_start
        elif isinstance(e, ExtendEntry):
            msg.entries.add(session_id=e.session_id, extend=pb.Extend(prompt_token_ids=e.prompt_ids, more=e.more,
                                                                      traceparent=e.traceparent))
        else:
            msg.entries.add(session_id=e.session_id, close=pb.Close())
    if trees:
        write_ints(msg.trees.fields, [e.session_id for e in trees] + [e.round for e in trees]
                   + [e.tree.num_nodes for e in trees] + positions)
        if any(e.traceparent for e in trees):
            msg.trees.traceparents.extend(e.traceparent for e in trees)
        for field in ("tokens", "next_token", "next_sibling"):
            buffers = [getattr(e.tree, field) for e in trees]
            write_ints(getattr(msg, f"tree_{field}"), buffers[0] if len(buffers) == 1 else torch.cat(buffers))
    return msg


def decode_link_request(msg: pb.LinkRequest, limits: LinkLimits) -> list[Entry | StepResult]:
    """The entries of a LinkRequest, in order. A bad entry becomes a `StepResult` carrying its
    INVALID_ARGUMENT error (that session fails, the others go on); a message that breaks the
    link's limits raises WireError. Tree structure is checked later (`common.tree.walk_trees`)."""
    tree_ids, rounds, sizes, positions = _columns(msg.trees.fields, TREE_COLUMNS, max_count=limits.max_entries,
                                                  what="trees")
    count = len(msg.entries) + len(tree_ids)
    if count > limits.max_entries:
        raise WireError(f"a link message carries {count} entries, the limit is {limits.max_entries}")
    if tree_ids and min(tree_ids) <= 0:  # (packed ints are signed: no id past 2^63 - 1)
        raise WireError(f"a tree's session id {min(tree_ids)} is outside [1, 2^63)")
    traceparents = list(msg.trees.traceparents) or [""] * len(tree_ids)
    if len(traceparents) != len(tree_ids):
        raise WireError(f"{len(traceparents)} trace contexts for {len(tree_ids)} trees")
    order = _merge_order(positions, len(msg.entries), "trees")
    framing, max_nodes = "", limits.max_entries * limits.max_tree_nodes
    if sizes and (min(sizes) < 0 or max(sizes) > max_nodes):
        framing = f"a node count of {min(sizes) if min(sizes) < 0 else max(sizes)}"
    else:
        try:
            buffers = [unpack_ints(getattr(msg, f"tree_{f}"), max_count=max_nodes, what=f"tree_{f}")
                       for f in ("tokens", "next_token", "next_sibling")]
            if any(b.numel() != sum(sizes) for b in buffers):
                framing = (f"tree buffers hold {[b.numel() for b in buffers]} values, the trees' num_nodes add up "
                           f"to {sum(sizes)}")
        except WireError as exc:
            framing = str(exc)
    # Each tree's slices of the three buffers, in order (one split per buffer, not one slice per tree).
    pieces = zip(*(b.split_with_sizes(sizes) for b in buffers)) if not framing else itertools.repeat(None)
    trees = iter(zip(tree_ids, rounds, sizes, traceparents, pieces))
    entries = iter(msg.entries)
    out: list[Entry | StepResult] = []
    seen: set[int] = set()
    for is_tree in order or itertools.repeat(True, len(tree_ids)):
        if is_tree:
            sid, rnd, n, traceparent, tree_buffers = next(trees)
        else:
            e = next(entries)
            sid = e.session_id
            if not 0 < sid <= MAX_SESSION_ID:
                raise WireError(f"session id {sid} is outside [1, 2^63)")
        if sid in seen:
            out.append(_invalid(sid, "the message carries two entries for this session"))
            continue
        seen.add(sid)
        if is_tree:
            if framing:
                out.append(_invalid(sid, f"malformed tree: {framing}"))
            elif not 1 <= n <= limits.max_tree_nodes:
                out.append(_invalid(sid, f"malformed tree: {n} nodes, expected 1 to {limits.max_tree_nodes}"))
            elif not 0 <= rnd <= MAX_ROUND:
                out.append(_invalid(sid, f"tree round {rnd} is outside [0, 2^32)"))
            else:
                out.append(TreeEntry(sid, rnd, DraftTree(*tree_buffers), traceparent))
        else:
            out.append(_decode_entry(e))
    return out


def _decode_entry(e: pb.SessionEntry) -> Entry | StepResult:
    """An open, extend or close entry (`decode_link_request`), or its INVALID_ARGUMENT result."""
    sid, kind = e.session_id, e.WhichOneof("kind")
    if kind == "open":
        try:
            sampling = decode_sampling(e.open.sampling)
        except ValueError as exc:
            return _invalid(sid, f"bad sampling parameters: {exc}")
        o = e.open
        counts = {len(o.bias_token_ids), len(o.bias_values), len(o.bias_until)}
        if len(counts) > 1 or max(counts) > MAX_TOKEN_BIAS:
            return _invalid(sid, f"token biases of {len(o.bias_token_ids)} ids, {len(o.bias_values)} values "
                                 f"and {len(o.bias_until)} bounds: at most {MAX_TOKEN_BIAS}, as many of each")
        return OpenEntry(sid, list(o.prompt_token_ids), sampling, o.traceparent, tuple(o.feature_layer_ids),
                         o.logprobs if o.HasField("logprobs") else None, o.more,
                         tuple(map(TokenBias, o.bias_token_ids, o.bias_values, o.bias_until)),
                         o.output_start if o.HasField("output_start") else ALWAYS)
    if kind == "extend":
        return ExtendEntry(sid, list(e.extend.prompt_token_ids), e.extend.more, e.extend.traceparent)
    if kind == "close":
        return CloseEntry(sid)
    return _invalid(sid, "an entry must be open, extend or close (trees travel as columns)")


def _invalid(session_id: int, message: str) -> StepResult:
    return StepResult(session_id, StatusError("INVALID_ARGUMENT", message))


@dataclass(frozen=True)
class EncodedReply:
    """A serialised LinkResponse, and each of its results' (session id, kind): what the link's
    session timers read, without parsing the message again."""
    data: bytes
    results: tuple[tuple[int, str], ...]


@dataclass(frozen=True)
class RingPlace:
    """Where a reply's feature rows go instead of into it: the link's ring, at a reserved position."""
    ring: RingWriter
    at: int


def feature_bytes(results: Sequence[StepResult], feature_dim: int, dtype: torch.dtype) -> int:
    """The bytes of the feature rows a reply to `results` carries."""
    rows = sum(r.outcome.features.shape[0] for r in results if isinstance(r.outcome, (Prefilled, Verified, Extended)))
    return rows * feature_dim * torch.empty(0, dtype=dtype).element_size()


def encode_link_response(step: int, results: Sequence[StepResult], feature_dim: int,
                         dtype: torch.dtype, step_seconds: float = 0.0, notice: bool = False,
                         held_seconds: float = 0.0, place: RingPlace | None = None,
                         offer: RingOffer | None = None) -> EncodedReply:
    """Results in order, with the features of all of them in one tensor (rows in result order),
    the time of the verifier step that made them and how long the verifier held the message
    (`LinkResponse.held_seconds`); serialised. With `place`, the rows go to the link's ring
    (`common.feature_ring`; `feature_bytes` reserved there) and the reply says where; `offer`
    offers the link a ring.

    The features (megabytes per step) are copied once, into the serialised reply: the message
    is serialised without them and their field appended after it (protobuf's wire format allows
    a message's fields in any order), instead of copying them into the message and then into its
    serialisation."""
    msg = pb.LinkResponse(step=step, step_seconds=step_seconds, notice=notice, held_seconds=held_seconds)
    if offer is not None:
        msg.ring.CopyFrom(pb.FeatureRing(path=offer.path, capacity=offer.capacity, nonce=offer.nonce))
    rows = []
    verified: list[tuple[int, Verified]] = []  # (position, result): the columns
    for index, r in enumerate(results):
        o = r.outcome
        if isinstance(o, Verified):
            verified.append((index, r))
            rows.append(o.features)
        elif isinstance(o, Prefilled):  # the fields set in place: faster than a message built and copied in
            p = msg.results.add(session_id=r.session_id).prefilled
            p.SetInParent()
            p.token, p.max_seq_len, p.feature_rows = o.token, o.max_seq_len, o.features.shape[0]
            _write_logprobs(p, o.logprobs)
            rows.append(o.features)
        elif isinstance(o, Extended):
            msg.results.add(session_id=r.session_id, extended=pb.Extended(feature_rows=o.features.shape[0]))
            rows.append(o.features)
        else:
            msg.results.add(session_id=r.session_id, error=pb.Error(code=status_code(o.status), message=o.message))
    if verified:
        out = [r.outcome for _, r in verified]
        write_ints(msg.verified.fields, [r.session_id for _, r in verified] + [o.round for o in out]
                   + [len(o.accepted_tokens) for o in out] + [o.next_token for o in out]
                   + [o.features.shape[0] for o in out] + [o.logprobs is not None for o in out]
                   + [index for index, _ in verified])
        write_ints(msg.verified.accepted_tokens, list(itertools.chain.from_iterable(o.accepted_tokens for o in out)))
        for o in out:
            if o.logprobs is not None:
                _write_logprobs(msg.verified.logprobs.add(), o.logprobs)
    features = stack_rows(rows, feature_dim, dtype)
    if place is not None:
        if features.numel() * features.element_size() != feature_bytes(results, feature_dim, dtype):
            raise ValueError("a reply's feature rows differ from the bytes reserved for them")
        place.ring.write(place.at, features)
        msg.features_at = place.at
        msg.features.CopyFrom(pb.Tensor(dtype=_DTYPE_NAMES[features.dtype], shape=list(features.shape)))
        data = msg.SerializeToString()
    else:
        data = b"".join([msg.SerializeToString(), *_tensor_field(_FEATURES_FIELD, features)])
    return EncodedReply(data, tuple((r.session_id, _KINDS.get(type(r.outcome), "error")) for r in results))


_KINDS = {Prefilled: "prefilled", Verified: "verified", Extended: "extended"}  # a result's kind, as EncodedReply says


def notice_results(results: Sequence[StepResult]) -> list[StepResult]:
    """What a notice holds of a reply's `results`: each Prefilled with feature rows, without them."""
    return [StepResult(r.session_id, Prefilled(r.outcome.token, r.outcome.features[:0], r.outcome.max_seq_len,
                                               r.outcome.logprobs))
            for r in results if isinstance(r.outcome, Prefilled) and r.outcome.features.shape[0]]


def encode_link_notice(step: int, results: Sequence[StepResult], feature_dim: int, dtype: torch.dtype) -> bytes | None:
    """The notice that goes ahead of message `step`'s reply (LinkResponse.notice: `notice_results`);
    None when there is nothing in it (the reply is small, nothing to gain)."""
    early = notice_results(results)
    return encode_link_response(step, early, feature_dim, dtype, notice=True).data if early else None


_FEATURES_FIELD = pb.LinkResponse.DESCRIPTOR.fields_by_name["features"].number
_DATA_FIELD = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _tensor_field(number: int, t: torch.Tensor) -> list:
    """Field `number` holding t as a pb.Tensor, in protobuf's wire format: [its header, a view
    of t's bytes] (joined by the caller, the one copy of the data)."""
    if t.dtype not in _DTYPE_NAMES:
        raise WireError(f"dtype {t.dtype} cannot be sent")
    t = t.detach().contiguous().cpu()
    raw = memoryview(t.view(torch.uint8).numpy().reshape(-1)) if t.numel() else b""
    head = pb.Tensor(dtype=_DTYPE_NAMES[t.dtype], shape=list(t.shape)).SerializeToString()
    data_key = _varint(_DATA_FIELD << 3 | 2) + _varint(len(raw))
    return [_varint(number << 3 | 2), _varint(len(head) + len(data_key) + len(raw)), head, data_key, raw]


def _write_logprobs(field, logprobs: list[TokenLogprob] | None) -> None:
    """Fill a Prefilled's `logprobs` field (left unset for None), or a Logprobs message."""
    if logprobs is None:
        return
    if not isinstance(field, pb.Logprobs):
        field = field.logprobs
        field.SetInParent()
    field.logprobs[:] = [t.logprob for t in logprobs]
    field.top_counts[:] = [len(t.top) for t in logprobs]
    field.top_token_ids[:] = [i for t in logprobs for i, _ in t.top]
    field.top_logprobs[:] = [v for t in logprobs for _, v in t.top]


def _read_logprobs(field: pb.Logprobs | None, tokens: list[int], vocab_size: int) -> list[TokenLogprob] | None:
    """The logprobs of a result's emitted `tokens`, checked; None for no field."""
    if field is None:
        return None
    values, counts = list(field.logprobs), list(field.top_counts)
    ids, tops = list(field.top_token_ids), list(field.top_logprobs)
    if len(values) != len(tokens) or len(counts) != len(tokens):
        raise WireError(f"logprobs for {len(values)} tokens ({len(counts)} counts), the result emits {len(tokens)}")
    if any(c > MAX_LOGPROBS for c in counts) or len(ids) != sum(counts) or len(tops) != len(ids):
        raise WireError(f"top logprobs of {len(ids)} ids and {len(tops)} values for counts {counts[:8]}")
    if any(not 0 <= i < vocab_size for i in ids):
        raise WireError(f"a top logprob token id outside the vocabulary [0, {vocab_size})")
    if not all(math.isfinite(v) and v <= 0.0 for v in values + tops):
        raise WireError("a log probability that is not a finite number <= 0")
    out, at = [], 0
    for token, value, count in zip(tokens, values, counts):
        out.append(TokenLogprob(token, value, tuple(zip(ids[at: at + count], tops[at: at + count]))))
        at += count
    return out


def decode_link_response(msg: pb.LinkResponse, *, vocab_size: int, feature_dim: int, max_feature_rows: int,
                         feature_data: memoryview | None = None,
                         reader: FeatureReader = FeatureReader()) -> list[StepResult]:
    """The results of a LinkResponse, each with its rows of the features: views of
    `feature_data` where given (`parse_link_response`'s view of them), or of what `reader.to_draft`
    makes of them all. With `reader.packed` the features come packed (`common.feature_wire`: uint8
    [rows, feature_dim + SCALE_BYTES]), else in a floating-point dtype.

    Raises WireError when the message is inconsistent: token ids outside the vocabulary,
    feature rows that do not add up, a feature width or dtype other than expected, or packed
    rows that `reader.to_draft` refuses.
    """
    width = feature_dim + SCALE_BYTES if reader.packed else feature_dim
    features = decode_tensor(msg.features, max_elements=max_feature_rows * max(1, width), data=feature_data)
    if features.dim() != 2 or features.shape[1] != width:
        raise WireError(f"features of shape {list(features.shape)}, expected [rows, {width}]")
    if (features.dtype == torch.uint8) != reader.packed:
        raise WireError(f"features of dtype {msg.features.dtype!r}, expected "
                        f"{'packed rows (uint8)' if reader.packed else 'a floating-point dtype'}")
    if reader.to_draft is not None:
        try:
            features = reader.to_draft(features)
        except ValueError as exc:
            raise WireError(str(exc)) from None
    verified = _verified_results(msg.verified, vocab_size, max_results=max_feature_rows)
    order = _merge_order(verified[-1], len(msg.results), "verified results")
    # Each result's feature rows, in order, then their slices of the features (one split).
    results = iter(msg.results)
    items = [next(results) if not is_column else None for is_column in order] if order else [None] * len(verified[0])
    column_rows = iter(verified[4])
    counts = [next(column_rows) if r is None else _feature_rows(r) for r in items]
    if sum(counts) != features.shape[0]:
        raise WireError(f"{features.shape[0]} feature rows sent, the results use {sum(counts)}")
    rows = features.split_with_sizes(counts)  # (not .split: its Python wrapper costs microseconds)
    columns = iter(list(_verified_outcomes(msg.verified, verified, vocab_size)))  # checked before any result
    out: list[StepResult] = []
    for r, f in zip(items, rows):
        if r is None:
            sid, emitted, bonus, rnd, logprobs = next(columns)
            out.append(StepResult(sid, Verified(emitted, bonus, f, rnd, logprobs)))
            continue
        kind = r.WhichOneof("kind")
        if kind == "prefilled":
            p = r.prefilled
            t = _token(p.token, vocab_size)
            outcome = Prefilled(t, f, p.max_seq_len, _read_logprobs(p.logprobs if p.HasField("logprobs") else None,
                                                                     [t], vocab_size))
        elif kind == "extended":
            outcome = Extended(f)
        elif kind == "error":
            outcome = StatusError(status_name(r.error.code), r.error.message)
        else:
            raise WireError("a result must be prefilled, extended or error (Verified ones travel as columns)")
        out.append(StepResult(r.session_id, outcome))
    return out


def _token(t: int, vocab_size: int) -> int:
    if not 0 <= t < vocab_size:
        raise WireError(f"token id {t} outside the vocabulary [0, {vocab_size})")
    return t


def _feature_rows(r: pb.SessionResult) -> int:
    kind = r.WhichOneof("kind")
    return r.prefilled.feature_rows if kind == "prefilled" else r.extended.feature_rows if kind == "extended" else 0


def _verified_results(msg: pb.VerifiedResults, vocab_size: int, max_results: int) -> list[list[int]]:
    """A reply's Verified columns (`pb.VerifiedResults`: VERIFIED_COLUMNS rows, as lists), checked:
    ids, rounds, counts and rows in range, as many logprobs as flagged, positions increasing."""
    columns = _columns(msg.fields, VERIFIED_COLUMNS, max_count=max_results, what="verified results")
    ids, rounds, accepted, next_tokens, rows, logprobs, _ = columns
    if not ids:
        return columns
    if min(ids) <= 0 or min(rounds) < 0 or max(rounds) > MAX_ROUND or min(accepted) < 0 or (
            max(accepted) > MAX_ACCEPTED):
        raise WireError("verified results with a session id, round or accepted count out of range")
    if min(next_tokens) < 0 or max(next_tokens) >= vocab_size:
        raise WireError(f"a bonus token id outside the vocabulary [0, {vocab_size})")
    if any(r and r != a + 1 for r, a in zip(rows, accepted)):
        raise WireError("a verified result's feature rows are neither 0 nor 1 + its accepted tokens")
    if not set(logprobs) <= {0, 1} or sum(logprobs) != len(msg.logprobs):
        raise WireError(f"{len(msg.logprobs)} logprobs for verified results that flag {sum(logprobs)}")
    return columns


def _verified_outcomes(msg: pb.VerifiedResults, columns: list[list[int]], vocab_size: int
                       ) -> Iterator[tuple[int, list[int], int, int, list[TokenLogprob] | None]]:
    """Each checked Verified column's (session id, accepted tokens, bonus token, round, logprobs);
    WireError when the accepted tokens do not add up or leave the vocabulary."""
    ids, rounds, accepted, next_tokens, _, logprobs, _ = columns
    tokens = _int_array(msg.accepted_tokens, max_count=sum(accepted), what="accepted tokens").tolist()
    if len(tokens) != sum(accepted):
        raise WireError(f"{len(tokens)} accepted tokens, the verified results count {sum(accepted)}")
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab_size):
        raise WireError(f"an accepted token id outside the vocabulary [0, {vocab_size})")
    extra = iter(msg.logprobs)
    at = 0
    for sid, rnd, n, bonus, has_logprobs in zip(ids, rounds, accepted, next_tokens, logprobs):
        emitted = tokens[at: at + n]
        at += n
        lp = _read_logprobs(next(extra), emitted + [bonus], vocab_size) if has_logprobs else None
        yield sid, emitted, bonus, rnd, lp


# Replies from this size on have their features parsed as a view (`parse_link_response`).
VIEW_MIN_BYTES = 1 << 16


def parse_link_response(data: bytes) -> tuple[pb.LinkResponse, memoryview | None]:
    """Parse a serialised LinkResponse without copying its features' data (megabytes per step):
    returns the message without that data and a view of it in `data`. A reply laid out
    otherwise than one `features` field holding one `data` field (protobuf would merge several)
    is parsed whole instead, its features' data left in the message (None), and so is a small
    reply (its copies cost less than finding the field). Raises ValueError as
    `common.rpc.decode_message` does."""
    span = _features_data_span(data) if len(data) >= VIEW_MIN_BYTES else None
    if span is None:
        return decode_message(pb.LinkResponse, data), None
    field_start, sub_start, field_end, data_start, data_end, data_key = span
    rest = data[sub_start:data_key] + data[data_end:field_end]  # the Tensor without its data
    stripped = b"".join([data[:field_start], _varint(_FEATURES_FIELD << 3 | 2), _varint(len(rest)), rest,
                         data[field_end:]])
    return decode_message(pb.LinkResponse, stripped), memoryview(data)[data_start:data_end]


class _Layout(Exception):
    """Wire data `_features_data_span` does not take (malformed, or laid out unusually)."""


def _read_varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 64:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise _Layout


def _field_spans(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(field number, wire type, key start, value start, value end) of each field in data[start:end]."""
    pos = start
    while pos < end:
        key, value_start = _read_varint(data, pos, end)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, value_end = _read_varint(data, value_start, end)
        elif wire_type == 1:
            value_end = value_start + 8
        elif wire_type == 5:
            value_end = value_start + 4
        elif wire_type == 2:
            length, value_start = _read_varint(data, value_start, end)
            value_end = value_start + length
        else:
            raise _Layout
        if number == 0 or value_end > end:
            raise _Layout
        yield number, wire_type, pos, value_start, value_end
        pos = value_end


def _features_data_span(data: bytes) -> tuple[int, int, int, int, int, int] | None:
    """Where a reply's one `features` field and its one `data` field lie: (field key start,
    field value start, field end, data value start, data value end, data key start), or None."""
    try:
        features = [f for f in _field_spans(data, 0, len(data)) if f[0] == _FEATURES_FIELD]
        if len(features) != 1 or features[0][1] != 2:
            return None
        _, _, field_start, sub_start, field_end = features[0]
        fields = [f for f in _field_spans(data, sub_start, field_end) if f[0] == _DATA_FIELD]
        if len(fields) != 1 or fields[0][1] != 2:
            return None
        _, _, data_key, data_start, data_end = fields[0]
    except _Layout:
        return None
    return field_start, sub_start, field_end, data_start, data_end, data_key


def status_code(name: str) -> int:
    """The numeric gRPC status code of a status name (UNKNOWN for an unknown name)."""
    return grpc.StatusCode.__members__.get(name, grpc.StatusCode.UNKNOWN).value[0]


def status_name(code: int) -> str:
    return next((c.name for c in grpc.StatusCode if c.value[0] == code), "UNKNOWN")


def encode_sampling(s: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
    if s.seed is not None:
        msg.seed = s.seed
    for name in _PENALTIES:
        if getattr(s, name) != getattr(_DEFAULT_SAMPLING, name):
            setattr(msg, name, getattr(s, name))
    return msg


_PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")
_DEFAULT_SAMPLING = SamplingParams()


def decode_sampling(msg: pb.SamplingParams) -> SamplingParams:
    """Unset fields take their defaults; the values are checked (ValueError)."""
    s = SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else 0.0,
        top_k=msg.top_k if msg.HasField("top_k") else 0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        **{name: getattr(msg, name) for name in _PENALTIES if msg.HasField(name)},
    )
    s.check()
    return s
