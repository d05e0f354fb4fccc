"""Checkpointing of the run over the shards: initialize or restore them at start, recover a
restarted shard, and take checkpoints at a consistent cut (asyncps.chief.cut)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncps.chief.checkpoint import CheckpointDir
from asyncps.chief.config import ChiefConfig
from asyncps.chief.cut import CutLapsed, at_cut
from asyncps.chief.membership import Membership
from asyncps.chief.progress import Progress
from asyncps.chief.tasks import TaskLedger
from asyncps.codec import Array

if TYPE_CHECKING:
    from asyncps.chief.checkpoint import Checkpoint
    from asyncps.placement import Placement
    from asyncps.transport import ModelClient

log = logging.getLogger("asyncps.chief")


class Checkpointer:
    """Pause/snapshot/restore orchestration between the shards and the checkpoint directory."""

    def __init__(self, config: ChiefConfig, client: ModelClient, placement: Placement,
                 initial_values: dict[str, Array], ledger: TaskLedger, membership: Membership,
                 progress: Progress, since: float) -> None:
        """`since`: the monotonic time the checkpoint schedule counts from (the chief's start)."""
        self._config = config
        self._run = config.run
        self._client = client
        self._placement = placement
        self._initial_values = initial_values
        self._ledger = ledger
        self._membership = membership
        self._progress = progress
        self.checkpoints = CheckpointDir(config.checkpoints, config.run.keep_checkpoints)
        self.examples_offset = 0  # examples seen before the checkpoint this run resumed from
        self._number = 0
        self._last = (since, 0)  # (monotonic time, updates) of the last checkpoint

    def initialize_shards(self) -> None:
        """Initialize every shard from the initial values, or (--resume) restore the latest checkpoint."""
        n = len(self._config.ps)
        ckpt = self.checkpoints.latest() if self._config.resume else None
        if self._config.resume and ckpt is None:
            log.warning("--resume: no checkpoint in %s; starting from initial values", self._config.checkpoints)
        if ckpt is not None:
            self.examples_offset = int(ckpt.manifest.get("examples", 0))
            self._number = ckpt.number
            if "data_tasks" in ckpt.manifest:
                self._ledger.load(ckpt.manifest["data_tasks"])
        with ThreadPoolExecutor(max_workers=n) as pool:
            list(pool.map(lambda shard: self._start_shard(shard, ckpt), range(n)))

    def _start_shard(self, shard: int, ckpt: Checkpoint | None) -> None:
        """Initialize a shard from the initial values, or restore it from a checkpoint."""
        from asyncps.chief.checkpoint import split
        from asyncps.placement import split_for_shards

        client = self._client.shards[shard]
        if ckpt is None:
            part = split_for_shards(self._placement, self._initial_values)[shard]
            reply = client.initialize("chief", shard, len(self._config.ps), self._run.update_rule(), part)
            log.info("shard %d at %s: %s at version %d", shard, self._config.ps[shard],
                     "initialized" if reply.created else "already initialized", reply.version)
            return
        snap = split(self._placement, ckpt, self._run.update_rule())[shard]
        reply = client.restore(snap, shard)
        log.info("shard %d at %s: restored from %s at version %d", shard, self._config.ps[shard], ckpt.path.name,
                 reply.version)

    def recover_shard(self, shard: int) -> None:
        """A shard came back empty (it crashed and restarted): restore its part of the latest checkpoint."""
        ckpt = self.checkpoints.latest()
        if ckpt is None:
            log.warning("shard %d restarted and there is no checkpoint: it restarts from initial values", shard)
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
        None (nothing written, logged) when the cut outlasted the shards' hold."""
        from asyncps.chief.checkpoint import assemble, assemble_policy_state

        t0 = time.monotonic()

        def records() -> tuple[int, dict[str, int], dict[str, Any]]:
            return examples_seen(), self._membership.worker_steps(), self._ledger.state()

        try:
            cut = at_cut(self._client.shards, lambda _, shard: shard.snapshot(), records)
        except CutLapsed as exc:
            log.error("checkpoint skipped: %s", exc)  # the next one is due again at once
            return None
        snaps = cut.reads
        examples, worker_steps, data_tasks = cut.record
        values, slots = assemble(self._placement, snaps)
        self._number += 1
        updates = {name: n for snap in snaps for name, n in snap.updates.items()}
        variable_updates: dict[str, int] = {}
        for part in self._placement.parts:
            variable_updates[part.variable] = max(variable_updates.get(part.variable, 0), updates.get(part.name, 0))
        path = self.checkpoints.save(self._number, values, slots, {
            "shard_versions": [s.version for s in snaps],
            "shard_counters": [{"accepted": s.accepted, "dropped": s.dropped} for s in snaps],
            "updates": updates,
            "variable_updates": variable_updates,
            "examples": examples + self.examples_offset,
            "worker_steps": worker_steps,
            "data_tasks": data_tasks,
            "run": dataclasses.asdict(self._run),
            "placement": [dataclasses.asdict(p) for p in self._placement.parts],
            "wall_time": time.time(),
        }, assemble_policy_state(self._placement, snaps))
        self._last = (time.monotonic(), self._progress.updates)
        log.info("checkpoint %s at versions %s in %.3fs", path.name, [s.version for s in snaps],
                 time.monotonic() - t0)
        return path
