"""The generated protobuf / gRPC modules of protos/ddtree/v1/ddtree.proto, and channel settings.

The generated code is the package `common.gen.ddtree.v1` (committed; scripts/gen_protos.py
rewrites its imports to that package, so it needs no sys.path edit). Everything else imports
`pb` and `pb_grpc` from this module.
"""
from google.protobuf.message import DecodeError

from common.gen.ddtree.v1 import ddtree_pb2 as pb
from common.gen.ddtree.v1 import ddtree_pb2_grpc as pb_grpc

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
VERIFIER_SERVICE = pb.DESCRIPTOR.services_by_name["Verifier"].full_name

KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]

# Clients (the drafter's link to the verifier included) neither send nor receive with a cap:
# a long prompt's features come back in one Prefilled message, and what a client sends is
# capped by the server that receives it (`common.grpc_server.server_options`), which answers
# RESOURCE_EXHAUSTED past its cap. The drafter's link messages stay under the verifier's cap
# by construction: it refuses prompts of max_seq_len tokens or more, and trees past max_tree_nodes.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    *KEEPALIVE_OPTIONS,
]


def decode_message(message_class, data: bytes):
    """Parse `data` as a `message_class`; ValueError with a one-line message when it is not
    one (corrupt wire format, invalid UTF-8 in a string field)."""
    try:
        return message_class.FromString(data)
    except DecodeError as exc:  # upb says "Error parsing message with type 'ddtree.v1.X': <reason>"
        reason = str(exc).rsplit("': ", 1)[-1] or "cannot be parsed"
        raise ValueError(f"malformed {message_class.DESCRIPTOR.name}: {reason}") from None


__all__ = ["pb", "pb_grpc", "GENERATION_SERVICE", "VERIFIER_SERVICE", "CHANNEL_OPTIONS", "KEEPALIVE_OPTIONS",
           "decode_message"]
