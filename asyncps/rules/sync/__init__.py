"""The multi-shard sync protocol in one home: shard 0 decides each step's set of pushes, the
other shards apply exactly those sets, and a checkpoint cut commits them on held followers.

1. stage: a worker pushes its parts to every follower with a Ballot (the coordinator version and
   incarnation it computed from); a follower only keeps them (`follower.SyncFollower`);
2. vote: then it pushes its part to shard 0, whose mode's `coordinator.Coordinator` decides which
   pushes make each step (`bsp.SyncConsistency`: the first live - backup of a version) and
   remembers that set; every gradient that can be in a set is already staged on every follower;
3. commit: shard 0's reply carries the Decisions since the worker's step; the worker hands them to
   each follower with its pull (`client.coordinated_step`), which applies every new decided step
   in order;
4. cut: while every shard is held, the chief reads shard 0's decisions and has each follower
   commit them (`cut.catch_up`), so the values read are one model.

On a shard the mode owns its side of the protocol through the `Consistency` hooks the store calls
(`commit`, `decisions`, `hold`, `defers_answer`): the coordinator answers `decisions`, a follower
takes `commit` and `hold`; the store never names either.

Modules: `types` (the messages), `steps` (a step's gradients), `coordinated` (the interface of a
coordinated mode: `CoordinatedMode`, `Coordinator`), `follower`, `bsp` (the sync mode), `client`
(the worker's step), `cut` (the chief's side), and the K-variants of Dutta et al. 2018, one file
each (`k_async`, `k_batch_sync`, `k_batch_async`). A coordinated mode is one file here with its
coordinator and spec, and a registration line in asyncps.rules.modes; a mode whose sets take stale
gradients or several of one worker names pushes in them (`types.push_name`) and says so in its
spec's `follow_rule` (`follower.FollowRule`).

Only the types are imported here: the modules above import the rules and the wire, which import
these types.
"""

from __future__ import annotations

from asyncps.rules.sync.types import Ballot, Decisions, Held, Resolution, SyncStep

__all__ = ["Ballot", "Decisions", "Held", "Resolution", "SyncStep"]
