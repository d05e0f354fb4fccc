"""manifest.json: who the run is, so that a restarted chief continues it instead of starting over.

Written by the chief when a run starts and kept current while it runs: the run's id (given to the
shards with their state, so a chief never trains on another run's shards), how many times a chief
started on it, the training time so far (the clock continues across chief restarts) and the
checkpoints the storage refused so far (summary.json counts them over every chief). A run
directory with a manifest is a run to resume.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path

from asyncps.rundir.atomic import write_json
from asyncps.rundir.names import RunDir, RunDirError


@dataclass(frozen=True)
class RunManifest:
    """The identity of a run and what a restarted chief continues from."""

    run_id: str
    chief_starts: int = 1  # chiefs started on this run directory, this one included
    elapsed_s: float = 0.0  # training time so far, over every chief of the run
    checkpoints_failed: int = 0  # checkpoints the storage refused, over every chief of the run

    @staticmethod
    def new() -> RunManifest:
        """A new run with a fresh random id."""
        return RunManifest(run_id=secrets.token_hex(8))

    @staticmethod
    def load(run_dir: Path) -> RunManifest | None:
        """The manifest of a run directory, or None when it has none (a new run)."""
        path = RunDir(run_dir).manifest
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
            return RunManifest(run_id=str(data["run_id"]), chief_starts=int(data["chief_starts"]),
                               elapsed_s=float(data["elapsed_s"]),
                               checkpoints_failed=int(data.get("checkpoints_failed", 0)))
        except (ValueError, KeyError, TypeError) as exc:
            raise RunDirError(f"{path}: not a run manifest ({exc})") from None

    def save(self, run_dir: Path) -> None:
        """Write atomically (a reader sees the old or the new manifest)."""
        write_json(RunDir(run_dir).manifest, {"run_id": self.run_id, "chief_starts": self.chief_starts,
                                             "elapsed_s": round(self.elapsed_s, 3),
                                             "checkpoints_failed": self.checkpoints_failed})
