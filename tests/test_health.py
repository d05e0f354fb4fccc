"""The standard gRPC health service, our own (asyncps/net/health.py): Check, Watch, graceful shutdown."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest

from asyncps.net import health
from asyncps.net.rpc import create_server, make_channel, serve_health
from asyncps.net.security import SecurityConfig, check_health

TIMEOUT_S = 5.0


@pytest.fixture()
def served() -> Iterator[tuple[health.HealthServicer, grpc.Channel, grpc.Channel]]:
    """A role's server with only the health service, its plaintext probe server, a channel to each."""
    server, port, servicer = create_server("127.0.0.1:0", register=[], max_workers=8)
    probe, probe_port = serve_health("127.0.0.1:0", servicer)
    with make_channel(f"127.0.0.1:{port}") as channel, make_channel(f"127.0.0.1:{probe_port}") as probe_channel:
        yield servicer, channel, probe_channel
    probe.stop(None)
    server.stop(None)


def test_check_answers_serving_then_not_serving_after_graceful_shutdown(
        served: tuple[health.HealthServicer, grpc.Channel, grpc.Channel]) -> None:
    servicer, channel, probe_channel = served
    assert health.check(channel, timeout_s=TIMEOUT_S) == health.SERVING
    assert health.check(probe_channel, timeout_s=TIMEOUT_S) == health.SERVING
    servicer.enter_graceful_shutdown()
    servicer.set(health.OVERALL, health.SERVING)  # ignored from now on
    assert health.check(channel, timeout_s=TIMEOUT_S) == health.NOT_SERVING
    assert health.check(probe_channel, timeout_s=TIMEOUT_S) == health.NOT_SERVING


def test_an_unknown_service_is_not_found(served: tuple[health.HealthServicer, grpc.Channel, grpc.Channel]) -> None:
    _, channel, _ = served
    with pytest.raises(grpc.RpcError) as info:
        health.check(channel, "no.such.Service", timeout_s=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no.such.Service" in (info.value.details() or "")


def test_watch_streams_the_status_and_each_change(
        served: tuple[health.HealthServicer, grpc.Channel, grpc.Channel]) -> None:
    servicer, channel, _ = served
    replies = health.watch(channel, "asyncps.Thing", timeout_s=TIMEOUT_S)
    assert next(replies).status == health.SERVICE_UNKNOWN
    servicer.set("asyncps.Thing", health.SERVING)
    assert next(replies).status == health.SERVING
    servicer.set("asyncps.Thing", health.SERVING)  # no change: nothing sent
    servicer.enter_graceful_shutdown()
    assert next(replies).status == health.NOT_SERVING
    replies.cancel()  # type: ignore[attr-defined]
    # the server still answers once the watch is cancelled
    assert health.check(channel, timeout_s=TIMEOUT_S) == health.NOT_SERVING


def test_served_with_our_own_messages_when_grpcio_health_checking_is_absent() -> None:
    """In a process where grpc_health cannot be imported (as after `pip install asyncps` alone), our
    compiled grpc.health.v1 messages serve and check health."""
    code = (
        "import sys; sys.modules['grpc_health'] = None\n"
        "from asyncps.net import health\n"
        "from asyncps.net.rpc import create_server, make_channel\n"
        "assert health.health_pb2.__name__ == 'asyncps.pb.health_pb2', health.health_pb2.__name__\n"
        "server, port, servicer = create_server('127.0.0.1:0', register=[], max_workers=8)\n"
        "with make_channel(f'127.0.0.1:{port}') as channel:\n"
        "    assert health.check(channel, timeout_s=5) == health.SERVING\n"
        "server.stop(None)\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_check_health_over_the_transport() -> None:
    server, port, other = create_server("127.0.0.1:0", register=[], max_workers=8)
    try:
        assert check_health(f"127.0.0.1:{port}", SecurityConfig(), TIMEOUT_S)
        other.set(health.OVERALL, health.NOT_SERVING)
        assert not check_health(f"127.0.0.1:{port}", SecurityConfig(), TIMEOUT_S)
    finally:
        server.stop(None)
