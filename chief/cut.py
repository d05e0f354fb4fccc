"""A consistent cut over all shards: every shard holds pushes before any is read.

Checkpoints and evaluations read the shards at a cut: all shards are paused (in parallel, each
pause returning once its in-flight pushes are applied), then every shard is read, then whatever
the chief records beside the values (the data ledger, the examples seen) is read, and only then
are pushes released. So the values are those of one instant of the whole cluster, the version
vector is the one they carry, and the records are those of the same instant.

A worker's step pushes to every shard; at the cut it may be applied on some shards and held on
others. That gradient is "in flight" at the cut: the values read do not contain it on the shards
where it was held, and the version vector says exactly which updates each shard's values hold.

Sync over several shards is the exception, since a step must be on every shard or none: shard 0
decides a step before the followers commit it, so while every shard is held the cut brings
each follower to shard 0's step (asyncps.rules.sync.cut.catch_up, through Pause, a chief-only
call) and the values read are one model.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from asyncps.rules.sync.cut import catch_up

if TYPE_CHECKING:
    from asyncps.transport import ModelClient, ShardTransport

Read = TypeVar("Read")
Record = TypeVar("Record")

# Pushes resume by themselves after this long, should the chief die while holding them.
DEFAULT_HOLD_S = 30.0

# Tests only: a folder where a file `hold-<what>` makes the next such cut (checkpoint, evaluation) stop
# once every shard is held: the chief writes `held-<what>` and waits for `go-<what>` (up to half the
# hold), so a test can kill processes exactly while the chief holds a cut.
CUT_GATE_ENV = "ASYNCPS_TEST_CUT_GATE"


class CutLapsed(RuntimeError):
    """Reading took as long as the hold: a shard may have released pushes by itself mid-cut."""


@dataclass(frozen=True)
class Cut(Generic[Read, Record]):
    """What was read from every shard at the cut, the shards' versions when paused, and the
    chief's records taken before the release."""

    reads: list[Read]
    paused_versions: list[int]  # after the sync followers caught up
    record: Record
    sync_steps: list[int] | None = None  # multi-shard sync: each shard's coordinator step at the cut


def _gate(what: str, hold_s: float) -> None:
    """The test gate of CUT_GATE_ENV (nothing unless the variable is set and names a `hold-<what>` file)."""
    folder = os.environ.get(CUT_GATE_ENV)
    if not folder:
        return
    try:
        os.unlink(os.path.join(folder, f"hold-{what}"))
    except FileNotFoundError:
        return
    with open(os.path.join(folder, f"held-{what}"), "w"):
        pass
    go = os.path.join(folder, f"go-{what}")
    give_up = time.monotonic() + hold_s / 2
    while not os.path.exists(go) and time.monotonic() < give_up:
        time.sleep(0.05)
    for name in (f"held-{what}", f"go-{what}"):  # ready for the next hold
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(folder, name))


def at_cut(shards: Sequence[ShardTransport], read: Callable[[int, ShardTransport], Read],
           record: Callable[[], Record], hold_s: float = DEFAULT_HOLD_S, what: str = "cut") -> Cut[Read, Record]:
    """Pause every shard, `read` each one, take `record()`, then release every shard.

    Each shard is released even when a pause or a read fails (the error is raised after). A cut
    that took `hold_s` or longer raises CutLapsed: a shard's hold may have expired during it.
    `what` names the cut (checkpoint, evaluation) for the test gate (CUT_GATE_ENV)."""
    started = time.monotonic()  # before any pause is sent: every shard's hold ends after started + hold_s
    with ThreadPoolExecutor(max_workers=max(1, len(shards)), thread_name_prefix="cut") as pool:
        try:
            paused, sync_steps = catch_up(shards, list(pool.map(lambda shard: shard.hold(hold_s), shards)),
                                          hold_s, pool.map)
            _gate(what, hold_s)
            reads = list(pool.map(read, range(len(shards)), shards))
            recorded = record()
            took = time.monotonic() - started
        finally:
            list(pool.map(lambda shard: shard.pause(0.0), shards))
    if took >= hold_s:
        raise CutLapsed(f"the cut took {took:.1f}s, not less than the {hold_s:.1f}s hold: pushes may have resumed")
    return Cut(reads, paused, recorded, sync_steps)


def pull_at_cut(client: ModelClient, hold_s: float = DEFAULT_HOLD_S,
                then: Callable[[], None] | None = None) -> list[int]:
    """Pull the whole model into `client.values` at a cut (and call `then`, reading the tables' rows, at
    the same cut); the version vector of those values.

    Pushes are held for the pull's duration, so no shard's values can include a gradient computed
    from values of another shard newer than the ones pulled."""
    def pull() -> list[int]:
        versions = client.pull()
        if then is not None:
            then()
        return versions

    return at_cut(client.shards, lambda _, __: None, pull, hold_s, what="evaluation").record


__all__ = ["CUT_GATE_ENV", "DEFAULT_HOLD_S", "Cut", "CutLapsed", "at_cut", "pull_at_cut"]
