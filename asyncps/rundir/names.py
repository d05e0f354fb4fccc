"""The files of a run directory, by name, and the error raised when one cannot be read."""

from __future__ import annotations

CONFIG_JSON = "config.json"  # the run's settings, written by the chief when it starts
SUMMARY_JSON = "summary.json"  # the run's outcome, written by the chief when it finishes
PUSHES_CSV = "pushes.csv"  # one row per push a worker reported
TIMELINE_CSV = "timeline.csv"  # one row per worker step (pull, compute, push, wait)
EVAL_CSV = "eval.csv"  # one row per evaluation of the model on the test set
MANIFEST_JSON = "manifest.json"  # the run's id and training time so far: a restarted chief resumes


class RunDirError(ValueError):
    """A run-directory file that is not in the format this version writes (names the file and the field)."""
