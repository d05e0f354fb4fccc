"""A staleness policy's state: per variable, row by row, and the values each worker read.

DC-ASGD-a keeps a running mean square and gap-aware a previous value and a step estimate, each
element by element. With sparse gradients a push touches some rows only: each row's state must
follow that row's own history, so the state is held at the variable's full shape and the policy
sees exactly the rows it corrects. A row the policy never saw has no state: the policy's "first
call" rule applies to it, whatever other rows have. Rows are grouped by which state keys they
have, and the policy is called once per group (one group, and no copy, in the usual dense case).

Not thread-safe: the store calls RowState with the variable's lock held, ReadValues with the
state lock held.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from asyncps.errors import InvalidArgumentError
from asyncps.rules.policies import StalenessPolicy
from asyncps.wire.codec import Array, Gradient

# In a snapshot, beside each state array KEY: KEY + ROWS_SUFFIX, int32 [rows], 1 where a row has it.
ROWS_SUFFIX = "@rows"


class RowState:
    """The policy state of one variable of shape `shape` (rank >= 1), per row."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self._shape = shape
        self._arrays: dict[str, Array] = {}
        self._has: dict[str, npt.NDArray[np.bool_]] = {}  # key -> which rows hold it

    def adjust(self, policy: StalenessPolicy, name: str, rows: npt.NDArray[np.int64] | None, grad: Array,
               value_now: Array, value_read: Array) -> Array:
        """The policy's correction of `grad` for `rows` (None: every row, a dense gradient);
        grad, value_now and value_read hold exactly those rows, each row at most once."""
        keys = sorted(self._arrays)
        if rows is None and all(self._has[k].all() or not self._has[k].any() for k in keys):
            # dense, every row with the same keys: hand over the full arrays (the policy replaces
            # entries, never writes into them)
            state = {k: self._arrays[k] for k in keys if self._has[k].all()}
            adjusted = policy.adjust(name, grad, value_now, value_read, state)
            self._store_all(state, keys)
            return adjusted
        index = np.arange(self._shape[0]) if rows is None else rows
        if keys:
            pattern = np.stack([self._has[k][index] for k in keys], axis=1)
            groups, which = np.unique(pattern, axis=0, return_inverse=True)
            which = which.reshape(-1)
        else:
            groups, which = np.zeros((1, 0), dtype=bool), np.zeros(len(index), dtype=np.int64)
        adjusted = np.empty(grad.shape, dtype=grad.dtype)
        for g, present in enumerate(groups):
            sel = np.flatnonzero(which == g)
            sub = index[sel]
            held = [k for k, has in zip(keys, present, strict=True) if has]
            state = {k: self._arrays[k][sub] for k in held}
            adjusted[sel] = policy.adjust(name, grad[sel], value_now[sel], value_read[sel], state)
            self._store_rows(state, held, sub)
        return adjusted

    def _store_all(self, state: dict[str, Array], held: list[str]) -> None:
        for key in held:
            if key not in state:
                self._has[key][:] = False
        for key, array in state.items():
            self._arrays[key] = array
            self._has[key] = np.ones(self._shape[0], dtype=bool)

    def _store_rows(self, state: dict[str, Array], held: list[str], rows: npt.NDArray[np.int64]) -> None:
        for key in held:
            if key not in state:
                self._has[key][rows] = False
        for key, array in state.items():
            if key not in self._arrays:
                self._arrays[key] = np.zeros(self._shape, dtype=array.dtype)
                self._has[key] = np.zeros(self._shape[0], dtype=bool)
            self._arrays[key][rows] = array
            self._has[key][rows] = True

    def export(self) -> dict[str, Array]:
        """Copies of the state arrays and their row masks (for a snapshot)."""
        out: dict[str, Array] = {}
        for key, array in self._arrays.items():
            out[key] = array.copy()
            out[key + ROWS_SUFFIX] = self._has[key].astype(np.int32)
        return out

    @classmethod
    def load(cls, name: str, shape: tuple[int, ...], arrays: dict[str, Array]) -> RowState:
        """Rebuild from `export`'s arrays, checking every shape and value (InvalidArgumentError)."""
        state = cls(shape)
        keys = {k for k in arrays if not k.endswith(ROWS_SUFFIX)}
        if {k + ROWS_SUFFIX for k in keys} != set(arrays) - keys:
            raise InvalidArgumentError(f"{name}: policy state needs KEY and KEY{ROWS_SUFFIX} for every key, "
                                       f"got {sorted(arrays)}")
        for key in sorted(keys):
            array, has = arrays[key], arrays[key + ROWS_SUFFIX]
            if array.shape != shape or not _finite_float(array):
                raise InvalidArgumentError(f"{name}: policy state {key!r} must be finite floats of shape {list(shape)}")
            if has.shape != shape[:1] or not np.isin(has, (0, 1)).all():
                raise InvalidArgumentError(f"{name}: policy state {key + ROWS_SUFFIX!r} must be 0/1 of shape "
                                           f"{list(shape[:1])}")
            state._arrays[key] = np.array(array, copy=True)
            state._has[key] = has.astype(bool)
        return state


class ReadValues:
    """The values each worker read, by version, kept for policies that correct a gradient with the
    values it was computed from (DC-ASGD, gap-aware). The arrays are the shard's read-only shared ones;
a part read by rows is kept as the rows served (SparseRows).

    A pipelined worker (--pipeline) pushes a gradient computed from the values one exchange older
    than its last read: a push is corrected against the values of its own base version, so the
    last KEEP reads of each worker are kept (two cover a pipeline of depth one).
    """

    KEEP = 2

    def __init__(self) -> None:
        self._by_worker: dict[str, dict[int, dict[str, Gradient]]] = {}

    def keep(self, worker_id: str, version: int, values: dict[str, Gradient]) -> None:
        """Remember that worker_id read `values` at `version` (forgetting its oldest read beyond KEEP)."""
        reads = self._by_worker.setdefault(worker_id, {})
        reads[version] = values
        while len(reads) > self.KEEP:
            del reads[min(reads)]

    def get(self, worker_id: str, version: int) -> dict[str, Gradient] | None:
        """The values worker_id read at `version`; if it kept no read of that version, its latest
        read (None: nothing yet)."""
        reads = self._by_worker.get(worker_id)
        if not reads:
            return None
        found = reads.get(version)
        return found if found is not None else reads[max(reads)]


def _finite_float(array: Array) -> bool:
    dtype: np.dtype[Any] = array.dtype
    return bool(np.issubdtype(dtype, np.floating) and np.isfinite(array).all())


__all__ = ["ROWS_SUFFIX", "ReadValues", "RowState"]
