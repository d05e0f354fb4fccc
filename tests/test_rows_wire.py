"""Row reads on every path against real shard processes: a pull or push-pull with `rows` serves exactly
those rows of each part named (and their clocks), whatever the version, over gRPC frames, TCP and shared
memory alike; hostile row reads get their status on each path and change nothing; tables a shard makes
itself (Initialize's `generated`) are read by rows like any other."""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import pytest
from asyncps.ps.store import MAX_ROWS_PER_READ

from asyncps.errors import AsyncpsError, InvalidArgumentError, NotFoundError, ResourceExhaustedError
from asyncps.pb import ps_pb2, tensor_pb2
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.rules.initializers import RowInit, TableSpec
from asyncps.transport import GrpcShardTransport, ShardClient, ShmDataPath, connect_shard
from asyncps.transport.link import ShardLink
from asyncps.transport.tcp import TcpDataPath
from asyncps.wire.codec import SparseRows, iter_chunks
from asyncps.wire.frames import decode_frame, encode_frame, identity, tensor_slices
from asyncps.wire.proto import parse_pull
from asyncps.wire.shard import PushRequest, ShardValues

if TYPE_CHECKING:
    from conftest import ShardLauncher, ShardProcess

CALL_TIMEOUT_S = 20.0
RULE = UpdateRuleConfig(OptimizerConfig("sgd", 1.0))
TRANSPORTS = ["grpc", "tcp", "shm"]
EMBED_ROWS = 50


def initial_values() -> dict[str, np.ndarray]:
    """A dense kernel and bias, and a table read by rows (small integers: SGD with lr=1 stays exact)."""
    return {"w": (np.arange(24, dtype=np.float32) - 12).reshape(6, 4),
            "b": np.array([1, -2, 3], np.float32),
            "embed": np.arange(EMBED_ROWS * 8, dtype=np.float32).reshape(EMBED_ROWS, 8)}


def whole_parts() -> dict[str, np.ndarray]:
    """A worker's buffers for the parts it reads whole (none for the table it reads by rows)."""
    return {"w": np.zeros((6, 4), np.float32), "b": np.zeros(3, np.float32)}


@pytest.fixture(scope="module")
def shard(module_shard_factory: ShardLauncher) -> ShardProcess:
    process = module_shard_factory(1)[0]
    client = GrpcShardTransport(process.address, deadline_s=CALL_TIMEOUT_S)
    assert client.initialize("test", 0, 1, RULE, initial_values()).created
    client.close()
    return process


@pytest.fixture(params=TRANSPORTS)
def client(request: pytest.FixtureRequest, shard: ShardProcess) -> Iterator[ShardClient]:
    """A worker's client to the shard over one transport, asked for by name (no silent fall back)."""
    transport: str = request.param
    shard_client = connect_shard(shard.address, deadline_s=CALL_TIMEOUT_S, transport=transport)
    yield shard_client
    shard_client.close()


@pytest.fixture
def probe(shard: ShardProcess) -> Iterator[GrpcShardTransport]:
    """gRPC frames reading the whole state: the reference the row reads are checked against."""
    frames = GrpcShardTransport(shard.address, deadline_s=CALL_TIMEOUT_S)
    yield frames
    frames.close()


def whole(probe: GrpcShardTransport) -> ShardValues:
    reply = probe.pull("probe")
    assert reply.values is not None and reply.rows is None
    return reply


def assert_rows(reply: ShardValues, name: str, ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """The reply served exactly rows `ids` of `table` (and not the part whole); their clocks."""
    assert reply.rows is not None and set(reply.rows) == {name}
    if reply.values is not None:
        assert name not in reply.values
    served = reply.rows[name]
    assert served.indices.tobytes() == ids.tobytes()
    assert served.values.dtype == table.dtype and served.values.tobytes() == table[ids].tobytes()
    assert served.clocks is not None and served.clocks.dtype == np.int64 and served.clocks.shape == ids.shape
    return served.clocks


def on_its_path(client: ShardClient, transport: str) -> None:
    """The call went the transport's own way (not its fallback)."""
    if transport == "tcp":
        assert isinstance(client.data, TcpDataPath) and client.data.uses_tcp
    if transport == "shm":
        assert isinstance(client.data, ShmDataPath) and client.data.uses_shared_memory
        assert client.data.rings_over_data_connection


def transport_of(client: ShardClient) -> str:
    return "tcp" if isinstance(client.data, TcpDataPath) else "shm" if isinstance(client.data, ShmDataPath) else "grpc"


def test_a_row_pull_serves_exactly_the_rows_asked_and_their_clocks(client: ShardClient,
                                                                   probe: GrpcShardTransport) -> None:
    state = whole(probe)
    assert state.values is not None
    ids = np.array([0, 7, 8, EMBED_ROWS - 1], np.int64)
    buffers = whole_parts()
    reply = client.pull("w0", -1, buffers, rows={"embed": ids})
    on_its_path(client, transport_of(client))
    assert reply.version == state.version and reply.values is not None and set(reply.values) == {"w", "b"}
    for name in ("w", "b"):
        assert reply.values[name].tobytes() == state.values[name].tobytes()
    assert_rows(reply, "embed", ids, state.values["embed"])
    empty = client.pull("w0", -1, buffers, rows={"embed": np.array([], np.int64)})
    assert_rows(empty, "embed", np.array([], np.int64), state.values["embed"])


def test_rows_are_served_when_the_dense_values_are_not_modified(client: ShardClient,
                                                                probe: GrpcShardTransport) -> None:
    state = whole(probe)
    assert state.values is not None
    ids = np.array([3, 4], np.int64)
    reply = client.pull("w0", state.version, whole_parts(), rows={"embed": ids})
    assert reply.values is None and reply.version == state.version
    assert_rows(reply, "embed", ids, state.values["embed"])


def test_a_push_pull_with_rows_pushes_then_serves_the_rows(client: ShardClient, probe: GrpcShardTransport) -> None:
    """A dense push (through the segment over shm) with a row read; then a sparse push with the clocks its
    rows were read at: those rows' clocks advance, the push's row staleness is measured."""
    state = whole(probe)
    assert state.values is not None
    ids = np.array([5, 9], np.int64)
    buffers = whole_parts()
    grads = {"b": np.ones(3, np.float32)}
    outcome, reply = client.push_pull(PushRequest("w0", state.version, grads), -1, buffers, rows={"embed": ids})
    assert outcome.accepted and reply.version == state.version + 1 and reply.values is not None
    assert reply.values["b"].tobytes() == (state.values["b"] - 1).tobytes()
    clocks = assert_rows(reply, "embed", ids, state.values["embed"])
    sparse = {"embed": SparseRows(ids[:1], np.ones((1, 8), np.float32), clocks[:1])}
    outcome, reply = client.push_pull(PushRequest("w0", reply.version, sparse), reply.version, buffers,
                                      rows={"embed": ids})
    assert outcome.accepted and outcome.rows is not None and (outcome.rows.rows, outcome.rows.max) == (1, 0)
    table = state.values["embed"].copy()
    table[ids[0]] -= 1
    after = assert_rows(reply, "embed", ids, table)
    assert after.tolist() == [clocks[0] + 1, clocks[1]]
    assert whole(probe).values["embed"].tobytes() == table.tobytes()  # type: ignore[index]


def test_row_bytes_count_as_the_transports_bytes(client: ShardClient, probe: GrpcShardTransport) -> None:
    """The ids asked count as bytes pushed to the shard, the rows and their clocks as bytes pulled, on the
    transport that carried them (a not-modified pull: no dense values)."""
    name = transport_of(client)
    ids = np.array([1, 2, 3], np.int64)
    buffers = whole_parts()
    version = client.pull("w0", -1, buffers, rows={"embed": ids}).version  # (shm: the segment mapped first)
    before = probe.stats()
    reply = client.pull("w0", version, buffers, rows={"embed": ids})
    after = probe.stats()
    assert reply.values is None and reply.rows is not None
    assert after.bytes_pushed_by_transport.get(name, 0) - before.bytes_pushed_by_transport.get(name, 0) == ids.nbytes
    assert (after.bytes_pulled_by_transport.get(name, 0) - before.bytes_pulled_by_transport.get(name, 0)
            == 3 * 8 * 4 + 3 * 8)


HOSTILE_ROWS: dict[str, tuple[dict[str, np.ndarray], type[AsyncpsError], str]] = {
    "negative": ({"embed": np.array([-1, 2], np.int64)}, InvalidArgumentError, "lie in"),
    "out of range": ({"embed": np.array([0, EMBED_ROWS], np.int64)}, InvalidArgumentError, "lie in"),
    "duplicated": ({"embed": np.array([3, 3], np.int64)}, InvalidArgumentError, "strictly increasing"),
    "unsorted": ({"embed": np.array([4, 3], np.int64)}, InvalidArgumentError, "strictly increasing"),
    "float ids": ({"embed": np.array([1.0, 2.0])}, InvalidArgumentError, "int64"),
    "int32 ids": ({"embed": np.array([1, 2], np.int32)}, InvalidArgumentError, "int64"),
    "2-d ids": ({"embed": np.array([[1, 2]], np.int64)}, InvalidArgumentError, r"int64 \[k\]"),
    "unknown part": ({"nope": np.array([0], np.int64)}, NotFoundError, "unknown variable"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_ROWS))
def test_hostile_row_reads_are_refused_and_change_nothing(client: ShardClient, probe: GrpcShardTransport,
                                                          case: str) -> None:
    rows, error, message = HOSTILE_ROWS[case]
    state = whole(probe)
    assert state.values is not None
    buffers = whole_parts()
    with pytest.raises(error, match=message):
        client.pull("w0", -1, buffers, rows=rows)
    with pytest.raises(error, match=message):  # refused before the push applies
        client.push_pull(PushRequest("w0", state.version, {"b": np.ones(3, np.float32)}), -1, buffers, rows=rows)
    assert_unchanged(probe, state)
    assert_rows(client.pull("w0", -1, buffers, rows={"embed": np.array([1], np.int64)}), "embed",
                np.array([1], np.int64), state.values["embed"])  # an honest request is still served


def assert_unchanged(probe: GrpcShardTransport, state: ShardValues) -> None:
    now = whole(probe)
    assert now.values is not None and state.values is not None and now.version == state.version
    assert all(now.values[n].tobytes() == state.values[n].tobytes() for n in state.values)


@pytest.mark.parametrize("clocks", [np.array([0], np.int64), np.array([0.0, 0.0]), np.array([[0, 0]], np.int64),
                                    np.array([-1, 0], np.int64)],
                         ids=["short", "float", "2-d", "negative"])
def test_a_push_with_bad_row_clocks_is_refused_and_changes_nothing(client: ShardClient, probe: GrpcShardTransport,
                                                                   clocks: np.ndarray) -> None:
    state = whole(probe)
    grad = {"embed": SparseRows(np.array([1, 2], np.int64), np.ones((2, 8), np.float32), clocks)}
    with pytest.raises(InvalidArgumentError, match="clocks"):
        client.push(PushRequest("w0", state.version, grad))
    with pytest.raises(InvalidArgumentError, match="clocks"):
        client.push_pull(PushRequest("w0", state.version, grad), -1, whole_parts(), rows={"embed": np.arange(2)})
    assert_unchanged(probe, state)


def test_a_row_read_of_more_rows_than_the_cap_is_invalid_argument(probe: GrpcShardTransport) -> None:
    """A million rows asked at once are refused by the store's cap (the request itself is within every size
    limit: 8 MiB of ids)."""
    state = whole(probe)
    with pytest.raises(InvalidArgumentError, match="at most"):
        probe.pull("w0", -1, rows={"embed": np.arange(MAX_ROWS_PER_READ + 1, dtype=np.int64)})
    assert_unchanged(probe, state)


def test_a_shared_memory_segment_maps_only_the_parts_read_whole(shard: ShardProcess,
                                                                probe: GrpcShardTransport) -> None:
    """The worker's segment has regions for the parts it reads whole only; a request through it that does
    not read the others by rows is refused (their values have nowhere to go)."""
    client = connect_shard(shard.address, deadline_s=CALL_TIMEOUT_S, transport="shm")
    try:
        assert isinstance(client.data, ShmDataPath)
        state = whole(probe)
        buffers = whole_parts()
        client.pull("w1", -1, buffers, rows={"embed": np.array([2], np.int64)})
        mapping = client.data._mapping
        assert mapping is not None and set(mapping.values) == {"w", "b"} and set(mapping.grads) == {"w", "b"}
        with pytest.raises(InvalidArgumentError, match="no region"):
            client.pull("w1", -1, buffers)
        assert_unchanged(probe, state)
    finally:
        client.close()


# ----------------------------------------------------------------------- the raw wire, by hand


def pull_call(address: str) -> tuple[grpc.Channel, Callable[..., Any]]:
    channel = grpc.insecure_channel(address)
    return channel, channel.unary_stream("/asyncps.pb.ParameterServer/Pull",
                                         request_serializer=ps_pb2.PullRequest.SerializeToString,
                                         response_deserializer=identity)


def raw_chunk(name: str, array: np.ndarray, role: int) -> tensor_pb2.TensorChunk:
    return next(iter_chunks(name, array, role, chunk_bytes=1 << 30))  # type: ignore[arg-type]


RAW_PULL_ROWS: dict[str, tuple[list[tensor_pb2.TensorChunk], grpc.StatusCode]] = {
    "float ids": ([raw_chunk("embed", np.array([1.0]), tensor_pb2.ROW_IDS)], grpc.StatusCode.INVALID_ARGUMENT),
    "clocks asked": ([raw_chunk("embed", np.array([1]), tensor_pb2.ROW_CLOCKS)], grpc.StatusCode.INVALID_ARGUMENT),
    "a tensor": ([raw_chunk("embed", np.ones(2, np.float32), tensor_pb2.DENSE)], grpc.StatusCode.INVALID_ARGUMENT),
    "short bytes": ([tensor_pb2.TensorChunk(name="embed", role=tensor_pb2.ROW_IDS, dtype=tensor_pb2.INT64,
                                            shape=[4], data=bytes(8))], grpc.StatusCode.INVALID_ARGUMENT),
    "huge shape": ([tensor_pb2.TensorChunk(name="embed", role=tensor_pb2.ROW_IDS, dtype=tensor_pb2.INT64,
                                           shape=[1 << 40], data=bytes(8))], grpc.StatusCode.RESOURCE_EXHAUSTED),
    "no name": ([raw_chunk("", np.array([1]), tensor_pb2.ROW_IDS)], grpc.StatusCode.INVALID_ARGUMENT),
}


@pytest.mark.parametrize("case", sorted(RAW_PULL_ROWS))
def test_hostile_pull_rows_over_grpc_get_their_status(shard: ShardProcess, probe: GrpcShardTransport,
                                                      case: str) -> None:
    chunks, code = RAW_PULL_ROWS[case]
    state = whole(probe)
    channel, call = pull_call(shard.address)
    try:
        with pytest.raises(grpc.RpcError) as caught:
            list(call(ps_pb2.PullRequest(worker_id="evil", if_newer_than=-1, rows=chunks), timeout=CALL_TIMEOUT_S))
        assert caught.value.code() == code and caught.value.details()
    finally:
        channel.close()
    assert_unchanged(probe, state)


def push_pull_frames(base_version: int, chunks: list[tensor_pb2.TensorChunk]) -> list[bytes]:
    message = ps_pb2.PushChunk(header=ps_pb2.PushHeader(worker_id="evil", base_version=base_version),
                               tensors=chunks)
    data = []
    for chunk in message.tensors:
        data.append(memoryview(chunk.data))
        chunk.nbytes = len(chunk.data)
        chunk.ClearField("data")
    return [encode_frame(message, data)]


def sparse_chunks(clocks: np.ndarray | None, with_indices: bool = True) -> list[tensor_pb2.TensorChunk]:
    chunks = [raw_chunk("embed", np.array([1, 2], np.int64), tensor_pb2.SPARSE_INDICES)] if with_indices else []
    chunks.append(raw_chunk("embed", np.ones((2, 8), np.float32), tensor_pb2.SPARSE_VALUES))
    if clocks is not None:
        chunks.append(raw_chunk("embed", clocks, tensor_pb2.ROW_CLOCKS))
    return chunks


RAW_PUSH_PULLS: dict[str, Callable[[], list[tensor_pb2.TensorChunk]]] = {
    "clocks without indices": lambda: sparse_chunks(np.array([0, 0], np.int64), with_indices=False),
    "clocks of the wrong length": lambda: sparse_chunks(np.array([0, 0, 0], np.int64)),
    "float clocks": lambda: sparse_chunks(np.array([0.0, 0.0])),
    "float ids": lambda: [raw_chunk("embed", np.array([1.0]), tensor_pb2.ROW_IDS)],
    "2-d ids": lambda: [raw_chunk("embed", np.array([[1]]), tensor_pb2.ROW_IDS)],
    "clocks alone": lambda: [raw_chunk("b", np.array([0, 0, 0]), tensor_pb2.ROW_CLOCKS)],
}


@pytest.mark.parametrize("case", sorted(RAW_PUSH_PULLS))
def test_hostile_push_pull_rows_over_grpc_are_invalid_argument(shard: ShardProcess, probe: GrpcShardTransport,
                                                               case: str) -> None:
    state = whole(probe)
    channel = grpc.insecure_channel(shard.address)
    call = channel.stream_stream("/asyncps.pb.ParameterServer/PushPull", request_serializer=identity,
                                 response_deserializer=identity)
    try:
        with pytest.raises(grpc.RpcError) as caught:
            list(call(iter(push_pull_frames(state.version, RAW_PUSH_PULLS[case]())), timeout=CALL_TIMEOUT_S))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and caught.value.details()
    finally:
        channel.close()
    assert_unchanged(probe, state)


def data_port(address: str) -> int:
    link = ShardLink(address, deadline_s=10)
    ask = link.channel.unary_unary(link.path("DataPort"), request_serializer=ps_pb2.DataPortRequest.SerializeToString,
                                   response_deserializer=ps_pb2.DataPortResponse.FromString)
    try:
        return int(ask(ps_pb2.DataPortRequest(), timeout=10).port)
    finally:
        link.close()


def send_framed(sock: socket.socket, message: ps_pb2.FramedRequest, payload: bytes = b"") -> None:
    head = message.SerializeToString()
    body = struct.pack("<I", len(head)) + head
    body += bytes(-len(body) % 8) + payload if payload else b""
    sock.sendall(struct.pack("<I", len(body)) + body)


def read_reply(sock: socket.socket) -> ps_pb2.FramedReply | None:
    """One reply frame's message (its tensors skipped), or None when the shard closed the connection."""
    data = b""
    while len(data) < 4 or len(data) < 4 + struct.unpack_from("<I", data)[0]:
        got = sock.recv(1 << 16)
        if not got:
            return None
        data += got
    (length,) = struct.unpack_from("<I", data, 4)
    return ps_pb2.FramedReply.FromString(data[8:8 + length])


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("kind", ["pull", "push_pull"])
def test_a_huge_row_ids_tensor_on_the_data_port_is_refused_before_it_is_read(
    shard: ShardProcess, probe: GrpcShardTransport, kind: str,
) -> None:
    """A ROW_IDS tensor announced larger than the request-size limit: one error reply, the connection
    closed, nothing allocated or applied; an honest client is served after it."""
    state = whole(probe)
    request = ps_pb2.FramedRequest()
    if kind == "pull":
        request.pull.CopyFrom(ps_pb2.PullRequest(worker_id="evil"))
    else:
        request.push_pull.CopyFrom(ps_pb2.PushHeader(worker_id="evil", base_version=state.version))
    request.tensors.add(name="embed", role=tensor_pb2.ROW_IDS, dtype=tensor_pb2.INT64, shape=[1 << 33],
                        nbytes=8 << 33)
    with socket.create_connection(("127.0.0.1", data_port(shard.address)), timeout=10) as sock:
        send_framed(sock, ps_pb2.FramedRequest(hello=ps_pb2.FramedHello(worker_id="evil")))
        hello = read_reply(sock)
        assert hello is not None and hello.hello
        head = request.SerializeToString()
        sock.sendall(struct.pack("<II", min(8 << 33, (1 << 32) - 1), len(head)) + head)
        reply = read_reply(sock)
        assert reply is not None and reply.WhichOneof("kind") == "error"
        assert reply.error.code in (grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                    grpc.StatusCode.INVALID_ARGUMENT.value[0]), reply.error
        assert closed(sock)  # out of step: closed
    assert_unchanged(probe, state)
    honest = connect_shard(shard.address, deadline_s=CALL_TIMEOUT_S, transport="tcp")
    try:
        assert_rows(honest.pull("w0", -1, rows={"embed": np.array([0], np.int64)}), "embed",
                    np.array([0], np.int64), state.values["embed"])  # type: ignore[index]
    finally:
        honest.close()


def test_a_doorbell_with_a_tensor_beside_its_row_ids_is_invalid_argument(shard: ShardProcess,
                                                                        probe: GrpcShardTransport) -> None:
    """Shared memory's `mapped` request carries row ids only: a gradient tensor on it is refused."""
    client = connect_shard(shard.address, deadline_s=CALL_TIMEOUT_S, transport="shm")
    try:
        assert isinstance(client.data, ShmDataPath)
        buffers = whole_parts()
        version = client.pull("w2", -1, buffers, rows={"embed": np.array([1], np.int64)}).version
        mapping = client.data._mapping
        doorbell = client.data._doorbell
        assert mapping is not None and doorbell is not None
        state = whole(probe)
        message = ps_pb2.FramedRequest(mapped=ps_pb2.ShmPushPullRequest(
            header=ps_pb2.PushHeader(worker_id="w2", base_version=version), attachment=mapping.attachment,
            pull_only=True))
        slices = [*tensor_slices("embed", np.array([1], np.int64), tensor_pb2.ROW_IDS),
                  *tensor_slices("b", np.ones(3, np.float32))]
        with pytest.raises(InvalidArgumentError, match="row ids"):
            doorbell.exchange("w2", message, slices)
        assert_unchanged(probe, state)
        assert client.pull("w2", -1, buffers, rows={"embed": np.array([1], np.int64)}).rows is not None
    finally:
        client.close()


# ------------------------------------------------------------------------------ generated tables


def test_a_generated_table_is_made_by_the_shard_and_read_by_rows(shard_factory: ShardLauncher) -> None:
    process = shard_factory(1)[0]
    spec = TableSpec((1000, 4), "float32", 2000, RowInit.parse("uniform:min=-1,max=1,seed=3"))
    control = GrpcShardTransport(process.address, deadline_s=CALL_TIMEOUT_S)
    tcp = connect_shard(process.address, deadline_s=CALL_TIMEOUT_S, transport="tcp")
    try:
        values = {"b": np.zeros(3, np.float32)}
        assert control.initialize("chief", 0, 1, RULE, values, generated={"emb": spec}).created
        assert not control.initialize("chief", 0, 1, RULE, values, generated={"emb": spec}).created  # identical
        assert ("emb", "float32", (1000, 4)) in control.stats().variables
        ids = np.array([0, 17, 999], np.int64)
        for path in (control, tcp):
            assert_rows(path.pull("w0", -1, rows={"emb": ids}), "emb", ids, spec.make())
    finally:
        tcp.close()
        control.close()


@pytest.mark.parametrize("table", [
    ps_pb2.GeneratedTable(name="emb", dtype=tensor_pb2.FLOAT32, shape=[10, 4], init="nope:seed=1"),
    ps_pb2.GeneratedTable(name="emb", dtype=tensor_pb2.FLOAT32, shape=[10, -4], init="zeros"),
    ps_pb2.GeneratedTable(name="emb", dtype=tensor_pb2.FLOAT32, shape=[], init="zeros"),
    ps_pb2.GeneratedTable(name="", dtype=tensor_pb2.FLOAT32, shape=[10, 4], init="zeros"),
    ps_pb2.GeneratedTable(name="emb", dtype=99, shape=[10, 4], init="zeros"),
    ps_pb2.GeneratedTable(name="emb", dtype=tensor_pb2.INT32, shape=[10, 4], init="zeros"),
], ids=["unknown-init", "negative-dim", "no-rows", "no-name", "bad-dtype", "int-table"])
def test_a_malformed_generated_table_is_invalid_argument(shard_factory: ShardLauncher,
                                                         table: ps_pb2.GeneratedTable) -> None:
    process = shard_factory(1)[0]
    channel = grpc.insecure_channel(process.address)
    call = channel.stream_unary("/asyncps.pb.ParameterServer/Initialize", request_serializer=identity,
                                response_deserializer=ps_pb2.InitializeResponse.FromString)
    header = ps_pb2.InitializeHeader(worker_id="evil", num_shards=1, generated=[table],
                                     rule=ps_pb2.UpdateRule(optimizer="sgd:learning_rate=1"))
    try:
        with pytest.raises(grpc.RpcError) as caught:
            call(iter([encode_frame(ps_pb2.InitializeChunk(header=header), [])]), timeout=CALL_TIMEOUT_S)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and caught.value.details()
    finally:
        channel.close()
    stats = GrpcShardTransport(process.address, deadline_s=CALL_TIMEOUT_S)
    try:
        assert not stats.stats().initialized
    finally:
        stats.close()


def test_a_pull_reply_frame_carries_rows_after_the_values(shard: ShardProcess) -> None:
    """The reply's layout, read by hand: header frame, dense values, then per part SPARSE_VALUES and
    ROW_CLOCKS named by the part (no SPARSE_INDICES: the reader asked the ids)."""
    channel, call = pull_call(shard.address)
    try:
        rows = [raw_chunk("embed", np.array([2, 3], np.int64), tensor_pb2.ROW_IDS)]
        frames = list(call(ps_pb2.PullRequest(worker_id="probe", rows=rows), timeout=CALL_TIMEOUT_S))
    finally:
        channel.close()
    chunks = [c for f in frames for c in decode_frame(f, parse_pull, "pull")[0].tensors]
    assert [(c.name, c.role) for c in chunks if c.name == "embed"] == [
        ("embed", tensor_pb2.SPARSE_VALUES), ("embed", tensor_pb2.ROW_CLOCKS)]
    assert {c.name for c in chunks if c.role == tensor_pb2.DENSE} == {"w", "b"}


# ------------------------------------------------------------------------------ keyed tables


@pytest.fixture(scope="module")
def keyed_shard(module_shard_factory: ShardLauncher) -> ShardProcess:
    """A shard holding a keyed table of 4 rows (asyncps.ps.keyed) beside a dense bias."""
    process = module_shard_factory(1)[0]
    control = GrpcShardTransport(process.address, deadline_s=CALL_TIMEOUT_S)
    spec = TableSpec((4, 2), "float32", 0, RowInit.parse("uniform:min=-1,max=1,seed=9"), keyed=True)
    assert control.initialize("chief", 0, 1, RULE, {"b": np.zeros(3, np.float32)}, generated={"keys": spec}).created
    control.close()
    return process


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_keyed_table_takes_keys_of_any_value_and_refuses_a_push_past_its_bound(
        keyed_shard: ShardProcess, transport: str) -> None:
    """Over each path: a read serves a key's initializer row, a push makes and trains rows by key; a push of more
    distinct keys than the part keeps is RESOURCE_EXHAUSTED, one of int32 keys or a whole gradient
    INVALID_ARGUMENT, each changing nothing, and the honest worker is served after."""
    big = np.iinfo(np.int64)
    keys = np.array([big.min, -7, 1 << 40, big.max], np.int64)
    client = connect_shard(keyed_shard.address, deadline_s=CALL_TIMEOUT_S, transport=transport)
    probe = GrpcShardTransport(keyed_shard.address, deadline_s=CALL_TIMEOUT_S)
    buffers = {"b": np.zeros(3, np.float32)}
    try:
        read = client.pull("w", -1, buffers, rows={"keys": keys}).rows
        assert read is not None
        on_its_path(client, transport)
        made = RowInit.parse("uniform:min=-1,max=1,seed=9").rows_at(keys, (2,), np.float32)
        before = probe.pull("probe", -1, rows={"keys": keys})
        assert before.rows is not None
        if transport == "grpc":  # the first path: the rows are still the initializer's
            np.testing.assert_array_equal(before.rows["keys"].values, made)
        version = before.version
        hostile: list[tuple[dict[str, Any], type[AsyncpsError], str]] = [
            ({"keys": SparseRows(np.arange(5, dtype=np.int64), np.ones((5, 2), np.float32))},
             ResourceExhaustedError, "5 distinct keys, more than the 4 rows"),
            ({"keys": SparseRows(np.array([1], np.int32), np.ones((1, 2), np.float32))},
             InvalidArgumentError, "must be int64"),
            ({"keys": np.ones((4, 2), np.float32)}, InvalidArgumentError, "takes rows by key"),
        ]
        for grads, error, message in hostile:
            with pytest.raises(error, match=message):
                client.push(PushRequest("evil", version, grads))
            after = probe.pull("probe", -1, rows={"keys": keys})
            assert after.version == version and after.rows is not None
            np.testing.assert_array_equal(after.rows["keys"].values, before.rows["keys"].values)
        outcome = client.push(PushRequest("w", version, {"keys": SparseRows(keys, np.ones((4, 2), np.float32),
                                                                            read["keys"].clocks)}))
        assert outcome.accepted
        trained = probe.pull("probe", -1, rows={"keys": keys}).rows
        assert trained is not None
        np.testing.assert_allclose(trained["keys"].values, before.rows["keys"].values - 1.0)
    finally:
        probe.close()
        client.close()
