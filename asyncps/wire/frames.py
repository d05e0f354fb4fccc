"""Raw frames: the lean wire format of every tensor stream (Initialize, Pull, Push, PushPull,
Snapshot, Restore).

A frame is one gRPC stream message, written and read by custom (de)serializers instead of
protobuf's, so tensor bytes never pass through protobuf objects:

    u32 little-endian H | H bytes: the stream's protobuf message (e.g. PushChunk) | payload

The message's TensorChunks carry `nbytes` and no `data`; their bytes follow in the payload in
the order the chunks are listed, each starting at the next multiple of 8 bytes from the start
of the frame (zero padding between), so a receiver can view float64 data in place. The payload
ends exactly where the last chunk ends. Any language with protobuf can read and write it.

A row read's tensors ride the same frames (asyncps.wire.codec.TensorAssembler.finish_request and
finish_reply): a request names the rows it asks of a part as a ROW_IDS chunk (int64 [k]); the
reply serves that part as a SPARSE_VALUES chunk ([k, ...], the rows in the order asked) and a
ROW_CLOCKS chunk (int64 [k]), never as a DENSE one; a push's sparse gradient may add a ROW_CLOCKS
chunk beside its SPARSE_INDICES (the clocks its rows were read at).

Sending copies each byte once (gRPC takes only `bytes`); receiving checks every length before
making a view, and a tensor that arrives whole in one frame is used in place (no copy).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
from google.protobuf.message import DecodeError

from asyncps.errors import InvalidArgumentError
from asyncps.pb import tensor_pb2
from asyncps.wire.codec import (
    DEFAULT_CHUNK_BYTES,
    Array,
    Gradient,
    IndexArray,
    SparseRows,
    TensorAssembler,
    dtype_to_proto,
    wire_array,
)

ALIGN = 8
_LENGTH = struct.Struct("<I")
_PADDING = bytes(ALIGN)
M = TypeVar("M")


class FrameMessage(Protocol):
    """A stream message: an optional header and TensorChunks (PushChunk, PullChunk, ...)."""

    tensors: Any

    def HasField(self, name: str) -> bool:
        """Whether a singular field is set."""

    def SerializeToString(self) -> bytes:
        """The message's protobuf encoding."""


@dataclass(frozen=True)
class Slice:
    """A byte range of one tensor, still in the sender's memory (nothing copied yet)."""

    name: str
    role: int
    dtype: int
    shape: tuple[int, ...]
    offset: int
    data: memoryview

    def chunk(self) -> tensor_pb2.TensorChunk:
        """The chunk that announces these bytes in a frame's message."""
        return tensor_pb2.TensorChunk(name=self.name, role=self.role,  # type: ignore[arg-type]
                                      dtype=self.dtype, shape=self.shape,  # type: ignore[arg-type]
                                      offset=self.offset, nbytes=self.data.nbytes)


def tensor_slices(
    name: str, array: Array, role: int = tensor_pb2.DENSE, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[Slice]:
    """Cut one array into slices of at most chunk_bytes (an empty array is one empty slice)."""
    arr = wire_array(array)
    dtype = int(dtype_to_proto(arr.dtype))
    raw = memoryview(arr.reshape(-1)).cast("B")  # type: ignore[arg-type]
    total = raw.nbytes
    offset = 0
    while True:
        end = min(offset + chunk_bytes, total)
        yield Slice(name, role, dtype, tuple(arr.shape), offset, raw[offset:end])
        offset = end
        if offset >= total:
            return


def gradient_slices(name: str, grad: Gradient, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[Slice]:
    """Slices of one gradient: dense, or the indices and values halves of a sparse one (then the clocks
    its rows were read at, ROW_CLOCKS, when it has them)."""
    if isinstance(grad, SparseRows):
        yield from tensor_slices(name, grad.indices, tensor_pb2.SPARSE_INDICES, chunk_bytes)
        yield from tensor_slices(name, grad.values, tensor_pb2.SPARSE_VALUES, chunk_bytes)
        if grad.clocks is not None:
            yield from tensor_slices(name, grad.clocks, tensor_pb2.ROW_CLOCKS, chunk_bytes)
    else:
        yield from tensor_slices(name, grad, tensor_pb2.DENSE, chunk_bytes)


def row_id_slices(rows: Mapping[str, IndexArray], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[Slice]:
    """Slices of a row read's request: the ids asked of each part (ROW_IDS, int64 [k]; sent as given,
    never cast: ids of another dtype are the shard's to refuse, not silently truncated here)."""
    for name, ids in rows.items():
        yield from tensor_slices(name, np.asarray(ids), tensor_pb2.ROW_IDS, chunk_bytes)


def served_row_slices(rows: Mapping[str, SparseRows], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[Slice]:
    """Slices of a row read's reply: per part, the rows served (SPARSE_VALUES [k, ...]) and their clocks
    (ROW_CLOCKS int64 [k]); not the ids, which the reader asked for."""
    for name, served in rows.items():
        yield from tensor_slices(name, served.values, tensor_pb2.SPARSE_VALUES, chunk_bytes)
        clocks = served.clocks if served.clocks is not None else np.zeros(served.indices.shape, np.int64)
        yield from tensor_slices(name, clocks, tensor_pb2.ROW_CLOCKS, chunk_bytes)


def _pad(position: int) -> int:
    return -position % ALIGN


def encode_frame(message: FrameMessage, data: Iterable[memoryview]) -> bytes:
    """One frame: the message, then each chunk's bytes at the next multiple of 8."""
    head = message.SerializeToString()
    parts: list[bytes | memoryview] = [_LENGTH.pack(len(head)), head]
    position = _LENGTH.size + len(head)
    for view in data:
        pad = _pad(position)
        if pad:
            parts.append(_PADDING[:pad])
        parts.append(view)
        position += pad + view.nbytes
    return b"".join(parts)


def frames(
    make: Callable[[Any, list[tensor_pb2.TensorChunk]], M],
    header: Any,
    slices: Iterable[Slice],
    frame_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[bytes]:
    """Encode a stream: `make(header, chunks)` for the first frame, `make(None, chunks)` after,
    each frame holding at most frame_bytes of tensor data (at least one slice); a stream without
    tensors is one header-only frame."""
    batch: list[Slice] = []
    size = 0
    first = True
    for piece in slices:
        if batch and size + piece.data.nbytes > frame_bytes:
            yield encode_frame(make(header if first else None, [s.chunk() for s in batch]),  # type: ignore[arg-type]
                               [s.data for s in batch])
            first, batch, size = False, [], 0
        batch.append(piece)
        size += piece.data.nbytes
    if batch or first:
        yield encode_frame(make(header if first else None, [s.chunk() for s in batch]),  # type: ignore[arg-type]
                           [s.data for s in batch])


def decode_frame(frame: bytes, parse: Callable[[bytes], M], what: str) -> tuple[M, list[memoryview]]:
    """Split a frame into its message and one view per chunk, checking every length first."""
    view = memoryview(frame)
    if view.nbytes < _LENGTH.size:
        raise InvalidArgumentError(f"{what}: frame of {view.nbytes} bytes is shorter than its length prefix")
    (length,) = _LENGTH.unpack_from(view)
    position = _LENGTH.size + length
    if position > view.nbytes:
        raise InvalidArgumentError(f"{what}: frame header of {length} bytes in a frame of {view.nbytes}")
    try:
        message = parse(bytes(view[_LENGTH.size:position]))
    except DecodeError:
        raise InvalidArgumentError(f"{what}: frame header is not a valid message") from None
    data: list[memoryview] = []
    for chunk in message.tensors:  # type: ignore[attr-defined]
        if chunk.data:
            raise InvalidArgumentError(f"{what}: {chunk.name}: chunk bytes belong after the message, not in it")
        if chunk.nbytes < 0:
            raise InvalidArgumentError(f"{what}: {chunk.name}: negative nbytes {chunk.nbytes}")
        position += _pad(position)
        end = position + chunk.nbytes
        if end > view.nbytes:
            raise InvalidArgumentError(
                f"{what}: {chunk.name}: chunk of {chunk.nbytes} bytes runs past the end of the frame")
        data.append(view[position:end])
        position = end
    if position != view.nbytes:
        raise InvalidArgumentError(f"{what}: {view.nbytes - position} bytes after the last chunk of the frame")
    return message, data


def read_frames(
    stream: Iterable[bytes], parse: Callable[[bytes], M], assembler: TensorAssembler, what: str
) -> Any:
    """Consume a stream of frames into the assembler; return the header, which must be in the
    first frame and only there (InvalidArgumentError otherwise)."""
    header = None
    for i, frame in enumerate(stream):
        message, data = decode_frame(frame, parse, what)
        if message.HasField("header"):  # type: ignore[attr-defined]
            if i > 0:
                raise InvalidArgumentError(f"{what}: header in frame {i}; it belongs in the first frame only")
            header = message.header  # type: ignore[attr-defined]
        elif i == 0:
            raise InvalidArgumentError(f"{what}: the first frame has no header")
        for chunk, view in zip(message.tensors, data, strict=True):  # type: ignore[attr-defined]
            assembler.add(chunk, view)
    if header is None:
        raise InvalidArgumentError(f"{what}: empty stream (no header)")
    return header


def parser(message_type: type[M]) -> Callable[[bytes], M]:
    """A parse function for decode_frame from a protobuf message class."""
    def parse(raw: bytes) -> M:
        return message_type.FromString(raw)  # type: ignore[attr-defined, no-any-return]

    return parse


def identity(frame: bytes) -> bytes:
    """The gRPC (de)serializer of raw frames: they are bytes already."""
    return frame


__all__ = ["ALIGN", "Slice", "decode_frame", "encode_frame", "frames", "gradient_slices", "identity", "parser",
           "read_frames", "row_id_slices", "served_row_slices", "tensor_slices"]
