"""TLS, mutual TLS and the API key, on both services over loopback with the shipped pair.

A throwaway PKI is made at test time: CA "A" signs the servers' certificate (SAN localhost and
127.0.0.1) and the clients' certificate; CA "B" signs look-alikes that must be refused. The
verifier and one drafter speak mutual TLS (the drafter's link too); another drafter speaks TLS
without client certificates and asks for an API key.
"""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

import drafter_svc.__main__ as drafter_cli
import verifier_svc.__main__ as verifier_cli
from common.config import load_draft_config
from common.protocol import StatusError
from common.rpc import CHANNEL_OPTIONS, GENERATION_SERVICE, pb, pb_grpc
from common.tls import ChannelTls, ServerTls, TlsError, open_channel
from drafter_svc import client as client_cli
from drafter_svc.server import DrafterConfig, DrafterEngine
from drafter_svc.server import serve as serve_drafter
from tests.servers import ServerThread
from verifier_svc.server import VerifierConfig
from verifier_svc.server import serve as serve_verifier

SHIPPED = Path(__file__).resolve().parent.parent / "models" / "default"
TARGET, DRAFT = str(SHIPPED / "target"), str(SHIPPED / "draft")
API_KEY = "k3y-for-tests"
PROMPT = pb.GenerateRequest(text="def fibonacci(n):", max_new_tokens=12)
TIMEOUT = 60


# -- a throwaway PKI -------------------------------------------------------------------------

@dataclass(frozen=True)
class Pki:
    """PEM file paths of one CA and the certificates it signed."""
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, cert: x509.Certificate, key) -> tuple[str, str]:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return str(path.with_suffix(".crt")), str(path.with_suffix(".key"))


def _issue(cn: str, ca_cert, ca_key, usage, sans=()) -> tuple[x509.Certificate, object]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def make_pki(folder: Path, label: str) -> Pki:
    """A CA, a server certificate for localhost / 127.0.0.1 and a client certificate."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    ca_cert = (x509.CertificateBuilder().subject_name(_name(f"test CA {label}")).issuer_name(_name(f"test CA {label}"))
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, encipher_only=False, decipher_only=False),
                              critical=True)
               .sign(ca_key, hashes.SHA256()))
    ca, _ = _write(folder / "ca", ca_cert, ca_key)
    sans = (x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    server = _write(folder / "server", *_issue("server", ca_cert, ca_key, ExtendedKeyUsageOID.SERVER_AUTH, sans))
    client = _write(folder / "client", *_issue("client", ca_cert, ca_key, ExtendedKeyUsageOID.CLIENT_AUTH))
    return Pki(ca, *server, *client)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki") / "a", "A")


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki") / "b", "B")


def mutual(pki: Pki) -> ServerTls:
    return ServerTls(cert=pki.server_cert, key=pki.server_key, client_ca=pki.ca)


def client_tls(pki: Pki, *, ca: str | None = None, with_cert: bool = True, server_name: str = "") -> ChannelTls:
    return ChannelTls(ca=ca or pki.ca, cert=pki.client_cert if with_cert else "",
                      key=pki.client_key if with_cert else "", server_name=server_name)


# -- servers ---------------------------------------------------------------------------------

def verifier_config(**changes) -> VerifierConfig:
    fields = dict(target_dir=TARGET, feature_layer_ids=load_draft_config(DRAFT).target_layer_ids,
                  projection_dir=DRAFT, host="127.0.0.1", port=0, max_sessions=4, max_seq_len=256,
                  max_tree_nodes=33)
    return VerifierConfig(**(fields | changes))


def drafter_config(verifier_port: int, **changes) -> DrafterConfig:
    fields = dict(draft_dir=DRAFT, target_dir=TARGET, verifier=f"127.0.0.1:{verifier_port}", host="127.0.0.1",
                  port=0, tree_budget=8, max_new_tokens=12, verifier_wait_s=10)
    return DrafterConfig(**(fields | changes))


def run_drafter(cfg: DrafterConfig) -> ServerThread:
    engine = DrafterEngine.start(cfg, torch.float32)
    return ServerThread(lambda: serve_drafter(engine, cfg.host, cfg.port))


@pytest.fixture(scope="module")
def tls_verifier(pki):
    with ServerThread(lambda: serve_verifier(verifier_config(tls=mutual(pki)))) as running:
        yield running


@pytest.fixture(scope="module")
def tls_drafter(pki, tls_verifier):
    """Mutual TLS on the public port and on the link."""
    cfg = drafter_config(tls_verifier.port, tls=mutual(pki), verifier_tls=client_tls(pki))
    with run_drafter(cfg) as running:
        yield running


@pytest.fixture(scope="module")
def key_drafter(pki, tls_verifier):
    """TLS without client certificates on the public port, an API key, mutual TLS on the link."""
    cfg = drafter_config(tls_verifier.port, tls=ServerTls(cert=pki.server_cert, key=pki.server_key),
                         verifier_tls=client_tls(pki), api_key=API_KEY)
    with run_drafter(cfg) as running:
        yield running


def generate(port: int, tls: ChannelTls | None, metadata=()) -> list[int]:
    with open_channel(f"127.0.0.1:{port}", tls, CHANNEL_OPTIONS) as channel:
        reply = pb_grpc.GenerationStub(channel).GenerateOnce(PROMPT, timeout=TIMEOUT, metadata=metadata)
    assert reply.final.usage.completion_tokens == len(reply.token_ids) > 0
    return list(reply.token_ids)


def refused(port: int, tls: ChannelTls | None) -> grpc.RpcError:
    """The error of a health check (open on every server) that must fail at the handshake."""
    with open_channel(f"127.0.0.1:{port}", tls, CHANNEL_OPTIONS) as channel, pytest.raises(grpc.RpcError) as caught:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return caught.value


# -- both hops over mutual TLS ---------------------------------------------------------------

def test_generation_over_mutual_tls_equals_plaintext(pki, tls_drafter):
    with ServerThread(lambda: serve_verifier(verifier_config())) as verifier, \
            run_drafter(drafter_config(verifier.port)) as drafter:
        plain = generate(drafter.port, None)
    assert generate(tls_drafter.port, client_tls(pki)) == plain


def test_client_cli_over_mutual_tls(pki, tls_drafter, capsys):
    client_cli.main(["--server", f"127.0.0.1:{tls_drafter.port}", "--ca", pki.ca, "--cert", pki.client_cert,
                     "--key", pki.client_key, "--max-new-tokens", "12", "--json", "def fibonacci(n):"])
    assert '"completion_tokens": 12' in capsys.readouterr().out


@pytest.mark.parametrize("server", ["verifier", "drafter"])
def test_plaintext_client_is_refused(server, tls_verifier, tls_drafter):
    port = tls_verifier.port if server == "verifier" else tls_drafter.port
    assert refused(port, None).code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("server", ["verifier", "drafter"])
def test_client_certificate_from_another_ca_is_refused(server, pki, other_pki, tls_verifier, tls_drafter):
    port = tls_verifier.port if server == "verifier" else tls_drafter.port
    # It trusts the right CA, but presents a certificate that CA never signed.
    impostor = ChannelTls(ca=pki.ca, cert=other_pki.client_cert, key=other_pki.client_key)
    assert refused(port, impostor).code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("server", ["verifier", "drafter"])
def test_client_without_certificate_is_refused_when_a_client_ca_is_set(server, pki, tls_verifier, tls_drafter):
    port = tls_verifier.port if server == "verifier" else tls_drafter.port
    assert refused(port, client_tls(pki, with_cert=False)).code() == grpc.StatusCode.UNAVAILABLE


def test_server_certificate_from_another_ca_is_refused_by_clients(other_pki, tls_verifier):
    assert refused(tls_verifier.port, client_tls(other_pki)).code() == grpc.StatusCode.UNAVAILABLE


def test_server_name_override(pki, tls_verifier):
    """--verifier-server-name: the name checked in the certificate instead of the address's host."""
    with open_channel(f"127.0.0.1:{tls_verifier.port}", client_tls(pki, server_name="localhost"),
                      CHANNEL_OPTIONS) as channel:
        assert pb_grpc.VerifierStub(channel).Info(pb.InfoRequest(), timeout=10).vocab_size > 0
    wrong = client_tls(pki, server_name="elsewhere.example")
    assert refused(tls_verifier.port, wrong).code() == grpc.StatusCode.UNAVAILABLE


def test_drafter_refuses_a_verifier_certificate_from_another_ca(other_pki, tls_verifier):
    cfg = drafter_config(tls_verifier.port, verifier_tls=client_tls(other_pki), verifier_wait_s=0.5)
    with pytest.raises(StatusError) as caught:
        DrafterEngine.start(cfg, torch.float32)
    assert caught.value.status == "UNAVAILABLE"
    message = caught.value.message
    assert "did not answer" in message and "\n" not in message
    assert "handshake" in message.lower()  # the reason, not just a passed deadline


# -- the API key -----------------------------------------------------------------------------

def test_api_key_required(pki, key_drafter):
    tls = client_tls(pki, with_cert=False)  # TLS without a client certificate is enough here
    for metadata, reason in [((), "missing API key"), ((("authorization", "Bearer wrong"),), "invalid API key"),
                             ((("authorization", API_KEY),), "invalid API key")]:
        with open_channel(f"127.0.0.1:{key_drafter.port}", tls, CHANNEL_OPTIONS) as channel:
            stub = pb_grpc.GenerationStub(channel)
            for call in (stub.GenerateOnce, lambda *args, **kwargs: list(stub.Generate(*args, **kwargs))):  # noqa: B023
                with pytest.raises(grpc.RpcError) as caught:
                    call(PROMPT, timeout=TIMEOUT, metadata=metadata)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert reason in caught.value.details() and "\n" not in caught.value.details()


def test_right_api_key_works_and_health_needs_none(pki, key_drafter, capsys):
    tls = client_tls(pki, with_cert=False)
    tokens = generate(key_drafter.port, tls, metadata=(("authorization", f"Bearer {API_KEY}"),))
    assert len(tokens) == 12
    with open_channel(f"127.0.0.1:{key_drafter.port}", tls, CHANNEL_OPTIONS) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", GENERATION_SERVICE):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    client_cli.main(["--server", f"127.0.0.1:{key_drafter.port}", "--ca", pki.ca, "--api-key", API_KEY,
                     "--max-new-tokens", "12", "--json", "def fibonacci(n):"])
    assert '"completion_tokens": 12' in capsys.readouterr().out


# -- start-up errors: one line each ----------------------------------------------------------

def one_line_failure(parse, argv, capsys) -> str:
    with pytest.raises(SystemExit) as caught:
        parse(argv)
    assert caught.value.code != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_start_up_errors_are_one_line(pki, other_pki, tmp_path, capsys):
    missing = str(tmp_path / "missing.pem")
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    base = ["--target", TARGET]
    for argv, needle in [
        (["--tls-cert", pki.server_cert], "--tls-cert and --tls-key go together"),
        (["--tls-key", pki.server_key], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", pki.ca], "--tls-client-ca needs --tls-cert"),
        (["--tls-cert", missing, "--tls-key", pki.server_key], "cannot read --tls-cert"),
        (["--tls-cert", str(not_pem), "--tls-key", pki.server_key], "is not a PEM file"),
        (["--tls-cert", pki.server_cert, "--tls-key", other_pki.server_key], "do not form a certificate"),
        (["--tls-cert", pki.server_cert, "--tls-key", pki.server_key, "--tls-client-ca", missing],
         "cannot read --tls-client-ca"),
    ]:
        assert needle in one_line_failure(verifier_cli.parse_config, base + argv, capsys)
    base = ["--draft", DRAFT, "--target", TARGET]
    for argv, needle in [
        (["--tls-key", pki.server_key], "--tls-cert and --tls-key go together"),
        (["--verifier-cert", pki.client_cert, "--verifier-key", pki.client_key], "need --verifier-ca"),
        (["--verifier-ca", pki.ca, "--verifier-cert", pki.client_cert], "go together"),
        (["--verifier-ca", missing], "cannot read --verifier-ca"),
        (["--verifier-ca", pki.ca, "--verifier-cert", pki.client_cert, "--verifier-key", pki.server_key],
         "do not form a certificate"),
        (["--api-key", "x", "--api-key-file", missing], "not both"),
        (["--api-key-file", missing], "cannot read the API key file"),
        (["--api-key", "has space"], "printable ASCII"),
    ]:
        assert needle in one_line_failure(drafter_cli.parse_args, base + argv, capsys)
    assert "need --ca" in one_line_failure(client_cli.parse_args, ["--cert", pki.client_cert, "--key",
                                                                   pki.client_key, "hi"], capsys)


def test_settings_from_the_environment(pki, tmp_path, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_text(API_KEY + "\n")
    for name, value in [("VERIFIER_TLS_CERT", pki.server_cert), ("VERIFIER_TLS_KEY", pki.server_key),
                        ("VERIFIER_TLS_CLIENT_CA", pki.ca), ("DRAFTER_VERIFIER_CA", pki.ca),
                        ("DRAFTER_VERIFIER_CERT", pki.client_cert), ("DRAFTER_VERIFIER_KEY", pki.client_key),
                        ("DRAFTER_VERIFIER_SERVER_NAME", "localhost"), ("DRAFTER_API_KEY_FILE", str(key_file))]:
        monkeypatch.setenv(name, value)
    assert verifier_cli.parse_config(["--target", TARGET]).tls == mutual(pki)
    cfg = drafter_cli.parse_args(["--draft", DRAFT, "--target", TARGET])
    assert cfg.verifier_tls == client_tls(pki, server_name="localhost") and cfg.api_key == API_KEY
    assert API_KEY not in repr(cfg)
    assert not cfg.tls.enabled


def test_unreadable_files_at_serve_time_are_one_line(pki, tmp_path):
    with pytest.raises(TlsError, match="cannot read --tls-cert"):
        ServerTls(cert=str(tmp_path / "gone.crt"), key=pki.server_key).credentials()
