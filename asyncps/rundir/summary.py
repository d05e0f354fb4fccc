"""summary.json (the run's outcome) and config.json (its settings): typed, written and read here only.

Reading validates: a missing field or a value of the wrong type is a RunDirError naming the file
and the field (e.g. `runs/x/summary.json: field 'staleness.p95': expected an integer, got 'a'`).
Keys this version does not know are ignored, so a newer chief's files still read.

Older run directories: no field has been renamed. The fields the chief has written since the first
version are required; the three added later (`data`, `idle_fraction`, `max_clock_lead`) read as
empty / 0 when absent, so run directories of earlier chiefs read; so do `start` and
`staleness_steady` (the start barrier and the steady-state staleness), and `measured_clock_lead`
reads as None (not measured: the tools measure it from timeline.csv then), and so does `provenance`
(the versions, host and commit a chief ran with, in both files, asyncps.rundir.provenance). `final_train_loss` and
`optimality_gap` exist only for datasets with a known optimum and are left out of the file
otherwise (None here). `outcome` and `verdict` (how the run ended, and why not as trained) read as None
when absent, `nonfinite_steps` and `checkpoints_failed` as 0.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncps.config import RunConfig
from asyncps.rundir.atomic import write_json
from asyncps.rundir.names import CONFIG_JSON, SUMMARY_JSON, RunDir, RunDirError
from asyncps.rundir.provenance import Provenance

#: The stop reason of a run stopped by a signal (Ctrl-C, SIGTERM): not a finished run.
INTERRUPTED = "interrupted"

_MISSING: Any = object()


class _Fields:
    """Typed access to one JSON object of a file, with errors that name the file and the field."""

    def __init__(self, data: Any, source: str, prefix: str = "") -> None:
        if not isinstance(data, dict):
            what = f"field {prefix.rstrip('.')!r}" if prefix else "the file"
            raise RunDirError(f"{source}: {what} must be a JSON object, got {_show(data)}")
        self.data: dict[str, Any] = data
        self.source, self.prefix = source, prefix

    def error(self, name: str, expected: str, value: Any) -> RunDirError:
        """The error for field `name` holding `value` instead of `expected`."""
        return RunDirError(f"{self.source}: field {self.prefix + name!r}: expected {expected}, got {_show(value)}")

    def get(self, name: str, default: Any = _MISSING) -> Any:
        """The raw value (a RunDirError when missing and there is no default)."""
        if name in self.data:
            return self.data[name]
        if default is _MISSING:
            raise RunDirError(f"{self.source}: missing field {self.prefix + name!r}")
        return default

    def integer(self, name: str, default: Any = _MISSING) -> int:
        """An integer field (a bool is not one)."""
        value = self.get(name, default)
        if not _is_int(value):
            raise self.error(name, "an integer", value)
        return int(value)

    def number(self, name: str, default: Any = _MISSING) -> float:
        """A number field (NaN allowed)."""
        value = self.get(name, default)
        if not _is_number(value):
            raise self.error(name, "a number", value)
        return float(value)

    def optional_number(self, name: str) -> float | None:
        """A number field that may be absent or null."""
        return None if self.get(name, None) is None else self.number(name)

    def text(self, name: str) -> str:
        """A string field."""
        value = self.get(name)
        if not isinstance(value, str):
            raise self.error(name, "a string", value)
        return value

    def optional_text(self, name: str) -> str | None:
        """A string field that may be null (it must be present)."""
        return None if self.get(name) is None else self.text(name)

    def obj(self, name: str) -> _Fields:
        """A nested object."""
        return _Fields(self.get(name), self.source, f"{self.prefix}{name}.")

    def objects(self, name: str) -> list[_Fields]:
        """A list of objects."""
        value = self.get(name)
        if not isinstance(value, list):
            raise self.error(name, "a list", value)
        return [_Fields(item, self.source, f"{self.prefix}{name}[{i}].") for i, item in enumerate(value)]

    def mapping(self, name: str, default: Any = _MISSING) -> dict[str, Any]:
        """An object as a plain dict."""
        value = self.get(name, default)
        if not isinstance(value, dict):
            raise self.error(name, "an object", value)
        return value

    def counts(self, name: str, default: Any = _MISSING, int_keys: bool = False,
               nullable: bool = False) -> dict[Any, Any]:
        """An object of integer values (None allowed when nullable), keys optionally integers."""
        out: dict[Any, Any] = {}
        for key, value in self.mapping(name, default).items():
            if not (_is_int(value) or (nullable and value is None)):
                raise self.error(f"{name}.{key}", "an integer", value)
            out[_int_key(self, name, key) if int_keys else key] = value
        return out

    def numbers(self, name: str, default: Any = _MISSING) -> dict[int, float]:
        """An object of numbers keyed by integers written as strings."""
        out: dict[int, float] = {}
        for key, value in self.mapping(name, default).items():
            if not _is_number(value):
                raise self.error(f"{name}.{key}", "a number", value)
            out[_int_key(self, name, key)] = float(value)
        return out


def _named_numbers(fields: _Fields, name: str) -> dict[str, float]:
    """An object of numbers keyed by names ({} when absent: written before the field existed)."""
    out: dict[str, float] = {}
    for key, value in fields.mapping(name, {}).items():
        if not _is_number(value):
            raise fields.error(f"{name}.{key}", "a number", value)
        out[str(key)] = float(value)
    return out


def _provenance(fields: _Fields) -> Provenance | None:
    """The `provenance` object (None when absent: written before it was recorded)."""
    if fields.get("provenance", None) is None:
        return None
    f = fields.obj("provenance")
    versions = f.mapping("versions", {})
    for name, version in versions.items():
        if not isinstance(version, str):
            raise f.error(f"versions.{name}", "a string", version)
    dirty = f.get("dirty", None)
    if dirty is not None and not isinstance(dirty, bool):
        raise f.error("dirty", "true or false", dirty)
    commit = f.get("commit", None)
    return Provenance(dict(versions), f.text("host"), None if commit is None else f.text("commit"), dirty)


def _int_key(fields: _Fields, name: str, key: str) -> int:
    try:
        return int(key)
    except ValueError:
        raise fields.error(name, "integer keys", key) from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _load_object(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise RunDirError(f"{path}: not JSON ({exc})") from None


@dataclass(frozen=True)
class StalenessSummary:
    """Staleness of the run's pushes: mean, quantiles, maximum, count and the histogram."""

    mean: float
    p50: int
    p95: int
    max: int
    count: int
    histogram: dict[int, int]  # staleness -> number of pushes

    @classmethod
    def of(cls, histogram: Mapping[int, int]) -> StalenessSummary:
        """The summary of a histogram of integer staleness counts (all zero when empty)."""
        total = sum(histogram.values())
        if total == 0:
            return cls(0.0, 0, 0, 0, 0, {})
        keys = sorted(histogram)

        def quantile(q: float) -> int:
            target, seen = q * total, 0
            for k in keys:
                seen += histogram[k]
                if seen >= target:
                    return k
            return keys[-1]

        return cls(mean=sum(k * c for k, c in histogram.items()) / total, p50=quantile(0.5), p95=quantile(0.95),
                   max=keys[-1], count=total, histogram={k: histogram[k] for k in keys})

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (histogram keys as strings)."""
        return {"mean": self.mean, "p50": self.p50, "p95": self.p95, "max": self.max, "count": self.count,
                "histogram": {str(k): v for k, v in sorted(self.histogram.items())}}

    @classmethod
    def read(cls, f: _Fields) -> StalenessSummary:
        """From its JSON object."""
        return cls(mean=f.number("mean"), p50=f.integer("p50"), p95=f.integer("p95"), max=f.integer("max"),
                   count=f.integer("count"), histogram=f.counts("histogram", int_keys=True))



@dataclass(frozen=True)
class RowStalenessSummary:
    """Per-row staleness of a run whose tables were read by rows (pushes.csv's row columns): over every
    row a push touched, the updates it had received since its worker read it (mean, max), and the
    distribution of each push's worst row; the hot rows' mean and the others' (asyncps.ps.store.HOT_SHARE),
    and the rows a per-row staleness policy dropped (0 in older files)."""

    rows: int
    mean: float
    max: int
    worst_per_push: StalenessSummary
    dropped: int = 0
    hot_rows: int = 0
    hot_mean: float = 0.0
    cold_mean: float = 0.0

    @classmethod
    def of(cls, rows: int, total: float, worst: Mapping[int, int], dropped: int = 0, hot_rows: int = 0,
           hot_total: float = 0.0) -> RowStalenessSummary:
        """From the rows measured, the sum of their staleness and a histogram of each push's worst row; the rows
        dropped, the hot rows and the sum of their staleness."""
        cold = rows - hot_rows
        return cls(rows, total / rows if rows else 0.0, max(worst, default=0), StalenessSummary.of(worst), dropped,
                   hot_rows, hot_total / hot_rows if hot_rows else 0.0, (total - hot_total) / cold if cold else 0.0)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object."""
        return {"rows": self.rows, "mean": self.mean, "max": self.max,
                "worst_per_push": self.worst_per_push.to_dict(), "dropped": self.dropped,
                "hot_rows": self.hot_rows, "hot_mean": self.hot_mean, "cold_mean": self.cold_mean}

    @classmethod
    def read(cls, f: _Fields) -> RowStalenessSummary:
        """Read back from summary.json's object."""
        return cls(f.integer("rows"), f.number("mean"), f.integer("max"),
                   StalenessSummary.read(f.obj("worst_per_push")), f.integer("dropped", 0),
                   f.integer("hot_rows", 0), f.number("hot_mean", 0.0), f.number("cold_mean", 0.0))

@dataclass(frozen=True)
class FinalEval:
    """The evaluation at the end of the run, on the test set."""

    loss: float
    accuracy: float


@dataclass(frozen=True)
class ShardCounters:
    """A shard's version and push counters at the end of the run."""

    version: int
    accepted: int
    dropped: int
    # added later (0 when reading an older run directory): tensor bytes the shard received in
    # pushes (sparse gradients: the touched rows and their indices only) and sent in pulls
    bytes_pushed: int = 0
    bytes_pulled: int = 0
    # the same by the transport that carried them: {"tcp": {"pushed": n, "pulled": m}, ...} (added later)
    bytes_by_transport: dict[str, dict[str, int]] = field(default_factory=dict)
    # the accepted pushes (pushes.csv rows) that a restore of the shard to a checkpoint rolled back:
    # rows of the shard = accepted + dropped + rolled_back, as far as the shard's counters go (added later)
    rolled_back: int = 0
    # added later (0 and {} in older run directories): the answers to pushes the shard's final state had
    # given (each numbered: pushes.csv's seq), in all and by worker index; the shard's pushes.csv rows,
    # those whose answer a restore took back (rolled back, or dropped by a state that was replaced), and
    # per worker index the answers no row reports (pushes of workers killed before their report):
    # answers == rows - rows_taken_back + sum(unreported), and by worker the same
    answers: int = 0
    answers_by_worker: dict[str, int] = field(default_factory=dict)
    rows: int = 0
    rows_taken_back: int = 0
    unreported: dict[str, int] = field(default_factory=dict)


def _by_transport(shard: _Fields) -> dict[str, dict[str, int]]:
    """A shard's bytes_by_transport ({} in run directories older than it)."""
    if not shard.mapping("bytes_by_transport", {}):
        return {}
    by = shard.obj("bytes_by_transport")
    return {name: by.counts(name) for name in by.data}


@dataclass(frozen=True)
class RunSummary:
    """summary.json: what a finished (or interrupted) run did. Written by the chief, read by the tools."""

    updates_applied: int
    updates_dropped: int
    staleness: StalenessSummary
    throughput_updates_per_s: float
    final_eval: FinalEval
    wall_s: float  # training time: from the first update to the stop
    mode: str
    staleness_policy: str
    workers: int
    ps_shards: int
    model: str
    dataset: str
    epochs: float
    stop_reason: str | None
    pushes_recorded: int
    dropped_by_reason: dict[str, int]
    backup_workers: int
    staleness_bound: int
    shards: tuple[ShardCounters, ...]
    # added after the first version: empty / 0 when reading an older run directory
    data: dict[str, int | None] = field(default_factory=dict)  # the data-task ledger's counts
    idle_fraction: dict[int, float] = field(default_factory=dict)  # worker -> share of step time held back
    max_clock_lead: float = 0.0
    # the start barrier (enabled, planned, ready, released_after_s, late_workers) and the staleness of
    # the pushes after every planned worker's first push; absent in older run directories
    start: dict[str, Any] = field(default_factory=dict)
    staleness_steady: StalenessSummary | None = None
    # per-row staleness when tables were read by rows (absent: none measured, or an older run directory)
    row_staleness: RowStalenessSummary | None = None
    # the workers' row caches (--row-cache-staleness): rows, hits, hit_rate, bytes_saved, and by_worker
    # (worker index -> the same); empty: no cache, or an older run directory
    row_cache: dict[str, Any] = field(default_factory=dict)
    # the largest clock lead measured by the chief from pushes.csv (asyncps.rundir.clocklead), and
    # SSP reads the shards refused (the worker repeated the call), by why: deadline, no_slot
    measured_clock_lead: int | None = None  # None: written by a chief before it measured it
    reads_refused: dict[str, int] = field(default_factory=dict)
    # datasets with a known optimum only
    final_train_loss: float | None = None
    optimality_gap: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # --eval-metrics of the final evaluation (test set)
    # the versions, host and commit the chief ran with (None: an older run directory, or built from the CSVs)
    provenance: Provenance | None = None
    # how the run ended: finished, interrupted, diverged or no_workers (None: an older chief's summary), the
    # verdict's words when it did not finish as trained, and the steps its workers skipped as non-finite
    outcome: str | None = None
    verdict: str | None = None
    nonfinite_steps: int = 0
    checkpoints_failed: int = 0  # checkpoints the storage refused (disk full, read-only); the run went on

    @property
    def diverged(self) -> bool:
        """True when the chief ended the run as diverged (exit status 5)."""
        return self.outcome == "diverged"

    @property
    def interrupted(self) -> bool:
        """True when the run was stopped by a signal before its stop condition."""
        return self.stop_reason == INTERRUPTED

    def settings(self) -> dict[str, Any]:
        """The run settings the summary records, by their RunConfig field names (for runs whose
        config.json is missing)."""
        return {"mode": self.mode, "staleness_policy": self.staleness_policy, "num_workers": self.workers,
                "num_ps": self.ps_shards, "model": self.model, "dataset": self.dataset,
                "backup_workers": self.backup_workers, "staleness_bound": self.staleness_bound}

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (the optimum's fields only when known)."""
        data: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["staleness"] = self.staleness.to_dict()
        data["final_eval"] = dataclasses.asdict(self.final_eval)
        data["shards"] = [dataclasses.asdict(s) for s in self.shards]
        data["idle_fraction"] = {str(k): v for k, v in self.idle_fraction.items()}
        data["dropped_by_reason"] = dict(self.dropped_by_reason)
        data["data"] = dict(self.data)
        data["start"] = dict(self.start)
        data["staleness_steady"] = None if self.staleness_steady is None else self.staleness_steady.to_dict()
        data["row_staleness"] = None if self.row_staleness is None else self.row_staleness.to_dict()
        data["reads_refused"] = dict(self.reads_refused)
        data["row_cache"] = dict(self.row_cache)
        data["metrics"] = dict(self.metrics)
        data["provenance"] = None if self.provenance is None else self.provenance.to_dict()
        for name in ("final_train_loss", "optimality_gap", "staleness_steady", "row_staleness", "measured_clock_lead",
                     "provenance", "outcome", "verdict"):
            if data[name] is None:
                del data[name]
        return data

    def to_json(self) -> str:
        """The file's text."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: Any, source: str = SUMMARY_JSON) -> RunSummary:
        """Validate and convert a parsed summary.json (`source` names it in errors)."""
        f = _Fields(data, source)
        final = f.obj("final_eval")
        return cls(
            updates_applied=f.integer("updates_applied"), updates_dropped=f.integer("updates_dropped"),
            staleness=StalenessSummary.read(f.obj("staleness")),
            throughput_updates_per_s=f.number("throughput_updates_per_s"),
            final_eval=FinalEval(final.number("loss"), final.number("accuracy")),
            wall_s=f.number("wall_s"), mode=f.text("mode"), staleness_policy=f.text("staleness_policy"),
            workers=f.integer("workers"), ps_shards=f.integer("ps_shards"), model=f.text("model"),
            dataset=f.text("dataset"), epochs=f.number("epochs"), stop_reason=f.optional_text("stop_reason"),
            pushes_recorded=f.integer("pushes_recorded"), dropped_by_reason=f.counts("dropped_by_reason"),
            backup_workers=f.integer("backup_workers"), staleness_bound=f.integer("staleness_bound"),
            shards=tuple(ShardCounters(s.integer("version"), s.integer("accepted"), s.integer("dropped"),
                                       s.integer("bytes_pushed", 0), s.integer("bytes_pulled", 0),
                                       _by_transport(s), s.integer("rolled_back", 0), s.integer("answers", 0),
                                       s.counts("answers_by_worker", {}), s.integer("rows", 0),
                                       s.integer("rows_taken_back", 0), s.counts("unreported", {}))
                         for s in f.objects("shards")),
            data=f.counts("data", {}, nullable=True), idle_fraction=f.numbers("idle_fraction", {}),
            max_clock_lead=f.number("max_clock_lead", 0.0), start=f.mapping("start", {}),
            measured_clock_lead=(f.integer("measured_clock_lead")
                                 if f.get("measured_clock_lead", None) is not None else None),
            reads_refused=f.counts("reads_refused", {}),
            staleness_steady=(StalenessSummary.read(f.obj("staleness_steady"))
                              if f.get("staleness_steady", None) is not None else None),
            row_staleness=(RowStalenessSummary.read(f.obj("row_staleness"))
                           if f.get("row_staleness", None) is not None else None),
            final_train_loss=f.optional_number("final_train_loss"), optimality_gap=f.optional_number("optimality_gap"),
            metrics=_named_numbers(f, "metrics"), provenance=_provenance(f), row_cache=f.mapping("row_cache", {}),
            outcome=_absent_or_text(f, "outcome"), verdict=_absent_or_text(f, "verdict"),
            nonfinite_steps=f.integer("nonfinite_steps", 0), checkpoints_failed=f.integer("checkpoints_failed", 0),
        )

    @classmethod
    def from_json(cls, text: str, source: str = SUMMARY_JSON) -> RunSummary:
        """Parse and validate the file's text."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RunDirError(f"{source}: not JSON ({exc})") from None
        return cls.from_dict(data, source)

    def save(self, run_dir: Path) -> Path:
        """Write run_dir/summary.json atomically."""
        path = RunDir(run_dir).summary
        write_json(path, self.to_dict())
        return path

    @classmethod
    def load(cls, run_dir: Path) -> RunSummary:
        """Read and validate run_dir/summary.json."""
        path = RunDir(run_dir).summary
        return cls.from_dict(_load_object(path), str(path))

    def mean_idle_fraction(self) -> float:
        """The workers' mean share of step time held back (NaN when not recorded)."""
        values = list(self.idle_fraction.values())
        return sum(values) / len(values) if values else math.nan


def _absent_or_text(f: _Fields, name: str) -> str | None:
    """A string field that may be absent or null (None then)."""
    return None if f.get(name, None) is None else f.text(name)


@dataclass(frozen=True)
class RunConfigRecord:
    """config.json: the run's settings (RunConfig fields, as a mapping so older runs with other fields
    still read), the shard addresses, the run directory and what the chief ran with (versions, host,
    commit), written by the chief when it starts (again at each start, with the stop conditions and
    provenance of that start)."""

    run: dict[str, Any]
    ps: tuple[str, ...] = ()
    run_dir: str = ""
    provenance: Provenance | None = None  # None: written before it was recorded

    @classmethod
    def of(cls, run: RunConfig, ps: tuple[str, ...] | list[str], run_dir: Path,
           provenance: Provenance | None = None) -> RunConfigRecord:
        """The record of a run about to start."""
        return cls(dataclasses.asdict(run), tuple(ps), str(run_dir), provenance)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object."""
        data: dict[str, Any] = {"run": dict(self.run), "ps": list(self.ps), "run_dir": self.run_dir}
        if self.provenance is not None:
            data["provenance"] = self.provenance.to_dict()
        return data

    def save(self, run_dir: Path) -> Path:
        """Write run_dir/config.json atomically."""
        path = RunDir(run_dir).config
        write_json(path, self.to_dict())
        return path

    @classmethod
    def from_dict(cls, data: Any, source: str = CONFIG_JSON) -> RunConfigRecord:
        """Validate and convert a parsed config.json."""
        f = _Fields(data, source)
        ps = f.get("ps", [])
        if not isinstance(ps, list) or not all(isinstance(a, str) for a in ps):
            raise f.error("ps", "a list of addresses", ps)
        run_dir = f.get("run_dir", "")
        if not isinstance(run_dir, str):
            raise f.error("run_dir", "a string", run_dir)
        return cls(f.mapping("run"), tuple(ps), run_dir, _provenance(f))

    @classmethod
    def load(cls, run_dir: Path) -> RunConfigRecord:
        """Read and validate run_dir/config.json."""
        path = RunDir(run_dir).config
        return cls.from_dict(_load_object(path), str(path))

    @classmethod
    def load_if_present(cls, run_dir: Path) -> RunConfigRecord | None:
        """run_dir/config.json, or None when the directory has none."""
        return cls.load(run_dir) if RunDir(run_dir).config.exists() else None
