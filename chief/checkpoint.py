"""Checkpoints of the whole model: full variables and optimizer slots plus a manifest.

A checkpoint is written into `ckpt-NNNNNNNN.tmp/`, every file fsynced, then the directory is
renamed to `ckpt-NNNNNNNN/` and its parent fsynced: a reader sees a complete checkpoint or none.
A write that fails (the disk full, the directory read-only) raises its OSError after removing what
it staged (where it can): the complete checkpoints before it stay the latest.
Variables are stored whole (slices reassembled), so a checkpoint restores into any number of
shards (resharding) through the placement module.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from asyncps.placement import Part, Placement
from asyncps.rules import UpdateRuleConfig
from asyncps.rundir import CheckpointNames
from asyncps.wire.codec import Array
from asyncps.wire.shard import Snapshot


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: whole variables, their slots, and the manifest."""

    path: Path
    values: dict[str, Array]
    slots: dict[str, dict[str, Array]]
    manifest: dict[str, Any]
    policy_state: dict[str, dict[str, Array]] = field(default_factory=dict)  # asyncps.ps.policy_state

    @property
    def number(self) -> int:
        """The checkpoint's sequence number."""
        return int(self.manifest["number"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def assemble(placement: Placement, snaps: list[Snapshot]) -> tuple[dict[str, Array], dict[str, dict[str, Array]]]:
    """Whole variables and slots from every shard's snapshot."""
    values: dict[str, Array] = {}
    slots: dict[str, dict[str, Array]] = {}
    for spec in placement.variables:
        values[spec.name] = np.empty(spec.shape, dtype=spec.dtype)
    for part in placement.parts:
        snap = snaps[part.shard]
        if part.name not in snap.values:
            raise ValueError(f"shard {part.shard} has no {part.name}")
        target = values[part.variable]
        (target[part.rows()] if part.sliced else target)[...] = snap.values[part.name]
        for slot, array in snap.slots.get(part.name, {}).items():
            full = slots.setdefault(part.variable, {}).setdefault(
                slot, np.empty(target.shape, dtype=array.dtype))
            (full[part.rows()] if part.sliced else full)[...] = array
    return values, slots


def assemble_policy_state(placement: Placement, snaps: list[Snapshot]) -> dict[str, dict[str, Array]]:
    """Whole-variable policy state from every shard's snapshot; rows of a part with no state for
    a key get zeros, which the row masks (KEY@rows) mark as "no state"."""
    state: dict[str, dict[str, Array]] = {}
    rows_of = {spec.name: spec.shape[0] if spec.shape else 1 for spec in placement.variables}
    for part in placement.parts:
        for key, array in snaps[part.shard].policy_state.get(part.name, {}).items():
            shape = (rows_of[part.variable], *array.shape[1:]) if part.sliced else array.shape
            full = state.setdefault(part.variable, {}).setdefault(key, np.zeros(shape, dtype=array.dtype))
            (full[part.rows()] if part.sliced else full)[...] = array
    return state


def _part_of(array: Array, part: Part) -> Array:
    """The part's rows (or the whole array), C-contiguous and in its own shape (numpy < 2 made 0-d 1-d)."""
    piece = array[part.rows()] if part.sliced else array
    return np.ascontiguousarray(piece).reshape(piece.shape)


def split(placement: Placement, ckpt: Checkpoint, rule: UpdateRuleConfig) -> list[Snapshot]:
    """One Snapshot per shard of `placement` from a checkpoint (possibly of another shard count)."""
    old_versions: list[int] = ckpt.manifest["shard_versions"]
    same_shape = len(old_versions) == placement.num_shards
    updates: dict[str, int] = ckpt.manifest["updates"]
    var_updates: dict[str, int] = ckpt.manifest["variable_updates"]
    snaps = []
    for shard in range(placement.num_shards):
        values: dict[str, Array] = {}
        slots: dict[str, dict[str, Array]] = {}
        policy_state: dict[str, dict[str, Array]] = {}
        part_updates: dict[str, int] = {}
        for part in placement.parts_on(shard):
            values[part.name] = _part_of(ckpt.values[part.variable], part)
            slots[part.name] = {k: _part_of(a, part) for k, a in ckpt.slots.get(part.variable, {}).items()}
            state = {k: _part_of(a, part) for k, a in ckpt.policy_state.get(part.variable, {}).items()}
            if state:
                policy_state[part.name] = state
            part_updates[part.name] = updates.get(part.name, var_updates.get(part.variable, 0))
        version = old_versions[shard] if same_shape else max(old_versions, default=0)
        counters = ckpt.manifest["shard_counters"]
        accepted = counters[shard]["accepted"] if same_shape else max(c["accepted"] for c in counters)
        dropped = counters[shard]["dropped"] if same_shape else max(c["dropped"] for c in counters)
        # the answers the shard had given (older checkpoints: none counted; another shard count: a new count)
        answers = int(counters[shard].get("answers", 0)) if same_shape else 0
        by_worker = {int(w): int(n) for w, n in counters[shard].get("answers_by_worker", {}).items()} \
            if same_shape else {}
        snaps.append(Snapshot(rule=rule, version=version, accepted=accepted, dropped=dropped,
                              values=values, slots=slots, updates=part_updates, policy_state=policy_state,
                              answers=answers, answers_by_worker=by_worker))
    return snaps


class CheckpointDir:
    """The checkpoints of a run, newest last; keeps the last `keep`."""

    def __init__(self, root: Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.root = root
        self.keep = keep
        self.names = CheckpointNames(root)

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first (a `.tmp` one is an interrupted write)."""
        if not self.root.exists():
            return []
        found = [p for p in self.root.iterdir()
                 if CheckpointNames.number_of(p) is not None and CheckpointNames.manifest(p).exists()]
        return sorted(found, key=lambda p: p.name)

    def last_number(self) -> int:
        """The number of the newest complete checkpoint (0: none): new ones continue after it."""
        paths = self.complete()
        number = CheckpointNames.number_of(paths[-1]) if paths else None
        return number or 0

    def latest(self) -> Checkpoint | None:
        """The newest complete checkpoint, loaded, or None."""
        paths = self.complete()
        return self.load(paths[-1]) if paths else None

    @staticmethod
    def load(path: Path) -> Checkpoint:
        """Load one checkpoint directory."""
        manifest = json.loads(CheckpointNames.manifest(path).read_text())
        values: dict[str, Array] = {}
        slots: dict[str, dict[str, Array]] = {}
        policy_state: dict[str, dict[str, Array]] = {}
        with np.load(CheckpointNames.arrays(path), allow_pickle=False) as data:
            for key in data.files:
                kind, _, rest = key.partition("/")
                if kind == "value":
                    values[rest] = data[key]
                else:
                    slot, _, name = rest.partition("/")
                    (policy_state if kind == "policy" else slots).setdefault(name, {})[slot] = data[key]
        return Checkpoint(path, values, slots, manifest, policy_state)

    def save(self, number: int, values: dict[str, Array], slots: dict[str, dict[str, Array]],
             manifest: dict[str, Any], policy_state: dict[str, dict[str, Array]] | None = None) -> Path:
        """Write checkpoint `number` atomically and prune old ones; return its path. An OSError (no space,
        a read-only directory) leaves no trace of it but what the storage refused to remove (a `.tmp`
        directory, never read as a checkpoint)."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.names.staging(number)
        try:
            final = self._write(number, tmp, values, slots, manifest, policy_state)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # a full disk frees what the torn write took
            raise
        for old in self.complete()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        for torn in self.root.glob("ckpt-*.tmp"):  # a chief killed mid-write (one chief writes: ChiefLock)
            shutil.rmtree(torn, ignore_errors=True)
        return final

    def _write(self, number: int, tmp: Path, values: dict[str, Array], slots: dict[str, dict[str, Array]],
               manifest: dict[str, Any], policy_state: dict[str, dict[str, Array]] | None) -> Path:
        """Stage checkpoint `number` in `tmp`, fsynced, and rename it into place; return its path."""
        final = self.names.final(number)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        arrays = {f"value/{n}": a for n, a in values.items()}
        arrays.update({f"slot/{s}/{n}": a for n, by_slot in slots.items() for s, a in by_slot.items()})
        arrays.update({f"policy/{k}/{n}": a for n, by_key in (policy_state or {}).items() for k, a in by_key.items()})
        with open(CheckpointNames.arrays(tmp), "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        with open(CheckpointNames.manifest(tmp), "w") as f:
            json.dump({**manifest, "number": number}, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        return final
