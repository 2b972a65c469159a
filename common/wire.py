"""Conversions between engine messages and protobuf, with validation of what arrives.

Tensors travel as raw little-endian bytes + dtype + shape (never pickled); tree buffers as
packed integers of the narrowest width that holds them, one array per field for all the
trees of a link message; features as one tensor per link message. Every decoder checks
sizes against limits before allocating, and raises `WireError` (a ValueError) with a clear
message, or, for one bad entry of a link message, a per-session error result.
"""
from __future__ import annotations

import math
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


def write_ints(field: pb.PackedInts, values: torch.Tensor | np.ndarray | list[int]) -> None:
    """Signed little-endian integers in the narrowest of 1, 2, 4 or 8 bytes, into a message's field.
    (numpy, not torch: a link message's few hundred integers cost microseconds, not tens of them.)"""
    a = np.asarray(values.cpu().numpy() if isinstance(values, torch.Tensor) else values, dtype=np.int64)
    lo, hi = (int(a.min()), int(a.max())) if a.size else (0, 0)
    width = next(w for w in (1, 2, 4, 8) if -(2 ** (8 * w - 1)) <= lo and hi < 2 ** (8 * w - 1))
    field.data = a.astype(_INT_DTYPES[width]).tobytes()
    field.width = width


def pack_ints(values: torch.Tensor | np.ndarray | list[int]) -> pb.PackedInts:
    msg = pb.PackedInts()
    write_ints(msg, values)
    return msg


def unpack_ints(msg: pb.PackedInts, *, max_count: int, what: str) -> torch.Tensor:
    if msg.width not in _INT_DTYPES:
        raise WireError(f"{what}: integer width {msg.width} is not 1, 2, 4 or 8")
    data = msg.data
    if len(data) % msg.width:
        raise WireError(f"{what}: {len(data)} bytes is not a multiple of width {msg.width}")
    count = len(data) // msg.width
    if count > max_count:
        raise WireError(f"{what}: {count} values exceed the limit of {max_count}")
    return torch.from_numpy(np.frombuffer(data, dtype=_INT_DTYPES[msg.width]).astype(np.int64))


@dataclass(frozen=True)
class LinkLimits:
    """What a verifier accepts in one LinkRequest."""
    max_entries: int      # entries per message
    max_tree_nodes: int   # nodes per tree, root included


MAX_SESSION_ID = 2**63 - 1


def encode_link_request(step: int, entries: Sequence[Entry]) -> pb.LinkRequest:
    """One drafter step as a LinkRequest: the trees' buffers go concatenated, in entry order."""
    msg = pb.LinkRequest(step=step)
    trees = []
    for e in entries:
        if isinstance(e, OpenEntry):
            entry = msg.entries.add(session_id=e.session_id, open=pb.Open(
                prompt_token_ids=e.prompt_ids, sampling=encode_sampling(e.sampling), traceparent=e.traceparent,
                feature_layer_ids=e.feature_layer_ids, more=e.more, bias_token_ids=[b.token for b in e.token_bias],
                bias_values=[b.value for b in e.token_bias], bias_until=[b.until for b in e.token_bias]))
            if e.logprobs is not None:
                entry.open.logprobs = e.logprobs
            if e.output_start != ALWAYS:
                entry.open.output_start = e.output_start
        elif isinstance(e, TreeEntry):  # the fields set in place, as `encode_link_response` does
            tree = msg.entries.add(session_id=e.session_id).tree
            tree.SetInParent()
            tree.round, tree.num_nodes, tree.traceparent = e.round, e.tree.num_nodes, e.traceparent
            trees.append(e.tree)
        elif isinstance(e, ExtendEntry):
            msg.entries.add(session_id=e.session_id, extend=pb.Extend(prompt_token_ids=e.prompt_ids, more=e.more,
                                                                      traceparent=e.traceparent))
        else:
            msg.entries.add(session_id=e.session_id, close=pb.Close())
    if trees:
        for field in ("tokens", "next_token", "next_sibling"):
            write_ints(getattr(msg, f"tree_{field}"), torch.cat([getattr(t, field) for t in trees]))
    return msg


def decode_link_request(msg: pb.LinkRequest, limits: LinkLimits) -> list[Entry | StepResult]:
    """The entries of a LinkRequest, in order. A bad entry becomes a `StepResult` carrying its
    INVALID_ARGUMENT error (that session fails, the others go on); a message that breaks the
    link's limits raises WireError. Tree structure is checked later (`common.tree.walk_trees`)."""
    if len(msg.entries) > limits.max_entries:
        raise WireError(f"a link message carries {len(msg.entries)} entries, the limit is {limits.max_entries}")
    sizes = [e.tree.num_nodes for e in msg.entries if e.WhichOneof("kind") == "tree"]
    total = sum(sizes)
    buffers, framing = None, ""
    try:
        buffers = [unpack_ints(getattr(msg, f"tree_{f}"), max_count=limits.max_entries * limits.max_tree_nodes,
                               what=f"tree_{f}") for f in ("tokens", "next_token", "next_sibling")]
        if any(b.numel() != total for b in buffers):
            framing = (f"tree buffers hold {[b.numel() for b in buffers]} values, the trees' num_nodes add up "
                       f"to {total}")
    except WireError as exc:
        framing = str(exc)
    # Each tree's slices of the three buffers, in entry order (one split per buffer, not one slice per tree).
    pieces = iter(zip(*(b.split(sizes) for b in buffers))) if not framing else None
    out: list[Entry | StepResult] = []
    seen: set[int] = set()
    for e in msg.entries:
        sid, kind = e.session_id, e.WhichOneof("kind")
        tree_buffers = next(pieces) if kind == "tree" and pieces is not None else None
        if not 0 < sid <= MAX_SESSION_ID:
            raise WireError(f"session id {sid} is outside [1, 2^63)")
        if sid in seen:
            out.append(_invalid(sid, "the message carries two entries for this session"))
            continue
        seen.add(sid)
        if kind == "open":
            try:
                sampling = decode_sampling(e.open.sampling)
            except ValueError as exc:
                out.append(_invalid(sid, f"bad sampling parameters: {exc}"))
                continue
            logprobs = e.open.logprobs if e.open.HasField("logprobs") else None
            o = e.open
            counts = {len(o.bias_token_ids), len(o.bias_values), len(o.bias_until)}
            if len(counts) > 1 or max(counts) > MAX_TOKEN_BIAS:
                out.append(_invalid(sid, f"token biases of {len(o.bias_token_ids)} ids, {len(o.bias_values)} values "
                                         f"and {len(o.bias_until)} bounds: at most {MAX_TOKEN_BIAS}, as many of each"))
                continue
            out.append(OpenEntry(sid, list(e.open.prompt_token_ids), sampling, e.open.traceparent,
                                 tuple(e.open.feature_layer_ids), logprobs, e.open.more,
                                 tuple(map(TokenBias, o.bias_token_ids, o.bias_values, o.bias_until)),
                                 o.output_start if o.HasField("output_start") else ALWAYS))
        elif kind == "extend":
            out.append(ExtendEntry(sid, list(e.extend.prompt_token_ids), e.extend.more, e.extend.traceparent))
        elif kind == "tree":
            n = e.tree.num_nodes
            if framing:
                out.append(_invalid(sid, f"malformed tree: {framing}"))
            elif not 1 <= n <= limits.max_tree_nodes:
                out.append(_invalid(sid, f"malformed tree: {n} nodes, expected 1 to {limits.max_tree_nodes}"))
            else:
                tokens, next_token, next_sibling = tree_buffers
                out.append(TreeEntry(sid, e.tree.round, DraftTree(tokens, next_token, next_sibling),
                                     e.tree.traceparent))
        elif kind == "close":
            out.append(CloseEntry(sid))
        else:
            out.append(_invalid(sid, "an entry must be open, extend, tree or close"))
    return out


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
    for r in results:
        o = r.outcome
        # The fields set in place: a third faster than building each result's message and copying
        # it in (32 results a step at 32 sessions).
        if isinstance(o, Prefilled):
            p = msg.results.add(session_id=r.session_id).prefilled
            p.SetInParent()
            p.token, p.max_seq_len, p.feature_rows = o.token, o.max_seq_len, o.features.shape[0]
            _write_logprobs(p, o.logprobs)
            rows.append(o.features)
        elif isinstance(o, Verified):
            v = msg.results.add(session_id=r.session_id).verified
            v.SetInParent()
            v.round, v.next_token, v.feature_rows = o.round, o.next_token, o.features.shape[0]
            v.accepted_tokens.extend(o.accepted_tokens)
            _write_logprobs(v, o.logprobs)
            rows.append(o.features)
        elif isinstance(o, Extended):
            msg.results.add(session_id=r.session_id, extended=pb.Extended(feature_rows=o.features.shape[0]))
            rows.append(o.features)
        else:
            msg.results.add(session_id=r.session_id, error=pb.Error(code=status_code(o.status), message=o.message))
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
    return EncodedReply(data, tuple((r.session_id, r.WhichOneof("kind")) for r in msg.results))


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


def _write_logprobs(result, logprobs: list[TokenLogprob] | None) -> None:
    """Fill a Prefilled's or Verified's `logprobs` field (left unset for None)."""
    if logprobs is None:
        return
    field = result.logprobs
    field.SetInParent()
    field.logprobs[:] = [t.logprob for t in logprobs]
    field.top_counts[:] = [len(t.top) for t in logprobs]
    field.top_token_ids[:] = [i for t in logprobs for i, _ in t.top]
    field.top_logprobs[:] = [v for t in logprobs for _, v in t.top]


def _read_logprobs(result, tokens: list[int], vocab_size: int) -> list[TokenLogprob] | None:
    """The logprobs of a result's emitted `tokens`, checked; None when the field is unset."""
    if not result.HasField("logprobs"):
        return None
    field = result.logprobs
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
    out: list[StepResult] = []
    row = 0

    def take(n: int) -> torch.Tensor:
        nonlocal row
        if row + n > features.shape[0]:
            raise WireError(f"results need more than the {features.shape[0]} feature rows sent")
        row += n
        return features[row - n: row]

    def token(t: int) -> int:
        if not 0 <= t < vocab_size:
            raise WireError(f"token id {t} outside the vocabulary [0, {vocab_size})")
        return t

    for r in msg.results:
        kind = r.WhichOneof("kind")
        if kind == "prefilled":
            p = r.prefilled
            outcome = Prefilled(token(p.token), take(p.feature_rows), p.max_seq_len,
                                _read_logprobs(p, [p.token], vocab_size))
        elif kind == "verified":
            v = r.verified
            accepted = [token(t) for t in v.accepted_tokens]
            if v.feature_rows not in (0, 1 + len(accepted)):
                raise WireError(f"a Verified of {len(accepted)} accepted tokens with {v.feature_rows} feature rows")
            outcome = Verified(accepted, token(v.next_token), take(v.feature_rows), v.round,
                               _read_logprobs(v, accepted + [v.next_token], vocab_size))
        elif kind == "extended":
            outcome = Extended(take(r.extended.feature_rows))
        elif kind == "error":
            outcome = StatusError(status_name(r.error.code), r.error.message)
        else:
            raise WireError("a result must be prefilled, extended, verified or error")
        out.append(StepResult(r.session_id, outcome))
    if row != features.shape[0]:
        raise WireError(f"{features.shape[0]} feature rows sent, the results use {row}")
    return out


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
