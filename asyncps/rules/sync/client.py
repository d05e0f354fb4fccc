"""The worker's side of the sync protocol: one step decided by shard 0 for every shard.

asyncps.transport.model.ModelClient calls `coordinated_step` for a coordinated mode over several
shards; it works over any data path (the `DataPath` faces of the shard transports).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from asyncps.rules.sync.types import Ballot, Decisions
from asyncps.wire.codec import Array, Gradient
from asyncps.wire.shard import PushOutcome, PushRequest, ShardValues

T = TypeVar("T")


class Parallel(Protocol):
    """Maps a call over shard indices, possibly in parallel (a thread pool's map)."""

    def __call__(self, fn: Callable[[int], T], items: Iterable[int], /) -> Iterator[T]:
        """The results in the order of `items`."""
        ...


class DataPath(Protocol):
    """What a coordinated step needs of a shard: push, and push-pull into the caller's buffers."""

    def push(self, request: PushRequest) -> PushOutcome:
        """Apply (here: stage) or drop one gradient."""
        ...

    def push_pull(self, request: PushRequest, pull_if_newer_than: int = -1,
                  buffers: Mapping[str, Array] | None = None, read_wait_s: float = 0.0,
                  ) -> tuple[PushOutcome, ShardValues]:
        """Push, then receive the values in the same round trip."""
        ...


@dataclass(frozen=True)
class StepOnShard:
    """What one shard answered for the step: the push's outcome, the version received, the time held."""

    shard: int
    outcome: PushOutcome
    version: int
    waited_s: float = 0.0


@dataclass(frozen=True)
class WorkerStep:
    """One worker's step: who, the gradient's part per shard, and what it was computed from."""

    worker_id: str
    per_shard: Sequence[Mapping[str, Gradient]]
    step: int
    loss: float
    base: Sequence[int]  # each shard's version the gradient was computed from
    incarnations: Sequence[int]
    worker_index: int | None = None

    def request(self, shard: int, ballot: Ballot, decisions: Decisions | None = None) -> PushRequest:
        """The push of this step to `shard` (a commit with no gradients when it carries decisions)."""
        grads = {} if decisions is not None else self.per_shard[shard]
        return PushRequest(self.worker_id, self.base[shard], grads, self.step, self.loss, self.incarnations[shard],
                           ballot, decisions, self.worker_index)


def coordinated_step(
    work: WorkerStep, shards: Sequence[DataPath], buffers: Sequence[Mapping[str, Array]], read_wait_s: float,
    accept: Callable[[int, ShardValues], None],
    parallel: Parallel,
) -> list[StepOnShard]:
    """One step decided by shard 0 for every shard: stage on the followers, vote at shard 0
    (held until the step is decided), commit and pull on the followers.

    `accept(shard, reply)` takes each shard's values; `parallel` maps a call over the followers
    (a thread pool's map)."""
    ballot = Ballot(work.base[0], work.incarnations[0])
    followers = list(range(1, len(shards)))
    staged = dict(zip(followers, parallel(lambda s: shards[s].push(work.request(s, ballot)), followers),
                      strict=True))
    outcome, reply = shards[0].push_pull(work.request(0, ballot), -1, buffers[0], read_wait_s)
    accept(0, reply)
    results = [StepOnShard(0, outcome, reply.version, reply.waited_s)]
    decisions = reply.decisions or Decisions(reply.incarnation)

    def commit(shard: int) -> StepOnShard:
        verdict, values = shards[shard].push_pull(work.request(shard, ballot, decisions), -1, buffers[shard], 0.0)
        accept(shard, values)
        # the commit says what became of the gradient, a refusal when it was staged included (the
        # answer the shard counts: PushOutcome.seq); the staging reply tells it only when the commit
        # is from an older shard (no number)
        chosen = staged[shard] if not staged[shard].accepted and not verdict.seq else verdict
        return StepOnShard(shard, chosen, values.version)

    return results + list(parallel(commit, followers))


__all__ = ["DataPath", "Parallel", "StepOnShard", "WorkerStep", "coordinated_step"]
