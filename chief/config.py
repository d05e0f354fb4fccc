"""The chief's configuration: where it serves, which shards it drives, and the run it runs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from asyncps.config import RunConfig
from asyncps.net.security import LOOPBACK_HOST, SecurityConfig, check_host
from asyncps.rundir import RunDir


@dataclass(frozen=True)
class ChiefConfig:
    """Where the chief serves, which shards it drives, and the run it runs."""

    ps: tuple[str, ...]
    run: RunConfig
    run_dir: Path
    host: str = LOOPBACK_HOST  # this machine only; containers and clusters say --host 0.0.0.0
    port: int = 0
    port_file: str = ""
    health_port: int | None = None  # also serve the health service in plaintext here (kubelet probes)
    stop_grace_s: float = 30.0  # how long to wait for workers to finish after STOP
    checkpoint_dir: Path | None = None  # default: run_dir/ckpt
    resume: bool = False  # continue from the latest checkpoint instead of initializing
    export: bool = True  # write the final model (Keras file and SavedModel) into the run directory
    security: SecurityConfig = dataclasses.field(default_factory=SecurityConfig)
    metrics_port: int = -1  # Prometheus /metrics on this port (0: any free port; -1: off)
    metrics_port_file: str = ""  # write the bound metrics port here (for metrics_port 0)

    @property
    def checkpoints(self) -> Path:
        """Where checkpoints go."""
        return self.checkpoint_dir or RunDir(self.run_dir).checkpoints

    def __post_init__(self) -> None:
        check_host(self.host)
        if not self.ps:
            raise ValueError("chief needs the shard addresses (--ps HOST:PORT,...)")
        if len(self.ps) != self.run.num_ps:
            raise ValueError(f"{len(self.ps)} shard addresses but num_ps={self.run.num_ps}")
