"""What every consistency mode is: the `Consistency` interface the store drives, and `ModeSpec`.

A mode is chosen by the update rule's mode spec (`async`, `sync:backup=1`, `ssp:bound=2`): a
small frozen dataclass of its typed parameters registered in `MODES`, whose `start` builds the
mode's running state for one shard, a `Consistency`. The store drives that object through this
interface only, injected like ps-lite's request handle: it never names a concrete mode.
- `admit`: apply a gradient now, accumulate it for a synchronous step, or drop it (and why);
- `accumulate` / `take_step`: keep an accumulated gradient; the averaged step once it is complete;
- `readable`: whether a worker that just pushed may receive parameters and start its next step
  (`strict_reads`: a worker that may not read yet gets no values at all, the call fails);
- the multi-shard protocol, which the mode owns: `decisions` (what this shard decided for the
  others), `commit` (apply another shard's decisions here), `hold` (where the shard stands at a
  cut) and `defers_answer` (a commit answers the push, not the push itself). The defaults are
  those of a mode that decides alone (async, SSP): no decisions, no commits, a plain hold. The
  hooks act on the shard through a `ShardHandle` the store passes in.

Modes that coordinate several shards (sync, the K-variants) implement the protocol hooks in their
own home, asyncps.rules.sync (the coordinator on shard 0, the followers elsewhere). The concrete
modes are in asyncps.rules.modes. All methods run with the store's state lock held.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from asyncps.errors import InvalidArgumentError
from asyncps.rules.drops import DropReason
from asyncps.rules.registry import Registry
from asyncps.rules.sync.types import Ballot, Decisions, Held, Resolution
from asyncps.wire.codec import Gradient

Outcome = TypeVar("Outcome")  # what the shard answered a push (asyncps.wire.shard.PushOutcome)


class Verdict(Enum):
    """What the store does with an admitted gradient."""

    APPLY = "apply"
    ACCUMULATE = "accumulate"
    DROP = "drop"


@dataclass(frozen=True)
class Admission:
    """A verdict and, for drops, the reason."""

    verdict: Verdict
    reason: str = ""
    drop: DropReason | None = None  # the kind of a DROP verdict


class RetryMemo(Generic[Outcome]):
    """The outcome of each worker's last push, by worker step, for modes with strict reads.

    A worker whose read was refused repeats its whole call; the repeated push (same step) is
    answered with its first outcome instead of being applied twice."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, Outcome]] = {}

    def repeated(self, worker_id: str, step: int | None) -> Outcome | None:
        """The first outcome when this push repeats the worker's last one (same step), else None."""
        last = self._last.get(worker_id)
        return last[1] if step is not None and last is not None and last[0] == step else None

    def remember(self, worker_id: str, step: int | None, outcome: Outcome) -> Outcome:
        """Keep the outcome of worker_id's push of `step`; the outcome."""
        if step is not None:
            self._last[worker_id] = (step, outcome)
        return outcome


class ShardHandle(Protocol):
    """The shard a mode's protocol hooks act on: the store passes it with its state lock held, and
    with every variable lock too to the hooks that may apply a step (`commit`, `hold`)."""

    @property
    def version(self) -> int:
        """The shard's version now."""

    @property
    def incarnation(self) -> int:
        """The shard's incarnation (changes on initialize and restore)."""

    def apply_step(self, grads: Mapping[str, Gradient]) -> None:
        """Apply one averaged step at the rule's learning rate: the shard's next version."""

    def count_drop(self, reason: DropReason) -> None:
        """Count a gradient dropped after its push was answered (a staged one no step took)."""


class Consistency(abc.ABC):
    """A consistency model: BSP (sync), SSP or fully asynchronous."""

    name: str
    exclusive = False  # True: a push needs every variable lock (it may complete a step)
    # True: a worker that may not read yet never gets values (SSP's bound); the shard refuses the
    # call and the worker pushes again (the shard recognizes the repeated push: `retries`)
    strict_reads = False
    enforce_bound = True  # False only in tests that show what the bound prevents
    # the classes the mode's state holds besides plain values, containers, numpy arrays and the mode itself:
    # all a backup seeded from a live shard may be sent of it (asyncps.ps.live_state); a mode of a plugin
    # module that keeps objects of its own lists them here
    state_types: ClassVar[tuple[type, ...]] = ()

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.live: set[str] | None = None  # None until the chief first says who is alive
        self.retries: RetryMemo[Any] | None = None  # set by modes with strict reads (outcomes: PushOutcome)

    @abc.abstractmethod
    def admit(self, worker_id: str, base_version: int, version: int, ballot: Ballot | None = None) -> Admission:
        """Decide what to do with a gradient from `worker_id` computed from `base_version`."""

    def pushed(self, worker_id: str) -> None:  # noqa: B027 - a hook; most models need nothing
        """A push from worker_id was handled (applied, accumulated or dropped)."""

    def accumulate(self, worker_id: str, grads: Mapping[str, Gradient], ballot: Ballot | None = None) -> None:
        """Keep a gradient `admit` answered ACCUMULATE with (only models that accumulate)."""
        raise TypeError(f"the {self.name} model does not accumulate gradients")

    def take_step(self) -> dict[str, Gradient] | None:
        """The accumulated step to apply now (and forget), or None while it is not complete."""
        return None

    def readable(self, worker_id: str, base_version: int, version: int) -> bool:
        """May worker_id, whose last gradient was computed from base_version, read now?"""
        return True

    def set_live(self, workers: Iterable[str]) -> None:
        """The chief's current set of live workers."""
        self.live = set(workers)

    def stats(self) -> dict[str, float]:
        """Model-specific counters for ShardStats."""
        return {}

    # -- the multi-shard protocol (asyncps.rules.sync); these defaults: a mode that decides alone --
    def decisions(self, shard: ShardHandle, since: int) -> Decisions | None:
        """The steps >= since this shard decided for the other shards (None: none, or since < 0)."""
        return None

    def defers_answer(self, worker_id: str, ballot: Ballot | None, refusal: Resolution | None) -> bool:
        """Whether a later commit gives the answer the worker records for this push (a follower's
        staging), keeping `refusal` (the push was refused) for it; False: the push answers itself."""
        return False

    def commit(self, shard: ShardHandle, worker_id: str, ballot: Ballot, decisions: Decisions) -> Resolution | None:
        """Apply another shard's decided steps here; what became of worker_id's gradient staged
        under `ballot` (None: staged still). Only a follower of a coordinated mode takes commits."""
        raise InvalidArgumentError("sync decisions go to a follower shard of a sync run only")

    def hold(self, shard: ShardHandle, sync: Decisions | None, decisions_since: int) -> Held:
        """Where a paused shard stands for a cut: a follower first commits `sync` (the
        coordinator's decisions the chief read); the decisions for steps >= decisions_since."""
        if sync is not None:
            raise InvalidArgumentError("sync decisions go to a follower shard of a sync run only")
        return Held(shard.version, decided=self.decisions(shard, decisions_since))


class ModeSpec(abc.ABC):
    """A consistency mode with its parameters (a frozen dataclass registered in MODES)."""

    @property
    def spec(self) -> str:
        """The canonical spec string; MODES.parse(spec) rebuilds an equal mode."""
        return MODES.canonical(self)

    @property
    def coordinated(self) -> bool:
        """Whether shard 0 decides each step for every shard (asyncps.rules.sync.CoordinatedMode)."""
        return False

    @abc.abstractmethod
    def start(self, num_workers: int, shard_index: int = 0) -> Consistency:
        """The running state of this mode on one shard, for a run planned with num_workers."""


MODES: Registry[ModeSpec] = Registry("consistency mode", ModeSpec, group="asyncps.modes")


def check_count(key: str, value: int, minimum: int = 0) -> None:
    """A mode parameter that counts something: an int >= minimum (ValueError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key} must be an integer >= {minimum}, got {value!r}")


__all__ = ["MODES", "Admission", "Consistency", "ModeSpec", "RetryMemo", "ShardHandle", "Verdict", "check_count"]
