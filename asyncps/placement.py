"""Deterministic placement of model variables on parameter-server shards, used by every role.

Variables are spread over shards by size (largest first onto the least-loaded shard); a variable
larger than the slice threshold is cut along axis 0 into one slice per shard so that no single
large matrix makes one shard the bottleneck.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_SLICE_THRESHOLD_BYTES = 256 * 1024


@dataclass(frozen=True)
class VariableSpec:
    """A model variable as placement sees it: name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def nbytes(self) -> int:
        """Size of the variable in bytes."""
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Part:
    """One stored piece of a variable: the whole variable, or rows [row_start, row_stop)."""

    variable: str
    name: str  # the key the shard stores it under
    shard: int
    row_start: int
    row_stop: int
    sliced: bool

    def rows(self) -> slice:
        """The axis-0 slice of the full variable this part holds."""
        return slice(self.row_start, self.row_stop)


@dataclass(frozen=True)
class Placement:
    """Where every variable (or slice of one) lives."""

    num_shards: int
    variables: tuple[VariableSpec, ...]
    parts: tuple[Part, ...]

    def parts_on(self, shard: int) -> tuple[Part, ...]:
        """The parts stored on one shard."""
        return tuple(p for p in self.parts if p.shard == shard)

    def parts_of(self, variable: str) -> tuple[Part, ...]:
        """The parts a variable is split into, in row order."""
        return tuple(p for p in self.parts if p.variable == variable)

    def without(self, variables: Iterable[str]) -> Placement:
        """The same placement with some variables left out (tables a worker reads by rows: no buffer)."""
        drop = set(variables)
        return Placement(self.num_shards, tuple(v for v in self.variables if v.name not in drop),
                         tuple(p for p in self.parts if p.variable not in drop))

    def shard_bytes(self) -> list[int]:
        """Bytes stored on each shard (for balance checks and logs)."""
        sizes = [0] * self.num_shards
        by_name = {v.name: v for v in self.variables}
        for p in self.parts:
            spec = by_name[p.variable]
            row_bytes = spec.nbytes // max(1, spec.shape[0]) if spec.shape else spec.nbytes
            sizes[p.shard] += row_bytes * (p.row_stop - p.row_start) if spec.shape else spec.nbytes
        return sizes


def _stable_hash(name: str) -> int:
    # hashlib, never hash(): Python's str hash is salted per process.
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def place(
    variables: Iterable[VariableSpec],
    num_shards: int,
    slice_threshold_bytes: int = DEFAULT_SLICE_THRESHOLD_BYTES,
) -> Placement:
    """Compute the placement of variables over num_shards shards; identical in every process."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    specs = tuple(variables)
    names = [v.name for v in specs]
    if len(set(names)) != len(names):
        raise ValueError("variable names must be unique")
    load = [0] * num_shards
    parts: list[Part] = []
    whole: list[VariableSpec] = []
    for spec in specs:
        rows = spec.shape[0] if spec.shape else 0
        if num_shards > 1 and spec.nbytes > slice_threshold_bytes and rows >= num_shards:
            bounds = np.linspace(0, rows, num_shards + 1).round().astype(int)
            first = _stable_hash(spec.name) % num_shards
            row_bytes = spec.nbytes // rows
            for i in range(num_shards):
                shard = (first + i) % num_shards
                start, stop = int(bounds[i]), int(bounds[i + 1])
                parts.append(Part(spec.name, f"{spec.name}/part{i}of{num_shards}", shard,
                                  start, stop, True))
                load[shard] += row_bytes * (stop - start)
        else:
            whole.append(spec)
    for spec in sorted(whole, key=lambda v: (-v.nbytes, v.name)):
        shard = min(range(num_shards), key=lambda s: (load[s], s))
        rows = spec.shape[0] if spec.shape else 1
        parts.append(Part(spec.name, spec.name, shard, 0, rows, False))
        load[shard] += spec.nbytes
    order = {n: i for i, n in enumerate(names)}
    parts.sort(key=lambda p: (order[p.variable], p.row_start))
    return Placement(num_shards=num_shards, variables=specs, parts=tuple(parts))


def split_for_shards(placement: Placement, values: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Cut full variable values into the per-shard dicts of parts (views, no copies)."""
    per_shard: list[dict[str, np.ndarray]] = [{} for _ in range(placement.num_shards)]
    for part in placement.parts:
        value = values[part.variable]
        per_shard[part.shard][part.name] = value[part.rows()] if part.sliced else value
    return per_shard


def specs_of(named_shapes: Sequence[tuple[str, tuple[int, ...], str]]) -> tuple[VariableSpec, ...]:
    """Build VariableSpecs from (name, shape, dtype) triples."""
    return tuple(VariableSpec(n, tuple(int(d) for d in s), d) for n, s, d in named_shapes)
