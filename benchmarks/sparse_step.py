"""Where a sparse step's milliseconds go, per part, at each table size (the bench's sparse section's model).

`python -m benchmarks.sparse_step [--rows 10000,10000000]`: one process times the worker's numpy work
(`SparseModel.batch_ids`, `RowStep`, `RowStep.whole`), the row cache's lookup, fill and take (S=4, no
update between: a run without pushes), and one shard's store serving a batch's rows and applying their
Adagrad update (its fancy indexing: half the table, as each of 2 shards holds), on the `recsys` data's
batches of 256 (the median of 200 calls, in ms). Network, serialization and TensorFlow's gradient are
not in it: the sparse section's step times show them.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from asyncps.ps.store import ShardStore

from asyncps.ml.datasets import load_dataset
from asyncps.ml.models import build_model
from asyncps.ml.sparse import build_deferred, plan
from asyncps.placement import VariableSpec, place
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.transport.rowcache import RowCache
from asyncps.wire.codec import SparseRows

BATCH = 256
CALLS = 200


def median_ms(fn: Callable[[int], Any], calls: int = CALLS) -> float:
    """The median wall time of fn(k), k = 0..calls-1, in ms."""
    times = []
    for k in range(calls):
        start = time.perf_counter()
        fn(k)
        times.append(time.perf_counter() - start)
    return 1000 * float(np.median(times))


def cached_read(cache: RowCache, ids: dict[str, Any], versions: list[int], incarnations: list[int]) -> None:
    """One step's rows through the row cache, the rows it misses served as ones."""
    ask = cache.to_ask(ids, versions, incarnations)
    served = {name: SparseRows(i, np.ones((i.size, 32), np.float32), np.zeros(i.size, np.int64))
              for name, i in ask.items()}
    cache.complete(ids, served, versions, incarnations)


def profile(rows: int) -> dict[str, float]:
    """Each part's median ms per step for a table of `rows` rows."""
    data = load_dataset(f"recsys:rows={rows}", seed=0)
    sparse = plan(build_deferred(lambda: build_model("recsys", data.num_features, data.num_classes, id_rows=rows)),
                  BATCH)
    assert sparse is not None
    table = sparse.tables[0]
    whole = len(data.x_train) // BATCH
    batches = [data.x_train[(k % whole) * BATCH:(k % whole + 1) * BATCH] for k in range(CALLS)]
    ids = [sparse.batch_ids(x) for x in batches]
    half = rows // 2  # one shard's part: the ids below it
    store = ShardStore(0)
    store.initialize(UpdateRuleConfig(OptimizerConfig("adagrad", 0.05)),
                     {"t": np.zeros((half, table.shape[1]), dtype=np.float32)})
    mine = [i[table.variable][i[table.variable] < half] for i in ids]
    served = [SparseRows(i[table.variable], np.ones((i[table.variable].size, table.shape[1]), np.float32),
                         np.zeros(i[table.variable].size, np.int64)) for i in ids]
    placement = place([VariableSpec(table.variable, table.shape, table.dtype)], 2, slice_threshold_bytes=1024)
    cache = RowCache(4, {table.variable: (placement.parts_of(table.variable), table.shape[1:], np.dtype("float32"))},
                     {table.variable: 500_000})
    versions, incarnations = [0, 0], [0, 0]
    steps = [sparse.step({table.variable: r}) for r in served[:2]]
    grad = SparseRows(np.arange(served[0].indices.size), served[0].values, None)
    return {
        "batch_ids (np.unique)": median_ms(lambda k: sparse.batch_ids(batches[k])),
        "RowStep (local table)": median_ms(lambda k: sparse.step({table.variable: served[k]})),
        "RowStep.whole": median_ms(lambda k: steps[0].whole(table.variable, grad)),
        "row cache: lookup, fill, take": median_ms(lambda k: cached_read(cache, ids[k], versions, incarnations)),
        "shard: serve rows": median_ms(lambda k: store.pull(-1, "w", rows={"t": mine[k]})),
        "shard: Adagrad on rows": median_ms(lambda k: store.push(
            "w", store.version, {"t": SparseRows(mine[k], np.ones((mine[k].size, table.shape[1]), np.float32),
                                                 None)})),
    }


def main() -> None:
    """Print one row per part, one column per table size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="10000,1000000,10000000", help="table sizes, comma-separated")
    sizes = [int(r) for r in parser.parse_args().rows.split(",")]
    results = {rows: profile(rows) for rows in sizes}
    print("| part (median ms per step) | " + " | ".join(f"{r:,} rows" for r in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for part in results[sizes[0]]:
        print(f"| {part} | " + " | ".join(f"{results[r][part]:.3f}" for r in sizes) + " |")


if __name__ == "__main__":
    main()
