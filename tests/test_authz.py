"""Per-role authorization: every method x every caller, by token and by certificate, against real
gRPC servers with a real shard; a denied call leaves the shard exactly as it was."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from asyncps.ps.adapter import ShardSide, add_handlers
from asyncps.ps.main import shard_adapters
from asyncps.ps.service import ShardService
from asyncps.ps.store import ShardStore
from google.protobuf.descriptor import MethodDescriptor

from asyncps.net import rpc
from asyncps.net.authz import CHIEF, METHOD_ROLES, WORKER, Authorizer, TokenRoles
from asyncps.net.security import SecurityConfig, secure_channel
from asyncps.pb import coordinator_pb2_grpc, ps_pb2, ps_pb2_grpc
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.tools.devcerts import DevCerts, generate_dev_certs
from tests.conftest import REPO_ROOT, START_TIMEOUT_S, child_env
from tests.test_security import METHODS, invoke, method_id

WORKER_TOKEN = "worker-token-0123456789abcdef"
CHIEF_TOKEN = "chief-token-fedcba9876543210"
Code = grpc.StatusCode
DENIED_OR_UNKNOWN = (Code.PERMISSION_DENIED, Code.UNAUTHENTICATED)


def path_of(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def chief_only(method: MethodDescriptor) -> bool:
    return METHOD_ROLES[path_of(method)] == frozenset({CHIEF})


class Served:
    """One real server over a real, initialized shard store (plus the coordinator's base servicer)."""

    def __init__(self, security: SecurityConfig) -> None:
        self.store = ShardStore(shard_index=0)
        self.store.initialize(UpdateRuleConfig(OptimizerConfig("sgd", 0.5)),
                              {"w": np.arange(6, dtype=np.float32).reshape(2, 3)})
        self.shutdowns: list[str] = []
        adapters = shard_adapters(ShardSide(ShardService(self.store), on_shutdown=self.shutdowns.append))

        def register(server: grpc.Server) -> None:
            add_handlers(server, adapters)
            coordinator_pb2_grpc.add_CoordinatorServicer_to_server(
                coordinator_pb2_grpc.CoordinatorServicer(), server)  # type: ignore[abstract]

        self.server, port, _ = rpc.create_server("127.0.0.1:0", [register], max_workers=8,
                                                 interceptors=security.server_interceptors(),
                                                 credentials=security.server_credentials())
        self.address = f"127.0.0.1:{port}"

    def fingerprint(self) -> tuple[object, ...]:
        """Everything a call could change: values, version, counters, live set, pause, shutdowns."""
        snap = self.store.snapshot()
        stats = self.store.stats()
        return (snap.version, {k: v.tobytes() for k, v in snap.values.items()}, repr(stats), repr(snap),
                tuple(self.shutdowns))


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> DevCerts:
    return generate_dev_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def serve() -> Iterator[Callable[[SecurityConfig], Served]]:
    started: list[Served] = []

    def start(security: SecurityConfig) -> Served:
        started.append(Served(security))
        return started[-1]

    yield start
    for served in started:
        served.server.stop(grace=None).wait()


def tls(certs: DevCerts, who: str, **kwargs: object) -> SecurityConfig:
    cert, key = {"chief": (certs.chief_cert, certs.chief_key), "worker": (certs.client_cert, certs.client_key),
                 "shard": (certs.server_cert, certs.server_key)}[who]
    return SecurityConfig(tls_cert=str(cert), tls_key=str(key), tls_ca=str(certs.ca_cert), **kwargs)  # type: ignore[arg-type]


def expect(served: Served, caller: SecurityConfig, method: MethodDescriptor, allowed: bool,
           denied_code: Code = Code.PERMISSION_DENIED) -> None:
    """Call method as caller: allowed calls reach the servicer; denied ones fail and change nothing."""
    before = served.fingerprint()
    with secure_channel(served.address, caller) as channel:
        code, details = invoke(channel, method)
    if allowed:
        # empty requests are mostly invalid; what matters is that the servicer judged them
        assert code not in (*DENIED_OR_UNKNOWN, Code.UNAVAILABLE), (code, details)
        return
    assert code is denied_code, (code, details)
    assert served.fingerprint() == before, "a denied call changed the shard"
    if denied_code is Code.PERMISSION_DENIED:
        assert f"{method.name} needs the chief role" in details, details


# -- the table ----------------------------------------------------------------------------------
def test_every_method_has_roles_and_the_chief_owns_the_lifecycle() -> None:
    assert {path_of(m) for m in METHODS} == set(METHOD_ROLES)
    owned = {m.name for m in METHODS if chief_only(m)}
    assert owned == {"Initialize", "Restore", "Pause", "Snapshot", "SetLiveWorkers", "Shutdown", "SetBackup", "Promote"}
    assert all(WORKER in METHOD_ROLES[path_of(m)] for m in METHODS if not chief_only(m))


def test_an_unlisted_method_is_denied() -> None:
    def handler(request: bytes, context: grpc.ServicerContext) -> bytes:
        return b"reached"

    server = grpc.server(rpc.futures.ThreadPoolExecutor(2), interceptors=[Authorizer(None)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "other.Service", {"Call": grpc.unary_unary_rpc_method_handler(handler)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary("/other.Service/Call")(b"", timeout=5)
        assert caught.value.code() is Code.PERMISSION_DENIED  # type: ignore[attr-defined]
        assert "not in the authorization table" in caught.value.details()  # type: ignore[attr-defined]
    finally:
        server.stop(None)


@pytest.mark.parametrize(("worker", "chief", "shared", "problem"), [
    (WORKER_TOKEN, "", False, "needs the chief's token too"),
    (WORKER_TOKEN, WORKER_TOKEN, False, "must differ"),
])
def test_token_settings_that_cannot_tell_the_roles_apart_are_refused(
        worker: str, chief: str, shared: bool, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        TokenRoles(worker, chief, shared)
    with pytest.raises(ValueError, match=problem):
        SecurityConfig(token=worker, chief_token=chief, shared_token=shared).server_interceptors()


# -- per-role tokens ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def token_served(serve: Callable[[SecurityConfig], Served]) -> Served:
    return serve(SecurityConfig(token=WORKER_TOKEN, chief_token=CHIEF_TOKEN))


@pytest.mark.parametrize("method", METHODS, ids=method_id)
def test_the_chief_token_may_call_everything(token_served: Served, method: MethodDescriptor) -> None:
    expect(token_served, SecurityConfig(token=WORKER_TOKEN, chief_token=CHIEF_TOKEN), method, allowed=True)


@pytest.mark.parametrize("method", METHODS, ids=method_id)
def test_the_worker_token_may_call_only_the_workers_methods(token_served: Served, method: MethodDescriptor) -> None:
    expect(token_served, SecurityConfig(token=WORKER_TOKEN), method, allowed=not chief_only(method))


@pytest.mark.parametrize("caller", ["none", "wrong"])
@pytest.mark.parametrize("method", METHODS, ids=method_id)
def test_no_or_a_wrong_token_is_unauthenticated(token_served: Served, method: MethodDescriptor,
                                                caller: str) -> None:
    security = SecurityConfig() if caller == "none" else SecurityConfig(token="guessed-token-123456")
    expect(token_served, security, method, allowed=False, denied_code=Code.UNAUTHENTICATED)


@pytest.mark.parametrize("method", METHODS, ids=method_id)
def test_an_explicitly_shared_token_acts_as_every_role(serve: Callable[[SecurityConfig], Served],
                                                       method: MethodDescriptor) -> None:
    served = serve(SecurityConfig(token=WORKER_TOKEN, shared_token=True))
    expect(served, SecurityConfig(token=WORKER_TOKEN), method, allowed=True)
    served.server.stop(None)


# -- certificate identities under mTLS ---------------------------------------------------------
@pytest.fixture(scope="module")
def mtls_served(serve: Callable[[SecurityConfig], Served], certs: DevCerts) -> Served:
    return serve(tls(certs, "shard"))


@pytest.mark.parametrize(("who", "chief_may"), [("chief", True), ("worker", False), ("shard", False)])
@pytest.mark.parametrize("method", METHODS, ids=method_id)
def test_certificate_identities(mtls_served: Served, certs: DevCerts, method: MethodDescriptor,
                                who: str, chief_may: bool) -> None:
    expect(mtls_served, tls(certs, who), method, allowed=chief_may or not chief_only(method))


@pytest.mark.parametrize(("who", "token", "chief_may"), [
    ("chief", CHIEF_TOKEN, True),
    ("chief", WORKER_TOKEN, False),   # a chief's certificate with a worker's token
    ("worker", CHIEF_TOKEN, False),   # a stolen chief token on a worker's certificate
])
@pytest.mark.parametrize("method", [m for m in METHODS if chief_only(m)], ids=method_id)
def test_with_mtls_and_tokens_both_must_be_the_chiefs(serve: Callable[[SecurityConfig], Served], certs: DevCerts,
                                                      method: MethodDescriptor, who: str, token: str,
                                                      chief_may: bool) -> None:
    served = serve(tls(certs, "shard", token=WORKER_TOKEN, chief_token=CHIEF_TOKEN))
    expect(served, tls(certs, who, token=token), method, allowed=chief_may)
    served.server.stop(None)


# -- a real shard process -----------------------------------------------------------------------
def test_a_worker_token_cannot_stop_or_restore_a_shard_process(tmp_path: Path) -> None:
    (tmp_path / "worker.token").write_text(WORKER_TOKEN + "\n")
    (tmp_path / "chief.token").write_text(CHIEF_TOKEN + "\n")
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncps.tools.cli", "ps", "--host", "127.0.0.1", "--port", "0",
         "--port-file", str(port_file), "--token-file", str(tmp_path / "worker.token"),
         "--chief-token-file", str(tmp_path / "chief.token")],
        cwd=REPO_ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        from asyncps.rundir import wait_port_file

        address = f"127.0.0.1:{wait_port_file(port_file, START_TIMEOUT_S, alive=lambda: proc.poll() is None)}"
        worker, chief = SecurityConfig(token=WORKER_TOKEN), SecurityConfig(token=WORKER_TOKEN, chief_token=CHIEF_TOKEN)
        with secure_channel(address, worker) as channel:
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            for call in (lambda: stub.Shutdown(ps_pb2.ShutdownRequest(reason="worker"), timeout=5),
                         lambda: stub.Restore(iter([ps_pb2.SnapshotChunk()]), timeout=5)):
                with pytest.raises(grpc.RpcError) as caught:
                    call()
                assert caught.value.code() is Code.PERMISSION_DENIED  # type: ignore[attr-defined]
            assert not stub.GetStats(ps_pb2.StatsRequest(), timeout=5).initialized  # still serving, unchanged
        assert proc.poll() is None
        with secure_channel(address, chief) as channel:
            ps_pb2_grpc.ParameterServerStub(channel).Shutdown(ps_pb2.ShutdownRequest(reason="chief"), timeout=5)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate(timeout=30)[0].decode(errors="replace")
    assert "per-role tokens auth" in out
    assert WORKER_TOKEN not in out and CHIEF_TOKEN not in out
