"""The one error of experiments: a spec or an output directory that cannot be used."""

from __future__ import annotations


class ExperimentError(ValueError):
    """A spec or an output directory that cannot be used (reported as one line by the CLI)."""
