"""Bounded streams: stalled clients against a real shard process with few handler threads, and the
guard's rules (per-connection limit, eviction when full, idle timeout) on a real in-process server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from asyncps.net import rpc
from asyncps.net.streamguard import StreamLimits
from asyncps.pb import ps_pb2
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.transport import GrpcShardTransport
from asyncps.wire.frames import identity
from asyncps.wire.proto import SHARD_SERVICE
from asyncps.wire.shard import PushRequest
from tests.conftest import ShardLauncher

Code = grpc.StatusCode
HANDLER_THREADS = 16
ATTACK_CHANNELS = 3
STREAMS_PER_CHANNEL = 20  # 60 stalled streams against 16 threads
IDLE_TIMEOUT_S = 4.0
HONEST_LIMIT_S = 2.0


def own_connection(address: str) -> grpc.Channel:
    """A channel with a connection of its own (channels to one address share one by default),
    as another client process would have."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def stalled(release: threading.Event) -> Iterator[bytes]:
    """A request stream that sends nothing until released (then ends: an empty, invalid push)."""
    release.wait()
    yield from ()


def open_stalled_pushes(channel: grpc.Channel, count: int, release: threading.Event) -> list[grpc.Future]:
    push = channel.stream_unary(f"/{SHARD_SERVICE}/Push", request_serializer=identity,
                                response_deserializer=ps_pb2.PushResult.FromString)
    return [push.future(stalled(release), timeout=60) for _ in range(count)]


def done_within(calls: list[grpc.Future], timeout: float, at_least: int | None = None) -> list[grpc.Future]:
    """The calls done once at_least of them (default: all) are, or when timeout has passed."""
    need = len(calls) if at_least is None else at_least
    finished = threading.Condition()

    def notify(_: object) -> None:
        with finished:
            finished.notify_all()

    for call in calls:
        call.add_done_callback(notify)
    with finished:
        finished.wait_for(lambda: sum(c.done() for c in calls) >= need, timeout)
    return [c for c in calls if c.done()]


def failure(call: grpc.Future) -> tuple[Code, str]:
    error = call.exception()
    assert isinstance(error, grpc.Call), f"a stalled stream succeeded: {call.result()}"
    return error.code(), error.details() or ""


def test_stalled_streams_beyond_the_thread_count_do_not_starve_an_honest_worker(
        shard_factory: ShardLauncher) -> None:
    (shard,) = shard_factory(1, args=("--handler-threads", str(HANDLER_THREADS),
                                      "--stream-idle-timeout-s", str(IDLE_TIMEOUT_S)))
    honest = GrpcShardTransport(shard.address, deadline_s=10, call_timeout_s=10)
    honest.initialize("chief", 0, 1, UpdateRuleConfig(OptimizerConfig("sgd", 1.0)),
                      {"w": np.zeros((4, 3), np.float32)})
    release = threading.Event()
    channels = [own_connection(shard.address) for _ in range(ATTACK_CHANNELS)]
    try:
        start = time.monotonic()
        attack = [call for ch in channels for call in open_stalled_pushes(ch, STREAMS_PER_CHANNEL, release)]
        # the streams over each connection's limit come back refused at once
        refused_quickly = done_within(attack, HONEST_LIMIT_S, at_least=len(attack) - HANDLER_THREADS)
        assert len(refused_quickly) >= len(attack) - HANDLER_THREADS, shard.log_tail()
        for call in refused_quickly:
            code, details = failure(call)
            assert code is Code.RESOURCE_EXHAUSTED, details
            assert "streams already open on this connection" in details or "evicted" in details, details

        slowest = 0.0
        for _ in range(3):  # an honest worker pulls and pushes while the rest stay stalled
            began = time.monotonic()
            pulled = honest.pull("worker-0")
            outcome = honest.push(PushRequest("worker-0", pulled.version, {"w": np.ones((4, 3), np.float32)}))
            took = time.monotonic() - began
            assert outcome.accepted, outcome
            assert took < HONEST_LIMIT_S, f"honest pull + push took {took:.2f}s\n{shard.log_tail()}"
            slowest = max(slowest, took)
        print(f"{len(attack)} stalled streams, {HANDLER_THREADS} threads: slowest honest pull + push {slowest:.3f}s")
        assert honest.stats().version == 3
        stalled_still = [c for c in attack if not c.done()]
        assert stalled_still, "no stream was left stalled: the test did not stress the shard"

        # the idle timeout ends the rest, with a reason
        done = done_within(attack, IDLE_TIMEOUT_S + 10)
        assert len(done) == len(attack), f"{len(attack) - len(done)} stalled streams outlived the idle timeout"
        idle = [failure(c) for c in stalled_still]
        assert all(code is Code.RESOURCE_EXHAUSTED for code, _ in idle), idle
        assert any("idle stream" in details for _, details in idle), idle
        assert time.monotonic() - start < IDLE_TIMEOUT_S + 15
        assert honest.stats().version == 3  # the stalled pushes changed nothing
    finally:
        release.set()
        for ch in channels:
            ch.close()
        honest.close()


# -- the rules, on an in-process server ---------------------------------------------------------
class Echo:
    """A tiny real service: Upload (client stream), Download (server stream), Ping (unary)."""

    def __init__(self) -> None:
        self.started = threading.Semaphore(0)

    def upload(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        self.started.release()
        return b"".join(requests)

    def download(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        self.started.release()
        for _ in range(int(request or b"1")):
            yield b"x" * 65536

    def ping(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        return b"pong"


@pytest.fixture
def echo_server() -> Iterator[tuple[str, Echo]]:
    echo = Echo()

    def register(server: grpc.Server) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {
            "Upload": grpc.stream_unary_rpc_method_handler(echo.upload),
            "Download": grpc.unary_stream_rpc_method_handler(echo.download),
            "Ping": grpc.unary_unary_rpc_method_handler(echo.ping),
        }),))

    server, port, _ = rpc.create_server("127.0.0.1:0", [register], max_workers=12,
                                        stream_limits=StreamLimits(max_streams=4, max_streams_per_peer=3,
                                                                   idle_timeout_s=1.0))
    yield f"127.0.0.1:{port}", echo
    server.stop(None)


def test_per_connection_limit_eviction_and_idle_timeout(echo_server: tuple[str, Echo]) -> None:
    address, echo = echo_server
    release = threading.Event()
    first, second = own_connection(address), own_connection(address)
    try:
        upload = [ch.stream_unary("/test.Echo/Upload") for ch in (first, second)]
        calls = []
        for _ in range(3):  # three stalled uploads on the first connection: its limit
            calls.append(upload[0].future(stalled(release), timeout=30))
            assert echo.started.acquire(timeout=5)
        over = upload[0].future(stalled(release), timeout=30)
        code, details = failure(over)
        assert code is Code.RESOURCE_EXHAUSTED and "3 streams already open on this connection (limit 3)" in details

        calls.append(upload[1].future(stalled(release), timeout=30))  # the fourth: server full now
        assert echo.started.acquire(timeout=5)
        newcomer = upload[1].future(iter([b"a", b"b"]), timeout=30)  # evicts the longest stalled
        assert newcomer.result() == b"ab"
        code, details = failure(calls[0])
        assert code is Code.RESOURCE_EXHAUSTED and "evicted after waiting" in details, details
        assert first.unary_unary("/test.Echo/Ping")(b"", timeout=5) == b"pong"  # unary calls are never counted

        for call in calls[1:]:  # the idle timeout ends the others
            code, details = failure(call)
            assert code is Code.RESOURCE_EXHAUSTED and "idle stream" in details, details
        assert upload[0].future(iter([b"c"]), timeout=30).result() == b"c"  # their slots are free again
    finally:
        release.set()
        first.close()
        second.close()


def test_a_client_that_does_not_read_its_download_is_ended(echo_server: tuple[str, Echo]) -> None:
    address, _ = echo_server
    with grpc.insecure_channel(address) as channel:
        replies = channel.unary_stream("/test.Echo/Download")(b"2000", timeout=30)  # ~128 MB, never read
        start = time.monotonic()
        while True:
            try:
                next(replies)
            except grpc.RpcError as exc:
                assert exc.code() is Code.RESOURCE_EXHAUSTED and "idle stream" in (exc.details() or "")  # type: ignore[attr-defined]
                break
            if time.monotonic() - start < 0.1:
                time.sleep(3)  # stop reading after the first message: the server's sends stall
        assert time.monotonic() - start < 10
