"""Update rules: how a shard turns gradients into updates (optimizers, staleness policies,
consistency modes) and the rule object every role shares.

The rule classes are pure numpy and carry no transport; the shard applies them, the chief and the
command line build and validate them, the wire carries their configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncps.rules.modes import MODES
from asyncps.rules.optimizers import OptimizerConfig
from asyncps.rules.policies import parse_policy

__all__ = ["MODES", "OptimizerConfig", "UpdateRuleConfig"]


@dataclass(frozen=True)
class UpdateRuleConfig:
    """How the shard turns gradients into updates: optimizer, consistency mode, policy."""

    optimizer: OptimizerConfig
    mode: str = "async"
    staleness_policy: str = "none"
    num_workers: int = 1
    backup_workers: int = 0
    staleness_bound: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; valid: {', '.join(MODES)}")
        parse_policy(self.staleness_policy)
        if self.num_workers < 1 or self.backup_workers < 0 or self.staleness_bound < 0:
            raise ValueError("num_workers must be >= 1, backup_workers and staleness_bound >= 0")
