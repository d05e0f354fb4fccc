"""Checkpointing of the run over the shards: initialize, adopt or restore them at start, recover
a restarted shard, and take checkpoints at a consistent cut (asyncps.chief.cut).

A chief that starts on a run it resumes (a restarted chief) keeps the live shards when they hold
this run's state at or past the latest checkpoint, and restores the checkpoint into all of them
otherwise. It never trains on another run's shards, and never silently re-initializes a shard
that lost its state when there is no checkpoint to restore (unless the run allows it).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncps.chief.checkpoint import CheckpointDir
from asyncps.chief.config import ChiefConfig
from asyncps.chief.cut import CutLapsed, at_cut
from asyncps.chief.membership import Membership
from asyncps.chief.progress import Progress
from asyncps.chief.tasks import TaskLedger

from asyncps.ml.userfns import user_path_from_env
from asyncps.rules import UpdateRuleConfig
from asyncps.rundir import RestoreRow, RowWriter, RunDir
from asyncps.wire.codec import Array

if TYPE_CHECKING:
    from asyncps.chief.checkpoint import Checkpoint

    from asyncps.placement import Placement
    from asyncps.rules.initializers import RowInit, TableSpec
    from asyncps.transport import ModelClient, ShardTransport
    from asyncps.transport.base import InitResult, SnapshotStream
    from asyncps.wire.shard import Snapshot, StoreStats

log = logging.getLogger("asyncps.chief")

LIVE, RESTORED, INITIALIZED = "live", "restored", "initialized"


class ShardStateError(RuntimeError):
    """The shards' state cannot be used for this run (another run's, or lost with no checkpoint)."""


def generated_parts(placement: Placement, shard: int, tables: Mapping[str, RowInit]) -> dict[str, TableSpec]:
    """The parts of `tables` on `shard` as the shard makes them: each part's shape, dtype, its first row in
    the whole table (so its values are those rows of the whole table's, whatever the shard count) and
    the table's row initializer."""
    from asyncps.rules.initializers import TableSpec

    specs = {v.name: v for v in placement.variables}
    out = {}
    for part in placement.parts_on(shard):
        init = tables.get(part.variable)
        if init is not None:
            spec = specs[part.variable]
            shape = (part.row_stop - part.row_start, *spec.shape[1:]) if part.sliced else tuple(spec.shape)
            out[part.name] = TableSpec(shape, spec.dtype, part.row_start if part.sliced else 0, init, part.keyed)
    return out


class Checkpointer:
    """Pause/snapshot/restore orchestration between the shards and the checkpoint directory."""

    def __init__(self, config: ChiefConfig, client: ModelClient, placement: Placement,
                 initial_values: dict[str, Array], ledger: TaskLedger, membership: Membership,
                 progress: Progress, since: float, run_id: str = "",
                 tables: Mapping[str, RowInit] | None = None, state: Sequence[str] = ()) -> None:
        """`since`: the monotonic time the checkpoint schedule counts from (the chief's start);
        `run_id`: the run's id, given to the shards with their state; `tables`: the row initializer of
        each table the shards make themselves (no initial values for those); `state`: the parts that are
        non-trainable state (the shards add their deltas: UpdateRuleConfig.state)."""
        self._state = tuple(state)
        self._config = config
        self._run = config.run
        self._client = client
        self._placement = placement
        self._initial_values = initial_values
        self._tables = dict(tables or {})
        self._ledger = ledger
        self._membership = membership
        self._progress = progress
        self.checkpoints = CheckpointDir(config.checkpoints, config.run.keep_checkpoints)
        self.examples_offset = 0  # examples seen before the checkpoint this run resumed from
        self._number = 0
        self._last = (since, 0)  # (monotonic time, updates) of the last checkpoint
        self.run_id = run_id
        self.failed = 0  # checkpoints the storage refused (disk full, read-only): summary.json
        self._restores_lock = threading.Lock()  # restores.csv: shards start in parallel

    def rule(self) -> UpdateRuleConfig:
        """The run's update rule, naming the model's state parts."""
        return dataclasses.replace(self._run.update_rule(), state=self._state)

    def initialize_shards(self) -> None:
        """A new run: initialize every shard from the initial values (refused on another run's shards)."""
        self.start_shards(resuming=False)

    def start_shards(self, resuming: bool, reshard: bool = False) -> str:
        """Bring the shards to this run's state; return how: LIVE, RESTORED or INITIALIZED.

        A new run initializes them. A resumed run keeps them (LIVE) when every shard holds this
        run's state at or past the latest checkpoint's versions, and the shard layout is the one they
        hold (not `reshard`); otherwise it restores the latest
        checkpoint into all of them (and the ledger with it); with no checkpoint it initializes them
        only when the run allows re-initialization. Raises ShardStateError when a shard holds
        another run's state, or when there is nothing to resume from."""
        n = len(self._config.ps)
        stats = [shard.stats() for shard in self._client.shards]
        for i, st in enumerate(stats):
            if st.initialized and st.run_id != self.run_id and (resuming or st.run_id):
                raise ShardStateError(
                    f"shard {i} at {self._config.ps[i]} holds the state of another run "
                    f"({st.run_id or 'no run id'!r}, this run is {self.run_id!r}); refusing to train on it: "
                    f"restart that shard empty, or point the chief at that run's directory")
        ckpt = self.checkpoints.latest() if resuming or self._config.resume else None
        self._number = max(self._number, self.checkpoints.last_number())  # never overwrite older ones
        if resuming and not reshard and self._live(stats, ckpt):
            log.info("resuming on the live shards at versions %s", [st.version for st in stats])
            return LIVE
        if resuming and ckpt is None and not self._run.allow_reinit:
            raise ShardStateError(
                f"cannot resume: the shards ({', '.join(self._config.ps)}) do not hold this run's state and "
                f"there is no checkpoint in {self._config.checkpoints} (allow_reinit / --allow-reinit starts "
                "them from the initial values)")
        if ckpt is not None:
            self.examples_offset = int(ckpt.manifest.get("examples", 0))
            if "data_tasks" in ckpt.manifest:
                self._ledger.load(ckpt.manifest["data_tasks"])
        elif resuming:
            log.warning("cannot resume the shards' state and there is no checkpoint: re-initializing them "
                        "(allow_reinit)")
        with ThreadPoolExecutor(max_workers=n) as pool:
            # a resumed run's shards lose the pushes after the checkpoint (or all, re-initialized)
            list(pool.map(lambda shard: self._start_shard(shard, ckpt, record=resuming or ckpt is not None),
                          range(n)))
        return INITIALIZED if ckpt is None else RESTORED

    def _live(self, stats: list[StoreStats], ckpt: Checkpoint | None) -> bool:
        """Every shard holds this run's state, at or past the latest checkpoint's versions."""
        if not all(st.initialized and st.run_id == self.run_id for st in stats):
            return False
        if ckpt is None:
            return True
        versions: list[int] = ckpt.manifest["shard_versions"]
        if len(versions) != len(stats):
            return False
        behind = [(i, st.version, v) for i, (st, v) in enumerate(zip(stats, versions, strict=True)) if st.version < v]
        for shard, version, want in behind:
            log.warning("shard %d is at version %d, behind %s (%d): restoring the checkpoint", shard, version,
                        ckpt.path.name, want)
        return not behind

    def _start_shard(self, shard: int, ckpt: Checkpoint | None, record: bool = True) -> None:
        """Initialize a shard from the initial values, or restore it from a checkpoint; `record`: write
        the restore to restores.csv (the pushes the shard had after its new version are rolled back)."""
        client = self._client.shards[shard]
        if ckpt is None:
            values = self._initial_values
            part = {p.name: values[p.variable][p.rows()] if p.sliced else values[p.variable]
                    for p in self._placement.parts_on(shard) if p.variable not in self._tables}
            reply = client.initialize("chief", shard, len(self._config.ps), self.rule(), part,
                                      self.run_id, self._generated(shard))
            log.info("shard %d at %s: %s at version %d", shard, self._config.ps[shard],
                     "initialized" if reply.created else "already initialized", reply.version)
            if record and reply.created:
                self._record_restore(shard, reply.version, "", 0)
            return
        # the restore is recorded before it happens, with the incarnation it gives the state: a chief killed
        # between the two leaves a row for a restore that may not have happened (harmless: the shard is
        # still behind, and the next chief restores it again, recorded again), never a restore without one
        incarnation = secrets.randbits(62) + 1
        reply, _ = self._restore(shard, ckpt, incarnation,
                                 (lambda snap: self._record_restore(shard, snap.version, ckpt.path.name,
                                                                    snap.answers, incarnation)) if record else None)
        log.info("shard %d at %s: restored from %s at version %d", shard, self._config.ps[shard], ckpt.path.name,
                 reply.version)

    def _restore(self, shard: int, ckpt: Checkpoint, incarnation: int,
                 before: Callable[[Snapshot], None] | None) -> tuple[InitResult, Snapshot]:
        """Restore a shard's part of a checkpoint, giving the state `incarnation`: streamed from its tensor
        files a chunk at a time (the chief never holds a tensor), or, for a model.npz checkpoint, split from
        its arrays as before; `before(snapshot)` (its tensors aside) runs just before the restore is sent."""
        from asyncps.chief.checkpoint import part_slices, split, split_counters

        client = self._client.shards[shard]
        rule = self.rule()
        # keyed tables' parts (their keys ride as per-row state): a key's shard depends on the shard count
        keyed = {name: spec for name, spec in self._generated(shard).items() if spec.keyed}
        taken_over = len(ckpt.manifest["shard_versions"])
        if keyed and taken_over != self._placement.num_shards:
            tables = sorted({p.variable for p in self._placement.parts if p.keyed})
            raise ShardStateError(f"{ckpt.path.name} was taken over {taken_over} shards: its keyed tables {tables} "
                                  "restore onto as many shards only (a key's shard depends on the count)")
        if not ckpt.files:
            snap = dataclasses.replace(split(self._placement, ckpt, rule)[shard], run_id=self.run_id, keyed=keyed,
                                       incarnation=incarnation)
            if before is not None:
                before(snap)
            return client.restore(snap, shard), snap
        snap = dataclasses.replace(split_counters(self._placement, ckpt, rule)[shard], run_id=self.run_id,
                                   keyed=keyed, incarnation=incarnation)
        if before is not None:
            before(snap)
        chunk = self._run.chunk_bytes
        return client.restore_stream(snap, shard, lambda: part_slices(self._placement, ckpt, shard, chunk)), snap

    def _generated(self, shard: int) -> dict[str, TableSpec]:
        """The tables' parts on `shard` the shard makes itself."""
        return generated_parts(self._placement, shard, self._tables)

    def _record_restore(self, shard: int, version: int, checkpoint: str, answers: int,
                        incarnation: int | None = None) -> None:
        """Append the restore to restores.csv, with the incarnation it gives the shard's state (None: asked
        of the shard, a pull of nothing newer carries it) and the answers to pushes that state had given."""
        if incarnation is None:
            incarnation = self._client.shards[shard].pull("", 1 << 62).incarnation
        row = RestoreRow(time.time(), shard, version, incarnation, checkpoint, answers)
        path = RunDir(self._config.run_dir).restores
        with self._restores_lock:
            path.parent.mkdir(parents=True, exist_ok=True)
            with RowWriter(path, RestoreRow, append=True) as out:
                out.write(row)
        log.info("shard %d: pushes it applied after version %d are rolled back (restores.csv)", shard, version)

    def recover_shard(self, shard: int) -> None:
        """A shard came back empty (it crashed and restarted): restore its part of the latest checkpoint."""
        ckpt = self.checkpoints.latest()
        if ckpt is None:
            if not self._run.allow_reinit:
                raise ShardStateError(
                    f"shard {shard} at {self._config.ps[shard]} lost its state and there is no checkpoint to "
                    "restore it from; stopping (allow_reinit / --allow-reinit restarts it from the initial values)")
            log.warning("shard %d restarted and there is no checkpoint: it restarts from initial values "
                        "(allow_reinit)", shard)
        self._start_shard(shard, ckpt)

    def due(self, training: bool) -> bool:
        """Whether the schedule (every N updates or every S seconds) asks for a checkpoint now."""
        at, updates = self._last
        run = self._run
        by_updates = run.checkpoint_every_updates and self._progress.updates - updates >= run.checkpoint_every_updates
        by_time = run.checkpoint_every_s and time.monotonic() - at >= run.checkpoint_every_s
        return bool(by_updates or by_time) and training

    def checkpoint(self, examples_seen: Callable[[], int]) -> Path | None:
        """Take a consistent cut (asyncps.chief.cut) and write it atomically; return its path.

        Every shard holds pushes before any is snapshotted, and the data ledger, the worker steps
        and `examples_seen` (the examples the workers reported) are read before the release, so
        the manifest describes the same instant as the values: a task the ledger counts as done
        had every push of it applied before the cut (its worker reports it only after them).
        None (nothing written, logged) when the cut outlasted the shards' hold, or when the storage refused
        the write (disk full, read-only: logged, counted in `failed`, tried again at the next interval; the
        latest complete checkpoint stays the one a restart resumes from)."""
        t0 = time.monotonic()

        def records() -> tuple[int, dict[str, int], dict[str, Any]]:
            return examples_seen(), self._membership.worker_steps(), self._ledger.state()

        opened: list[SnapshotStream] = []

        def open_stream(_: int, shard: ShardTransport) -> SnapshotStream:
            opened.append(shard.snapshot_stream())
            return opened[-1]

        cut = None
        try:  # at the cut, each shard copies its state and sends its counters; its tensors stream after
            cut = at_cut(self._client.shards, open_stream, records, what="checkpoint")
        except CutLapsed as exc:
            log.error("checkpoint skipped: %s", exc)  # the next one is due again at once
            return None
        finally:
            if cut is None:  # a failed cut: no shard keeps its copy for a stream nobody reads
                for each in opened:
                    each.cancel()
        streams = cut.reads
        try:
            path = self._write(streams, cut.record)
        except OSError as exc:
            self.failed += 1
            self._last = (time.monotonic(), self._progress.updates)  # tried again at the next interval, not at once
            latest = self.checkpoints.complete()
            log.error("checkpoint %d not written: %s; training goes on, a restart resumes from %s; tried again at "
                      "the next interval (%d checkpoint(s) failed)", self._number, exc,
                      latest[-1].name if latest else "no checkpoint", self.failed)
            return None
        finally:
            for stream in streams:
                stream.cancel()
        self._last = (time.monotonic(), self._progress.updates)
        log.info("checkpoint %s at versions %s in %.3fs", path.name, [s.header.version for s in streams],
                 time.monotonic() - t0)
        return path

    def _write(self, streams: list[SnapshotStream], record: tuple[int, dict[str, int], dict[str, Any]]) -> Path:
        """The next checkpoint from the shards' streams (each shard's tensors written as they arrive, the
        shards at once) and the records of the cut."""
        from asyncps.chief.checkpoint import TensorWriter

        examples, worker_steps, data_tasks = record
        snaps = [stream.header for stream in streams]
        self._number += 1
        updates = {name: n for snap in snaps for name, n in snap.updates.items()}
        variable_updates: dict[str, int] = {}
        for part in self._placement.parts:
            variable_updates[part.variable] = max(variable_updates.get(part.variable, 0), updates.get(part.name, 0))

        def write(tmp: Path) -> None:
            writer = TensorWriter(tmp, self._placement)
            done = False
            try:
                with ThreadPoolExecutor(max_workers=len(streams), thread_name_prefix="ckpt") as pool:
                    list(pool.map(lambda stream: writer.add_all(stream.slices), streams))
                done = True
            finally:
                writer.close(complete=done)

        return self.checkpoints.save_with(self._number, write, {
            "shard_versions": [s.version for s in snaps],
            "shard_counters": [{"accepted": s.accepted, "dropped": s.dropped, "answers": s.answers,
                                "answers_by_worker": {str(w): n for w, n in sorted(s.answers_by_worker.items())}}
                               for s in snaps],
            "updates": updates,
            "variable_updates": variable_updates,
            "examples": examples + self.examples_offset,
            "worker_steps": worker_steps,
            "data_tasks": data_tasks,
            "run": dataclasses.asdict(self._run),
            "user_path": [os.path.abspath(d) for d in user_path_from_env()],  # for asyncps export
            "placement": [dataclasses.asdict(p) for p in self._placement.parts],
            "wall_time": time.time(),
        })
