"""How one worker process reaches the cluster (its flags, validated once)."""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncps.net.security import SecurityConfig


@dataclass(frozen=True)
class WorkerConfig:
    """How one worker process reaches the cluster."""

    chief: str
    index: int = -1  # -1: the chief assigns one
    deadline_s: float = 60.0  # how long to keep trying an unreachable chief (the chief timeout)
    max_steps: int = 0  # stop on its own after this many steps (0: only when the chief says)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    logical: int = 1  # logical workers (threads) in this process: indices index .. index+logical-1

    def __post_init__(self) -> None:
        if not self.chief:
            raise ValueError("worker needs the chief's address (--chief HOST:PORT)")
        if self.deadline_s <= 0:
            raise ValueError("deadline_s must be > 0")
        if self.logical < 1:
            raise ValueError("logical must be >= 1")
