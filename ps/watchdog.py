"""The shard's side of liveness: notice that the chief has been silent too long.

The chief polls every shard's counters several times a second, so a shard that hears none of the
chief's control calls for `timeout_s` has lost its chief (killed and not restarted, or cut off);
it then exits non-zero instead of serving forever. Before the first call a chief is still
starting (loading TensorFlow, the data and the model can take a minute on a busy host), so a
chief that never comes is given `startup_s` (or the timeout, if longer). Only the chief's calls
count: workers still pushing to a shard whose chief is gone do not keep it alive.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from asyncps.wire.proto import SHARD_SERVICE

# The calls only a chief makes (GetStats is its poll, several times a second).
CHIEF_METHODS = frozenset(f"/{SHARD_SERVICE}/{m}" for m in (
    "Initialize", "Restore", "GetStats", "SetLiveWorkers", "Pause", "Snapshot", "Shutdown", "SetBackup", "Promote"))


class ChiefWatch:
    """When the chief was last heard; `timeout_s` 0 disables the watch. Thread-safe."""

    def __init__(self, timeout_s: float, startup_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s < 0:
            raise ValueError("chief timeout must be >= 0 (0: never give up on the chief)")
        self.timeout_s = timeout_s
        self.startup_s = startup_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last = clock()
        self._ever_heard = False

    def heard(self) -> None:
        """A chief's call arrived."""
        with self._lock:
            self._last = self._clock()
            self._ever_heard = True

    def silent_s(self) -> float:
        """Seconds since the chief was last heard (or since the shard started)."""
        with self._lock:
            return self._clock() - self._last

    def limit_s(self) -> float:
        """How long the chief may be silent now: the timeout, or the startup allowance before its first call."""
        with self._lock:
            return self.timeout_s if self._ever_heard else max(self.timeout_s, self.startup_s)

    def expired(self) -> bool:
        """The chief has been silent for longer than allowed."""
        return self.timeout_s > 0 and self.silent_s() > self.limit_s()

    def interceptor(self) -> grpc.ServerInterceptor[Any, Any]:
        """A server interceptor that marks every chief call as heard (after authentication)."""
        return _HeardInterceptor(self)


class _HeardInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    def __init__(self, watch: ChiefWatch) -> None:
        self._watch = watch

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        if handler_call_details.method in CHIEF_METHODS:
            self._watch.heard()
        return continuation(handler_call_details)


__all__ = ["CHIEF_METHODS", "ChiefWatch"]
