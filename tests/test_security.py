"""Token authentication, TLS and mTLS against real in-process gRPC servers bound to port 0."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from asyncps.ps.adapter import ShardSide, add_handlers
from asyncps.ps.main import shard_adapters
from asyncps.ps.service import ShardService
from asyncps.ps.store import ShardStore
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message_factory import GetMessageClass

from asyncps.net import health, rpc
from asyncps.net.security import (
    TOKEN_ENV,
    SecurityConfig,
    TokenAuthInterceptor,
    TokenClientInterceptor,
    check_health,
    load_token,
    secure_channel,
)
from asyncps.pb import coordinator_pb2, coordinator_pb2_grpc, ps_pb2, ps_pb2_grpc
from asyncps.tools.devcerts import DevCerts, cert_paths, generate_dev_certs, subject_alt_names

TOKEN = "s3cret-token-0123456789abcdef"
WRONG_TOKEN = "not-the-token-9876543210"
SHARD_INDEX = 3  # not 0, so a reply from the real shard is recognisable
CALL_TIMEOUT_S = 5.0
Code = grpc.StatusCode
METHODS: list[MethodDescriptor] = [
    method
    for service in (ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"],
                    coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"])
    for method in service.methods
]
# A failed TLS handshake surfaces as UNAVAILABLE with a detail naming the handshake/certificate.
HANDSHAKE_DETAIL = re.compile(r"handshake|certificate|ssl|tls", re.IGNORECASE)


# -- helpers -------------------------------------------------------------------------------------
def register_services(server: grpc.Server) -> None:
    add_handlers(server, shard_adapters(ShardSide(ShardService(ShardStore(shard_index=SHARD_INDEX)))))
    # The generated base servicer answers UNIMPLEMENTED: enough to show that a call got past the
    # interceptor, and it keeps these tests independent of the chief's constructor.
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(
        coordinator_pb2_grpc.CoordinatorServicer(), server)  # type: ignore[abstract]


def invoke(channel: grpc.Channel, method: MethodDescriptor,
           metadata: Sequence[tuple[str, str]] | None = None) -> tuple[grpc.StatusCode, str]:
    """Call method with an empty request of its kind; return the status code and details."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    request = GetMessageClass(method.input_type)()
    serializers: dict[str, Any] = {
        "request_serializer": type(request).SerializeToString,
        "response_deserializer": GetMessageClass(method.output_type).FromString,
    }
    options: dict[str, Any] = {"timeout": CALL_TIMEOUT_S, "metadata": metadata}
    try:
        if method.client_streaming and method.server_streaming:
            list(channel.stream_stream(path, **serializers)(iter([request]), **options))
        elif method.client_streaming:
            channel.stream_unary(path, **serializers)(iter([request]), **options)
        elif method.server_streaming:
            list(channel.unary_stream(path, **serializers)(request, **options))
        else:
            channel.unary_unary(path, **serializers)(request, **options)
    except grpc.RpcError as exc:
        assert isinstance(exc, grpc.Call)
        return exc.code(), exc.details() or ""
    return Code.OK, ""


def shard_index(channel: grpc.Channel) -> int:
    """The index GetStats reports: proof that a call reached the real shard."""
    stats = ps_pb2_grpc.ParameterServerStub(channel).GetStats(ps_pb2.StatsRequest(), timeout=CALL_TIMEOUT_S)
    return int(stats.shard_index)


def get_stats_error(channel: grpc.Channel) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        shard_index(channel)
    return caught.value


def method_id(method: MethodDescriptor) -> str:
    return f"{method.containing_service.name}.{method.name}"


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def start_server() -> Iterator[Callable[[SecurityConfig], str]]:
    """`start_server(security)` serves both services as security says; returns host:port."""
    servers: list[grpc.Server] = []

    def start(security: SecurityConfig) -> str:
        server, port, _ = rpc.create_server(
            "127.0.0.1:0", [register_services], max_workers=8,
            interceptors=[TokenAuthInterceptor(security.token)] if security.token else [],
            credentials=security.server_credentials(),
        )
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(grace=None).wait()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> DevCerts:
    return generate_dev_certs(tmp_path_factory.mktemp("certs"), extra_names=["ps-0", "chief"])


@pytest.fixture(scope="module")
def other_certs(tmp_path_factory: pytest.TempPathFactory) -> DevCerts:
    """A second, unrelated CA with its own server and client certificates."""
    return generate_dev_certs(tmp_path_factory.mktemp("other-certs"))


@pytest.fixture(scope="module")
def token_server(start_server: Callable[[SecurityConfig], str]) -> str:
    return start_server(SecurityConfig(token=TOKEN))


@pytest.fixture(scope="module")
def channels(token_server: str) -> Iterator[dict[str, grpc.Channel]]:
    """Plaintext channels to token_server: without a token, with a wrong one, with the right one."""
    opened = {
        "none": secure_channel(token_server, SecurityConfig()),
        "wrong": secure_channel(token_server, SecurityConfig(token=WRONG_TOKEN)),
        "right": secure_channel(token_server, SecurityConfig(token=TOKEN)),
    }
    yield opened
    for channel in opened.values():
        channel.close()


@pytest.fixture(scope="module")
def tls_server(start_server: Callable[[SecurityConfig], str], certs: DevCerts) -> str:
    return start_server(SecurityConfig(token=TOKEN, tls_cert=str(certs.server_cert),
                                       tls_key=str(certs.server_key)))


@pytest.fixture(scope="module")
def mtls_server(start_server: Callable[[SecurityConfig], str], certs: DevCerts) -> str:
    return start_server(SecurityConfig(token=TOKEN, tls_cert=str(certs.server_cert),
                                       tls_key=str(certs.server_key), tls_ca=str(certs.ca_cert)))


# -- token authentication ------------------------------------------------------------------------
def test_the_services_have_methods_of_every_streaming_kind() -> None:
    kinds = {(m.client_streaming, m.server_streaming) for m in METHODS}
    assert kinds == {(False, False), (False, True), (True, False), (True, True)}
    assert {"Initialize", "Pull", "Push", "PushPull", "Shutdown", "Register", "Heartbeat"} <= {
        m.name for m in METHODS}


@pytest.mark.parametrize("method", METHODS, ids=method_id)
def test_a_call_without_a_token_is_unauthenticated(channels: dict[str, grpc.Channel],
                                                    method: MethodDescriptor) -> None:
    code, details = invoke(channels["none"], method)
    assert code is Code.UNAUTHENTICATED, details
    assert details.startswith("missing token")


@pytest.mark.parametrize("method", METHODS, ids=method_id)
def test_a_call_with_a_wrong_token_is_unauthenticated(channels: dict[str, grpc.Channel],
                                                       method: MethodDescriptor) -> None:
    code, details = invoke(channels["wrong"], method)
    assert (code, details) == (Code.UNAUTHENTICATED, "invalid token")


@pytest.mark.parametrize("method", METHODS, ids=method_id)
def test_a_call_with_the_right_token_reaches_the_servicer(channels: dict[str, grpc.Channel],
                                                          method: MethodDescriptor) -> None:
    code, details = invoke(channels["right"], method)
    # empty requests are mostly invalid; all that matters is that the servicer judged them
    assert code is not Code.UNAUTHENTICATED, details
    assert code is not Code.UNAVAILABLE, details


def test_the_right_token_gets_real_answers(channels: dict[str, grpc.Channel]) -> None:
    assert shard_index(channels["right"]) == SHARD_INDEX


@pytest.mark.parametrize("authorization", [
    f"Basic {TOKEN}",
    TOKEN,
    f"Bearer {TOKEN}x",
    f"Bearer {TOKEN[:-1]}",
    "Bearer ",
    "Bearer",
])
def test_malformed_authorization_is_an_invalid_token(token_server: str, authorization: str) -> None:
    with rpc.make_channel(token_server) as channel:
        code, details = invoke(channel, METHODS[0], metadata=[("authorization", authorization)])
    assert (code, details) == (Code.UNAUTHENTICATED, "invalid token")


def test_two_authorization_entries_are_an_invalid_token(token_server: str) -> None:
    metadata = [("authorization", f"Bearer {TOKEN}"), ("authorization", f"Bearer {WRONG_TOKEN}")]
    with rpc.make_channel(token_server) as channel:
        assert invoke(channel, METHODS[0], metadata=metadata) == (Code.UNAUTHENTICATED, "invalid token")


def test_the_bearer_scheme_is_case_insensitive(token_server: str) -> None:
    get_stats = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].methods_by_name["GetStats"]
    with rpc.make_channel(token_server) as channel:
        assert invoke(channel, get_stats, metadata=[("authorization", f"bearer {TOKEN}")]) == (Code.OK, "")


def test_explicit_call_metadata_wins_over_the_channel_token(channels: dict[str, grpc.Channel]) -> None:
    code, details = invoke(channels["right"], METHODS[0], metadata=[("authorization", f"Bearer {WRONG_TOKEN}")])
    assert (code, details) == (Code.UNAUTHENTICATED, "invalid token")


def test_health_needs_no_token(token_server: str, channels: dict[str, grpc.Channel]) -> None:
    assert health.check(channels["none"], timeout_s=CALL_TIMEOUT_S) == health.SERVING
    assert check_health(token_server, SecurityConfig())


def test_an_unknown_method_stays_unimplemented(channels: dict[str, grpc.Channel]) -> None:
    call = channels["none"].unary_unary("/asyncps.pb.ParameterServer/NoSuchMethod", None, None)
    with pytest.raises(grpc.RpcError) as caught:
        call(b"", timeout=CALL_TIMEOUT_S)
    assert caught.value.code() is Code.UNIMPLEMENTED


def test_tokens_are_never_logged(channels: dict[str, grpc.Channel], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    for kind in ("none", "wrong", "right"):
        for method in METHODS:
            invoke(channels[kind], method)
    assert "rejected /asyncps.pb.ParameterServer/PushPull: invalid token" in caplog.text
    assert TOKEN not in caplog.text and WRONG_TOKEN not in caplog.text
    assert TOKEN not in repr(SecurityConfig(token=TOKEN))
    assert TOKEN not in repr(TokenAuthInterceptor(TOKEN)) + repr(TokenClientInterceptor(TOKEN))


@pytest.mark.parametrize("token", ["", "has space", "new\nline", "caf\u00e9"])
def test_interceptors_refuse_unusable_tokens(token: str) -> None:
    with pytest.raises(ValueError) as server_side:
        TokenAuthInterceptor(token)
    with pytest.raises(ValueError):
        TokenClientInterceptor(token)
    if token:
        assert token not in str(server_side.value)


# -- loading the token ---------------------------------------------------------------------------
def test_load_token_reads_a_file_and_strips_the_newline(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(f"{TOKEN}\n")
    assert load_token(path, environ={TOKEN_ENV: WRONG_TOKEN}) == TOKEN  # the file wins
    assert load_token(str(path), environ={}) == TOKEN


def test_load_token_falls_back_to_the_environment() -> None:
    assert load_token("", environ={TOKEN_ENV: f" {TOKEN} "}) == TOKEN
    assert load_token(environ={}) == ""


@pytest.mark.parametrize(("content", "message"), [
    (None, "token file not found"),
    ("\n", "is empty"),
    ("two words", "printable ASCII"),
])
def test_load_token_rejects_a_bad_file(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_token(path, environ={TOKEN_ENV: TOKEN})


def test_security_config_from_flags(tmp_path: Path, certs: DevCerts) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN)
    config = SecurityConfig.from_flags(token_file=str(path), tls_cert=str(certs.server_cert),
                                       tls_key=str(certs.server_key), tls_ca=str(certs.ca_cert), environ={})
    assert config.token == TOKEN and config.mtls
    assert config.describe() == "mTLS, token auth"
    assert SecurityConfig.from_flags(environ={}).describe() == "plaintext, no token auth"
    assert SecurityConfig(tls_ca=str(certs.ca_cert)).describe() == "TLS, no token auth"


# -- configuration validation --------------------------------------------------------------------
def test_security_config_validation(certs: DevCerts, tmp_path: Path) -> None:
    cert, key, ca = str(certs.server_cert), str(certs.server_key), str(certs.ca_cert)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tls_cert": cert}, "--tls-cert needs --tls-key"),
        ({"tls_key": key}, "--tls-key needs --tls-cert"),
        ({"tls_ca": str(tmp_path / "missing.pem")}, "--tls-ca: no such file"),
        ({"tls_cert": key, "tls_key": key}, "--tls-cert: .* is not a PEM certificate"),
        ({"tls_cert": cert, "tls_key": cert}, "--tls-key: .* is not a PEM private key"),
        ({"server_name_override": "ps-0"}, "needs TLS"),
        ({"token": "two words"}, "printable ASCII"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message) as caught:
            SecurityConfig(**kwargs)
        assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="needs --tls-cert and --tls-key"):
        SecurityConfig(tls_ca=ca).server_credentials()
    assert SecurityConfig().server_credentials() is None
    assert SecurityConfig().channel_credentials() is None


# -- TLS -----------------------------------------------------------------------------------------
def test_tls_with_the_right_ca_works(tls_server: str, certs: DevCerts) -> None:
    port = tls_server.rsplit(":", 1)[1]
    security = SecurityConfig(token=TOKEN, tls_ca=str(certs.ca_cert))
    for address in (tls_server, f"localhost:{port}"):  # an IP and a DNS subject alt name
        with secure_channel(address, security) as channel:
            assert shard_index(channel) == SHARD_INDEX
    assert check_health(tls_server, SecurityConfig(tls_ca=str(certs.ca_cert)))


def test_tls_still_requires_the_token(tls_server: str, certs: DevCerts) -> None:
    with secure_channel(tls_server, SecurityConfig(tls_ca=str(certs.ca_cert))) as channel:
        assert get_stats_error(channel).code() is Code.UNAUTHENTICATED


def test_tls_with_the_wrong_ca_fails_the_handshake(tls_server: str, other_certs: DevCerts) -> None:
    with secure_channel(tls_server, SecurityConfig(token=TOKEN, tls_ca=str(other_certs.ca_cert))) as channel:
        error = get_stats_error(channel)
    assert error.code() is Code.UNAVAILABLE
    assert HANDSHAKE_DETAIL.search(error.details() or ""), error.details()
    assert not check_health(tls_server, SecurityConfig(tls_ca=str(other_certs.ca_cert)))


def test_a_plaintext_client_cannot_talk_to_a_tls_server(tls_server: str) -> None:
    with secure_channel(tls_server, SecurityConfig(token=TOKEN)) as channel:
        assert get_stats_error(channel).code() is Code.UNAVAILABLE


def test_server_name_override(tls_server: str, certs: DevCerts) -> None:
    ok = SecurityConfig(token=TOKEN, tls_ca=str(certs.ca_cert), server_name_override="ps-0")
    with secure_channel(tls_server, ok) as channel:
        assert shard_index(channel) == SHARD_INDEX
    wrong = SecurityConfig(token=TOKEN, tls_ca=str(certs.ca_cert), server_name_override="ps-9")
    with secure_channel(tls_server, wrong) as channel:
        assert get_stats_error(channel).code() is Code.UNAVAILABLE


# -- mutual TLS ----------------------------------------------------------------------------------
def test_mtls_refuses_a_client_without_a_certificate(mtls_server: str, certs: DevCerts) -> None:
    with secure_channel(mtls_server, SecurityConfig(token=TOKEN, tls_ca=str(certs.ca_cert))) as channel:
        assert get_stats_error(channel).code() is Code.UNAVAILABLE


def test_mtls_refuses_a_certificate_from_another_ca(mtls_server: str, certs: DevCerts,
                                                    other_certs: DevCerts) -> None:
    security = SecurityConfig(token=TOKEN, tls_ca=str(certs.ca_cert), tls_cert=str(other_certs.client_cert),
                              tls_key=str(other_certs.client_key))
    with secure_channel(mtls_server, security) as channel:
        assert get_stats_error(channel).code() is Code.UNAVAILABLE


@pytest.mark.parametrize("role", ["client", "server"])
def test_mtls_accepts_a_client_certificate(mtls_server: str, certs: DevCerts, role: str) -> None:
    # "server": a process that both serves and calls (the chief) presents its server certificate
    cert, key = (certs.client_cert, certs.client_key) if role == "client" else (certs.server_cert, certs.server_key)
    security = SecurityConfig(token=TOKEN, tls_ca=str(certs.ca_cert), tls_cert=str(cert), tls_key=str(key))
    with secure_channel(mtls_server, security) as channel:
        assert shard_index(channel) == SHARD_INDEX


def test_client_certificates_can_be_optional(start_server: Callable[[SecurityConfig], str],
                                             certs: DevCerts) -> None:
    address = start_server(SecurityConfig(tls_cert=str(certs.server_cert), tls_key=str(certs.server_key),
                                          tls_ca=str(certs.ca_cert), require_client_cert=False))
    with secure_channel(address, SecurityConfig(tls_ca=str(certs.ca_cert))) as channel:
        assert shard_index(channel) == SHARD_INDEX


# -- development certificates --------------------------------------------------------------------
def test_dev_certs_name_the_defaults_and_the_extra_names() -> None:
    assert subject_alt_names(["ps-0", "localhost", "10.0.0.7"]) == (
        "DNS:localhost, IP:127.0.0.1, IP:::1, DNS:ps-0, IP:10.0.0.7")
    for bad in ("a,b", "x y", "-lead", "", "a\nb"):
        with pytest.raises(ValueError, match="not a host name"):
            subject_alt_names([bad])


def test_dev_certs_refuse_to_overwrite(certs: DevCerts) -> None:
    with pytest.raises(FileExistsError, match="--force"):
        generate_dev_certs(certs.ca_cert.parent)
    assert certs.server_key.stat().st_mode & 0o077 == 0


def test_dev_certs_from_the_cli_have_the_roles_they_claim(tmp_path: Path) -> None:
    """`asyncps devcerts` (no openssl binary): a CA that may sign, the chief and server certificates
    naming the hosts and valid both ways, the client's for client authentication only."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    from asyncps.tools.cli import main as cli_main

    assert cli_main(["devcerts", str(tmp_path / "c"), "--name", "ps-0", "--days", "2"]) == 0
    assert cli_main(["devcerts", str(tmp_path / "c")]) == 2  # refuses to overwrite
    paths = cert_paths(tmp_path / "c")

    def load(path: Path) -> x509.Certificate:
        return x509.load_pem_x509_certificate(path.read_bytes())

    ca, chief, client = load(paths.ca_cert), load(paths.chief_cert), load(paths.client_cert)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for leaf in (chief, client, load(paths.server_cert)):
        leaf.verify_directly_issued_by(ca)
        assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    both = {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert set(chief.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == both
    assert set(client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == {
        ExtendedKeyUsageOID.CLIENT_AUTH}
    names = chief.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "ps-0" in names.get_values_for_type(x509.DNSName)
    assert chief.subject.rfc4514_string() == "CN=asyncps-chief"
    assert all(p.stat().st_mode & 0o077 == 0 for p in (paths.ca_key, paths.chief_key, paths.client_key))
