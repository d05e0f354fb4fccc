"""The shard's side of the transport seam: one adapter per transport over the one ShardService.

asyncps.ps.main builds every registered transport's adapter (asyncps.transport.registry names
each factory as "module:attribute") from one `ShardSide`, registers the gRPC methods they answer
on the shard's one gRPC server, starts them and closes them. An adapter translates its messages
to service calls and back; what a call means is decided by the service, once for every path.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from asyncps.ps.service import ShardService

from asyncps.errors import InvalidArgumentError
from asyncps.net.framed import DEFAULT_MAX_REQUEST_BYTES, FramedKind
from asyncps.net.handlers import Handler
from asyncps.net.security import LOOPBACK_HOST, SecurityConfig
from asyncps.net.streamguard import DEFAULT_IDLE_TIMEOUT_S
from asyncps.pb import ps_pb2
from asyncps.wire.codec import DEFAULT_CHUNK_BYTES
from asyncps.wire.proto import SHARD_SERVICE, decisions_to_proto
from asyncps.wire.shard import ShardValues

MAX_WAIT_S = 300.0  # longest a long-poll blocks, whatever the caller asks


class AdapterStartError(RuntimeError):
    """A transport adapter cannot begin serving (its message says what to change): the shard exits."""


@dataclass(frozen=True)
class ShardSide:
    """What every shard adapter is built from: the shard's one service and its serving settings."""

    service: ShardService
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    on_shutdown: Callable[[str], None] | None = None
    # replicated shards (asyncps.ps.replica): attach a backup at an address ("": let it go; the version it is
    # seeded at), and take over a dead primary's port (where the shard serves now); None: not offered
    on_set_backup: Callable[[str], int] | None = None
    on_promote: Callable[[int], int] | None = None
    host: str = LOOPBACK_HOST  # where an adapter with a listener of its own binds (the shard's --host)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    # the plugin modules a request's rule spec may import (the shard's --plugins; entry points always)
    plugin_modules: frozenset[str] = frozenset()
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S  # how long a connection of its own may wait on its client
    # the shard settings by name (asyncps.transport.registry.ShardSetting: the data connection's, e.g.
    # data_port, and each transport's), given ones checked and the others at their defaults
    settings: Mapping[str, Any] = field(default_factory=dict)
    # the request kinds each channel answers on the shard's framed data connection (asyncps.net.framed:
    # tcp's pull, push and push-pull, shm's doorbell), side by side, by kind, offered as the adapters
    # are built (asyncps.ps.main.shard_adapters) and served by the data port (asyncps.ps.dataport)
    framed_kinds: dict[str, FramedKind] = field(default_factory=dict, compare=False)

    @property
    def framed_request_bytes(self) -> int:
        """The largest request the framed data connection reads: the shard's, within the connection's cap."""
        return min(self.max_request_bytes, DEFAULT_MAX_REQUEST_BYTES)

    def offer(self, kind: FramedKind) -> None:
        """Answer `kind.kind` on every framed data connection of this shard."""
        if kind.kind in self.framed_kinds:
            raise ValueError(f"framed request kind {kind.kind!r} is answered by two transport adapters")
        self.framed_kinds[kind.kind] = kind

    def setting(self, name: str) -> Any:
        """A transport's shard setting (its registry entry names it and its default; shard_adapters
        fills in the defaults and checks the values)."""
        try:
            return self.settings[name]
        except KeyError:
            raise KeyError(f"no shard setting {name!r} (known: {sorted(self.settings)})") from None


class ShardAdapter(Protocol):
    """One transport's shard side."""

    def rpc_handlers(self) -> Mapping[str, Handler]:
        """The shard gRPC service's methods it answers, by name (none for a path of its own)."""

    def start(self) -> None:
        """Begin serving beyond gRPC (e.g. a data port), once the gRPC server is up."""

    def close(self) -> None:
        """Stop serving and release what it holds."""


AdapterFactory = Callable[[ShardSide], ShardAdapter]


def load_adapter_factory(spec: str) -> AdapterFactory:
    """The factory a registry entry names as "module:attribute"."""
    module, _, attribute = spec.partition(":")
    if not module or not attribute:
        raise ValueError(f"shard adapter {spec!r}: expected 'module:attribute'")
    factory: AdapterFactory = getattr(importlib.import_module(module), attribute)
    return factory


def add_handlers(server: grpc.Server, adapters: Sequence[ShardAdapter]) -> None:
    """Register every adapter's methods as the one shard service (a method answered twice is an error)."""
    handlers: dict[str, Handler] = {}
    for adapter in adapters:
        for name, handler in adapter.rpc_handlers().items():
            if name in handlers:
                raise ValueError(f"shard method {name} is answered by two transport adapters")
            handlers[name] = handler
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SHARD_SERVICE, handlers),))


def checked_wait(what: str, asked_s: float, max_wait_s: float = MAX_WAIT_S) -> float:
    """How long a long-poll may block: what the caller asked (a finite number >= 0, else
    InvalidArgumentError naming `what`), within max_wait_s and our cap."""
    if not math.isfinite(asked_s) or asked_s < 0:
        raise InvalidArgumentError(f"{what} must be a finite number of seconds >= 0, got {asked_s}")
    return max(0.0, min(asked_s, max_wait_s, MAX_WAIT_S))


def wait_limit(what: str, asked_s: float, context: grpc.ServicerContext, margin_s: float = 0.0) -> float:
    """How long a long-poll may block: what the caller asked, within its deadline and our cap."""
    remaining = context.time_remaining()
    return checked_wait(what, asked_s, MAX_WAIT_S if remaining is None else remaining - margin_s)


def reply_header(reply: ShardValues, push: ps_pb2.PushResult | None, shard_index: int) -> ps_pb2.PullHeader:
    """The header of a pull or push-pull reply, whatever path its values take."""
    header = ps_pb2.PullHeader(version=reply.version, not_modified=reply.values is None,
                               shard_index=shard_index, push=push, waited_s=reply.waited_s,
                               incarnation=reply.incarnation)
    if reply.decisions is not None:
        header.sync.CopyFrom(decisions_to_proto(reply.decisions))
    return header


__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "MAX_WAIT_S",
    "AdapterFactory",
    "AdapterStartError",
    "ShardAdapter",
    "ShardSide",
    "add_handlers",
    "checked_wait",
    "load_adapter_factory",
    "reply_header",
    "wait_limit",
]
