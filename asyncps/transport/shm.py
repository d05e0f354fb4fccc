"""The same-host transport: gRPC carries the headers, shared memory carries the tensors.

A worker made by connect_model keeps its whole model in one arena (shmseg.Arena: every
variable's buffer and a region per dense gradient part) that each of its shards maps (AttachShm,
proven by a token), so a shard writes its values, sliced rows included, where the worker computes
from them. Otherwise (no arena, or a shard that must map again after the arena's name is gone),
per shard, the worker creates a segment holding that shard's value parts and gradient regions.
Every name is unlinked once mapped: nothing is left in /dev/shm whatever happens to either process
later (the arena's base name only once all its shards have mapped it: see shmseg.Arena). A push
then writes the gradients into the segment and sends only a small ShmPushPull; the shard copies
them out, decides exactly as for a framed push, and writes the new values back into the
segment. That small request rings the shard over its framed data connection (asyncps.net.framed, the
`mapped` request kind, beside the "tcp" channel's and never through it) when the shard has a data
port (the doorbell: no gRPC call per step), else as the unary ShmPushPull call. When the segment
cannot be seen (another host) the shard says so with a typed outcome (errors.PathNotVisibleError)
and this path hands every call to its fallback (the next path of "auto"; an error when shm was asked
for by name); when a restarted shard has forgotten the mapping (errors.AttachAgainError), a fresh
segment is attached. Sparse gradients always travel through the fallback (gRPC frames). A row read
maps no region for the parts it reads by rows (the worker's buffers name only the parts read whole): their
ids ride the doorbell as ROW_IDS tensors and the rows come back as its reply's tensors (no doorbell: the
fallback). The control calls are not this path's: see ShardClient.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from asyncps.errors import AttachAgainError, FailedPreconditionError, PathNotVisibleError
from asyncps.net.framed import DataPortUnavailable, FramedConnection, reply_destination
from asyncps.pb import ps_pb2, tensor_pb2
from asyncps.placement import Placement
from asyncps.transport import shmseg
from asyncps.transport.base import ClientSetup, DataPath
from asyncps.transport.grpc_shard import FramesDataPath, received_values
from asyncps.transport.link import ShardLink, data_connection
from asyncps.wire.codec import Array, Gradient, IndexArray, SparseRows, dtype_to_proto
from asyncps.wire.frames import row_id_slices
from asyncps.wire.proto import decisions_from_proto, outcome_from_proto, push_header
from asyncps.wire.shard import PushOutcome, PushRequest, ShardValues
from asyncps.wire.stream import FrameError

log = logging.getLogger(__name__)

T = TypeVar("T")
_NEVER_NEWER = (1 << 63) - 1  # pull_if_newer_than of a push: no values come back
_WHOLE = 1 << 62  # row_id_slices chunk size: every tensor travels whole
# the answer to a rung doorbell: the reply's header and the rows served (None: no row asked)
Rung = tuple[ps_pb2.PullHeader, Mapping[str, SparseRows] | None]


@dataclass(frozen=True)
class _Layout:
    """Where each value and gradient of one shard lives in its segment."""

    values: dict[str, tuple[int, np.dtype[Any], tuple[int, ...]]]
    grads: dict[str, tuple[int, np.dtype[Any], tuple[int, ...]]]
    size: int

    @classmethod
    def of(cls, parts: Mapping[str, Array]) -> _Layout:
        position = shmseg.align(shmseg.TOKEN_BYTES)
        values: dict[str, tuple[int, np.dtype[Any], tuple[int, ...]]] = {}
        grads: dict[str, tuple[int, np.dtype[Any], tuple[int, ...]]] = {}
        for table in (values, grads):
            for name, like in sorted(parts.items()):
                table[name] = (position, like.dtype, tuple(like.shape))
                position = shmseg.align(position + like.nbytes)
        return cls(values, grads, max(position, shmseg.ALIGN))

    @staticmethod
    def chunk(name: str, where: tuple[int, np.dtype[Any], tuple[int, ...]]) -> tensor_pb2.TensorChunk:
        offset, dtype, shape = where
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return tensor_pb2.TensorChunk(name=name, role=tensor_pb2.DENSE, dtype=dtype_to_proto(dtype), shape=shape,
                                      offset=offset, nbytes=nbytes)


class _Mapping:
    """One segment the shard has mapped: the arrays over its value and gradient regions and the
    shard's attachment id."""

    def __init__(self, layout: _Layout, attachment: int, values: dict[str, Array], grads: dict[str, Array],
                 owner: object) -> None:
        self.layout = layout
        self.attachment = attachment
        self.values = values
        self.grads = grads
        self.owner = owner  # what keeps the memory mapped (the segment or the arena)
        self.grad_chunks = {name: _Layout.chunk(name, w) for name, w in layout.grads.items()}

    @classmethod
    def over(cls, segment: shmseg.Segment, layout: _Layout, attachment: int) -> _Mapping:
        """Views of this path's own segment."""
        def view(where: tuple[int, np.dtype[Any], tuple[int, ...]]) -> Array:
            offset, dtype, shape = where
            count = int(np.prod(shape, dtype=np.int64))
            return np.frombuffer(segment.buffer, dtype, count, offset).reshape(shape)

        return cls(layout, attachment, {name: view(w) for name, w in layout.values.items()},
                   {name: view(w) for name, w in layout.grads.items()}, segment)


class ShmDataPath:
    """A shard on the same host: a DataPath with gRPC headers over the shard's link and the
    tensors in shared memory; `fallback` carries what the segment cannot (sparse gradients, a
    shard on another host)."""

    def __init__(self, link: ShardLink, fallback: DataPath, required: bool = False,
                 doorbell: FramedConnection | None = None, arena: shmseg.Arena | None = None) -> None:
        self.address = link.address
        # the worker's arena (asyncps.transport.connect_model): when the buffers lie in it, the shard
        # writes the values straight into them and the gradients go to regions of it kept for this path
        self._arena = arena
        self._arena_grads: dict[str, tuple[int, Array]] = {}
        self._settled = False  # told the arena this path attached once (or gave up on shared memory)
        self._link = link
        self._doorbell = doorbell  # the shard's data port, None: ring with ShmPushPull over gRPC
        self._fallback = fallback
        self._required = required  # asked for by name: a shard that cannot see the segment is an error
        self._lock = threading.Lock()
        self._mapping: _Mapping | None = None
        self._unavailable = False  # the shard cannot see our segments: the fallback from now on
        self._attach = link.channel.unary_unary(link.path("AttachShm"),
                                                request_serializer=ps_pb2.AttachShmRequest.SerializeToString,
                                                response_deserializer=ps_pb2.AttachShmResponse.FromString)
        self._push_pull = link.channel.unary_unary(link.path("ShmPushPull"),
                                                   request_serializer=ps_pb2.ShmPushPullRequest.SerializeToString,
                                                   response_deserializer=ps_pb2.PullHeader.FromString)

    @property
    def uses_shared_memory(self) -> bool:
        """Whether pushes currently travel through shared memory."""
        return self._mapping is not None

    def _attach_segment(self, worker_id: str, like: Mapping[str, Array]) -> _Mapping | None:
        """A segment the shard maps, shaped like `like`: the worker's arena when every buffer lies in
        it, else a fresh segment of this path's own; None when the shard cannot see it."""
        arena = self._arena
        placed = self._arena_layout(arena, like) if arena is not None else None
        if arena is not None and placed is not None:
            layout, grads = placed
            with arena.named() as name:
                attachment = (self._request_attach(worker_id, name, arena.size, arena.token, layout)
                              if name is not None else False)
            if attachment is not False:
                if not self._settled:
                    self._settled = True
                    arena.settled()
                if attachment is None:
                    return None
                log.info("shard %s: tensors through shared memory (the worker's arena: values written in place)",
                         self.address)
                return _Mapping(layout, attachment, dict(like), grads, arena)
            log.info("shard %s: the worker's arena has no name left to attach again: a segment of this path's own",
                     self.address)
        layout = _Layout.of(like)
        segment = shmseg.create(layout.size)
        try:
            attachment = self._request_attach(worker_id, segment.name, segment.size, segment.token, layout)
        finally:
            segment.unlink()  # mapped by both sides now (or by nobody): the name is not needed
        if attachment is None:
            return None
        log.info("shard %s: tensors through shared memory (%d bytes)", self.address, segment.size)
        return _Mapping.over(segment, layout, attachment)

    def _arena_layout(self, arena: shmseg.Arena, like: Mapping[str, Array]) -> tuple[_Layout, dict[str, Array]] | None:
        """Where `like` (the values) lie in the arena and the arena's gradient regions of this path,
        kept from one attachment to the next; None when a buffer is not in the arena or the arena
        has no room left (this path then uses a segment of its own)."""
        values: dict[str, tuple[int, np.dtype[Any], tuple[int, ...]]] = {}
        for name, buffer in like.items():
            offset = arena.offset_of(buffer)
            if offset is None:
                return None
            values[name] = (offset, buffer.dtype, tuple(buffer.shape))
        grads: dict[str, tuple[int, np.dtype[Any], tuple[int, ...]]] = {}
        arrays: dict[str, Array] = {}
        for name, buffer in like.items():
            kept = self._arena_grads.get(name)
            if kept is None or kept[1].shape != buffer.shape or kept[1].dtype != buffer.dtype:
                try:
                    kept = self._arena_grads[name] = arena.take(tuple(buffer.shape), buffer.dtype)
                except MemoryError as exc:
                    log.warning("shard %s: %s; this path uses a segment of its own", self.address, exc)
                    return None
            grads[name] = (kept[0], buffer.dtype, tuple(buffer.shape))
            arrays[name] = kept[1]
        return _Layout(values, grads, arena.size), arrays

    def _request_attach(self, worker_id: str, name: str, size: int, token: bytes, layout: _Layout) -> int | None:
        """AttachShm: the shard maps the segment `name` (and unlinks the name); the attachment id, or
        None when the shard cannot see it (the fallback from now on)."""
        request = ps_pb2.AttachShmRequest(
            worker_id=worker_id, segment=name, segment_bytes=size, token=token,
            values=[_Layout.chunk(n, w) for n, w in layout.values.items()])
        try:
            # a restarted shard waiting for the chief to restore it is waited for (FAILED_PRECONDITION)
            reply = self._link.retry(lambda: self._attach(request, timeout=self._link.call_timeout_s),
                                     policy=self._link.restart_policy)
        except PathNotVisibleError as exc:
            if self._required:
                raise
            log.info("shard %s cannot map this worker's shared memory (%s): using the fallback", self.address, exc)
            self._unavailable = True
            return None
        return int(reply.attachment)

    def _mapped(self, worker_id: str, buffers: Mapping[str, Array], call: Callable[[_Mapping], T]) -> T | None:
        """call(mapping) with a segment shaped like `buffers` mapped by the shard (a fresh one after
        a restart); None when the shard cannot see our segments (use frames)."""
        with self._lock:  # one exchange at a time per segment
            for attempt in (0, 1):
                mapping = self._mapping
                if mapping is None or set(mapping.values) != set(buffers):
                    mapping = self._mapping = self._attach_segment(worker_id, buffers)
                    if mapping is None:
                        return None
                try:
                    return call(mapping)
                except AttachAgainError:
                    if attempt:
                        raise
                    self._mapping = None  # a restarted shard: map a fresh segment
            raise AssertionError("unreachable")

    def _through_segment(self, grads: Mapping[str, Gradient], buffers: Mapping[str, Array] | None,
                         rows: Mapping[str, IndexArray] | None) -> bool:
        """Whether a call goes through the segment: dense gradients only, buffers to map, and for a row
        read a doorbell to carry its ids and rows (and a region for every gradient: none of a part read by
        rows); else the fallback."""
        if self._unavailable or buffers is None or any(isinstance(g, SparseRows) for g in grads.values()):
            return False
        return not rows or (self._doorbell is not None and set(grads) <= set(buffers))

    def push_pull(
        self, request: PushRequest, pull_if_newer_than: int = -1, buffers: Mapping[str, Array] | None = None,
        read_wait_s: float = 0.0, rows: Mapping[str, IndexArray] | None = None,
    ) -> tuple[PushOutcome, ShardValues]:
        """Push and pull through the segment, the parts in `rows` as those rows over the doorbell (gRPC
        frames for sparse gradients or another host)."""
        if buffers is not None and self._through_segment(request.grads, buffers, rows):
            done = self._mapped(request.worker_id, buffers,
                                lambda m: self._exchange(m, request, pull_if_newer_than, buffers, read_wait_s,
                                                         rows=rows))
            if done is not None:
                outcome, values = done
                assert outcome is not None
                return outcome, values
        return self._fallback.push_pull(request, pull_if_newer_than, buffers, read_wait_s, rows)

    def pull(self, worker_id: str, if_newer_than: int = -1, buffers: Mapping[str, Array] | None = None,
             wait_timeout_s: float = 0.0, rows: Mapping[str, IndexArray] | None = None) -> ShardValues:
        """The values through the segment (into `buffers`), the parts in `rows` as those rows over the
        doorbell; or over frames."""
        if buffers is not None and self._through_segment({}, buffers, rows):
            request = PushRequest(worker_id, 0, {})
            done = self._mapped(worker_id, buffers, lambda m: self._exchange(m, request, if_newer_than, buffers,
                                                                             wait_timeout_s, True, rows))
            if done is not None:
                return done[1]
        return self._fallback.pull(worker_id, if_newer_than, buffers, wait_timeout_s, rows)

    def push(self, request: PushRequest) -> PushOutcome:
        """One gradient through the segment already mapped (no values come back), else over frames."""
        mapping = self._mapping
        dense = all(not isinstance(g, SparseRows) for g in request.grads.values())
        if mapping is not None and dense and set(request.grads) <= set(mapping.grads):
            buffers = mapping.values
            done = self._mapped(request.worker_id, buffers,
                                lambda m: self._exchange(m, request, _NEVER_NEWER, buffers, 0.0))
            if done is not None and done[0] is not None:
                return done[0]
        return self._fallback.push(request)

    def _exchange(
        self, mapping: _Mapping, request: PushRequest, pull_if_newer_than: int, buffers: Mapping[str, Array],
        read_wait_s: float, pull_only: bool = False, rows: Mapping[str, IndexArray] | None = None,
    ) -> tuple[PushOutcome | None, ShardValues] | None:
        """One request through the segment; None when rows were asked and only gRPC can ring (the caller
        falls back: nothing was sent)."""
        chunks = []
        for name, grad in request.grads.items():
            target = mapping.grads.get(name)
            if target is None:
                raise FailedPreconditionError(f"no shared-memory region for gradient {name!r}")
            assert not isinstance(grad, SparseRows)  # sparse pushes take the frames (push_pull)
            np.copyto(target, grad)
            chunks.append(mapping.grad_chunks[name])
        header = push_header(request, pull_if_newer_than, read_wait_s)
        message = ps_pb2.ShmPushPullRequest(header=header, attachment=mapping.attachment, grads=chunks,
                                            pull_only=pull_only)
        rung = self._ring(request.worker_id, message, read_wait_s, rows)
        if rung is None:
            return None
        reply, served = rung
        values: dict[str, Array] | None = None
        if not reply.not_modified:
            for name, value in mapping.values.items():
                if buffers[name] is not value:
                    np.copyto(buffers[name], value)
            values = dict(buffers)
        outcome = None if pull_only else outcome_from_proto(reply.push)
        decisions = decisions_from_proto(reply.sync) if reply.HasField("sync") else None
        return outcome, ShardValues(reply.version, reply.incarnation, values, reply.waited_s, decisions,
                                    lent=mapping.values, rows=served)

    def _ring(self, worker_id: str, message: ps_pb2.ShmPushPullRequest, wait_s: float,
              rows: Mapping[str, IndexArray] | None = None) -> Rung | None:
        """Tell the shard the segment holds a request; its reply's header and the rows served. Over the
        data connection when the shard has one, else the unary call (None when rows were asked: only the
        data connection carries them). Either way retried on UNAVAILABLE only: a restarted shard answers
        AttachAgainError (FAILED_PRECONDITION) at once."""
        doorbell = self._doorbell
        if doorbell is not None:
            try:
                return ring(doorbell, worker_id, message, wait_s, rows)
            except DataPortUnavailable as exc:  # nothing was sent: ring over gRPC from now on
                log.info("%s: shared-memory requests signalled over gRPC", exc)
                doorbell.close()
                self._doorbell = None
        if rows:
            return None
        header: ps_pb2.PullHeader = self._link.retry(
            lambda: self._push_pull(message, timeout=self._link.call_timeout_s + wait_s))
        return header, None

    @property
    def rings_over_data_connection(self) -> bool:
        """Whether requests are signalled over the shard's data connection (not yet known before the first)."""
        return self._doorbell is not None

    def close(self) -> None:
        """Unmap the segment, close the doorbell and the fallback (the channel is the link's, closed by
        the control)."""
        if self._doorbell is not None:
            self._doorbell.close()
        self._fallback.close()
        with self._lock:
            if self._mapping is not None:
                self._mapping.values.clear()
                self._mapping.grads.clear()
                self._mapping = None


def ring(doorbell: FramedConnection, worker_id: str, message: ps_pb2.ShmPushPullRequest, wait_s: float,
         rows: Mapping[str, IndexArray] | None = None) -> Rung:
    """Ring the shard's doorbell: the `mapped` request on its data connection (with the ids of a row
    read as its ROW_IDS tensors); the reply's header and the rows served (its tensors, None when no row
    was asked). Retried as the gRPC call it replaces: a broken connection or UNAVAILABLE, nothing else."""
    ids = list(row_id_slices(rows or {}, _WHOLE))
    reply, arrays = doorbell.exchange(worker_id, ps_pb2.FramedRequest(mapped=message), ids, reply_destination(),
                                      wait_s=wait_s)
    if reply.WhichOneof("kind") != "values":
        raise FrameError(f"shard {doorbell.address} answered a mapped request with {reply.WhichOneof('kind')}")
    served = received_values(reply.values, reply.tensors, arrays, rows)
    if served.values:  # dense values travel through the segment only
        raise FrameError(f"shard {doorbell.address} sent values {sorted(served.values)} over the doorbell")
    return reply.values, served.rows


def shm_data_path(setup: ClientSetup, fallback: DataPath | None, required: bool) -> DataPath:
    """The registry's factory for "shm": shared memory over the link, with the next path of "auto"
    (or gRPC frames) as the fallback; `required` when shm was asked for by name. The worker's model
    buffers are used in place when they are this transport's arena (shm_model_buffers)."""
    arena = setup.model_buffers if isinstance(setup.model_buffers, shmseg.Arena) else None
    return ShmDataPath(setup.link, fallback or FramesDataPath(setup.link, setup.chunk_bytes), required,
                       doorbell=data_connection(setup.link, setup.security), arena=arena)


def shm_model_buffers(placement: Placement, shards: int) -> shmseg.Arena | None:
    """The registry's model-buffers hook for "shm": one arena for the worker's whole model that its
    `shards` shards map (None where this host cannot make one: the buffers are then the worker's own)."""
    return shmseg.Arena.create(arena_bytes(placement), shards)


def arena_bytes(placement: Placement) -> int:
    """An arena's size for a placement: every variable once (the values) and every part once (its
    gradient region), each aligned."""
    return (2 * sum(shmseg.align(v.nbytes) for v in placement.variables)
            + shmseg.ALIGN * (len(placement.parts) + len(placement.variables)))


__all__ = ["ShmDataPath", "arena_bytes", "ring", "shm_data_path", "shm_model_buffers"]
