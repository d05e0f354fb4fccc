"""Real shard processes over real gRPC: round trips, status codes, slicing, shutdown."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import numpy as np
import pytest
from asyncps.ps.main import EXIT_TERMINATED

from asyncps.errors import AlreadyExistsError, FailedPreconditionError, InvalidArgumentError
from asyncps.net.rpc import Unreachable, make_channel
from asyncps.net.security import SecurityConfig, check_health
from asyncps.pb import ps_pb2, tensor_pb2
from asyncps.placement import Placement, VariableSpec, place, split_for_shards
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.rules.drops import DropReason
from asyncps.transport import GrpcShardTransport, connect_model
from asyncps.wire.codec import SparseRows, iter_chunks
from asyncps.wire.frames import decode_frame, encode_frame, identity
from asyncps.wire.proto import SHARD_SERVICE, parse_pull, rule_to_proto
from asyncps.wire.shard import PushOutcome, PushRequest, StoreStats

if TYPE_CHECKING:
    from conftest import ShardLauncher, ShardProcess

CALL_TIMEOUT_S = 30.0
RULE = UpdateRuleConfig(OptimizerConfig("sgd", 1.0))
SHARD_INDEX = 2  # not 0, so a header or stats field left at its default shows
Code = grpc.StatusCode


def initial_values() -> dict[str, np.ndarray]:
    return {
        "w": np.arange(24, dtype=np.float32).reshape(6, 4),
        "b": np.array([1.0, -2.0, 3.0], dtype=np.float32),
    }


@dataclass
class Shard:
    """One initialized shard process with a typed client and a raw channel."""

    process: ShardProcess
    client: GrpcShardTransport
    channel: grpc.Channel

    def raw_pull(self, request: ps_pb2.PullRequest) -> list[ps_pb2.PullChunk]:
        """A Pull sent and read frame by frame, below the transport."""
        call = self.channel.unary_stream(f"/{SHARD_SERVICE}/Pull", response_deserializer=identity,
                                         request_serializer=ps_pb2.PullRequest.SerializeToString)
        return [decode_frame(frame, parse_pull, "test")[0] for frame in call(request, timeout=CALL_TIMEOUT_S)]

    def raw_push(self, method: str, messages: list[ps_pb2.PushChunk]) -> object:
        """Push or PushPull with hand-made messages, each sent as a frame with its bytes moved
        after the message."""
        frames = [frame_of(m) for m in messages]
        if method == "Push":
            return self.channel.stream_unary(f"/{SHARD_SERVICE}/Push", request_serializer=identity,
                                             response_deserializer=ps_pb2.PushResult.FromString)(
                iter(frames), timeout=CALL_TIMEOUT_S)
        call = self.channel.stream_stream(f"/{SHARD_SERVICE}/PushPull", request_serializer=identity,
                                          response_deserializer=identity)
        return list(call(iter(frames), timeout=CALL_TIMEOUT_S))

    def state(self) -> tuple[dict[str, np.ndarray], StoreStats]:
        """The shard's values (one pull), then its counters."""
        values = self.client.pull("probe").values
        stats = self.client.stats()
        assert values is not None
        return values, stats


@pytest.fixture(scope="module")
def shard(module_shard_factory: ShardLauncher) -> Iterator[Shard]:
    process = module_shard_factory(1, first_index=SHARD_INDEX)[0]
    # tiny chunks: every tensor of these tests travels as several chunks
    client = GrpcShardTransport(process.address, deadline_s=CALL_TIMEOUT_S, chunk_bytes=20,
                                call_timeout_s=CALL_TIMEOUT_S)
    reply = client.initialize("test", SHARD_INDEX, 3, RULE, initial_values())
    assert (reply.created, reply.version) == (True, 0)
    pulled = client.pull("test")
    assert pulled.version == 0 and pulled.values is not None
    assert_same_values(pulled.values, initial_values())
    channel = make_channel(process.address)
    yield Shard(process, client, channel)
    client.close()
    channel.close()


def assert_same_values(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert got[name].tobytes() == value.tobytes(), name


def frame_of(message: ps_pb2.PushChunk | ps_pb2.InitializeChunk) -> bytes:
    """A message with inline chunk bytes, as a raw frame (the bytes moved after the message)."""
    framed = type(message)()
    framed.CopyFrom(message)
    data = []
    for chunk in framed.tensors:
        data.append(memoryview(chunk.data))
        chunk.nbytes, chunk.data = len(chunk.data), b""
    return encode_frame(framed, data)


def assert_counters_equal(after: StoreStats, before: StoreStats) -> None:
    assert (after.version, after.pushes_accepted, after.pushes_dropped) == (
        before.version, before.pushes_accepted, before.pushes_dropped)


# ----------------------------------------------------------------------------- round trips


def test_shard_answers_the_standard_health_check(shard: Shard) -> None:
    assert check_health(shard.process.address, SecurityConfig())


def test_identical_initialize_is_accepted_and_conflicts_are_already_exists(shard: Shard) -> None:
    values, before = shard.state()
    reply = shard.client.initialize("other", SHARD_INDEX, 3, RULE, initial_values())
    assert (reply.created, reply.version) == (False, before.version)
    other_rule = UpdateRuleConfig(OptimizerConfig("sgd", 0.5))
    conflicts = [
        (other_rule, initial_values(), "different rule"),
        (RULE, {**initial_values(), "w": np.zeros((4, 6), np.float32)},
         "w: already initialized as"),
        (RULE, {"w": initial_values()["w"]}, "already initialized with variables"),
    ]
    for rule, conflicting, message in conflicts:
        with pytest.raises(AlreadyExistsError) as info:
            shard.client.initialize("other", SHARD_INDEX, 3, rule, conflicting)
        assert info.value.code == "ALREADY_EXISTS"
        assert message in info.value.detail
    after_values, after = shard.state()
    assert_same_values(after_values, values)
    assert_counters_equal(after, before)
    assert after.rule == RULE


def test_pull_round_trip_and_not_modified(shard: Shard) -> None:
    values, stats = shard.state()
    reply = shard.client.pull("t", if_newer_than=stats.version - 1)
    assert reply.version == stats.version and reply.values is not None
    assert_same_values(reply.values, values)
    assert shard.client.pull("t", if_newer_than=stats.version).values is None
    stream = shard.raw_pull(ps_pb2.PullRequest(if_newer_than=stats.version))
    assert len(stream) == 1 and stream[0].HasField("header") and not stream[0].tensors
    header = stream[0].header
    assert (header.version, header.not_modified, header.shard_index) == (
        stats.version, True, SHARD_INDEX)
    # pulling into caller buffers fills them in place
    buffers = {name: np.zeros_like(value) for name, value in values.items()}
    filled = shard.client.pull("t", buffers=buffers).values
    assert filled is not None and all(filled[n] is buffers[n] for n in buffers)
    assert_same_values(buffers, values)


def test_push_and_push_pull_round_trip(shard: Shard) -> None:
    values, stats = shard.state()
    v0 = stats.version
    grad = {"w": np.full((6, 4), 2.0, np.float32), "b": np.array([1, 2, 3], np.float32)}
    result = shard.client.push(PushRequest("t", v0, grad, step=7, loss=0.25))
    assert (result.accepted, result.staleness, result.version) == (True, 0, v0 + 1)
    assert (result.effective_lr, result.drop, result.detail) == (1.0, None, "")
    expected = {n: values[n] - grad[n] for n in values}
    assert_same_values(shard.state()[0], expected)

    # computed from v0, arriving at v0 + 1: staleness 1, and the reply carries the new model
    result, reply = shard.client.push_pull(PushRequest("t", v0, {"b": np.ones(3, np.float32)}))
    assert (result.accepted, result.staleness, result.version) == (True, 1, v0 + 2)
    expected["b"] = expected["b"] - 1
    assert reply.version == v0 + 2 and reply.values is not None
    assert_same_values(reply.values, expected)

    result, reply = shard.client.push_pull(PushRequest("t", v0 + 2, {"b": np.ones(3, np.float32)}),
                                           pull_if_newer_than=v0 + 3)
    assert (result.accepted, result.version) == (True, v0 + 3)
    assert reply.version == v0 + 3 and reply.values is None  # not newer than asked
    after_values, after = shard.state()
    expected["b"] = expected["b"] - 1
    assert_same_values(after_values, expected)
    assert (after.version, after.pushes_accepted) == (v0 + 3, stats.pushes_accepted + 3)


def test_stats_round_trip_and_byte_counters(shard: Shard) -> None:
    _, before = shard.state()
    assert before.shard_index == SHARD_INDEX and before.initialized
    assert list(before.variables) == [("b", "float32", (3,)), ("w", "float32", (6, 4))]
    assert before.rule == RULE
    assert before.version == before.pushes_accepted and before.pushes_dropped == 0
    shard.client.pull("t")
    shard.client.push(PushRequest("t", before.version, {"w": np.zeros((6, 4), np.float32)}))
    after = shard.client.stats()
    assert after.bytes_pulled - before.bytes_pulled == (24 + 3) * 4  # one whole model

    assert after.bytes_pushed - before.bytes_pushed == 24 * 4
    assert after.version == before.version + 1


def test_long_poll_pull_returns_when_a_push_lands(shard: Shard) -> None:
    _, stats = shard.state()
    replies = []

    def poll() -> None:
        replies.append(shard.client.pull("poller", stats.version, wait_timeout_s=CALL_TIMEOUT_S))

    started = time.monotonic()
    poller = threading.Thread(target=poll)
    poller.start()
    shard.client.push(PushRequest("t", stats.version, {"b": np.zeros(3, np.float32)}))
    poller.join(2 * CALL_TIMEOUT_S)
    assert not poller.is_alive()
    assert len(replies) == 1 and replies[0].version == stats.version + 1
    assert replies[0].values is not None
    assert time.monotonic() - started < CALL_TIMEOUT_S / 2  # woken by the push, not the timeout


def test_long_poll_pull_times_out_not_modified(shard: Shard) -> None:
    _, stats = shard.state()
    started = time.monotonic()
    reply = shard.client.pull("poller", stats.version, wait_timeout_s=0.3)
    assert time.monotonic() - started >= 0.29
    assert reply.version == stats.version and reply.values is None


# ----------------------------------------------------------------------------- bad input


def header(base_version: int) -> ps_pb2.PushHeader:
    return ps_pb2.PushHeader(worker_id="bad", base_version=base_version)


def tensors(name: str, value: np.ndarray, role: int = tensor_pb2.DENSE,
            chunk_bytes: int = 8) -> list[tensor_pb2.TensorChunk]:
    return list(iter_chunks(name, value, role, chunk_bytes))


def raw(name: str, dtype: int, shape: list[int], data: bytes,
        offset: int = 0) -> tensor_pb2.TensorChunk:
    return tensor_pb2.TensorChunk(name=name, dtype=dtype, shape=shape, offset=offset, data=data)


def one_per_frame(
    items: list[ps_pb2.PushHeader | tensor_pb2.TensorChunk],
) -> list[ps_pb2.PushChunk]:
    """A stream with every header and every tensor chunk in a frame of its own."""
    return [ps_pb2.PushChunk(header=item) if isinstance(item, ps_pb2.PushHeader)
            else ps_pb2.PushChunk(tensors=[item]) for item in items]


ONES_B = np.ones(3, np.float32)
B_BYTES = ONES_B.tobytes()
F32 = tensor_pb2.FLOAT32
Builder = Callable[[int], list[ps_pb2.PushHeader | tensor_pb2.TensorChunk]]

BAD_PUSHES: dict[str, tuple[Builder, Code, str]] = {
    "unknown-variable": (lambda v: [header(v), *tensors("nope", ONES_B)], Code.NOT_FOUND,
                         "unknown variable 'nope'"),
    "unknown-beside-valid": (lambda v: [header(v), *tensors("b", ONES_B), *tensors("nope", ONES_B)],
                             Code.NOT_FOUND, "unknown variable 'nope'"),
    "shape": (lambda v: [header(v), *tensors("w", np.ones((4, 6), np.float32))],
              Code.INVALID_ARGUMENT, "gradient shape [4, 6] != variable shape [6, 4]"),
    "dtype": (lambda v: [header(v), *tensors("b", np.ones(3, np.float64))],
              Code.INVALID_ARGUMENT, "gradient dtype float64 != variable dtype float32"),
    "nan": (lambda v: [header(v), *tensors("b", np.array([0, np.nan, 0], np.float32))],
            Code.INVALID_ARGUMENT, "b: gradient contains NaN or Inf"),
    "inf": (lambda v: [header(v), *tensors("w", np.full((6, 4), -np.inf, np.float32))],
            Code.INVALID_ARGUMENT, "w: gradient contains NaN or Inf"),
    "nan-beside-valid": (lambda v: [header(v), *tensors("w", np.ones((6, 4), np.float32)),
                                    *tensors("b", np.array([np.nan] * 3, np.float32))],
                         Code.INVALID_ARGUMENT, "b: gradient contains NaN or Inf"),
    "future-base-version": (lambda v: [header(v + 1), *tensors("b", ONES_B)],
                            Code.INVALID_ARGUMENT, "is from the future"),
    "negative-base-version": (lambda v: [header(-1), *tensors("b", ONES_B)],
                              Code.INVALID_ARGUMENT, "base_version must be >= 0"),
    "tensor-before-header": (lambda v: [*tensors("b", ONES_B), header(v)],
                             Code.INVALID_ARGUMENT, "the first frame has no header"),
    "two-headers": (lambda v: [header(v), header(v), *tensors("b", ONES_B)],
                    Code.INVALID_ARGUMENT, "header in frame 1; it belongs in the first frame only"),
    "no-header": (lambda v: [], Code.INVALID_ARGUMENT, "empty stream (no header)"),
    "no-gradients": (lambda v: [header(v)], Code.INVALID_ARGUMENT, "push without gradients"),
    "bytes-short": (lambda v: [header(v), raw("b", F32, [3], B_BYTES[:8])],
                    Code.INVALID_ARGUMENT, "b: received 8 of 12 bytes"),
    "bytes-long": (lambda v: [header(v), raw("b", F32, [3], B_BYTES + b"\0" * 4)],
                   Code.INVALID_ARGUMENT, "16 bytes for a float32[3] tensor of 12 bytes"),
    "offset-gap": (lambda v: [header(v), raw("b", F32, [3], B_BYTES[:4]),
                              raw("b", F32, [3], B_BYTES[8:], offset=8)],
                   Code.INVALID_ARGUMENT, "chunk at byte offset 8, expected 4"),
    "shape-changes-between-chunks": (lambda v: [header(v), raw("b", F32, [3], B_BYTES[:4]),
                                                raw("b", F32, [1, 3], B_BYTES[4:], offset=4)],
                                     Code.INVALID_ARGUMENT, "earlier chunks said float32[3]"),
    "unknown-dtype": (lambda v: [header(v), raw("b", 99, [3], B_BYTES)],
                      Code.INVALID_ARGUMENT, "unknown dtype code 99"),
    "negative-dim": (lambda v: [header(v), raw("b", F32, [-3], b"")],
                     Code.INVALID_ARGUMENT, "negative dimension"),
    "too-big": (lambda v: [header(v), raw("b", F32, [1 << 40], b"")],
                Code.RESOURCE_EXHAUSTED, "limit"),
    "sparse-index-out-of-range": (
        lambda v: [header(v), *tensors("w", np.array([0, 6], np.int64), tensor_pb2.SPARSE_INDICES),
                   *tensors("w", np.ones((2, 4), np.float32), tensor_pb2.SPARSE_VALUES)],
        Code.INVALID_ARGUMENT, "sparse row index outside [0, 6)"),
    "sparse-indices-without-values": (
        lambda v: [header(v), *tensors("w", np.array([0], np.int64), tensor_pb2.SPARSE_INDICES)],
        Code.INVALID_ARGUMENT, "sparse indices without values"),
    "sparse-count-mismatch": (
        lambda v: [header(v), *tensors("w", np.array([0, 1], np.int64), tensor_pb2.SPARSE_INDICES),
                   *tensors("w", np.ones((1, 4), np.float32), tensor_pb2.SPARSE_VALUES)],
        Code.INVALID_ARGUMENT, "2 indices but values of shape [1, 4]"),
}


# PushPull shares Push's input handling: a sample of its cases is enough
BAD_PUSH_CALLS = [(case, "Push") for case in BAD_PUSHES] + [
    (case, "PushPull") for case in ("unknown-variable", "nan", "tensor-before-header")]


@pytest.mark.parametrize("case, method", BAD_PUSH_CALLS)
def test_bad_push_gets_its_status_code_and_changes_nothing(shard: Shard, case: str,
                                                           method: str) -> None:
    build, code, message = BAD_PUSHES[case]
    values, before = shard.state()
    with pytest.raises(grpc.RpcError) as info:
        shard.raw_push(method, one_per_frame(build(before.version)))
    assert info.value.code() == code, info.value.details()
    assert message in info.value.details()
    # the shard still serves, with its values and version untouched
    after_values, after = shard.state()
    assert_same_values(after_values, values)
    assert_counters_equal(after, before)


def test_uninitialized_shard_refuses_pushes_and_pulls(shard_server: str) -> None:
    client = GrpcShardTransport(shard_server, deadline_s=CALL_TIMEOUT_S, call_timeout_s=CALL_TIMEOUT_S)
    stats = client.stats()
    assert (stats.initialized, stats.version, stats.shard_index, len(stats.variables)) == (
        False, 0, 0, 0)
    with pytest.raises(FailedPreconditionError) as info:
        client.push(PushRequest("t", 0, {"b": ONES_B}))
    assert info.value.code == "FAILED_PRECONDITION"
    assert "shard 0 is not initialized" in info.value.detail
    # training calls ride through a shard waiting to be restored, until their deadline
    patient = GrpcShardTransport(shard_server, deadline_s=1.0, call_timeout_s=CALL_TIMEOUT_S)
    for name, call in {"push_pull": lambda: patient.push_pull(PushRequest("t", 0, {"b": ONES_B})),
                       "pull": lambda: patient.pull("t")}.items():
        with pytest.raises(Unreachable) as unreachable:
            call()
        assert "FAILED_PRECONDITION" in str(unreachable.value), name
        assert "shard 0 is not initialized" in str(unreachable.value), name
    # the chief's client does not: it is the one that restores the shard (a cut reading it fails at once)
    chiefs = connect_model("chief", [shard_server], place([VariableSpec("b", (3,), "float32")], 1), deadline_s=30.0,
                           ride_restarts=False)
    started = time.monotonic()
    with pytest.raises(FailedPreconditionError) as failed:
        chiefs.pull()
    assert failed.value.code == "FAILED_PRECONDITION" and time.monotonic() - started < 10.0
    chiefs.close()
    bad_inits = [
        (RULE, {"b": np.array([np.inf, 0, 0], np.float32)}, "NaN or Inf"),
        (RULE, {"i": np.arange(3, dtype=np.int32)}, "floating point"),
    ]
    for rule, values, message in bad_inits:
        with pytest.raises(InvalidArgumentError) as invalid:
            client.initialize("t", 0, 1, rule, values)
        assert invalid.value.code == "INVALID_ARGUMENT" and message in invalid.value.detail
    # a bad rule and sparse initial values cannot be expressed through the transport: send them raw
    channel = make_channel(shard_server)
    initialize = channel.stream_unary(f"/{SHARD_SERVICE}/Initialize", request_serializer=identity,
                                      response_deserializer=ps_pb2.InitializeResponse.FromString)
    bad_rule = ps_pb2.UpdateRule(optimizer="rmsprop:lr=0.1")
    with pytest.raises(grpc.RpcError) as info:
        initialize(iter([frame_of(ps_pb2.InitializeChunk(
            header=ps_pb2.InitializeHeader(rule=bad_rule), tensors=tensors("b", ONES_B)))]), timeout=CALL_TIMEOUT_S)
    assert info.value.code() == Code.INVALID_ARGUMENT and "bad update rule" in info.value.details()
    sparse_init = [ps_pb2.InitializeChunk(
        header=ps_pb2.InitializeHeader(rule=rule_to_proto(RULE)),
        tensors=tensors("b", np.array([0], np.int64), tensor_pb2.SPARSE_INDICES)
        + tensors("b", np.ones(1, np.float32), tensor_pb2.SPARSE_VALUES))]
    with pytest.raises(grpc.RpcError) as info:
        initialize(iter([frame_of(m) for m in sparse_init]), timeout=CALL_TIMEOUT_S)
    channel.close()
    assert info.value.code() == Code.INVALID_ARGUMENT
    assert "initial values must be dense" in info.value.details()
    assert not client.stats().initialized
    assert client.initialize("t", 0, 1, RULE, initial_values()).created
    assert client.stats().initialized
    client.close()


def test_a_shard_that_placement_leaves_empty_can_be_initialized(shard_server: str) -> None:
    placement = place([VariableSpec("kernel", (64, 10)), VariableSpec("bias", (10,))], 3)
    per_shard = split_for_shards(placement, {"kernel": np.zeros((64, 10), np.float32),
                                             "bias": np.zeros(10, np.float32)})
    assert per_shard[2] == {}
    client = GrpcShardTransport(shard_server, deadline_s=CALL_TIMEOUT_S, call_timeout_s=CALL_TIMEOUT_S)
    try:
        assert client.initialize("chief", 2, 3, RULE, per_shard[2]).created
        assert client.stats().initialized
    finally:
        client.close()


# ----------------------------------------------------------------------------- concurrency


def test_concurrent_pushers_over_grpc_lose_nothing(shard: Shard) -> None:
    pushers_n, pushes_n = 4, 25
    values, before = shard.state()
    start = threading.Barrier(pushers_n)
    results: list[list[PushOutcome]] = [[] for _ in range(pushers_n)]
    errors: list[BaseException] = []

    def pusher(t: int) -> None:
        client = GrpcShardTransport(shard.process.address, deadline_s=CALL_TIMEOUT_S,
                                    call_timeout_s=CALL_TIMEOUT_S)
        try:
            start.wait()
            for j in range(pushes_n):
                c = float(t * pushes_n + j + 1)  # integer-valued: sums are exact in float32
                grads = {"w": np.full((6, 4), c, np.float32), "b": np.full(3, c, np.float32)}
                results[t].append(client.push(PushRequest(f"w{t}", before.version, grads)))
        except BaseException as exc:  # reported below: a thread's exception is otherwise lost
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=pusher, args=(t,)) for t in range(pushers_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(4 * CALL_TIMEOUT_S)
        assert not thread.is_alive()
    assert not errors, errors
    total = pushers_n * pushes_n
    flat = [r for per_thread in results for r in per_thread]
    assert len(flat) == total and all(r.accepted for r in flat)
    first = before.version + 1
    assert sorted(r.version for r in flat) == list(range(first, first + total))
    grad_sum = total * (total + 1) / 2
    after_values, after = shard.state()
    assert_same_values(after_values, {n: values[n] - grad_sum for n in values})
    assert (after.version, after.pushes_accepted) == (
        before.version + total, before.pushes_accepted + total)


# ----------------------------------------------------------------------------- sliced model


@dataclass
class SlicedModel:
    """Two shard processes holding a model whose large variables are sliced over both."""

    addresses: list[str]
    placement: Placement
    initial: dict[str, np.ndarray]


BIG_SHAPE = (5000, 2000)  # 40 MB of float32
EMB_SHAPE = (1200, 64)  # 300 KiB: over the slice threshold too


@pytest.fixture(scope="module")
def sliced_model(module_shard_factory: ShardLauncher) -> SlicedModel:
    addresses = [s.address for s in module_shard_factory(2)]
    specs = [VariableSpec("big", BIG_SHAPE), VariableSpec("emb", EMB_SHAPE),
             VariableSpec("bias", (64,))]
    placement = place(specs, 2)
    assert [len(placement.parts_of(s.name)) for s in specs] == [2, 2, 1]
    rng = np.random.default_rng(0)
    initial = {
        "big": rng.standard_normal(BIG_SHAPE, dtype=np.float32),
        "emb": rng.integers(-50, 50, EMB_SHAPE).astype(np.float32),
        "bias": np.arange(64, dtype=np.float32),
    }
    model = connect_model("init", addresses, placement, deadline_s=CALL_TIMEOUT_S)
    for shard, values in enumerate(split_for_shards(placement, initial)):
        assert model.shards[shard].initialize("init", shard, 2, RULE, values).created
    model.close()
    return SlicedModel(addresses, placement, initial)


def test_sliced_40mb_variable_is_reassembled_exactly(sliced_model: SlicedModel) -> None:
    model = connect_model("t", sliced_model.addresses, sliced_model.placement, deadline_s=CALL_TIMEOUT_S)
    buffers = {name: id(value) for name, value in model.values.items()}
    versions = model.pull()
    assert versions == [0, 0]  # the first test on these shards
    assert_same_values(model.values, sliced_model.initial)
    assert {name: id(value) for name, value in model.values.items()} == buffers  # in place
    for shard, client in enumerate(model.shards):
        names = [name for name, _, _ in client.stats().variables]
        assert names == sorted(p.name for p in sliced_model.placement.parts_on(shard))
    assert model.pull(only_if_newer=True) == versions  # nothing newer: headers only
    model.close()


def _pull_fresh(sliced_model: SlicedModel) -> dict[str, np.ndarray]:
    model = connect_model("check", sliced_model.addresses, sliced_model.placement, deadline_s=CALL_TIMEOUT_S)
    model.pull()
    model.close()
    return model.values


def test_sparse_push_across_a_slice_boundary_touches_only_its_rows(
    sliced_model: SlicedModel,
) -> None:
    model = connect_model("t", sliced_model.addresses, sliced_model.placement, deadline_s=CALL_TIMEOUT_S)
    before_versions = model.pull()
    before = {name: value.copy() for name, value in model.values.items()}
    emb_parts = sliced_model.placement.parts_of("emb")
    boundary = emb_parts[0].row_stop
    assert boundary == 600
    indices = np.array([3, boundary - 1, boundary, EMB_SHAPE[0] - 1, 3], np.int64)
    rows = np.arange(5 * 64, dtype=np.float32).reshape(5, 64)
    grads = {"emb": SparseRows(indices, rows),
             "bias": SparseRows(np.array([0, 63], np.int64), np.array([5.0, -5.0], np.float32))}
    results = model.push_pull(grads, step=1, loss=0.5)
    assert [r.shard for r in results] == [0, 1]
    assert all(r.outcome is not None and r.outcome.accepted and r.outcome.staleness == 0 for r in results)
    assert [r.version for r in results] == [v + 1 for v in before_versions]

    expected = {name: value.copy() for name, value in before.items()}
    expected["emb"][3] -= rows[0] + rows[4]
    for i in (1, 2, 3):
        expected["emb"][indices[i]] -= rows[i]
    expected["bias"][[0, 63]] -= [5.0, -5.0]
    assert_same_values(model.values, expected)  # the values pulled in the same round trip
    assert_same_values(_pull_fresh(sliced_model), expected)  # and what the shards hold
    model.close()


def test_sparse_push_inside_one_slice_leaves_the_other_shard_alone(
    sliced_model: SlicedModel,
) -> None:
    model = connect_model("t", sliced_model.addresses, sliced_model.placement, deadline_s=CALL_TIMEOUT_S)
    before_versions = model.pull()
    before = {name: value.copy() for name, value in model.values.items()}
    upper = sliced_model.placement.parts_of("emb")[1]
    indices = np.array([upper.row_start + 1, upper.row_stop - 1], np.int64)
    rows = np.ones((2, 64), np.float32)
    results = model.push_pull({"emb": SparseRows(indices, rows)}, step=2, loss=0.5)
    by_shard = {r.shard: r for r in results}
    touched, other = upper.shard, 1 - upper.shard
    outcome = by_shard[touched].outcome
    assert outcome is not None and outcome.accepted
    assert by_shard[touched].version == before_versions[touched] + 1
    assert by_shard[other].outcome is None  # nothing sent: only a pull
    assert by_shard[other].version == before_versions[other]
    expected = {name: value.copy() for name, value in before.items()}
    expected["emb"][indices] -= 1.0
    assert_same_values(_pull_fresh(sliced_model), expected)
    assert [c.stats().version for c in model.shards] == [
        before_versions[0] + (touched == 0), before_versions[1] + (touched == 1)]
    model.close()


# ----------------------------------------------------------------------------- shutdown


def test_shutdown_rpc_makes_the_process_exit_cleanly(shard_factory: ShardLauncher) -> None:
    process = shard_factory(1)[0]
    assert check_health(process.address, SecurityConfig())
    client = GrpcShardTransport(process.address, deadline_s=CALL_TIMEOUT_S)
    client.shutdown("tests are done")
    client.close()
    assert process.process.wait(timeout=30) == 0, process.log_tail()
    assert "shutdown requested: tests are done" in process.log_tail()
    assert not check_health(process.address, SecurityConfig(), timeout_s=2.0)


def test_sigterm_is_not_the_runs_end_the_shard_exits_143(shard_factory: ShardLauncher) -> None:
    """An orchestrator's SIGTERM (a task replaced) exits 143, so an on-failure restart policy brings the shard back;
    only the chief's Shutdown exits 0 (swarm read a SIGTERMed shard's 0 as "Complete" and never replaced it)."""
    process = shard_factory(1)[0]
    process.process.terminate()
    assert process.process.wait(timeout=30) == EXIT_TERMINATED, process.log_tail()
    assert f"stopped by SIGTERM: exiting {EXIT_TERMINATED}" in process.log_tail()


def test_a_shards_refusal_of_a_non_finite_gradient_is_a_dropped_push_not_an_exception(
    sliced_model: SlicedModel,
) -> None:
    """The shard refuses NaN with INVALID_ARGUMENT typed as non-finite: the worker's client reports a
    dropped push (DropReason.NONFINITE) for that shard, as for a step the worker skipped itself."""
    model = connect_model("nan", sliced_model.addresses, sliced_model.placement, deadline_s=CALL_TIMEOUT_S)
    versions = model.pull()
    grad = np.ones(64, np.float32)
    grad[3] = np.nan
    results = model.push_pull({"bias": grad}, step=0, loss=1.0)
    refused = [r for r in results if r.outcome is not None]
    assert len(refused) == 1 and refused[0].outcome is not None
    assert refused[0].outcome.drop is DropReason.NONFINITE and not refused[0].outcome.accepted
    assert "NaN or Inf" in refused[0].outcome.detail
    assert model.pull() == versions  # nothing applied
    model.close()
