"""`--stop-at`: the level a run stops at, parsed and compared (the end-to-end run is in test_local_cluster)."""

from __future__ import annotations

import math

import pytest

from asyncps.config import RunConfig
from asyncps.ml.stopat import StopAt, parse_stop_at


def test_parse_reads_metric_operator_and_level() -> None:
    assert parse_stop_at("accuracy>=0.9") == StopAt("accuracy", ">=", 0.9)
    assert parse_stop_at(" loss <= 1e-2 ") == StopAt("loss", "<=", 0.01)
    assert parse_stop_at("mse<=0.3") == StopAt("mse", "<=", 0.3)
    assert parse_stop_at("") is None and parse_stop_at("  ") is None


@pytest.mark.parametrize(("text", "says"), [
    ("accuracy>0.9", "is not METRIC>=VALUE or METRIC<=VALUE"),
    ("accuracy=0.9", "is not METRIC>=VALUE"),
    ("0.9<=accuracy", "is not METRIC>=VALUE"),
    ("accuracy>=high", "'high' is not a number"),
    ("loss<=nan", "must be a finite number"),
    ("loss<=inf", "must be a finite number"),
])
def test_a_malformed_level_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError, match="stop_at") as info:
        parse_stop_at(text)
    assert says in str(info.value)
    with pytest.raises(ValueError, match="invalid run configuration") as info:
        RunConfig(stop_at=text)
    assert says in str(info.value)


def test_met_compares_in_the_operators_direction() -> None:
    above, below = StopAt("accuracy", ">=", 0.9), StopAt("loss", "<=", 0.1)
    assert above.met(1.0, 0.9, {}) and not above.met(1.0, 0.8999, {})
    assert below.met(0.1, math.nan, {}) and not below.met(0.1001, 0.99, {})


def test_a_named_metric_is_read_from_the_evaluations_metrics() -> None:
    mse = StopAt("mse", "<=", 0.3)
    assert mse.met(5.0, math.nan, {"mse": 0.25}) and not mse.met(0.0, math.nan, {"mse": 0.31})
    # the task's own metric of that name wins over the built-in accuracy
    assert not StopAt("accuracy", ">=", 0.9).met(0.0, 0.95, {"accuracy": 0.5})


def test_a_metric_the_evaluation_lacks_never_stops_the_run() -> None:
    assert not StopAt("accuracy", ">=", 0.0).met(0.1, math.nan, {"mse": 0.1})
    assert math.isnan(StopAt("auc", ">=", 0.5).observed(0.1, 0.9, {"mse": 0.1}))
    assert not StopAt("auc", "<=", 1e9).met(0.1, 0.9, {})


def test_the_chief_refuses_a_level_its_evaluation_cannot_report() -> None:
    from asyncps.chief.main import check_stop_at

    from asyncps.ml.task import resolve_task
    from asyncps.runmodel import build_run_model

    run = RunConfig(model="mlp:8", dataset="digits", stop_at="auc>=0.9")
    data, model = build_run_model(run)
    task = resolve_task(run.loss, run.eval_metrics, model, data.y_test)
    with pytest.raises(ValueError, match=r"--stop-at auc >= 0.9: this run's evaluation reports no auc "
                                         r"\(it reports loss, accuracy\)"):
        check_stop_at(run, task)
    for level in ("accuracy>=0.9", "loss<=0.2", ""):
        check_stop_at(RunConfig(model="mlp:8", dataset="digits", stop_at=level), task)


def test_early_stop_waits_patience_evaluations_without_improvement() -> None:
    from asyncps.ml.stopat import EarlyStopWatch, parse_early_stop

    rule = parse_early_stop("val_loss:patience=2,min_delta=0.1")
    assert rule is not None and (rule.metric, rule.mode) == ("loss", "min")
    watch = EarlyStopWatch(rule)
    assert [watch.observe(loss, 0.0, {}) for loss in (1.0, 0.8, 0.75, 0.72, 0.5)] == [False, False, False, True,
                                                                                       False]
    accuracy = parse_early_stop("accuracy:patience=1")
    assert accuracy is not None and accuracy.mode == "max"


@pytest.mark.parametrize("text", ["loss:patience=0", "loss:wait=3", "loss:mode=up", "val_loss:patience=x", "1loss"])
def test_a_bad_early_stop_is_a_clear_error(text: str) -> None:
    from asyncps.ml.stopat import parse_early_stop

    with pytest.raises(ValueError, match="early_stop"):
        parse_early_stop(text)
