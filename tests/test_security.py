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


def make_pki(directory: Path, ca_name: str = "specdec-test-ca", identities: dict[str, list[str]] | None = None) -> Path:
    """A CA and one certificate (server + client usage, SAN localhost/127.0.0.1) signed by it, as
    ``service.crt``/``.key``; ``identities``: more certificates from the same CA, ``NAME.crt``/``.key``
    with common name NAME and these DNS names (or IP addresses) as SANs."""
    import ipaddress

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (x509.CertificateBuilder().subject_name(_name(ca_name)).issuer_name(_name(ca_name))
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .sign(ca_key, hashes.SHA256()))
    _write(directory / "ca", ca_key, ca_cert)

    def san(name: str) -> x509.GeneralName:
        try:
            return x509.IPAddress(ipaddress.ip_address(name))
        except ValueError:
            return x509.DNSName(name)

    def issue(file_name: str, common_name: str, names: list[str]) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca_cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([san(n) for n in names]), critical=False)
                .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH,
                                                      x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        _write(directory / file_name, key, cert)

    issue("service", "specdec", ["localhost", "127.0.0.1"])
    for name, names in (identities or {}).items():
        issue(name, name, names)
    return directory


def wait_serving_tls(address: str, pki: Path, proc, timeout: float = 120, identity: str = "service") -> None:
    credentials = grpc.ssl_channel_credentials((pki / "ca.crt").read_bytes(), (pki / f"{identity}.key").read_bytes(),
                                               (pki / f"{identity}.crt").read_bytes())
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


# -- drafters and verifiers take calls from a gateway only ----------------------------------------

SERVICE_TOKEN = "t0ken-for-the-tests-" + "x" * 24
GATEWAY_PEER = "specdec-gateway"


def _verifier_calls(stub):
    from specdec.v1 import verifier_pb2

    start = verifier_pb2.VerifyRequest(start=verifier_pb2.VerifyStart(prompt_token_ids=[1, 2, 3]))
    return {
        "Verify": lambda **kw: list(stub.Verify(iter([start]), timeout=10, **kw)),
        "GetInfo": lambda **kw: stub.GetInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=10, **kw),
        "CancelVerify": lambda **kw: stub.CancelVerify(verifier_pb2.CancelVerifyRequest(session_id="nobody"),
                                                        timeout=10, **kw),
    }


def _drafter_calls(stub):
    from specdec.v1 import drafter_pb2

    start = drafter_pb2.DraftRequest(start=drafter_pb2.DraftStart(prompt_token_ids=[1, 2, 3]))
    return {
        "Draft": lambda **kw: list(stub.Draft(iter([start]), timeout=10, **kw)),
        "GetInfo": lambda **kw: stub.GetInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=10, **kw),
        "CancelDraft": lambda **kw: stub.CancelDraft(drafter_pb2.CancelDraftRequest(session_id="nobody"),
                                                      timeout=10, **kw),
    }


def _calls(service, channel):
    from specdec.v1 import drafter_pb2_grpc, verifier_pb2_grpc

    if service.name.startswith("verifier"):
        return _verifier_calls(verifier_pb2_grpc.VerifierStub(channel))
    return _drafter_calls(drafter_pb2_grpc.DrafterStub(channel))


@pytest.fixture(scope="module")
def token_stack(tiny_pair, tmp_path_factory):
    """Drafter, verifier and gateway sharing a service token (the gateway presents it)."""
    from tests.harness import start_stack

    stack = start_stack(tiny_pair[1], tiny_pair[2], tmp_path_factory.mktemp("token-logs"),
                        env={"SPECDEC_SERVICE_TOKEN": SERVICE_TOKEN})
    yield stack
    stack.stop()


@pytest.mark.parametrize("token", [None, "wrong-token-of-enough-length", SERVICE_TOKEN + "x", ""])
def test_model_services_refuse_calls_without_the_service_token(token_stack, token):
    metadata = None if token is None else (("x-specdec-service-token", token),)
    for service in (token_stack.verifiers[0], token_stack.drafters[0]):
        with grpc.insecure_channel(service.address) as channel:
            for name, call in _calls(service, channel).items():
                with pytest.raises(grpc.RpcError) as info:
                    call(metadata=metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (service.name, name)
                assert "service token" in info.value.details(), (service.name, name)


def test_a_client_api_key_is_no_service_token(token_stack):
    """Client credentials never open the internal services."""
    for service in (token_stack.verifiers[0], token_stack.drafters[0]):
        with grpc.insecure_channel(service.address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                _calls(service, channel)["GetInfo"](metadata=(("authorization", f"Bearer {SERVICE_TOKEN}"),
                                                              ("x-api-key", SERVICE_TOKEN)))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_and_reflection_stay_open_without_a_token(token_stack):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from tests.harness import health_status

    for service in (token_stack.verifiers[0], token_stack.drafters[0]):
        assert health_status(service.address) == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(service.address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            answer = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                    timeout=10))
        names = {s.name for s in answer.list_services_response.service}
        assert "grpc.health.v1.Health" in names and any(n.startswith("specdec.v1.") for n in names)


def test_the_right_token_opens_every_method(token_stack):
    metadata = (("x-specdec-service-token", SERVICE_TOKEN),)
    for service in (token_stack.verifiers[0], token_stack.drafters[0]):
        with grpc.insecure_channel(service.address) as channel:
            calls = _calls(service, channel)
            assert calls["GetInfo"](metadata=metadata).model.model
            with pytest.raises(grpc.RpcError) as info:  # past authentication: the session is unknown
                calls["CancelVerify" if "CancelVerify" in calls else "CancelDraft"](metadata=metadata)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_gateway_with_the_token_generates_through_protected_services(token_stack):
    with GatewayClient(token_stack.gateway.address, timeout=60) as c:
        result = c.generate(prompt="the quick", max_new_tokens=12, ignore_eos=True, method="model", num_draft_tokens=2)
    assert len(result.token_ids) == 12
    assert result.stats["draft_method"] == "model" and result.stats["draft_tokens"] > 0


def test_refusals_are_logged_once_without_a_traceback(token_stack):
    with grpc.insecure_channel(token_stack.verifiers[0].address) as channel:
        for _ in range(3):
            with pytest.raises(grpc.RpcError):
                _calls(token_stack.verifiers[0], channel)["GetInfo"]()
    time.sleep(0.5)
    for service in (token_stack.verifiers[0], token_stack.drafters[0]):
        log = service.log()
        assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
        assert "no service token" not in log  # the open-mode warning is for services without one
    refusals = [line for line in token_stack.verifiers[0].log().splitlines() if "refused" in line]
    assert refusals and all("WARNING" in line for line in refusals)
    # Many refusals above (every method, every bad token): one line per caller and reason a minute.
    assert len([line for line in refusals if "service token" in line]) == 1, refusals


def test_open_channel_presents_the_token_on_unary_and_stream_calls(token_stack):
    """The gateway's channel: every call through it carries the token, metadata of its own kept."""
    import asyncio

    from specdec.rpc.server import open_channel
    from specdec.v1 import verifier_pb2, verifier_pb2_grpc

    async def run():
        async with open_channel(token_stack.verifiers[0].address, service_token=SERVICE_TOKEN) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            info = await stub.GetInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=10,
                                      metadata=(("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01"),))
            call = stub.Verify(timeout=30, metadata=grpc.aio.Metadata(("x-other", "kept")))
            await call.write(verifier_pb2.VerifyRequest(start=verifier_pb2.VerifyStart(prompt_token_ids=[1, 2, 3])))
            first = await call.read()
            await call.done_writing()
            while await call.read() is not grpc.aio.EOF:
                pass
            return info, first

    info, first = asyncio.run(run())
    assert info.model.model
    assert len(first.token_ids) == 1 and first.committed_length == 4  # the prefill's verdict: the first token


def test_open_mode_warns_at_start(tiny_pair, tmp_path):
    """No token: the service stays open (tests, one machine) and says so once at start."""
    service = start_service("drafter", ["--method", "ngram", "--draft-model", str(tiny_pair[1])], tmp_path,
                            env={"SPECDEC_SERVICE_TOKEN": "", "SPECDEC_SERVICE_TOKEN_FILE": ""})
    try:
        service.wait_serving()
        with grpc.insecure_channel(service.address) as channel:
            assert _calls(service, channel)["GetInfo"]().method == "ngram"
    finally:
        service.stop()
    warnings = [line for line in service.log().splitlines() if "no service token" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0]


@pytest.fixture(scope="module")
def peer_stack(tiny_pair, tmp_path_factory):
    """mTLS with an allow-list: the verifier takes calls from the gateway's certificate only. The
    verifier's certificate names the Kubernetes Service (not 127.0.0.1), as discovered pods' do."""
    pki = make_pki(tmp_path_factory.mktemp("peer-pki"), identities={
        GATEWAY_PEER: ["localhost", "specdec-gateway.specdec.svc"],
        "specdec-verifier": ["localhost", "specdec-verifier.specdec.svc"],
        "specdec-drafter": ["localhost", "specdec-drafter.specdec.svc"],
    })
    logs = tmp_path_factory.mktemp("peer-logs")

    def tls(identity: str) -> list[str]:
        return ["--tls-cert", str(pki / f"{identity}.crt"), "--tls-key", str(pki / f"{identity}.key"),
                "--tls-ca", str(pki / "ca.crt"), "--tls-client-auth"]

    from tests.harness import free_port

    health_port = free_port()
    verifier = start_service("verifier", ["--target", str(tiny_pair[1]), *tls("specdec-verifier"),
                                          "--tls-allowed-peers", GATEWAY_PEER, "--health-port", str(health_port)], logs)
    verifier_address = verifier.address.replace("127.0.0.1", "localhost")
    gateway = start_service("gateway", ["--target", str(tiny_pair[1]), "--verifier", verifier_address,
                                        *tls(GATEWAY_PEER)], logs)
    stack = Stack(gateway, [verifier], [])
    try:
        for service in stack.all:
            wait_serving_tls(service.address.replace("127.0.0.1", "localhost"), pki, service.proc)
        yield stack, pki, health_port
    finally:
        stack.stop()


def _tls_channel(address: str, pki: Path, identity: str) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials((pki / "ca.crt").read_bytes(), (pki / f"{identity}.key").read_bytes(),
                                               (pki / f"{identity}.crt").read_bytes())
    return grpc.secure_channel(address, credentials)


@pytest.mark.parametrize("identity", ["specdec-drafter", "specdec-verifier", "service"])
def test_a_certificate_from_the_same_ca_that_is_not_the_gateways_is_denied(peer_stack, identity):
    stack, pki, _ = peer_stack
    verifier = stack.verifiers[0]
    with _tls_channel(verifier.address.replace("127.0.0.1", "localhost"), pki, identity) as channel:
        for name, call in _calls(verifier, channel).items():
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
            assert "not an allowed caller" in info.value.details()
        stub = health_pb2_grpc.HealthStub(channel)  # health stays open to any certificate of the CA
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    log = verifier.log()
    assert "Traceback" not in log and " ERROR " not in log


def test_the_gateways_certificate_is_allowed(peer_stack):
    stack, pki, _ = peer_stack
    verifier = stack.verifiers[0]
    with _tls_channel(verifier.address.replace("127.0.0.1", "localhost"), pki, GATEWAY_PEER) as channel:
        assert _calls(verifier, channel)["GetInfo"]().model.model
    with client(Stack(stack.gateway, [], []), pki, api_key=None, tls_cert=str(pki / f"{GATEWAY_PEER}.crt"),
                tls_key=str(pki / f"{GATEWAY_PEER}.key")) as c:
        result = c.generate(prompt="the quick", max_new_tokens=8, ignore_eos=True, method="none")
    assert len(result.token_ids) == 8
    assert "no service token" not in verifier.log()  # mTLS + allowed peers is authentication too


def test_discovered_pods_are_verified_by_the_services_name(peer_stack):
    """A pod IP is not in the verifier's certificate: open_channel checks the Service's DNS name."""
    import asyncio

    from specdec.rpc.security import TLSConfig
    from specdec.rpc.server import open_channel
    from specdec.v1 import verifier_pb2, verifier_pb2_grpc

    stack, pki, _ = peer_stack
    tls = TLSConfig.from_sources(str(pki / f"{GATEWAY_PEER}.crt"), str(pki / f"{GATEWAY_PEER}.key"), str(pki / "ca.crt"))

    async def get_info(server_name):
        async with open_channel(stack.verifiers[0].address, tls, server_name=server_name) as channel:
            return await verifier_pb2_grpc.VerifierStub(channel).GetInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=5)

    assert asyncio.run(get_info("specdec-verifier.specdec.svc")).model.model
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(get_info(None))  # 127.0.0.1 is not a name the certificate carries
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_health_port_serves_probes_in_plaintext(peer_stack):
    from tests.harness import health_status

    stack, _, health_port = peer_stack
    address = f"127.0.0.1:{health_port}"
    assert health_status(address) == health_pb2.HealthCheckResponse.SERVING
    assert health_status(address, "specdec.v1.Verifier") == health_pb2.HealthCheckResponse.SERVING
    assert health_status(address, "specdec.v1.Liveness") == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(address) as channel:  # and nothing else
        with pytest.raises(grpc.RpcError) as info:
            _calls(stack.verifiers[0], channel)["GetInfo"]()
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_allowed_peers_need_client_certificates():
    from specdec.cli import main

    with pytest.raises(SystemExit, match="--tls-allowed-peers needs"):
        main(["serve", "verifier", "--tls-allowed-peers", GATEWAY_PEER])


# -- where tokens come from ------------------------------------------------------------------------

def test_service_tokens_from_file_and_environment(tmp_path):
    from specdec.service_config import allowed_peers, service_tokens

    new, old = "n" * 20, "o" * 20
    path = tmp_path / "token"
    path.write_text(f"# rotation: new first (presented), old still accepted\n{new}\n\n{old}\n")
    assert service_tokens({}) == []
    assert service_tokens({}, str(path)) == [new.encode(), old.encode()]
    environ = {"SPECDEC_SERVICE_TOKEN_FILE": str(path), "SPECDEC_SERVICE_TOKEN": "e" * 20 + ", " + "f" * 20}
    assert service_tokens(environ) == [new.encode(), old.encode(), b"e" * 20, b"f" * 20]
    with pytest.raises(SystemExit, match="at least 16"):
        service_tokens({"SPECDEC_SERVICE_TOKEN": "short"})
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(SystemExit, match="holds no token"):
        service_tokens({}, str(tmp_path / "empty"))
    with pytest.raises(SystemExit, match="cannot read"):
        service_tokens(environ, str(tmp_path / "missing"))  # the flag's file wins over the variable's
    assert allowed_peers({"SPECDEC_TLS_ALLOWED_PEERS": "a, b"}) == ("a", "b")
    assert allowed_peers({"SPECDEC_TLS_ALLOWED_PEERS": "a, b"}, ["c,d", "e"]) == ("c", "d", "e")


def test_token_metadata_merges_with_the_callers():
    from specdec.rpc.security import SERVICE_TOKEN_HEADER, _with_metadata

    extra = ((SERVICE_TOKEN_HEADER, "tok"),)
    assert _with_metadata(None, extra) == extra
    assert _with_metadata((("a", "1"), (SERVICE_TOKEN_HEADER, "forged")), extra) == (("a", "1"), *extra)
    merged = _with_metadata(grpc.aio.Metadata(("a", "1")), extra)
    assert list(merged) == [("a", "1"), (SERVICE_TOKEN_HEADER, "tok")]


def _up_args(*extra):
    from specdec.cli import build_parser

    return build_parser().parse_args(["up", "--draft-method", "ngram", *extra])


def test_specdec_up_gives_its_children_one_random_token():
    from specdec import up

    specs = up.children(_up_args())
    tokens = {spec.env["SPECDEC_SERVICE_TOKEN"] for spec in specs}
    assert len(tokens) == 1 and len(tokens.pop()) >= 32
    assert all(spec.env["SPECDEC_SERVICE_TOKEN_FILE"] == "" for spec in specs)  # no inherited file
    assert not any(spec.env["SPECDEC_SERVICE_TOKEN"] in " ".join(spec.command) for spec in specs)  # not in ps
    assert up.children(_up_args())[0].env["SPECDEC_SERVICE_TOKEN"] != specs[0].env["SPECDEC_SERVICE_TOKEN"]


def test_specdec_up_takes_a_token_file(tmp_path):
    from specdec import up

    path = tmp_path / "token"
    path.write_text("z" * 24 + "\n")
    specs = up.children(_up_args("--service-token-file", str(path)))
    assert all(spec.env == {"SPECDEC_SERVICE_TOKEN_FILE": str(path), "SPECDEC_SERVICE_TOKEN": ""} for spec in specs)
    path.write_text("short\n")
    with pytest.raises(SystemExit):
        up.children(_up_args("--service-token-file", str(path)))


def test_specdec_up_is_closed_by_default(tiny_pair):
    """The real thing: the local stack generates, and its verifier and drafter refuse a caller
    without the run's token."""
    from specdec.stack import LocalStack

    _, target, draft = tiny_pair
    with LocalStack(["--target", str(target), "--draft-model", str(draft), "--drafter-nice", "0"], quiet=True) as address:
        with GatewayClient(address, timeout=60) as c:
            result = c.generate(prompt="the quick", max_new_tokens=6, ignore_eos=True, method="model",
                                num_draft_tokens=2)
        assert len(result.token_ids) == 6 and result.stats["draft_method"] == "model"
        host, _, port = address.rpartition(":")
        for offset, role in ((1, "drafter"), (2, "verifier")):
            service = type("S", (), {"name": role})
            with grpc.insecure_channel(f"{host}:{int(port) + offset}") as channel:
                with pytest.raises(grpc.RpcError) as info:
                    _calls(service, channel)["GetInfo"]()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, role
