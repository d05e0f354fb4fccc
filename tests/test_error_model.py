"""One error model below the seam: against a real shard process, a failure over gRPC frames and the
same failure over the TCP data path reach the code above the seam as the same asyncps.errors type,
with the same status code name and detail (never a grpc.RpcError)."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import pytest

from asyncps.errors import (
    AsyncpsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
    Unreachable,
)
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.transport import ShardClient, connect_shard
from asyncps.transport.tcp import TcpDataPath
from asyncps.wire.shard import PushRequest

if TYPE_CHECKING:
    from conftest import ShardLauncher

RULE = UpdateRuleConfig(OptimizerConfig("sgd", 0.5))
PATHS = ("grpc", "tcp")
B = np.ones(4, np.float32)


def over_tcp(client: ShardClient) -> bool:
    """Whether the client's tensors (and so its failures) still travel over its TCP data connection."""
    return isinstance(client.data, TcpDataPath) and client.data.uses_tcp


def failure(client: ShardClient, call: Callable[[ShardClient], object]) -> AsyncpsError:
    """The asyncps error `call` fails with (anything else, a grpc.RpcError included, fails the test)."""
    with pytest.raises(AsyncpsError) as caught:
        call(client)
    return caught.value


def same_failure(clients: dict[str, ShardClient], call: Callable[[ShardClient], object]) -> AsyncpsError:
    """The failure of `call` over each path, checked to be one error: type, code and detail."""
    errors = {path: failure(client, call) for path, client in clients.items()}
    assert over_tcp(clients["tcp"]), "the TCP path fell back to frames: its failure was not its own"
    grpc_error, tcp_error = errors["grpc"], errors["tcp"]
    assert type(grpc_error) is type(tcp_error), errors
    assert (grpc_error.code, grpc_error.detail) == (tcp_error.code, tcp_error.detail), errors
    return grpc_error


@pytest.fixture
def clients(shard_factory: ShardLauncher) -> Iterator[dict[str, ShardClient]]:
    """A fresh, uninitialized shard process and a client to it over each path."""
    address = shard_factory(1)[0].address
    made = {path: connect_shard(address, deadline_s=20, transport=path) for path in PATHS}
    yield made
    for client in made.values():
        client.close()


def test_the_shards_refusals_are_one_error_type_on_every_path(clients: dict[str, ShardClient]) -> None:
    # before initialization: a push (not ridden through, unlike a training call) is refused
    refused = same_failure(clients, lambda c: c.push(PushRequest("w", 0, {"b": B})))
    assert isinstance(refused, FailedPreconditionError) and refused.code == "FAILED_PRECONDITION"
    assert "not initialized" in refused.detail
    clients["grpc"].initialize("chief", 0, 1, RULE, {"b": np.zeros(4, np.float32)})
    unknown = same_failure(clients, lambda c: c.push_pull(PushRequest("w", 0, {"nope": B}), -1, None))
    assert isinstance(unknown, NotFoundError) and unknown.code == "NOT_FOUND"
    assert "unknown variable 'nope'" in unknown.detail
    shape = same_failure(clients, lambda c: c.push(PushRequest("w", 0, {"b": np.ones(5, np.float32)})))
    assert type(shape) is InvalidArgumentError and shape.code == "INVALID_ARGUMENT"
    assert clients["grpc"].stats().version == 0  # every refusal changed nothing


def test_a_dead_address_is_unavailable_on_every_path() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    for path in PATHS:
        client = connect_shard(address, deadline_s=1.0, call_timeout_s=1.0, transport=path)
        try:
            with pytest.raises(UnavailableError) as caught:
                client.pull("w")
            assert type(caught.value) is Unreachable and caught.value.code == "UNAVAILABLE", path
            assert f"parameter server {address}" in str(caught.value) and "UNAVAILABLE" in str(caught.value), path
            assert path == "grpc" or over_tcp(client)  # not handed to frames: the TCP path's own failure
        finally:
            client.close()
