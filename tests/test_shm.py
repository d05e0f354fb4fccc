"""The same-host data path: shared-memory segments between a worker and real shard processes."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import numpy as np
import pytest
from asyncps.worker.trainer import BatchStream, Telemetry, Trainer, make_grad_fn

from asyncps.delays import NoDelay, StepDelay
from asyncps.errors import AsyncpsError, AttachAgainError, InvalidArgumentError, PathNotVisibleError
from asyncps.ml.datasets import load_dataset
from asyncps.ml.models import build_model, loss_fn
from asyncps.net.rpc import make_channel
from asyncps.pb import ps_pb2, tensor_pb2
from asyncps.placement import VariableSpec, place, split_for_shards
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.transport import (
    GrpcShardTransport,
    ModelClient,
    ShardClient,
    ShmDataPath,
    connect_model,
    connect_shard,
    shmseg,
)
from asyncps.transport.link import ShardLink, data_connection
from asyncps.transport.shm import ring as ring_doorbell
from asyncps.wire.proto import SHARD_SERVICE
from asyncps.wire.shard import PushRequest
from asyncps.wire.stream import read_head, send_frame

if TYPE_CHECKING:
    from conftest import ShardLauncher, ShardProcess

pytestmark = pytest.mark.skipif(not shmseg.available(), reason="no writable /dev/shm on this host")

CALL_TIMEOUT_S = 30.0
RULE = UpdateRuleConfig(OptimizerConfig("adam", 0.01))
Code = grpc.StatusCode


def segments() -> set[str]:
    return {p.name for p in shmseg.SHM_DIR.glob(f"{shmseg.PREFIX}*")}


def shm_in_use(client: object) -> bool:
    """Whether a shard client's data path is shared memory with a segment mapped now."""
    return isinstance(client, ShardClient) and isinstance(client.data, ShmDataPath) and client.data.uses_shared_memory


def initial_values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"w": rng.standard_normal((300, 40)).astype(np.float32), "b": np.zeros(40, np.float32)}


@pytest.fixture
def shard(shard_factory: ShardLauncher) -> Iterator[ShardProcess]:
    process = shard_factory(1)[0]
    client = GrpcShardTransport(process.address, deadline_s=CALL_TIMEOUT_S)
    assert client.initialize("test", 0, 1, RULE, initial_values()).created
    client.close()
    yield process


def test_shared_memory_tcp_and_grpc_give_bit_identical_training(start_shards: Callable[[int], list[str]]) -> None:
    """One seeded worker for N steps over each transport (fresh shards each): the same bits."""
    data = load_dataset("digits", 0)
    x, y = data.x_train[:400], data.y_train[:400]
    results = {}
    before = segments()
    for transport in ("grpc", "tcp", "shm"):
        addresses = start_shards(2)
        model = build_model("mlp", data.num_features, data.num_classes, seed=3)
        names = [v.path for v in model.trainable_variables]
        specs = [VariableSpec(v.path, tuple(v.shape), "float32") for v in model.trainable_variables]
        placement = place(specs, 2, slice_threshold_bytes=16 * 1024)  # sliced parts travel too
        initial = {v.path: np.array(v.numpy()) for v in model.trainable_variables}
        client = connect_model("worker-0", addresses, placement, deadline_s=CALL_TIMEOUT_S, transport=transport)
        for shard, values in enumerate(split_for_shards(placement, initial)):
            client.shards[shard].initialize("test", shard, 2, RULE, values)
        trainer = Trainer(client, names, make_grad_fn(model, loss_fn), BatchStream(x, y, 32, seed=5),
                          StepDelay(NoDelay()), Telemetry())
        trainer.run(threading.Event(), max_steps=12)
        uses = [shm_in_use(s) for s in client.shards]
        assert uses == ([True, True] if transport == "shm" else [False, False])
        carried = [s.stats().bytes_pushed_by_transport for s in client.shards]
        assert all(set(c) == {transport} for c in carried), carried
        assert client.versions == [12, 12]
        client.pull()  # what the shards hold, over frames
        results[transport] = {n: v.copy() for n, v in client.values.items()}
        client.close()
    for name, value in results["grpc"].items():
        assert value.tobytes() == results["shm"][name].tobytes() == results["tcp"][name].tobytes(), name
    assert segments() <= before  # every segment was unlinked once mapped


def test_auto_falls_back_to_frames_when_the_shard_cannot_see_the_segment(
    shard_factory: ShardLauncher, tmp_path: Path,
) -> None:
    """A shard that looks in another directory (as on another host) refuses the attach; auto
    then pushes over frames with the same results, and shm mode reports the error."""
    elsewhere = tmp_path / "other-shm"
    elsewhere.mkdir()
    process = shard_factory(1, extra_env={"ASYNCPS_SHM_DIR": str(elsewhere)})[0]
    setup = GrpcShardTransport(process.address, deadline_s=CALL_TIMEOUT_S)
    setup.initialize("test", 0, 1, RULE, initial_values())
    auto = connect_shard(process.address, deadline_s=CALL_TIMEOUT_S, transport="auto")
    assert isinstance(auto.data, ShmDataPath)
    buffers = {n: np.empty_like(v) for n, v in initial_values().items()}
    grads = {"w": np.ones((300, 40), np.float32), "b": np.ones(40, np.float32)}
    outcome, reply = auto.push_pull(PushRequest("w0", 0, grads), -1, buffers)
    assert outcome.accepted and reply.version == 1 and not shm_in_use(auto)
    assert reply.values is not None
    np.testing.assert_array_equal(reply.values["b"], setup.pull("probe").values["b"])  # type: ignore[index]
    forced = connect_shard(process.address, deadline_s=CALL_TIMEOUT_S, transport="shm")
    with pytest.raises(PathNotVisibleError) as info:
        forced.push_pull(PushRequest("w1", 1, grads), -1, buffers)
    assert info.value.code == "FAILED_PRECONDITION" and "not visible" in info.value.detail
    assert setup.stats().version == 1  # the refused attach changed nothing
    for client in (setup, auto, forced):
        client.close()


def test_a_restarted_shard_gets_a_fresh_segment(shard_factory: ShardLauncher) -> None:
    """The mapping dies with the shard; the next push maps a new segment (the old name is gone)."""
    process = shard_factory(1)[0]
    setup = GrpcShardTransport(process.address, deadline_s=CALL_TIMEOUT_S)
    setup.initialize("test", 0, 1, RULE, initial_values())
    client = connect_shard(process.address, deadline_s=CALL_TIMEOUT_S, transport="shm")
    assert isinstance(client.data, ShmDataPath)
    buffers = {n: np.empty_like(v) for n, v in initial_values().items()}
    grads = {"w": np.ones((300, 40), np.float32), "b": np.ones(40, np.float32)}
    client.push_pull(PushRequest("w0", 0, grads), -1, buffers)
    first = client.data._mapping
    # a second transport of the same worker replaces the shard's mapping of the first
    other = connect_shard(process.address, deadline_s=CALL_TIMEOUT_S, transport="shm")
    other.push_pull(PushRequest("w0", 1, grads), -1, buffers)
    outcome, reply = client.push_pull(PushRequest("w0", 2, grads), -1, buffers)
    assert outcome.accepted and reply.version == 3 and client.data._mapping is not first
    for c in (setup, client, other):
        c.close()


# -- hostile input ----------------------------------------------------------------------------


class Raw:
    """AttachShm and ShmPushPull with hand-made requests."""

    def __init__(self, address: str) -> None:
        self.channel = make_channel(address)
        self.attach = self.channel.unary_unary(f"/{SHARD_SERVICE}/AttachShm",
                                               request_serializer=ps_pb2.AttachShmRequest.SerializeToString,
                                               response_deserializer=ps_pb2.AttachShmResponse.FromString)
        self.push_pull = self.channel.unary_unary(f"/{SHARD_SERVICE}/ShmPushPull",
                                                  request_serializer=ps_pb2.ShmPushPullRequest.SerializeToString,
                                                  response_deserializer=ps_pb2.PullHeader.FromString)

    def code(self, call: Callable[[], object]) -> tuple[Code, str]:
        try:
            call()
        except grpc.RpcError as exc:
            return exc.code(), exc.details()  # type: ignore[attr-defined]
        return Code.OK, ""


def region(name: str, shape: tuple[int, ...], offset: int, nbytes: int | None = None,
           dtype: int = tensor_pb2.FLOAT32, role: int = tensor_pb2.DENSE) -> tensor_pb2.TensorChunk:
    size = int(np.prod(shape)) * 4
    return tensor_pb2.TensorChunk(name=name, role=role, dtype=dtype, shape=shape, offset=offset,  # type: ignore[arg-type]
                                  nbytes=size if nbytes is None else nbytes)


def test_hostile_attach_and_push_requests_are_refused_and_change_nothing(shard: ShardProcess) -> None:
    raw = Raw(shard.address)
    probe = GrpcShardTransport(shard.address, deadline_s=CALL_TIMEOUT_S)
    before = probe.pull("probe").values
    assert before is not None
    segment = shmseg.create(1 << 16)
    try:
        good = [region("b", (40,), 64), region("w", (300, 40), 1024)]

        def attach(**changes: object) -> tuple[Code, str]:
            fields: dict[str, object] = {"worker_id": "evil", "segment": segment.name, "segment_bytes": segment.size,
                                         "token": segment.token, "values": good}
            fields.update(changes)
            return raw.code(lambda: raw.attach(ps_pb2.AttachShmRequest(**fields), timeout=CALL_TIMEOUT_S))

        cases = {
            "path traversal": ({"segment": "../../etc/passwd"}, Code.INVALID_ARGUMENT, "is not asyncps-"),
            "absent": ({"segment": "asyncps-nosuchsegment"}, Code.FAILED_PRECONDITION, "not visible"),
            "wrong size": ({"segment_bytes": segment.size - 8}, Code.INVALID_ARGUMENT, "holds"),
            "huge size": ({"segment_bytes": 1 << 62}, Code.INVALID_ARGUMENT, "outside"),
            "wrong token": ({"token": bytes(16)}, Code.FAILED_PRECONDITION, "not visible"),
            "past the end": ({"values": [region("b", (40,), 64), region("w", (300, 40), 1 << 15)]},
                             Code.INVALID_ARGUMENT, "8-aligned range"),
            "over the token": ({"values": [region("b", (40,), 0), region("w", (300, 40), 1024)]},
                               Code.INVALID_ARGUMENT, "8-aligned range"),
            "misaligned": ({"values": [region("b", (40,), 68), region("w", (300, 40), 1024)]},
                           Code.INVALID_ARGUMENT, "8-aligned range"),
            "short nbytes": ({"values": [region("b", (40,), 64, nbytes=8), region("w", (300, 40), 1024)]},
                             Code.INVALID_ARGUMENT, "bytes for a"),
            "wrong shape": ({"values": [region("b", (41,), 64), region("w", (300, 40), 1024)]},
                            Code.INVALID_ARGUMENT, "for a variable"),
            "unknown name": ({"values": [*good, region("nope", (1,), 60000)]}, Code.NOT_FOUND, "unknown variable"),
            # (regions for some parts only are an attachment whose requests read the others by rows:
            # tests/test_rows_wire.py)
            "sparse": ({"values": [region("b", (40,), 64, role=tensor_pb2.SPARSE_VALUES), good[1]]},
                       Code.INVALID_ARGUMENT, "only dense"),
        }
        for what, (changes, code, message) in cases.items():
            got, details = attach(**changes)
            assert (got, message in details) == (code, True), (what, got, details)
        assert segment.path.exists()  # nothing above mapped it (or unlinked it)
        attachment = raw.attach(ps_pb2.AttachShmRequest(worker_id="evil2", segment=segment.name,
                                                        segment_bytes=segment.size, token=segment.token,
                                                        values=good), timeout=CALL_TIMEOUT_S).attachment
        assert not segment.path.exists()  # mapped, so the shard unlinked the name
        header = ps_pb2.PushHeader(worker_id="evil2", base_version=0)
        np.frombuffer(segment.buffer, np.float32, 40, 2048)[:] = np.nan
        pushes = {
            "unknown attachment": (ps_pb2.ShmPushPullRequest(header=header, attachment=attachment + 99),
                                   Code.FAILED_PRECONDITION, "attach again"),
            "someone else's": (ps_pb2.ShmPushPullRequest(header=ps_pb2.PushHeader(worker_id="evil"),
                                                         attachment=attachment), Code.FAILED_PRECONDITION,
                               "attach again"),
            "out of bounds": (ps_pb2.ShmPushPullRequest(header=header, attachment=attachment,
                                                        grads=[region("b", (40,), 1 << 16)]),
                              Code.INVALID_ARGUMENT, "8-aligned range"),
            "nan gradient": (ps_pb2.ShmPushPullRequest(header=header, attachment=attachment,
                                                       grads=[region("b", (40,), 2048)]),
                             Code.INVALID_ARGUMENT, "NaN or Inf"),
            "twice": (ps_pb2.ShmPushPullRequest(header=header, attachment=attachment,
                                                grads=[region("w", (300, 40), 4096)] * 2),
                      Code.INVALID_ARGUMENT, "named twice"),
            "no gradients": (ps_pb2.ShmPushPullRequest(header=header, attachment=attachment),
                             Code.INVALID_ARGUMENT, "without gradients"),
        }
        for what, (request, code, message) in pushes.items():
            got, details = raw.code(lambda r=request: raw.push_pull(r, timeout=CALL_TIMEOUT_S))
            assert (got, message in details) == (code, True), (what, got, details)
    finally:
        segment.unlink()
    after = probe.pull("probe").values
    assert after is not None and all(after[n].tobytes() == before[n].tobytes() for n in before)
    assert probe.stats().version == 0
    probe.close()
    raw.channel.close()


def test_no_segment_outlives_kill_9_of_a_worker_or_a_shard(shard_factory: ShardLauncher) -> None:
    """A worker process maps segments with two shards, then it and one shard are killed with
    SIGKILL: /dev/shm holds nothing of theirs (names are unlinked as soon as they are mapped)."""
    shards = shard_factory(2)
    for i, s in enumerate(shards):
        setup = GrpcShardTransport(s.address, deadline_s=CALL_TIMEOUT_S)
        setup.initialize("test", i, 2, RULE, initial_values())
        setup.close()
    script = textwrap.dedent(f"""
        import sys, time, numpy as np
        from asyncps.wire.shard import PushRequest
        from asyncps.transport import connect_shard
        clients = [connect_shard(a, transport="shm") for a in {[s.address for s in shards]!r}]
        buffers = {{"w": np.empty((300, 40), np.float32), "b": np.empty(40, np.float32)}}
        grads = {{"w": np.ones((300, 40), np.float32), "b": np.ones(40, np.float32)}}
        for c in clients:
            c.push_pull(PushRequest("w0", 0, grads), -1, buffers)
            assert c.data.uses_shared_memory
        print("mapped", flush=True)
        time.sleep(600)
    """)
    worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, shmseg.TAG_ENV: "killtest"})
    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "mapped"
        assert not list(shmseg.SHM_DIR.glob(f"{shmseg.PREFIX}killtest-*"))  # unlinked while both live
        worker.send_signal(signal.SIGKILL)
        shards[0].kill()
        worker.wait(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert not list(shmseg.SHM_DIR.glob(f"{shmseg.PREFIX}killtest-*"))
    assert shards[1].process.poll() is None  # the other shard keeps serving


def test_the_model_client_over_shared_memory_is_a_model_client(start_shards: Callable[[int], list[str]]) -> None:
    addresses = start_shards(1)
    placement = place([VariableSpec("w", (300, 40)), VariableSpec("b", (40,))], 1)
    client = connect_model("w0", addresses, placement, transport="auto")
    assert isinstance(client, ModelClient)
    client.shards[0].initialize("t", 0, 1, RULE, initial_values())
    client.pull()
    results = client.push_pull({"w": np.ones((300, 40), np.float32), "b": np.ones(40, np.float32)}, 0, 0.0)
    assert results[0].outcome is not None and results[0].outcome.accepted
    assert shm_in_use(client.shards[0])
    client.close()


def test_the_model_client_computes_from_the_segment_so_values_are_written_once(
        start_shards: Callable[[int], list[str]]) -> None:
    """Every variable's buffer, sliced or whole, lies in the worker's arena, and each shard writes its
    parts (a sliced variable's rows included) straight into it: the worker computes from where the
    values land, no copy out. The values stay those a frames client reads, step after step."""
    addresses = start_shards(2)
    specs = [VariableSpec("w", (300, 40)), VariableSpec("b", (40,)), VariableSpec("c", (7, 3))]
    placement = place(specs, 2, slice_threshold_bytes=16 * 1024)  # w is sliced over both shards
    assert any(p.sliced for p in placement.parts if p.variable == "w")
    initial = {"w": initial_values()["w"], "b": np.arange(40, dtype=np.float32), "c": np.ones((7, 3), np.float32)}
    client = connect_model("w0", addresses, placement, transport="shm")
    frames = connect_model("probe", addresses, placement, transport="grpc")
    for shard, values in enumerate(split_for_shards(placement, initial)):
        client.shards[shard].initialize("t", shard, 2, RULE, values)
    buffers = dict(client.values)
    arena = client._buffers
    assert isinstance(arena, shmseg.Arena) and all(arena.offset_of(v) is not None for v in buffers.values())
    client.pull()
    assert all(client.values[n] is buffers[n] for n in buffers)  # never replaced, never copied into
    for s in client.shards:
        regions = s.data._mapping.values  # type: ignore[attr-defined]
        for part in placement.parts_on(client.shards.index(s)):
            # what the shard writes is a view of the variable's own buffer (w's rows of this shard)
            assert np.shares_memory(regions[part.name], buffers[part.variable]), part
    grads = {"w": np.full((300, 40), 0.5, np.float32), "b": np.ones(40, np.float32), "c": np.ones((7, 3), np.float32)}
    for step in range(3):
        results = client.push_pull(grads, step, 0.0)
        assert all(r.outcome is not None and r.outcome.accepted for r in results)
        frames.pull()
        for name, value in frames.values.items():
            assert client.values[name].tobytes() == value.tobytes(), (step, name)
        assert all(client.values[n] is buffers[n] for n in buffers)
    assert all(shm_in_use(s) for s in client.shards)
    client.close()
    frames.close()


def test_the_arena_is_named_only_until_every_shard_has_mapped_it(start_shards: Callable[[int], list[str]]) -> None:
    """The arena keeps a name while its shards attach for the first time, and none after; a shard that
    forgets the attachment later (here replaced by another client of the same worker id, as after a
    restart) gets a segment of the path's own, and the values keep arriving in the same buffers."""
    addresses = start_shards(2)
    placement = place([VariableSpec("w", (300, 40)), VariableSpec("b", (40,))], 2, slice_threshold_bytes=16 * 1024)
    before = segments()
    client = connect_model("w0", addresses, placement, transport="shm")
    assert len(segments() - before) == 1  # the arena's base name, while no shard has mapped it
    for shard, values in enumerate(split_for_shards(placement, initial_values())):
        client.shards[shard].initialize("t", shard, 2, RULE, values)
    buffers = dict(client.values)
    grads = {"w": np.ones((300, 40), np.float32), "b": np.ones(40, np.float32)}
    client.pull()
    assert segments() <= before  # both shards mapped it: no name is left
    client.push_pull(grads, 0, 0.0)
    first = client.shards[0].data._mapping  # type: ignore[attr-defined]
    other = connect_model("w0", addresses, placement, transport="shm")
    other.pull()
    results = client.push_pull(grads, 1, 0.0)
    again = client.shards[0].data._mapping  # type: ignore[attr-defined]
    assert all(r.outcome is not None and r.outcome.accepted for r in results)
    assert again is not first and isinstance(again.owner, shmseg.Segment)  # the path's own segment now
    assert isinstance(first.owner, shmseg.Arena)
    assert client.values["w"] is buffers["w"]  # sliced: its own buffer still (a whole one may be lent anew)
    probe = connect_model("probe", addresses, placement, transport="grpc")
    probe.pull()
    assert all(probe.values[n].tobytes() == client.values[n].tobytes() for n in buffers)
    assert segments() <= before
    for c in (client, other, probe):
        c.close()


def test_pull_and_push_travel_through_the_segment_too(shard: ShardProcess) -> None:
    """Pull (with if_newer_than) and Push over a mapped segment mean what they mean over frames."""
    frames = GrpcShardTransport(shard.address, deadline_s=CALL_TIMEOUT_S)
    client = connect_shard(shard.address, deadline_s=CALL_TIMEOUT_S, transport="shm")
    assert isinstance(client.data, ShmDataPath)
    buffers = {n: np.empty_like(v) for n, v in initial_values().items()}
    reply = client.pull("w0", -1, buffers)
    assert shm_in_use(client) and reply.version == 0 and reply.values is not None
    assert all(reply.values[n] is buffers[n] for n in buffers)
    np.testing.assert_array_equal(buffers["w"], initial_values()["w"])
    outcome = client.push(PushRequest("w0", 0, {"b": np.ones(40, np.float32)}))  # a subset of the variables
    assert outcome.accepted and outcome.version == 1
    assert client.pull("w0", 1, buffers).values is None  # not newer
    fresh = client.pull("w0", 0, buffers)
    expected = frames.pull("probe").values
    assert fresh.version == 1 and fresh.values is not None and expected is not None
    for name, value in expected.items():
        assert buffers[name].tobytes() == value.tobytes(), name
    raw = Raw(shard.address)
    mapping = client.data._mapping
    assert mapping is not None
    code, details = raw.code(lambda: raw.push_pull(ps_pb2.ShmPushPullRequest(
        header=ps_pb2.PushHeader(worker_id="w0"), attachment=mapping.attachment, pull_only=True,
        grads=[mapping.grad_chunks["b"]]), timeout=CALL_TIMEOUT_S))
    assert code == Code.INVALID_ARGUMENT and "carries no gradients" in details
    assert frames.stats().version == 1
    for c in (frames, client):
        c.close()
    raw.channel.close()


# -- the doorbell: no gRPC call per step -------------------------------------------------------


def test_shared_memory_rings_over_the_data_connection_when_the_shard_has_one(shard_factory: ShardLauncher) -> None:
    """With a data port the segment's requests ring over TCP; without one (--data-port -1) over the
    unary ShmPushPull. The same values and versions either way, every byte counted as shm's."""
    grads = {"w": np.full((300, 40), 0.5, np.float32), "b": np.full(40, 0.25, np.float32)}
    results = {}
    for args in ((), ("--data-port", "-1")):
        process = shard_factory(1, args=args)[0]
        setup = GrpcShardTransport(process.address, deadline_s=CALL_TIMEOUT_S)
        setup.initialize("test", 0, 1, RULE, initial_values())
        client = connect_shard(process.address, deadline_s=CALL_TIMEOUT_S, transport="shm")
        assert isinstance(client.data, ShmDataPath)
        buffers = {n: np.empty_like(v) for n, v in initial_values().items()}
        version = client.pull("w0", -1, buffers).version
        for _ in range(3):
            outcome, reply = client.push_pull(PushRequest("w0", version, grads), -1, buffers)
            assert outcome.accepted
            version = reply.version
        stats = setup.stats()
        assert stats.bytes_pushed_by_transport == {"shm": 3 * sum(g.nbytes for g in grads.values())}
        assert set(stats.bytes_pulled_by_transport) == {"shm"}
        results[args] = (client.data.rings_over_data_connection, version, {n: b.tobytes() for n, b in buffers.items()})
        for c in (setup, client):
            c.close()
    over_tcp, over_grpc = results[()], results[("--data-port", "-1")]
    assert over_tcp[0] and not over_grpc[0]
    assert over_tcp[1:] == over_grpc[1:] == (3, over_tcp[2])


def test_hostile_doorbell_requests_get_their_error_and_change_nothing(shard: ShardProcess) -> None:
    """Rung on the data port by hand: another worker's attachment, a tensor where only row ids belong and a
    region outside the segment are refused with the gRPC call's codes; the connection stays
    usable and the owner's next step is served."""
    client = connect_shard(shard.address, deadline_s=CALL_TIMEOUT_S, transport="shm")
    assert isinstance(client.data, ShmDataPath)
    buffers = {n: np.empty_like(v) for n, v in initial_values().items()}
    version = client.pull("w0", -1, buffers).version
    mapping = client.data._mapping
    assert mapping is not None and client.data.rings_over_data_connection
    frames = GrpcShardTransport(shard.address, deadline_s=CALL_TIMEOUT_S)
    before = frames.pull("probe")
    link = ShardLink(shard.address, deadline_s=5)
    bell = data_connection(link)

    def ring(request: ps_pb2.ShmPushPullRequest) -> AsyncpsError:
        with pytest.raises(AsyncpsError) as caught:
            ring_doorbell(bell, "evil", request, 0.0)
        return caught.value

    header = ps_pb2.PushHeader(worker_id="evil", base_version=version)
    error = ring(ps_pb2.ShmPushPullRequest(header=header, attachment=mapping.attachment,
                                           grads=[mapping.grad_chunks["b"]]))
    assert isinstance(error, AttachAgainError), error  # not this worker's attachment: typed as over gRPC
    owner = ps_pb2.PushHeader(worker_id="w0", base_version=version)
    with_tensor = ps_pb2.FramedRequest(mapped=ps_pb2.ShmPushPullRequest(header=owner, attachment=mapping.attachment,
                                                                 grads=[mapping.grad_chunks["b"]]))
    with_tensor.tensors.add(name="b", dtype=tensor_pb2.FLOAT32, shape=[2], nbytes=8)
    head = with_tensor.SerializeToString()
    body = struct.pack("<I", len(head)) + head
    body += bytes(-len(body) % 8) + np.ones(2, np.float32).tobytes()
    port = int(link.channel.unary_unary(link.path("DataPort"),
                                        request_serializer=ps_pb2.DataPortRequest.SerializeToString,
                                        response_deserializer=ps_pb2.DataPortResponse.FromString)(
        ps_pb2.DataPortRequest(), timeout=5).port)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        send_frame(sock, ps_pb2.FramedRequest(hello=ps_pb2.FramedHello(worker_id="evil")))
        assert read_head(sock, ps_pb2.FramedReply.FromString, "hello", 1 << 16, deadline=time.monotonic() + 10)[0].hello
        sock.sendall(struct.pack("<I", len(body)) + body)
        reply, _ = read_head(sock, ps_pb2.FramedReply.FromString, "reply", 1 << 16, deadline=time.monotonic() + 10)
    assert reply.error.code == Code.INVALID_ARGUMENT.value[0] and "carries row ids (ROW_IDS)" in reply.error.message
    outside = region("b", (40,), 1 << 40)
    error = ring(ps_pb2.ShmPushPullRequest(header=owner, attachment=mapping.attachment, grads=[outside]))
    assert isinstance(error, InvalidArgumentError) and "8-aligned range" in str(error), error
    after = frames.pull("probe")
    assert after.version == before.version and after.values is not None and before.values is not None
    assert all(after.values[n].tobytes() == before.values[n].tobytes() for n in before.values)
    outcome, reply = client.push_pull(PushRequest("w0", version, {"b": np.ones(40, np.float32)}), -1, buffers)
    assert outcome.accepted and reply.version == version + 1 and client.data._mapping is mapping
    for c in (bell, link, frames, client):
        c.close()
