#!/usr/bin/env python3
"""Ask a gRPC server for its health (grpc.health.v1.Health/Check); for container healthchecks.

    python scripts/grpc_health_probe.py --addr HOST:PORT [--service NAME] [--timeout S]
        [--ca FILE [--cert FILE --key FILE] [--server-name NAME]]

`--ca` dials TLS, verifying the server against that CA; `--cert`/`--key` present a client
certificate (for servers started with a client CA: mutual TLS); `--server-name` is the name
expected in the server's certificate when the address is not it (e.g. 127.0.0.1).

Exit status 0 when the server answers SERVING, 1 otherwise (cannot connect, deadline passed,
unknown service, NOT_SERVING, bad arguments). Docker reserves exit status 2, so this never
uses it. Prints one line either way. Needs only grpcio and grpcio-health-checking, which the
project depends on; no extra binary in the image.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

OK, FAIL = 0, 1


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse exits 2 by default; Docker reserves 2
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(FAIL)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--addr", required=True, help="server address, HOST:PORT")
    p.add_argument("--service", default="",
                   help="service name to ask about (default: '', the whole server)")
    p.add_argument("--timeout", type=float, default=3.0,
                   help="deadline for the whole check in seconds (default 3)")
    p.add_argument("--ca", default="", help="PEM CA bundle: dial TLS and verify the server with it")
    p.add_argument("--cert", default="", help="PEM client certificate, for mutual TLS (with --key)")
    p.add_argument("--key", default="", help="PEM private key of --cert")
    p.add_argument("--server-name", default="", help="name expected in the server's certificate")
    args = p.parse_args(argv)
    if args.timeout <= 0:
        p.error("--timeout must be > 0")
    if bool(args.cert) != bool(args.key) or ((args.cert or args.server_name) and not args.ca):
        p.error("--cert and --key go together, and they and --server-name need --ca")
    return args


def open_channel(grpc, args: argparse.Namespace):
    """Plaintext, or TLS (mutual with --cert/--key) when --ca is given; OSError if a file is unreadable."""
    if not args.ca:
        return grpc.insecure_channel(args.addr)
    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()
    credentials = grpc.ssl_channel_credentials(read(args.ca), read(args.key) if args.key else None,
                                               read(args.cert) if args.cert else None)
    options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
    return grpc.secure_channel(args.addr, credentials, options=options)


def probe(addr: str, service: str, timeout: float, args: argparse.Namespace | None = None) -> tuple[int, str]:
    """Return (exit status, one-line message)."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # keep grpc's own logging off the line
    try:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
    except ImportError as exc:
        return FAIL, f"error: cannot import grpc health stubs: {exc}"

    what = f"{addr} service={service!r}"
    deadline = time.monotonic() + timeout
    try:
        channel = open_channel(grpc, args) if args is not None else grpc.insecure_channel(addr)
        with channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=timeout)
            except grpc.FutureTimeoutError:
                return FAIL, f"UNHEALTHY {what}: cannot connect within {timeout:g}s"
            left = max(deadline - time.monotonic(), 0.05)
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=left)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        name = code.name if code is not None else "UNKNOWN"
        detail = (exc.details() if hasattr(exc, "details") else "") or ""
        detail = " ".join(detail.split())[:200]
        if code == grpc.StatusCode.NOT_FOUND:
            return FAIL, f"UNHEALTHY {what}: service not registered with the health server"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return FAIL, f"UNHEALTHY {what}: no answer within {timeout:g}s ({detail or name})"
        return FAIL, f"UNHEALTHY {what}: {name} {detail}".rstrip()
    except Exception as exc:  # e.g. a malformed address
        return FAIL, f"UNHEALTHY {what}: {type(exc).__name__}: {exc}"

    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        return OK, f"SERVING {what}"
    return FAIL, f"UNHEALTHY {what}: {status}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code, message = probe(args.addr, args.service, args.timeout, args)
    print(message, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
