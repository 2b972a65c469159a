"""The generated protobuf / gRPC modules of protos/ddtree/v1/ddtree.proto.

The generated code (common/gen, committed) imports itself as `ddtree.v1`, so its folder
goes on sys.path once, here; everything else imports `pb` and `pb_grpc` from this module.
"""
import sys
from pathlib import Path

_GEN = str(Path(__file__).resolve().parent / "gen")
if _GEN not in sys.path:
    sys.path.insert(0, _GEN)

from ddtree.v1 import ddtree_pb2 as pb  # noqa: E402
from ddtree.v1 import ddtree_pb2_grpc as pb_grpc  # noqa: E402

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
VERIFIER_SERVICE = pb.DESCRIPTOR.services_by_name["Verifier"].full_name

# No 4 MiB cap: a long prompt's features come back in one Prefilled message.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]

__all__ = ["pb", "pb_grpc", "GENERATION_SERVICE", "VERIFIER_SERVICE", "CHANNEL_OPTIONS"]
