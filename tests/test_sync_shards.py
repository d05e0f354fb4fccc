"""Sync decided once for all shards (coordinator + follower stores) and SSP's strict reads,
on the shard state and service layer directly."""

from __future__ import annotations

import numpy as np
import pytest
from asyncps.ps.service import ShardService
from asyncps.ps.store import ShardStore

from asyncps.errors import InvalidArgumentError, UnavailableError
from asyncps.pb import ps_pb2
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.rules.sync import Ballot, Decisions
from asyncps.rules.sync.follower import SyncFollower
from asyncps.wire.proto import decisions_from_proto
from asyncps.wire.shard import DropReason, PushRequest

WORKERS = ["w0", "w1", "w2"]


def shard(index: int, mode: str, name: str, workers: int = 3, **kwargs: bool) -> ShardStore:
    store = ShardStore(shard_index=index, **kwargs)
    store.initialize(UpdateRuleConfig(OptimizerConfig("sgd", 1.0), mode=mode, num_workers=workers),
                     {name: np.zeros(2, np.float32)})
    store.set_live_workers(WORKERS[:workers])
    return store


def g(v: float) -> np.ndarray:
    return np.full(2, v, np.float32)


def test_a_follower_applies_exactly_the_set_the_coordinator_decided() -> None:
    coord, follower = shard(0, "sync:backup=1", "a"), shard(1, "sync:backup=1", "b")
    assert isinstance(follower._mode, SyncFollower)
    ballot = Ballot(0, coord.incarnation)
    grads = {"w0": 1.0, "w1": 10.0, "w2": 100.0}
    for w, v in grads.items():  # 1. stage everywhere
        assert follower.push(w, 0, {"b": g(v)}, follower.incarnation, ballot=ballot).accepted
    assert follower.version == 0 and np.all(follower.values()["b"] == 0)  # staged only
    for w in ("w2", "w0"):  # 2. vote: the first two make the quorum
        coord.push(w, 0, {"a": g(grads[w])}, coord.incarnation, ballot=ballot)
    late = coord.push("w1", 0, {"a": g(grads["w1"])}, coord.incarnation, ballot=ballot)
    assert coord.version == 1 and late.drop is DropReason.LATE
    decisions = coord.decisions_since(0)
    assert decisions is not None and [set(s.workers) for s in decisions.steps] == [{"w0", "w2"}]
    # 3. any worker delivers the decision; the follower applies it once
    outcome = follower.commit("w1", ballot, decisions)
    assert not outcome.accepted and outcome.drop is DropReason.LATE
    assert follower.commit("w0", ballot, decisions).accepted
    assert follower.version == coord.version == 1
    # w1's staged gradient, dropped at commit, is counted once on the follower as on shard 0
    assert follower.stats().pushes_dropped == coord.stats().pushes_dropped == 1
    assert follower.stats().dropped_by_reason == coord.stats().dropped_by_reason == {"late": 1}
    np.testing.assert_allclose(follower.values()["b"], -g(50.5))
    np.testing.assert_allclose(coord.values()["a"], -g(50.5))
    # a late stage of a decided step is dropped at once
    assert follower.push("w1", 0, {"b": g(1.0)}, follower.incarnation, ballot=ballot).drop is DropReason.LATE


def test_a_held_follower_commits_the_decisions_a_cut_reads_from_the_held_coordinator() -> None:
    coord, follower = shard(0, "sync:backup=1", "a"), shard(1, "sync:backup=1", "b")
    ballot = Ballot(0, coord.incarnation)
    for w, v in (("w0", 1.0), ("w1", 3.0)):
        follower.push(w, 0, {"b": g(v)}, follower.incarnation, ballot=ballot)
        coord.push(w, 0, {"a": g(v)}, coord.incarnation, ballot=ballot)
    # shard 0 decided step 0; no worker delivered it yet: the cut holds both shards
    held = follower.hold(30.0)
    assert (held.version, held.follower, held.lineage, held.next_step) == (0, True, 0, 0)
    coord_held = coord.hold(30.0, held.next_step)
    assert coord_held.version == 1 and not coord_held.follower and coord_held.decided is not None
    assert coord.hold(30.0).decided is None  # no decisions unless asked for
    caught = follower.hold(30.0, sync=coord_held.decided)  # committed although held
    assert (caught.version, caught.lineage, caught.next_step) == (1, coord.incarnation, 1)
    np.testing.assert_allclose(follower.values()["b"], -g(2.0))
    with pytest.raises(InvalidArgumentError, match="follower"):
        coord.hold(30.0, sync=coord_held.decided)
    assert coord.version == 1  # unchanged by the refused call


def test_a_new_coordinator_incarnation_drops_what_was_staged_against_the_old_one() -> None:
    follower = shard(1, "sync", "b")
    old, new = Ballot(5, 111), Ballot(3, 222)
    follower.push("w0", 0, {"b": g(1.0)}, follower.incarnation, ballot=old)
    follower.commit("w1", new, Decisions(111, ()))  # the follower tracks incarnation 111
    follower.push("w1", 0, {"b": g(2.0)}, follower.incarnation, ballot=new)
    dropped = follower.commit("w0", old, Decisions(222, ()))  # shard 0 was restored: 222 now
    assert dropped.drop is DropReason.RESTORED
    assert follower.stats().dropped_by_reason == {"restored": 1}
    assert follower.push("w2", 0, {"b": g(3.0)}, follower.incarnation, ballot=old).drop is DropReason.LATE  # retired
    assert follower.commit("w1", new, Decisions(222, ())).accepted and follower.version == 0  # still staged


def test_a_follower_needs_a_ballot_and_decisions_must_be_ordered() -> None:
    follower = shard(1, "sync", "b")
    with pytest.raises(InvalidArgumentError, match="needs the coordinator's version"):
        follower.push("w0", 0, {"b": g(1.0)})
    assert follower.version == 0
    msg = ps_pb2.SyncDecisions(incarnation=7, steps=[ps_pb2.SyncStep(step=2), ps_pb2.SyncStep(step=2)])
    with pytest.raises(InvalidArgumentError, match="increasing steps"):
        decisions_from_proto(msg)
    with pytest.raises(InvalidArgumentError, match="incarnation"):
        decisions_from_proto(ps_pb2.SyncDecisions(incarnation=0))


def test_ssp_refuses_a_read_beyond_the_bound_and_applies_the_repeated_push_once() -> None:
    store = shard(0, "ssp:bound=0", "a", workers=2)
    service = ShardService(store)
    fast = PushRequest("w0", 0, {"a": g(1.0)}, step=0)
    for _ in range(2):  # the call and its repetition: refused, the push applied once
        with pytest.raises(UnavailableError, match="leads the slowest live worker by more than the bound"):
            service.push_pull(fast, -1, read_wait_s=0.05)
        assert store.version == 1
    assert service.stats().mode_stats["refused_deadline"] == 2  # the service decides and counts refusals
    service.push_pull(PushRequest("w1", 0, {"a": g(1.0)}, step=0), -1, 0.05)  # the slow one catches up
    outcome, values = service.push_pull(fast, -1, read_wait_s=0.05)
    assert outcome.accepted and outcome.version == 1 and values.values is not None and store.version == 2
    assert store.stats().mode_stats["max_clock_lead"] == 0
    # one answer each: the repetitions of w0's push got its first answer again, numbered as it was
    assert outcome.seq == 1 and store.stats().answers == 2


def test_ssp_refuses_at_once_when_no_waiting_slot_is_free() -> None:
    store = shard(0, "ssp:bound=0", "a", workers=2)
    service = ShardService(store, max_waiters=1)
    # the only slot is taken
    with service._waiter(), pytest.raises(UnavailableError, match="every waiting slot is taken"):
        service.push_pull(PushRequest("w0", 0, {"a": g(1.0)}, step=0), -1, read_wait_s=5.0)
    assert service.stats().mode_stats["refused_no_slot"] == 1


def test_without_the_bound_ssp_lets_a_worker_run_ahead() -> None:
    store = shard(0, "ssp:bound=0", "a", workers=2, enforce_bounds=False)
    service = ShardService(store)
    for step in range(3):
        service.push_pull(PushRequest("w0", step, {"a": g(1.0)}, step=step), -1, read_wait_s=0.05)
    assert store.version == 3 and store.stats().mode_stats["max_clock_lead"] == 3


def test_every_answer_a_worker_records_is_numbered_once_and_a_follower_answers_at_commit() -> None:
    """Answers (PushOutcome.seq, ShardStats.answers): the coordinator numbers each push's answer; a
    follower numbers none at staging (its commit is the answer the worker records: the step's fate, or
    the staging's refusal); the counts survive a snapshot, and a gradient a restore lost is answered
    as dropped (restored)."""
    coord, follower = shard(0, "sync:backup=1", "a"), shard(1, "sync:backup=1", "b")
    ballot = Ballot(0, coord.incarnation)
    for i, w in enumerate(WORKERS[:2]):
        staged = follower.push(w, 0, {"b": g(1.0)}, follower.incarnation, ballot=ballot, worker_index=i)
        assert staged.accepted and staged.seq == 0
    answers = [coord.push(w, 0, {"a": g(1.0)}, coord.incarnation, ballot=ballot, worker_index=i)
               for i, w in enumerate(WORKERS)]
    assert [a.seq for a in answers] == [1, 2, 3] and answers[2].drop is DropReason.LATE
    decisions = coord.decisions_since(0)
    assert decisions is not None
    commits = [follower.commit(w, ballot, decisions, worker_index=i) for i, w in enumerate(WORKERS[:2])]
    assert [c.seq for c in commits] == [1, 2] and all(c.accepted for c in commits)
    # w2 stages after its step was decided: refused at once, unnumbered; its commit gives the refusal
    late = follower.push("w2", 0, {"b": g(1.0)}, follower.incarnation, ballot=ballot, worker_index=2)
    assert late.drop is DropReason.LATE and late.seq == 0
    refused = follower.commit("w2", ballot, decisions, worker_index=2)
    assert refused.drop is DropReason.LATE and refused.seq == 3
    assert follower.stats().answers == 3 and follower.stats().answers_by_worker == {0: 1, 1: 1, 2: 1}
    assert coord.stats().answers == 3 and coord.stats().answers_by_worker == {0: 1, 1: 1, 2: 1}
    # staged, then the follower is restored from a snapshot: the staged gradient is lost, and said so
    ballot1 = Ballot(1, coord.incarnation)
    follower.push("w1", 1, {"b": g(1.0)}, follower.incarnation, ballot=ballot1, worker_index=1)
    follower.restore(follower.snapshot())
    assert follower.stats().answers == 3 and follower.stats().answers_by_worker == {0: 1, 1: 1, 2: 1}
    lost = follower.commit("w1", ballot1, Decisions(coord.incarnation, ()), worker_index=1)
    assert lost.drop is DropReason.RESTORED and lost.seq == 4
    assert follower.stats().answers_by_worker == {0: 1, 1: 2, 2: 1}


def test_a_repeated_staging_vote_or_commit_is_given_its_first_answer_not_a_second() -> None:
    """A staging, a vote or a commit whose answer was lost (its shard died after answering and its backup took
    over) is repeated: it gets the first answer again, numbered as before, and each shard counts one answer."""
    coord, follower = shard(0, "sync", "a", workers=1), shard(1, "sync", "b", workers=1)
    ballot = Ballot(0, coord.incarnation)
    follower.push("w0", 0, {"b": g(2.0)}, follower.incarnation, 5, ballot=ballot, worker_index=0)
    coord.push("w0", 0, {"a": g(2.0)}, coord.incarnation, 5, ballot=ballot, worker_index=0)
    decisions = coord.decisions_since(0)
    assert decisions is not None
    # the staging and the vote of that step, repeated (their shards' primaries died after answering): the
    # first answers again, not "already staged" (a refusal the worker would record) nor a second vote
    restaged = follower.push("w0", 0, {"b": g(2.0)}, follower.incarnation, 5, ballot=ballot, worker_index=0)
    assert restaged.accepted and restaged.seq == 0 and follower.stats().pushes_dropped == 0
    revote = coord.push("w0", 0, {"a": g(2.0)}, coord.incarnation, 5, ballot=ballot, worker_index=0)
    assert revote.accepted and revote.seq == 1 and coord.version == 1 and coord.stats().answers == 1
    first = follower.commit("w0", ballot, decisions, 5, worker_index=0)
    again = follower.commit("w0", ballot, decisions, 5, worker_index=0)
    assert first.accepted and (again, again.seq) == (first, first.seq) == (first, 1)
    assert follower.stats().answers == 1 and follower.version == 1
    np.testing.assert_allclose(follower.values()["b"], -g(2.0))
