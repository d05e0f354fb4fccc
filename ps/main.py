"""Parameter-server process: serve one shard until asked to shut down (or signalled)."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from asyncps.ps.adapter import (
    DEFAULT_MAX_REQUEST_BYTES,
    AdapterStartError,
    ShardAdapter,
    ShardSide,
    add_handlers,
    load_adapter_factory,
)
from asyncps.ps.dataport import DataPortAdapter
from asyncps.ps.service import DEFAULT_MAX_WAITERS, ShardService
from asyncps.ps.servicer import SHARD_HANDLER_THREADS
from asyncps.ps.store import ShardStore
from asyncps.ps.watchdog import ChiefWatch

from asyncps.net.rpc import create_server, serve_health
from asyncps.net.security import LOOPBACK_HOST, SecurityConfig, check_host, exposure_warning
from asyncps.net.streamguard import DEFAULT_IDLE_TIMEOUT_S, StreamLimits
from asyncps.procenv import freeze_heap
from asyncps.rules.registry import import_plugin_modules
from asyncps.rundir import write_port_file
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


def run_ps(config: PsConfig, interrupt: threading.Event | None = None) -> int:
    """Serve until Shutdown or interrupt (0), or until the chief is silent for too long (3); 4 when a
    transport cannot start (e.g. its data port is taken)."""
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
    adapters = shard_adapters(ShardSide(service, config.chunk_bytes, config.max_request_bytes,
                                        on_shutdown=lambda reason: stop.set(), host=config.host,
                                        security=config.security, settings=config.transport_settings,
                                        plugin_modules=plugin_modules,
                                        idle_timeout_s=config.stream_idle_timeout_s))
    freeze_heap()  # set up, before serving: later collections walk only what requests allocate
    server, port, health = create_server(
        f"{config.host}:{config.port}",
        [lambda s: add_handlers(s, adapters)],
        max_workers=config.handler_threads, stream_limits=limits,
        interceptors=[*config.security.server_interceptors(), watch.interceptor()],
        credentials=config.security.server_credentials())
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
    server.stop(grace=2.0 if code == 0 else 0.5).wait()  # no chief: nobody waits for answers worth a grace
    if probe is not None:
        probe.stop(grace=None)
    for adapter in reversed(adapters):
        adapter.close()
    return code
