"""The run configuration: everything that defines a training run, resolved and validated once.

Every RunConfig field carries its Option (help text, text parser, the word for a sentinel default);
its one flag is the field spelled with dashes,
its one variable ASYNCPS_<FIELD>. The CLI's flags, the `ASYNCPS_*` environment variables, `--run-config` files and their
help are all derived from these fields, and resolved in one order (see RunConfig.from_layers):
built-in default < `--run-config` file < `ASYNCPS_*` environment < explicit flag.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncps.delays import StepDelay
from asyncps.ml.specs import spec_problems
from asyncps.ml.stopat import parse_early_stop, parse_stop_at
from asyncps.placement import DEFAULT_SLICE_THRESHOLD_BYTES
from asyncps.rules import MODES, OUTER_RULES, POLICIES, OptimizerConfig, UpdateRuleConfig
from asyncps.rules.modes import MODE_ALIASES, fold_mode_aliases, mode_alias_values
from asyncps.rules.outer import LocalRule
from asyncps.transport.registry import TRANSPORTS
from asyncps.wire.codec import DEFAULT_CHUNK_BYTES

ENV_PREFIX = "ASYNCPS_"
DEFAULT_EPOCHS = 30.0
# What a chief gives its first workers to start (TensorFlow's import and tracing take tens of seconds
# on a busy 2-core machine) before it calls a run without live workers dead (idle_without_workers_s).
NO_WORKERS_START_ALLOWANCE_S = 60.0

# What a resumed run may change (asyncps.config.resume_changes). The fields that make the run what it is
# (its model and data, its update rule and their seeds, the workers the rule and the data tasks are
# planned for) are kept: a resume that would change one is refused. The shard layout changes only by
# a reshard: the latest checkpoint restored into the new layout. The stop conditions may change; so
# may the rest (timeouts, evaluation and checkpoint schedules, transport, threads, injected delays).
RUN_DEFINING = ("model", "dataset", "loss", "eval_metrics", "batch_size", "optimizer", "learning_rate",
                "optimizer_params", "mode", "staleness_policy", "num_workers", "seed", "task_size",
                "local_steps", "local_optimizer", "outer",  # the mode spec holds backup_workers and staleness_bound
                "clipnorm", "global_clipnorm", "clipvalue")
SHARD_LAYOUT = ("num_ps", "slice_threshold_bytes")
STOP_CONDITIONS = ("max_updates", "epochs", "max_training_s")


# The command line's conventions (docs/cli.md: Conventions), kept by construction here: every run flag is
# its field spelled with dashes, and nothing else; a duration's field and flag end in `_s`/`-s` and take
# seconds; a field whose 0 (or empty) value is a sentinel names it by one word: OFF (a feature or a limit
# is off; 0 is the same) or AUTO (asyncps chooses, as the help says; 0 is refused as text).
OFF = "off"
AUTO = "auto"


@dataclass(frozen=True)
class Option:
    """How one RunConfig field is set from outside the program (its flag, variable and help)."""

    help: str
    parse: Callable[[str], Any] | None = None  # text -> value; None: by the field's type
    repeat: bool = False  # the flag may be repeated; the parsed mappings are merged
    word: str = ""  # OFF or AUTO: the word for the field's 0 or empty value, accepted as text, shown in help
    shown: str = ""  # the default as the help shows it, where a rule decides it


def setting(default: Any = dataclasses.MISSING, *, help: str, factory: Callable[[], Any] | None = None,
            parse: Callable[[str], Any] | None = None, repeat: bool = False, word: str = "",
            shown: str = "") -> Any:
    """A RunConfig field with its Option (in the field's metadata)."""
    option = Option(help, parse, repeat, word, shown)
    if factory is not None:
        return field(default_factory=factory, metadata={"option": option})
    return field(default=default, metadata={"option": option})


def parse_opt_params(text: str) -> dict[str, float]:
    """`beta_1=0.9 beta_2=0.999` (spaces or commas) -> {"beta_1": 0.9, "beta_2": 0.999}."""
    out = {}
    for item in (i for i in text.replace(",", " ").split() if i):
        key, sep, value = item.partition("=")
        try:
            out[key] = float(value)
        except ValueError:
            sep = ""
        if not sep or not key:
            raise ValueError(f"wants KEY=NUMBER items, got {item!r}")
    return out


@dataclass(frozen=True)
class RunConfig:
    """A training run; the chief owns it and hands it to every worker when it registers."""

    model: str = setting("mlp", help="logreg | mlp | mlp:H1,H2,... | cnn | embedding | package.module:function")
    dataset: str = setting("digits", help="digits | mnist | fashion_mnist | npz:PATH | synthetic-logreg | "
                                          "package.module:function")
    loss: str = setting("auto", help="auto (the loss the model was compiled with, else crossentropy) | "
                                     "crossentropy (of logits, over integer class ids) | a Keras loss name | "
                                     "package.module:function")
    eval_metrics: str = setting("", word=AUTO, help=(
        "metrics the chief measures on the test set at each evaluation, comma-separated: Keras metric names | "
        "accuracy | package.module:function; auto: the model's compiled ones"))
    batch_size: int = setting(32, help="examples per worker step")
    optimizer: str = setting("sgd", help="sgd | momentum | nesterov | adam | adagrad")
    learning_rate: float = setting(0.1, help="learning rate")
    optimizer_params: dict[str, float] = setting(  # noqa: RUF009 - a dataclasses.field with a default_factory
        factory=dict, help="optimizer hyperparameter KEY=VALUE (repeatable), e.g. beta_1=0.9",
        parse=parse_opt_params, repeat=True, shown="none")
    # The mode and the policy are specs (sync:backup=1, drop:bound=4), kept canonical; the table of
    # every mode and policy with its parameters is in docs/experiments.md (scripts/rules_table.py).
    mode: str = setting("async", help="consistency mode spec: async | sync[:backup=B] | ssp[:bound=S]")
    staleness_policy: str = setting(
        "none", help="staleness policy spec (async): none | drop:bound=K | lr-scale | dc-asgd[:lambda=L] | "
                     "dc-asgd-a[:lambda0=L0,momentum=M] | gap-aware[:c=C] | row-drop:bound=K | row-lr-scale")
    # The mode's parameters as fields of their own: a nonzero value folds into `mode` (a contradiction is
    # an error); afterwards both mirror the mode (0 for another mode's parameter).
    backup_workers: int = setting(0, word=OFF, help="same as --mode sync:backup=B")
    staleness_bound: int = setting(0, word=OFF, help="same as --mode ssp:bound=S")
    num_workers: int = setting(2, help="number of workers (chief: else TF_CONFIG's, when it has one)")
    num_ps: int = setting(2, help="number of parameter-server shards")
    worker_processes: int = setting(0, word=OFF, help=(
        "run the workers as logical workers (threads) in this many processes (off: one process per worker); "
        "see docs/experiments.md on what logical workers share"))
    start_barrier: bool = setting(True, help=(
        "hold every worker until all planned workers registered and computed a warm-up gradient "
        "(--no-start-barrier: start each as soon as it is ready)"))
    max_updates: int = setting(0, word=OFF, help="stop after this many applied updates")
    epochs: float = setting(DEFAULT_EPOCHS, word=OFF, shown=(
        f"{DEFAULT_EPOCHS:g}, or off when --max-updates or --max-training-s is given"),
        help="stop after this many passes over the training data")
    max_training_s: float = setting(0.0, word=OFF, help="stop after this many seconds of training")
    stop_at: str = setting("", word=OFF, help=(
        "also stop once a scheduled evaluation meets this level: METRIC>=V or METRIC<=V, e.g. accuracy>=0.9, "
        "loss<=0.1 or a metric the task reports"))
    early_stop: str = setting("", word=OFF, help=(
        "also stop once P evaluations in a row did not improve METRIC (Keras' EarlyStopping): "
        "METRIC:patience=P[,min_delta=D][,mode=min|max], e.g. val_loss:patience=3"))
    eval_every_s: float = setting(2.0, help="seconds between evaluations")
    eval_weights: bool = setting(False, help=(
        "the chief writes the values each scheduled evaluation measured into RUN/eval-weights/ (what "
        "asyncps.train loads into the caller's model for a ModelCheckpoint callback; tables read by rows left out)"))
    seed: int = setting(0, help="seed of model init, data order and injected delays")
    compute_delay: str = setting("none", help="injected delay per step: none | const:S | uniform:A,B | exp:MEAN")
    stragglers: str = setting("", word=OFF, help="permanent slow workers, e.g. 0:4x,3:2x (seeded experiments)")
    slowdown: str = setting("", word=OFF, help="random slowdowns P:F: with probability P a step is F times slower")
    rpc_latency_s: float = setting(0.0, word=OFF, help="seconds added before every worker round trip")
    slice_threshold_bytes: int = setting(DEFAULT_SLICE_THRESHOLD_BYTES,
                                         help="variables larger than this many bytes are sliced over shards")
    chunk_bytes: int = setting(DEFAULT_CHUNK_BYTES, help="bytes per streamed tensor chunk")
    heartbeat_interval_s: float = setting(0.5, help="seconds between worker heartbeats")
    heartbeat_timeout_s: float = setting(10.0, help="seconds of silence after which a worker is dead")
    idle_without_workers_s: float = setting(0.0, word=AUTO, help=(
        "the chief ends the run with an error (exit 6) after this many seconds with no live worker (auto: 2 x "
        f"--heartbeat-timeout-s + {NO_WORKERS_START_ALLOWANCE_S:g}); before any worker registered, at least the "
        "start barrier's limit (300)"))
    max_nonfinite_steps: int = setting(20, word=OFF, help=(
        "the chief ends the run as diverged (exit 5) once every live worker had this many consecutive steps "
        "with a non-finite loss or gradient (each skipped, not pushed)"))
    rpc_deadline_s: float = setting(60.0, help="seconds to keep retrying an unreachable peer")
    read_wait_s: float = setting(30.0, help="longest a shard holds a sync/ssp worker before answering, in seconds")
    tf_threads: int = setting(1, word=AUTO, help="TensorFlow intra/inter-op threads per process (auto: TensorFlow's "
                                                 "default)")
    checkpoint_every_updates: int = setting(0, word=OFF, help=(
        "checkpoint every this many applied updates (with --checkpoint-every-s: whichever comes first)"))
    checkpoint_every_s: float = setting(30.0, word=OFF, help="checkpoint every this many seconds")
    keep_checkpoints: int = setting(3, help="how many checkpoints to keep")
    allow_reinit: bool = setting(False, help=(
        "a shard that comes back empty when there is no checkpoint restarts from the initial values "
        "(off: the run stops with an error)"))
    chief_timeout_s: float = setting(120.0, word=OFF, help=(
        "shards and workers exit (non-zero) after the chief is unreachable this many seconds (a shard gives a "
        "chief that never called at least 300 s to start)"))
    task_size: int = setting(0, word=AUTO, help="examples per data task (auto: 4 batches)")
    transport: str = setting("auto", help=TRANSPORTS.help())
    local_steps: int = setting(1, help=(
        "local SGD: each worker takes this many steps of --local-optimizer on its own model, then pushes the "
        "change of its model, which the shards apply by --outer (1: push every gradient)"))
    local_optimizer: str = setting("", word=AUTO, help=(
        "the workers' optimizer of local steps, NAME:lr=LR[,KEY=VALUE...], e.g. adam:lr=0.001 (auto: "
        "--optimizer, --learning-rate and --optimizer-params)"))
    outer: str = setting("average", help=(
        "what the shards do with the workers' model changes (--local-steps > 1): average | easgd[:alpha=A] | "
        "nesterov[:lr=LR,momentum=M] | delayed-nesterov[:lr=LR,momentum=M,period=N] (async: momentum once per N "
        "deltas)"))
    pipeline: bool = setting(False, help=(
        "workers compute the next gradient while the previous push is in flight: more steps/s, one more "
        "step of staleness (measured and recorded like any other)"))
    clipnorm: float = setting(0.0, word=OFF, help=(
        "workers clip each variable's gradient to this L2 norm before pushing it, as Keras' clipnorm"))
    global_clipnorm: float = setting(0.0, word=OFF, help=(
        "workers scale a step's gradients so that their joint L2 norm is at most this, as Keras' global_clipnorm"))
    clipvalue: float = setting(0.0, word=OFF, help=(
        "workers clip every gradient element to [-V, V], as Keras' clipvalue (one of the three clippings)"))
    row_pull: str = setting("auto", help=(
        "auto: workers read the tables of the model's Embedding layers by rows, only those a batch touches "
        "(never a whole copy; per-row staleness measured); off: every variable pulled whole each step"))
    row_cache_staleness: int = setting(0, word=OFF, help=(
        "tables read by rows: a worker serves a row it read at shard version v again, without asking, while "
        "that shard's version as it last saw it is at most v + S (a bound on the row's updates since; the "
        "rows' clocks are those they were read at, so per-row staleness counts the cache's); off: every row "
        "a step touches is read"))
    row_cache_rows: int = setting(0, word=AUTO, help=(
        "rows the row cache keeps per table, the least recently used evicted (auto: as many as 64 MB of row "
        "values hold, its index adding about 130 bytes a row; at least the most distinct ids of one batch)"))

    def __post_init__(self) -> None:
        self._fold_rule_specs()
        problems = []
        if self.batch_size < 1:
            problems.append("batch_size must be >= 1")
        if self.learning_rate <= 0:
            problems.append("learning_rate must be > 0")
        if self.num_workers < 1 or self.num_ps < 1:
            problems.append("num_workers and num_ps must be >= 1")
        if not 0 <= self.worker_processes <= self.num_workers:
            problems.append("worker_processes must be between 0 and num_workers")
        if self.max_updates < 0 or self.epochs < 0 or self.max_training_s < 0:
            problems.append("max_updates, epochs and max_training_s must be >= 0")
        if min(self.clipnorm, self.global_clipnorm, self.clipvalue) < 0:
            problems.append("clipnorm, global_clipnorm and clipvalue must be >= 0 (0: off)")
        if sum(1 for c in (self.clipnorm, self.global_clipnorm, self.clipvalue) if c) > 1:
            problems.append("give one of clipnorm, global_clipnorm and clipvalue (as Keras' optimizers take them)")
        if self.max_updates == 0 and self.epochs == 0 and self.max_training_s == 0:
            problems.append("set a stop condition: max_updates, epochs or max_training_s")
        for parse, text in ((parse_stop_at, self.stop_at), (parse_early_stop, self.early_stop)):
            try:
                parse(text)
            except ValueError as exc:
                problems.append(str(exc))
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
        if self.chief_timeout_s < 0:
            problems.append("chief_timeout_s must be >= 0 (0: off)")
        if self.task_size < 0:
            problems.append("task_size must be >= 0")
        if self.idle_without_workers_s < 0 or self.max_nonfinite_steps < 0:
            problems.append("idle_without_workers_s and max_nonfinite_steps must be >= 0")
        transport_problem = TRANSPORTS.problem(self.transport)
        if transport_problem is not None:
            problems.append(transport_problem)
        if self.tf_threads < 0:
            problems.append("tf_threads must be >= 0 (0: auto, TensorFlow's default)")
        problems += spec_problems(self.model, self.dataset)
        problems += self._local_sgd_problems()
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

    def _local_sgd_problems(self) -> list[str]:
        """What is wrong with local_steps, local_optimizer and outer (canonicalizing the two specs)."""
        if isinstance(self.local_steps, bool) or not isinstance(self.local_steps, int) or self.local_steps < 1:
            return [f"local_steps (--local-steps) must be an integer >= 1, got {self.local_steps!r}"]
        problems = []
        try:
            object.__setattr__(self, "outer", OUTER_RULES.normalize(self.outer))
        except ValueError as error:
            problems.append(f"--outer: {error}")
        if self.local_optimizer:
            try:
                object.__setattr__(self, "local_optimizer", OptimizerConfig.parse(self.local_optimizer).spec)
            except ValueError as error:
                problems.append(f"--local-optimizer: {error}")
        if self.local_steps == 1 and (self.local_optimizer or self.outer != "average"):
            problems.append("--local-optimizer and --outer apply to local SGD only: set --local-steps H (H > 1)")
        if self.row_pull not in ("auto", "off"):
            problems.append(f"row_pull must be auto or off, got {self.row_pull!r}")
        if self.row_cache_staleness < 0 or self.row_cache_rows < 0:
            problems.append("row_cache_staleness and row_cache_rows must be >= 0 (0: off, auto)")
        if self.local_steps > 1 and self.pipeline:
            problems.append("--pipeline overlaps one gradient with its push; with --local-steps > 1 a push is "
                            "H steps of local work: leave --pipeline off")
        return problems

    def local_rule(self) -> LocalRule | None:
        """The workers' local SGD (None: they push every gradient)."""
        if self.local_steps == 1:
            return None
        optimizer = (OptimizerConfig.parse(self.local_optimizer) if self.local_optimizer
                     else OptimizerConfig(self.optimizer, self.learning_rate, self.optimizer_params))
        return LocalRule(self.local_steps, optimizer, OUTER_RULES.parse(self.outer))

    def step_delay(self, worker_index: int) -> StepDelay:
        """The injected delays of one worker (seeded by run seed and worker index)."""
        return StepDelay.for_worker(worker_index, self.compute_delay, self.stragglers, self.slowdown,
                                    self.rpc_latency_s, self.seed)

    def no_workers_grace_s(self) -> float:
        """How long the chief waits with no live worker before it ends the run (idle_without_workers_s, or
        by default two heartbeat timeouts plus a start-up allowance)."""
        return self.idle_without_workers_s or 2 * self.heartbeat_timeout_s + NO_WORKERS_START_ALLOWANCE_S

    def update_rule(self) -> UpdateRuleConfig:
        """The shards' update rule for this run (with local SGD: the outer rule's optimizer)."""
        local = self.local_rule()
        return UpdateRuleConfig(
            optimizer=(local.outer.shard_optimizer() if local is not None
                       else OptimizerConfig(self.optimizer, self.learning_rate, self.optimizer_params)),
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

    @classmethod
    def from_layers(cls, *layers: Mapping[str, Any]) -> RunConfig:
        """The RunConfig of settings layers, each overriding the ones before it (e.g. file, environment,
        flags); no layer setting `epochs` and a max_updates or max_training_s stop means epochs 0."""
        merged: dict[str, Any] = {}
        for layer in layers:
            merged = _merge_mode_layer(merged, layer)
        unknown = sorted(set(merged) - set(run_options()))
        if unknown:
            raise ValueError(f"unknown run configuration keys {unknown}")
        if "epochs" not in merged and (merged.get("max_updates") or merged.get("max_training_s")):
            merged["epochs"] = 0.0
        return cls(**merged)


@dataclass(frozen=True)
class ResumeChanges:
    """How a resumed run's settings differ from those it recorded: each as `--flag OLD -> NEW`."""

    refused: tuple[str, ...]  # run-defining settings: the resume is refused
    reshard: tuple[str, ...]  # the shard layout: allowed as a reshard from the latest checkpoint

    def refusal(self, run_dir: object, recorded_in: object) -> str:
        """The error message of a refused resume of the run in `run_dir` (settings `recorded_in`)."""
        return (f"cannot resume the run in {run_dir} with other settings: {'; '.join(self.refused)} (the run's "
                f"settings are recorded in {recorded_in}); a resume may change its stop conditions "
                f"({', '.join(flag_name(n) for n in STOP_CONDITIONS)}), the number of shards by a reshard, "
                "and operational settings; start a different run in a new --run-dir")


def resume_changes(recorded: Mapping[str, Any], run: RunConfig) -> ResumeChanges:
    """How `run` differs from the settings a run directory recorded (its config.json's `run`), in the
    run-defining fields and the shard layout; fields the record lacks (an older version) are not compared."""
    old = RunConfig.from_layers(coerce_settings(known_settings(recorded), "recorded run"))

    def changes(names: Iterable[str]) -> tuple[str, ...]:
        return tuple(f"{flag_name(name)} {getattr(old, name)!r} -> {getattr(run, name)!r}" for name in names
                     if name in recorded and getattr(old, name) != getattr(run, name))

    return ResumeChanges(changes(RUN_DEFINING), changes(SHARD_LAYOUT))


def known_settings(recorded: Mapping[str, Any]) -> dict[str, Any]:
    """The recorded settings this version has fields for (a field an older version had is dropped)."""
    return {name: value for name, value in recorded.items() if name in run_options()}


def resumed_layers(recorded: Mapping[str, Any], *layers: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The settings layers of a resumed run: its recorded settings under `layers` (file, environment,
    flags); when a layer sets any stop condition, the recorded ones are all dropped, so the new ones
    read as they would for a new run (`--max-updates N` alone means no epoch limit)."""
    base = known_settings(recorded)
    if any(name in layer for layer in layers for name in STOP_CONDITIONS):
        base = {name: value for name, value in base.items() if name not in STOP_CONDITIONS}
    return [coerce_settings(base, "recorded run"), *(dict(layer) for layer in layers)]


def _merge_mode_layer(merged: Mapping[str, Any], layer: Mapping[str, Any]) -> dict[str, Any]:
    """`merged` overridden by `layer`, where a layer's mode settings replace the earlier ones: a layer
    giving `mode` drops the earlier mirrored per-mode fields; one giving only backup_workers or
    staleness_bound replaces that parameter of the earlier mode spec (so a config.json, which
    records both the spec and its mirror, can be overridden by --backup-workers or --mode)."""
    out = {**merged, **layer}
    if "mode" in layer:
        for alias in MODE_ALIASES:
            if alias not in layer:
                out.pop(alias, None)
        return out
    given = [alias for alias in MODE_ALIASES if alias in layer]
    if given and "mode" in merged:
        name, params = MODES.split(str(merged["mode"]))
        for alias in given:
            mode, key = MODE_ALIASES[alias]
            if mode == name:
                params.pop(key, None)
        out["mode"] = name + (":" + ",".join(f"{k}={v}" for k, v in params.items()) if params else "")
    return out


# -- the options of the fields: names, parsing of text and of file values ------------------------
@functools.cache
def run_options() -> dict[str, Option]:
    """Every RunConfig field's Option, in field order."""
    return {f.name: f.metadata["option"] for f in dataclasses.fields(RunConfig)}


@functools.cache
def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(RunConfig)


def flag_name(name: str) -> str:
    """The command-line flag of a field: its name spelled with dashes, its only spelling."""
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    """The environment variable of a field: ASYNCPS_<FIELD>."""
    return ENV_PREFIX + name.upper()


def shown_default(name: str) -> str:
    """A field's default as the help shows it: its word (off, auto) for a sentinel, on/off for a switch."""
    option, default = run_options()[name], _defaults()[name]
    if option.shown:
        return option.shown
    if isinstance(default, bool):
        return "on" if default else OFF
    if option.word and default in (0, ""):
        return option.word
    return f"{default:g}" if isinstance(default, float) else str(default)


@functools.cache
def _defaults() -> dict[str, Any]:
    return dataclasses.asdict(RunConfig())


def _parse_int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"wants an integer, got {text!r}") from None


def _parse_float(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError(f"wants a number, got {text!r}") from None
    if math.isnan(value):
        raise ValueError(f"wants a number, got {text!r}")
    return value


def parse_setting(name: str, text: str) -> dict[str, Any]:
    """The settings one text value of a field's flag or variable stands for ({name: value}, or several
    fields' for an option that spreads); ValueError says what the text should look like."""
    option, kind = run_options()[name], _field_types()[name]
    if option.word and text.strip().lower() == option.word:
        return {name: _zero(kind)}
    if option.parse is not None:
        return {name: option.parse(text)}
    if kind is int or kind is float:
        value = _parse_int(text) if kind is int else _parse_float(text)
        if option.word == AUTO and value == 0:  # 0 means off, which this setting has not
            raise ValueError(f"wants a number > 0 or auto, got {text!r}")
        return {name: value}
    if kind is str:
        return {name: text}
    if kind is bool:
        return {name: parse_bool(text)}
    raise TypeError(f"RunConfig.{name}: no text parser for {kind}")


def _zero(kind: Any) -> Any:
    """The value a field's word (off, auto) stands for: 0 or empty."""
    return {int: 0, float: 0.0, str: ""}[kind]


def parse_bool(text: str) -> bool:
    """1/true/yes/on or 0/false/no/off (any case)."""
    word = text.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false (1/0, yes/no, on/off), got {text!r}")  # a programming error


def settings_from_env(environ: Mapping[str, str], names: Iterable[str] | None = None) -> dict[str, Any]:
    """The settings the environment gives (every field, or only `names`); an empty variable counts
    as unset; a bad value is a ValueError naming the variable."""
    out: dict[str, Any] = {}
    for name in run_options() if names is None else names:
        var = env_name(name)
        text = environ.get(var, "")
        if text.strip():
            try:
                out.update(parse_setting(name, text))
            except ValueError as exc:
                raise ValueError(f"environment variable {var}={text!r}: {exc}") from None
    return out


def coerce_settings(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Settings from a file (JSON, YAML, TOML, an experiment spec): field names checked, values of the
    field's type (ints as floats, whole floats as ints, numbers as strings, numeric strings parsed, a
    field's word, `off` or `auto`, as its 0 or empty value)."""
    types = _field_types()
    unknown = sorted(str(k) for k in set(data) - set(types))
    if unknown:
        raise ValueError(f"{where}: unknown RunConfig fields {unknown}; valid: {', '.join(types)}")
    out: dict[str, Any] = {}
    for name, value in data.items():
        word = run_options()[name].word
        said = value.strip().lower() == word if isinstance(value, str) else word == OFF and value is False
        if word and said:  # YAML 1.1 reads a bare `off` as false
            value = _zero(types[name])
        try:
            out[name] = _coerce(types[name], value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {name}: {exc}") from None
    return out


def _coerce(kind: Any, value: Any) -> Any:
    if kind is bool:
        return value if isinstance(value, bool) else parse_bool(str(value))
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    if kind is float and (numeric or isinstance(value, str)):
        return _parse_float(value) if isinstance(value, str) else float(value)
    if kind is int and isinstance(value, str):
        return _parse_int(value)
    if kind is int and numeric and float(value).is_integer():
        return int(value)
    if kind is str and (numeric or isinstance(value, str)):
        return str(value)
    if typing.get_origin(kind) is dict:  # optimizer_params: a mapping of numbers, or KEY=VALUE text
        if isinstance(value, str):
            return parse_opt_params(value)
        if isinstance(value, Mapping):
            return {str(k): _coerce(float, v) for k, v in value.items()}
    raise TypeError(f"wants {getattr(kind, '__name__', kind)}, got {value!r}")


def parse_toml(text: str) -> dict[str, Any]:
    """A TOML document as a dict (the standard tomllib from Python 3.11, its backport tomli on 3.10);
    malformed TOML raises ValueError (both libraries' TOMLDecodeError is one)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10 (pyproject installs tomli there)
        import tomli as tomllib
    return tomllib.loads(text)


def _load(suffix: str, text: str) -> Any:
    if suffix == ".json":
        return json.loads(text)
    if suffix == ".toml":
        return parse_toml(text)
    import yaml

    return yaml.safe_load(text)


def read_settings_file(path: Path) -> dict[str, Any]:
    """The settings of a run configuration file: a mapping of RunConfig fields in JSON (.json), YAML
    (.yaml, .yml) or TOML (.toml), or a run directory's config.json (its `run`). Problems are ValueErrors."""
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml", ".toml"):
        raise ValueError(f"{path}: a run configuration file is .json, .yaml, .yml or .toml")
    text = path.read_text()
    try:
        data = _load(suffix, text)
    except Exception as exc:  # the parsers' own errors (yaml.YAMLError is no ValueError)
        raise ValueError(f"{path}: {exc}") from None
    if data is None:
        data = {}
    if isinstance(data, dict) and isinstance(data.get("run"), dict):  # a run directory's config.json
        data = data["run"]
    if not isinstance(data, dict):
        raise ValueError(f"{path}: wants a mapping of RunConfig fields, got {type(data).__name__}")
    return coerce_settings(data, str(path))
