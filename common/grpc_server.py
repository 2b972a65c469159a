"""Starting a grpc.aio server the way both services do: a cap on inbound messages, no
SO_REUSEPORT, keepalive permits, requests handed to the servicers unparsed, the standard
health service and server reflection; TLS or mutual TLS when given (`common.tls.ServerTls`),
and interceptors (e.g. `common.auth.ApiKeyInterceptor`)."""
from __future__ import annotations

import os
import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2

from common.rpc import KEEPALIVE_OPTIONS, pb
from common.tls import ServerTls

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REFLECTION_SERVICES = ("grpc.reflection.v1.ServerReflection", reflection.SERVICE_NAME)
MIB = 1 << 20

_HANDLERS = {  # (client streaming, server streaming) -> handler factory
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def listen_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def bind_error_reason(exc: OSError) -> str:
    """Why a bind failed, as the OS says it ("address already in use"), without the wrapper text
    asyncio adds ("error while attempting to bind on address ...")."""
    return os.strerror(exc.errno).lower() if exc.errno else str(exc)


def check_bindable(host: str, port: int) -> None:
    """Raise OSError with the reason (``address already in use``, a name that does not resolve)
    when no address of `host` can take `port`. gRPC binds the same addresses and succeeds when
    one of them binds, but says why it failed only in a log line of its own; this check runs
    first so that the usual mistakes end in one line. (A port taken between the two still fails
    in `start_grpc_server`.)"""
    if port == 0:
        return
    address = listen_address(host, port)
    try:
        resolved = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM,
                                      flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot listen on {address}: {(e.strerror or str(e)).lower()}") from None
    reasons = []
    for family, kind, proto, _, sockaddr in resolved:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's listeners
            try:
                probe.bind(sockaddr)
                return
            except OSError as e:
                reasons.append(bind_error_reason(e))
    raise OSError(f"cannot listen on {address}: {', '.join(dict.fromkeys(reasons))}")


def server_options(max_receive_bytes: int) -> list[tuple[str, int]]:
    """A server's options: larger inbound messages get RESOURCE_EXHAUSTED (from gRPC itself);
    outbound ones are not capped (the verifier's replies carry features); and no SO_REUSEPORT,
    which would let a second server share a busy port, the kernel splitting new connections
    between the two."""
    return [("grpc.max_receive_message_length", max_receive_bytes), ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", 0), *KEEPALIVE_OPTIONS]


def _serialize(reply) -> bytes:
    """A reply message, or one the servicer serialised itself (the verifier's link replies)."""
    return reply if isinstance(reply, bytes) else reply.SerializeToString()


def add_raw_servicer(server: grpc.aio.Server, service_name: str, servicer) -> None:
    """Register `servicer`'s methods for the ddtree service `service_name`, its requests
    handed over as bytes: the servicer parses them (`common.rpc.decode_message`), so that a
    malformed one gets INVALID_ARGUMENT with one line. (gRPC's own parse would answer UNKNOWN,
    or fail a stream's read, and log a traceback.)"""
    service = pb.DESCRIPTOR.services_by_name[service_name.rsplit(".", 1)[-1]]
    handlers = {}
    for method in service.methods:
        make = _HANDLERS[method.client_streaming, method.server_streaming]
        handlers[method.name] = make(getattr(servicer, method.name), response_serializer=_serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def add_reflection(server: grpc.aio.Server, service_names: tuple[str, ...]) -> None:
    """Server reflection under both `grpc.reflection.v1` (what current grpcurl and Postman ask
    for) and `grpc.reflection.v1alpha`: the two protocols have identical messages, so the one
    servicer the reflection package ships (v1alpha) answers both."""
    names = (*service_names, *REFLECTION_SERVICES)
    handler = grpc.stream_stream_rpc_method_handler(
        reflection.aio.ReflectionServicer(names).ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    for service in REFLECTION_SERVICES:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            service, {"ServerReflectionInfo": handler}),))


async def start_grpc_server(servicer, service_name: str, host: str, port: int, max_receive_bytes: int,
                            tls: ServerTls | None = None, interceptors: tuple = ()
                            ) -> tuple[grpc.aio.Server, int, health_aio.HealthServicer]:
    """Create, bind and start a server for `servicer` (see `add_raw_servicer`). Returns
    (server, bound port, health).

    With `tls` enabled the port speaks TLS only (mutual TLS when it has a client CA). Health
    reports SERVING for "" and `service_name` once the server is started. Raises OSError when
    the address cannot be bound (in use, or not an address of this host), `common.tls.TlsError`
    (a ValueError) when the TLS files are unusable.
    """
    credentials = tls.credentials() if tls is not None and tls.enabled else None  # checked before binding
    check_bindable(host, port)
    server = grpc.aio.server(options=server_options(max_receive_bytes), interceptors=list(interceptors) or None)
    add_raw_servicer(server, service_name, servicer)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    add_reflection(server, (service_name, HEALTH_SERVICE))
    address = listen_address(host, port)
    try:
        bound = (server.add_secure_port(address, credentials) if credentials is not None
                 else server.add_insecure_port(address))
    except RuntimeError:  # newer grpcio raises instead of returning 0
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {address}: address in use, or not an address of this host")
    await server.start()
    for service in ("", service_name):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health
