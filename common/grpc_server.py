"""Starting a grpc.aio server the way both services do: no message-size cap, keepalive
permits, the standard health service and server reflection."""
from __future__ import annotations

from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from common.rpc import CHANNEL_OPTIONS

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


def listen_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


async def start_grpc_server(register: Callable[[grpc.aio.Server], None], service_name: str, host: str,
                            port: int) -> tuple[grpc.aio.Server, int, health_aio.HealthServicer]:
    """Create, bind and start a server; `register` adds the servicers. Returns (server, bound port, health).

    Health reports SERVING for "" and `service_name` once the server is started. Raises
    OSError when the address cannot be bound.
    """
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    register(server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection((service_name, HEALTH_SERVICE, reflection.SERVICE_NAME), server)
    address = listen_address(host, port)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError:  # newer grpcio raises instead of returning 0
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {address} (address in use or not local?)")
    await server.start()
    for service in ("", service_name):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health
