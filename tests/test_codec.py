"""asyncps.wire.codec: tensor encoding, chunking and validated reassembly."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from asyncps.errors import InvalidArgumentError, ResourceExhaustedError
from asyncps.pb import tensor_pb2
from asyncps.wire.codec import (
    SparseRows,
    TensorAssembler,
    all_finite,
    decode_tensor,
    dtype_from_proto,
    dtype_to_proto,
    encode_tensor,
    gradient_chunks,
    iter_chunks,
)

WIRE_DTYPES = {
    tensor_pb2.FLOAT32: np.float32,
    tensor_pb2.FLOAT64: np.float64,
    tensor_pb2.FLOAT16: np.float16,
    tensor_pb2.INT32: np.int32,
    tensor_pb2.INT64: np.int64,
}
DTYPES = list(WIRE_DTYPES.values())


def sample(shape: tuple[int, ...], dtype: type, seed: int = 0) -> np.ndarray:
    """Distinct, dtype-exact values (so any misplaced byte shows)."""
    rng = np.random.default_rng(seed)
    return rng.integers(-1000, 1000, size=shape).astype(dtype)


def assemble(chunks, **kwargs) -> dict:
    assembler = TensorAssembler(**kwargs)
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.finish()


def chunk(name: str = "w", dtype: int = tensor_pb2.FLOAT32, shape=(2, 3), offset: int = 0,
          data: bytes = b"", role: int = tensor_pb2.DENSE) -> tensor_pb2.TensorChunk:
    return tensor_pb2.TensorChunk(name=name, role=role, dtype=dtype, shape=shape, offset=offset,
                                  data=data)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ----------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("code, dtype", WIRE_DTYPES.items())
def test_dtype_mapping_is_a_bijection(code: int, dtype: type) -> None:
    assert dtype_to_proto(np.dtype(dtype)) == code
    assert dtype_from_proto(code) == np.dtype(dtype)


@pytest.mark.parametrize("dtype", [np.bool_, np.uint8, np.int8, np.complex64, np.uint64])
def test_unsupported_dtype_is_invalid_argument(dtype: type) -> None:
    with pytest.raises(InvalidArgumentError, match="unsupported dtype"):
        encode_tensor(np.zeros(3, dtype=dtype))
    with pytest.raises(InvalidArgumentError, match="unsupported dtype"):
        next(iter_chunks("w", np.zeros(3, dtype=dtype)))


@pytest.mark.parametrize("code", [tensor_pb2.DTYPE_UNSPECIFIED, 6, 99])
def test_unknown_dtype_code_is_invalid_argument(code: int) -> None:
    with pytest.raises(InvalidArgumentError, match=f"unknown dtype code {code}"):
        dtype_from_proto(code)
    with pytest.raises(InvalidArgumentError, match=f"unknown dtype code {code}"):
        decode_tensor(tensor_pb2.Tensor(dtype=code, shape=[1], data=b"\0" * 4))
    with pytest.raises(InvalidArgumentError, match=f"unknown dtype code {code}"):
        TensorAssembler().add(chunk(dtype=code, shape=[1], data=b"\0" * 4))


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 5), (0,), (4, 0, 2)])
def test_whole_tensor_round_trip(dtype: type, shape: tuple[int, ...]) -> None:
    value = sample(shape, dtype)
    msg = encode_tensor(value)
    assert list(msg.shape) == list(shape) and len(msg.data) == value.nbytes
    decoded = decode_tensor(msg)
    assert same_bits(decoded, value)
    assert decoded.flags.writeable  # a copy, not a read-only view of the message bytes


@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_chunk_round_trip(dtype: type) -> None:
    value = sample((13, 7), dtype, seed=1)
    chunk_bytes = 10  # not a multiple of any item size: chunks split elements
    chunks = list(iter_chunks("w", value, chunk_bytes=chunk_bytes))
    assert len(chunks) == -(-value.nbytes // chunk_bytes)
    assert [c.offset for c in chunks] == list(range(0, value.nbytes, chunk_bytes))
    assert all(len(c.data) <= chunk_bytes for c in chunks)
    assert all(list(c.shape) == [13, 7] for c in chunks)
    out = assemble(chunks)
    assert list(out) == ["w"] and same_bits(out["w"], value)


def test_non_contiguous_input_is_sent_in_logical_order() -> None:
    base = sample((6, 8), np.float32)
    view = base[::2, 1::3]  # strided: not C-contiguous
    assert same_bits(decode_tensor(encode_tensor(view)), np.ascontiguousarray(view))
    assert same_bits(assemble(iter_chunks("v", view, chunk_bytes=5))["v"], view.copy())


@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0)])
def test_empty_tensor_is_one_empty_chunk(shape: tuple[int, ...]) -> None:
    chunks = list(iter_chunks("e", np.zeros(shape, np.float32)))
    assert len(chunks) == 1
    assert chunks[0].offset == 0 and chunks[0].data == b"" and list(chunks[0].shape) == list(shape)
    out = assemble(chunks)
    assert out["e"].shape == shape and out["e"].dtype == np.float32


def test_scalar_chunk_from_the_wire_assembles_to_a_0d_array() -> None:
    raw = np.float64(2.5).tobytes()
    out = assemble([chunk(name="s", dtype=tensor_pb2.FLOAT64, shape=[], data=raw)])
    assert out["s"].shape == () and out["s"].dtype == np.float64 and float(out["s"]) == 2.5
    decoded = decode_tensor(tensor_pb2.Tensor(dtype=tensor_pb2.FLOAT64, shape=[], data=raw))
    assert decoded.shape == () and float(decoded) == 2.5


@pytest.mark.parametrize("dtype", DTYPES)
def test_scalar_round_trip_keeps_shape(dtype: type) -> None:
    value = np.array(7, dtype=dtype)
    assert same_bits(decode_tensor(encode_tensor(value)), value)
    assert same_bits(assemble(iter_chunks("s", value))["s"], value)


@pytest.mark.parametrize("dtype", [">f4", ">f8", ">i4"])
def test_big_endian_input_round_trips_by_value(dtype: str) -> None:
    value = np.arange(1, 6).astype(dtype)
    np.testing.assert_array_equal(decode_tensor(encode_tensor(value)), value)
    np.testing.assert_array_equal(assemble(iter_chunks("b", value))["b"], value)


def test_several_tensors_in_one_stream() -> None:
    a, b = sample((5, 3), np.float32), sample((4,), np.int64, seed=2)
    chunks = [*iter_chunks("a", a, chunk_bytes=8), *iter_chunks("b", b, chunk_bytes=8)]
    out = assemble(chunks)
    assert sorted(out) == ["a", "b"]
    assert same_bits(out["a"], a) and same_bits(out["b"], b)


def test_total_bytes_counts_announced_tensor_bytes() -> None:
    assembler = TensorAssembler()
    for c in [*iter_chunks("a", np.zeros((5, 3), np.float32)), *iter_chunks("b", np.zeros(4))]:
        assembler.add(c)
    assert assembler.total_bytes == 5 * 3 * 4 + 4 * 8


@settings(max_examples=60, deadline=None)
@given(
    value=hnp.arrays(
        dtype=st.sampled_from(DTYPES),
        shape=hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=9),
    ),
    chunk_bytes=st.integers(min_value=1, max_value=300),
)
def test_round_trip_property(value: np.ndarray, chunk_bytes: int) -> None:
    assert same_bits(decode_tensor(encode_tensor(value)), value)
    chunks = list(iter_chunks("t", value, chunk_bytes=chunk_bytes))
    assert sum(len(c.data) for c in chunks) == value.nbytes
    assert len(chunks) == max(1, -(-value.nbytes // chunk_bytes))
    assert same_bits(assemble(chunks)["t"], value)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(min_value=1, max_value=12),
    k=st.integers(min_value=0, max_value=10),
    width=st.integers(min_value=1, max_value=4),
    chunk_bytes=st.integers(min_value=1, max_value=64),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_sparse_round_trip_property(rows: int, k: int, width: int, chunk_bytes: int,
                                    seed: int) -> None:
    rng = np.random.default_rng(seed)
    grad = SparseRows(indices=rng.integers(0, rows, size=k).astype(np.int64),
                      values=rng.integers(-9, 9, size=(k, width)).astype(np.float32))
    chunks = list(gradient_chunks("emb", grad, chunk_bytes))
    roles = [c.role for c in chunks]
    assert roles == sorted(roles)  # indices first, then values
    assert set(roles) == {tensor_pb2.SPARSE_INDICES, tensor_pb2.SPARSE_VALUES}
    out = assemble(chunks)
    assert isinstance(out["emb"], SparseRows)
    assert same_bits(out["emb"].indices, grad.indices)
    assert same_bits(out["emb"].values, grad.values)


def test_dense_gradient_chunks_are_dense() -> None:
    grad = sample((3, 2), np.float32)
    chunks = list(gradient_chunks("w", grad, chunk_bytes=8))
    assert {c.role for c in chunks} == {tensor_pb2.DENSE}
    assert same_bits(assemble(chunks)["w"], grad)


# ----------------------------------------------------------------------------- in place


def test_assembles_into_provided_buffer_in_place() -> None:
    value = sample((9, 4), np.float32)
    buffer = np.full((9, 4), -1.0, np.float32)
    address = buffer.ctypes.data
    out = assemble(iter_chunks("w", value, chunk_bytes=12), buffers={"w": buffer})
    assert out["w"] is buffer
    assert buffer.ctypes.data == address
    assert same_bits(buffer, value)


def test_fills_a_contiguous_row_slice_of_a_bigger_array_in_place() -> None:
    full = np.zeros((10, 3), np.float32)
    part = full[4:8]  # what ModelClient hands in for a sliced variable
    value = sample((4, 3), np.float32)
    out = assemble(iter_chunks("w/part1of2", value, chunk_bytes=7),
                   buffers={"w/part1of2": part})
    assert out["w/part1of2"] is part
    assert same_bits(full[4:8], value)
    assert not full[:4].any() and not full[8:].any()


@pytest.mark.parametrize(
    "buffer",
    [np.zeros((4, 9), np.float32), np.zeros((9, 4), np.float64),
     np.zeros((9, 8), np.float32)[:, ::2]],
    ids=["other-shape", "other-dtype", "not-contiguous"],
)
def test_unsuitable_buffer_is_left_alone(buffer: np.ndarray) -> None:
    before = buffer.copy()
    value = sample((9, 4), np.float32)
    out = assemble(iter_chunks("w", value), buffers={"w": buffer})
    assert out["w"] is not buffer
    assert same_bits(out["w"], value)
    assert same_bits(buffer, before)


def test_sparse_parts_never_go_into_buffers() -> None:
    buffer = np.zeros(3, np.int64)
    grad = SparseRows(np.array([0, 2, 1], np.int64), np.ones((3, 2), np.float32))
    out = assemble(gradient_chunks("emb", grad), buffers={"emb": buffer})
    assert out["emb"].indices is not buffer and not buffer.any()


# ----------------------------------------------------------------------------- bad input


def test_decode_rejects_byte_length_mismatch() -> None:
    msg = encode_tensor(np.zeros((2, 3), np.float32))
    for data in (msg.data[:-1], msg.data + b"\0", b""):
        bad = tensor_pb2.Tensor(dtype=msg.dtype, shape=msg.shape, data=data)
        with pytest.raises(InvalidArgumentError, match=f"needs 24 bytes, got {len(data)}"):
            decode_tensor(bad)


def test_decode_rejects_negative_dims_and_oversized_shapes() -> None:
    with pytest.raises(InvalidArgumentError, match="negative dimension"):
        decode_tensor(tensor_pb2.Tensor(dtype=tensor_pb2.FLOAT32, shape=[2, -1], data=b""))
    with pytest.raises(ResourceExhaustedError, match="limit 1024"):
        decode_tensor(tensor_pb2.Tensor(dtype=tensor_pb2.FLOAT32, shape=[257]), limit=1024)
    # exactly at the limit is fine
    decoded = decode_tensor(encode_tensor(np.zeros(256, np.float32)), limit=1024)
    assert decoded.shape == (256,)


def test_assembler_rejects_missing_bytes_in_finish() -> None:
    chunks = list(iter_chunks("w", np.zeros((2, 3), np.float32), chunk_bytes=8))
    assembler = TensorAssembler()
    for c in chunks[:-1]:
        assembler.add(c)
    with pytest.raises(InvalidArgumentError, match="w: received 16 of 24 bytes"):
        assembler.finish()


def test_assembler_rejects_out_of_order_offsets() -> None:
    chunks = list(iter_chunks("w", np.zeros((2, 3), np.float32), chunk_bytes=8))
    assembler = TensorAssembler()
    assembler.add(chunks[0])
    with pytest.raises(InvalidArgumentError, match="offset 16, expected 8"):
        assembler.add(chunks[2])
    with pytest.raises(InvalidArgumentError, match="offset 0, expected 8"):
        assembler.add(chunks[0])  # a repeated chunk


def test_assembler_rejects_a_first_chunk_not_at_zero() -> None:
    with pytest.raises(InvalidArgumentError, match="offset 4, expected 0"):
        TensorAssembler().add(chunk(offset=4, data=b"\0" * 4))


def test_assembler_rejects_bytes_beyond_the_tensor() -> None:
    assembler = TensorAssembler()
    assembler.add(chunk(data=b"\0" * 20))
    with pytest.raises(InvalidArgumentError, match="28 bytes for a float32\\[2, 3\\] tensor of 24"):
        assembler.add(chunk(offset=20, data=b"\0" * 8))
    with pytest.raises(InvalidArgumentError, match="25 bytes"):
        TensorAssembler().add(chunk(data=b"\0" * 25))


@pytest.mark.parametrize(
    "second",
    [chunk(shape=(3, 2), offset=8, data=b"\0" * 8), chunk(shape=(6,), offset=8, data=b"\0" * 8),
     chunk(dtype=tensor_pb2.INT32, offset=8, data=b"\0" * 8)],
    ids=["transposed", "flattened", "dtype"],
)
def test_assembler_rejects_inconsistent_chunks(second: tensor_pb2.TensorChunk) -> None:
    assembler = TensorAssembler()
    assembler.add(chunk(data=b"\0" * 8))
    with pytest.raises(InvalidArgumentError, match="earlier chunks said float32\\[2, 3\\]"):
        assembler.add(second)


def test_assembler_rejects_negative_dims() -> None:
    with pytest.raises(InvalidArgumentError, match="negative dimension"):
        TensorAssembler().add(chunk(shape=(3, -2)))


def test_assembler_limit_is_resource_exhausted() -> None:
    with pytest.raises(ResourceExhaustedError):
        TensorAssembler(max_total_bytes=100).add(chunk(shape=(26,)))
    huge = chunk(shape=(1 << 20, 1 << 20, 1 << 10))  # 2**50 floats: must fail before allocating
    with pytest.raises(ResourceExhaustedError):
        TensorAssembler().add(huge)


def test_assembler_limit_counts_all_tensors_of_a_stream() -> None:
    assembler = TensorAssembler(max_total_bytes=100)
    assembler.add(chunk(name="a", shape=(20,)))  # 80 bytes
    assert assembler.total_bytes == 80
    with pytest.raises(ResourceExhaustedError):
        assembler.add(chunk(name="b", shape=(6,)))  # 24 more: over 100
    assembler.add(chunk(name="c", shape=(5,)))  # 20 more: exactly 100


def test_assembler_rejects_unnamed_chunks_and_unknown_roles() -> None:
    with pytest.raises(InvalidArgumentError, match="without a name"):
        TensorAssembler().add(chunk(name=""))
    with pytest.raises(InvalidArgumentError, match="unknown tensor role 7"):
        TensorAssembler().add(chunk(role=7))


def _sparse_chunks(indices: np.ndarray | None, values: np.ndarray | None) -> list:
    out = []
    if indices is not None:
        out += iter_chunks("emb", indices, tensor_pb2.SPARSE_INDICES)
    if values is not None:
        out += iter_chunks("emb", values, tensor_pb2.SPARSE_VALUES)
    return out


@pytest.mark.parametrize(
    "chunks, message",
    [
        (_sparse_chunks(np.array([0, 1], np.int64), None), "sparse indices without values"),
        (_sparse_chunks(None, np.ones((2, 3), np.float32)), "sparse values without indices"),
        (_sparse_chunks(np.array([0, 1], np.int32), np.ones((2, 3), np.float32)),
         "indices must be int64"),
        (_sparse_chunks(np.array([[0, 1]], np.int64), np.ones((2, 3), np.float32)),
         "indices must be int64"),
        (_sparse_chunks(np.array([0, 1, 2], np.int64), np.ones((2, 3), np.float32)),
         "3 indices but values of shape \\[2, 3\\]"),
        ([*_sparse_chunks(np.array([0], np.int64), np.ones((1, 3), np.float32)),
          *iter_chunks("emb", np.ones((4, 3), np.float32))], "both dense and sparse"),
    ],
    ids=["no-values", "no-indices", "int32-indices", "2d-indices", "count-mismatch",
         "dense-and-sparse"],
)
def test_assembler_rejects_malformed_sparse_pairs(chunks: list, message: str) -> None:
    assembler = TensorAssembler()
    for c in chunks:
        assembler.add(c)
    with pytest.raises(InvalidArgumentError, match=message):
        assembler.finish()


def test_assembler_rejects_0d_sparse_values() -> None:
    raw = np.float32(1.0).tobytes()
    assembler = TensorAssembler()
    for c in iter_chunks("emb", np.array([0], np.int64), tensor_pb2.SPARSE_INDICES):
        assembler.add(c)
    assembler.add(chunk(name="emb", shape=[], data=raw, role=tensor_pb2.SPARSE_VALUES))
    with pytest.raises(InvalidArgumentError, match="1 indices but values of shape \\[\\]"):
        assembler.finish()


def test_coalesce_rows_sums_duplicate_rows_once_per_index() -> None:
    from asyncps.wire.codec import coalesce_rows

    indices = np.array([5, 1, 5, 3, 1, 5], np.int32)
    values = np.arange(12, dtype=np.float32).reshape(6, 2)
    rows = coalesce_rows(indices, values)
    assert rows.indices.dtype == np.int64 and rows.indices.tolist() == [1, 3, 5]
    dense = np.zeros((6, 2), np.float32)
    np.add.at(dense, indices, values)
    np.testing.assert_array_equal(rows.values, dense[[1, 3, 5]])
    empty = coalesce_rows(np.zeros(0, np.int64), np.zeros((0, 2), np.float32))
    assert empty.indices.size == 0 and empty.values.shape == (0, 2)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "0-d"])
def test_all_finite_finds_one_nan_or_inf_anywhere(dtype: type, bad: float, layout: str) -> None:
    rng = np.random.default_rng(0)
    base = rng.standard_normal((64, 33)).astype(dtype)
    array = {"contiguous": base, "strided": base[:, ::2], "0-d": base[:1, :1].reshape(())}[layout]
    assert all_finite(array)
    for where in ([0] * array.ndim, [d - 1 for d in array.shape]):
        spoiled = array.copy() if layout != "strided" else base.copy()[:, ::2]
        spoiled[tuple(where)] = bad
        assert not all_finite(spoiled), (layout, where)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_all_finite_is_not_fooled_by_squares_that_overflow(dtype: type) -> None:
    # the sum of squares of large finite values overflows to inf: every element is then checked
    huge = np.full(1000, np.finfo(dtype).max / 2, dtype)
    assert all_finite(huge)
    huge[-1] = np.nan
    assert not all_finite(huge)


def test_all_finite_on_integers_and_empty_arrays() -> None:
    assert all_finite(np.arange(10, dtype=np.int64))
    assert all_finite(np.zeros((0, 3), np.float32))
