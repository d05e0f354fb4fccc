"""Bring your own: a user's model, dataset, loss and staleness-policy plugin from examples/byo.

The example is trained end to end as real processes through `asyncps local` and through
`asyncps.train`, and must reach a stated test accuracy (0.95 on three classes, chance 0.33); the
plugin is loaded by name in the shards and must drop exactly the pushes of the worker it names.
Around them, fast checks of the loading rules: what is refused, and with which message.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from asyncps.ps.store import ShardStore

from asyncps.identity import index_of, new_worker_id
from asyncps.ml.userfns import add_user_path
from asyncps.rules import POLICIES, OptimizerConfig, UpdateRuleConfig
from asyncps.rules.policies import PushContext
from asyncps.rundir import RunDir, exported_model
from tests.conftest import ShardLauncher

ROOT = Path(__file__).resolve().parent.parent
BYO = ROOT / "examples" / "byo"
#: The accuracy the example must reach on its test split (chance is 1/3).
STATED_ACCURACY = 0.95
EXAMPLE = {"model": "shapes_model:build", "dataset": "shapes_data:load", "loss": "sparse_categorical_crossentropy",
           "optimizer": "adam", "learning_rate": 0.01, "epochs": 4, "num_workers": 2, "num_ps": 1}


@pytest.fixture(autouse=True, scope="module")
def byo_on_path() -> None:
    add_user_path([str(BYO)])


def run_cli(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "ASYNCPS_USER_PATH"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return subprocess.run([sys.executable, "-m", "asyncps.tools.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def push_rows(run_dir: Path) -> list[dict[str, str]]:
    with open(RunDir(run_dir).pushes, newline="") as f:
        return list(csv.DictReader(f))


# -- end to end ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_example_trains_through_the_cli(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_cli(["local", "--user-path", str(BYO), "--run-dir", str(run_dir), "--quiet",
                      "--model", EXAMPLE["model"], "--dataset", EXAMPLE["dataset"], "--loss", EXAMPLE["loss"],
                      "--optimizer", "adam", "--learning-rate", "0.01", "--epochs", "4", "--num-workers", "2",
                      "--num-ps", "1",
                      "--eval-metrics", "sparse_categorical_accuracy,shapes_model:true_class_probability"])
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(RunDir(run_dir).summary.read_text())
    assert summary["model"] == "shapes_model:build" and summary["dataset"] == "shapes_data:load"
    assert summary["final_eval"]["accuracy"] >= STATED_ACCURACY, summary["final_eval"]
    # the Keras metric measures what the chief's own accuracy does; the user's metric is a probability
    assert summary["metrics"]["sparse_categorical_accuracy"] == pytest.approx(summary["final_eval"]["accuracy"])
    assert 1 / 3 < summary["metrics"]["shapes_model:true_class_probability"] <= 1.0
    assert RunDir(run_dir).exported_model.exists()
    # its last checkpoint exports with no --user-path: the checkpoint records where the chief imported from
    exported = run_cli(["export", str(run_dir), "--out", str(tmp_path / "export")])
    assert exported.returncode == 0, exported.stdout + exported.stderr
    import keras

    from asyncps.ml.datasets import load_dataset

    data = load_dataset(EXAMPLE["dataset"])
    model = keras.models.load_model(exported_model(tmp_path / "export"))
    accuracy = float(np.mean(np.argmax(model.predict(data.x_test, verbose=0), axis=1) == data.y_test))
    assert accuracy >= STATED_ACCURACY


@pytest.mark.slow
def test_example_trains_through_asyncps_train(tmp_path: Path) -> None:
    from shapes_data import load
    from shapes_model import build

    import asyncps

    # functions travel by name; the directory reaches the child processes through user_path
    result = asyncps.train(model=build, dataset=load, loss=EXAMPLE["loss"], optimizer="adam", learning_rate=0.01,
                           epochs=4, num_workers=2, num_ps=1, run_dir=tmp_path / "run", user_path=[str(BYO)])
    summary = result.summary
    assert type(summary).__name__ == "RunSummary" and summary.workers == 2 and result.workers == 2
    assert summary.model == "shapes_model:build"
    assert summary.final_eval.accuracy >= STATED_ACCURACY, summary.final_eval


@pytest.mark.slow
def test_policy_plugin_is_loaded_by_name_and_applied_in_the_shard(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_cli(["local", "--user-path", str(BYO), "--run-dir", str(run_dir), "--quiet", "--model", "logreg",
                      "--num-workers", "2", "--num-ps", "1", "--max-updates", "40",
                      "--staleness-policy", "byo_plugins:IgnoreWorker:worker=1"])
    assert result.returncode == 0, result.stdout + result.stderr
    rows = push_rows(run_dir)
    by_worker = {w: [r for r in rows if r["worker"] == w] for w in ("0", "1")}
    assert by_worker["0"] and by_worker["1"], "both workers pushed"
    assert all(r["accepted"] == "1" for r in by_worker["0"])
    assert all(r["accepted"] == "0" and r["drop_reason"] == "stale" and "worker 1 is ignored" in r["drop_detail"]
               for r in by_worker["1"])
    summary = json.loads(RunDir(run_dir).summary.read_text())
    assert summary["staleness_policy"] == "byo_plugins:IgnoreWorker"  # canonical: worker=1 is the default
    assert summary["dropped_by_reason"].get("stale", 0) >= len(by_worker["1"]) > 0


def test_a_plugin_the_shards_cannot_import_is_a_clear_error(tmp_path: Path) -> None:
    result = run_cli(["local", "--run-dir", str(tmp_path / "run"), "--quiet", "--max-updates", "5",
                      "--staleness-policy", "no_such_plugins:Policy"])
    assert result.returncode == 2
    assert "staleness policy plugin 'no_such_plugins:Policy'" in result.stderr
    assert "--user-path" in result.stderr


# -- the loading rules, in process ------------------------------------------------------------------


def test_plugin_spec_round_trips_and_the_store_applies_it_per_worker() -> None:
    rule = UpdateRuleConfig(OptimizerConfig("sgd", 0.5), staleness_policy="byo_plugins:IgnoreWorker:worker=0",
                            num_workers=2)
    assert rule.staleness_policy == "byo_plugins:IgnoreWorker:worker=0"  # the canonical spec, as on the wire
    assert POLICIES.normalize("byo_plugins:IgnoreWorker:worker=1") == "byo_plugins:IgnoreWorker"  # the default
    store = ShardStore()
    store.initialize(rule, {"w": np.zeros(2, np.float32)})
    ignored, kept = new_worker_id("worker", 0), new_worker_id("worker", 1)
    assert (index_of(ignored), index_of(kept), index_of(new_worker_id("worker"))) == (0, 1, None)
    dropped = store.push(ignored, 0, {"w": np.ones(2, np.float32)}, step=7)
    applied = store.push(kept, 0, {"w": np.ones(2, np.float32)}, step=3)
    assert not dropped.accepted and "step 7" in dropped.detail
    assert applied.accepted and applied.staleness == 0
    np.testing.assert_allclose(store.pull(-1, kept).values["w"], [-0.5, -0.5])


def test_the_worker_index_pushed_with_a_gradient_reaches_the_plugin_in_a_real_shard(
        shard_factory: ShardLauncher) -> None:
    from asyncps.errors import InvalidArgumentError
    from asyncps.placement import VariableSpec, place
    from asyncps.transport import connect_model, connect_shard
    from asyncps.wire.shard import PushRequest

    [shard] = shard_factory(1, args=("--user-path", str(BYO), "--plugins", "byo_plugins"))
    rule = UpdateRuleConfig(OptimizerConfig("sgd", 0.5), staleness_policy="byo_plugins:IgnoreWorker:worker=1",
                            num_workers=2)
    frames = connect_shard(shard.address)
    # a worker whose index the chief assigned, over shared memory as `asyncps local` runs it
    assigned = connect_model(new_worker_id("worker"), [shard.address], place([VariableSpec("w", (2,), "float32")], 1),
                             transport="shm", worker_index=1)
    try:
        frames.initialize("chief", 0, 1, rule, {"w": np.zeros(2, np.float32)})
        one = {"w": np.ones(2, np.float32)}
        [pushed] = assigned.push_pull(one, step=4, loss=0.0, base=[0])
        assert pushed.outcome is not None and not pushed.outcome.accepted
        assert "worker 1 is ignored (step 4" in pushed.outcome.detail
        assert frames.push(PushRequest(new_worker_id("worker"), 0, one, step=2, worker_index=0)).accepted
        # no index pushed (a worker of an earlier version): the worker id's index, as before, or none
        assert not frames.push(PushRequest(new_worker_id("worker", 1), 1, one, step=3)).accepted
        assert frames.push(PushRequest(new_worker_id("worker"), 1, one, step=3)).accepted
        with pytest.raises(InvalidArgumentError, match="worker_index") as bad:
            frames.push(PushRequest(new_worker_id("worker"), 2, one, worker_index=-2))
        assert bad.value.code == "INVALID_ARGUMENT"
        stats = frames.stats()
        assert (stats.version, stats.pushes_accepted, stats.pushes_dropped) == (2, 2, 2)  # the bad push changed nothing
    finally:
        assigned.close()
        frames.close()


def test_push_context_reaches_a_policy() -> None:
    policy = POLICIES.parse("byo_plugins:IgnoreWorker:worker=3")
    assert not policy.decide_push(PushContext(new_worker_id("worker", 3), 1, 0)).accept
    assert policy.decide_push(PushContext(new_worker_id("worker", 2), 1, 0)).accept
    assert policy.decide_push(PushContext("worker-host-1-abc", 1, 0)).accept  # index unknown: applied
    assert not policy.decide_push(PushContext("worker-host-1-abc", 1, 0, pushed_index=3)).accept  # sent with it
    assert policy.decide_push(PushContext(new_worker_id("worker", 3), 1, 0, pushed_index=2)).accept  # it wins


def test_a_model_with_batchnorm_holds_its_statistics_on_the_shards() -> None:
    from asyncps.ml.models import build_model, shard_variables, state_variables

    model = build_model("shapes_model:build_with_batchnorm", 64, 3, (8, 8, 1))
    state = [v.path.split("/")[-1] for v in state_variables(model)]
    assert state == ["moving_mean", "moving_variance"]
    assert [v.path for v in shard_variables(model)][:len(model.trainable_variables)] == [
        v.path for v in model.trainable_variables]


def test_user_model_and_dataset_load_like_the_built_in_ones() -> None:
    from asyncps.ml.datasets import load_dataset
    from asyncps.ml.models import build_model

    data = load_dataset("shapes_data:load")
    assert (data.x_train.shape, data.image_shape, data.num_classes) == ((2400, 64), (8, 8, 1), 3)
    assert data.x_train.dtype == np.float32 and data.x_train.min() >= 0.0 and data.x_train.max() <= 1.0
    model = build_model("shapes_model:build", data.num_features, data.num_classes, data.image_shape)
    assert model(data.x_test[:5]).shape == (5, 3)
    assert all(v.path.startswith("shapes_cnn/") for v in model.trainable_variables)


@pytest.mark.parametrize("spec, message", [
    ("shapes_model:nothing", "has no 'nothing'"),
    ("not_a_module_anywhere:build", "cannot import 'not_a_module_anywhere'.*--user-path"),
])
def test_bad_model_specs_say_what_is_wrong(spec: str, message: str) -> None:
    from asyncps.ml.models import build_model

    with pytest.raises(ValueError, match=message):
        build_model(spec, 64, 3)


def test_bad_losses_and_datasets_say_what_is_wrong(tmp_path: Path) -> None:
    from asyncps.ml.datasets import load_dataset
    from asyncps.ml.task import make_loss, make_metrics

    (tmp_path / "byo_bad_data.py").write_text("def flat():\n    return [1, 2, 3]\n")
    add_user_path([str(tmp_path)])
    with pytest.raises(ValueError, match="unknown loss 'no_such_loss'"):
        make_loss("no_such_loss")
    with pytest.raises(ValueError, match="unknown metric 'accuracy_please'"):
        make_metrics("sparse_categorical_accuracy, accuracy_please")
    with pytest.raises(ValueError, match=r"must return \(x_train, y_train\), \(x_test, y_test\), got list"):
        load_dataset("byo_bad_data:flat")


def test_an_installed_entry_point_is_a_policy_name(tmp_path: Path) -> None:
    # an installed distribution as importlib.metadata finds it: a .dist-info folder on sys.path
    (tmp_path / "byo_ep_policy.py").write_text(
        "from dataclasses import dataclass\n"
        "from asyncps.rules.policies import Decision, StalenessPolicy\n"
        "from asyncps.rules.registry import param\n\n"
        "@dataclass(frozen=True)\n"
        "class HalfRate(StalenessPolicy):\n"
        "    '''Applies every gradient at a fraction of the learning rate.'''\n"
        "    scale: float = param(0.5)\n\n"
        "    def decide(self, staleness: int) -> Decision:\n"
        "        return Decision(True, lr_scale=self.scale)\n")
    dist = tmp_path / "byo_ep-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: byo-ep\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[asyncps.policies]\nhalf-rate = byo_ep_policy:HalfRate\n")
    add_user_path([str(tmp_path)])
    try:
        rule = UpdateRuleConfig(OptimizerConfig("sgd", 1.0), staleness_policy="half-rate:scale=0.25")
        assert rule.staleness_policy == "half-rate:scale=0.25"
        store = ShardStore()
        store.initialize(rule, {"w": np.zeros(1, np.float32)})
        assert store.push("w0", 0, {"w": np.ones(1, np.float32)}).effective_lr == pytest.approx(0.25)
    finally:
        POLICIES.unregister("half-rate")


def test_optimizer_and_mode_plugins_travel_on_the_wire_and_run_in_a_store() -> None:
    from asyncps.wire.proto import rule_from_proto, rule_to_proto

    rule = UpdateRuleConfig(OptimizerConfig("byo_plugins:SignSGD", 0.1), mode="byo_plugins:FirstWins", num_workers=2)
    assert rule.optimizer.spec == "byo_plugins:SignSGD:lr=0.1"
    assert rule_from_proto(rule_to_proto(rule)) == rule
    store = ShardStore()
    store.initialize(rule, {"w": np.zeros(2, np.float32)})
    first = store.push("worker#0-a", 0, {"w": np.array([3.0, -0.2], np.float32)})
    second = store.push("worker#1-b", 0, {"w": np.array([1.0, 1.0], np.float32)})
    assert first.accepted and not second.accepted and second.drop is not None and second.drop.value == "late"
    np.testing.assert_allclose(store.pull(-1, "worker#0-a").values["w"], [-0.1, 0.1])


@pytest.mark.slow
def test_asyncps_train_reports_why_a_user_model_failed(tmp_path: Path) -> None:
    import asyncps

    with pytest.raises(asyncps.TrainingFailed, match="2 outputs"):
        asyncps.train(model="targets:build_two_heads", dataset="shapes_data:load", max_updates=5,
                      num_workers=1, num_ps=1, run_dir=tmp_path / "run", user_path=[str(BYO)])
