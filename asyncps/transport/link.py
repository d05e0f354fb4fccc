"""One gRPC channel to one shard, with its deadlines and retry policy: what the control face and
every data path over gRPC share (and what a data path's factory is handed, asyncps.transport.base)."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import TypeVar

import grpc

from asyncps.net.rpc import call_with_retry, make_channel
from asyncps.net.security import SecurityConfig, secure_channel
from asyncps.wire.proto import SHARD_SERVICE

T = TypeVar("T")

_RETRY = (grpc.StatusCode.UNAVAILABLE,)
# Training calls also ride through a shard that restarted and waits for the chief to restore it
# (FAILED_PRECONDITION: not initialized).
_TRAINING_RETRY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION)


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
        # the owner's stop event: once set, retries give up at the next failure (call_with_retry)
        self.abort = abort

    @staticmethod
    def path(method: str) -> str:
        """The full path of one of the shard service's methods."""
        return f"/{SHARD_SERVICE}/{method}"

    def retry(self, fn: Callable[[], T], deadline_s: float | None = None, training: bool = False) -> T:
        """Call fn, retrying UNAVAILABLE (and, for training calls on a link that rides restarts, a shard
        waiting to be restored)."""
        codes = _TRAINING_RETRY if training and self.ride_restarts else _RETRY
        return call_with_retry(fn, f"parameter server {self.address}",
                               self.deadline_s if deadline_s is None else deadline_s, retry_codes=codes,
                               rng=self._rng, abort=self.abort)

    def close(self) -> None:
        """Close the channel."""
        self.channel.close()


__all__ = ["ShardLink"]
