"""Atomic writes and port files of a run directory (shared by every role)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def atomic_write(path: Path, text: str) -> None:
    """Write a file so readers see the old or the new content, never a torn one."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_npz(path: Path, arrays: Mapping[str, Any]) -> None:
    """Atomically write arrays as an npz (its folder made if missing): readers see all of it or none."""
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: Path, data: Any) -> None:
    """Atomically write pretty JSON."""
    atomic_write(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_port_file(path: str, port: int) -> None:
    """Publish the port a server bound (for launchers that start it on port 0)."""
    if path:
        atomic_write(Path(path), f"{port}\n")


def wait_port_file(path: Path, timeout_s: float, alive: Any = None) -> int:
    """Wait for a port file to appear; `alive()` returning False aborts early."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        if path.exists():
            text = path.read_text().strip()
            if text.isdigit():
                return int(text)
        if alive is not None and not alive():
            raise RuntimeError(f"process exited before publishing its port ({path.name})")
        time.sleep(0.05)
    raise TimeoutError(f"no port published in {path} within {timeout_s:.0f}s")
