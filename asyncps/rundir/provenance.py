"""What a run ran on: the versions of asyncps, Python and the libraries that shape its numbers, the host,
and the project's git commit when the code runs from a checkout. config.json and summary.json record it
(their `provenance` object) so a result can be traced to the code and the libraries that made it."""

from __future__ import annotations

import importlib.metadata
import platform
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# the libraries a run's numbers depend on, each with the distributions it may be installed as
LIBRARIES: dict[str, tuple[str, ...]] = {
    "asyncps": ("asyncps",),
    "tensorflow": ("tensorflow", "tensorflow-cpu", "tf-nightly", "tensorflow-macos", "tensorflow-intel"),
    "keras": ("keras", "tf-keras"),
    "numpy": ("numpy",),
    "grpcio": ("grpcio",),
    "protobuf": ("protobuf",),
}
GIT_TIMEOUT_S = 2.0  # a commit is worth a little start-up time, not a hang on a broken repository
# the checkout the running code comes from: asyncps/rundir/provenance.py -> the repository root
_SOURCE_ROOT = Path(__file__).resolve().parents[2]


def library_versions() -> dict[str, str]:
    """Python's version and each installed library's (a library not installed is left out); a module
    already imported answers with its own __version__ (the one actually running)."""
    versions = {"python": platform.python_version()}
    for name, distributions in LIBRARIES.items():
        module = sys.modules.get(name)
        version = getattr(module, "__version__", None) if module is not None else None
        for dist in distributions if not isinstance(version, str) else ():
            try:
                version = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        if isinstance(version, str):
            versions[name] = version
    return versions


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def source_commit(root: Path = _SOURCE_ROOT) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the git checkout at `root` that the code runs from; (None, None) when the code
    is not in a checkout of its own (an installed package), or git cannot tell within its timeout."""
    if not (root / ".git").exists():  # a directory, or a file in a worktree; not a parent's repository
        return None, None
    commit = _git(root, "rev-parse", "HEAD")
    if not commit:
        return None, None
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    return commit, None if status is None else bool(status)


@dataclass(frozen=True)
class Provenance:
    """The versions, host and commit a run ran with (one process's view: the chief's)."""

    versions: dict[str, str] = field(default_factory=dict)  # "python", "asyncps", "tensorflow", ...
    host: str = ""
    commit: str | None = None  # None: not run from a git checkout
    dirty: bool | None = None  # the checkout had changes to tracked files

    @staticmethod
    def collect() -> Provenance:
        """This process's."""
        commit, dirty = source_commit()
        return Provenance(library_versions(), socket.gethostname(), commit, dirty)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (commit and dirty only when known)."""
        data: dict[str, Any] = {"versions": dict(self.versions), "host": self.host}
        if self.commit is not None:
            data["commit"] = self.commit
        if self.dirty is not None:
            data["dirty"] = self.dirty
        return data
