"""Raw frames (asyncps/wire/frames.py): round trips, zero-copy receive, alignment, and hostile bytes."""

from __future__ import annotations

import contextlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncps.errors import InvalidArgumentError, ResourceExhaustedError
from asyncps.pb import ps_pb2, tensor_pb2
from asyncps.wire.codec import SparseRows, TensorAssembler
from asyncps.wire.frames import ALIGN, decode_frame, encode_frame, frames, gradient_slices, parser, read_frames

PUSH = parser(ps_pb2.PushChunk)


def _make(header: ps_pb2.PushHeader | None, chunks: list[tensor_pb2.TensorChunk]) -> ps_pb2.PushChunk:
    return ps_pb2.PushChunk(header=header, tensors=chunks)


def _stream(tensors: dict[str, np.ndarray | SparseRows], frame_bytes: int = 1 << 20) -> list[bytes]:
    header = ps_pb2.PushHeader(worker_id="w", base_version=3)
    slices = (s for name, t in tensors.items() for s in gradient_slices(name, t, chunk_bytes=frame_bytes))
    return list(frames(_make, header, slices, frame_bytes))


def _read(stream: list[bytes], **kwargs: object) -> tuple[ps_pb2.PushHeader, dict[str, object]]:
    assembler = TensorAssembler(**kwargs)  # type: ignore[arg-type]
    header = read_frames(stream, PUSH, assembler, "test")
    return header, assembler.finish()


def test_round_trip_of_every_dtype_shape_and_sparse_rows() -> None:
    rng = np.random.default_rng(0)
    tensors: dict[str, np.ndarray | SparseRows] = {
        "f32": rng.standard_normal((7, 5)).astype(np.float32),
        "f64": rng.standard_normal(3),
        "f16": rng.standard_normal((2, 2)).astype(np.float16),
        "i32": np.arange(5, dtype=np.int32),
        "scalar": np.float32(2.5).reshape(()),
        "empty": np.zeros((0, 4), np.float32),
        "emb": SparseRows(np.array([4, 1], np.int64), rng.standard_normal((2, 3)).astype(np.float32)),
    }
    header, out = _read(_stream(tensors))
    assert header.worker_id == "w" and header.base_version == 3
    for name, sent in tensors.items():
        got = out[name]
        if isinstance(sent, SparseRows):
            assert isinstance(got, SparseRows)
            np.testing.assert_array_equal(got.indices, sent.indices)
            np.testing.assert_array_equal(got.values, sent.values)
        else:
            assert isinstance(got, np.ndarray) and got.dtype == sent.dtype and got.shape == sent.shape
            np.testing.assert_array_equal(got, sent)


def test_large_tensors_span_frames_of_bounded_size_and_reassemble() -> None:
    big = np.arange(10_000, dtype=np.float64)
    stream = _stream({"big": big, "small": np.ones(3, np.float32)}, frame_bytes=4096)
    assert len(stream) == 20 and all(len(f) < 4096 + 256 for f in stream)
    _, out = _read(stream)
    np.testing.assert_array_equal(out["big"], big)


def test_a_whole_tensor_is_received_in_place_and_a_destination_buffer_is_filled() -> None:
    value = np.arange(12, dtype=np.float32).reshape(3, 4)
    stream = _stream({"w": value, "b": np.ones(4, np.float32)})
    assert len(stream) == 1
    _, out = _read(stream)
    view = out["w"]
    assert isinstance(view, np.ndarray)
    assert np.shares_memory(view, np.frombuffer(stream[0], np.uint8)) and not view.flags.writeable
    buffer = np.zeros((3, 4), np.float32)
    _, filled = _read(stream, buffers={"w": buffer})
    assert filled["w"] is buffer
    np.testing.assert_array_equal(buffer, value)


def test_every_chunk_starts_on_an_eight_byte_boundary() -> None:
    stream = _stream({"a": np.ones(3, np.float32), "b": np.ones(5, np.float64), "c": np.ones(1, np.float16)})
    message, views = decode_frame(stream[0], PUSH, "test")
    base = np.frombuffer(stream[0], np.uint8).__array_interface__["data"][0]
    for view in views:
        start = np.frombuffer(view, np.uint8).__array_interface__["data"][0] if view.nbytes else base
        assert (start - base) % ALIGN == 0
    assert [c.nbytes for c in message.tensors] == [12, 40, 2]


def test_a_header_only_stream_is_one_frame() -> None:
    stream = _stream({})
    assert len(stream) == 1
    header, out = _read(stream)
    assert header.worker_id == "w" and out == {}


def _frame_with(message: ps_pb2.PushChunk, payload: bytes) -> bytes:
    head = message.SerializeToString()
    return struct.pack("<I", len(head)) + head + payload


GOOD = ps_pb2.PushChunk(header=ps_pb2.PushHeader(worker_id="w"), tensors=[tensor_pb2.TensorChunk(
    name="w", dtype=tensor_pb2.FLOAT32, shape=[2], nbytes=8)])


@pytest.mark.parametrize(("frame", "message"), [
    (b"\x01\x00", "shorter than its length prefix"),
    (struct.pack("<I", 1000) + b"abc", "frame header of 1000 bytes"),
    (struct.pack("<I", 3) + b"\xff\xff\xff", "not a valid message"),
    (_frame_with(GOOD, b""), "runs past the end"),
    (_frame_with(GOOD, bytes(64)), "bytes after the last chunk"),
    (_frame_with(ps_pb2.PushChunk(header=ps_pb2.PushHeader(), tensors=[tensor_pb2.TensorChunk(
        name="w", dtype=tensor_pb2.FLOAT32, shape=[2], data=bytes(8))]), b""), "belong after the message"),
    (_frame_with(ps_pb2.PushChunk(header=ps_pb2.PushHeader(), tensors=[tensor_pb2.TensorChunk(
        name="w", dtype=tensor_pb2.FLOAT32, shape=[2], nbytes=-8)]), b""), "negative nbytes"),
])
def test_malformed_frames_are_invalid_argument(frame: bytes, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        decode_frame(frame, PUSH, "test")


def test_lengths_that_disagree_with_dtype_and_shape_are_rejected() -> None:
    head = GOOD.SerializeToString()
    pad = -(4 + len(head)) % ALIGN
    frame = struct.pack("<I", len(head)) + head + bytes(pad) + bytes(8)
    _read([frame])  # the well-formed frame is accepted
    lying = ps_pb2.PushChunk(header=ps_pb2.PushHeader(), tensors=[tensor_pb2.TensorChunk(
        name="w", dtype=tensor_pb2.FLOAT32, shape=[3], nbytes=8)])
    with pytest.raises(InvalidArgumentError, match="received 8 of 12 bytes"):
        _read([encode_frame(lying, [memoryview(bytes(8))])])
    huge = ps_pb2.PushChunk(header=ps_pb2.PushHeader(), tensors=[tensor_pb2.TensorChunk(
        name="w", dtype=tensor_pb2.FLOAT32, shape=[1 << 40], nbytes=8)])
    with pytest.raises(ResourceExhaustedError):
        _read([encode_frame(huge, [memoryview(bytes(8))])])


def test_the_header_belongs_in_the_first_frame_only() -> None:
    stream = _stream({"big": np.arange(2000, dtype=np.float64)}, frame_bytes=4096)
    with pytest.raises(InvalidArgumentError, match="first frame has no header"):
        _read(stream[1:])
    with pytest.raises(InvalidArgumentError, match="header in frame 1"):
        _read([stream[0], stream[0]])
    with pytest.raises(InvalidArgumentError, match="empty stream"):
        _read([])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_are_rejected_cleanly_or_parse(frame: bytes) -> None:
    with contextlib.suppress(InvalidArgumentError, ResourceExhaustedError):
        _read([frame], max_total_bytes=1 << 20)
