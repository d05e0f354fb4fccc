"""Watching a run from outside: `asyncps status` and the chief's Prometheus endpoint against a
running cluster, its TensorBoard records, then `asyncps report` and `asyncps export` on the same run
after its chief was killed (no summary.json)."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from asyncps.chief.checkpoint import CheckpointDir

from asyncps.config import RunConfig
from asyncps.rundir import SUMMARY_JSON, RunDir, exported_model, wait_port_file
from asyncps.tools.local import LocalCluster
from asyncps.tools.progress import StatusPoller

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCPS_")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return subprocess.run([sys.executable, "-m", "asyncps.tools.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A running cluster (1 shard, 2 workers) with metrics on, an evaluation and a checkpoint behind it."""
    run = RunConfig(num_ps=1, num_workers=2, epochs=0, max_training_s=300, eval_every_s=1.0,
                    checkpoint_every_updates=40, compute_delay="const:0.01")
    cluster = LocalCluster(run, tmp_path_factory.mktemp("watch") / "run", prometheus_port=0)
    cluster.run_dir.mkdir(parents=True)
    try:
        cluster.start()
        poller = StatusPoller(cluster.chief_address, timeout_s=30)
        deadline = time.monotonic() + 180
        while True:
            status = poller.try_poll()
            ckpts = CheckpointDir(RunDir(cluster.run_dir).checkpoints).complete()
            if status is not None and status.eval_version > 0 and status.workers_alive == 2 and ckpts:
                break
            assert time.monotonic() < deadline and cluster.chief.alive(), "the run did not get going"
            time.sleep(0.3)
        poller.close()
        yield cluster
    finally:
        cluster.interrupt()
        cluster.stop(grace_s=5)


def test_status_prints_progress_of_a_running_cluster(cluster: LocalCluster) -> None:
    result = cli("status", cluster.chief_address)
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip()
    match = re.search(r"\]\s+([\d.]+)% ETA\s+(\S+)\s+updates\s+(\d+) .* workers 2/2", line)
    assert match, line
    percent, eta, updates = float(match[1]), match[2], int(match[3])
    assert 0 < percent < 100 and updates > 0
    assert re.fullmatch(r"\d+s|\d+m\d\ds|\d+h\d\dm", eta), eta  # max_training_s: the ETA is known

    watched = cli("status", cluster.chief_address, "--watch", "--count", "3", "--interval-s", "0.3")
    assert watched.returncode == 0, watched.stderr
    counts = [int(m) for m in re.findall(r"updates\s+(\d+)", watched.stdout)]
    assert len(counts) == 3 and counts == sorted(counts) and counts[-1] > counts[0], watched.stdout


def test_status_of_no_chief_is_a_clear_error() -> None:
    result = cli("status", "127.0.0.1:1", "--timeout-s", "1")
    assert result.returncode == 1
    assert "did not answer" in result.stderr and "127.0.0.1:1" in result.stderr


def test_metrics_endpoint_parses_with_prometheus_client(cluster: LocalCluster) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    port = wait_port_file(cluster.files.port_file("chief.metrics"), 30)
    poller = StatusPoller(cluster.chief_address)
    before = poller.poll()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    after = poller.poll()
    poller.close()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert before.updates <= value("asyncps_updates_total") <= after.updates
    assert value("asyncps_live_workers") == 2 and value("asyncps_planned_workers") == 2
    assert 0 < value("asyncps_eval_accuracy") <= 1 and value("asyncps_eval_loss") > 0
    assert 0 < value("asyncps_fraction_done") < 1
    buckets = [(float(dict(labels)["le"]), v) for (name, labels), v in samples.items()
               if name == "asyncps_staleness_bucket"]
    counts = [v for _, v in sorted(buckets)]
    assert counts == sorted(counts) and counts[-1] == value("asyncps_staleness_count") > 0
    # two workers: about one update lands between a worker's pull and its push
    assert 0 < value("asyncps_staleness_sum") / value("asyncps_staleness_count") < 3
    assert any(name == "asyncps_dropped_pushes_total" for name, _ in samples) or "asyncps_dropped_pushes" in text


def test_tensorboard_has_worker_loss_idle_fraction_drops_and_hparams(cluster: LocalCluster) -> None:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    tags: set[str] = set()
    plugins: set[str] = set()
    for path in RunDir(cluster.run_dir).tensorboard.glob("events.out.tfevents.*"):
        for event in EventFileLoader(str(path)).Load():
            for v in event.summary.value:
                tags.add(v.tag)
                plugins.add(v.metadata.plugin_data.plugin_name)
    assert {"eval/accuracy", "train/worker_loss", "train/dropped_pushes", "train/idle_fraction",
            "idle_fraction/worker_0", "run/config"} <= tags, sorted(tags)
    assert "hparams" in plugins, sorted(plugins)


@pytest.fixture(scope="module")
def crashed_run(cluster: LocalCluster) -> Path:
    """The cluster's run directory after its chief was killed (SIGKILL) mid-run."""
    cluster.chief.proc.send_signal(signal.SIGKILL)
    cluster.chief.proc.wait(timeout=30)
    cluster.stop(grace_s=5)
    assert not (cluster.run_dir / SUMMARY_JSON).exists()
    return cluster.run_dir


def test_report_on_a_run_whose_chief_was_killed(crashed_run: Path) -> None:
    result = cli("report", str(crashed_run))
    assert result.returncode == 0, result.stdout + result.stderr
    for name in ("curves", "staleness", "timeline", "scaling"):
        assert (crashed_run / "figures" / f"{name}.png").stat().st_size > 1000, name
    report = (crashed_run / "report.md").read_text()
    assert "Unfinished" in report and f"`{crashed_run.name}`" in report


def test_export_writes_a_keras_file_and_savedmodel_from_a_checkpoint(crashed_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "export"
    result = cli("export", str(crashed_run), "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    import keras
    import tensorflow as tf

    from asyncps.ml.datasets import load_dataset

    ckpt = CheckpointDir(RunDir(crashed_run).checkpoints).latest()
    assert ckpt is not None
    model = keras.models.load_model(exported_model(out))
    for variable in model.trainable_variables:
        np.testing.assert_array_equal(variable.numpy(), ckpt.values[variable.path])
    data = load_dataset("digits")
    logits = model.predict(data.x_test, verbose=0)
    saved = tf.saved_model.load(str(out / "saved_model"))  # keep it referenced: serve() uses its variables
    served = saved.serve(data.x_test).numpy()
    np.testing.assert_allclose(served, logits, rtol=1e-5, atol=1e-5)
    accuracy = float(np.mean(np.argmax(logits, axis=1) == data.y_test))
    assert accuracy > 0.5 and not math.isnan(accuracy)  # trained past chance (0.1): real values were loaded
