"""The run configuration from one source: flags, ASYNCPS_* variables and --run-config files, all
generated from RunConfig's fields, in the order default < file < environment < explicit flag."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncps.config import RunConfig, env_name, flag_name, read_settings_file, run_options
from asyncps.rundir import RunDir
from asyncps.tools.cli import build_parser, main, run_config_from
from asyncps.tools.local import child_env

ROOT = Path(__file__).resolve().parent.parent


def resolve(argv: list[str], env: dict[str, str] | None = None, command: str = "local") -> RunConfig:
    args = build_parser().parse_args([command, *argv])
    return run_config_from(args, environ=env or {})


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# -- precedence ----------------------------------------------------------------------------------
def test_defaults_without_file_env_or_flags() -> None:
    assert resolve([]) == RunConfig()


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    file = write(tmp_path / "run.json", json.dumps({"seed": 1, "batch_size": 8, "model": "logreg", "tf_threads": 3}))
    env = {"ASYNCPS_SEED": "2", "ASYNCPS_BATCH_SIZE": "16"}
    run = resolve(["--run-config", file, "--seed", "3"], env)
    assert (run.seed, run.batch_size, run.model, run.tf_threads) == (3, 16, "logreg", 3)
    assert run.dataset == RunConfig().dataset  # nothing set it: the default


def test_an_explicit_flag_equal_to_its_default_wins_over_file_and_environment(tmp_path: Path) -> None:
    default = RunConfig()
    file = write(tmp_path / "run.json", json.dumps({"mode": "sync", "learning_rate": 0.5, "num_workers": 4}))
    run = resolve(["--run-config", file, "--mode", default.mode, "--learning-rate", str(default.learning_rate),
                   "--num-workers", str(default.num_workers)])
    assert (run.mode, run.learning_rate, run.num_workers) == (default.mode, default.learning_rate,
                                                              default.num_workers)
    run = resolve(["--mode", default.mode], {"ASYNCPS_MODE": "sync"})
    assert run.mode == default.mode
    # not given: the file's values, and the environment's over them
    assert resolve(["--run-config", file]).mode == "sync"
    assert resolve(["--run-config", file], {"ASYNCPS_LEARNING_RATE": "0.2"}).learning_rate == 0.2


def test_field_named_variables_and_flags_and_no_older_spellings(capsys: pytest.CaptureFixture[str]) -> None:
    assert resolve([], {"ASYNCPS_LEARNING_RATE": "0.3"}).learning_rate == 0.3
    assert resolve(["--learning-rate", "0.4"]).learning_rate == 0.4
    assert resolve([], {"ASYNCPS_EVAL_EVERY_S": "7"}).eval_every_s == 7.0
    assert resolve([], {"ASYNCPS_NUM_WORKERS": "3", "ASYNCPS_PS": "1"}).num_workers == 3
    # the spellings renamed before the first release (docs/cli.md) are gone, as flags and as variables
    assert resolve([], {"ASYNCPS_LR": "0.3", "ASYNCPS_WORKERS": "5", "ASYNCPS_METRICS": "mae"}) == RunConfig()
    for old in ("--lr", "--workers", "--metrics", "--max-seconds", "--no-workers-timeout-s", "--checkpoint-every",
                "--eval-every", "--chief-timeout", "--heartbeat-interval"):  # no prefix of a flag stands for it
        with pytest.raises(SystemExit):
            build_parser().parse_args(["local", old, "1"])
        assert "unrecognized arguments" in capsys.readouterr().err, old


def test_empty_variables_count_as_unset() -> None:
    # docker-compose passes ${ASYNCPS_OPTIMIZER_PARAMS:-} and the like through as empty strings
    assert resolve([], {"ASYNCPS_OPTIMIZER_PARAMS": "", "ASYNCPS_MODEL": " "}) == RunConfig()


def test_epochs_default_gives_way_to_another_stop_from_any_layer(tmp_path: Path) -> None:
    assert resolve(["--max-updates", "100"]).epochs == 0.0
    assert resolve([], {"ASYNCPS_MAX_TRAINING_S": "5"}).epochs == 0.0
    file = write(tmp_path / "run.json", json.dumps({"epochs": 5}))
    run = resolve(["--run-config", file, "--max-updates", "100"])
    assert (run.epochs, run.max_updates) == (5.0, 100)
    run = resolve(["--run-config", file, "--max-updates", "100"], {"ASYNCPS_EPOCHS": "0"})
    assert run.epochs == 0.0


def test_repeated_options_and_the_two_checkpoint_schedules() -> None:
    run = resolve(["--optimizer-params", "beta_1=0.8", "--optimizer-params", "beta_2=0.99,epsilon=1e-7",
                   "--optimizer", "adam"])
    assert run.optimizer_params == {"beta_1": 0.8, "beta_2": 0.99, "epsilon": 1e-7}
    run = resolve(["--optimizer", "adam"], {"ASYNCPS_OPTIMIZER_PARAMS": "beta_1=0.9 beta_2=0.999"})
    assert run.optimizer_params == {"beta_1": 0.9, "beta_2": 0.999}
    run = resolve([])
    assert (run.checkpoint_every_s, run.checkpoint_every_updates) == (30.0, 0)
    run = resolve(["--checkpoint-every-updates", "500"], {"ASYNCPS_CHECKPOINT_EVERY_S": "off"})
    assert (run.checkpoint_every_s, run.checkpoint_every_updates) == (0.0, 500)


def test_off_and_auto_are_the_words_for_a_sentinel(tmp_path: Path) -> None:
    """`off` (or 0) turns a feature or a limit off; `auto` lets asyncps choose, and 0 is no value of it."""
    run = resolve(["--max-updates", "off", "--max-training-s", "5", "--tf-threads", "auto", "--task-size", "auto"])
    assert (run.max_updates, run.max_training_s, run.tf_threads, run.task_size) == (0, 5.0, 0, 0)
    assert resolve(["--max-updates", "0", "--epochs", "off", "--max-training-s", "5"]).epochs == 0.0
    with pytest.raises(ValueError, match="--tf-threads '0': wants a number > 0 or auto"):
        resolve(["--tf-threads", "0"])
    file = write(tmp_path / "run.yaml", "idle_without_workers_s: auto\nchief_timeout_s: off\n")
    run = resolve(["--run-config", file])
    assert (run.idle_without_workers_s, run.chief_timeout_s) == (0.0, 0.0)



def test_every_settable_field_has_a_flag_and_a_variable_in_the_help() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["local"].format_help().split())
    for name in run_options():
        assert f"{flag_name(name)} " in text, name
        assert env_name(name) in text, name


def test_the_help_shows_each_true_default_once_in_words_for_a_sentinel() -> None:
    """No default contradicts itself: each flag's help says `default:` once, a sentinel in words."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    local = sub.choices["local"]
    helps = {a.option_strings[0]: " ".join(str(a.help).split()) for a in local._actions if a.option_strings}
    for flag, text in helps.items():
        assert text.count("default:") <= 1 and "default: )" not in text, (flag, text)
    assert helps["--checkpoint-every-s"].endswith("default: 30)")
    assert helps["--checkpoint-every-updates"].endswith("default: off)")
    assert helps["--max-updates"].endswith("default: off)") and helps["--task-size"].endswith("default: auto)")
    assert helps["--epochs"].endswith("default: 30, or off when --max-updates or --max-training-s is given)")
    assert helps["--run-dir"].endswith("default: runs/<timestamp>)")
    assert helps["--prometheus-port"].endswith("default: off)") and helps["--pipeline"].endswith("default: off)")


def test_the_chief_takes_the_shard_count_from_its_addresses() -> None:
    args = build_parser().parse_args(["chief", "--ps", "a:1,b:2,c:3", "--num-workers", "2"])
    assert "num_ps" not in args.run_fields and args.ps == "a:1,b:2,c:3"
    assert run_config_from(args, environ={"ASYNCPS_PS": "a:1"}, num_ps=3).num_ps == 3


# -- files ---------------------------------------------------------------------------------------
def test_json_yaml_and_toml_files(tmp_path: Path) -> None:
    expected = {"model": "logreg", "optimizer": "adam", "learning_rate": 0.05, "epochs": 2.0,
                "optimizer_params": {"beta_1": 0.5}, "seed": 4, "stragglers": "0:2x"}
    files = {
        "run.json": json.dumps(expected),
        "run.yaml": "model: logreg\noptimizer: adam\nlearning_rate: 5e-2\nepochs: 2\nseed: 4\nstragglers: '0:2x'\n"
                    "optimizer_params: {beta_1: 0.5}\n",
        "run.toml": 'model = "logreg"\noptimizer = "adam"\nlearning_rate = 0.05\nepochs = 2\nseed = 4\n'
                    'stragglers = "0:2x"\n[optimizer_params]\nbeta_1 = 0.5\n',
    }
    for name, text in files.items():
        path = tmp_path / name
        path.write_text(text)
        settings = read_settings_file(path)
        assert settings == expected, name
        assert type(settings["epochs"]) is float and type(settings["seed"]) is int, name
        assert resolve(["--run-config", str(path)]) == RunConfig(**expected), name


def test_a_runs_config_json_is_a_run_config_file(tmp_path: Path) -> None:
    run = RunConfig(mode="sync", num_workers=3, num_ps=1, max_updates=50, epochs=0.0, optimizer="adam",
                    optimizer_params={"beta_1": 0.8})
    path = RunDir(tmp_path).launch_config  # what `asyncps local` hands its chief
    path.parent.mkdir()
    path.write_text(run.to_json())
    assert resolve(["--run-config", str(path)]) == run
    path = RunDir(tmp_path).config  # what the chief writes into the run directory
    path.write_text(json.dumps({"run": dataclasses.asdict(run), "ps": ["127.0.0.1:1"], "run_dir": "runs/x"}))
    assert resolve(["--run-config", str(path)]) == run


@pytest.mark.parametrize(("name", "text", "message"), [
    ("run.json", '{"mode": "sync", "modee": "x", "lr": 1}', r"unknown RunConfig fields \['lr', 'modee'\]"),
    ("run.yaml", "batch_size: many\n", "batch_size: wants an integer, got 'many'"),
    ("run.toml", "seed = true\n", "seed: wants int, got True"),
    ("run.yaml", "- mode\n", "wants a mapping of RunConfig fields, got list"),
    ("run.json", "{not json", "run.json: Expecting property name"),
    ("run.yaml", "a: [\n", "run.yaml: while parsing"),
    ("run.ini", "mode=sync\n", r"\.json, \.yaml, \.yml or \.toml"),
])
def test_bad_files_are_clear_errors(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        resolve(["--run-config", str(path)])


def test_unknown_file_keys_are_one_line_on_the_command_line(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    file = write(tmp_path / "run.yaml", "mode: sync\nworkers: 4\n")
    assert main(["local", "--run-config", file, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "unknown RunConfig fields ['workers']" in err and "num_workers" in err


# -- bad values ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("env", "message"), [
    ({"ASYNCPS_BATCH_SIZE": "lots"}, "environment variable ASYNCPS_BATCH_SIZE='lots': wants an integer"),
    ({"ASYNCPS_LEARNING_RATE": "fast"}, "environment variable ASYNCPS_LEARNING_RATE='fast': wants a number"),
    ({"ASYNCPS_OPTIMIZER_PARAMS": "beta_1"},
     "environment variable ASYNCPS_OPTIMIZER_PARAMS='beta_1': wants KEY=NUMBER"),
    ({"ASYNCPS_CHECKPOINT_EVERY_S": "soon"}, "environment variable ASYNCPS_CHECKPOINT_EVERY_S='soon': wants a number"),
])
def test_bad_environment_values_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve([], env)


def test_a_bad_variable_is_one_line_on_the_command_line(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ASYNCPS_EPOCHS", "ten")
    assert main(["local", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "asyncps local: error: environment variable ASYNCPS_EPOCHS='ten': wants a number, got 'ten'"


def test_a_bad_flag_value_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--batch-size 'x': wants an integer"):
        resolve(["--batch-size", "x"])


def test_local_children_do_not_see_the_launchers_run_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    # the chief gets the resolved RunConfig as a file: an ASYNCPS_MODE would override it there
    monkeypatch.setenv("ASYNCPS_MODE", "sync")
    monkeypatch.setenv("ASYNCPS_LEARNING_RATE", "0.3")
    monkeypatch.setenv("ASYNCPS_LOG_LEVEL", "DEBUG")
    env = child_env()
    assert "ASYNCPS_MODE" not in env and "ASYNCPS_LEARNING_RATE" not in env and env["ASYNCPS_LOG_LEVEL"] == "DEBUG"


# -- a real run ----------------------------------------------------------------------------------
def test_an_explicit_mode_flag_beats_file_and_environment_in_a_real_run(tmp_path: Path) -> None:
    # The file and the launcher's environment both say sync; `--mode async` (the default) must win,
    # in the launcher and in the chief it starts.
    base = RunConfig(mode="sync", model="logreg", num_workers=1, num_ps=1, max_updates=20, epochs=0.0,
                     eval_every_s=30.0)
    file = write(tmp_path / "run.yaml", "".join(f"{k}: {json.dumps(v)}\n" for k, v in dataclasses.asdict(base).items()))
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCPS_")}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", ASYNCPS_MODE="sync")
    result = subprocess.run([sys.executable, "-m", "asyncps.tools.cli", "local", "--run-config", file,
                             "--mode", "async", "--run-dir", str(run_dir), "--quiet"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(RunDir(run_dir).summary.read_text())
    config = json.loads(RunDir(run_dir).config.read_text())
    assert summary["mode"] == "async" and config["run"]["mode"] == "async"
    assert summary["workers"] == 1 and summary["ps_shards"] == 1 and config["run"]["model"] == "logreg"
    assert summary["updates_applied"] >= 20


def test_every_run_flag_is_its_field_spelled_with_dashes_and_every_duration_ends_in_s() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    local = sub.choices["local"]
    by_field = {}
    for action in local._actions:
        if action.dest in run_options() and not action.option_strings[0].startswith("--no-"):
            by_field[action.dest] = action.option_strings
    assert by_field == {name: [flag_name(name)] for name in run_options()}  # one spelling each
    assert flag_name("num_ps") == "--num-ps"  # --ps is the chief's address list and nothing else
    seconds = [n for n in run_options() if "second" in run_options()[n].help]
    assert all(n.endswith("_s") for n in seconds), seconds


def test_local_refuses_a_run_dir_that_holds_a_run_unless_resume(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    RunDir(run_dir).launch_config.parent.mkdir(parents=True)
    RunDir(run_dir).launch_config.write_text(RunConfig().to_json())  # a launcher got this far, then stopped
    assert main(["local", "--run-dir", str(run_dir), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"asyncps local: error: --run-dir {run_dir} holds a run already: give --resume to continue it, "
                   "or name a new --run-dir")
    assert not RunDir(run_dir).config.exists()  # nothing started


def test_local_says_what_ps_means_instead_of_taking_a_count(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["local", "--ps", "2"])
    assert "--num-ps" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "says"), [
    (["--model", "mlpp"], "unknown model spec 'mlpp'"),
    (["--model", "mlp:12,x"], "bad mlp spec"),
    (["--dataset", "synthetic:3"], "bad dataset spec 'synthetic:3'"),
    (["--dataset", "digitz"], "unknown dataset spec 'digitz'"),
    (["--dataset", "npz:/no/such.npz"], "no file '/no/such.npz'"),
    (["--model", "no_such_module_here:build"], "cannot import 'no_such_module_here'"),
    (["--loss", "tests.test_config:no_such_loss"], "has no 'no_such_loss'"),
])
def test_local_names_a_bad_spec_before_starting_any_process(tmp_path: Path, flags: list[str], says: str) -> None:
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "asyncps.tools.cli", "local", "--run-dir", str(run_dir), "--quiet",
                             *flags], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and says in result.stderr, result.stderr
    assert not run_dir.exists()  # nothing was started


def test_every_built_in_spec_passes_the_syntax_check() -> None:
    from asyncps.ml.specs import DATASET_NAMES, MODEL_NAMES, spec_problems

    for model in (*MODEL_NAMES, "mlp:64,32", "examples.byo.model:build"):
        assert spec_problems(model, "digits") == []
    for dataset in (*DATASET_NAMES, "npz:data.npz", "synthetic:784x10", "examples.byo.data:load"):
        assert spec_problems("mlp", dataset) == []
