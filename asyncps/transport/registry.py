"""The registry of transports: one entry per data path, read by connect_shard, RunConfig's
validation of `transport` and the `--transport` help.

An entry names the client's data-path factory, the shard-side adapter (as "module:attribute",
because the shard is a role and the core never imports a role: asyncps.ps.main loads it), an
availability check for this host, a one-line help and the shard-side settings its adapter
reads (each an `asyncps ps` flag and ASYNCPS_* variable, generated from the entry). The shard's
framed data connection, which every lean channel rides, is no transport: its two shard settings
(DATA_CONNECTION_SETTINGS: `--data-port`, `--max-data-connections`) are the registry's own, read by
the shard's one data port (asyncps.ps.dataport). "auto" is a
policy over the entries, not an entry: the available ones with an `auto_rank`, best first, each
falling back to the next, ending in the base path (gRPC frames), which every shard serves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from asyncps.net.framed import DEFAULT_MAX_CONNECTIONS
from asyncps.placement import Placement
from asyncps.transport import shmseg
from asyncps.transport.base import ClientSetup, DataPath, ModelBuffers
from asyncps.transport.grpc_shard import frames_data_path
from asyncps.transport.shm import shm_data_path, shm_model_buffers
from asyncps.transport.tcp import tcp_data_path

AUTO = "auto"
BASE = "grpc"  # the path every shard serves and every other path can fall back to

# (setup, the path to fall back to or None, asked for by name) -> the data path to one shard
DataPathFactory = Callable[[ClientSetup, "DataPath | None", bool], DataPath]
# (the worker's placement, its number of shards) -> where its model's values live (None: its own arrays)
ModelBuffersFactory = Callable[[Placement, int], "ModelBuffers | None"]


def _always() -> str | None:
    return None


def _fine(value: Any) -> str | None:
    return None


@dataclass(frozen=True)
class ShardSetting:
    """A shard-side setting of one transport or of the data connection: `asyncps ps FLAG` (env
    ASYNCPS_<NAME>), handed to its adapter as ShardSide.setting(name); `check` says why a value is
    wrong (None: fine)."""

    flag: str  # e.g. "--data-port"; its name is "data_port"
    default: int | float | str
    help: str
    check: Callable[[Any], str | None] = _fine

    @property
    def name(self) -> str:
        """The setting's key: the flag without dashes, in snake case."""
        return self.flag.lstrip("-").replace("-", "_")


DEFAULT_MAX_DATA_CONNECTIONS = DEFAULT_MAX_CONNECTIONS
DATA_CONNECTION = "data connection"  # the owner of DATA_CONNECTION_SETTINGS in help and errors


def _port_or_none(value: Any) -> str | None:
    return None if isinstance(value, int) and -1 <= value < 65536 else "a port number, 0 (any free port) or -1 (none)"


def _at_least_one(value: Any) -> str | None:
    return None if isinstance(value, int) and value >= 1 else "an integer >= 1"


# the shard's framed data connection's own settings (asyncps.ps.dataport reads them): no channel
# owns them, because every lean channel's request kinds (tcp's, shm's doorbell) ride the one port
DATA_CONNECTION_SETTINGS = (
    ShardSetting("--data-port", 0, "the framed data connection's port (tcp's tensors, shm's doorbell), "
                 "announced to workers over gRPC (0: any free port; -1: none, workers use gRPC frames)",
                 _port_or_none),
    ShardSetting("--max-data-connections", DEFAULT_MAX_DATA_CONNECTIONS,
                 "framed data connections at once (the one idle longest yields to a newcomer)", _at_least_one),
)


@dataclass(frozen=True)
class Transport:
    """One way tensors travel between a worker and a shard (the control face is always gRPC)."""

    name: str
    help: str  # one line, for --transport's help and error messages
    data_path: DataPathFactory  # the client's side
    shard_adapter: str  # "module:attribute" of the shard side's factory (asyncps.ps.adapter.AdapterFactory)
    unavailable: Callable[[], str | None] = _always  # why it cannot run on this host, None when it can
    auto_rank: int | None = None  # place in "auto"'s preference (lower first); None: only by name
    shard_settings: tuple[ShardSetting, ...] = ()  # what its shard adapter can be told
    # where a worker's model values live when this path may carry them (shm: one arena its shards map)
    model_buffers: ModelBuffersFactory | None = None


class TransportRegistry:
    """Transports by name, in registration order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, Transport] = {}

    def register(self, transport: Transport) -> Transport:
        """Add a transport; a name may be registered once."""
        with self._lock:
            if transport.name == AUTO or transport.name in self._entries:
                raise ValueError(f"transport {transport.name!r} is already registered")
            taken = {s.name for _, s in self._shard_settings()}
            clash = sorted(taken & {s.name for s in transport.shard_settings})
            if clash:
                raise ValueError(f"transport {transport.name!r}: shard settings {clash} belong to another transport "
                                 f"or the {DATA_CONNECTION}")
            self._entries[transport.name] = transport
        return transport

    def unregister(self, name: str) -> None:
        """Remove a transport (tests registering their own)."""
        if name == BASE:
            raise ValueError(f"transport {BASE!r} is the base path and cannot be removed")
        with self._lock:
            self._entries.pop(name, None)

    def __iter__(self) -> Iterator[Transport]:
        with self._lock:
            return iter(list(self._entries.values()))

    def names(self) -> tuple[str, ...]:
        """Every valid value of `transport`: "auto" and each registered name."""
        return (AUTO, *(t.name for t in self))

    def get(self, name: str) -> Transport:
        """The entry of a name (ValueError naming the valid ones)."""
        with self._lock:
            entry = self._entries.get(name)
        if entry is None:
            raise ValueError(f"transport {name!r}: one of {', '.join(self.names())}")
        return entry

    def shard_settings(self) -> list[tuple[str, ShardSetting]]:
        """Every shard-side setting with its owner's name: the data connection's, then each
        transport's in registration order."""
        with self._lock:
            return self._shard_settings()

    def _shard_settings(self) -> list[tuple[str, ShardSetting]]:
        """shard_settings, the caller holding the lock."""
        return [*((DATA_CONNECTION, s) for s in DATA_CONNECTION_SETTINGS),
                *((t.name, s) for t in self._entries.values() for s in t.shard_settings)]

    def shard_setting_values(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Every shard setting's value: `given`'s, else its default; a ValueError naming the flag
        of a wrong value, or a name no transport has."""
        known = {s.name: (owner, s) for owner, s in self.shard_settings()}
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(f"no transport has the shard setting(s) {unknown}; known: {sorted(known)}")
        values: dict[str, Any] = {}
        for name, (owner, setting) in known.items():
            value = given.get(name, setting.default)
            why = setting.check(value)
            if why is not None:
                raise ValueError(f"{setting.flag} ({owner}): {why}, got {value!r}")
            values[name] = value
        return values

    def problem(self, name: str) -> str | None:
        """Why `name` is not a valid transport setting, None when it is (configuration validation)."""
        if name in self.names():
            return None
        return f"transport must be one of {', '.join(self.names())}, not {name!r}"

    def help(self) -> str:
        """The --transport help: the auto policy, then one line per transport."""
        order = " > ".join(t.name for t in self.auto_order())
        return ("how workers move tensors to shards: auto (the best path that works: " + order + ") | "
                + " | ".join(f"{t.name} ({t.help})" for t in self))

    def auto_order(self) -> list[Transport]:
        """The transports "auto" tries, best first, ending with the base path."""
        ranked = sorted((t for t in self if t.auto_rank is not None and t.name != BASE),
                        key=lambda t: t.auto_rank if t.auto_rank is not None else 0)
        return [*ranked, self.get(BASE)]

    def chain(self, name: str) -> list[tuple[Transport, bool]]:
        """The paths to build for a `transport` setting, best first, each (entry, asked for by name):
        auto's available ones, or the named one (an error where it cannot run) over the base path."""
        if name == AUTO:
            return [(t, False) for t in self.auto_order() if t.unavailable() is None]
        entry = self.get(name)
        why = entry.unavailable()
        if why is not None:
            raise ValueError(f"transport {name}: {why}")
        return [(entry, True)] if name == BASE else [(entry, True), (self.get(BASE), False)]

    def model_buffers(self, name: str, placement: Placement, shards: int) -> ModelBuffers | None:
        """A worker's model buffers for a `transport` setting: from the best path in its chain that
        provides some (None: the worker's own arrays)."""
        for entry, _ in self.chain(name):
            if entry.model_buffers is not None:
                return entry.model_buffers(placement, shards)
        return None

    def data_path(self, name: str, setup: ClientSetup) -> DataPath:
        """The data path to one shard for a `transport` setting: each path in the chain is built
        over the one after it (its fallback)."""
        path: DataPath | None = None
        for entry, named in reversed(self.chain(name)):
            path = entry.data_path(setup, path, named)
        assert path is not None  # the chain always holds the base path
        return path


def _no_shm() -> str | None:
    return None if shmseg.available() else f"no writable {shmseg.SHM_DIR} on this host"


TRANSPORTS = TransportRegistry()
TRANSPORTS.register(Transport(
    BASE, "gRPC frames: works across hosts; the reference and the fallback",
    frames_data_path, "asyncps.ps.servicer:grpc_adapter"))
TRANSPORTS.register(Transport(
    "shm", "shared memory with shards on the same host, required",
    shm_data_path, "asyncps.ps.shm:ShmAdapter", unavailable=_no_shm, auto_rank=0,
    model_buffers=shm_model_buffers))
TRANSPORTS.register(Transport(
    "tcp", "a TCP data connection per shard to the port it announces; gRPC frames when that port cannot be reached",
    tcp_data_path, "asyncps.ps.tcp:TcpAdapter", auto_rank=1))

__all__ = ["AUTO", "BASE", "DATA_CONNECTION", "DATA_CONNECTION_SETTINGS", "DEFAULT_MAX_DATA_CONNECTIONS", "TRANSPORTS",
           "DataPathFactory", "ModelBuffersFactory", "ShardSetting", "Transport", "TransportRegistry"]
