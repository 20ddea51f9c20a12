"""TLS, mutual TLS and API keys with the services as real processes on loopback."""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.client import GatewayClient
from specdec.rpc.security import key_is_valid, presented_key
from tests.harness import Stack, start_service

API_KEY = "s3cret-key"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, key, cert) -> None:
    path.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def make_pki(directory: Path, ca_name: str = "specdec-test-ca") -> Path:
    """A CA and one certificate (server + client usage, SAN localhost/127.0.0.1) signed by it."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (x509.CertificateBuilder().subject_name(_name(ca_name)).issuer_name(_name(ca_name))
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .sign(ca_key, hashes.SHA256()))
    _write(directory / "ca", ca_key, ca_cert)
    key = ec.generate_private_key(ec.SECP256R1())
    import ipaddress

    cert = (x509.CertificateBuilder().subject_name(_name("specdec")).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH,
                                                  x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write(directory / "service", key, cert)
    return directory


def wait_serving_tls(address: str, pki: Path, proc, timeout: float = 120) -> None:
    credentials = grpc.ssl_channel_credentials((pki / "ca.crt").read_bytes(), (pki / "service.key").read_bytes(),
                                               (pki / "service.crt").read_bytes())
    deadline = time.monotonic() + timeout
    with grpc.secure_channel(address, credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert proc.poll() is None, "service exited"
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(address)


@pytest.fixture(scope="module")
def secure_stack(tiny_pair, tmp_path_factory):
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    logs = tmp_path_factory.mktemp("logs")
    tls = ["--tls-cert", str(pki / "service.crt"), "--tls-key", str(pki / "service.key"),
           "--tls-ca", str(pki / "ca.crt"), "--tls-client-auth"]
    verifier = start_service("verifier", ["--target", str(tiny_pair[1]), *tls], logs)
    drafter = start_service("drafter", ["--method", "model", "--draft-model", str(tiny_pair[2]), *tls], logs)
    gateway = start_service("gateway", ["--target", str(tiny_pair[1]), "--verifier", verifier.address,
                                        "--drafter", drafter.address, *tls], logs,
                            env={"SPECDEC_API_KEYS": API_KEY})
    stack = Stack(gateway, [verifier], [drafter])
    try:
        for service in stack.all:
            wait_serving_tls(service.address, pki, service.proc)
        yield stack, pki
    finally:
        stack.stop()


def client(stack, pki, **overrides) -> GatewayClient:
    kwargs = dict(api_key=API_KEY, tls_ca=str(pki / "ca.crt"), tls_cert=str(pki / "service.crt"),
                  tls_key=str(pki / "service.key"))
    kwargs.update(overrides)
    return GatewayClient(stack.gateway.address.replace("127.0.0.1", "localhost"), timeout=30, **kwargs)


def test_mtls_and_api_key_end_to_end(secure_stack):
    stack, pki = secure_stack
    with client(stack, pki) as c:
        result = c.generate(prompt="the quick", max_new_tokens=12, ignore_eos=True, method="model", num_draft_tokens=2)
    assert len(result.token_ids) == 12 and result.stats["draft_method"] == "model"


def test_client_without_certificate_is_refused(secure_stack):
    stack, pki = secure_stack
    with client(stack, pki, tls_cert=None, tls_key=None) as c:
        with pytest.raises(grpc.RpcError) as info:
            c.generate(prompt="x", max_new_tokens=2)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # the TLS handshake fails


def test_client_with_a_foreign_ca_certificate_is_refused(secure_stack, tmp_path):
    stack, pki = secure_stack
    foreign = make_pki(tmp_path, ca_name="someone-else")
    with client(stack, pki, tls_cert=str(foreign / "service.crt"), tls_key=str(foreign / "service.key")) as c:
        with pytest.raises(grpc.RpcError) as info:
            c.generate(prompt="x", max_new_tokens=2)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_plaintext_client_is_refused(secure_stack):
    stack, _ = secure_stack
    with GatewayClient(stack.gateway.address, timeout=10, api_key=API_KEY) as c:
        with pytest.raises(grpc.RpcError) as info:
            c.generate(prompt="x", max_new_tokens=2)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("api_key", [None, "wrong", API_KEY + "x", ""])
def test_wrong_or_missing_api_key_is_unauthenticated(secure_stack, api_key):
    stack, pki = secure_stack
    with client(stack, pki, api_key=api_key) as c:
        with pytest.raises(grpc.RpcError) as info:
            c.generate(prompt="x", max_new_tokens=2)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_internal_services_refuse_clients_without_certificates(secure_stack):
    from specdec.v1 import verifier_pb2, verifier_pb2_grpc

    stack, pki = secure_stack
    credentials = grpc.ssl_channel_credentials((pki / "ca.crt").read_bytes())  # no client certificate
    address = stack.verifiers[0].address.replace("127.0.0.1", "localhost")
    with grpc.secure_channel(address, credentials) as channel:
        with pytest.raises(grpc.RpcError) as info:
            verifier_pb2_grpc.VerifierStub(channel).GetInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_api_key_helpers():
    keys = [b"alpha", b"beta"]
    assert key_is_valid(b"beta", keys) and not key_is_valid(b"gamma", keys) and not key_is_valid(None, keys)
    assert presented_key([("authorization", "Bearer beta")]) == b"beta"
    assert presented_key([("x-api-key", "alpha")]) == b"alpha"
    assert presented_key([("authorization", "Basic xyz")]) is None
