"""memory.json: the local launcher's peak memory per process (VmHWM), written when the run ends.

Why: logical workers exist to fit many workers into one machine's memory, so a run says what it
used; the experiment tools read `per_worker_mb` from it. A run started otherwise has no memory.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from asyncps.rundir.atomic import atomic_write
from asyncps.rundir.names import RunDir
from asyncps.rundir.summary import _Fields, _load_object


@dataclass(frozen=True)
class PeakMemory:
    """Peak resident memory in MB: per process name, the workers' total, all processes, one (logical) worker's share."""

    peak_rss_mb: dict[str, float] = field(default_factory=dict)
    workers_total_mb: float = 0.0
    total_mb: float = 0.0
    per_worker_mb: float = 0.0

    def to_dict(self) -> dict[str, object]:
        """The JSON object, in the order the launcher has always written it."""
        return {"peak_rss_mb": dict(self.peak_rss_mb), "workers_total_mb": self.workers_total_mb,
                "total_mb": self.total_mb, "per_worker_mb": self.per_worker_mb}

    def save(self, run_dir: Path) -> Path:
        """Write run_dir/memory.json atomically."""
        path = RunDir(run_dir).memory
        atomic_write(path, json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: object, source: str) -> PeakMemory:
        """Validate and convert a parsed memory.json (`source` names it in errors)."""
        f = _Fields(data, source)
        peaks: dict[str, float] = {}
        for name, value in f.mapping("peak_rss_mb", {}).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise f.error(f"peak_rss_mb.{name}", "a number", value)
            peaks[name] = float(value)
        return cls(peaks, f.number("workers_total_mb"), f.number("total_mb"), f.number("per_worker_mb"))

    @classmethod
    def load(cls, run_dir: Path) -> PeakMemory:
        """Read and validate run_dir/memory.json."""
        path = RunDir(run_dir).memory
        return cls.from_dict(_load_object(path), str(path))

    @classmethod
    def load_if_present(cls, run_dir: Path) -> PeakMemory | None:
        """run_dir/memory.json, or None when the run has none."""
        return cls.load(run_dir) if RunDir(run_dir).memory.exists() else None


__all__ = ["PeakMemory"]
