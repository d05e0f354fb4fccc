"""Deterministic placement of model variables on parameter-server shards, used by every role.

Variables are spread over shards by size (largest first onto the least-loaded shard); a variable
larger than the slice threshold is cut along axis 0 into one slice per shard so that no single
large matrix makes one shard the bottleneck. A keyed table (rows by int64 key: ps/keyed.py) is cut into
one part per shard whatever its size, each keeping its share of the table's rows, and a key's row lives
in part `mix64(key) % parts` (`Placement.row_parts`): the same keys go to the same shard in every process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

DEFAULT_SLICE_THRESHOLD_BYTES = 256 * 1024
_U64 = np.uint64


def mix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finalizer: a bijection of uint64 whose outputs pass as independent uniform bits."""
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def key_parts(keys: npt.NDArray[np.int64], parts: int) -> npt.NDArray[np.int64]:
    """The part (0 .. parts-1) of a keyed table that holds each key's row."""
    with np.errstate(over="ignore"):
        out: npt.NDArray[np.int64] = (mix64(np.asarray(keys, dtype=np.int64).view(_U64)) % _U64(parts)).astype(np.int64)
    return out


@dataclass(frozen=True)
class VariableSpec:
    """A model variable as placement sees it: name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    keyed: bool = False  # rows by int64 key, shape[0] the most the table keeps (ps/keyed.py)

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
    keyed: bool = False  # holds the rows of the keys routed to it (key_parts), not rows [row_start, row_stop)

    def rows(self) -> slice:
        """The axis-0 slice of the full variable this part holds (of a keyed part: the rows it keeps)."""
        return slice(self.row_start, self.row_stop)

    def ids_of(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Ids of the whole table as this part's: a keyed part takes keys as they are."""
        return ids if self.keyed else ids - self.row_start


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

    def row_parts(self, variable: str, ids: npt.NDArray[np.int64]) -> list[tuple[Part, npt.NDArray[np.int64]]]:
        """Each part of `variable` with the positions in `ids` (sorted, distinct ids of the whole table) of the
        rows it holds: by row range, or for a keyed table by key_parts."""
        parts = self.parts_of(variable)
        if parts and parts[0].keyed:
            which = key_parts(ids, len(parts))
            return [(part, np.flatnonzero(which == i)) for i, part in enumerate(parts)]
        out = []
        for part in parts:
            lo, hi = np.searchsorted(ids, [part.row_start, part.row_stop])
            out.append((part, np.arange(lo, hi, dtype=np.int64)))
        return out

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
        if spec.keyed and rows < num_shards:
            raise ValueError(f"{spec.name}: a keyed table keeps at least one row per shard, not {rows} over "
                             f"{num_shards}")
        if spec.keyed or (num_shards > 1 and spec.nbytes > slice_threshold_bytes and rows >= num_shards):
            bounds = np.linspace(0, rows, num_shards + 1).round().astype(int)
            first = _stable_hash(spec.name) % num_shards
            row_bytes = spec.nbytes // rows
            for i in range(num_shards):
                shard = (first + i) % num_shards
                start, stop = int(bounds[i]), int(bounds[i + 1])
                name = f"{spec.name}/part{i}of{num_shards}" if num_shards > 1 else spec.name
                parts.append(Part(spec.name, name, shard, start, stop, True, spec.keyed))
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
