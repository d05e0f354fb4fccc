"""asyncps.placement: deterministic, complete and balanced placement of variables on shards."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncps.placement import (
    DEFAULT_SLICE_THRESHOLD_BYTES,
    Placement,
    VariableSpec,
    place,
    specs_of,
    split_for_shards,
)

REPO_ROOT = Path(__file__).resolve().parent.parent


def mlp(*widths: int) -> tuple[VariableSpec, ...]:
    """Kernels and biases of a dense MLP with the given layer widths (input first)."""
    specs = []
    for i, (n_in, n_out) in enumerate(itertools.pairwise(widths)):
        specs += [VariableSpec(f"dense_{i}/kernel", (n_in, n_out)),
                  VariableSpec(f"dense_{i}/bias", (n_out,))]
    return tuple(specs)


def assignment(placement: Placement) -> dict[str, tuple[int, int, int, bool]]:
    """Where every part lives, independent of the order of the parts tuple."""
    return {p.name: (p.shard, p.row_start, p.row_stop, p.sliced) for p in placement.parts}


def check_complete(placement: Placement) -> None:
    """Every variable is covered exactly once by contiguous row ranges on valid shards."""
    assert {p.variable for p in placement.parts} == {v.name for v in placement.variables}
    names = [p.name for p in placement.parts]
    assert len(names) == len(set(names)), "two parts share a storage key"
    for spec in placement.variables:
        parts = placement.parts_of(spec.name)
        rows = spec.shape[0] if spec.shape else 1
        assert parts[0].row_start == 0 and parts[-1].row_stop == rows, spec
        for before, after in itertools.pairwise(parts):
            assert before.row_stop == after.row_start, spec
        assert all(0 <= p.shard < placement.num_shards for p in parts)
        if len(parts) > 1:
            assert all(p.sliced for p in parts)
            assert [p.name for p in parts] == [
                f"{spec.name}/part{i}of{placement.num_shards}" for i in range(len(parts))]
            assert len({p.shard for p in parts}) == len(parts), "two slices on one shard"
        else:
            assert not parts[0].sliced and parts[0].name == spec.name
    assert sum(placement.shard_bytes()) == sum(v.nbytes for v in placement.variables)


# ----------------------------------------------------------------------------- determinism


def test_same_input_gives_the_same_placement() -> None:
    specs = mlp(784, 512, 512, 10)
    assert place(specs, 2) == place(specs, 2)
    assert place(specs, 3) == place(list(specs), 3)


def test_shard_assignment_does_not_depend_on_input_order() -> None:
    specs = list(mlp(784, 2048, 2048, 10)) + [VariableSpec(f"v{i}", (i + 1, 7)) for i in range(20)]
    reference = place(specs, 3)
    for seed in range(5):
        shuffled = specs[:]
        random.Random(seed).shuffle(shuffled)
        again = place(shuffled, 3)
        assert assignment(again) == assignment(reference)
        # the parts tuple itself follows the caller's variable order, slices in row order
        order = {s.name: i for i, s in enumerate(shuffled)}
        keys = [(order[p.variable], p.row_start) for p in again.parts]
        assert keys == sorted(keys)


def test_placement_is_identical_in_another_process_with_another_hash_seed() -> None:
    specs = list(mlp(784, 2048, 2048, 10)) + [VariableSpec(f"v{i}", (3,)) for i in range(10)]
    script = (
        "import json, sys\n"
        "from asyncps.placement import place, specs_of\n"
        "specs = specs_of([(n, tuple(s), d) for n, s, d in json.load(sys.stdin)])\n"
        "parts = place(specs, 3).parts\n"
        "print(json.dumps([[p.name, p.shard, p.row_start, p.row_stop] for p in parts]))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    result = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps([[s.name, s.shape, s.dtype] for s in specs]),
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120, check=True)
    there = json.loads(result.stdout)
    here = [[p.name, p.shard, p.row_start, p.row_stop] for p in place(specs, 3).parts]
    assert there == here


# ----------------------------------------------------------------------------- coverage


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5])
def test_every_variable_is_covered_exactly_once(num_shards: int) -> None:
    specs = (*mlp(784, 2048, 2048, 10), VariableSpec("scalar", ()), VariableSpec("empty", (0, 4)),
             VariableSpec("step", (1,), "int64"))
    check_complete(place(specs, num_shards))


def test_large_variables_are_sliced_over_all_shards() -> None:
    specs = mlp(784, 2048, 2048, 10)
    placement = place(specs, 3)
    for name in ("dense_0/kernel", "dense_1/kernel"):
        parts = placement.parts_of(name)
        assert len(parts) == 3 and {p.shard for p in parts} == {0, 1, 2}
        sizes = [p.row_stop - p.row_start for p in parts]
        assert max(sizes) - min(sizes) <= 1  # near-equal row counts
    # dense_2/kernel is 2048*10*4 = 80 KiB: under the threshold, stored whole
    assert [p.sliced for p in placement.parts_of("dense_2/kernel")] == [False]


def test_slicing_threshold_is_strict_and_needs_enough_rows() -> None:
    at = VariableSpec("at", (DEFAULT_SLICE_THRESHOLD_BYTES // 4,))  # exactly the threshold
    over = VariableSpec("over", (DEFAULT_SLICE_THRESHOLD_BYTES // 4 + 1,))
    few_rows = VariableSpec("few_rows", (2, 1 << 20))  # 8 MiB but only 2 rows for 3 shards
    placement = place([at, over, few_rows], 3)
    assert len(placement.parts_of("at")) == 1
    assert len(placement.parts_of("over")) == 3
    assert len(placement.parts_of("few_rows")) == 1
    check_complete(placement)


def test_one_shard_never_slices() -> None:
    placement = place(mlp(784, 2048, 2048, 10), 1)
    assert not any(p.sliced for p in placement.parts)
    assert {p.shard for p in placement.parts} == {0}


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="num_shards"):
        place(mlp(4, 2), 0)
    with pytest.raises(ValueError, match="unique"):
        place([VariableSpec("a", (2,)), VariableSpec("a", (3,))], 2)


def test_specs_of_builds_int_shapes() -> None:
    specs = specs_of([("w", (np.int64(3), 4), "float64")])
    assert specs == (VariableSpec("w", (3, 4), "float64"),)
    assert specs[0].nbytes == 96


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(
        st.tuples(st.integers(0, 300), st.integers(1, 300)).map(tuple), min_size=1, max_size=12),
    num_shards=st.integers(1, 5),
    threshold=st.sampled_from([1024, 16 * 1024, DEFAULT_SLICE_THRESHOLD_BYTES]),
)
def test_coverage_and_balance_property(shapes: list[tuple[int, int]], num_shards: int,
                                       threshold: int) -> None:
    specs = [VariableSpec(f"v{i}", s) for i, s in enumerate(shapes)]
    placement = place(specs, num_shards, threshold)
    check_complete(placement)
    # Greedy placement onto the least-loaded shard keeps the spread below the biggest whole
    # variable plus the rounding of slices (at most one row of each sliced variable).
    loads = placement.shard_bytes()
    whole = [s.nbytes for s in specs if len(placement.parts_of(s.name)) == 1]
    sliced_rows = [s.nbytes // s.shape[0] for s in specs if len(placement.parts_of(s.name)) > 1]
    assert max(loads) - min(loads) <= max(whole, default=0) + sum(sliced_rows)


# ----------------------------------------------------------------------------- balance


@pytest.mark.parametrize(
    "widths, num_shards",
    [((784, 512, 512, 10), 2), ((784, 2048, 2048, 10), 2), ((784, 2048, 2048, 10), 3)],
)
def test_mlp_bytes_are_balanced(widths: tuple[int, ...], num_shards: int) -> None:
    specs = mlp(*widths)
    loads = place(specs, num_shards).shard_bytes()
    assert len(loads) == num_shards and sum(loads) == sum(s.nbytes for s in specs)
    assert max(loads) / min(loads) < 1.05, loads


def test_shard_bytes_of_a_small_mlp_on_two_shards_exactly() -> None:
    # 784x512 and 512x512 kernels are sliced in halves; the small rest goes largest first
    # onto the least-loaded shard (ties: lowest index).
    placement = place(mlp(784, 512, 512, 10), 2)
    half = (784 * 512 + 512 * 512) * 4 // 2
    assert placement.shard_bytes() == [half + 512 * 10 * 4, half + (512 + 512 + 10) * 4]
    assert placement.parts_on(0) == tuple(p for p in placement.parts if p.shard == 0)


# ----------------------------------------------------------------------------- splitting


@pytest.mark.parametrize("num_shards", [2, 3])
def test_split_for_shards_reassembles_exactly(num_shards: int) -> None:
    specs = (*mlp(300, 400, 10), VariableSpec("scalar", ()))
    placement = place(specs, num_shards, slice_threshold_bytes=16 * 1024)
    assert any(p.sliced for p in placement.parts)
    rng = np.random.default_rng(0)
    values = {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in specs}
    per_shard = split_for_shards(placement, values)
    assert len(per_shard) == num_shards
    for shard, parts in enumerate(per_shard):
        assert set(parts) == {p.name for p in placement.parts_on(shard)}
    rebuilt = {}
    for spec in specs:
        pieces = [per_shard[p.shard][p.name] for p in placement.parts_of(spec.name)]
        for piece in pieces:
            assert np.shares_memory(piece, values[spec.name]), "a part was copied"
        rebuilt[spec.name] = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
        assert rebuilt[spec.name].tobytes() == values[spec.name].tobytes(), spec.name
        assert rebuilt[spec.name].shape == values[spec.name].shape


def test_a_keyed_table_has_one_part_per_shard_and_each_key_one_part() -> None:
    from asyncps.placement import key_parts

    spec = VariableSpec("t", (1000, 4), keyed=True)
    placement = place([spec, VariableSpec("b", (3,))], 3)
    parts = placement.parts_of("t")
    assert [p.keyed for p in parts] == [True] * 3 and sorted(p.shard for p in parts) == [0, 1, 2]
    assert sum(p.row_stop - p.row_start for p in parts) == 1000  # each keeps its share of the table's rows
    keys = np.unique(np.random.default_rng(0).integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, 5000))
    routed = placement.row_parts("t", keys)
    positions = np.concatenate([at for _, at in routed])
    assert sorted(positions.tolist()) == list(range(keys.size))  # every key once
    assert min(at.size for _, at in routed) > 1500  # the hash spreads them
    for i, (part, at) in enumerate(routed):
        assert part is parts[i] and (key_parts(keys[at], 3) == i).all()
        np.testing.assert_array_equal(part.ids_of(keys[at]), keys[at])  # keys go as they are
    single = place([spec], 1).parts_of("t")
    assert len(single) == 1 and single[0].keyed and single[0].name == "t"


def test_a_keyed_table_with_fewer_rows_than_shards_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one row per shard"):
        place([VariableSpec("t", (2, 4), keyed=True)], 3)
