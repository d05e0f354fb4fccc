"""`make bench` end to end on its smallest pieces: real processes, no speed assertions.

The transfer section with a 2 MB model (a raw gRPC server and a shard process) runs in the default
suite; one scaling point (a whole local cluster, TensorFlow in the chief and a worker) is slow.
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest

from benchmarks import bench
from benchmarks.sparse import sparse_ratios

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[dict[str, Any], str]:
    out = tmp_path / "results" / "bench.json"
    code = bench.main([*args, "--out", str(out), "--no-reexec"])
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())
    assert code == 0, results["failures"]
    assert bench.validate(results) == []
    assert out.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC
    return results, printed


def test_transfer_section_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results, printed = _run(tmp_path, capsys, "--only", "transfer", "--megabytes", "2", "--repeats", "2")
    assert results["config"]["sections"] == ["transfer"]
    assert "training" not in results and "scaling" not in results
    contenders = results["transfer"]["contenders"]
    assert list(contenders) == ["raw-grpc", "raw-tcp", "asyncps-grpc", "asyncps-shm", "asyncps-tcp"]
    assert all(len(c[way]["values"]) == 2 for c in contenders.values() for way in ("pull", "push"))
    # every contender against both references (the raw socket is the tcp path's limit)
    expected = {f"{other} / {ref} {way}" for ref in ("raw-grpc", "raw-tcp") for other in contenders if other != ref
                for way in ("pull", "push")}
    assert set(results["transfer"]["ratios"]) == expected
    assert "### Transfer of a 2 MB model, MB/s" in printed and "| asyncps-grpc | push |" in printed


@pytest.mark.slow
def test_one_scaling_point_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results, printed = _run(tmp_path, capsys, "--only", "scaling", "--scaling-workers", "1", "--scaling-shards", "",
                            "--fixed-shards", "1", "--repeats", "1", "--seconds", "2", "--transports", "shm")
    (point,) = results["scaling"]["points"]
    assert (point["workers"], point["shards"], point["transport"]) == (1, 1, "shm")
    assert point["steps_per_s"] > 0 and point["compute_ms"] > 0 and point["step_ms"] >= point["compute_ms"]
    assert point["worker_rss_mb"] > 0 and point["shard_rss_mb"] > 0 and point["chief_rss_mb"] > 0
    assert "| shm | 1 | 1 |" in printed


def _synthetic() -> dict[str, Any]:
    """A results dict with every section, shaped like run_bench's."""
    def samples(name: str, unit: str, values: list[float]) -> dict[str, Any]:
        return {"name": name, "unit": unit, "median": sorted(values)[len(values) // 2], "min": min(values),
                "max": max(values), "values": values}

    training = {}
    for label in ("784-512-512-10", "784-2048-2048-10"):
        training[label] = {"contenders": {
            "keras-local": {**samples("k", "steps/s", [300.0, 310.0, 320.0]), "threads": {"intra_op": 2, "inter_op": 1},
                            "transport": None, "reference": True, "step_ms": 3.2, "compute_ms": None,
                            "overhead_ms": None},
            "tf-ps-strategy": {**samples("t", "steps/s", [150.0, 160.0, 170.0]),
                               "threads": {"intra_op": 1, "inter_op": 3}, "transport": None, "reference": True,
                               "step_ms": None, "compute_ms": None, "overhead_ms": None},
            "asyncps-grpc": {**samples("a", "steps/s", [200.0, 210.0, 220.0]),
                             "threads": {"intra_op": 1, "inter_op": 1}, "transport": "grpc", "reference": False,
                             "step_ms": 9.0, "compute_ms": 5.0, "overhead_ms": 4.0}},
            "ratios": {"asyncps-grpc / keras-local": 210.0 / 310.0}}
    points = [{"workers": w, "shards": s, "steps_per_s": 100.0 * w / s, "worker_rss_mb": 300.0,
               "shard_rss_mb": 100.0, "chief_rss_mb": 400.0, "step_ms": 5.0, "compute_ms": 3.0, "transport": "grpc"}
              for w, s in ((1, 2), (2, 2), (4, 2), (2, 1))]
    return {
        "schema": bench.SCHEMA, "started": "now", "machine": {"cpus": 2}, "env": {}, "failures": {}, "wall_s": 1.0,
        "config": {"sections": list(bench.SECTIONS)}, "training": training,
        "overhead": {"grpc": {"784-512-512-10": {"step_ms": 9.0, "compute_ms": 5.0, "overhead_ms": 4.0}}},
        "transfer": {"megabytes": 40, "contenders": {
            "raw-grpc": {"pull": samples("r", "MB/s", [900.0]), "push": samples("r", "MB/s", [800.0]),
                         "reference": True},
            "asyncps-grpc": {"pull": samples("a", "MB/s", [700.0]), "push": samples("a", "MB/s", [600.0]),
                             "reference": False}}, "ratios": {}},
        "scaling": {"hidden": [512, 512], "model": "784-512-512-10", "seconds": 17.0, "fixed_shards": 2,
                    "fixed_workers": 2, "points": points},
        "sparse": _sparse_section(samples),
        "replication": {"transport": "tcp", "num_ps": 2, "num_workers": 2, "workloads": {"mlp 784-512-512-10": {
            "1": {**samples("replicas 1", "steps/s", [200.0, 210.0]), "step_ms": 9.0, "steps": 400},
            "2": {**samples("replicas 2", "steps/s", [150.0, 160.0]), "step_ms": 12.0, "steps": 300},
            "ratio": 160.0 / 210.0}}},
    }


def _sparse_section(samples: Any) -> dict[str, Any]:
    """The sparse section at two table sizes, shaped like bench._run_sparse's."""
    rows: dict[str, Any] = {}
    for size, scale in (("10000", 1.0), ("1000000", 0.1)):
        rows[size] = {
            "keras-local": {**samples("k", "steps/s", [500.0 * scale]), "bytes_per_step": None,
                            "rss_mb": {"worker": 600.0}},
            "tf-ps-strategy": {**samples("t", "steps/s", [200.0 * scale]), "bytes_per_step": None,
                               "rss_mb": {"worker": 500.0, "shard": 300.0, "chief": 400.0}},
            "asyncps-tcp": {**samples("a", "steps/s", [300.0 * scale, 350.0 * scale]), "bytes_per_step": 1.5e6,
                            "rss_mb": {"worker": 580.0, "shard": 80.0, "chief": 610.0}}}
    return {"batch": 256, "num_ps": 2, "num_workers": 2, "rows": rows, "ratios": sparse_ratios(rows)}


def test_tables_and_plot_of_every_section(tmp_path: Path) -> None:
    results = _synthetic()
    assert bench.validate(results) == []
    tables = bench.markdown_tables(results)
    for title in ("### Training steps/s, MLP 784-2048-2048-10", "### Per-step overhead", "### Transfer of a 40 MB",
                  "### Scaling, MLP 784-512-512-10", "### Sparse: recsys model", "### Replication's cost"):
        assert title in tables
    assert "| asyncps-grpc | 210.0 | 200.0-220.0 | 3 | 1/1 | 9.00 | 5.00 | 4.00 | 0.68 | 1.31 |" in tables
    assert "| mlp 784-512-512-10 | 210.0 | 200.0-210.0 | 9.00 | 160.0 | 150.0-160.0 | 12.00 | 0.76 |" in tables
    png = tmp_path / "plot.png"
    bench.plot(results, png)
    assert png.read_bytes()[:8] == PNG_MAGIC
    # a single scaling point off both curves' fixed shapes still plots, without warnings
    only = {**results, "scaling": {**results["scaling"], "fixed_shards": 1, "points": results["scaling"]["points"][:1]}}
    for key in ("training", "transfer", "overhead"):
        only.pop(key)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bench.plot(only, png)


def test_validate_rejects_broken_results() -> None:
    good = _synthetic()
    broken = []
    for mutate in (
        lambda r: r.pop("wall_s"),
        lambda r: r.update(schema=99),
        lambda r: r.pop("transfer"),  # listed in config.sections
        lambda r: r["training"]["784-512-512-10"]["contenders"]["keras-local"].update(median=1e9),
        lambda r: r["transfer"]["contenders"]["raw-grpc"]["pull"].update(values=[]),
        lambda r: r["scaling"]["points"][0].pop("chief_rss_mb"),
        lambda r: r["overhead"]["grpc"]["784-512-512-10"].pop("overhead_ms"),
        lambda r: r["sparse"]["rows"]["10000"]["asyncps-tcp"].pop("rss_mb"),
        lambda r: r["sparse"]["rows"]["10000"]["keras-local"].update(values=[]),
        lambda r: r["replication"]["workloads"]["mlp 784-512-512-10"]["2"].pop("step_ms"),
        lambda r: r["replication"]["workloads"]["mlp 784-512-512-10"].update(ratio=0.0),
        lambda r: r.update(replication={}),
    ):
        r = copy.deepcopy(good)
        mutate(r)
        broken.append(bench.validate(r))
    assert all(broken), broken


def test_options() -> None:
    cfg, out, reexec = bench.parse_args(["--quick", "--only", "scaling", "--only", "training", "--no-reexec"])
    assert cfg.sections == ("training", "scaling") and cfg.models == ((512, 512),) and not reexec
    assert out == bench.DEFAULT_OUT
    assert cfg.scaling_points() == [(1, 2), (2, 2), (2, 1)]
    assert bench.parse_args([])[0].scaling_points() == [(1, 2), (2, 2), (4, 2), (8, 2), (2, 1), (2, 4)]
    assert bench.parse_args(["--models", "small,64x32"])[0].models == ((512, 512), (64, 32))
    assert not cfg.scaling_all_transports
    assert [c.name for c in bench.training_contenders(cfg)] == ["keras-local", "tf-ps-strategy", "asyncps-grpc",
                                                                 "asyncps-shm", "asyncps-tcp"]
    assert [c.name for c in bench.transfer_contenders(cfg)] == ["raw-grpc", "raw-tcp", "asyncps-grpc", "asyncps-shm",
                                                                "asyncps-tcp"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--transports", "pigeon"])


def test_stages_reads_cpu_from_proc_and_tabulates_every_role() -> None:
    """benchmarks.stages: this process's CPU seconds grow with work; the table has a column per role."""
    from benchmarks import stages

    before = stages._cpu_s(os.getpid())
    assert before is not None
    sum(i * i for i in range(2_000_000))
    after = stages._cpu_s(os.getpid())
    assert after is not None and after > before
    assert stages._cpu_s(2**22 + 7) is None  # no such process
    rows = [stages.Stages("tcp", "512-512", 100.0, 20.0, 8.0, 9.0, 0.0, 3.0, {"ps": 4.0, "worker": 15.0}),
            stages.Stages("shm", "512-512", 150.0, 13.3, 8.0, 2.0, 0.0, 3.3, {"chief": 1.0, "ps": 2.0})]
    text = stages.table(rows)
    assert "| CPU ms/step chief | CPU ms/step ps | CPU ms/step worker |" in text
    assert "| tcp | 784-512-512-10 | 100.0 | 20.00 | 8.00 | 9.00 | 0.00 | 3.00 | 0.00 | 4.00 | 15.00 |" in text


def test_sparse_section_plumbing() -> None:
    """The sparse section's options, contenders, ratios and table (no measurement: those run in `make bench`)."""
    quick = bench.parse_args(["--quick", "--only", "sparse"])[0]
    assert quick.sections == ("sparse",) and quick.sparse_rows == (10_000, 1_000_000)
    assert bench.parse_args([])[0].sparse_rows == (10_000, 1_000_000, 10_000_000)
    assert bench.parse_args(["--sparse-rows", "10000,50000000"])[0].sparse_rows == (10_000, 50_000_000)
    with pytest.raises(SystemExit):
        bench.parse_args(["--only", "sparse", "--sparse-rows", ""])
    assert [name for name, _ in bench.sparse_contenders(quick)] == ["keras-local", "tf-ps-strategy", "asyncps-tcp",
                                                                     "asyncps-shm", "asyncps-tcp-cache",
                                                                     "asyncps-tcp-keyed"]
    section = _synthetic()["sparse"]
    assert section["ratios"] == {"asyncps-tcp / tf-ps-strategy at 1000000 rows": pytest.approx(35.0 / 20.0),
                                 "asyncps-tcp 1000000 / 10000 rows": pytest.approx(0.1)}
    big = {**section["rows"], "10000000": section["rows"]["1000000"]}
    assert "asyncps-tcp / keras-local at 10000000 rows" in sparse_ratios(big)
    table = bench.markdown_tables({"sparse": section})
    assert "| 1000000 | asyncps-tcp | 35.0 | 30.0-35.0 | 2 | 1.50 | - | - | - | 580 | 80 | 610 |" in table
    assert "| 10000 | keras-local | 500.0 | 500.0-500.0 | 1 | n/a | - | - | - | 600 | - | - |" in table
    cached = {**section["rows"]["10000"]["asyncps-tcp"], "pulled_per_step": 2.5e5, "rows_per_step": 1428.4,
              "hit_rate": 0.41}
    row = bench.markdown_tables({"sparse": {**section, "rows": {"10000": {"asyncps-tcp-cache": cached}}}})
    assert "| 10000 | asyncps-tcp-cache | 350.0 | 300.0-350.0 | 2 | 1.50 | 250.0 | 1428 | 0.41 | 580 | 80 | 610 |" \
        in row
    assert "| asyncps-tcp / tf-ps-strategy at 1000000 rows | 1.750 |" in table


def test_capacity_arithmetic() -> None:
    """benchmarks.capacity: the binding term and the shard count follow the measured costs (no measurement)."""
    from benchmarks import capacity

    assert capacity.fit_line([1.0, 2.0, 3.0], [3.0, 5.0, 7.0]) == (pytest.approx(1.0), pytest.approx(2.0))
    # 100 workers x 10 steps/s x 8 MB a step (4 MB each way) = 4 GB/s a direction: 4 shards at 10 Gbit/s
    # (1.25 GB/s each) if a step costs the shards no CPU; 1 ms of shard CPU a step: 1,000 steps/s a core -> 1
    assert capacity.shards_needed(100, 10.0, 8e6, 0.0, 10) == (4, "net")
    assert capacity.shards_needed(100, 10.0, 8e6, 0.0, 100) == (1, "net")
    assert capacity.shards_needed(100, 10.0, 8e3, 0.005, 10) == (5, "cpu")


def test_replication_section_plumbing() -> None:
    """The replication section's workloads: each MLP of the run and the recsys model, all over tcp on 2 shards x 2
    workers (its measurement runs in `make bench`)."""
    from benchmarks.replication import workloads

    cfg = bench.parse_args(["--quick", "--only", "replication"])[0]
    assert cfg.sections == ("replication",)
    runs = workloads(cfg.models, cfg.train_seconds)
    assert [label for label, _, _ in runs] == ["mlp 784-512-512-10", "recsys 10000 rows"]
    assert all(r.transport == "tcp" and r.num_ps == 2 and r.num_workers == 2 for _, r, _ in runs)
    assert runs[1][1].model == "recsys" and runs[1][1].dataset == "recsys:rows=10000"
