"""asyncps: a parameter-server training system for asynchronous SGD with staleness tracking.

`asyncps.train(...)` is the Python API (asyncps.tools.api). It is imported on first use: this
package is the core floor, which imports no tool, and `import asyncps` stays free of TensorFlow.
"""

from __future__ import annotations

import importlib
from typing import Any

_API = ("train", "TrainResult", "TrainingFailed", "RunDiverged")


def __getattr__(name: str) -> Any:
    """`asyncps.train`, `asyncps.TrainingFailed` and `asyncps.RunDiverged`, loaded lazily from asyncps.tools.api."""
    if name in _API:
        return getattr(importlib.import_module("asyncps.tools.api"), name)
    raise AttributeError(f"module 'asyncps' has no attribute {name!r}")
