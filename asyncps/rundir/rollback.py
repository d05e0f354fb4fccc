"""Which recorded pushes a shard restore rolled back (pushes.csv against restores.csv).

A restore puts a shard back to a checkpoint's version v with a new incarnation: the pushes it
had applied after v are gone. Every answer a shard's state gives to a push is numbered (pushes.csv's
seq, counted in the state and its checkpoints), and restores.csv keeps the count the restore went
back to: an answer numbered above it was taken back, accepted or dropped. Rows of older files
without numbers fall back to versions: A push row carries the incarnation of the state it was applied to;
the restores after that incarnation began (every restore of the shard when no restore created it:
the state the run initialized) went back to versions at or below the smallest v among them, so an
accepted push with a resulting version above that v is rolled back. A push of incarnation 0 (an
older worker) cannot be placed and is never counted rolled back.
"""

from __future__ import annotations

from collections.abc import Iterable

from asyncps.rundir.tables import PushRow, RestoreRow


class Rollbacks:
    """The restores of a run, by shard, in the order they happened; which pushes they rolled back."""

    def __init__(self, restores: Iterable[RestoreRow] = ()) -> None:
        self._by_shard: dict[int, list[RestoreRow]] = {}
        for row in restores:
            self.add(row)

    def add(self, row: RestoreRow) -> None:
        """One more restore (after every one added so far)."""
        self._by_shard.setdefault(row.shard, []).append(row)

    def rolled_back(self, push: PushRow) -> bool:
        """Whether an accepted push was undone by a later restore of its shard."""
        return push.accepted and self.taken_back(push)

    def taken_back(self, push: PushRow) -> bool:
        """Whether a later restore of its shard took the push's answer back: an accepted push's update is
        undone, a drop is no longer in the restored state's count of answers. By the answer's number
        (seq) where the row and the restores carry them, else (older files) by version, accepted only."""
        restores = self._by_shard.get(push.shard)
        if not restores or not push.incarnation:
            return False
        later = restores
        for i, row in enumerate(restores):
            if row.incarnation == push.incarnation:
                later = restores[i + 1:]  # the last such restore: incarnations are random, never repeated
        if not later:
            return False
        if push.seq > 0 and all(row.answers >= 0 for row in later):
            return push.seq > min(row.answers for row in later)
        return push.accepted and push.version > min(row.version for row in later)

    def __len__(self) -> int:
        return sum(len(rows) for rows in self._by_shard.values())


__all__ = ["Rollbacks"]
