"""Parameter-server process: serve one shard until asked to shut down (or signalled)."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
from asyncps.ps.adapter import (
    DEFAULT_MAX_REQUEST_BYTES,
    AdapterStartError,
    ShardAdapter,
    ShardSide,
    add_handlers,
    load_adapter_factory,
)
from asyncps.ps.dataport import DataPortAdapter
from asyncps.ps.replica import ForwardingJournal
from asyncps.ps.service import DEFAULT_MAX_WAITERS, ShardService
from asyncps.ps.servicer import SHARD_HANDLER_THREADS
from asyncps.ps.store import ShardStore
from asyncps.ps.watchdog import ChiefWatch

from asyncps.errors import AsyncpsError, FailedPreconditionError, InvalidArgumentError
from asyncps.net.rpc import create_server, serve_health
from asyncps.net.security import LOOPBACK_HOST, SecurityConfig, check_host, exposure_warning
from asyncps.net.streamguard import DEFAULT_IDLE_TIMEOUT_S, StreamLimits
from asyncps.procenv import freeze_heap
from asyncps.rules.registry import import_plugin_modules
from asyncps.rundir import write_port_file
from asyncps.transport import ShardClient, connect_shard
from asyncps.transport.registry import TRANSPORTS, TransportRegistry
from asyncps.wire.codec import DEFAULT_CHUNK_BYTES

log = logging.getLogger("asyncps.ps")

NO_SSP_BOUND_ENV = "ASYNCPS_TEST_NO_SSP_BOUND"


@dataclass(frozen=True)
class PsConfig:
    """Where one shard serves."""

    host: str = LOOPBACK_HOST  # this machine only; containers and clusters say --host 0.0.0.0
    port: int = 8470
    index: int = 0
    port_file: str = ""
    health_port: int | None = None  # also serve the health service in plaintext here (kubelet probes)
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    security: SecurityConfig = field(default_factory=SecurityConfig)
    chief_timeout_s: float = 120.0  # exit (non-zero) after this long without a call from the chief; 0: never
    handler_threads: int = SHARD_HANDLER_THREADS
    stream_idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    max_streams_per_peer: int = 0  # 0: asyncps.net.streamguard's default for the thread count
    # the shard settings by name (the registry declares them: the data connection's --data-port, each transport's)
    transport_settings: Mapping[str, Any] = field(default_factory=dict)
    # modules whose plugins (`module:Class` rule specs) a request may name; installed entry points always
    plugins: tuple[str, ...] = ()

    @property
    def stream_limits(self) -> StreamLimits:
        """How many streams the shard admits (all, per client connection) and how long one may idle."""
        return StreamLimits.for_threads(self.handler_threads, self.stream_idle_timeout_s, self.max_streams_per_peer)

    def __post_init__(self) -> None:
        self.stream_limits  # noqa: B018 - validates the three settings together
        TRANSPORTS.shard_setting_values(self.transport_settings)  # each transport's own, by its flag
        check_host(self.host)
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} out of range")
        if self.index < 0:
            raise ValueError("index must be >= 0")
        if self.chief_timeout_s < 0:
            raise ValueError("chief_timeout_s must be >= 0 (0: never give up on the chief)")


def shard_adapters(side: ShardSide, registry: TransportRegistry = TRANSPORTS) -> list[ShardAdapter]:
    """The one place a shard's transports are built: every registered transport's adapter over
    the same service, in registry order (gRPC first), then the data port serving the request kinds
    they offered (last: started after them, closed before them); the shard settings checked and the
    ones not given at their defaults (ValueError naming the flag of a wrong one)."""
    side = dataclasses.replace(side, settings=registry.shard_setting_values(side.settings))
    adapters = [load_adapter_factory(transport.shard_adapter)(side) for transport in registry]
    return [*adapters, DataPortAdapter(side)]


_THIS_HOST = ("127.0.0.1", "localhost", "0.0.0.0", "::1", "::", "")


class Replication:
    """A shard process's part in replicated shards (asyncps.ps.replica): the backup it forwards every state
    change to (SetBackup), and its takeover of a dead primary's port (Promote: a second server there, answering
    the same service)."""

    def __init__(self, store: ShardStore, index: int, security: SecurityConfig,
                 serve_on: Callable[[int], tuple[grpc.Server, int]]) -> None:
        self._store, self._index, self._security, self._serve_on = store, index, security, serve_on
        self._lock = threading.Lock()
        self._journal: ForwardingJournal | None = None
        self._backup: ShardClient | None = None
        self._servers: list[grpc.Server] = []
        self.ports: set[int] = set()  # where this process serves (a backup there would be itself)

    def set_backup(self, address: str) -> int:
        """Forward to the backup at `address` from now on (its whole state first; "": none); the version."""
        host, _, port = address.rpartition(":")
        if address and int(port) in self.ports and host.strip("[]") in _THIS_HOST:
            raise InvalidArgumentError(f"{address} is this shard itself: a shard cannot be its own backup")
        with self._lock:
            self._let_go()
            if address:
                # one attempt per call: a push tried again could apply twice on the backup
                # the tensors over the backup's TCP data port (the control calls over gRPC): the forwarding is on
                # every answer's path, and a socket moves a big gradient several times faster than gRPC's frames
                self._backup = connect_shard(address, deadline_s=0.0, call_timeout_s=30.0, security=self._security,
                                             transport="tcp", ride_restarts=False)
                self._journal = journal = ForwardingJournal(self._backup, self._index, self._index + 1)
                self._store.attach_journal(journal)
                if journal.recorded:  # a live state: the backup is one once seeded with it (else: at initialize)
                    journal.wait(1)
                if journal.lost is not None:
                    raise FailedPreconditionError(f"the backup at {address} could not be seeded: {journal.lost}")
                log.info("shard %d: every state change goes to its backup at %s from version %d", self._index,
                         address, self._store.version)
            return self._store.version

    def promote(self, port: int) -> int:
        """Serve on `port` too (the dead primary's); where the shard serves now."""
        with self._lock:
            try:
                server, bound = self._serve_on(port)
            except (OSError, RuntimeError):  # grpc's "Failed to bind" is a RuntimeError
                raise FailedPreconditionError(f"cannot serve on port {port}: it is in use (is its primary still "
                                              "alive?)") from None
            self._servers.append(server)
            self.ports.add(bound)
            log.warning("shard %d takes over its primary's port %d at version %d", self._index, bound,
                        self._store.version)
            return bound

    def _let_go(self) -> None:
        if self._journal is not None:
            self._store.attach_journal(None)
            self._journal.close(timeout_s=5.0)
            self._journal = None
        if self._backup is not None:
            self._backup.close()
            self._backup = None

    def close(self, ended: str | None = None) -> None:
        """Let the backup go (`ended`: the run ended, the chief's Shutdown reason: the backup is told to exit too;
        else it stays, to take over); stop the servers of taken-over ports."""
        with self._lock:
            if ended is not None and self._backup is not None:
                try:
                    self._backup.shutdown(f"its primary shard {self._index} was shut down: {ended}")
                except AsyncpsError as exc:
                    log.warning("shard %d: could not tell its backup to exit: %s", self._index, exc)
            self._let_go()
            for server in self._servers:
                server.stop(grace=0.5).wait()


# `asyncps ps` stopped by SIGTERM (an orchestrator replacing the task): not 0, which an on-failure restart policy
# reads as the run's end (the chief's Shutdown)
EXIT_TERMINATED = 143  # 128 + 15


def run_ps(config: PsConfig, interrupt: threading.Event | None = None) -> int:
    """Serve until Shutdown or interrupt (0), or until the chief is silent for too long (3); 4 when a
    transport cannot start (e.g. its data port is taken). `asyncps ps` exits EXIT_TERMINATED when the
    interrupt was SIGTERM."""
    stop = interrupt or threading.Event()
    watch = ChiefWatch(config.chief_timeout_s)
    # test only: lets SSP workers read beyond the bound, to show the chief's measurement catches it
    unbounded = os.environ.get(NO_SSP_BOUND_ENV) == "1"
    if unbounded:
        log.warning("%s=1: SSP's bound is NOT enforced (a test switch)", NO_SSP_BOUND_ENV)
    plugin_modules = import_plugin_modules(config.plugins)
    store = ShardStore(config.index, enforce_bounds=not unbounded)
    limits = config.stream_limits
    # long-polls are streams too: never more waiting than the guard admits
    service = ShardService(store, max_waiters=min(DEFAULT_MAX_WAITERS, limits.max_streams))

    def serve_on(port: int) -> tuple[grpc.Server, int]:
        server, bound, _ = create_server(
            f"{config.host}:{port}", [lambda s: add_handlers(s, adapters)],
            max_workers=config.handler_threads, stream_limits=limits,
            interceptors=[*config.security.server_interceptors(), watch.interceptor()],
            credentials=config.security.server_credentials())
        return server, bound

    replication = Replication(store, config.index, config.security, serve_on)
    shutdown_reason: list[str] = []  # the chief's Shutdown: the run's end

    def on_shutdown(reason: str) -> None:
        shutdown_reason.append(reason)
        stop.set()

    adapters = shard_adapters(ShardSide(service, config.chunk_bytes, config.max_request_bytes,
                                        on_shutdown=on_shutdown, host=config.host,
                                        security=config.security, settings=config.transport_settings,
                                        plugin_modules=plugin_modules,
                                        idle_timeout_s=config.stream_idle_timeout_s,
                                        on_set_backup=replication.set_backup, on_promote=replication.promote))
    freeze_heap()  # set up, before serving: later collections walk only what requests allocate
    server, port, health = create_server(
        f"{config.host}:{config.port}",
        [lambda s: add_handlers(s, adapters)],
        max_workers=config.handler_threads, stream_limits=limits,
        interceptors=[*config.security.server_interceptors(), watch.interceptor()],
        credentials=config.security.server_credentials())
    replication.ports.add(port)
    try:
        for adapter in adapters:
            adapter.start()
    except AdapterStartError as exc:
        log.error("shard %d cannot serve: %s", config.index, exc)
        server.stop(grace=None).wait()
        for adapter in reversed(adapters):
            adapter.close()
        return 4
    probe = None
    if config.health_port is not None:
        probe, probe_port = serve_health(f"{config.host}:{config.health_port}", health)
        log.info("shard %d: health service in plaintext on port %d", config.index, probe_port)
    log.info("shard %d serving on port %d of %s (%s)", config.index, port, config.host, config.security.describe())
    exposed = exposure_warning(f"shard {config.index}", f"{config.host}:{port}", config.security)
    if exposed:
        log.warning("%s", exposed)
    if plugin_modules:
        log.info("shard %d: a request's rule may name plugins of %s (--plugins)", config.index,
                 ", ".join(sorted(plugin_modules)))
    write_port_file(config.port_file, port)  # last: whoever waits on it finds the lines above written
    code = 0
    while not stop.wait(min(1.0, config.chief_timeout_s / 4) if config.chief_timeout_s else None):
        if watch.expired():
            log.error("shard %d: no call from the chief for %.0fs (--chief-timeout-s %g): exiting", config.index,
                      watch.silent_s(), config.chief_timeout_s)
            code = 3
            break
    log.info("shard %d stopping at version %d", config.index, store.version)
    health.enter_graceful_shutdown()
    # blocked handlers (sync steps, SSP gates, long polls, pushes held by a cut) answer now: a
    # handler thread still waiting after the grace would keep the process from exiting
    service.stop()
    replication.close(ended=shutdown_reason[0] if shutdown_reason else None)
    server.stop(grace=2.0 if code == 0 else 0.5).wait()  # no chief: nobody waits for answers worth a grace
    if probe is not None:
        probe.stop(grace=None)
    for adapter in reversed(adapters):
        adapter.close()
    return code
