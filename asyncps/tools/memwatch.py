"""Peak memory of the local cluster's processes: VmHWM (the kernel's peak resident set) per process.

Why: logical workers exist to fit many workers into one machine's memory, so a run must say what
it used. The launcher samples every child while it runs (VmHWM only grows, so the last sample
before a process exits is its peak) and writes memory.json (asyncps.rundir.PeakMemory) into the run
directory.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from asyncps.rundir import PeakMemory


def peak_rss_mb(pid: int) -> float:
    """VmHWM of a live process in MB; 0 once it is gone (or where /proc does not exist)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


class MemoryWatch:
    """The largest VmHWM seen per process name."""

    def __init__(self) -> None:
        self.peaks: dict[str, float] = {}

    def sample(self, processes: Iterable[tuple[str, int]]) -> None:
        """Read every (name, pid) once."""
        for name, pid in processes:
            self.peaks[name] = max(self.peaks.get(name, 0.0), peak_rss_mb(pid))

    def summary(self, num_workers: int) -> PeakMemory:
        """The peaks, the workers' total and the share of one (logical) worker."""
        workers = sum(mb for name, mb in self.peaks.items() if name.startswith("worker"))
        return PeakMemory(peak_rss_mb={k: round(v, 1) for k, v in sorted(self.peaks.items())},
                          workers_total_mb=round(workers, 1),
                          total_mb=round(sum(self.peaks.values()), 1),
                          per_worker_mb=round(workers / max(1, num_workers), 1))

    def write(self, run_dir: Path, num_workers: int) -> PeakMemory:
        """Write run_dir/memory.json; return its content."""
        data = self.summary(num_workers)
        data.save(run_dir)
        return data
