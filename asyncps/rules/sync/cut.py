"""The chief's side of the sync protocol: bring every held follower to shard 0's step at a cut.

A cut can find shard 0 at version v+1 and a follower still at v (shard 0 decides a step before
the followers commit it). While every shard is held, the cut reads shard 0's decisions since the
oldest step a follower has not committed and has each follower commit them (both through a
hold); every follower then stands at shard 0's step, and the values read are one model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

from asyncps.rules.sync.types import Decisions, Held


class Holdable(Protocol):
    """A shard the chief can hold (ShardTransport's control face)."""

    def hold(self, hold_s: float, decisions_since: int = -1, sync: Decisions | None = None) -> Held:
        """Hold pushes; answer the decisions since a step, or commit `sync` on a follower."""
        ...


def catch_up(shards: Sequence[Holdable], held: list[Held], hold_s: float,
             parallel: Callable[[Callable[[int], Held], Iterable[int]], Iterator[Held]] = map,
             ) -> tuple[list[int], list[int] | None]:
    """Bring every held sync follower to shard 0's step; the versions then and each shard's step.

    `held` is every shard's answer to the cut's hold; `parallel` maps a call over followers (a
    thread pool's map). Not a coordinated mode over several shards: the versions as paused, no steps."""
    followers = [i for i, h in enumerate(held) if h.follower]
    if not followers:
        return [h.version for h in held], None
    since = min(held[i].next_step for i in followers)
    decided = shards[0].hold(hold_s, since).decided
    if decided is not None and any(held[i].lineage != decided.incarnation for i in followers) and since > 0:
        decided = shards[0].hold(hold_s, 0).decided  # a follower still follows an older incarnation
    if decided is not None:
        commits = decided
        caught = dict(zip(followers, parallel(lambda i: shards[i].hold(hold_s, sync=commits), followers),
                          strict=True))
        held = [caught.get(i, h) for i, h in enumerate(held)]
    return [h.version for h in held], [held[0].version, *(h.next_step for h in held[1:])]


__all__ = ["Holdable", "catch_up"]
