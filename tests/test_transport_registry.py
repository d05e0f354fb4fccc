"""The transport seam: the registry is the one source of transports (connect_shard, RunConfig,
--help and the shard's start all read it), and typed outcomes, not message text, steer the
shared-memory client (fall back, attach again)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
from asyncps.ps.adapter import ShardSide, add_handlers
from asyncps.ps.main import PsConfig, run_ps, shard_adapters
from asyncps.ps.service import ShardService
from asyncps.ps.shm import ShmAdapter
from asyncps.ps.store import ShardStore

from asyncps.config import RunConfig
from asyncps.errors import AttachAgainError, FailedPreconditionError, PathNotVisibleError, Unreachable
from asyncps.net import rpc
from asyncps.net.handlers import Handler
from asyncps.pb import ps_pb2
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.rundir import wait_port_file
from asyncps.transport import (
    TRANSPORTS,
    ClientSetup,
    DataPath,
    FramesDataPath,
    ShardClient,
    ShmDataPath,
    Transport,
    TransportRegistry,
    connect_shard,
    shmseg,
)
from asyncps.transport.registry import BASE
from asyncps.wire.codec import Array, IndexArray
from asyncps.wire.shard import PushOutcome, PushRequest, ShardValues

RULE = UpdateRuleConfig(OptimizerConfig("sgd", 0.5))
CALL_TIMEOUT_S = 30.0


def initial_values() -> dict[str, np.ndarray]:
    return {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.zeros(4, np.float32)}


def grads() -> dict[str, Array]:
    return {"w": np.ones((3, 4), np.float32), "b": np.ones(4, np.float32)}


# -- a test transport, registered by the test alone --------------------------------------------
@dataclass
class CountingPath:
    """A data path that wraps gRPC frames and counts its calls."""

    frames: FramesDataPath
    calls: dict[str, int] = field(default_factory=dict)

    def _count(self, what: str) -> None:
        self.calls[what] = self.calls.get(what, 0) + 1

    def pull(self, worker_id: str, if_newer_than: int = -1, buffers: Mapping[str, Array] | None = None,
             wait_timeout_s: float = 0.0, rows: Mapping[str, IndexArray] | None = None) -> ShardValues:
        self._count("pull")
        return self.frames.pull(worker_id, if_newer_than, buffers, wait_timeout_s, rows)

    def push(self, request: PushRequest) -> PushOutcome:
        self._count("push")
        return self.frames.push(request)

    def push_pull(self, request: PushRequest, pull_if_newer_than: int = -1,
                  buffers: Mapping[str, Array] | None = None,
                  read_wait_s: float = 0.0, rows: Mapping[str, IndexArray] | None = None
                  ) -> tuple[PushOutcome, ShardValues]:
        self._count("push_pull")
        return self.frames.push_pull(request, pull_if_newer_than, buffers, read_wait_s, rows)

    def close(self) -> None:
        self._count("close")


def counting_data_path(setup: ClientSetup, fallback: DataPath | None, required: bool) -> DataPath:
    return CountingPath(FramesDataPath(setup.link, setup.chunk_bytes))


class CountingAdapter:
    """The test transport's shard side: answers no gRPC method, records that it ran."""

    built: list[CountingAdapter] = []

    def __init__(self, side: ShardSide) -> None:
        self.service = side.service
        self.started = threading.Event()
        self.closed = threading.Event()
        CountingAdapter.built.append(self)

    def rpc_handlers(self) -> dict[str, Handler]:
        return {}

    def start(self) -> None:
        self.started.set()

    def close(self) -> None:
        self.closed.set()


@pytest.fixture
def counting() -> Iterator[Transport]:
    CountingAdapter.built.clear()
    entry = TRANSPORTS.register(Transport("counting", "frames that count their calls (a test)", counting_data_path,
                                          f"{__name__}:CountingAdapter"))
    yield entry
    TRANSPORTS.unregister("counting")


def test_a_registered_transport_is_valid_configuration_and_shown_in_the_help(counting: Transport) -> None:
    assert RunConfig(transport="counting").transport == "counting"
    assert "counting (frames that count their calls (a test))" in TRANSPORTS.help()
    with pytest.raises(ValueError,
                       match="transport must be one of auto, grpc, shm, tcp, counting, not 'carrier-pigeon'"):
        RunConfig(transport="carrier-pigeon")


def test_an_unregistered_transport_is_refused_everywhere() -> None:
    with pytest.raises(ValueError, match="'counting'"):
        RunConfig(transport="counting")
    with pytest.raises(ValueError, match="transport 'counting': one of auto, grpc, shm, tcp"):
        connect_shard("127.0.0.1:1", transport="counting")


def test_a_registered_transport_is_started_by_the_shard_and_chosen_by_name(counting: Transport,
                                                                          tmp_path: Path) -> None:
    """The shard's one place builds and starts the test adapter over its service; connect_shard
    pairs the test data path with the gRPC control face; the tensors take the test path."""
    stop = threading.Event()
    port_file = tmp_path / "port"
    codes: list[int] = []
    shard = threading.Thread(target=lambda: codes.append(run_ps(
        PsConfig(host="127.0.0.1", port=0, port_file=str(port_file), chief_timeout_s=0), stop)))
    shard.start()
    try:
        port = wait_port_file(port_file, CALL_TIMEOUT_S)
        [adapter] = CountingAdapter.built
        assert adapter.started.wait(CALL_TIMEOUT_S)
        client = connect_shard(f"127.0.0.1:{port}", deadline_s=CALL_TIMEOUT_S, transport="counting")
        assert isinstance(client, ShardClient) and isinstance(client.data, CountingPath)
        assert client.initialize("test", 0, 1, RULE, initial_values()).created  # the control face
        outcome, reply = client.push_pull(PushRequest("w0", 0, grads()))
        assert outcome.accepted and reply.version == 1 and reply.values is not None
        np.testing.assert_array_equal(reply.values["b"], -0.5 * np.ones(4, np.float32))
        assert client.push(PushRequest("w0", 1, grads())).accepted
        assert client.pull("w0").version == 2
        assert client.stats().version == 2
        client.close()
        assert client.data.calls == {"push_pull": 1, "push": 1, "pull": 1, "close": 1}
        assert adapter.service.stats().version == 2  # the adapter was given the shard's one service
    finally:
        stop.set()
        shard.join(CALL_TIMEOUT_S)
    assert codes == [0] and adapter.closed.is_set()


def test_auto_is_a_policy_over_the_registry() -> None:
    """Available ranked transports best first, each falling back to the next, the base last; a
    named transport is required (an error where it cannot run) over the base path."""
    registry = TransportRegistry()
    registry.register(TRANSPORTS.get(BASE))
    registry.register(Transport("far", "ranked second", counting_data_path, "m:a", auto_rank=2))
    registry.register(Transport("near", "ranked first", counting_data_path, "m:a", auto_rank=1))
    registry.register(Transport("gone", "never here", counting_data_path, "m:a",
                                unavailable=lambda: "not on this host", auto_rank=0))
    registry.register(Transport("manual", "only by name", counting_data_path, "m:a"))
    assert [(t.name, named) for t, named in registry.chain("auto")] == [("near", False), ("far", False),
                                                                        ("grpc", False)]
    assert [(t.name, named) for t, named in registry.chain("manual")] == [("manual", True), ("grpc", False)]
    assert [(t.name, named) for t, named in registry.chain("grpc")] == [("grpc", True)]
    with pytest.raises(ValueError, match="transport gone: not on this host"):
        registry.chain("gone")
    assert registry.help().startswith("how workers move tensors to shards: auto (the best path that works: "
                                      "gone > near > far > grpc)")
    with pytest.raises(ValueError, match="already registered"):
        registry.register(Transport("auto", "", counting_data_path, "m:a"))


def test_the_shipped_auto_tries_shared_memory_then_tcp_then_grpc_frames() -> None:
    assert [t.name for t in TRANSPORTS.auto_order()] == ["shm", "tcp", "grpc"]
    assert [t.name for t in TRANSPORTS] == ["grpc", "shm", "tcp"]
    assert TRANSPORTS.get("tcp").shard_adapter == "asyncps.ps.tcp:TcpAdapter"


# -- typed outcomes steer the shared-memory client ---------------------------------------------
class BlindShmAdapter(ShmAdapter):
    """A shard that cannot see any segment: says so typed, in words that do not say 'not visible'."""

    @rpc.handles_errors
    def AttachShm(self, request: ps_pb2.AttachShmRequest, context: grpc.ServicerContext) -> ps_pb2.AttachShmResponse:
        raise PathNotVisibleError("segment elsewhere")


class UntypedShmAdapter(ShmAdapter):
    """A shard that refuses with the old words but no typed outcome: the client must not fall back."""

    @rpc.handles_errors
    def AttachShm(self, request: ps_pb2.AttachShmRequest, context: grpc.ServicerContext) -> ps_pb2.AttachShmResponse:
        raise FailedPreconditionError("segment is not visible from this shard")


class ForgetfulShmAdapter(ShmAdapter):
    """A shard that forgets the first attachment once, typed, in words without 'attach again'."""

    attaches = 0
    forgot = False

    def AttachShm(self, request: ps_pb2.AttachShmRequest, context: grpc.ServicerContext) -> ps_pb2.AttachShmResponse:
        ForgetfulShmAdapter.attaches += 1
        return super().AttachShm(request, context)

    def ShmPushPull(self, request: ps_pb2.ShmPushPullRequest, context: grpc.ServicerContext) -> ps_pb2.PullHeader:
        @rpc.handles_errors
        def forget(self: object, request: object, context: grpc.ServicerContext) -> None:
            raise AttachAgainError("mapping lost")

        if not ForgetfulShmAdapter.forgot:
            ForgetfulShmAdapter.forgot = True
            return forget(self, request, context)  # type: ignore[func-returns-value]
        return super().ShmPushPull(request, context)


def serve(shm_adapter: str) -> tuple[grpc.Server, str, ShardService]:
    """An in-process shard whose "shm" adapter is `shm_adapter`, started by the shard's one place."""
    registry = TransportRegistry()
    registry.register(TRANSPORTS.get(BASE))
    registry.register(Transport("shm", "a test's shard side", TRANSPORTS.get("shm").data_path, shm_adapter))
    service = ShardService(ShardStore(shard_index=0))
    service.initialize(RULE, initial_values())
    adapters = shard_adapters(ShardSide(service), registry)
    server, port, _ = rpc.create_server("127.0.0.1:0", [lambda s: add_handlers(s, adapters)], max_workers=8)
    return server, f"127.0.0.1:{port}", service


needs_shm = pytest.mark.skipif(not shmseg.available(), reason="no writable /dev/shm on this host")


@needs_shm
def test_auto_falls_back_to_frames_on_the_typed_outcome() -> None:
    server, address, service = serve(f"{__name__}:BlindShmAdapter")
    try:
        auto = connect_shard(address, deadline_s=CALL_TIMEOUT_S, transport="auto")
        assert isinstance(auto.data, ShmDataPath)
        buffers = {n: np.empty_like(v) for n, v in initial_values().items()}
        outcome, reply = auto.push_pull(PushRequest("w0", 0, grads()), -1, buffers)
        assert outcome.accepted and reply.version == 1 and not auto.data.uses_shared_memory
        assert service.stats().bytes_pushed == sum(g.nbytes for g in grads().values())  # over frames
        forced = connect_shard(address, deadline_s=CALL_TIMEOUT_S, transport="shm")
        with pytest.raises(PathNotVisibleError) as info:
            forced.push_pull(PushRequest("w1", 1, grads()), -1, buffers)
        assert info.value.code == "FAILED_PRECONDITION"
        assert service.stats().version == 1
        for client in (auto, forced):
            client.close()
    finally:
        server.stop(None)


@needs_shm
def test_message_text_alone_does_not_steer_the_client() -> None:
    """The old words without the typed outcome: no fallback, the attach keeps waiting and fails."""
    server, address, service = serve(f"{__name__}:UntypedShmAdapter")
    try:
        auto = connect_shard(address, deadline_s=0.5, transport="auto")
        buffers = {n: np.empty_like(v) for n, v in initial_values().items()}
        with pytest.raises(Unreachable) as info:  # the attach waited for a restore, as for any FAILED_PRECONDITION
            auto.push_pull(PushRequest("w0", 0, grads()), -1, buffers)
        assert "FAILED_PRECONDITION" in str(info.value) and "not visible" in str(info.value)
        assert service.stats().version == 0
        auto.close()
    finally:
        server.stop(None)


@needs_shm
def test_the_typed_attach_again_maps_a_fresh_segment() -> None:
    ForgetfulShmAdapter.attaches, ForgetfulShmAdapter.forgot = 0, False
    server, address, service = serve(f"{__name__}:ForgetfulShmAdapter")
    try:
        client = connect_shard(address, deadline_s=CALL_TIMEOUT_S, transport="shm")
        buffers = {n: np.empty_like(v) for n, v in initial_values().items()}
        outcome, reply = client.push_pull(PushRequest("w0", 0, grads()), -1, buffers)
        assert outcome.accepted and reply.version == 1
        assert isinstance(client.data, ShmDataPath) and client.data.uses_shared_memory
        assert ForgetfulShmAdapter.forgot and ForgetfulShmAdapter.attaches == 2
        assert service.stats().version == 1  # the forgotten exchange changed nothing
        client.close()
    finally:
        server.stop(None)


# -- a transport's own shard settings ------------------------------------------------------------
class KnobAdapter:
    """A shard adapter that only records the setting it was given."""

    seen: list[int] = []

    def __init__(self, side: ShardSide) -> None:
        KnobAdapter.seen.append(int(side.setting("probe_knob")))

    def rpc_handlers(self) -> Mapping[str, Handler]:
        return {}

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass


def _positive(value: object) -> str | None:
    return None if isinstance(value, int) and value > 0 else "an integer > 0"


def test_a_transports_shard_settings_come_from_its_entry_alone(capsys: pytest.CaptureFixture[str]) -> None:
    """Declared in the registry entry, a setting reaches its adapter (default or given), a wrong
    value is refused naming its flag, and no two transports may claim one name; the real tcp
    entry's settings are `asyncps ps` flags with their ASYNCPS_* variables."""
    from asyncps.tools.cli import build_parser
    from asyncps.transport.registry import ShardSetting

    registry = TransportRegistry()
    registry.register(TRANSPORTS.get(BASE))
    knob = ShardSetting("--probe-knob", 3, "a test's knob", _positive)
    registry.register(Transport("probe", "a test's transport", TRANSPORTS.get(BASE).data_path,
                                f"{__name__}:KnobAdapter", shard_settings=(knob,)))
    service = ShardService(ShardStore(shard_index=0))
    KnobAdapter.seen.clear()
    shard_adapters(ShardSide(service), registry)
    shard_adapters(ShardSide(service, settings={"probe_knob": 7}), registry)
    assert KnobAdapter.seen == [3, 7]
    with pytest.raises(ValueError, match=r"--probe-knob \(probe\): an integer > 0, got 0"):
        shard_adapters(ShardSide(service, settings={"probe_knob": 0}), registry)
    with pytest.raises(ValueError, match="no transport has the shard setting"):
        shard_adapters(ShardSide(service, settings={"tcp_knob": 1}), registry)
    shard_adapters(ShardSide(service, settings={"data_port": -1}), registry)  # the data connection's, tcp or not
    with pytest.raises(ValueError, match="belong to another transport or the data connection"):
        registry.register(Transport("probe3", "another", TRANSPORTS.get(BASE).data_path, f"{__name__}:KnobAdapter",
                                    shard_settings=(ShardSetting("--data-port", 1, "again"),)))
    with pytest.raises(ValueError, match="belong to another transport"):
        registry.register(Transport("probe2", "another", TRANSPORTS.get(BASE).data_path, f"{__name__}:KnobAdapter",
                                    shard_settings=(ShardSetting("--probe-knob", 1, "again"),)))
    parser = build_parser()
    args = parser.parse_args(["ps", "--data-port", "-1", "--max-data-connections", "3"])
    assert (args.data_port, args.max_data_connections) == (-1, 3)
    with pytest.raises(SystemExit):
        parser.parse_args(["ps", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "env ASYNCPS_DATA_PORT" in help_text and "env ASYNCPS_MAX_DATA_CONNECTIONS" in help_text
    assert "[data connection]" in help_text
    with pytest.raises(ValueError, match=r"--max-data-connections \(data connection\)"):
        PsConfig(transport_settings={"max_data_connections": 0})


@needs_shm
def test_shared_memory_rings_over_the_data_port_without_the_tcp_adapter() -> None:
    """The data port is the shard's, not tcp's: with only gRPC and shm registered, shard_adapters
    still opens it and the shm client rings its doorbell there."""
    registry = TransportRegistry()
    registry.register(TRANSPORTS.get(BASE))
    registry.register(TRANSPORTS.get("shm"))
    service = ShardService(ShardStore(shard_index=0))
    service.initialize(RULE, initial_values())
    adapters = shard_adapters(ShardSide(service), registry)
    server, port, _ = rpc.create_server("127.0.0.1:0", [lambda s: add_handlers(s, adapters)], max_workers=8)
    for adapter in adapters:
        adapter.start()
    try:
        client = connect_shard(f"127.0.0.1:{port}", deadline_s=CALL_TIMEOUT_S, transport="shm", registry=registry)
        buffers = {n: np.empty_like(v) for n, v in initial_values().items()}
        outcome, reply = client.push_pull(PushRequest("w0", 0, grads()), -1, buffers)
        assert outcome.accepted and reply.version == 1
        assert isinstance(client.data, ShmDataPath) and client.data.uses_shared_memory
        assert client.data.rings_over_data_connection
        client.close()
    finally:
        server.stop(None)
        for adapter in reversed(adapters):
            adapter.close()
