"""One gRPC channel to one shard, with its deadlines and retry policies: what the control face and
every data path over gRPC share (and what a data path's factory is handed, asyncps.transport.base);
and the framed data connection a lean channel opens to the data port the shard announces over it.

The link is the gRPC paths' edge: every call through `retry` fails with asyncps.errors, never a
grpc.RpcError (asyncps.net.rpc.raising_domain_errors), and is retried by an asyncps.net.retry policy."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

from asyncps.errors import AsyncpsError, FailedPreconditionError, UnavailableError
from asyncps.net.framed import DEFAULT_CONNECT_TIMEOUT_S, FramedConnection
from asyncps.net.retry import RetryPolicy
from asyncps.net.rpc import make_channel, raising_domain_errors
from asyncps.net.security import SecurityConfig, secure_channel
from asyncps.pb import ps_pb2
from asyncps.wire.proto import SHARD_SERVICE

T = TypeVar("T")
C = TypeVar("C", bound=FramedConnection)

# Training calls also ride through a shard that restarted and waits for the chief to restore it
# (FAILED_PRECONDITION: not initialized; its typed outcomes are subclasses, never retried).
RIDE_RESTARTS: tuple[type[AsyncpsError], ...] = (UnavailableError, FailedPreconditionError)


class ShardLink:
    """One gRPC channel to one shard with its deadlines and retry policy: the control face and
    every data path over gRPC share it, each building the method stubs it calls."""

    def __init__(
        self,
        address: str,
        deadline_s: float = 60.0,
        security: SecurityConfig | None = None,
        call_timeout_s: float = 30.0,
        seed: int | None = None,
        ride_restarts: bool = True,
        abort: threading.Event | None = None,
    ) -> None:
        self.address = address
        # training calls wait for a restarted shard's restore; the chief, which restores it, must not
        self.ride_restarts = ride_restarts
        self.deadline_s = deadline_s  # how long a call keeps retrying UNAVAILABLE
        self.call_timeout_s = call_timeout_s  # the deadline of one attempt
        self.channel = secure_channel(address, security) if security else make_channel(address)
        self._rng = random.Random(seed)
        # the owner's stop event: once set, retries give up at the next failure (RetryPolicy.stop)
        self.abort = abort
        self.policy = RetryPolicy(deadline_s, stop=abort)  # UNAVAILABLE only
        self.restart_policy = replace(self.policy, retry_on=RIDE_RESTARTS)

    @staticmethod
    def path(method: str) -> str:
        """The full path of one of the shard service's methods."""
        return f"/{SHARD_SERVICE}/{method}"

    def retry(self, fn: Callable[[], T], deadline_s: float | None = None, training: bool = False,
              policy: RetryPolicy | None = None) -> T:
        """Call fn (gRPC calls), its failures raised as asyncps.errors, retrying UNAVAILABLE (and, for
        training calls on a link that rides restarts, a shard waiting to be restored) or as `policy` says."""
        if policy is None:
            policy = self.restart_policy if training and self.ride_restarts else self.policy
        return policy.within(deadline_s).call(raising_domain_errors(fn), f"parameter server {self.address}",
                                              self._rng)

    def close(self) -> None:
        """Close the channel."""
        self.channel.close()


def data_connection(link: ShardLink, security: SecurityConfig | None = None,
                    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                    kind: Callable[..., C] = FramedConnection) -> C:  # type: ignore[assignment]
    """A framed connection (of a channel's `kind`) to the data port the shard announces over `link`
    (DataPort), with the link's deadlines and policies (training calls ride restarts); it connects on
    first use."""
    ask = link.channel.unary_unary(link.path("DataPort"),
                                   request_serializer=ps_pb2.DataPortRequest.SerializeToString,
                                   response_deserializer=ps_pb2.DataPortResponse.FromString)

    def data_port() -> int:
        reply = link.retry(lambda: ask(ps_pb2.DataPortRequest(), timeout=link.call_timeout_s))
        return int(reply.port)

    return kind(link.address, data_port, security, link.deadline_s, link.call_timeout_s, connect_timeout_s,
                abort=link.abort, training_policy=link.restart_policy)


__all__ = ["RIDE_RESTARTS", "ShardLink", "data_connection"]
