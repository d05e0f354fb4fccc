"""The shard adapter of the "shm" transport: mapped worker segments ("attachments") served over
the shard's gRPC server (AttachShm, ShmPushPull) on the shard's one ShardService.

A worker's segment holds its full model values and a region per gradient part. The shard maps
it once (AttachShm), then for every ShmPushPull (over gRPC, or rung on the shard's framed data
connection as the `mapped` request kind this adapter offers there, beside tcp's kinds) hands the
gradients to the service as views of the segment, exactly as a framed push hands its received
arrays (the service copies whatever it keeps), and writes the reply's values into the worker's
regions once. The worker waits for the reply, so an honest worker
never writes a region the shard is reading; a hostile one could change a gradient between the
finite check and the apply, which does no more harm than the large finite gradient it could
send anyway (tokens and roles decide who may push at all). Every offset and length is checked
against the segment before any view is made. A segment the shard cannot map answers
errors.PathNotVisibleError (the client falls back); an attachment gone or replaced answers
errors.AttachAgainError (the client maps a fresh one).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import mmap
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from asyncps.ps.adapter import MAX_WAIT_S, ShardSide, checked_wait, reply_header
from asyncps.ps.service import ShardService

from asyncps.errors import (
    AttachAgainError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PathNotVisibleError,
)
from asyncps.net.framed import FramedKind
from asyncps.net.handlers import Handler
from asyncps.net.rpc import handles_errors
from asyncps.pb import ps_pb2, tensor_pb2
from asyncps.transport import shmseg
from asyncps.wire.codec import (
    Array,
    IndexArray,
    SparseRows,
    TensorAssembler,
    _checked_nbytes,
    dtype_from_proto,
    rows_nbytes,
)
from asyncps.wire.frames import Slice, served_row_slices
from asyncps.wire.proto import outcome_to_proto, push_request, rows_of_request
from asyncps.wire.stream import byte_view

log = logging.getLogger(__name__)

DEFAULT_MAX_ATTACHMENTS = 256
_WHOLE = 1 << 62  # served_row_slices chunk size: every tensor travels whole


@dataclass(frozen=True)
class Region:
    """A tensor in a segment."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def view(self, buffer: mmap.mmap) -> Array:
        """The region as an array over the segment (no copy)."""
        count = self.nbytes // self.dtype.itemsize
        return np.frombuffer(buffer, self.dtype, count, self.offset).reshape(self.shape)


def region_of(chunk: tensor_pb2.TensorChunk, size: int, what: str) -> Region:
    """Check one region of a segment of `size` bytes: dense, known dtype, inside, aligned, exact."""
    if chunk.role != tensor_pb2.DENSE:
        raise InvalidArgumentError(f"{what} {chunk.name!r}: only dense tensors travel through shared memory")
    try:
        dtype = dtype_from_proto(chunk.dtype)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{what} {chunk.name!r}: {exc}") from None
    nbytes = _checked_nbytes(chunk.shape, dtype, size)
    if chunk.nbytes != nbytes:
        raise InvalidArgumentError(f"{what} {chunk.name!r}: {chunk.nbytes} bytes for a {dtype}{list(chunk.shape)} "
                                   f"tensor of {nbytes}")
    if chunk.offset % 8 or chunk.offset < shmseg.TOKEN_BYTES or chunk.offset + nbytes > size:
        raise InvalidArgumentError(f"{what} {chunk.name!r}: bytes [{chunk.offset}, {chunk.offset + nbytes}) are not "
                                   f"an 8-aligned range of the segment's [{shmseg.TOKEN_BYTES}, {size})")
    return Region(chunk.name, dtype, tuple(int(d) for d in chunk.shape), chunk.offset, nbytes)


@dataclass
class Attachment:
    """One worker's mapped segment and where this shard's values go in it."""

    id: int
    worker_id: str
    buffer: mmap.mmap
    values: dict[str, Region]
    # the shard's parts with no region here (read by rows only: every request must ask them by rows)
    unmapped: frozenset[str] = frozenset()
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False

    def close(self) -> None:
        """Unmap, or, while a request still holds views of the gradients, leave the unmapping to
        the last of them (an mmap with exported buffers is unmapped when it is freed)."""
        with self.lock:
            if not self.closed:
                self.closed = True
                with contextlib.suppress(BufferError):
                    self.buffer.close()

    def read_grads(self, chunks: Iterable[tensor_pb2.TensorChunk]) -> dict[str, Array]:
        """The gradients as read-only views of the segment (caller holds the lock)."""
        grads: dict[str, Array] = {}
        for chunk in chunks:
            region = region_of(chunk, len(self.buffer), "gradient")
            if region.name in grads:
                raise InvalidArgumentError(f"gradient {region.name!r} named twice")
            view = region.view(self.buffer)
            view.flags.writeable = False
            grads[region.name] = view
        return grads

    def write_values(self, values: Mapping[str, Array]) -> None:
        """Write the reply's values into the worker's regions (caller holds the lock)."""
        missing = sorted(set(values) - set(self.values))
        if missing:
            raise AttachAgainError(f"attachment has no region for {missing}: attach again")
        for name, value in values.items():
            region = self.values[name]
            if value.shape != region.shape or value.dtype != region.dtype:
                raise AttachAgainError(f"{name}: the shard holds {value.dtype}{list(value.shape)}, the "
                                              f"attachment {region.dtype}{list(region.shape)}: attach again")
            np.copyto(region.view(self.buffer), value)


class Attachments:
    """The mapped segments of one shard, at most one per worker, at most max_attachments."""

    def __init__(self, max_attachments: int = DEFAULT_MAX_ATTACHMENTS) -> None:
        self._lock = threading.Lock()
        self._by_id: collections.OrderedDict[int, Attachment] = collections.OrderedDict()
        self._ids = itertools.count(1)
        self._max = max_attachments

    def attach(
        self, worker_id: str, segment: str, size: int, token: bytes, regions: Sequence[tensor_pb2.TensorChunk],
        variables: Mapping[str, tuple[np.dtype[Any], tuple[int, ...]]],
    ) -> int:
        """Map a worker's segment; check every region against it and against the shard's variables (a
        region for some of them: the others are read by rows)."""
        if not shmseg.TOKEN_BYTES <= size <= shmseg.MAX_SEGMENT_BYTES:
            raise InvalidArgumentError(f"segment_bytes {size} outside [{shmseg.TOKEN_BYTES}, "
                                       f"{shmseg.MAX_SEGMENT_BYTES}]")
        values: dict[str, Region] = {}
        for chunk in regions:
            region = region_of(chunk, size, "value")
            if region.name in values:
                raise InvalidArgumentError(f"value {region.name!r} named twice")
            if region.name not in variables:
                raise NotFoundError(f"unknown variable {region.name!r} on this shard")
            dtype, shape = variables[region.name]
            if (region.dtype, region.shape) != (dtype, shape):
                raise InvalidArgumentError(f"{region.name}: region {region.dtype}{list(region.shape)} for a variable "
                                           f"{dtype}{list(shape)}")
            values[region.name] = region
        try:
            buffer = shmseg.attach(segment, size, token)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        except (FileNotFoundError, PermissionError) as exc:
            raise PathNotVisibleError(f"segment {segment!r} is not visible from this shard (another host?): "
                                          f"{type(exc).__name__}") from None
        # a part without a region is one the worker reads by rows only (a table too large to map whole)
        attachment = Attachment(next(self._ids), worker_id, buffer, values, frozenset(variables) - frozenset(values))
        evicted = []
        with self._lock:
            for old in [a for a in self._by_id.values() if a.worker_id == worker_id]:
                evicted.append(self._by_id.pop(old.id))
            while len(self._by_id) >= self._max:
                evicted.append(self._by_id.popitem(last=False)[1])
            self._by_id[attachment.id] = attachment
        for old in evicted:
            old.close()
        return attachment.id

    def get(self, attachment_id: int, worker_id: str) -> Attachment:
        """The attachment of this worker; AttachAgainError when gone."""
        with self._lock:
            attachment = self._by_id.get(attachment_id)
        if attachment is None or attachment.worker_id != worker_id:
            raise AttachAgainError(f"no shared-memory attachment {attachment_id} of {worker_id!r}: attach again")
        return attachment

    def close(self) -> None:
        """Unmap everything."""
        with self._lock:
            attachments, self._by_id = list(self._by_id.values()), collections.OrderedDict()
        for attachment in attachments:
            attachment.close()


class ShmAdapter:
    """The shard side of "shm": AttachShm and ShmPushPull over the service (a ShardAdapter)."""

    def __init__(self, side: ShardSide, max_attachments: int = DEFAULT_MAX_ATTACHMENTS) -> None:
        self._service: ShardService = side.service
        self._max_request_bytes = side.framed_request_bytes
        self._attachments = Attachments(max_attachments)
        # the doorbell: a worker with a data connection rings through it instead of ShmPushPull
        side.offer(FramedKind("mapped", "ShmPushPull", self._rung, tensors=True))

    def _rung(self, request: ps_pb2.FramedRequest, tensors: Sequence[Array]) -> tuple[ps_pb2.FramedReply, list[Slice]]:
        """The doorbell's answer: the exchange's header (the values are in the segment), and the rows of a
        row read (asked by the request's ROW_IDS tensors, the only tensors it may carry) as its tensors."""
        assembler = TensorAssembler(self._max_request_bytes)
        for chunk, array in zip(request.tensors, tensors, strict=True):
            assembler.add(chunk, byte_view(array))
        rows = rows_of_request(assembler, "mapped")
        self._service.count("shm", pushed=assembler.total_bytes)
        header, served = self.exchange(request.mapped, MAX_WAIT_S, rows)
        if not served:
            return ps_pb2.FramedReply(values=header), []
        self._service.count("shm", pulled=rows_nbytes(served))
        return ps_pb2.FramedReply(values=header), list(served_row_slices(served, _WHOLE))

    @handles_errors
    def AttachShm(self, request: ps_pb2.AttachShmRequest, context: grpc.ServicerContext) -> ps_pb2.AttachShmResponse:
        """Map a worker's shared-memory segment (same host only)."""
        stats = self._service.stats()
        if not stats.initialized:
            raise FailedPreconditionError(f"shard {self._service.shard_index} is not initialized yet")
        variables = {name: (np.dtype(dtype), tuple(shape)) for name, dtype, shape in stats.variables}
        attachment = self._attachments.attach(request.worker_id, request.segment, request.segment_bytes,
                                              request.token, request.values, variables)
        log.info("attached the shared memory of %s (%d bytes)", request.worker_id, request.segment_bytes)
        return ps_pb2.AttachShmResponse(attachment=attachment)

    @handles_errors
    def ShmPushPull(self, request: ps_pb2.ShmPushPullRequest, context: grpc.ServicerContext) -> ps_pb2.PullHeader:
        """PushPull with the tensors in an attached segment; only the headers travel here."""
        remaining = context.time_remaining()
        return self.exchange(request, MAX_WAIT_S if remaining is None else max(0.0, remaining - 1.0))[0]

    def exchange(self, request: ps_pb2.ShmPushPullRequest, max_wait_s: float,
                 rows: Mapping[str, IndexArray] | None = None) -> tuple[ps_pb2.PullHeader, Mapping[str, SparseRows]]:
        """One push-pull (or pull) through an attached segment, held at most max_wait_s: the answer of
        ShmPushPull over gRPC and of the `mapped` request on the framed data connection (the doorbell),
        with the rows read (`rows`: only the doorbell carries them; every part without a region must be
        among them)."""
        header = request.header
        attachment = self._attachments.get(request.attachment, header.worker_id)
        self._service.check_rows(rows or {})  # an unknown part is NOT_FOUND, whatever the segment maps
        unread = sorted(attachment.unmapped - set(rows or {}))
        if unread:
            raise InvalidArgumentError(f"parts {unread} have no region in the segment: a request through it reads "
                                       "them by rows")
        limit = checked_wait("read_wait_s", header.read_wait_s, max_wait_s)
        push_result: ps_pb2.PushResult | None = None
        if request.pull_only:
            if request.grads:
                raise InvalidArgumentError("a pull_only request carries no gradients")
            reply = self._service.pull(header.worker_id, header.pull_if_newer_than, limit, rows)
        else:
            with attachment.lock:
                if attachment.closed:
                    raise AttachAgainError("the shared-memory attachment was replaced: attach again")
                grads = attachment.read_grads(request.grads)
            self._service.count("shm", pushed=sum(g.nbytes for g in grads.values()))
            push = push_request(header, grads)
            outcome, reply = self._service.push_pull(push, header.pull_if_newer_than, limit, rows)
            push_result = outcome_to_proto(outcome)
        if reply.values is not None:
            with attachment.lock:
                if attachment.closed:
                    raise AttachAgainError("the shared-memory attachment was replaced: attach again")
                attachment.write_values(reply.values)
            self._service.count("shm", pulled=sum(v.nbytes for v in reply.values.values()))
        return reply_header(reply, push_result, self._service.shard_index), reply.rows or {}

    def rpc_handlers(self) -> dict[str, Handler]:
        """AttachShm and ShmPushPull, protobuf both ways."""
        return {
            "AttachShm": grpc.unary_unary_rpc_method_handler(
                self.AttachShm, request_deserializer=ps_pb2.AttachShmRequest.FromString,
                response_serializer=ps_pb2.AttachShmResponse.SerializeToString),
            "ShmPushPull": grpc.unary_unary_rpc_method_handler(
                self.ShmPushPull, request_deserializer=ps_pb2.ShmPushPullRequest.FromString,
                response_serializer=ps_pb2.PullHeader.SerializeToString),
        }

    def start(self) -> None:
        """Nothing beyond the gRPC server: segments are mapped as workers attach them."""

    def close(self) -> None:
        """Unmap every attached segment."""
        self._attachments.close()


__all__ = ["Attachment", "Attachments", "Region", "ShmAdapter", "region_of"]
