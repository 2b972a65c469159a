"""TLS settings of both services and their clients: which PEM files, checked once, turned into
gRPC credentials.

`ServerTls` is a listening side (`--tls-cert`, `--tls-key`, optionally `--tls-client-ca`,
which makes client certificates required and verified: mutual TLS). `ChannelTls` is a dialling
side (a CA to verify the server with, optionally a client certificate and key for mutual TLS,
and a name to expect in the server's certificate when it differs from the address). Both check
their files with the standard `ssl` module (readable, PEM, the key matching the certificate)
so that a mistake is one line at start-up rather than failed handshakes later. Empty settings
mean plaintext.
"""
from __future__ import annotations

import ssl
from dataclasses import dataclass, field

import grpc


class TlsError(ValueError):
    """A TLS setting that cannot work: one line, naming the flag and the file."""


def read_pem(path: str, what: str) -> bytes:
    """The bytes of the PEM file `path` (given as `what`, e.g. "--tls-cert"); TlsError otherwise."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TlsError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise TlsError(f"{what} {path} is not a PEM file")
    return data


def _check_identity(cert: str, key: str, prefix: str) -> None:
    """A certificate and its key, given as {prefix}cert and {prefix}key: both readable PEM files
    that form a pair."""
    read_pem(cert, f"{prefix}cert")
    read_pem(key, f"{prefix}key")
    _check_pair(cert, key, f"{prefix}cert")


def _check_pair(cert: str, key: str, what: str) -> None:
    """The key must be the certificate's (ssl refuses a mismatched or unparsable pair)."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise TlsError(f"{what} {cert} and its key {key} do not form a certificate and its private key "
                       f"({getattr(exc, 'reason', None) or exc})") from None


def _check_ca(path: str, what: str) -> None:
    try:
        ssl.create_default_context(cafile=path)
    except (ssl.SSLError, OSError) as exc:
        raise TlsError(f"{what} {path} holds no usable CA certificate "
                       f"({getattr(exc, 'reason', None) or exc})") from None


@dataclass(frozen=True)
class ServerTls:
    """How a server listens: plaintext (no cert), TLS (cert + key), or mutual TLS (+ client CA)."""
    cert: str = ""       # PEM certificate chain the server presents
    key: str = ""        # its PEM private key
    client_ca: str = ""  # PEM CA bundle; set = clients must present a certificate it signed
    flag_prefix: str = field(default="--tls-", compare=False)  # how the CLI names these settings, for messages

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key or self.client_ca)

    def check(self) -> None:
        """TlsError unless the settings are complete and the files usable."""
        p = self.flag_prefix
        if bool(self.cert) != bool(self.key):
            raise TlsError(f"{p}cert and {p}key go together: give both or neither")
        if self.client_ca and not self.cert:
            raise TlsError(f"{p}client-ca needs {p}cert and {p}key (mutual TLS is TLS first)")
        if not self.enabled:
            return
        _check_identity(self.cert, self.key, p)
        if self.client_ca:
            read_pem(self.client_ca, f"{p}client-ca")
            _check_ca(self.client_ca, f"{p}client-ca")

    def credentials(self) -> grpc.ServerCredentials:
        """Server credentials; with a client CA, client certificates are required and verified."""
        self.check()
        p = self.flag_prefix
        pair = [(read_pem(self.key, f"{p}key"), read_pem(self.cert, f"{p}cert"))]
        if not self.client_ca:
            return grpc.ssl_server_credentials(pair)
        return grpc.ssl_server_credentials(pair, root_certificates=read_pem(self.client_ca, f"{p}client-ca"),
                                           require_client_auth=True)


@dataclass(frozen=True)
class ChannelTls:
    """How a client dials: plaintext (no CA), TLS verified against `ca`, or mutual TLS (+ cert, key)."""
    ca: str = ""           # PEM CA bundle that signed the server's certificate
    cert: str = ""         # client certificate chain, for servers that require one
    key: str = ""          # its private key
    server_name: str = ""  # name expected in the server's certificate ("" = the address's host)
    # How the CLI names these settings, for messages: "--" (client) or "--verifier-" (drafter).
    flag_prefix: str = field(default="--", compare=False)

    @property
    def enabled(self) -> bool:
        return bool(self.ca or self.cert or self.key or self.server_name)

    def check(self) -> None:
        """TlsError unless the settings are complete and the files usable."""
        p = self.flag_prefix
        if bool(self.cert) != bool(self.key):
            raise TlsError(f"{p}cert and {p}key go together: give both or neither")
        if self.enabled and not self.ca:
            raise TlsError(f"{p}cert, {p}key and {p}server-name need {p}ca (the CA that signed the server)")
        if not self.enabled:
            return
        read_pem(self.ca, f"{p}ca")
        _check_ca(self.ca, f"{p}ca")
        if self.cert:
            _check_identity(self.cert, self.key, p)

    def credentials(self) -> grpc.ChannelCredentials:
        self.check()
        p = self.flag_prefix
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca, f"{p}ca"),
            private_key=read_pem(self.key, f"{p}key") if self.key else None,
            certificate_chain=read_pem(self.cert, f"{p}cert") if self.cert else None)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def open_channel(address: str, tls: ChannelTls | None = None, options=()) -> grpc.Channel:
    """A blocking channel to `address`: secure when `tls` is enabled, plaintext otherwise."""
    if tls is None or not tls.enabled:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.credentials(), options=[*options, *tls.channel_options()])
