"""The whole model over all shards: pulls into full-size buffers, splits and pushes gradients.

Works over any ShardTransport; which one is decided by the caller (asyncps.transport.connect).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from asyncps.errors import InvalidArgumentError, NonFiniteGradientError
from asyncps.placement import Part, Placement, key_parts
from asyncps.rules.drops import DropReason
from asyncps.rules.sync.client import WorkerStep, coordinated_step
from asyncps.transport.base import ModelBuffers, ShardTransport
from asyncps.transport.rowcache import RowCache
from asyncps.wire.codec import Array, Gradient, IndexArray, SparseRows, aligned_zeros
from asyncps.wire.shard import PushOutcome, PushRequest, ShardValues

T = TypeVar("T")


@dataclass(frozen=True)
class ShardPush:
    """One step's exchange with one shard: the push's outcome (None when the step touched
    nothing on that shard, so nothing was pushed), the version received and the time held."""

    shard: int
    outcome: PushOutcome | None
    version: int
    waited_s: float = 0.0


class _NamingRows:
    """A shard's transport whose pulls always name its parts of the tables read by rows (no ids unless
    the caller asks some), so such a part never comes whole, whoever calls (the sync protocol too)."""

    def __init__(self, shard: ShardTransport, parts: Sequence[str]) -> None:
        self._shard = shard
        self._none = {name: np.zeros(0, dtype=np.int64) for name in parts}

    def __getattr__(self, name: str) -> object:
        return getattr(self._shard, name)

    def pull(self, worker_id: str, if_newer_than: int = -1, buffers: Mapping[str, Array] | None = None,
             wait_timeout_s: float = 0.0, rows: Mapping[str, IndexArray] | None = None) -> ShardValues:
        """The shard's pull, naming every table part."""
        return self._shard.pull(worker_id, if_newer_than, buffers, wait_timeout_s, {**self._none, **(rows or {})})

    def push_pull(self, request: PushRequest, pull_if_newer_than: int = -1,
                  buffers: Mapping[str, Array] | None = None, read_wait_s: float = 0.0,
                  rows: Mapping[str, IndexArray] | None = None) -> tuple[PushOutcome, ShardValues]:
        """The shard's push_pull, naming every table part."""
        return self._shard.push_pull(request, pull_if_newer_than, buffers, read_wait_s,
                                     {**self._none, **(rows or {})})


class ModelClient:
    """The whole model over all shards.

    Received parts are written straight into views of the full variable buffers (an axis-0 slice
    of a C-contiguous array is contiguous), so reassembling a sliced variable costs no copy.

    Tables read by rows (`row_variables`) have no buffer: a pull or a push-pull given `rows` (ids of the
    whole table, sorted and distinct) fetches exactly those rows from the shards that hold them, into
    `rows` (SparseRows of the whole table's ids, with the clocks they were read at); such a table is
    never pulled whole. With a `row_cache`, only the rows it cannot serve are asked
    (asyncps.transport.rowcache).
    """

    def __init__(self, worker_id: str, shards: Sequence[ShardTransport], placement: Placement,
                 worker_index: int | None = None, coordinated: bool = False,
                 buffers: ModelBuffers | None = None, row_variables: Collection[str] = ()) -> None:
        if len(shards) != placement.num_shards:
            raise ValueError(f"{len(shards)} shard transports for a placement over {placement.num_shards}")
        self.worker_id = worker_id
        self.worker_index = worker_index  # sent with every push when known (staleness policies see it)
        self.placement = placement
        self.row_variables = frozenset(row_variables)
        unknown = sorted(self.row_variables - {v.name for v in placement.variables})
        if unknown:
            raise ValueError(f"tables {unknown} are not variables of the placement")
        # each part's place among its variable's parts (a keyed table's key_parts)
        self._part_index = {p.name: i for v in placement.variables for i, p in enumerate(placement.parts_of(v.name))}
        self._row_parts: list[list[Part]] = [[p for p in placement.parts_on(s) if p.variable in self.row_variables]
                                             for s in range(len(shards))]
        self.shards: list[ShardTransport] = [
            _NamingRows(shard, [p.name for p in parts]) if parts else shard  # type: ignore[misc]
            for shard, parts in zip(shards, self._row_parts, strict=True)]
        self.rows: dict[str, SparseRows] = {}  # the rows last read, by table
        self.row_cache: RowCache | None = None  # set by use_row_cache
        # aligned, so that TensorFlow computes from them in place (asyncps.worker.trainer.make_grad_fn); in
        # the transport's buffers when it provided some (shm's arena, where the shards write them)
        self._buffers = buffers
        self.values: dict[str, Array] = {
            v.name: buffers.array(tuple(v.shape), np.dtype(v.dtype)) if buffers is not None
            else aligned_zeros(tuple(v.shape), v.dtype) for v in placement.variables
            if v.name not in self.row_variables
        }
        self.versions = [-1] * placement.num_shards
        self.incarnations = [0] * placement.num_shards
        self._views: list[dict[str, Array]] = [{} for _ in shards]
        self._whole: list[dict[str, str]] = [{} for _ in shards]  # per shard: part name -> its whole variable
        for part in placement.parts:
            if part.variable in self.row_variables:
                continue
            full = self.values[part.variable]
            self._views[part.shard][part.name] = full[part.rows()] if part.sliced else full
            if not part.sliced:
                self._whole[part.shard][part.name] = part.variable
        self._pool = ThreadPoolExecutor(max_workers=len(shards), thread_name_prefix="shard")
        # sync over several shards: shard 0 decides each step for all (asyncps.rules.sync)
        self.coordinated = coordinated

    def use_row_cache(self, staleness: int, max_rows: Mapping[str, int]) -> RowCache:
        """Serve the tables' rows from a cache while within `staleness` versions of their shard (at most
        `max_rows` rows per table, by name)."""
        tables = {name: (self.placement.parts_of(name), tuple(v.shape[1:]), np.dtype(v.dtype))
                  for v in self.placement.variables if (name := v.name) in self.row_variables}
        self.row_cache = RowCache(staleness, tables, max_rows)
        return self.row_cache

    def _on_all(self, fn: Callable[[int], T]) -> list[T]:
        """fn(shard) for every shard at once: shard 0 in the calling thread (one thread hand-off fewer per
        step), the others in the pool; the results in shard order, the first error raised."""
        if len(self.shards) == 1:
            return [fn(0)]
        others = [self._pool.submit(fn, shard) for shard in range(1, len(self.shards))]
        try:
            first = fn(0)
        except BaseException:
            for future in others:
                future.cancel()
            raise
        return [first, *(future.result() for future in others)]

    def _accept(self, shard: int, reply: ShardValues) -> None:
        self.versions[shard] = reply.version
        self.incarnations[shard] = reply.incarnation
        if reply.values is None:
            return
        views = self._views[shard]
        if set(reply.values) != set(views):
            raise InvalidArgumentError(
                f"shard {shard} holds {sorted(reply.values)}, placement expects {sorted(views)}")
        for name, value in reply.values.items():
            if value is not views[name]:  # not received in place: shapes differ or a first pull
                np.copyto(views[name], value)
        if reply.lent is not None:
            self._adopt(shard, reply.lent)

    def _adopt(self, shard: int, lent: Mapping[str, Array]) -> None:
        """Take the arrays a path lends (shared memory's value regions) as the buffers of this shard's
        whole variables, so the values are written once, by the shard, and computed from where they
        land. Called right after a reply's values were received, when both hold the same values; a
        sliced variable keeps its own buffer (its rows come from several shards). A lent array is
        only written during this client's own exchanges, never while a gradient is computed from it."""
        views = self._views[shard]
        for name, variable in self._whole[shard].items():
            array = lent.get(name)
            current = views[name]
            if array is None or array is current or array.shape != current.shape or array.dtype != current.dtype:
                continue
            views[name] = array
            self.values[variable] = array

    def pull(self, only_if_newer: bool = False, rows: Mapping[str, IndexArray] | None = None) -> list[int]:
        """Refresh every variable from every shard (the tables: the `rows` asked, into self.rows); return
        the version vector."""
        wanted = rows
        rows = self._to_ask(rows)
        asked = self._rows_by_shard(rows)

        def one(shard: int) -> ShardValues:
            since = self.versions[shard] if only_if_newer else -1
            reply = self.shards[shard].pull(self.worker_id, since, self._views[shard], rows=asked[shard])
            self._accept(shard, reply)
            return reply

        self._take_rows(rows, self._on_all(one))
        self._from_cache(wanted)
        return list(self.versions)

    def _to_ask(self, rows: Mapping[str, IndexArray] | None) -> Mapping[str, IndexArray] | None:
        """The rows the shards must serve: all of `rows`, or the row cache's misses."""
        if rows is None or self.row_cache is None:
            return rows
        return self.row_cache.to_ask(rows, self.versions, self.incarnations)

    def _from_cache(self, wanted: Mapping[str, IndexArray] | None) -> None:
        """With a row cache: the rows just served kept in it, and self.rows every row `wanted`."""
        if wanted is not None and self.row_cache is not None:
            self.rows = self.row_cache.complete(wanted, self.rows, self.versions, self.incarnations)

    def _rows_by_shard(self, rows: Mapping[str, IndexArray] | None) -> list[dict[str, IndexArray] | None]:
        """Ids of whole tables as ids of each shard's parts (None for a shard holding no table part)."""
        out: list[dict[str, IndexArray] | None] = []
        for parts in self._row_parts:
            if not parts:
                out.append(None)
                continue
            out.append({part.name: np.zeros(0, dtype=np.int64) for part in parts})
        for variable, ids in (rows or {}).items():
            for part, at in self.placement.row_parts(variable, ids):
                asked = out[part.shard]
                if asked is not None:
                    asked[part.name] = part.ids_of(ids[at])
        return out

    def _take_rows(self, rows: Mapping[str, IndexArray] | None, replies: Sequence[ShardValues]) -> None:
        """Join the rows each shard served into rows of the whole tables (self.rows)."""
        if rows is None:
            return
        for variable, ids in rows.items():
            got = [(at, reply[part.name]) for part, at in self.placement.row_parts(variable, ids)
                   if (reply := replies[part.shard].rows) is not None and part.name in reply]
            if sum(r.indices.size for _, r in got) != ids.size or any(r.indices.size != at.size for at, r in got):
                raise InvalidArgumentError(f"{variable}: the shards served {sum(r.indices.size for _, r in got)} "
                                           f"rows for {ids.size} asked")
            if not got:
                self.rows[variable] = SparseRows(np.asarray(ids, dtype=np.int64), np.zeros((0,)), np.zeros(0, np.int64))
                continue
            first = got[0][1].values
            values = np.empty((ids.size, *first.shape[1:]), dtype=first.dtype)
            clocks = np.zeros(ids.size, dtype=np.int64)
            for at, served in got:
                values[at] = served.values
                if served.clocks is not None:
                    clocks[at] = served.clocks
            self.rows[variable] = SparseRows(np.asarray(ids, dtype=np.int64), values, clocks)

    def split(self, grads: Mapping[str, Gradient]) -> list[dict[str, Gradient]]:
        """Cut full-variable gradients into per-shard dicts of parts."""
        per_shard: list[dict[str, Gradient]] = [{} for _ in self.shards]
        for part in self.placement.parts:
            grad = grads.get(part.variable)
            if grad is None:
                continue
            if not part.sliced:
                per_shard[part.shard][part.name] = grad
            elif isinstance(grad, SparseRows):
                if part.keyed:
                    mask = key_parts(grad.indices, self.placement.num_shards) == self._part_index[part.name]
                else:
                    mask = (grad.indices >= part.row_start) & (grad.indices < part.row_stop)
                if mask.any():
                    per_shard[part.shard][part.name] = SparseRows(
                        part.ids_of(grad.indices[mask]), grad.values[mask],
                        None if grad.clocks is None else grad.clocks[mask])
            else:
                per_shard[part.shard][part.name] = grad[part.rows()]
        return per_shard

    def push_pull(
        self, grads: Mapping[str, Gradient], step: int, loss: float, read_wait_s: float = 0.0,
        base: Sequence[int] | None = None, incarnations: Sequence[int] | None = None,
        rows: Mapping[str, IndexArray] | None = None,
    ) -> list[ShardPush]:
        """Push one step's gradient to every shard with the versions (and incarnations) it was
        computed from — by default the ones last received — and receive the new values in the
        same round trip (with the tables' `rows` asked, for the next step: into self.rows)."""
        per_shard = self.split(grads)
        base = list(self.versions if base is None else base)
        incarnations = list(self.incarnations if incarnations is None else incarnations)
        if self.coordinated and len(self.shards) > 1:
            return self._coordinated_step(per_shard, step, loss, read_wait_s, base, incarnations)
        wanted = rows
        rows = self._to_ask(rows)
        asked = self._rows_by_shard(rows)
        replies: list[ShardValues | None] = [None] * len(self.shards)

        def one(shard: int) -> ShardPush:
            if not per_shard[shard]:  # nothing of this shard was touched (sparse-only models)
                reply = self.shards[shard].pull(self.worker_id, base[shard], self._views[shard], rows=asked[shard])
                self._accept(shard, reply)
                replies[shard] = reply
                return ShardPush(shard, None, reply.version)
            request = PushRequest(self.worker_id, base[shard], per_shard[shard], step, loss, incarnations[shard],
                                  worker_index=self.worker_index)
            try:
                outcome, reply = self.shards[shard].push_pull(request, -1, self._views[shard], read_wait_s,
                                                              rows=asked[shard])
            except NonFiniteGradientError as exc:
                # the shard refused a NaN/Inf gradient: a dropped push of this step, not the end of the worker
                return ShardPush(shard, PushOutcome(False, 0, base[shard], 0.0, DropReason.NONFINITE, exc.detail),
                                 base[shard])
            self._accept(shard, reply)
            replies[shard] = reply
            return ShardPush(shard, outcome, reply.version, reply.waited_s)

        pushed = self._on_all(one)
        if rows is not None and all(r is not None for r in replies):
            self._take_rows(rows, [r for r in replies if r is not None])
            self._from_cache(wanted)
        else:
            self.rows = {}  # a refused push: the next step reads its rows again
        return pushed

    def _coordinated_step(
        self, per_shard: list[dict[str, Gradient]], step: int, loss: float, read_wait_s: float,
        base: list[int], incarnations: list[int],
    ) -> list[ShardPush]:
        """One step decided by shard 0 for every shard (asyncps.rules.sync.client)."""
        work = WorkerStep(self.worker_id, per_shard, step, loss, base, incarnations, self.worker_index)
        done = coordinated_step(work, self.shards, self._views, read_wait_s, self._accept, self._pool.map)
        return [ShardPush(d.shard, d.outcome, d.version, d.waited_s) for d in done]

    def close(self) -> None:
        """Close every transport and the thread pool."""
        self._pool.shutdown(wait=False)
        for shard in self.shards:
            shard.close()
        if self._buffers is not None:
            self._buffers.close()


__all__ = ["ModelClient", "ShardPush"]
