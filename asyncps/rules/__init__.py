"""Update rules: how a shard turns gradients into updates (optimizers, staleness policies,
consistency modes) and the rule object every role shares.

The three kinds share one registry style (asyncps.rules.registry): each entry is a small frozen
dataclass of typed parameters, chosen by a spec `name` or `name:key=value,...`. The rule classes
are pure numpy and carry no transport; the shard applies them, the chief and the command line
build and validate them, the wire carries their canonical specs.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncps.rules.modes import MODES, ModeSpec
from asyncps.rules.optimizers import OPTIMIZERS, OptimizerConfig
from asyncps.rules.policies import POLICIES, StalenessPolicy
from asyncps.rules.registry import Registry

__all__ = ["MODES", "OPTIMIZERS", "POLICIES", "OptimizerConfig", "UpdateRuleConfig", "registries"]


def registries() -> tuple[Registry[object], ...]:
    """The registries of every kind of rule, in the order the README lists them."""
    return (OPTIMIZERS, POLICIES, MODES)  # type: ignore[return-value]


@dataclass(frozen=True)
class UpdateRuleConfig:
    """How the shard turns gradients into updates: optimizer, consistency mode, policy.

    `mode` and `staleness_policy` are specs (`sync:backup=1`, `drop:bound=4`), kept in their
    canonical form, so two rules are equal exactly when they configure the same thing.
    `num_workers` is the number of workers the run plans (the sync quorum before the chief's
    first live set).
    """

    optimizer: OptimizerConfig
    mode: str = "async"
    staleness_policy: str = "none"
    num_workers: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", MODES.normalize(self.mode))
        object.__setattr__(self, "staleness_policy", POLICIES.normalize(self.staleness_policy))
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ValueError(f"num_workers must be an integer >= 1, got {self.num_workers!r}")

    def consistency(self) -> ModeSpec:
        """The consistency mode with its parameters."""
        return MODES.parse(self.mode)

    def policy(self) -> StalenessPolicy:
        """The staleness policy with its parameters."""
        return POLICIES.parse(self.staleness_policy)
