"""The run's lifecycle: the run directory and the Coordinator server at the start, the stop
condition, the final model export, and the shutdown of the server and the shards."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from asyncps.chief.config import ChiefConfig
from asyncps.chief.progress import Progress, TrainClock
from asyncps.chief.tasks import TaskLedger
from asyncps.pb import coordinator_pb2_grpc
from asyncps.rpc import create_server, serve_health
from asyncps.rundir import INTERRUPTED, RunConfigRecord, write_port_file

if TYPE_CHECKING:
    import grpc
    from grpc_health.v1.health import HealthServicer

    from asyncps.transport import ModelClient

log = logging.getLogger("asyncps.chief")


def prepare_run_dir(config: ChiefConfig) -> None:
    """The run directory with its config.json and the TensorBoard folder."""
    run_dir = config.run_dir
    (run_dir / "tb").mkdir(parents=True, exist_ok=True)
    RunConfigRecord.of(config.run, config.ps, run_dir).save(run_dir)


def export_model(model: Any, config: ChiefConfig) -> None:
    """The final model as a Keras file and a SavedModel that plain TensorFlow can load."""
    t0 = time.monotonic()
    model.save(config.run_dir / "model.keras")
    model.export(str(config.run_dir / "saved_model"), verbose=False)
    log.info("exported model.keras and saved_model/ in %.1fs", time.monotonic() - t0)


class Lifecycle:
    """Starts the Coordinator server, says when the run must stop, and shuts everything down."""

    def __init__(self, config: ChiefConfig, interrupt: threading.Event, progress: Progress, clock: TrainClock,
                 ledger: TaskLedger, client: ModelClient) -> None:
        self._config = config
        self._run = config.run
        self._interrupt = interrupt
        self._progress = progress
        self._clock = clock
        self._ledger = ledger
        self._client = client
        self._server: grpc.Server | None = None
        self._health: HealthServicer | None = None
        self._probe: grpc.Server | None = None  # the plaintext health server (--health-port)

    def start(self, servicer: coordinator_pb2_grpc.CoordinatorServicer) -> int:
        """Serve the Coordinator service; write the port file; return the bound port."""
        config = self._config
        self._server, port, self._health = create_server(
            f"{config.host}:{config.port}",
            [lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s)],
            interceptors=config.security.server_interceptors(),
            credentials=config.security.server_credentials())
        if config.health_port is not None:
            self._probe, probe_port = serve_health(f"{config.host}:{config.health_port}", self._health)
            log.info("chief: health service in plaintext on port %d", probe_port)
        write_port_file(config.port_file, port)
        log.info("chief serving on port %d (%s); waiting for %d workers", port, config.security.describe(),
                 self._run.num_workers)
        return port

    def stop_reason(self) -> str | None:
        """Why the run must stop now (interrupt, updates, epochs or time reached), or None."""
        run, p = self._run, self._progress
        if self._interrupt.is_set():
            return INTERRUPTED
        if run.max_updates and p.updates >= run.max_updates:
            return f"reached {run.max_updates} updates"
        if run.epochs and self._ledger.finished():
            return f"reached {run.epochs:g} epochs (every data task done)"
        if run.max_seconds and self._clock.elapsed() >= run.max_seconds:
            return f"reached {run.max_seconds:g} s"
        return None

    def shutdown(self) -> None:
        """Ask the shards to exit, stop serving, close the shard channels."""
        self._shutdown_shards()
        if self._health is not None:
            self._health.enter_graceful_shutdown()
        if self._server is not None:
            self._server.stop(grace=2.0).wait()
        if self._probe is not None:
            self._probe.stop(grace=None)
        self._client.close()

    def _shutdown_shards(self) -> None:
        for shard in self._client.shards:
            try:
                shard.shutdown("training finished")
            except Exception as exc:  # a shard already gone is fine: we only ask it to exit
                log.warning("could not ask %s to shut down: %s", shard.address, exc)
