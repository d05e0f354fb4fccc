"""The run configuration: everything that defines a training run, resolved and validated once."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from asyncps.codec import DEFAULT_CHUNK_BYTES
from asyncps.delays import StepDelay
from asyncps.placement import DEFAULT_SLICE_THRESHOLD_BYTES
from asyncps.rules import POLICIES, OptimizerConfig, UpdateRuleConfig
from asyncps.rules.modes import MODE_ALIASES, fold_mode_aliases, mode_alias_values


@dataclass(frozen=True)
class RunConfig:
    """A training run; the chief owns it and hands it to every worker when it registers."""

    model: str = "mlp"
    dataset: str = "digits"
    batch_size: int = 32
    optimizer: str = "sgd"
    learning_rate: float = 0.1
    optimizer_params: dict[str, float] = field(default_factory=dict)
    mode: str = "async"  # a mode spec: async | sync[:backup=B] | ssp[:bound=S], kept canonical
    staleness_policy: str = "none"  # a staleness policy spec, kept canonical
    # Older spellings of the mode's parameters (--backup-workers, --staleness-bound): a nonzero
    # value is folded into `mode` (a contradiction is an error); afterwards both mirror the mode.
    backup_workers: int = 0
    staleness_bound: int = 0
    num_workers: int = 2
    num_ps: int = 2
    max_updates: int = 0  # stop after this many applied updates (0: no limit)
    epochs: float = 30.0  # stop after this many passes over the training set (0: no limit)
    max_seconds: float = 0.0  # stop after this much training time (0: no limit)
    eval_every_s: float = 2.0
    seed: int = 0
    compute_delay: str = "none"
    stragglers: str = ""  # permanent slow factors, e.g. "0:4x,3:2x"
    slowdown: str = ""  # random slowdowns "P:F": with probability P a step is F times slower
    rpc_latency_s: float = 0.0  # added before every worker round trip
    slice_threshold_bytes: int = DEFAULT_SLICE_THRESHOLD_BYTES
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 10.0
    rpc_deadline_s: float = 60.0
    read_wait_s: float = 30.0  # how long a shard may hold a sync/ssp worker before answering anyway
    tf_threads: int = 1
    checkpoint_every_updates: int = 0  # 0: not by updates
    checkpoint_every_s: float = 0.0  # 0: not by time
    keep_checkpoints: int = 3
    task_size: int = 0  # examples per data task (0: 4 batches)

    def __post_init__(self) -> None:
        self._fold_rule_specs()
        problems = []
        if self.batch_size < 1:
            problems.append("batch_size must be >= 1")
        if self.learning_rate <= 0:
            problems.append("learning_rate must be > 0")
        if self.num_workers < 1 or self.num_ps < 1:
            problems.append("num_workers and num_ps must be >= 1")
        if self.max_updates < 0 or self.epochs < 0 or self.max_seconds < 0:
            problems.append("max_updates, epochs and max_seconds must be >= 0")
        if self.max_updates == 0 and self.epochs == 0 and self.max_seconds == 0:
            problems.append("set a stop condition: max_updates, epochs or max_seconds")
        if self.backup_workers >= self.num_workers:
            problems.append(f"backup workers ({self.backup_workers}) must be < num_workers")
        if self.eval_every_s <= 0 or self.heartbeat_interval_s <= 0:
            problems.append("eval_every_s and heartbeat_interval_s must be > 0")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            problems.append("heartbeat_timeout_s must exceed heartbeat_interval_s")
        if self.chunk_bytes < 1024:
            problems.append("chunk_bytes must be >= 1024")
        if self.checkpoint_every_updates < 0 or self.checkpoint_every_s < 0 or self.keep_checkpoints < 1:
            problems.append("checkpoint intervals must be >= 0 and keep_checkpoints >= 1")
        if self.task_size < 0:
            problems.append("task_size must be >= 0")
        if self.tf_threads < 0:
            problems.append("tf_threads must be >= 0 (0: TensorFlow's default)")
        if problems:
            raise ValueError("invalid run configuration: " + "; ".join(problems))
        self.update_rule()  # validates optimizer, mode and staleness policy
        self.step_delay(0)

    def _fold_rule_specs(self) -> None:
        """Canonical mode and policy specs, with the old per-mode fields folded into the mode."""
        try:
            mode = fold_mode_aliases(self.mode, {alias: getattr(self, alias) for alias in MODE_ALIASES})
            policy = POLICIES.normalize(self.staleness_policy)
        except ValueError as error:
            raise ValueError(f"invalid run configuration: {error}") from None
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "staleness_policy", policy)
        for alias, value in mode_alias_values(mode).items():
            object.__setattr__(self, alias, value)

    def step_delay(self, worker_index: int) -> StepDelay:
        """The injected delays of one worker (seeded by run seed and worker index)."""
        return StepDelay.for_worker(worker_index, self.compute_delay, self.stragglers, self.slowdown,
                                    self.rpc_latency_s, self.seed)

    def update_rule(self) -> UpdateRuleConfig:
        """The shards' update rule for this run."""
        return UpdateRuleConfig(
            optimizer=OptimizerConfig(self.optimizer, self.learning_rate, self.optimizer_params),
            mode=self.mode, staleness_policy=self.staleness_policy, num_workers=self.num_workers)

    def to_json(self) -> str:
        """Serialize (for config.json and for workers)."""
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        """Parse what to_json wrote; unknown keys are an error (a version mismatch)."""
        data: dict[str, Any] = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown run configuration keys {sorted(unknown)}")
        return cls(**data)
