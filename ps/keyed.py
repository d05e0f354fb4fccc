"""The rows of a keyed part: which int64 key each of its places holds, and which to give up when full.

A keyed table (asyncps.HashEmbedding: hashed user or item ids of any value) is stored on each shard as a
part of `bound` places (rows of the part's arrays, optimizer slots and row clocks alike). Keys are
translated to places where a request enters the store, so everything after (optimizers, clocks, per-row
staleness) works on places as it works on a positional table's rows:

- a read of a key with no place is served the initializer's row at that key (and clock 0) and makes
  nothing: a row is made by the first push that names it, never by a read;
- a push naming keys with no place gives each a free place, else the place of the least recently
  pushed key the push does not name (evicted: a later read of it gets the initializer's row again);
  the new row starts as the initializer's at its key, its optimizer slots fresh and its clock 0;
- a push naming more distinct keys than the part's bound is refused (ResourceExhaustedError) and
  changes nothing.

Snapshots carry each place's key and the tick of its last push (-1: free) as two per-row arrays
("keyed.keys", "keyed.touched") beside the policy state, so checkpoints store and split them by rows
like any per-row state; keys are routed to shards by a hash of the key and the shard count
(asyncps.placement.key_parts), so a keyed table restores onto the same shard count only.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from asyncps.errors import InvalidArgumentError, ResourceExhaustedError

#: The per-row arrays a keyed part's snapshot carries beside its policy state.
KEYS, TOUCHED = "keyed.keys", "keyed.touched"


class KeyedRows:
    """Key -> place of one keyed part of `bound` places, with each place's last push (LRU)."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._place: dict[int, int] = {}
        self.keys = np.zeros(bound, dtype=np.int64)
        self.touched = np.full(bound, -1, dtype=np.int64)  # the tick of each place's last push; -1: free
        self._free = list(range(bound - 1, -1, -1))  # a stack: places are taken lowest first
        self._tick = 0

    def __len__(self) -> int:
        return len(self._place)

    def find(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The place of each key, -1 for a key that has none (changes nothing)."""
        get = self._place.get
        return np.fromiter((get(k, -1) for k in keys.tolist()), dtype=np.int64, count=keys.size)

    def check_push(self, name: str, keys: npt.NDArray[np.int64]) -> None:
        """ResourceExhaustedError when a push naming `keys` cannot be given places (before any change)."""
        distinct = np.unique(keys)
        if distinct.size > self.bound:
            raise ResourceExhaustedError(f"{name}: a push names {distinct.size} distinct keys, more than the "
                                         f"{self.bound} rows this shard keeps of the table")

    def places_for_push(self, keys: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64],
                                                                     npt.NDArray[np.int64]]:
        """The place of each key of a push (check_push passed), making places for new keys: (places per key,
        the new places, their keys). The push's keys become the most recently pushed."""
        distinct, inverse = np.unique(keys, return_inverse=True)
        places = self.find(distinct)
        new = places < 0
        new_keys = distinct[new]
        shortfall = new_keys.size - len(self._free)
        if shortfall > 0:
            self._evict(shortfall, places[~new])
        made = np.array([self._free.pop() for _ in range(new_keys.size)], dtype=np.int64)
        for key, place in zip(new_keys.tolist(), made.tolist(), strict=True):
            self._place[key] = place
        self.keys[made] = new_keys
        places[new] = made
        self._tick += 1
        self.touched[places] = self._tick
        out: npt.NDArray[np.int64] = places[inverse.reshape(-1)]
        return out, made, new_keys

    def _evict(self, count: int, keep: npt.NDArray[np.int64]) -> None:
        """Free the `count` least recently pushed places outside `keep`."""
        ages = self.touched.copy()
        ages[keep] = -1
        used = np.flatnonzero(ages >= 0)
        oldest = used[np.argsort(ages[used], kind="stable")[:count]]
        for place in oldest.tolist():
            del self._place[int(self.keys[place])]
            self.touched[place] = -1
            self._free.append(place)

    def export(self) -> dict[str, npt.NDArray[np.int64]]:
        """The per-row arrays of a snapshot (copies)."""
        return {KEYS: self.keys.copy(), TOUCHED: self.touched.copy()}

    @staticmethod
    def load(name: str, bound: int, state: Mapping[str, npt.NDArray[np.int64]]) -> KeyedRows:
        """The rows a snapshot's arrays describe; InvalidArgumentError when they are not a keyed part's."""
        rows = KeyedRows(bound)
        if set(state) != {KEYS, TOUCHED}:
            raise InvalidArgumentError(f"{name}: a keyed part's snapshot needs {KEYS} and {TOUCHED}, got "
                                       f"{sorted(state)}")
        keys, touched = state[KEYS], state[TOUCHED]
        for label, array in ((KEYS, keys), (TOUCHED, touched)):
            if array.dtype != np.int64 or array.shape != (bound,):
                raise InvalidArgumentError(f"{name}: {label} must be int64 [{bound}], got {array.dtype} "
                                           f"{list(array.shape)}")
        if touched.size and touched.min() < -1:
            raise InvalidArgumentError(f"{name}: {TOUCHED} must be >= -1")
        used = np.flatnonzero(touched >= 0)
        if np.unique(keys[used]).size != used.size:
            raise InvalidArgumentError(f"{name}: a key held by two rows")
        rows.keys[...] = keys
        rows.touched[...] = touched
        rows._place = dict(zip(keys[used].tolist(), used.tolist(), strict=True))
        rows._free = sorted(np.flatnonzero(touched < 0).tolist(), reverse=True)
        rows._tick = int(touched.max(initial=0))
        return rows


__all__ = ["KEYS", "TOUCHED", "KeyedRows"]
