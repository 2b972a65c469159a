"""An optional API key on a gRPC service: calls must carry `authorization: Bearer <key>`.

`ApiKeyInterceptor` guards the methods of the services it is given (the drafter passes the
public Generation API) and leaves the others open, so health checks and reflection answer
without a key. A call without the header, or with another key, ends with UNAUTHENTICATED and
one line; the servicers never see it. Keys are compared in constant time (`hmac.compare_digest`).
`read_api_key` loads a key from a file, so that it need not sit on a command line.
"""
from __future__ import annotations

import hmac
from collections.abc import Iterable

import grpc

AUTH_HEADER = "authorization"
SCHEME = "bearer"


class ApiKeyError(ValueError):
    """An API key setting that cannot work (one line)."""


def read_api_key(path: str) -> str:
    """The key in `path` (surrounding whitespace stripped); ApiKeyError when unreadable or empty."""
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ApiKeyError(f"cannot read the API key file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not key:
        raise ApiKeyError(f"the API key file {path} is empty")
    return key


def check_api_key(key: str) -> None:
    """ApiKeyError unless `key` can travel in a header: printable ASCII without spaces."""
    if not key or not all(33 <= ord(c) < 127 for c in key):
        raise ApiKeyError("the API key must be non-empty printable ASCII without spaces")


def bearer_metadata(key: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that presents `key` (for clients)."""
    return ((AUTH_HEADER, f"Bearer {key}"),) if key else ()


def presents_key(header: str | None, key: str) -> bool:
    """Whether an `authorization` header value is `Bearer <key>` (scheme case-insensitive)."""
    if not header:
        return False
    scheme, _, given = header.strip().partition(" ")
    if scheme.lower() != SCHEME:
        return False
    return hmac.compare_digest(given.strip().encode("utf-8", "replace"), key.encode("utf-8"))


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with UNAUTHENTICATED."""
    async def refuse(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # an async generator, as streaming replies need

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream)
    return grpc.unary_unary_rpc_method_handler(refuse)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <key>` on every method of `services` (full names)."""

    def __init__(self, key: str, services: Iterable[str]):
        check_api_key(key)
        self._key = key
        self._prefixes = tuple(f"/{name}/" for name in services)

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or not method.startswith(self._prefixes):
            return handler
        header = next((v for k, v in handler_call_details.invocation_metadata or () if k == AUTH_HEADER), None)
        if isinstance(header, bytes):
            header = header.decode("latin-1")
        if presents_key(header, self._key):
            return handler
        reason = "missing API key" if header is None else "invalid API key"
        return _refusal(handler, f"{reason}: send metadata 'authorization: Bearer <key>'")
