"""Hostile input against real shard processes: malformed requests for every RPC, made by hypothesis.

Every request is built here as protobuf messages and sent through bare gRPC callables, so nothing
is sanitized on the way: the tensor streams, raw frames on the wire (asyncps/wire/frames.py), are
converted as they are, tensor bytes moved out of each chunk's `data` into the frame's payload (see
Shard.send); frame-level defects have their own test. Each request is a
valid request with a set of *defects* applied; every defect names the status codes it may cause. A
request with defects must fail with one of those codes (so never INTERNAL or UNKNOWN) and a
message, and change nothing; a request without defects must succeed, and its effect is accounted
for exactly. After every example the shard must still answer GetStats and hold exactly the expected
values, version and counters.

Three shard processes serve the module: the fuzzed one (initialized once: SGD, a 2-D, a 1-D, a 0-d
and a float64 variable), one never initialized, and a scratch one for tests that replace state.
At the end: regression tests for the bugs these tests found (all fixed). The number of generated
requests is printed when the module finishes.
"""

from __future__ import annotations

import collections
import copy
import itertools
import math
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

import grpc
import numpy as np
import pytest
from asyncps.ps.servicer import DEFAULT_MAX_REQUEST_BYTES
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncps.net.rpc import MAX_MESSAGE_BYTES
from asyncps.pb import ps_pb2, tensor_pb2
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.transport import GrpcShardTransport
from asyncps.wire.codec import MAX_RANK, SparseRows, TensorAssembler, dtype_from_proto, dtype_to_proto, wire_array
from asyncps.wire.frames import decode_frame, encode_frame, identity, parser, read_frames
from asyncps.wire.proto import FRAMED_REPLIES, FRAMED_REQUESTS, SHARD_SERVICE, rule_from_proto, rule_to_proto
from asyncps.wire.shard import Snapshot

if TYPE_CHECKING:
    from conftest import ShardLauncher, ShardProcess

Code = grpc.StatusCode
Codes = frozenset[grpc.StatusCode]
INVALID: Codes = frozenset({Code.INVALID_ARGUMENT})
TOO_LARGE: Codes = frozenset({Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED})
NOT_FOUND: Codes = frozenset({Code.NOT_FOUND})
CONFLICT: Codes = frozenset({Code.ALREADY_EXISTS})
NOT_INITIALIZED: Codes = frozenset({Code.FAILED_PRECONDITION})
NONE: Codes = frozenset()

CALL_TIMEOUT_S = 20.0
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
RULE = rule_to_proto(UpdateRuleConfig(OptimizerConfig("sgd", 1.0)))


def initial_values() -> dict[str, np.ndarray]:
    """The shard's variables: 2-D, 1-D, 0-d float32 and a float64 one; small integers, so SGD with
    lr=1 and integer gradients stays exact and the expected values are computable bit for bit."""
    return {
        "w": (np.arange(24, dtype=np.float32) - 12).reshape(6, 4),
        "b": np.array([1, -2, 3], np.float32),
        "s": np.array(5, np.float32),
        "d": np.array([2, -3], np.float64),
    }


VARIABLES = initial_values()
ROWS_OF = {name: value.shape[0] for name, value in VARIABLES.items() if value.ndim}

# ---------------------------------------------------------------------------- request tally

SENT: collections.Counter[str] = collections.Counter()  # generated requests per RPC
REJECTED: collections.Counter[str] = collections.Counter()  # ... refused with an expected status
DROPPED: collections.Counter[str] = collections.Counter()  # ... pushes dropped (stale incarnation)


@pytest.fixture(scope="module", autouse=True)
def request_tally(pytestconfig: pytest.Config) -> Iterator[None]:
    """Print how many generated requests the module sent (the number a report quotes)."""
    yield
    by_rpc = ", ".join(f"{rpc} {n}/{REJECTED[rpc]}" for rpc, n in sorted(SENT.items()))
    line = (f"hostile input: {sum(SENT.values())} generated requests sent, {sum(REJECTED.values())} of them "
            f"malformed and rejected with an expected status, {sum(DROPPED.values())} pushes dropped for a "
            f"stale incarnation, the rest valid and answered as expected (sent/rejected per RPC: {by_rpc})")
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write("\n" + line + "\n")  # after the progress dots
    else:
        print(line)


# ----------------------------------------------------------------------------- the shards


@dataclass
class State:
    """What a shard holds: values, version, counters and incarnation."""

    values: dict[str, np.ndarray]
    version: int
    accepted: int
    dropped: int
    incarnation: int

    def copy(self) -> State:
        return State({n: v.copy() for n, v in self.values.items()}, self.version, self.accepted,
                     self.dropped, self.incarnation)

    def apply(self, grads: dict[str, Any]) -> None:
        """SGD with lr=1 on integer-valued gradients: exact, whatever the order."""
        for name, grad in grads.items():
            value = self.values[name].copy()
            if isinstance(grad, SparseRows):
                np.subtract.at(value, grad.indices, grad.values)
            else:
                value -= grad
            self.values[name] = value
        self.version += 1
        self.accepted += 1


@dataclass
class Outcome:
    """A reply, or the error the call failed with."""

    reply: Any
    error: grpc.RpcError | None

    @property
    def code(self) -> grpc.StatusCode:
        return Code.OK if self.error is None else self.error.code()


# ------------------------------------------------------------------- the wire, frames included

SERVICE = ps_pb2.DESCRIPTOR.services_by_name[SHARD_SERVICE.rpartition(".")[2]]
assert SERVICE.full_name == SHARD_SERVICE
# The messages of a tensor stream (one per frame): a header, then TensorChunks.
ChunkMessage = ps_pb2.InitializeChunk | ps_pb2.PushChunk | ps_pb2.PullChunk | ps_pb2.SnapshotChunk
M = TypeVar("M", ps_pb2.InitializeChunk, ps_pb2.PushChunk, ps_pb2.PullChunk, ps_pb2.SnapshotChunk)


def method_of(rpc: str) -> MethodDescriptor:
    return SERVICE.methods_by_name[rpc]


def message_type(descriptor: Any) -> type[Message]:
    return message_factory.GetMessageClass(descriptor)


def rpc_callable(channel: grpc.Channel, rpc: str, raw: bool = False) -> Callable[..., Any]:
    """A bare callable for one method of the shard service: raw frames (bytes) in the directions that
    carry them, protobuf messages in the others (bytes both ways with raw)."""
    method = method_of(rpc)
    factory: dict[tuple[bool, bool], Callable[..., Any]] = {
        (False, False): channel.unary_unary, (False, True): channel.unary_stream,
        (True, False): channel.stream_unary, (True, True): channel.stream_stream}
    serialize = identity if raw or rpc in FRAMED_REQUESTS else message_type(method.input_type).SerializeToString
    deserialize = identity if raw or rpc in FRAMED_REPLIES else message_type(method.output_type).FromString
    return factory[(method.client_streaming, method.server_streaming)](  # type: ignore[no-any-return]
        f"/{SHARD_SERVICE}/{rpc}", request_serializer=serialize, response_deserializer=deserialize)


def lean(message: ChunkMessage) -> tuple[ChunkMessage, list[memoryview]]:
    """A stream message as a frame carries it: each chunk's bytes moved out of `data` (nbytes set)."""
    out = copy.deepcopy(message)
    data = []
    for chunk in out.tensors:
        data.append(memoryview(chunk.data))
        chunk.nbytes = len(chunk.data)
        chunk.ClearField("data")
    return out, data


def to_frame(message: ChunkMessage) -> bytes:
    """The frame of one generated stream message, its defects kept."""
    return encode_frame(*lean(message))  # type: ignore[arg-type]


def from_frame(frame: bytes, reply: type[M], rpc: str) -> M:
    """A received frame as a stream message with each chunk's bytes back in `data`."""
    message, data = decode_frame(frame, parser(reply), f"{rpc} reply")
    for chunk, view in zip(message.tensors, data, strict=True):
        chunk.data = bytes(view)
        chunk.ClearField("nbytes")
    return message


class Shard:
    """One shard process reached through bare gRPC callables, with the state last verified."""

    def __init__(self, process: ShardProcess) -> None:
        self.process = process
        self.address = address = process.address
        # no size limits on the client side: the server's limits are the ones under test
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1),
                                                               ("grpc.max_receive_message_length", -1)])
        self.calls = {method.name: rpc_callable(self.channel, method.name) for method in SERVICE.methods}
        self._verified: State | None = None
        # per worker id: the step (not 0) and answer of its last push the shard applied; the same step again is
        # a retry, answered again and not applied (ShardStore._retries): what the fuzzed pushes have left
        self.last_push: dict[str, tuple[int, ps_pb2.PushResult]] = {}

    def send(self, rpc: str, request: Any, timeout: float | None = CALL_TIMEOUT_S) -> Outcome:
        """Send one generated request (counted); streams are lists of messages (frames once sent;
        ready-made frames, bytes, go as they are), and streamed replies come back as messages."""
        SENT[rpc] += 1
        method = method_of(rpc)
        if rpc in FRAMED_REQUESTS:
            request = [m if isinstance(m, bytes) else to_frame(m) for m in request]
        if method.client_streaming:
            request = iter(request)
        try:
            reply = self.calls[rpc](request, timeout=timeout)
            if method.server_streaming:
                reply = list(reply)
        except grpc.RpcError as exc:
            return Outcome(None, exc)
        if rpc in FRAMED_REPLIES:
            reply_type = cast("type[ChunkMessage]", message_type(method.output_type))
            reply = [from_frame(frame, reply_type, rpc) for frame in reply]  # type: ignore[type-var]
        return Outcome(reply, None)

    def stats(self, timeout: float = CALL_TIMEOUT_S) -> ps_pb2.ShardStats:
        """GetStats, not counted as a request."""
        return self.calls["GetStats"](ps_pb2.StatsRequest(), timeout=timeout)  # type: ignore[no-any-return]

    def alive(self) -> None:
        """The process has not crashed (a dead shard would only show as UNAVAILABLE otherwise)."""
        code = self.process.process.poll()
        assert code is None, f"the shard process exited with {code}:\n{self.process.log_tail()}"

    def observe(self) -> State:
        """The shard's state, read with one GetStats and one Pull (not counted as requests)."""
        self.alive()
        stats = self.stats()
        assert stats.initialized
        frames = self.calls["Pull"](ps_pb2.PullRequest(worker_id="probe", if_newer_than=-1), timeout=CALL_TIMEOUT_S)
        stream = [from_frame(frame, ps_pb2.PullChunk, "Pull") for frame in frames]
        header, values = assemble_pull(stream)
        assert values is not None and header.version == stats.version
        return State(values, stats.version, stats.pushes_accepted, stats.pushes_dropped, header.incarnation)

    def begin(self) -> State:
        """The state an example starts from (the last verified one, or a fresh reading)."""
        state = self._verified if self._verified is not None else self.observe()
        self._verified = None
        return state.copy()

    def verify(self, expected: State) -> None:
        """The shard still answers and holds exactly the expected state."""
        actual = self.observe()
        assert_same_values(actual.values, expected.values)
        assert (actual.version, actual.accepted, actual.dropped, actual.incarnation) == (
            expected.version, expected.accepted, expected.dropped, expected.incarnation)
        self._verified = actual


def assemble_pull(stream: Sequence[ps_pb2.PullChunk]) -> tuple[ps_pb2.PullHeader, dict[str, np.ndarray] | None]:
    """Check a pull stream's framing and return its header and values (None: not modified)."""
    assert stream and stream[0].HasField("header"), "the first frame carries the header"
    assert not any(frame.HasField("header") for frame in stream[1:]), "only the first frame has a header"
    header = stream[0].header
    assembler = TensorAssembler()
    for frame in stream:
        for chunk in frame.tensors:
            assembler.add(chunk)
    tensors = assembler.finish()
    if header.not_modified:
        assert not tensors
        return header, None
    values = {}
    for name, value in tensors.items():
        assert not isinstance(value, SparseRows)
        values[name] = value
    return header, values


def assert_same_values(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert (got[name].dtype, got[name].shape) == (value.dtype, value.shape), name
        assert got[name].tobytes() == value.tobytes(), f"{name}: {got[name]} != {value}"


def assert_rejected(outcome: Outcome, allowed: Codes, rpc: str, what: object) -> None:
    """The call failed with an allowed status and said why."""
    assert outcome.error is not None, f"{rpc} accepted a malformed request ({what}): {outcome.reply}"
    code, details = outcome.error.code(), outcome.error.details()
    assert code in allowed, (f"{rpc} ({what}) failed with {code.name}: {details!r}; "
                             f"expected one of {sorted(c.name for c in allowed)}")
    assert details, f"{rpc} ({what}): {code.name} without a message"
    REJECTED[rpc] += 1


def assert_succeeded(outcome: Outcome, rpc: str, what: object) -> Any:
    assert outcome.error is None, (
        f"{rpc} refused a valid request ({what}): {outcome.code.name} {outcome.error.details()!r}")
    return outcome.reply


@dataclass
class Shards:
    main: Shard
    blank: Shard
    scratch: Shard


@pytest.fixture(scope="module")
def shards(module_shard_factory: ShardLauncher) -> Iterator[Shards]:
    """Three shard processes: the fuzzed one (initialized once), one never initialized, and a
    scratch one for tests that wreck state on purpose."""
    main, blank, scratch = (Shard(p) for p in module_shard_factory(3))
    client = GrpcShardTransport(main.address, deadline_s=CALL_TIMEOUT_S, call_timeout_s=CALL_TIMEOUT_S)
    assert client.initialize("test", 0, 1, rule_from_proto(RULE), initial_values()).created
    client.close()
    yield Shards(main, blank, scratch)
    for shard in (main, blank, scratch):
        shard.channel.close()


@pytest.fixture(scope="module")
def shard(shards: Shards) -> Shard:
    return shards.main


FUZZ = settings(deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# HOSTILE_EXAMPLES_FACTOR=0.1 for a quick local loop; the default sends over 10,000 requests.
EXAMPLES_FACTOR = float(os.environ.get("HOSTILE_EXAMPLES_FACTOR", "1"))


def fuzz(max_examples: int) -> settings:
    """Settings for a fuzzing test: no deadline (real RPCs), the example count scaled."""
    return settings(FUZZ, max_examples=max(1, round(max_examples * EXAMPLES_FACTOR)))

# --------------------------------------------------------------------- streams and defects


@dataclass
class Part:
    """One tensor of a stream before it is cut into chunks."""

    name: str
    role: int
    dtype: int
    shape: list[int]
    data: bytes
    damaged: bool = False  # carries a semantic defect: chunk defects stay off it (they could undo it)


def part_of(name: str, array: np.ndarray, role: int = tensor_pb2.DENSE, damaged: bool = False) -> Part:
    arr = wire_array(np.asarray(array))
    return Part(name, role, dtype_to_proto(arr.dtype), list(arr.shape), arr.tobytes(), damaged)


# Defects any stream can carry; all are caught while the shard assembles the stream.
CHUNK_DEFECTS: dict[str, Codes] = {
    "dtype_code": INVALID,        # unknown or different dtype code, on all or one chunk
    "shape": TOO_LARGE,           # negative / huge dims, or a byte count the data does not have
    "byte_length": INVALID,       # bytes added to or cut from the last chunk
    "out_of_order": INVALID,      # two chunks of a tensor swapped
    "overlap": INVALID,           # a chunk starting inside the previous one
    "offset_gap": INVALID,        # a chunk starting past the end of the previous one (or < 0)
    "duplicate_tensor": INVALID,  # a whole tensor sent again in a later frame
    "empty_name": INVALID,
    "bad_role": INVALID,          # a TensorRole the proto does not define
}
STREAM_DEFECTS: dict[str, Codes] = {
    "missing_header": INVALID,    # the first frame has no header
    "late_header": INVALID,       # a header in a later frame
    "empty_stream": INVALID,      # no frames at all
}
NEEDS_SPLIT = {"out_of_order", "overlap"}  # the target tensor needs two or more chunks
DTYPE_CODES = [0, 1, 2, 3, 4, 5, 6, 7, 99, -1, 2**31 - 1]
HUGE_DIMS = [2**31, 2**40, 2**62, INT64_MAX]  # with any itemsize >= 2: beyond the 2 GiB request limit
BAD_ROLES = [5, 17, 2**31 - 1, -1]  # 3 and 4 are ROW_IDS and ROW_CLOCKS: their own cases in tests/test_rows_wire.py


def bad_shape(draw: st.DrawFn, part: Part) -> list[int]:
    """A shape the assembler must refuse: a negative dim, too many bytes, or not the data's length."""
    itemsize = dtype_from_proto(part.dtype).itemsize
    kind = draw(st.sampled_from(["negative", "huge", "mismatch", "rank"]))
    if kind == "rank":  # more dimensions than any tensor may have (numpy itself stops at 64)
        return draw(st.lists(st.integers(0, 2), min_size=MAX_RANK + 1, max_size=80))
    if kind == "negative":
        dims = draw(st.lists(st.integers(0, 8), max_size=3))
        dims.insert(draw(st.integers(0, len(dims))), draw(st.integers(INT64_MIN, -1)))
        return dims
    if kind == "huge":
        dims = draw(st.lists(st.sampled_from(HUGE_DIMS), min_size=1, max_size=2))
        return dims + draw(st.lists(st.integers(1, 8), max_size=2))
    return draw(st.lists(st.integers(0, 16), max_size=5).filter(
        lambda s: math.prod(s) * itemsize != len(part.data)))


def encode_stream(
    draw: st.DrawFn, make_frame: Callable[..., Any], header: Any, parts: list[Part], defects: Sequence[str],
    applied: list[str],
) -> list[Any]:
    """Cut parts into chunks and frames with the header in the first frame, applying the chunk and
    stream defects asked for (each chunk defect on a tensor of its own); record what applied."""
    targets: dict[int, str] = {}
    for defect in (d for d in defects if d in CHUNK_DEFECTS):
        need = 2 if defect in NEEDS_SPLIT else 1 if defect == "duplicate_tensor" else 0
        eligible = [i for i, p in enumerate(parts) if i not in targets and not p.damaged and len(p.data) >= need]
        if eligible:
            targets[draw(st.sampled_from(eligible))] = defect
    per_part: list[list[tensor_pb2.TensorChunk]] = []
    tail: list[list[tensor_pb2.TensorChunk]] = []
    for i, part in enumerate(parts):
        defect = targets.get(i, "")
        n = len(part.data)
        cuts = draw(st.lists(st.integers(1, n - 1), min_size=1 if defect in NEEDS_SPLIT else 0, max_size=3,
                             unique=True)) if n >= 2 else []
        bounds = [0, *sorted(cuts), n]
        chunks = [tensor_pb2.TensorChunk(name=part.name, role=part.role, dtype=part.dtype, shape=part.shape,
                                         offset=a, data=part.data[a:b]) for a, b in itertools.pairwise(bounds)]
        if defect:
            apply_chunk_defect(draw, defect, part, chunks, tail)
            applied.append(defect)
        per_part.append(chunks)
    flat = [c for chunks in per_part for c in chunks]
    splits = sorted(draw(st.lists(st.integers(1, len(flat) - 1), max_size=3, unique=True))) if len(flat) > 1 else []
    bounds = [0, *splits, len(flat)]
    frames: list[dict[str, Any]] = [{"tensors": flat[a:b]} for a, b in itertools.pairwise(bounds)]
    frames += [{"tensors": chunks} for chunks in tail]
    for _ in range(draw(st.integers(0, 2))):  # empty frames between and after: harmless
        frames.insert(draw(st.integers(1, len(frames))), {"tensors": []})
    frames[0]["header"] = header
    if "missing_header" in defects:
        del frames[0]["header"]
        applied.append("missing_header")
    if "late_header" in defects:
        if len(frames) == 1:
            frames.append({"tensors": []})
        frames[draw(st.integers(1, len(frames) - 1))]["header"] = header
        applied.append("late_header")
    if "empty_stream" in defects:
        frames = []
        applied.append("empty_stream")
    return [make_frame(**frame) for frame in frames]


def apply_chunk_defect(
    draw: st.DrawFn, defect: str, part: Part, chunks: list[tensor_pb2.TensorChunk],
    tail: list[list[tensor_pb2.TensorChunk]],
) -> None:
    """Damage one tensor's chunks in place (or add a duplicate of them to the tail)."""
    one_or_all = chunks if draw(st.booleans()) else [draw(st.sampled_from(chunks))]
    if defect == "dtype_code":
        code = draw(st.sampled_from([c for c in DTYPE_CODES if c != part.dtype]))
        for chunk in one_or_all:
            chunk.dtype = code
    elif defect == "shape":
        shape = bad_shape(draw, part)
        for chunk in one_or_all:
            del chunk.shape[:]
            chunk.shape.extend(shape)
    elif defect == "byte_length":
        last = chunks[-1]
        if last.data and draw(st.booleans()):
            last.data = last.data[: -draw(st.integers(1, len(last.data)))]
        else:
            last.data += draw(st.binary(min_size=1, max_size=9))
    elif defect == "out_of_order":
        j = draw(st.integers(1, len(chunks) - 1))
        i = draw(st.integers(0, j - 1))
        chunks[i], chunks[j] = chunks[j], chunks[i]
    elif defect == "overlap":
        chunk = chunks[draw(st.integers(1, len(chunks) - 1))]
        chunk.offset -= draw(st.integers(1, chunk.offset))
    elif defect == "offset_gap":
        j = draw(st.integers(0, len(chunks) - 1))
        if j == 0 and draw(st.booleans()):
            chunks[0].offset = draw(st.integers(INT64_MIN, -1))
        else:
            chunks[j].offset += draw(st.integers(1, 2**62))
    elif defect == "duplicate_tensor":
        tail.append([tensor_pb2.TensorChunk.FromString(c.SerializeToString()) for c in chunks])
    elif defect == "empty_name":
        for chunk in chunks:
            chunk.name = ""
    elif defect == "bad_role":
        role = draw(st.sampled_from(BAD_ROLES))
        for chunk in one_or_all:
            chunk.role = role
    else:
        raise AssertionError(defect)


def allowed_codes(table: dict[str, Codes], applied: Sequence[str]) -> Codes:
    return frozenset().union(*(table[d] for d in applied))


TEXT = st.text(st.characters(codec="utf-8"), max_size=24)
# Long names too, cheaply (at most 256 characters); very long non-ASCII names have their own
# regression test at the end.
NAMES = st.one_of(TEXT, TEXT.map(lambda t: (t * 200)[:256]))
ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True)
# Waits (Pull.wait_timeout_s, PushHeader.read_wait_s) must be finite and >= 0 (-0.0 is fine).
BAD_WAITS = st.one_of(st.sampled_from([-1.0, -5e-324, np.nan, np.inf, -np.inf, -1e300]),
                      st.floats(max_value=-5e-324, allow_infinity=True))
SHORT_WAITS = st.one_of(st.sampled_from([0.0, -0.0, 5e-324, 1e-4]), st.floats(0.0, 0.002))
LONG_WAITS = st.one_of(st.sampled_from([1e300, 1e10, 301.0, 1.7976931348623157e308]), st.floats(0.0, 1e300))


def valid_wait(seconds: float) -> bool:
    return math.isfinite(seconds) and seconds >= 0


def unknown_name(draw: st.DrawFn) -> str:
    return draw(NAMES.filter(lambda n: n and n not in VARIABLES))


def small_ints(draw: st.DrawFn, shape: Sequence[int], dtype: Any) -> np.ndarray:
    """Integer-valued gradient entries in [-3, 3] (from a drawn seed: fast, still shrinkable)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return rng.integers(-3, 4, size=tuple(shape)).astype(dtype)


# ----------------------------------------------------------------------------- Push / PushPull

PUSH_DEFECTS: dict[str, Codes] = {
    "unknown_name": NOT_FOUND,
    "other_variable_name": INVALID,  # another variable's name: shape or dtype never fits
    "wrong_shape": INVALID,          # same elements, another shape
    "wrong_dtype": INVALID,          # the other float width
    "non_finite": INVALID,
    "index_out_of_range": INVALID,
    "index_dtype": INVALID,          # int32 indices
    "index_count": INVALID,          # k indices, k + 1 rows (or the reverse)
    "values_without_indices": INVALID,
    "indices_without_values": INVALID,
    "indices_not_1d": INVALID,
    "dense_and_sparse": INVALID,
    "no_gradients": INVALID,
    "future_base": INVALID,
    "negative_base": INVALID,
    "stale_incarnation": NONE,       # not an error: the push is dropped
    **CHUNK_DEFECTS,
    **STREAM_DEFECTS,
}
SPARSE_ONLY = {"index_out_of_range", "index_dtype", "index_count", "values_without_indices",
               "indices_without_values", "indices_not_1d"}
NEEDS_ELEMENT = {"index_out_of_range", "index_dtype", "non_finite"}
HEADER_DEFECTS = {"future_base", "negative_base", "stale_incarnation", "no_gradients"}


@dataclass
class Entry:
    """One variable's gradient in a push: dense, or sparse indices and values (either may be cut)."""

    name: str
    dense: np.ndarray | None = None
    indices: np.ndarray | None = None
    values: np.ndarray | None = None
    damaged: bool = False

    @property
    def sparse(self) -> bool:
        return self.dense is None

    def elements(self) -> int:
        target = self.dense if self.dense is not None else self.values
        return 0 if target is None else target.size

    def rows(self) -> int:
        return 0 if self.indices is None else self.indices.size

    def gradient(self) -> Any:
        return self.dense if self.dense is not None else SparseRows(self.indices, self.values)

    def parts(self) -> list[Part]:
        tensors = [(self.dense, tensor_pb2.DENSE), (self.indices, tensor_pb2.SPARSE_INDICES),
                   (self.values, tensor_pb2.SPARSE_VALUES)]
        return [part_of(self.name, t, role, self.damaged) for t, role in tensors if t is not None]


def new_entry(draw: st.DrawFn, name: str, sparse: bool, min_rows: int = 0) -> Entry:
    value = VARIABLES[name]
    if not sparse:
        return Entry(name, dense=small_ints(draw, value.shape, value.dtype))
    k = draw(st.integers(min_rows, 5))
    indices = np.asarray(draw(st.lists(st.integers(0, value.shape[0] - 1), min_size=k, max_size=k)), np.int64)
    return Entry(name, indices=indices, values=small_ints(draw, (k, *value.shape[1:]), value.dtype))


def eligible_for(defect: str, entry: Entry) -> bool:
    if entry.damaged:
        return False
    if defect in SPARSE_ONLY:
        return entry.sparse and (entry.rows() > 0 or defect not in NEEDS_ELEMENT)
    if defect == "non_finite":
        return entry.elements() > 0
    if defect == "dense_and_sparse":
        return VARIABLES[entry.name].ndim > 0
    return True


def reshapes(shape: tuple[int, ...]) -> list[list[int]]:
    """Other shapes with the same number of elements."""
    size = math.prod(shape)
    candidates = [[size], [size, 1], [1, size], [1, *shape], [*shape, 1], list(reversed(shape))]
    if size % 2 == 0 and size > 2:
        candidates.append([2, size // 2])
    return [c for c in candidates if tuple(c) != tuple(shape)]


def damage_entry(draw: st.DrawFn, defect: str, entry: Entry, entries: list[Entry]) -> None:
    """Apply one semantic defect to one variable's gradient."""
    entry.damaged = True
    var = VARIABLES[entry.name]
    if defect == "unknown_name":
        entry.name = unknown_name(draw)
    elif defect == "other_variable_name":
        entry.name = draw(st.sampled_from([n for n in VARIABLES if n != entry.name]))
    elif defect == "wrong_shape":
        if entry.dense is not None:
            entry.dense = entry.dense.reshape(draw(st.sampled_from(reshapes(entry.dense.shape))))
        else:
            values = entry.values
            assert values is not None
            rest = draw(st.sampled_from(reshapes(values.shape[1:])))
            entry.values = values.reshape((values.shape[0], *rest))
    elif defect == "wrong_dtype":
        other = draw(st.sampled_from([d for d in (np.float16, np.float32, np.float64) if d != var.dtype]))
        if entry.dense is not None:
            entry.dense = entry.dense.astype(other)
        else:
            assert entry.values is not None
            entry.values = entry.values.astype(other)
    elif defect == "non_finite":
        target = entry.dense if entry.dense is not None else entry.values
        assert target is not None
        flat = target.reshape(-1)
        flat[draw(st.integers(0, flat.size - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    elif defect == "index_out_of_range":
        indices = entry.indices
        assert indices is not None
        bad = draw(st.one_of(st.integers(ROWS_OF[entry.name], INT64_MAX), st.integers(INT64_MIN, -1)))
        indices[draw(st.integers(0, indices.size - 1))] = bad
    elif defect == "index_dtype":
        assert entry.indices is not None
        entry.indices = entry.indices.astype(np.int32)
    elif defect == "index_count":
        if draw(st.booleans()):
            entry.indices = np.append(entry.indices, np.int64(0))
        else:
            values = entry.values
            assert values is not None
            entry.values = np.concatenate([values, np.zeros((1, *values.shape[1:]), values.dtype)])
    elif defect == "values_without_indices":
        entry.indices = None
    elif defect == "indices_without_values":
        entry.values = None
    elif defect == "indices_not_1d":
        assert entry.indices is not None
        entry.indices = entry.indices.reshape(-1, 1)
    elif defect == "dense_and_sparse":
        other = new_entry(draw, entry.name, sparse=not entry.sparse)
        entry.dense = entry.dense if entry.dense is not None else other.dense
        if other.indices is not None:
            entry.indices, entry.values = other.indices, other.values
    else:
        raise AssertionError(defect)


@dataclass
class PushRequest:
    """A generated push: its frames, header and what a success means."""

    frames: list[ps_pb2.PushChunk]
    header: ps_pb2.PushHeader
    applied: list[str]
    grads: dict[str, Any] = field(default_factory=dict)


def push_defects(min_size: int = 0) -> st.SearchStrategy[list[str]]:
    return st.lists(st.sampled_from(sorted(PUSH_DEFECTS)), min_size=min_size, max_size=3, unique=True)


def draw_push(draw: st.DrawFn, state: State, defects: Sequence[str], rpc: str = "Push") -> PushRequest:
    """A push of integer gradients from a version the shard has, with the given defects applied.

    read_wait_s is any float for Push (which ignores it); for PushPull it stays valid here, and the
    regression test at the end checks that an invalid one is refused before anything is applied.
    """
    applied: list[str] = []
    names = draw(st.lists(st.sampled_from(sorted(VARIABLES)), min_size=1, max_size=4, unique=True))
    entries = [new_entry(draw, n, sparse=n in ROWS_OF and draw(st.booleans())) for n in names]
    for defect in (d for d in defects if d not in CHUNK_DEFECTS and d not in STREAM_DEFECTS
                   and d not in HEADER_DEFECTS):
        candidates = [e for e in entries if eligible_for(defect, e)]
        if not candidates:  # add a fresh gradient that fits the defect, if a variable is left
            unused = [n for n in VARIABLES if n not in {e.name for e in entries}]
            if defect in SPARSE_ONLY or defect == "dense_and_sparse":
                unused = [n for n in unused if n in ROWS_OF]
            if not unused:
                continue
            name = draw(st.sampled_from(unused))
            sparse = name in ROWS_OF and (defect in SPARSE_ONLY or draw(st.booleans()))
            entries.append(new_entry(draw, name, sparse, min_rows=1))
            candidates = [entries[-1]]
        damage_entry(draw, defect, draw(st.sampled_from(candidates)), entries)
        applied.append(defect)
    grads = {e.name: e.gradient() for e in entries}
    if "no_gradients" in defects:
        entries, grads = [], {}
        applied = ["no_gradients"]
    # Draws never depend on the shard's state (hypothesis replays examples against a shard that
    # moved on): offsets are drawn, then placed relative to the current version and incarnation.
    if "future_base" in defects:
        base_version = min(INT64_MAX, state.version + 1 + draw(st.integers(0, INT64_MAX)))
        applied.append("future_base")
    elif "negative_base" in defects:
        base_version = draw(st.integers(INT64_MIN, -1))
        applied.append("negative_base")
    else:
        base_version = max(0, state.version - draw(st.integers(0, 100)))
    if "stale_incarnation" in defects:
        incarnation = draw(st.integers(INT64_MIN, INT64_MAX - 1))
        incarnation += 1 if incarnation in (0, state.incarnation) else 0
        incarnation += 1 if incarnation in (0, state.incarnation) else 0
        applied.append("stale_incarnation")
    else:
        incarnation = state.incarnation if draw(st.booleans()) else 0
    header = ps_pb2.PushHeader(
        worker_id=draw(NAMES), base_version=base_version, step=draw(st.integers(INT64_MIN, INT64_MAX)),
        loss=draw(ANY_FLOAT), pull_if_newer_than=draw(pull_versions(state.version)),
        read_wait_s=draw(ANY_FLOAT if rpc == "Push" else st.one_of(SHORT_WAITS, LONG_WAITS)),
        incarnation=incarnation)
    parts = [p for e in entries for p in e.parts()]
    frames = encode_stream(draw, ps_pb2.PushChunk, header, parts, defects, applied)
    return PushRequest(frames, header, applied, grads)


def pull_versions(version: int) -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([INT64_MIN, -2, -1, 0, INT64_MAX]), st.integers(-3, 3).map(lambda d: version + d),
                     st.integers(INT64_MIN, INT64_MAX))


def check_push(shard: Shard, rpc: str, request: PushRequest, state: State) -> None:
    """Send one push and check its outcome against the defects; update the expected state."""
    outcome = shard.send(rpc, request.frames)
    errors = [d for d in request.applied if PUSH_DEFECTS[d]]
    dropped_ok = "stale_incarnation" in request.applied and set(errors) <= {"future_base"}
    if errors and not (dropped_ok and outcome.error is None):
        assert_rejected(outcome, allowed_codes(PUSH_DEFECTS, request.applied), rpc, request.applied)
        return
    reply = assert_succeeded(outcome, rpc, request.applied)
    version_before = state.version
    worker, step = request.header.worker_id, request.header.step
    last = shard.last_push.get(worker)
    repeated = not dropped_ok and step != 0 and last is not None and last[0] == step
    if dropped_ok:
        state.dropped += 1
        DROPPED[rpc] += 1
    elif not repeated:
        state.apply(request.grads)
    if rpc == "Push":
        result = reply
    else:
        header, values = assemble_pull(reply)
        result = header.push
        assert (header.version, header.incarnation) == (state.version, state.incarnation)
        assert header.not_modified == (state.version <= request.header.pull_if_newer_than)
        if values is not None:
            assert_same_values(values, state.values)
    if dropped_ok:
        assert not result.accepted and result.drop == ps_pb2.DROP_RESTORED and result.drop_detail, result
        assert result.version == state.version
    elif repeated:  # the same worker's same step: its first answer again, nothing applied
        assert last is not None and result == last[1], (result, last)
    else:
        if step != 0:
            shard.last_push[worker] = (step, result)
        assert (result.accepted, result.staleness, result.version, result.effective_lr, result.drop,
                result.drop_detail) == (
            True, version_before - request.header.base_version, state.version, 1.0, ps_pb2.DROP_NONE, ""), result


# Requests per example: several, so the state check after each example costs little. The first
# request of an example may be valid; the others carry at least one defect.
BATCH = 6


@fuzz(1100)
@given(data=st.data())
def test_hostile_pushes_and_push_pulls(shard: Shard, data: st.DataObject) -> None:
    state = shard.begin()
    for i in range(BATCH):
        rpc = data.draw(st.sampled_from(["Push", "PushPull"]))
        request = draw_push(data.draw, state, data.draw(push_defects(min_size=min(i, 1))), rpc)
        check_push(shard, rpc, request, state)
    shard.verify(state)


# ---------------------------------------------------------------------------------------- Pull

@fuzz(200)
@given(data=st.data())
def test_pulls_with_odd_versions_and_waits(shard: Shard, data: st.DataObject) -> None:
    state = shard.begin()
    for _ in range(BATCH):
        if_newer_than = data.draw(pull_versions(state.version))
        # a real wait only where the version is not newer than asked (then short, to keep the test
        # fast); where it is newer nothing waits, so any valid wait, however long, answers at once
        bad, short, long = data.draw(BAD_WAITS), data.draw(SHORT_WAITS), data.draw(LONG_WAITS)
        wait = bad if data.draw(st.booleans()) else short if state.version <= if_newer_than else long
        request = ps_pb2.PullRequest(worker_id=data.draw(NAMES), if_newer_than=if_newer_than, wait_timeout_s=wait)
        outcome = shard.send("Pull", request)
        if not valid_wait(wait):
            assert_rejected(outcome, INVALID, "Pull", f"wait_timeout_s {wait!r}")
            continue
        header, values = assemble_pull(assert_succeeded(outcome, "Pull", request))
        assert (header.version, header.incarnation) == (state.version, state.incarnation)
        assert header.not_modified == (state.version <= if_newer_than)
        if values is not None:
            assert_same_values(values, state.values)
    shard.verify(state)


# ---------------------------------------------------------------------------------- Initialize

OTHER_RULES = [
    ps_pb2.UpdateRule(optimizer="sgd:lr=0.5"),
    ps_pb2.UpdateRule(optimizer="momentum:lr=1,momentum=0.9"),
    ps_pb2.UpdateRule(optimizer="adam:lr=1"),
    ps_pb2.UpdateRule(optimizer=RULE.optimizer, mode="sync", num_workers=2),
    ps_pb2.UpdateRule(optimizer=RULE.optimizer, mode="ssp:bound=2"),
    ps_pb2.UpdateRule(optimizer=RULE.optimizer, staleness_policy="drop:bound=3"),
    ps_pb2.UpdateRule(optimizer=RULE.optimizer, staleness_policy="lr-scale"),
    ps_pb2.UpdateRule(optimizer=RULE.optimizer, num_workers=3),
]


def _sgd(lr: float = 1.0, **params: float) -> str:
    return "sgd:" + ",".join([f"lr={lr!r}", *(f"{k}={v!r}" for k, v in params.items())])


BAD_RULES = [
    *(ps_pb2.UpdateRule(optimizer=spec)
      for spec in ["", "SGD:lr=1", "sgd :lr=1", "lbfgs:lr=1", "sgd", "sgd:", "sgd:lr=", "sgd:lr=1,lr=2",
                   "sgd:1", "adam:lr=1,beta1=0.9"]),
    *(ps_pb2.UpdateRule(optimizer=_sgd(lr)) for lr in [0.0, -1.0, np.nan, np.inf, -np.inf, -0.0]),
    ps_pb2.UpdateRule(optimizer=_sgd(momentum=0.9)),
    ps_pb2.UpdateRule(optimizer="momentum:lr=1,momentum=2"),
    ps_pb2.UpdateRule(optimizer="adam:lr=1,beta_1=nan"),
    *(ps_pb2.UpdateRule(optimizer=_sgd(), mode=m)
      for m in ["bsp", "ASYNC", "async ", "sync:backup=-1", "ssp:bound=-1", "ssp:bound=1.5", "sync:bound=1",
                "async:1"]),
    *(ps_pb2.UpdateRule(optimizer=_sgd(), staleness_policy=p)
      for p in ["drop", "drop:-1", "drop:x", "bogus", "none:1", "dc-asgd:lambda=", "gap-aware:c=0"]),
    ps_pb2.UpdateRule(optimizer=_sgd(), num_workers=-1),
]

INIT_DEFECTS: dict[str, Codes] = {
    "other_rule": CONFLICT,
    "bad_rule": INVALID,
    "missing_variable": CONFLICT,
    "extra_variable": CONFLICT,
    "reshaped_variable": CONFLICT,
    "other_float_dtype": CONFLICT,
    "int_dtype": INVALID,
    "non_finite": INVALID,
    "other_values": CONFLICT,  # only a conflict before the first update (see draw_init)
    "sparse_role": INVALID,
    **CHUNK_DEFECTS,
    **STREAM_DEFECTS,
}
MALFORMED_INIT = sorted(d for d, codes in INIT_DEFECTS.items() if codes <= TOO_LARGE)  # never valid anywhere


@dataclass
class InitRequest:
    frames: list[ps_pb2.InitializeChunk]
    applied: list[str]


def draw_init(draw: st.DrawFn, values: dict[str, np.ndarray], version: int, defects: Sequence[str]) -> InitRequest:
    """Initialize with the shard's own rule and values, then the given defects."""
    applied: list[str] = []
    arrays = {n: v.copy() for n, v in values.items()}
    roles = dict.fromkeys(arrays, tensor_pb2.DENSE)
    rule = RULE
    damaged: set[str] = set()

    def victim() -> str | None:
        left = sorted(set(arrays) - damaged)
        if not left:
            return None
        name = draw(st.sampled_from(left))
        damaged.add(name)
        return name

    for defect in (d for d in defects if d not in CHUNK_DEFECTS and d not in STREAM_DEFECTS):
        if defect == "other_rule":
            rule = draw(st.sampled_from(OTHER_RULES))
        elif defect == "bad_rule":
            rule = draw(st.sampled_from(BAD_RULES))
        elif defect == "extra_variable":
            extra = unknown_name(draw)
            arrays[extra] = small_ints(draw, draw(st.lists(st.integers(1, 4), max_size=2)), np.float32)
            damaged.add(extra)  # no second defect on it (missing_variable would cancel this one)
        elif (name := victim()) is None:
            continue
        elif defect == "missing_variable":
            del arrays[name]
        elif defect == "reshaped_variable":
            arrays[name] = arrays[name].reshape(draw(st.sampled_from(reshapes(arrays[name].shape))))
        elif defect == "other_float_dtype":
            # exact and finite either way (float16 could overflow to inf: another defect)
            arrays[name] = arrays[name].astype(np.float64 if arrays[name].dtype == np.float32 else np.float32)
        elif defect == "int_dtype":
            arrays[name] = arrays[name].astype(draw(st.sampled_from([np.int32, np.int64])))
        elif defect == "non_finite":
            flat = arrays[name].reshape(-1)
            flat[draw(st.integers(0, flat.size - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        elif defect == "other_values":
            # in the array's dtype: numpy < 2 made a 0-d float32 plus a Python int a float64
            arrays[name] = arrays[name] + arrays[name].dtype.type(1)
            if version > 0:  # after an update values are not compared: an identical re-init
                applied.append("(other_values, accepted after updates)")
                continue
        elif defect == "sparse_role":
            roles[name] = draw(st.sampled_from([tensor_pb2.SPARSE_INDICES, tensor_pb2.SPARSE_VALUES]))
        applied.append(defect)
    header = ps_pb2.InitializeHeader(worker_id=draw(NAMES), shard_index=draw(st.integers(-(2**31), 2**31 - 1)),
                                     num_shards=draw(st.integers(-(2**31), 2**31 - 1)), rule=rule)
    order = draw(st.permutations(sorted(arrays)))
    parts = [part_of(n, arrays[n], roles.get(n, tensor_pb2.DENSE), n in damaged) for n in order]
    frames = encode_stream(draw, ps_pb2.InitializeChunk, header, parts, defects, applied)
    return InitRequest(frames, [d for d in applied if not d.startswith("(")])


@fuzz(250)
@given(data=st.data())
def test_conflicting_and_malformed_initialize(shard: Shard, data: st.DataObject) -> None:
    state = shard.begin()
    for i in range(BATCH):
        defects = data.draw(st.lists(st.sampled_from(sorted(INIT_DEFECTS)), min_size=min(i, 1), max_size=3,
                                     unique=True))
        request = draw_init(data.draw, state.values, state.version, defects)
        outcome = shard.send("Initialize", request.frames)
        if request.applied:
            assert_rejected(outcome, allowed_codes(INIT_DEFECTS, request.applied), "Initialize", request.applied)
        else:  # identical: accepted, creates nothing
            reply = assert_succeeded(outcome, "Initialize", defects)
            assert (reply.created, reply.version) == (False, state.version)
    shard.verify(state)


# ------------------------------------------------------------------------------------- Restore

BAD_SNAPSHOT_NAMES = ["", "w", "value", "value/", "slot/w", "slot/momentum", "slot//", "values/w", "VALUE/w", "/w"]
RESTORE_DEFECTS: dict[str, Codes] = {
    "bad_tensor_name": INVALID,        # not value/NAME or slot/SLOT/NAME
    "unknown_slot_variable": INVALID,  # slot/momentum/zz without value/zz
    "foreign_slot": INVALID,           # a momentum slot under an SGD rule
    "int_values": INVALID,
    "non_finite": INVALID,
    "sparse_value": INVALID,
    "bad_rule": INVALID,
    **CHUNK_DEFECTS,
    **STREAM_DEFECTS,
}


def snapshot_header(state: State, updates: dict[str, int], rule: ps_pb2.UpdateRule = RULE) -> ps_pb2.SnapshotHeader:
    return ps_pb2.SnapshotHeader(rule=rule, version=state.version, pushes_accepted=state.accepted,
                                 pushes_dropped=state.dropped, updates=updates)


def draw_restore(draw: st.DrawFn, state: State, updates: dict[str, int], defects: Sequence[str]) -> InitRequest:
    """A restore of the shard's own state with the given (at least one) defects applied."""
    applied: list[str] = []
    names = {f"value/{n}": f"value/{n}" for n in state.values}  # tensor -> name it travels under
    arrays = {f"value/{n}": v.copy() for n, v in state.values.items()}
    roles = dict.fromkeys(arrays, tensor_pb2.DENSE)
    rule = RULE
    free = sorted(arrays)
    damaged: set[str] = set()
    for defect in (d for d in defects if d not in CHUNK_DEFECTS and d not in STREAM_DEFECTS):
        if defect == "bad_rule":
            rule = draw(st.sampled_from(BAD_RULES))
        elif defect == "unknown_slot_variable":
            arrays["slot/momentum/zz"] = np.zeros(2, np.float32)
        elif defect == "foreign_slot":
            var = draw(st.sampled_from(sorted(state.values)))
            arrays[f"slot/momentum/{var}"] = np.zeros_like(state.values[var])
        else:
            key = draw(st.sampled_from(free))
            free.remove(key)
            damaged.add(key)
            if defect == "bad_tensor_name":
                names[key] = draw(st.one_of(st.sampled_from(BAD_SNAPSHOT_NAMES), NAMES.filter(
                    lambda n: not n.startswith(("value/", "slot/")))))
            elif defect == "int_values":
                arrays[key] = arrays[key].astype(np.int32)
            elif defect == "non_finite":
                flat = arrays[key].reshape(-1)
                flat[draw(st.integers(0, flat.size - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
            elif defect == "sparse_value":
                roles[key] = draw(st.sampled_from([tensor_pb2.SPARSE_INDICES, tensor_pb2.SPARSE_VALUES]))
        applied.append(defect)
    header = snapshot_header(state, updates, rule)
    parts = [part_of(names.get(k, k), a, roles.get(k, tensor_pb2.DENSE), k in damaged) for k, a in arrays.items()]
    frames = encode_stream(draw, ps_pb2.SnapshotChunk, header, parts, defects, applied)
    return InitRequest(frames, applied)


@fuzz(250)
@given(data=st.data())
def test_malformed_restore(shard: Shard, data: st.DataObject) -> None:
    state = shard.begin()
    snapshot = shard.send("Snapshot", ps_pb2.SnapshotRequest())  # a request too, though never malformed
    frames = assert_succeeded(snapshot, "Snapshot", "current state")
    updates = dict(frames[0].header.updates)
    assert frames[0].header.version == state.version
    for _ in range(BATCH):
        defects = data.draw(st.lists(st.sampled_from(sorted(RESTORE_DEFECTS)), min_size=1, max_size=3, unique=True))
        request = draw_restore(data.draw, state, updates, defects)
        assert request.applied, defects  # every restore defect always applies: never a valid restore
        outcome = shard.send("Restore", request.frames)
        if outcome.error is None:  # put the state back before failing, so later examples still mean something
            client = GrpcShardTransport(shard.address, deadline_s=CALL_TIMEOUT_S, call_timeout_s=CALL_TIMEOUT_S)
            client.restore(Snapshot(UpdateRuleConfig(OptimizerConfig("sgd", 1.0)), state.version, state.accepted,
                                    state.dropped, state.values, {}, updates), 0)
            client.close()
        assert_rejected(outcome, allowed_codes(RESTORE_DEFECTS, request.applied), "Restore", request.applied)
    shard.verify(state)


# ------------------------------------------------------------------------- Pause, SetLiveWorkers

HOLDS = st.one_of(ANY_FLOAT, st.sampled_from([0.0, -0.0, 600.0, 600.0000001, 601.0, 5e-324, -5e-324, 1e-3]))
WORKER_LISTS = st.one_of(st.lists(NAMES, max_size=20),
                         st.integers(0, 3000).map(lambda n: [f"worker-{i % 700}" for i in range(n)]))


@fuzz(200)
@given(data=st.data())
def test_pause_hold_values_and_live_worker_sets(shard: Shard, data: st.DataObject) -> None:
    state = shard.begin()
    for _ in range(BATCH):
        if data.draw(st.integers(0, 3)) == 0:
            request = ps_pb2.LiveWorkersRequest(worker_ids=data.draw(WORKER_LISTS))
            reply = assert_succeeded(shard.send("SetLiveWorkers", request), "SetLiveWorkers", "any set")
            assert reply.version == state.version
            continue
        pause, hold = data.draw(st.booleans()), data.draw(HOLDS)
        outcome = shard.send("Pause", ps_pb2.PauseRequest(pause=pause, max_hold_s=hold))
        if pause and not 0 < hold <= 600:
            assert_rejected(outcome, INVALID, "Pause", f"hold {hold!r}")
            continue
        assert assert_succeeded(outcome, "Pause", (pause, hold)).version == state.version
        if pause:  # release at once: the next example pushes
            release = shard.send("Pause", ps_pb2.PauseRequest(pause=False, max_hold_s=data.draw(ANY_FLOAT)))
            assert assert_succeeded(release, "Pause", "release").version == state.version
    shard.verify(state)


# ---------------------------------------------------------------------------- not initialized

BLANK_OPS = ["Push", "PushPull", "Pull", "Snapshot", "SetLiveWorkers", "Initialize", "Restore"]
BLANK_STATE = State(initial_values(), 0, 0, 0, 0)


@fuzz(250)
@given(data=st.data())
def test_uninitialized_shard_refuses_everything(shards: Shards, data: st.DataObject) -> None:
    blank = shards.blank
    for _ in range(BATCH):
        rpc = data.draw(st.sampled_from(BLANK_OPS))
        if rpc in ("Push", "PushPull"):
            request = draw_push(data.draw, BLANK_STATE, data.draw(push_defects()), rpc)
            outcome = blank.send(rpc, request.frames)
            assert_rejected(outcome, NOT_INITIALIZED | allowed_codes(PUSH_DEFECTS, request.applied), rpc,
                            request.applied)
        elif rpc == "Initialize":  # only defects that make it invalid on any shard
            defects = data.draw(st.lists(st.sampled_from(MALFORMED_INIT), min_size=1, max_size=3, unique=True))
            init = draw_init(data.draw, BLANK_STATE.values, 0, defects)
            assert init.applied, defects
            assert_rejected(blank.send(rpc, init.frames), allowed_codes(INIT_DEFECTS, init.applied), rpc, init.applied)
        elif rpc == "Restore":
            defects = data.draw(st.lists(st.sampled_from(sorted(RESTORE_DEFECTS)), min_size=1, max_size=3, unique=True))
            restore = draw_restore(data.draw, BLANK_STATE, {}, defects)
            assert_rejected(blank.send(rpc, restore.frames), allowed_codes(RESTORE_DEFECTS, restore.applied), rpc,
                            restore.applied)
        elif rpc == "Pull":  # nothing newer than a negative version to wait for: no real wait
            wait = data.draw(st.one_of(BAD_WAITS, SHORT_WAITS, LONG_WAITS))
            since = data.draw(st.integers(INT64_MIN, -1))
            request = ps_pb2.PullRequest(worker_id=data.draw(NAMES), if_newer_than=since, wait_timeout_s=wait)
            allowed = NOT_INITIALIZED if valid_wait(wait) else INVALID
            assert_rejected(blank.send(rpc, request), allowed, rpc, f"not initialized, wait {wait!r}")
        else:
            request = {
                "Snapshot": ps_pb2.SnapshotRequest,
                "SetLiveWorkers": lambda: ps_pb2.LiveWorkersRequest(worker_ids=data.draw(st.lists(NAMES, max_size=5))),
            }[rpc]()
            assert_rejected(blank.send(rpc, request), NOT_INITIALIZED, rpc, "not initialized")
    blank.alive()
    stats = blank.stats()
    assert (stats.initialized, stats.version, stats.pushes_accepted, stats.pushes_dropped, len(stats.variables)) == (
        False, 0, 0, 0, 0)


# ------------------------------------------------------------------------------- message size


def oversized_frames() -> list[ps_pb2.PushChunk]:
    """One frame just over the server's maximum receive size (the tensor itself would be fine)."""
    data = bytes(MAX_MESSAGE_BYTES + 4096)
    chunk = tensor_pb2.TensorChunk(name="w", dtype=tensor_pb2.FLOAT32, shape=[len(data) // 4], data=data)
    return [ps_pb2.PushChunk(header=ps_pb2.PushHeader(worker_id="big"), tensors=[chunk])]


@pytest.mark.parametrize("rpc", ["Push", "PushPull"])
def test_frame_over_the_max_receive_size_is_resource_exhausted(shard: Shard, rpc: str) -> None:
    state = shard.begin()
    assert MAX_MESSAGE_BYTES < DEFAULT_MAX_REQUEST_BYTES  # the frame limit bites first, not the request limit
    assert_rejected(shard.send(rpc, oversized_frames()), frozenset({Code.RESOURCE_EXHAUSTED}), rpc, "oversized frame")
    shard.verify(state)
    # and a normal push still goes through afterwards
    grad = {"b": np.ones(3, np.float32)}
    header = ps_pb2.PushHeader(worker_id="after", base_version=state.version)
    frames = [ps_pb2.PushChunk(header=header, tensors=[tensor_pb2.TensorChunk(
        name="b", dtype=tensor_pb2.FLOAT32, shape=[3], data=grad["b"].tobytes())])]
    assert assert_succeeded(shard.send("Push", frames), "Push", "valid").accepted
    state.apply(grad)
    shard.verify(state)


# --------------------------------------------------------------------------- undecodable bytes


@fuzz(100)
@given(payloads=st.lists(st.binary(max_size=64), min_size=1, max_size=3), method=st.sampled_from(
    ["Push", "PushPull", "Initialize", "Restore", "SetLiveWorkers"]))
def test_undecodable_bytes_leave_the_shard_serving(shard: Shard, payloads: list[bytes], method: str) -> None:
    """Raw bytes on the wire. A tensor stream's bytes are frames, read by the shard's frame decoder:
    every failure there is an asyncps status with a message. A protobuf request (SetLiveWorkers):
    whatever parses is validated as usual; what does not parse is refused by grpc itself, which
    answers INTERNAL "Exception deserializing request!" before any asyncps code runs (a grpc
    behaviour, reported, not asserted away)."""
    state = shard.begin()
    streaming_in, streaming_out = method_of(method).client_streaming, method_of(method).server_streaming
    call = rpc_callable(shard.channel, method, raw=True)
    SENT[f"raw {method}"] += 1
    try:
        reply = call(iter(payloads) if streaming_in else payloads[0], timeout=CALL_TIMEOUT_S)
        if streaming_out:
            list(reply)
    except grpc.RpcError as exc:
        if exc.code() is Code.INTERNAL and method not in FRAMED_REQUESTS:
            assert exc.details() == "Exception deserializing request!", exc.details()
        else:
            assert exc.code() in {Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.FAILED_PRECONDITION,
                                  Code.ALREADY_EXISTS, Code.RESOURCE_EXHAUSTED}, exc
            assert exc.details()
        REJECTED[f"raw {method}"] += 1
        shard.verify(state)
        return
    # It parsed and was accepted: only a live-worker set can be (it changes nothing in async mode);
    # pushes need a header and tensors. (Pull and Pause stay out: parsed bytes could ask for a long
    # wait or hold pushes for minutes, which are valid requests.)
    assert method == "SetLiveWorkers", (method, payloads)
    shard.verify(state)


# ------------------------------------------------------------------------------ frame defects


def with_prefix(length: int, rest: bytes) -> bytes:
    return struct.pack("<I", length) + rest


def reprefixed(length: Callable[[int], int]) -> Callable[[ChunkMessage, list[memoryview]], bytes]:
    """The frame with its length prefix replaced by length(frame size)."""
    def damage(message: ChunkMessage, data: list[memoryview]) -> bytes:
        frame = encode_frame(message, data)  # type: ignore[arg-type]
        return with_prefix(length(len(frame)), frame[4:])
    return damage


def with_nbytes(index: int, nbytes: int) -> Callable[[ChunkMessage, list[memoryview]], bytes]:
    """A frame whose chunk `index` announces nbytes (its bytes still the real ones)."""
    def damage(message: ChunkMessage, data: list[memoryview]) -> bytes:
        message.tensors[index].nbytes = nbytes
        return encode_frame(message, data)  # type: ignore[arg-type]
    return damage


def inline_data(message: ChunkMessage, data: list[memoryview]) -> bytes:
    """A chunk's bytes both in the message and after it."""
    message.tensors[0].data = bytes(data[0])
    return encode_frame(message, data)  # type: ignore[arg-type]


def inline_data_only(message: ChunkMessage, data: list[memoryview]) -> bytes:
    """The chunk bytes in the messages and none after (tensor messages before raw frames)."""
    for chunk, view in zip(message.tensors, data, strict=True):
        chunk.data, chunk.nbytes = bytes(view), 0
    return encode_frame(message, [])  # type: ignore[arg-type]


# Ways to break one frame of a valid stream, each caught by the shard's frame decoder before any
# tensor is assembled: a frame (its message with nbytes set and its chunks' bytes) -> the bytes sent.
FRAME_DEFECTS: dict[str, Callable[[ChunkMessage, list[memoryview]], bytes]] = {
    "empty": lambda m, d: b"",
    "shorter_than_prefix": lambda m, d: encode_frame(m, d)[:3],  # type: ignore[arg-type]
    "prefix_past_end": reprefixed(lambda size: size - 3),  # one byte more than the frame holds
    "prefix_max": reprefixed(lambda size: 2**32 - 1),
    "header_truncated": lambda m, d: with_prefix(4, b"\x0a\x05ab"),  # a field of 5 bytes with 2 left
    "header_bad_wire_type": lambda m, d: with_prefix(1, b"\x0f"),
    "header_bad_utf8": lambda m, d: with_prefix(5, b"\x12\x03\x0a\x01\xff"),  # tensors[0].name = b"\xff"
    "nbytes_past_end": lambda m, d: with_nbytes(-1, m.tensors[-1].nbytes + 1)(m, d),
    "nbytes_huge": with_nbytes(-1, INT64_MAX),
    "nbytes_negative": with_nbytes(0, -8),
    "trailing_byte": lambda m, d: encode_frame(m, d) + b"\x00",  # type: ignore[arg-type]
    "trailing_block": lambda m, d: encode_frame(m, d) + bytes(64),  # type: ignore[arg-type]
    "inline_data": inline_data,
    "inline_data_only": inline_data_only,
}
STREAM_TYPES: dict[str, type[ChunkMessage]] = {
    "Initialize": ps_pb2.InitializeChunk, "Push": ps_pb2.PushChunk, "PushPull": ps_pb2.PushChunk,
    "Restore": ps_pb2.SnapshotChunk,
}


def valid_stream(rpc: str, state: State) -> list[ChunkMessage]:
    """A request the shard would take, in two frames: the header and one tensor, then the rest.
    (A push from the current version, an identical Initialize, a restore of the current values.)"""
    make = STREAM_TYPES[rpc]
    header: Any
    if rpc in ("Push", "PushPull"):
        header = ps_pb2.PushHeader(worker_id="frames", base_version=state.version, incarnation=state.incarnation)
        grads: dict[str, np.ndarray] = {"b": np.ones(3, np.float32), "w": np.ones((6, 4), np.float32),
                                        "d": np.ones(2)}
        chunks = [c for n, g in grads.items() for c in encode_whole(n, g)]
    elif rpc == "Initialize":
        header = ps_pb2.InitializeHeader(worker_id="frames", num_shards=1, rule=RULE)
        chunks = [c for n, v in state.values.items() for c in encode_whole(n, v)]
    else:
        header = snapshot_header(state, {})
        chunks = [c for n, v in state.values.items() for c in encode_whole(f"value/{n}", v)]
    return [make(header=header, tensors=chunks[:1]), make(tensors=chunks[1:])]  # type: ignore[arg-type]


@pytest.mark.parametrize("defect", sorted(FRAME_DEFECTS))
@pytest.mark.parametrize("rpc", sorted(STREAM_TYPES))
def test_defective_frames_are_invalid_argument(shard: Shard, rpc: str, defect: str) -> None:
    """One broken frame, the first or the second of a valid stream: INVALID_ARGUMENT with a
    message, and nothing applied (not even the tensors of an intact first frame)."""
    state = shard.begin()
    stream = valid_stream(rpc, state)
    frames = [to_frame(m) for m in stream]
    header = read_frames(frames, parser(STREAM_TYPES[rpc]), TensorAssembler(), rpc)  # intact, it is valid
    assert header == stream[0].header
    for where in range(len(frames)):
        damaged = list(frames)
        damaged[where] = FRAME_DEFECTS[defect](*lean(stream[where]))
        assert damaged[where] != frames[where]
        assert_rejected(shard.send(rpc, damaged), INVALID, rpc, f"{defect} in frame {where}")
    shard.verify(state)


# --------------------------------------------------------------------------------- Shutdown


def test_shutdown_with_a_hostile_reason_exits_cleanly(shard_factory: ShardLauncher) -> None:
    process = shard_factory(1)[0]
    target = Shard(process)
    reason = "\u202e\x00" + "\U0001f4a5" * 100_000
    assert_succeeded(target.send("Shutdown", ps_pb2.ShutdownRequest(reason=reason)), "Shutdown", "long reason")
    assert process.process.wait(timeout=30) == 0
    target.channel.close()


# ----------------------------------------------- regressions: bugs these tests found, now fixed


def pushed(shard: Shard, grads: dict[str, np.ndarray], base_version: int) -> Outcome:
    header = ps_pb2.PushHeader(worker_id="t", base_version=base_version)
    chunks = [c for n, g in grads.items() for c in encode_whole(n, g)]
    return shard.send("Push", [ps_pb2.PushChunk(header=header, tensors=chunks)])


def encode_whole(name: str, value: np.ndarray) -> list[tensor_pb2.TensorChunk]:
    part = part_of(name, value)
    return [tensor_pb2.TensorChunk(name=part.name, role=part.role, dtype=part.dtype, shape=part.shape,
                                   data=part.data)]


def reset(shard: Shard, version: int = 0) -> State:
    """Give the scratch shard a known state (a valid restore works on any shard); return it."""
    client = GrpcShardTransport(shard.address, deadline_s=CALL_TIMEOUT_S, call_timeout_s=CALL_TIMEOUT_S)
    client.restore(Snapshot(UpdateRuleConfig(OptimizerConfig("sgd", 1.0)), version, version, 0,
                            initial_values(), {}, {}), 0)
    client.close()
    return shard.observe()


@pytest.mark.parametrize("rank", [MAX_RANK + 1, 65])
def test_shape_with_too_many_dims_is_invalid_argument(shard: Shard, rank: int) -> None:
    """Was INTERNAL: a 65-d shape passed the byte check and np.empty raised ValueError."""
    state = shard.begin()
    chunk = tensor_pb2.TensorChunk(name="w", dtype=tensor_pb2.FLOAT32, shape=[1] * rank, data=bytes(4))
    outcome = shard.send("Push", [ps_pb2.PushChunk(header=ps_pb2.PushHeader(), tensors=[chunk])])
    shard.verify(state)
    assert_rejected(outcome, INVALID, "Push", f"{rank}-d shape")


@pytest.mark.parametrize("wait", [np.inf, 1e10])
def test_long_poll_without_deadline_is_refused_or_bounded(shards: Shards, wait: float) -> None:
    """Was INTERNAL: with no client deadline a wait above threading.TIMEOUT_MAX raised OverflowError."""
    scratch = shards.scratch
    reset(scratch, version=3)
    replies: list[Outcome] = []
    request = ps_pb2.PullRequest(worker_id="poller", if_newer_than=3, wait_timeout_s=wait)
    poller = threading.Thread(target=lambda: replies.append(scratch.send("Pull", request, timeout=None)))
    poller.start()
    poller.join(0.5)  # not an interleaving: a correct shard either answered or is waiting for a push
    if poller.is_alive():
        assert pushed(scratch, {"b": np.ones(3, np.float32)}, 3).error is None
        poller.join(CALL_TIMEOUT_S)
    assert not poller.is_alive(), "the long poll did not return after a push"
    (outcome,) = replies
    if outcome.error is not None:  # refusing a non-finite wait is fine too
        assert_rejected(outcome, INVALID, "Pull", f"wait {wait}")
    else:
        header, values = assemble_pull(outcome.reply)
        assert header.version == 4 and values is not None


def with_header(**fields: Any) -> Callable[[ps_pb2.SnapshotHeader], None]:
    def change(header: ps_pb2.SnapshotHeader) -> None:
        for key, value in fields.items():
            if key in ("updates", "answers_by_worker"):
                getattr(header, key).update(value)
            else:
                setattr(header, key, value)
    return change


@pytest.mark.parametrize("change", [
    with_header(version=-5), with_header(pushes_accepted=-1), with_header(pushes_dropped=-1),
    with_header(updates={"w": -2}), with_header(updates={"zz": 3}), with_header(answers=-1),
    with_header(answers=4, answers_by_worker={0: -1}), with_header(answers=4, answers_by_worker={0: 3, 1: 2}),
], ids=["negative-version", "negative-accepted", "negative-dropped", "negative-updates", "updates-unknown-variable",
        "negative-answers", "negative-answers-of-a-worker", "answers-by-worker-beyond-all"])
def test_restore_with_impossible_counters_is_invalid_argument(
    shards: Shards, change: Callable[[ps_pb2.SnapshotHeader], None],
) -> None:
    """Were accepted: a negative version wedged the shard (every push 'from the future'); a negative
    update count made the next push INTERNAL after the variables sorted before it were updated."""
    scratch = shards.scratch
    state = reset(scratch)
    header = snapshot_header(state, {n: 0 for n in VARIABLES})
    change(header)
    frames = [ps_pb2.SnapshotChunk(header=header, tensors=[
        c for n, v in initial_values().items() for c in encode_whole(f"value/{n}", v)])]
    outcome = scratch.send("Restore", frames)
    scratch.verify(state)
    assert_rejected(outcome, INVALID, "Restore", header)
    grads = {"b": np.ones(3, np.float32), "w": np.ones((6, 4), np.float32)}
    assert pushed(scratch, grads, 0).error is None  # the shard still takes pushes
    state.apply(grads)
    scratch.verify(state)


def test_long_polls_do_not_starve_other_calls(shards: Shards) -> None:
    """Was a denial of service: 40 long polls held all 32 handler threads; GetStats timed out."""
    scratch = shards.scratch
    reset(scratch)
    channels = [grpc.insecure_channel(scratch.address) for _ in range(64)]
    request = ps_pb2.PullRequest(worker_id="poller", if_newer_than=INT64_MAX, wait_timeout_s=3.0)
    calls = [rpc_callable(c, "Pull")(request, timeout=4.0) for c in channels]
    SENT["Pull"] += len(calls)
    try:
        time.sleep(0.5)  # not an interleaving: the polls only need to have arrived
        started = time.monotonic()
        try:
            scratch.stats(timeout=1.5)
        except grpc.RpcError as exc:
            pytest.fail(f"GetStats behind 64 long polls: {exc.code().name} after {time.monotonic() - started:.1f}s")
    finally:
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()


def conflicting_init_with_many_variables() -> list[ps_pb2.InitializeChunk]:
    """A realistic conflict: a model of 600 variables against a shard holding 4."""
    chunks = [c for i in range(600) for c in encode_whole(f"sequential/dense_{i}/kernel", np.zeros(1, np.float32))]
    return [ps_pb2.InitializeChunk(header=ps_pb2.InitializeHeader(rule=RULE), tensors=chunks)]


def push_of_unknown_name(name: str) -> list[ps_pb2.PushChunk]:
    chunk = tensor_pb2.TensorChunk(name=name, dtype=tensor_pb2.FLOAT32, shape=[1], data=bytes(4))
    return [ps_pb2.PushChunk(header=ps_pb2.PushHeader(), tensors=[chunk])]


@pytest.mark.parametrize(("rpc", "frames", "code"), [
    ("Initialize", conflicting_init_with_many_variables, Code.ALREADY_EXISTS),
    ("Push", lambda: push_of_unknown_name("x" * 20_000), Code.NOT_FOUND),
], ids=["initialize-600-variables", "push-20k-name"])
def test_long_error_messages_keep_their_status_code(
    shard: Shard, rpc: str, frames: Callable[[], list[Any]], code: grpc.StatusCode,
) -> None:
    """Were RESOURCE_EXHAUSTED 'Stream removed': a status message over gRPC's metadata limit."""
    state = shard.begin()
    outcome = shard.send(rpc, frames())
    shard.verify(state)
    assert_rejected(outcome, frozenset({code}), rpc, "long error message")


# ---------------------------------------------- regressions of bugs found by this file (fixed)


@pytest.mark.parametrize("read_wait_s", [-1.0, np.nan, np.inf])
def test_push_pull_with_an_invalid_read_wait_changes_nothing(shards: Shards, read_wait_s: float) -> None:
    scratch = shards.scratch
    state = reset(scratch)
    header = ps_pb2.PushHeader(worker_id="t", base_version=0, read_wait_s=read_wait_s)
    frames = [ps_pb2.PushChunk(header=header, tensors=encode_whole("b", np.ones(3, np.float32)))]
    outcome = scratch.send("PushPull", frames)
    assert_rejected(outcome, INVALID, "PushPull", f"read_wait_s {read_wait_s}")
    scratch.verify(state)


def test_long_non_ascii_names_keep_their_status_code(shard: Shard) -> None:
    state = shard.begin()
    codes = collections.Counter(shard.send("Push", push_of_unknown_name("\U0001f4a5" * 2000)).code.name
                                for _ in range(30))
    shard.verify(state)
    assert codes == {"NOT_FOUND": 30}, codes


# ------------------------------------------------------------------- row reads (ROW_IDS, ROW_CLOCKS)


def row_ids(ids: Any, name: str = "w", role: int = tensor_pb2.ROW_IDS) -> tensor_pb2.TensorChunk:
    part = part_of(name, np.asarray(ids), role)
    return tensor_pb2.TensorChunk(name=part.name, role=part.role, dtype=part.dtype, shape=part.shape, data=part.data)


@pytest.mark.parametrize(("rows", "codes"), [
    ([row_ids(np.array([-1], np.int64))], INVALID),
    ([row_ids(np.array([0, ROWS_OF["w"]], np.int64))], INVALID),
    ([row_ids(np.array([2, 2], np.int64))], INVALID),
    ([row_ids(np.array([1.0, 2.0]))], INVALID),
    ([row_ids(np.array([[1]], np.int64))], INVALID),
    ([row_ids(np.array([0], np.int64), name="nope")], NOT_FOUND),
    ([row_ids(np.array([0], np.int64), name="s")], INVALID),  # a scalar has no rows
    ([row_ids(np.array([0], np.int64), role=tensor_pb2.ROW_CLOCKS)], INVALID),
    ([row_ids(np.array([0], np.int64)), row_ids(np.array([1], np.int64))], INVALID),  # one part asked twice
], ids=["negative", "out-of-range", "duplicated", "float", "2-d", "unknown-part", "scalar", "clocks", "twice"])
@pytest.mark.parametrize("rpc", ["Pull", "PushPull"])
def test_hostile_row_reads_change_nothing(shard: Shard, rpc: str, rows: list[tensor_pb2.TensorChunk],
                                          codes: Codes) -> None:
    """A pull or push-pull asking bad rows is refused whole: its push is not applied either."""
    state = shard.begin()
    if rpc == "Pull":
        outcome = shard.send(rpc, ps_pb2.PullRequest(worker_id="rows", if_newer_than=-1, rows=rows))
    else:
        header = ps_pb2.PushHeader(worker_id="rows", base_version=state.version, incarnation=state.incarnation)
        outcome = shard.send(rpc, [ps_pb2.PushChunk(header=header, tensors=[
            *encode_whole("b", np.ones(3, np.float32)), *rows])])
    shard.verify(state)
    assert_rejected(outcome, codes, rpc, rows)
