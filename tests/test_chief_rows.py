"""The chief never makes a table the shards can make, and evaluates a model read by rows exactly as it
evaluates the model whole.

Real shard processes: a table the shards make from its row initializer holds, part by part over two
shards, the rows of the whole table's (each part from its own first row); an evaluation that reads the
rows each batch looks up (pulled per batch, or held from one read of the test set's rows) gives the
loss and accuracy of the whole model pulled whole.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from asyncps.chief.checkpointer import generated_parts
from asyncps.chief.evaluator import Evaluator, HeldRows, pull_rows
from asyncps.chief.main import resolve_run_task

from asyncps.config import RunConfig
from asyncps.placement import VariableSpec, place
from asyncps.runmodel import build_chief_model, build_run_model
from asyncps.transport import connect_model

ROWS, DIM, BATCH = 3000, 8, 64
TABLE = "recsys:rows=3000,dim=8"
SMALL_SLICES = 4096  # bytes: the table (96 KB) is sliced over both shards


def _run() -> RunConfig:
    return RunConfig(dataset=f"recsys:rows={ROWS}", model=TABLE, seed=5, slice_threshold_bytes=SMALL_SLICES)


def test_the_chief_makes_no_table_and_the_shards_make_each_part_from_its_first_row(
        start_shards: Callable[[int], list[str]]) -> None:
    run = _run()
    _, clone, sparse, made = build_chief_model(run, BATCH)
    assert sparse is not None and made == {}
    table = sparse.tables[0]
    assert table.init is not None
    # the clone's table is the local one: capacity rows, never the whole table
    assert [tuple(v.shape) for v in clone.trainable_variables if v.path == table.variable] == [(table.capacity, DIM)]
    placement = place(sparse.specs(), 2, run.slice_threshold_bytes)
    assert len(placement.parts_of(table.variable)) == 2
    addresses = start_shards(2)
    client = connect_model("chief", addresses, placement)
    try:
        dense = {v.path: np.array(v.numpy()) for v in clone.trainable_variables if v.path != table.variable}
        for shard in range(2):
            values = {p.name: dense[p.variable][p.rows()] if p.sliced else dense[p.variable]
                      for p in placement.parts_on(shard) if p.variable in dense}
            client.shards[shard].initialize("chief", shard, 2, run.update_rule(), values, "",
                                            generated_parts(placement, shard, {table.variable: table.init}))
        client.pull()
        np.testing.assert_array_equal(client.values[table.variable], table.init.rows(0, ROWS, (DIM,), np.float32))
    finally:
        client.close()


def test_an_evaluation_by_rows_measures_what_the_whole_model_measures(
        start_shards: Callable[[int], list[str]]) -> None:
    run = _run()
    data, whole = build_run_model(run)
    task = resolve_run_task(run, data, whole)
    _, clone, sparse, _ = build_chief_model(run, BATCH)
    assert sparse is not None
    specs = [VariableSpec(v.path, tuple(v.shape), str(v.dtype)) for v in whole.trainable_variables]
    placement = place(specs, 2, run.slice_threshold_bytes)
    addresses = start_shards(2)
    whole_client = connect_model("chief", addresses, placement)
    rows_client = connect_model("chief", addresses, placement, row_variables=[t.variable for t in sparse.tables])
    try:
        values = {v.path: np.array(v.numpy()) for v in whole.trainable_variables}  # the whole model's table
        for shard in range(2):
            part = {p.name: values[p.variable][p.rows()] if p.sliced else values[p.variable]
                    for p in placement.parts_on(shard)}
            whole_client.shards[shard].initialize("chief", shard, 2, run.update_rule(), part)
        whole_client.pull()
        reference = Evaluator(whole, task, BATCH)
        reference.load(whole_client.values)
        expected = reference.evaluate(data.x_test, data.y_test)

        by_rows = Evaluator(clone, task, BATCH, sparse, rows=lambda ids: pull_rows(rows_client, ids))
        rows_client.pull()
        assert set(rows_client.values) == set(values) - {t.variable for t in sparse.tables}
        by_rows.load(rows_client.values)
        per_batch = by_rows.evaluate(data.x_test, data.y_test)
        by_rows.rows = HeldRows(pull_rows(rows_client, by_rows.ids(data.x_test)))
        held = by_rows.evaluate(data.x_test, data.y_test)
    finally:
        whole_client.close()
        rows_client.close()
    assert expected[1] > 0.0
    np.testing.assert_allclose(per_batch, expected, rtol=1e-6)
    np.testing.assert_allclose(held, expected, rtol=1e-6)
