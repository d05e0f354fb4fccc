"""Tables made where they are stored: a row initializer evaluated per row on the shard.

A table too large for one process (an embedding of 10M rows) is never materialized whole: the chief
sends each shard only a description of its part (`TableSpec`: the part's shape, dtype, first row in
the whole table, and a `RowInit`), and the shard makes the rows itself, a bounded block at a time.
Every element is a function of (seed, row of the whole table, column) only, through a counter-based
hash (splitmix64), so a table's values do not depend on how many shards hold it, nor on the block
size: resharding or restoring onto another shard count makes the same values.

Spec strings (what the wire carries): `uniform:min=A,max=B,seed=S`, `normal:mean=M,stddev=S,seed=S`,
`truncated_normal:mean=M,stddev=S,seed=S` (redrawn beyond two standard deviations, as Keras'),
`constant:value=V`, `zeros`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from asyncps.placement import mix64 as _mix

#: What each kind of initializer takes, with its defaults (Keras' defaults for the same names).
KINDS: dict[str, dict[str, float]] = {
    "uniform": {"min": -0.05, "max": 0.05, "seed": 0},
    "normal": {"mean": 0.0, "stddev": 0.05, "seed": 0},
    "truncated_normal": {"mean": 0.0, "stddev": 0.05, "seed": 0},
    "constant": {"value": 0.0},
    "zeros": {},
}

#: Rows made per block: bounds the temporary memory of making a table (the block's uint64 counters).
BLOCK_ELEMENTS = 1 << 22

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class RowInit:
    """A row initializer: its kind and parameters (see KINDS)."""

    kind: str
    params: tuple[tuple[str, float], ...] = ()

    @staticmethod
    def parse(spec: str) -> RowInit:
        """The initializer a spec string names; ValueError naming what is wrong."""
        name, _, rest = spec.strip().partition(":")
        if name not in KINDS:
            raise ValueError(f"unknown row initializer {name!r}: one of {', '.join(KINDS)}")
        params = dict(KINDS[name])
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq or key not in params:
                takes = ", ".join(sorted(params)) or "none"
                raise ValueError(f"row initializer {name}: unknown parameter {item!r} (takes {takes})")
            try:
                number = float(value)
            except ValueError:
                raise ValueError(f"row initializer {name}: {key}={value!r} is not a number") from None
            if not math.isfinite(number):
                raise ValueError(f"row initializer {name}: {key} must be finite")
            params[key] = number
        init = RowInit(name, tuple(sorted(params.items())))
        init._check()
        return init

    def _check(self) -> None:
        p = dict(self.params)
        if self.kind == "uniform" and not p["min"] <= p["max"]:
            raise ValueError(f"row initializer uniform: min {p['min']} > max {p['max']}")
        if self.kind in ("normal", "truncated_normal") and p["stddev"] < 0:
            raise ValueError(f"row initializer {self.kind}: stddev must be >= 0")
        if "seed" in p and (p["seed"] != int(p["seed"]) or p["seed"] < 0):
            raise ValueError(f"row initializer {self.kind}: seed must be a non-negative integer")

    @property
    def spec(self) -> str:
        """The canonical spec string."""
        if not self.params:
            return self.kind
        return self.kind + ":" + ",".join(f"{k}={_number(v)}" for k, v in self.params)

    def rows(self, start: int, stop: int, row_shape: tuple[int, ...], dtype: npt.DTypeLike) -> npt.NDArray[Any]:
        """Rows [start, stop) of the whole table, each of `row_shape`, in `dtype` (made block by block)."""
        width = int(np.prod(row_shape, dtype=np.int64))
        out = np.empty((stop - start, *row_shape), dtype=dtype)
        flat = out.reshape(stop - start, width)
        block = max(1, BLOCK_ELEMENTS // max(1, width))
        for first in range(start, stop, block):
            last = min(stop, first + block)
            flat[first - start:last - start] = self._block(np.arange(first, last, dtype=_U64), width)
        return out

    def rows_at(self, ids: npt.NDArray[np.int64], row_shape: tuple[int, ...], dtype: npt.DTypeLike) -> npt.NDArray[Any]:
        """The rows of ids `ids` (any int64: a keyed table's keys), each of `row_shape`, in `dtype`: row k is
        the same as `rows`' row k for k >= 0 (a negative id counts as its two's complement)."""
        width = int(np.prod(row_shape, dtype=np.int64))
        out = np.empty((ids.size, *row_shape), dtype=dtype)
        flat = out.reshape(ids.size, width)
        block = max(1, BLOCK_ELEMENTS // max(1, width))
        counters = np.asarray(ids, dtype=np.int64).view(_U64)
        for first in range(0, ids.size, block):
            flat[first:first + block] = self._block(counters[first:first + block], width)
        return out

    def _block(self, rows: npt.NDArray[np.uint64], width: int) -> npt.NDArray[np.float64]:
        p = dict(self.params)
        shape = (rows.size, width)
        if self.kind == "zeros":
            return np.zeros(shape)
        if self.kind == "constant":
            return np.full(shape, p["value"])
        with np.errstate(over="ignore"):
            counters = rows[:, None] * _U64(max(1, width)) + np.arange(width, dtype=_U64)[None, :]
        seed = int(p["seed"])
        if self.kind == "uniform":
            return p["min"] + (p["max"] - p["min"]) * _uniform(seed, counters, 0)
        normal = _normal(seed, counters, 0)
        if self.kind == "truncated_normal":
            for attempt in range(1, 64):  # redraw beyond 2 stddev, as Keras' TruncatedNormal
                outside = np.abs(normal) > 2.0
                if not outside.any():
                    break
                normal[outside] = _normal(seed, counters[outside], attempt)
            np.clip(normal, -2.0, 2.0, out=normal)
        return p["mean"] + p["stddev"] * normal


@dataclass(frozen=True)
class TableSpec:
    """One part of a table a shard makes itself: its shape and dtype, the row of the whole table its
    first row is, and the initializer.

    A keyed part (`keyed`) holds rows by int64 key instead of by position: `shape[0]` is the most rows it
    keeps (its bound), a row is made from the initializer (at its key) when a push first names it, and
    the least recently pushed row gives up its place when the part is full (ps/store.py)."""

    shape: tuple[int, ...]
    dtype: str
    row_start: int
    init: RowInit
    keyed: bool = False

    def make(self) -> npt.NDArray[Any]:
        """The part's values."""
        if not self.shape:
            raise ValueError("a generated table has at least one dimension (its rows)")
        if self.row_start < 0 or min(self.shape) < 0:
            raise ValueError(f"a generated table's shape {list(self.shape)} and first row {self.row_start} "
                             "must be >= 0")
        if not np.issubdtype(np.dtype(self.dtype), np.floating):
            raise ValueError(f"a generated table is floating point, not {self.dtype}")
        if self.keyed:  # no row yet: each is made at its key when a push first names it (zeros: pages unmade)
            return np.zeros(self.shape, dtype=self.dtype)
        return self.init.rows(self.row_start, self.row_start + self.shape[0], self.shape[1:], self.dtype)


def _number(value: float) -> str:
    return str(int(value)) if value == int(value) else repr(value)


def _uniform(seed: int, counters: npt.NDArray[np.uint64], stream: int) -> npt.NDArray[np.float64]:
    """Uniform [0, 1) per counter, for `seed` and a stream number (53 bits of one hash each)."""
    key = _mix(np.array([seed * 0x10001 + stream], dtype=_U64))[0]
    with np.errstate(over="ignore"):
        bits = _mix(counters * _GOLDEN + key)
    return (bits >> _U64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _normal(seed: int, counters: npt.NDArray[np.uint64], attempt: int) -> npt.NDArray[np.float64]:
    """Standard normal per counter (Box-Muller over two independent uniforms)."""
    u1 = 1.0 - _uniform(seed, counters, 2 * attempt + 1)  # (0, 1]: log is finite
    u2 = _uniform(seed, counters, 2 * attempt + 2)
    normal: npt.NDArray[np.float64] = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
    return normal


__all__ = ["BLOCK_ELEMENTS", "KINDS", "RowInit", "TableSpec"]
