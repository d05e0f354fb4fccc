"""The lean TCP data path against real shard processes: the same results as gRPC frames, sync
waits, hostile input on the data port, stalled connections, and the fall back to frames."""

from __future__ import annotations

import dataclasses
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from asyncps.errors import AsyncpsError, InvalidArgumentError, ResourceExhaustedError, UnauthenticatedError
from asyncps.net.rpc import Unreachable, error_of
from asyncps.net.security import SecurityConfig
from asyncps.pb import ps_pb2
from asyncps.placement import VariableSpec, place, split_for_shards
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.transport import (
    TRANSPORTS,
    GrpcShardTransport,
    ShardClient,
    ShmDataPath,
    TransportRegistry,
    connect_model,
    connect_shard,
    shmseg,
)
from asyncps.transport.grpc_shard import FramesDataPath
from asyncps.transport.link import ShardLink
from asyncps.transport.tcp import TcpConnection, TcpDataPath
from asyncps.wire.codec import SparseRows
from asyncps.wire.shard import PushRequest

if TYPE_CHECKING:
    from conftest import ShardLauncher

TOKEN = "worker-token-0123456789abcdef"
RULE = UpdateRuleConfig(OptimizerConfig("sgd", 0.5))


def initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {"w": rng.standard_normal((64, 33)).astype(np.float32),
            "b": rng.standard_normal(33).astype(np.float32),
            "embed": rng.standard_normal((50, 8)).astype(np.float32)}


def pushes(count: int) -> Iterator[dict[str, np.ndarray | SparseRows]]:
    rng = np.random.default_rng(11)
    for _ in range(count):
        rows = np.unique(rng.integers(0, 50, 7)).astype(np.int64)
        yield {"w": rng.standard_normal((64, 33)).astype(np.float32),
               "b": rng.standard_normal(33).astype(np.float32),
               "embed": SparseRows(rows, rng.standard_normal((rows.size, 8)).astype(np.float32))}


def tcp_in_use(client: object) -> bool:
    """Whether a shard client's tensors travel over its TCP data connection now."""
    return isinstance(client, ShardClient) and isinstance(client.data, TcpDataPath) and client.data.uses_tcp


def data_port(address: str, security: SecurityConfig | None = None) -> int:
    client = ShardLink(address, deadline_s=10, security=security)
    ask = client.channel.unary_unary(client.path("DataPort"),
                                     request_serializer=ps_pb2.DataPortRequest.SerializeToString,
                                     response_deserializer=ps_pb2.DataPortResponse.FromString)
    try:
        return int(ask(ps_pb2.DataPortRequest(), timeout=10).port)
    finally:
        client.close()


def frame(message: ps_pb2.FramedRequest, payload: bytes = b"") -> bytes:
    head = message.SerializeToString()
    body = struct.pack("<I", len(head)) + head
    body += bytes(-len(body) % 8) + payload if payload else b""
    return struct.pack("<I", len(body)) + body


def read_reply(sock: socket.socket) -> ps_pb2.FramedReply | None:
    """One reply frame (without tensors), or None when the shard closed the connection."""
    data = b""
    while len(data) < 4 or len(data) < 4 + struct.unpack_from("<I", data)[0]:
        got = sock.recv(65536)
        if not got:
            return None
        data += got
    (length,) = struct.unpack_from("<I", data, 4)
    return ps_pb2.FramedReply.FromString(data[8:8 + length])


def raw(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def hello(sock: socket.socket, token: str = TOKEN) -> ps_pb2.FramedReply | None:
    sock.sendall(frame(ps_pb2.FramedRequest(hello=ps_pb2.FramedHello(token=token, worker_id="raw"))))
    return read_reply(sock)


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.fixture(scope="module")
def secured(module_shard_factory: ShardLauncher, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[str, SecurityConfig]]:
    """One initialized shard with the workers' token (shared), two data connections at most."""
    token_file = Path(tmp_path_factory.mktemp("token")) / "token"
    token_file.write_text(TOKEN)
    shard = module_shard_factory(1, args=("--token-file", str(token_file), "--shared-token",
                                          "--max-data-connections", "2", "--stream-idle-timeout-s", "20"))[0]
    security = SecurityConfig(token=TOKEN, shared_token=True)
    client = connect_shard(shard.address, deadline_s=20, security=security, transport="tcp")
    client.initialize("chief", 0, 1, RULE, initial())
    client.close()
    yield shard.address, security


def state(address: str, security: SecurityConfig) -> tuple[int, dict[str, bytes]]:
    client = GrpcShardTransport(address, deadline_s=10, security=security)
    try:
        values = client.pull("probe")
        assert values.values is not None
        return values.version, {k: v.tobytes() for k, v in values.values.items()}
    finally:
        client.close()


def honest_step(address: str, security: SecurityConfig) -> int:
    """A push-pull over TCP by an honest worker; its new version."""
    client = connect_shard(address, deadline_s=20, security=security, transport="tcp")
    try:
        values = client.pull("honest")
        grads = {"b": np.full(33, 0.25, np.float32)}
        outcome, after = client.push_pull(PushRequest("honest", values.version, grads, incarnation=values.incarnation))
        assert tcp_in_use(client)
        assert outcome.accepted
        return after.version
    finally:
        client.close()


# -- equivalence --------------------------------------------------------------------------------
def test_tcp_and_grpc_frames_give_bit_identical_values_and_versions(shard_factory: ShardLauncher) -> None:
    over_grpc, over_tcp = shard_factory(2)
    clients = [connect_shard(over_grpc.address, deadline_s=20, transport="grpc"),
               connect_shard(over_tcp.address, deadline_s=20, transport="tcp")]
    results = []
    for client in clients:
        client.initialize("w0", 0, 1, RULE, initial())
        buffers = {name: np.zeros_like(value) for name, value in initial().items()}
        version, history = 0, []
        for i, grads in enumerate(pushes(12)):
            if i % 3 == 2:  # a plain push now and then, then a pull into the buffers
                outcome = client.push(PushRequest("w0", version, grads, step=i))
                values = client.pull("w0", buffers=buffers)
            else:
                outcome, values = client.push_pull(PushRequest("w0", version, grads, step=i), buffers=buffers)
            assert values.values is not None
            version = values.version
            history.append((outcome, version, {k: v.tobytes() for k, v in values.values.items()}))
        stats = client.stats()
        results.append((history, stats.version, stats.pushes_accepted))
        client.close()
    assert tcp_in_use(clients[1])
    assert results[0] == results[1]
    assert results[1][1] == 12


def test_a_shard_killed_and_restarted_is_reached_again_over_tcp(shard_factory: ShardLauncher) -> None:
    """kill -9 of the shard under a TCP connection: the client's next call finds the restarted shard
    (same gRPC address, a new data port asked again over gRPC), as a gRPC client would, and its
    tensors keep travelling over TCP."""
    (shard,) = shard_factory(1)
    client = connect_shard(shard.address, deadline_s=20, transport="tcp")
    client.initialize("w0", 0, 1, RULE, initial())
    grads = {"b": np.ones(33, np.float32)}
    outcome, values = client.push_pull(PushRequest("w0", 0, grads))
    assert outcome.accepted and values.version == 1 and tcp_in_use(client)
    first_port = data_port(shard.address)
    shard.kill()
    port = shard.address.rsplit(":", 1)[1]
    (again,) = shard_factory(1, args=("--port", port))  # what a supervisor does: the same address
    assert again.address == shard.address
    control = GrpcShardTransport(again.address, deadline_s=20)
    control.initialize("w0", 0, 1, RULE, initial())
    control.close()
    values = client.pull("w0")  # over a fresh connection to the new shard's data port
    assert values.version == 0 and values.values is not None
    outcome, values = client.push_pull(PushRequest("w0", 0, grads, incarnation=values.incarnation))
    assert outcome.accepted and values.version == 1 and tcp_in_use(client)
    stats = client.stats()
    assert stats.bytes_pushed_by_transport == {"tcp": grads["b"].nbytes}
    assert data_port(again.address) > 0 and first_port > 0  # each incarnation announced its own
    client.close()


def test_a_taken_data_port_is_a_clear_exit_not_a_traceback(tmp_path: Path) -> None:
    """A fixed --data-port another process holds: the shard says which port and what to change,
    and exits 4 (a supervisor's restart cannot help), its gRPC port released."""
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT, child_env

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "asyncps.tools.cli", "ps", "--port", "0", "--data-port",
                               str(taken), "--chief-timeout-s", "0"], capture_output=True, text=True, timeout=60,
                              env=child_env(), cwd=REPO_ROOT)
    assert done.returncode == 4, done.stderr[-2000:]
    assert f"the data port 127.0.0.1:{taken} cannot be bound (Address already in use)" in done.stderr
    assert "--data-port a free port" in done.stderr and "Traceback" not in done.stderr


def test_pull_lands_in_the_callers_buffers_and_not_modified_sends_nothing(shard_factory: ShardLauncher) -> None:
    address = shard_factory(1)[0].address
    client = connect_shard(address, deadline_s=20, transport="tcp")
    client.initialize("w0", 0, 1, RULE, initial())
    buffers = {name: np.zeros_like(value) for name, value in initial().items()}
    values = client.pull("w0", buffers=buffers)
    assert values.values is not None and all(values.values[n] is buffers[n] for n in buffers)
    assert all(np.array_equal(buffers[n], v) for n, v in initial().items())
    assert client.pull("w0", if_newer_than=values.version).values is None
    client.close()


def test_sync_waits_work_over_tcp(shard_factory: ShardLauncher) -> None:
    address = shard_factory(1)[0].address
    rule = UpdateRuleConfig(OptimizerConfig("sgd", 0.5), mode="sync", num_workers=2)
    first = connect_shard(address, deadline_s=20, transport="tcp")
    first.initialize("w0", 0, 1, rule, initial())
    results: dict[str, int] = {}

    def worker(name: str) -> None:
        client = connect_shard(address, deadline_s=20, transport="tcp")
        _, values = client.push_pull(PushRequest(name, 0, {"b": np.ones(33, np.float32)}, step=0),
                                     read_wait_s=20.0)
        results[name] = values.version
        client.close()

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("w0", "w1")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == {"w0": 1, "w1": 1}  # each waited for the other: both read the synchronous step
    first.close()


def test_domain_errors_are_the_same_typed_errors(shard_factory: ShardLauncher) -> None:
    address = shard_factory(1)[0].address
    client = connect_shard(address, deadline_s=20, transport="tcp")
    client.initialize("w0", 0, 1, RULE, initial())
    with pytest.raises(InvalidArgumentError, match="w"):
        client.push(PushRequest("w0", 0, {"w": np.ones((3, 3), np.float32)}))
    with pytest.raises(InvalidArgumentError):
        client.push(PushRequest("w0", 0, {"b": np.full(33, np.nan, np.float32)}))
    assert client.push(PushRequest("w0", 0, {"b": np.ones(33, np.float32)})).accepted  # still serving
    assert isinstance(error_of(16, "x"), UnauthenticatedError)
    client.close()


def test_a_seeded_worker_trains_bit_identically_over_tcp_and_grpc_frames(
        start_shards: Callable[[int], list[str]]) -> None:
    """One seeded worker, N steps of a Keras MLP with sliced variables on 2 shards, per transport."""
    from asyncps.worker.trainer import BatchStream, Telemetry, Trainer, make_grad_fn

    from asyncps.delays import NoDelay, StepDelay
    from asyncps.ml.datasets import load_dataset
    from asyncps.ml.models import build_model, loss_fn

    data = load_dataset("digits", 0)
    x, y = data.x_train[:400], data.y_train[:400]
    rule = UpdateRuleConfig(OptimizerConfig("adam", 0.01))
    results = {}
    for transport in ("grpc", "tcp"):
        addresses = start_shards(2)
        model = build_model("mlp", data.num_features, data.num_classes, seed=3)
        names = [v.path for v in model.trainable_variables]
        specs = [VariableSpec(v.path, tuple(v.shape), "float32") for v in model.trainable_variables]
        placement = place(specs, 2, slice_threshold_bytes=16 * 1024)  # sliced parts travel too
        start = {v.path: np.array(v.numpy()) for v in model.trainable_variables}
        client = connect_model("worker-0", addresses, placement, deadline_s=20, transport=transport)
        for shard, values in enumerate(split_for_shards(placement, start)):
            client.shards[shard].initialize("test", shard, 2, rule, values)
        trainer = Trainer(client, names, make_grad_fn(model, loss_fn), BatchStream(x, y, 32, seed=5),
                          StepDelay(NoDelay()), Telemetry())
        trainer.run(threading.Event(), max_steps=12)
        assert [tcp_in_use(s) for s in client.shards] == [transport == "tcp"] * 2
        assert client.versions == [12, 12]
        client.pull()
        results[transport] = {n: v.copy() for n, v in client.values.items()}
        client.close()
    assert {n: v.tobytes() for n, v in results["grpc"].items()} == {n: v.tobytes() for n, v in results["tcp"].items()}


# -- hostile input ------------------------------------------------------------------------------
def test_wrong_or_missing_token_is_refused(secured: tuple[str, SecurityConfig]) -> None:
    address, security = secured
    port = data_port(address, security)
    before = state(address, security)
    for token in ("wrong-token", ""):
        with raw(port) as sock:
            reply = hello(sock, token)
            assert reply is not None and reply.WhichOneof("kind") == "error"
            assert isinstance(error_of(reply.error.code, reply.error.message), UnauthenticatedError)
            assert closed(sock)
    bad = TcpConnection(address, lambda: port, SecurityConfig(token="not-it", shared_token=True), deadline_s=5)
    with pytest.raises(UnauthenticatedError):  # the typed error at once, no retry
        bad.pull("w")
    assert state(address, security) == before
    assert honest_step(address, security) == before[0] + 1


@pytest.mark.parametrize("attack", ["oversized", "truncated", "garbage-header", "header-too-long",
                                    "tensor-past-the-end", "no-hello"])
def test_hostile_frames_get_an_error_and_change_nothing(secured: tuple[str, SecurityConfig], attack: str) -> None:
    address, security = secured
    port = data_port(address, security)
    before = state(address, security)
    push = ps_pb2.FramedRequest(push=ps_pb2.PushHeader(worker_id="evil", base_version=before[0]))
    with raw(port) as sock:
        if attack != "no-hello":
            reply = hello(sock)
            assert reply is not None and reply.hello
        if attack == "oversized":
            sock.sendall(struct.pack("<I", 0xFFFFFFF0) + b"\0" * 64)
            expected: type[AsyncpsError] | None = ResourceExhaustedError
        elif attack == "truncated":
            chunk = ps_pb2.FramedRequest(push=push.push)
            chunk.tensors.add(name="b", dtype=1, shape=[33], nbytes=132)
            whole = frame(chunk, np.ones(33, np.float32).tobytes())
            sock.sendall(whole[:len(whole) - 40])
            sock.shutdown(socket.SHUT_WR)  # the rest never comes
            expected = None
        elif attack == "garbage-header":
            sock.sendall(struct.pack("<II", 12, 8) + b"\xff" * 8)
            expected = InvalidArgumentError
        elif attack == "header-too-long":
            sock.sendall(struct.pack("<II", 64, 1 << 30) + b"\0" * 60)
            expected = ResourceExhaustedError
        elif attack == "tensor-past-the-end":
            chunk = ps_pb2.FramedRequest(push=push.push)
            chunk.tensors.add(name="b", dtype=1, shape=[33], nbytes=132)
            sock.sendall(frame(chunk, b"\0" * 16))  # announces 132 bytes, the frame holds 16
            expected = InvalidArgumentError
        else:  # a push as the first message
            sock.sendall(frame(push))
            expected = InvalidArgumentError
        reply = read_reply(sock)
        if expected is None:
            assert reply is None or reply.WhichOneof("kind") == "error"
        else:
            assert reply is not None and reply.WhichOneof("kind") == "error", reply
            assert isinstance(error_of(reply.error.code, reply.error.message), expected), reply.error
            assert closed(sock)
    assert state(address, security) == before
    version = honest_step(address, security)
    assert version == before[0] + 1


def test_silent_connections_do_not_block_others(secured: tuple[str, SecurityConfig]) -> None:
    """Two connections that never say a word fill the data port (max 2); honest workers still get in."""
    address, security = secured
    port = data_port(address, security)
    silent = [raw(port), raw(port)]
    try:
        before = state(address, security)[0]
        assert honest_step(address, security) == before + 1
        assert honest_step(address, security) == before + 2
    finally:
        for sock in silent:
            sock.close()


def test_an_evicted_connection_is_reopened_and_the_request_served(secured: tuple[str, SecurityConfig]) -> None:
    """The data port is full of newer connections: the worker's idle one was evicted (closed
    before its next request was read), so the worker reconnects and its request is served once."""
    address, security = secured
    port = data_port(address, security)
    client = connect_shard(address, deadline_s=20, security=security, transport="tcp")
    before = client.pull("evicted").version
    newer = [raw(port), raw(port)]  # at most 2: the worker's connection, idle longest, makes room
    try:
        for sock in newer:
            assert hello(sock) is not None
        outcome, values = client.push_pull(PushRequest("evicted", before, {"b": np.ones(33, np.float32)}))
        assert outcome.accepted and values.version == before + 1
        assert tcp_in_use(client)
    finally:
        for sock in newer:
            sock.close()
        client.close()


# -- the seam: one registry entry, the shard's one service ----------------------------------------
def test_auto_takes_tcp_where_shared_memory_cannot_run(shard_factory: ShardLauncher) -> None:
    """auto is shm > tcp > grpc: without shared memory the worker's tensors travel over TCP; with
    it, TCP is the shared-memory path's fallback (a shard on another host, sparse gradients)."""
    address = shard_factory(1)[0].address
    registry = TransportRegistry()
    for entry in TRANSPORTS:
        registry.register(entry if entry.name != "shm" else dataclasses.replace(entry, unavailable=lambda: "none"))
    client = connect_shard(address, deadline_s=20, transport="auto", registry=registry)
    client.initialize("w0", 0, 1, RULE, initial())
    outcome, values = client.push_pull(PushRequest("w0", 0, {"b": np.ones(33, np.float32)}))
    assert outcome.accepted and values.version == 1 and tcp_in_use(client)
    client.close()
    if shmseg.available():
        auto = connect_shard(address, deadline_s=20, transport="auto")
        assert isinstance(auto.data, ShmDataPath) and isinstance(auto.data._fallback, TcpDataPath)
        auto.close()


def test_tcp_traffic_is_counted_by_the_shards_one_service(shard_factory: ShardLauncher) -> None:
    """GetStats over gRPC counts the bytes that travelled over the data port: one ShardService."""
    address = shard_factory(1)[0].address
    client = connect_shard(address, deadline_s=20, transport="tcp")
    client.initialize("w0", 0, 1, RULE, initial())
    before = client.stats()
    grads = {"b": np.ones(33, np.float32), "w": np.ones((64, 33), np.float32)}
    _, values = client.push_pull(PushRequest("w0", 0, grads))
    after = client.stats()
    assert tcp_in_use(client) and values.values is not None
    assert after.bytes_pushed - before.bytes_pushed == sum(g.nbytes for g in grads.values())
    assert after.bytes_pulled - before.bytes_pulled == sum(v.nbytes for v in values.values.values())
    # initialize travels over gRPC (the control face); the step's tensors over the data port only
    assert after.bytes_pushed_by_transport.get("tcp", 0) - before.bytes_pushed_by_transport.get("tcp", 0) == \
        after.bytes_pushed - before.bytes_pushed
    assert after.bytes_pulled_by_transport.get("tcp", 0) - before.bytes_pulled_by_transport.get("tcp", 0) == \
        after.bytes_pulled - before.bytes_pulled
    assert after.bytes_pushed_by_transport.get("grpc", 0) == before.bytes_pushed_by_transport.get("grpc", 0)
    client.close()


# -- the fall back -------------------------------------------------------------------------------
def test_no_data_port_falls_back_to_grpc_frames(shard_factory: ShardLauncher) -> None:
    address = shard_factory(1, args=("--data-port", "-1"))[0].address
    assert data_port(address) == 0
    client = connect_shard(address, deadline_s=20, transport="tcp")
    assert isinstance(client, ShardClient) and isinstance(client.data, TcpDataPath)
    client.initialize("w0", 0, 1, RULE, initial())
    outcome, values = client.push_pull(PushRequest("w0", 0, {"b": np.ones(33, np.float32)}))
    assert outcome.accepted and values.version == 1
    assert not client.data.uses_tcp
    client.close()


def test_an_unreachable_data_port_falls_back_to_grpc_frames(shard_factory: ShardLauncher) -> None:
    address = shard_factory(1)[0].address
    control = GrpcShardTransport(address, deadline_s=20)
    link = ShardLink(address, deadline_s=20)
    path = TcpDataPath(link, FramesDataPath(link))
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    connection = path._connection
    assert connection is not None
    connection._data_port = lambda: dead_port  # the shard announces a port this client cannot reach
    control.initialize("w0", 0, 1, RULE, initial())
    assert path.pull("w0").version == 0
    assert not path.uses_tcp
    path.close()
    link.close()
    control.close()


# -- TLS ------------------------------------------------------------------------------------------
def test_mutual_tls_and_a_token_over_tcp(shard_factory: ShardLauncher, tmp_path: Path) -> None:
    """Under mTLS the data connection is TLS with the same certificates; a client without a
    certificate gets no data connection (and no gRPC either)."""
    from asyncps.tools.devcerts import generate_dev_certs

    certs = generate_dev_certs(tmp_path / "certs")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    address = shard_factory(1, args=("--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
                                     "--tls-ca", str(certs.ca_cert), "--token-file", str(token_file),
                                     "--shared-token"))[0].address
    worker = SecurityConfig(token=TOKEN, shared_token=True, tls_cert=str(certs.client_cert),
                            tls_key=str(certs.client_key), tls_ca=str(certs.ca_cert))
    chief = SecurityConfig(token=TOKEN, shared_token=True, tls_cert=str(certs.chief_cert),
                           tls_key=str(certs.chief_key), tls_ca=str(certs.ca_cert))
    GrpcShardTransport(address, deadline_s=20, security=chief).initialize("chief", 0, 1, RULE, initial())
    client = connect_shard(address, deadline_s=20, security=worker, transport="tcp")
    buffers = {name: np.zeros_like(value) for name, value in initial().items()}
    outcome, values = client.push_pull(PushRequest("w0", 0, {"b": np.ones(33, np.float32)}), buffers=buffers)
    assert outcome.accepted and values.version == 1 and values.values is not None
    assert tcp_in_use(client)
    assert np.array_equal(buffers["b"], initial()["b"] - 0.5)
    client.close()
    port = data_port(address, worker)
    no_cert = TcpConnection(address, lambda: port, SecurityConfig(token=TOKEN, shared_token=True,
                                                                tls_ca=str(certs.ca_cert)), deadline_s=2)
    with pytest.raises(Unreachable, match="SSL"):  # the TLS handshake fails: no certificate
        no_cert.pull("w0")
    with raw(port) as sock:  # plaintext to a TLS port: refused, the shard keeps serving
        sock.sendall(frame(ps_pb2.FramedRequest(hello=ps_pb2.FramedHello(token=TOKEN))))
        assert closed(sock)
    assert state(address, worker)[0] == 1


def test_a_request_that_starts_just_before_the_idle_deadline_is_read_whole(shard_factory: ShardLauncher) -> None:
    """A worker held elsewhere (sync on another shard) for about the idle timeout sends its next request
    just before it runs out: the rest of the frame gets its own time, as the payload does, instead of the
    idle deadline's remainder (which cut such requests off with 'did not arrive' and killed the worker
    in long sync runs)."""
    idle_s = 1.0
    shard = shard_factory(1, args=("--stream-idle-timeout-s", str(idle_s)))[0]
    setup = GrpcShardTransport(shard.address, deadline_s=10)
    setup.initialize("chief", 0, 1, RULE, initial())
    setup.close()
    sock = raw(data_port(shard.address))
    try:
        reply = hello(sock, "")
        assert reply is not None and reply.WhichOneof("kind") == "hello", reply
        request = frame(ps_pb2.FramedRequest(pull=ps_pb2.PullRequest(worker_id="held")))
        time.sleep(0.8 * idle_s)  # the shard's idle clock, not an ordering of threads
        sock.sendall(request[:1])
        time.sleep(0.5 * idle_s)  # past the idle deadline, well within a fresh one
        sock.sendall(request[1:])
        reply = read_reply(sock)
        assert reply is not None and reply.WhichOneof("kind") == "values", reply
    finally:
        sock.close()
