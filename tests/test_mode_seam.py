"""The seam between the shard's store and its consistency mode: the mode owns commit, decisions and hold.

A mode defined here, which the store has never heard of, stages pushes and applies them only when
a commit names them; a real ShardStore drives it through the `Consistency` interface alone. A
scan of ps/ checks that no shard module names a concrete mode.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest
from asyncps.ps.store import ShardStore

from asyncps.errors import InvalidArgumentError
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.rules.consistency import MODES, Admission, Consistency, ModeSpec, ShardHandle, Verdict
from asyncps.rules.drops import DropReason
from asyncps.rules.sync.types import Ballot, Decisions, Held, Resolution, SyncStep
from asyncps.wire.codec import Gradient

ROOT = Path(__file__).resolve().parent.parent


class Relay(Consistency):
    """Stage every push; a commit applies the staged pushes of the workers its decisions name,
    one step each, and drops the others; this shard's decisions are the steps it applied."""

    name = "test-relay"
    exclusive = True

    def __init__(self, num_workers: int) -> None:
        super().__init__(num_workers)
        self.staged: dict[str, Mapping[str, Gradient]] = {}
        self.refused: dict[str, Resolution] = {}
        self.applied: list[SyncStep] = []

    def admit(self, worker_id: str, base_version: int, version: int, ballot: Ballot | None = None) -> Admission:
        if worker_id in self.staged:
            return Admission(Verdict.DROP, "one staged push per worker", DropReason.DUPLICATE)
        return Admission(Verdict.ACCUMULATE)

    def accumulate(self, worker_id: str, grads: Mapping[str, Gradient], ballot: Ballot | None = None) -> None:
        self.staged[worker_id] = {name: np.array(grad, copy=True) for name, grad in grads.items()}

    def defers_answer(self, worker_id: str, ballot: Ballot | None, refusal: Resolution | None) -> bool:
        if refusal is not None:
            self.refused[worker_id] = refusal
        return True

    def _apply(self, shard: ShardHandle, decisions: Decisions) -> None:
        for decided in decisions.steps:
            for worker in sorted(decided.workers):
                shard.apply_step(self.staged.pop(worker))
            self.applied.append(decided)
        for _ in self.staged:
            shard.count_drop(DropReason.LATE)
        self.staged.clear()

    def commit(self, shard: ShardHandle, worker_id: str, ballot: Ballot, decisions: Decisions) -> Resolution | None:
        if worker_id in self.refused:
            return self.refused.pop(worker_id)
        named = any(worker_id in decided.workers for decided in decisions.steps)
        self._apply(shard, decisions)
        return Resolution(True, shard.version, 0) if named else None

    def decisions(self, shard: ShardHandle, since: int) -> Decisions | None:
        steps = tuple(step for step in self.applied if step.step >= since)
        return Decisions(shard.incarnation, steps) if since >= 0 and steps else None

    def hold(self, shard: ShardHandle, sync: Decisions | None, decisions_since: int) -> Held:
        if sync is not None:
            self._apply(shard, sync)
        return Held(shard.version, True, shard.incarnation, len(self.applied), self.decisions(shard, decisions_since))


@dataclasses.dataclass(frozen=True)
class RelayMode(ModeSpec):
    """A test mode: pushes wait for a commit that names them."""

    def start(self, num_workers: int, shard_index: int = 0) -> Consistency:
        return Relay(num_workers)


@pytest.fixture
def relay() -> Iterator[ShardStore]:
    MODES.register("test-relay")(RelayMode)
    try:
        store = ShardStore(shard_index=1)
        store.initialize(UpdateRuleConfig(OptimizerConfig("sgd", 0.5), mode="test-relay", num_workers=2),
                         {"w": np.zeros(3, np.float32)})
        yield store
    finally:
        MODES.unregister("test-relay")


def grad(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full(3, value, np.float32)}


def test_the_store_drives_a_mode_it_does_not_know_through_the_interface(relay: ShardStore) -> None:
    store = relay
    ballot = Ballot(0, 7)
    staged = store.push("w0", 0, grad(2.0), step=0, ballot=ballot, worker_index=0)
    assert staged.accepted and store.version == 0  # staged, not applied
    assert store.stats().answers == 0  # the mode deferred the answer to the commit
    store.push("w1", 0, grad(6.0), step=0, ballot=ballot, worker_index=1)

    # the commit is the mode's: it applies w0's step through the handle and drops w1's
    outcome = store.commit("w0", ballot, Decisions(7, (SyncStep(0, frozenset({"w0"})),)), worker_index=0)
    assert outcome.accepted and outcome.version == 1 and outcome.seq == 1  # the one answer counted
    np.testing.assert_array_equal(store.values()["w"], np.full(3, -1.0, np.float32))  # 0 - 0.5 * 2
    stats = store.stats()
    assert (stats.version, stats.pushes_accepted, stats.dropped_by_reason) == (1, 1, {"late": 1})

    # the mode's decisions reach the reader with the values of the same instant
    pulled = store.pull(worker_id="w0", decisions_since=0)
    assert pulled.version == 1 and pulled.decisions == Decisions(store.incarnation, (SyncStep(0, frozenset({"w0"})),))
    assert store.decisions_since(-1) is None

    # the hold is the mode's too: it says where this shard stands, under the store's pause
    held = store.hold(5.0, decisions_since=0)
    assert held == Held(1, True, store.incarnation, 1, pulled.decisions)
    store.pause(0)


def test_a_refusal_staged_for_the_commit_is_its_answer(relay: ShardStore) -> None:
    store = relay
    ballot = Ballot(0, 7)
    store.push("w0", 0, grad(1.0), step=0, ballot=ballot)
    store.push("w0", 0, grad(1.0), step=1, ballot=ballot)  # refused: the mode keeps why
    answer = store.commit("w0", ballot, Decisions(7, ()), worker_index=0)
    assert not answer.accepted and answer.drop is DropReason.DUPLICATE and store.stats().answers == 1


def test_async_takes_no_commit_and_holds_plainly() -> None:
    store = ShardStore()
    store.initialize(UpdateRuleConfig(OptimizerConfig("sgd", 1.0)), {"w": np.zeros(3, np.float32)})
    before = store.stats()
    with pytest.raises(InvalidArgumentError, match="follower shard"):
        store.commit("w0", Ballot(0, 1), Decisions(1, ()))
    with pytest.raises(InvalidArgumentError, match="follower shard"):
        store.hold(5.0, sync=Decisions(1, ()))
    assert store.stats() == before  # refused before anything changed, the pause included
    assert store.push("w0", 0, grad(1.0)).accepted  # not held
    assert store.hold(0.0, decisions_since=0) == Held(1)


def _mode_imports(path: Path) -> Iterator[str]:
    """The names a module imports from the rules' mode modules (all but the interface and the types)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            interface = node.module in {"asyncps.rules.consistency", "asyncps.rules.sync.types"}
            if not interface and (node.module == "asyncps.rules.modes" or node.module.startswith("asyncps.rules.sync")):
                yield from (f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name.startswith("asyncps.rules.sync.")
                        and alias.name != "asyncps.rules.sync.types")


def test_no_shard_module_names_a_concrete_mode() -> None:
    found = {str(path.relative_to(ROOT)): names for path in sorted((ROOT / "ps").rglob("*.py"))
             if (names := sorted(_mode_imports(path)))}
    assert found == {}
