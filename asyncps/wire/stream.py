"""Raw frames over a byte stream (the framed data connection, asyncps.net.framed): one length prefix, then one frame.

    u32 little-endian N | N bytes: a frame in asyncps.wire.frames' layout
                          (u32 H | H bytes: a FramedRequest or FramedReply | tensor bytes, 8-aligned)

Each tensor travels whole in one frame (no chunking: a stream needs no message-size cap), its
bytes received with `recv_into` straight into the array the caller picks for it and sent from
memoryviews over the arrays, with no per-tensor `bytes` object on either side. Every length is
checked against the caller's limits before anything is allocated or received: N before the
header is read, the header's size before it is parsed, each tensor's place inside N before its
bytes are read. A broken frame (FrameError) leaves the stream out of step: the reader replies
once and closes the connection.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from google.protobuf.message import DecodeError

from asyncps.errors import InvalidArgumentError, ResourceExhaustedError
from asyncps.pb import tensor_pb2
from asyncps.wire.codec import Array
from asyncps.wire.frames import ALIGN, Slice

M = TypeVar("M")
_U32 = struct.Struct("<I")
_PADDING = bytes(ALIGN)
MAX_FRAME_BYTES = (1 << 32) - 1  # what a u32 prefix can say
DEFAULT_MAX_HEADER_BYTES = 1 << 20  # headers are names, shapes and versions: far below this
_IOV_MAX = 512  # buffers per sendmsg call (POSIX guarantees 16, Linux allows 1024)


class FrameError(InvalidArgumentError):
    """A frame that breaks the format or the limits; the stream is out of step after it."""


class FrameTooLarge(ResourceExhaustedError):
    """A frame or header longer than the reader's limit (nothing of it was read; the stream is
    out of step after it too)."""


BROKEN_FRAME = (FrameError, FrameTooLarge)  # what leaves a stream out of step


class StreamClosed(ConnectionError):
    """The peer closed the connection (at a frame boundary or inside a frame)."""


@dataclass(frozen=True)
class Place:
    """One tensor of a frame being read: its chunk and the padding before its bytes."""

    chunk: tensor_pb2.TensorChunk
    pad: int


def _pad(position: int) -> int:
    return -position % ALIGN


def byte_view(array: Array) -> memoryview:
    """A flat, writable-if-the-array-is, byte view of a C-contiguous array (0-d included)."""
    return memoryview(array.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def recv_exactly(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view` from the socket; StreamClosed at EOF, TimeoutError past the deadline."""
    filled, total = 0, view.nbytes
    while filled < total:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"peer sent {filled} of {total} bytes in time")
            sock.settimeout(left)
        got = sock.recv_into(view[filled:], total - filled)
        if got == 0:
            raise StreamClosed(f"peer closed the connection after {filled} of {total} bytes")
        filled += got


def read_head(
    sock: socket.socket, parse: Callable[[bytes], M], what: str, max_frame_bytes: int,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES, deadline: float | None = None,
    first_byte: Callable[[], None] | None = None, then_within_s: float | None = None,
) -> tuple[M, list[Place]]:
    """Read a frame's prefix and message and check where every tensor's bytes lie in it; the
    bytes themselves are left on the stream for read_payload. first_byte runs once the first
    byte of the frame is in (the reader is no longer idle). `deadline` is for the first byte; with
    then_within_s, the rest of the head must follow within that many seconds of it (a frame that
    starts just before an idle deadline is read, not cut off), else by `deadline` too."""
    prefix = bytearray(8)
    view = memoryview(prefix)
    recv_exactly(sock, view[:1], deadline)
    if first_byte is not None:
        first_byte()
    if then_within_s is not None:
        deadline = time.monotonic() + then_within_s
    recv_exactly(sock, view[1:4], deadline)
    (total,) = _U32.unpack_from(prefix)
    if total > max_frame_bytes:
        raise FrameTooLarge(f"{what}: frame of {total} bytes, limit {max_frame_bytes}")
    if total < _U32.size:
        raise FrameError(f"{what}: frame of {total} bytes is shorter than its header length")
    recv_exactly(sock, view[4:8], deadline)
    (length,) = _U32.unpack_from(prefix, 4)
    if length > max_header_bytes:
        raise FrameTooLarge(f"{what}: frame header of {length} bytes, limit {max_header_bytes}")
    if _U32.size + length > total:
        raise FrameError(f"{what}: frame header of {length} bytes in a frame of {total}")
    head = bytearray(length)
    recv_exactly(sock, memoryview(head), deadline)
    try:
        message = parse(bytes(head))
    except DecodeError:
        raise FrameError(f"{what}: frame header is not a valid message") from None
    places: list[Place] = []
    position = _U32.size + length
    for chunk in message.tensors:  # type: ignore[attr-defined]
        if chunk.data:
            raise FrameError(f"{what}: {chunk.name}: chunk bytes belong after the message, not in it")
        if chunk.nbytes < 0 or chunk.offset != 0:
            raise FrameError(f"{what}: {chunk.name}: a stream frame carries whole tensors "
                             f"(nbytes {chunk.nbytes}, offset {chunk.offset})")
        pad = _pad(position)
        position += pad + chunk.nbytes
        if position > total:
            raise FrameError(f"{what}: {chunk.name}: tensor of {chunk.nbytes} bytes runs past the end of the frame")
        places.append(Place(chunk, pad))
    if position != total:
        raise FrameError(f"{what}: {total - position} bytes after the last tensor of the frame")
    return message, places


def read_payload(
    sock: socket.socket, places: Sequence[Place], destination: Callable[[tensor_pb2.TensorChunk], Array],
    deadline: float | None = None,
) -> list[Array]:
    """Receive each tensor's bytes straight into destination(chunk) (a C-contiguous array of
    exactly chunk.nbytes bytes, checked) and return those arrays in order."""
    scratch = memoryview(bytearray(ALIGN))
    arrays = []
    for place in places:
        if place.pad:
            recv_exactly(sock, scratch[:place.pad], deadline)
        target = destination(place.chunk)
        if target.nbytes != place.chunk.nbytes or not target.flags.c_contiguous:
            raise FrameError(f"{place.chunk.name}: no {place.chunk.nbytes}-byte destination")
        if target.nbytes:
            recv_exactly(sock, byte_view(target), deadline)
        arrays.append(target)
    return arrays


def frame_parts(message: Any, tensors: Sequence[Slice]) -> list[bytes | memoryview]:
    """The buffers of one prefixed frame: the message announces each slice, its bytes follow."""
    for piece in tensors:
        message.tensors.append(piece.chunk())
    head = message.SerializeToString()
    parts: list[bytes | memoryview] = [b"", _U32.pack(len(head)), head]
    position = _U32.size + len(head)
    for piece in tensors:
        pad = _pad(position)
        if pad:
            parts.append(_PADDING[:pad])
        if piece.data.nbytes:
            parts.append(piece.data)
        position += pad + piece.data.nbytes
    if position > MAX_FRAME_BYTES:
        raise ResourceExhaustedError(f"a frame of {position} bytes: at most {MAX_FRAME_BYTES} travel in one")
    parts[0] = _U32.pack(position)
    return parts


def send_parts(sock: socket.socket, parts: Sequence[bytes | memoryview]) -> None:
    """Send every buffer in order without joining them (sendmsg; sendall one by one over TLS)."""
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg over TLS: small parts joined, tensors as they are
        small: list[bytes | memoryview] = []
        for part in parts:
            if len(part) < 65536:
                small.append(part)
                continue
            if small:
                sock.sendall(b"".join(small))
                small = []
            sock.sendall(part)
        if small:
            sock.sendall(b"".join(small))
        return
    pending = [memoryview(p).cast("B") for p in parts if len(p)]
    while pending:
        sent = sock.sendmsg(pending[:_IOV_MAX])
        while sent and pending:
            if sent >= pending[0].nbytes:
                sent -= pending[0].nbytes
                pending.pop(0)
            else:
                pending[0] = pending[0][sent:]
                sent = 0


def send_frame(sock: socket.socket, message: Any, tensors: Sequence[Slice] = ()) -> None:
    """Send one prefixed frame (see frame_parts)."""
    send_parts(sock, frame_parts(message, tensors))


__all__ = ["BROKEN_FRAME", "DEFAULT_MAX_HEADER_BYTES", "MAX_FRAME_BYTES", "FrameError", "FrameTooLarge", "Place",
           "StreamClosed", "byte_view", "frame_parts", "read_head", "read_payload", "recv_exactly", "send_frame",
           "send_parts"]
