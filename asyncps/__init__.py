"""asyncps: a parameter-server training system for asynchronous SGD with staleness tracking.

`asyncps.train(...)` is the Python API (asyncps.tools.api); `asyncps.HashEmbedding` is the Keras layer of a
table keyed by int64 ids of any value (asyncps.ml.sparse). They are imported on first use: this
package is the core floor, which imports no tool, and `import asyncps` stays free of TensorFlow;
type checkers and editors see the real signatures through the package's stub (`__init__.pyi`).
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import Any

_API = ("train", "TrainResult", "TrainingFailed", "RunDiverged", "History")

try:
    __version__ = metadata.version("asyncps")
except metadata.PackageNotFoundError:  # a checkout on the path, not installed
    __version__ = "0+unknown"

__all__ = ["HashEmbedding", "History", "RunDiverged", "TrainResult", "TrainingFailed", "__version__", "train"]


def __getattr__(name: str) -> Any:
    """`asyncps.train`, `asyncps.TrainResult`, `asyncps.History`, `asyncps.TrainingFailed` and
    `asyncps.RunDiverged`, loaded lazily from asyncps.tools.api; `asyncps.HashEmbedding` from asyncps.ml.sparse."""
    if name in _API:
        return getattr(importlib.import_module("asyncps.tools.api"), name)
    if name == "HashEmbedding":
        return importlib.import_module("asyncps.ml.sparse").HashEmbedding
    raise AttributeError(f"module 'asyncps' has no attribute {name!r}")
