"""A worker's bounded-staleness cache of table rows (Petuum Bösen's SSP row cache: Ho et al., NIPS 2013;
Wei et al., SoCC 2015).

A row read at shard version v (the version of the reply that served it) is served again from the cache
while the version of that shard, as the worker last saw it, is at most v + S: every update of the row
since its read is an update of its shard, so S bounds the updates the cached row misses. Only rows
missing or expired are asked of the shards. A row served from the cache keeps the clock it was read
at, so the push carrying its gradient reports its whole staleness, the cache's included. A shard seen
at another incarnation (restarted, restored) expires every row read from it.

Memory is bounded: at most `max_rows` rows per table, the least recently used evicted first; never a
row the current step needs (`max_rows` is at least the most distinct ids of one batch).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from asyncps.placement import Part, key_parts
from asyncps.wire.codec import Array, IndexArray, SparseRows

#: Bytes a row served from the cache keeps off the wire besides its values: its id asked, its clock served.
ROW_OVERHEAD_BYTES = 16


@dataclass
class RowCacheCounts:
    """What the cache did: rows a worker's steps needed, how many it served itself, and the bytes that
    therefore did not travel (values, clock and id of each row served)."""

    rows: int = 0
    hits: int = 0
    bytes_saved: int = 0

    @property
    def hit_rate(self) -> float:
        """The share of rows needed that the cache served."""
        return self.hits / self.rows if self.rows else 0.0

    def minus(self, before: RowCacheCounts) -> RowCacheCounts:
        """The counts since `before`."""
        return RowCacheCounts(self.rows - before.rows, self.hits - before.hits, self.bytes_saved - before.bytes_saved)


class _TableRows:
    """One table's cached rows: values, the clock each was read at, the version and incarnation of the shard
    that served it, in `max_rows` slots; ids mapped to slots in least recently used order."""

    def __init__(self, parts: Sequence[Part], row_shape: tuple[int, ...], dtype: np.dtype, max_rows: int) -> None:
        ordered = sorted(parts, key=lambda p: p.row_start)
        self._keyed = bool(ordered) and ordered[0].keyed  # a keyed table: a key's part is key_parts'
        self._starts = np.array([p.row_start for p in ordered], dtype=np.int64)
        self._shards = np.array([p.shard for p in ordered], dtype=np.int64)
        self.values = np.zeros((max_rows, *row_shape), dtype=dtype)
        self.clocks = np.zeros(max_rows, dtype=np.int64)
        self.read_at = np.zeros(max_rows, dtype=np.int64)  # the serving shard's version
        self.incarnation = np.zeros(max_rows, dtype=np.int64)
        self.shard = np.zeros(max_rows, dtype=np.int64)
        self.slots: OrderedDict[int, int] = OrderedDict()  # id -> slot, least recently used first
        self._free = list(range(max_rows - 1, -1, -1))
        self.row_bytes = int(np.prod(row_shape, dtype=np.int64)) * np.dtype(dtype).itemsize + ROW_OVERHEAD_BYTES

    def shards_of(self, ids: IndexArray) -> Array:
        """The shard holding each id's row."""
        if self._keyed:
            return self._shards[key_parts(ids, self._shards.size)]
        return self._shards[np.searchsorted(self._starts, ids, side="right") - 1]

    def fresh(self, ids: IndexArray, staleness: int, versions: Array, incarnations: Array) -> Array:
        """The slot of each id the cache may serve (-1: ask it): held, read from the shard's current
        incarnation, and at most `staleness` versions behind it; those are marked most recently used."""
        got = self.slots.get
        slots = np.fromiter((got(i, -1) for i in ids.tolist()), dtype=np.int64, count=ids.size)
        held = np.flatnonzero(slots >= 0)
        s = slots[held]
        shard = self.shard[s]
        ok = (self.incarnation[s] == incarnations[shard]) & (versions[shard] <= self.read_at[s] + staleness)
        slots[held[~ok]] = -1
        for i in ids[slots >= 0].tolist():
            self.slots.move_to_end(i)
        return slots

    def store(self, rows: SparseRows, versions: Array, incarnations: Array) -> Array:
        """Keep rows just served (an expired row's slot reused), evicting the least recently used; their slots."""
        slots = np.empty(rows.indices.size, dtype=np.int64)
        if not rows.indices.size:
            return slots
        for k, i in enumerate(rows.indices.tolist()):
            slot = self.slots.pop(i, None)
            if slot is None:
                slot = self._free.pop() if self._free else self.slots.popitem(last=False)[1]
            self.slots[i] = slot
            slots[k] = slot
        shards = self.shards_of(rows.indices)
        self.values[slots] = rows.values
        self.clocks[slots] = rows.clocks if rows.clocks is not None else 0
        self.read_at[slots] = versions[shards]
        self.incarnation[slots] = incarnations[shards]
        self.shard[slots] = shards
        return slots

    def take(self, ids: IndexArray, slots: Array) -> SparseRows:
        """The rows of `ids` held in `slots`, with the clocks they were read at."""
        return SparseRows(ids, self.values[slots], self.clocks[slots])


class RowCache:
    """The rows a worker read of every table read by rows, served again within `staleness` versions."""

    def __init__(self, staleness: int, tables: Mapping[str, tuple[Sequence[Part], tuple[int, ...], np.dtype]],
                 max_rows: Mapping[str, int]) -> None:
        if staleness < 1:
            raise ValueError(f"a row cache serves rows at most S >= 1 versions behind, got S={staleness}")
        self.staleness = staleness
        self._tables = {name: _TableRows(parts, shape, dtype, max_rows[name])
                        for name, (parts, shape, dtype) in tables.items()}
        self.counts = RowCacheCounts()
        self._slots: dict[str, Array] = {}  # per table: the slots of the ids last asked (-1: asked of the shards)

    def to_ask(self, rows: Mapping[str, IndexArray], versions: Sequence[int],
               incarnations: Sequence[int]) -> dict[str, IndexArray]:
        """The ids of `rows` the shards must serve (missing or expired), the others counted as hits."""
        v, inc = np.asarray(versions, dtype=np.int64), np.asarray(incarnations, dtype=np.int64)
        ask: dict[str, IndexArray] = {}
        self._slots = {}
        for name, ids in rows.items():
            table = self._tables.get(name)
            if table is None:
                ask[name] = ids
                continue
            slots = self._slots[name] = table.fresh(ids, self.staleness, v, inc)
            hits = slots >= 0
            ask[name] = ids[~hits]
            served = int(hits.sum())
            self.counts.rows += ids.size
            self.counts.hits += served
            self.counts.bytes_saved += served * table.row_bytes
        return ask

    def complete(self, rows: Mapping[str, IndexArray], served: Mapping[str, SparseRows], versions: Sequence[int],
                 incarnations: Sequence[int]) -> dict[str, SparseRows]:
        """The rows of `rows` (as to_ask split them): those `served` by the shards at `versions` kept, the
        others from the cache."""
        v, inc = np.asarray(versions, dtype=np.int64), np.asarray(incarnations, dtype=np.int64)
        out: dict[str, SparseRows] = {}
        for name, ids in rows.items():
            table = self._tables.get(name)
            if table is None:
                out[name] = served[name]
                continue
            slots = self._slots[name]
            slots[slots < 0] = table.store(served[name], v, inc)
            out[name] = table.take(ids, slots)
        return out


__all__ = ["ROW_OVERHEAD_BYTES", "RowCache", "RowCacheCounts"]
