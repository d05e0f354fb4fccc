"""asyncps.rules.registry: one spec form for optimizers, staleness policies and consistency modes.

Round trips of every registered entry, error messages, the old spellings folded into the mode spec
(RunConfig and the command line), a policy registered at run time and used by a real ShardStore,
the sync mode's accumulation against the arithmetic the store used to do itself, and the rules
table in docs/experiments.md generated from the registries.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from asyncps.ps.store import ShardStore
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from asyncps.config import RunConfig
from asyncps.errors import InvalidArgumentError
from asyncps.pb import ps_pb2
from asyncps.rules import (
    MODES,
    OPTIMIZERS,
    POLICIES,
    RULES_TABLE_BEGIN,
    RULES_TABLE_END,
    OptimizerConfig,
    UpdateRuleConfig,
    registries,
    rules_markdown,
)
from asyncps.rules.drops import DropReason
from asyncps.rules.modes import fold_mode_aliases
from asyncps.rules.optimizers import make_optimizer
from asyncps.rules.policies import Decision, StalenessPolicy
from asyncps.rules.registry import Param, Registry, param
from asyncps.rules.sync.bsp import SyncConsistency
from asyncps.tools.cli import add_run_flags, run_config_from
from asyncps.wire.codec import Array, Gradient, SparseRows
from asyncps.wire.proto import rule_from_proto, rule_to_proto

ROOT = Path(__file__).resolve().parent.parent


def values_for(p: Param) -> st.SearchStrategy[Any]:
    """Values of one parameter, valid or not (the entry's own checks decide)."""
    numbers: st.SearchStrategy[Any]
    if p.kind is int:
        numbers = st.integers(-2, 10**6)
    else:
        numbers = st.one_of(st.floats(0.0, 1.0), st.floats(1e-12, 1e6),
                            st.floats(allow_nan=False, allow_infinity=False))
    return st.one_of(st.none(), numbers) if p.optional else numbers


@st.composite
def entries(draw: st.DrawFn, registry: Registry[Any]) -> Any:
    """A valid instance of some entry of the registry, its parameters drawn."""
    entry = draw(st.sampled_from(registry.entries()))
    kwargs = {p.field: draw(values_for(p)) for p in entry.params if p.required or draw(st.booleans())}
    try:
        return entry.cls(**kwargs)
    except ValueError:
        assume(False)


ALL: dict[str, Registry[Any]] = {"optimizer": OPTIMIZERS, "staleness policy": POLICIES, "consistency mode": MODES}


@pytest.mark.parametrize("kind", ALL)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_canonical_spec_round_trips_every_entry(kind: str, data: st.DataObject) -> None:
    registry = ALL[kind]
    item = data.draw(entries(registry))
    canonical = registry.canonical(item)
    assert registry.parse(canonical) == item
    assert registry.normalize(canonical) == canonical
    # every parameter written out, defaults included, parses to the same thing
    entry = registry.entry(registry.name_of(item))
    spelled = [f"{p.key}={getattr(item, p.field)!r}" for p in entry.params if getattr(item, p.field) is not None]
    full = f"{entry.name}:{','.join(spelled)}" if spelled else entry.name
    assert registry.parse(full) == item


@pytest.mark.parametrize("kind", ALL)
def test_every_entry_parses_by_its_name_or_says_what_it_needs(kind: str) -> None:
    registry = ALL[kind]
    assert registry.names() and registry.kind == kind
    for entry in registry.entries():
        required = [p for p in entry.params if p.required]
        if not required:
            assert registry.canonical(registry.parse(entry.name)) == entry.name
        else:
            with pytest.raises(ValueError, match=f"{kind} {entry.name!r}: {entry.name} needs {required[0].key}="):
                registry.parse(entry.name)


@settings(max_examples=100, deadline=None)
@given(name=st.sampled_from(OPTIMIZERS.names()), lr=st.floats(1e-9, 10.0), data=st.data())
def test_optimizer_config_spec_round_trips(name: str, lr: float, data: st.DataObject) -> None:
    params = {p.key: data.draw(st.integers(1, 64) if p.kind is int else st.floats(1e-6, 0.99))
              for p in OPTIMIZERS.entry(name).params if data.draw(st.booleans())}
    config = OptimizerConfig(name, lr, params)
    assert OptimizerConfig.parse(config.spec) == config
    assert config.spec.startswith(f"{name}:lr=")


def test_known_specs_and_their_canonical_forms() -> None:
    assert MODES.normalize("sync:backup=1") == "sync:backup=1"
    assert MODES.normalize("sync:backup=0") == "sync"
    assert MODES.normalize("ssp:2") == "ssp:bound=2"  # positional, the older form
    assert POLICIES.normalize("dc-asgd:lambda=0.04") == "dc-asgd"
    assert POLICIES.normalize("drop:4") == "drop:bound=4"
    assert OPTIMIZERS.normalize("adam:beta_1=0.8") == "adam:beta_1=0.8"
    assert OptimizerConfig.parse("adam:lr=0.001,beta_1=0.8") == OptimizerConfig("adam", 0.001, {"beta_1": 0.8})
    assert OptimizerConfig("momentum", 0.5, {"momentum": 0.9}).spec == "momentum:lr=0.5,momentum=0.9"
    rule = UpdateRuleConfig(OptimizerConfig("sgd", 0.1), mode="ssp:2", staleness_policy="dc-asgd-a:2,0.9")
    assert (rule.mode, rule.staleness_policy) == ("ssp:bound=2", "dc-asgd-a:momentum=0.9")
    assert rule == UpdateRuleConfig(OptimizerConfig("sgd", 0.1), mode="ssp:bound=2",
                                    staleness_policy="dc-asgd-a:lambda0=2,momentum=0.9")


@pytest.mark.parametrize(
    "registry, spec, message",
    [
        (MODES, "bsp", r"unknown consistency mode 'bsp'; valid: async \| sync\[:backup=INT\] \| ssp\[:bound=INT\]"),
        (MODES, "sync:bound=1", r"consistency mode 'sync:bound=1': unknown key 'bound'; sync takes: backup; "
                                r"valid: sync\[:backup=INT\]"),
        (MODES, "ssp:bound=x", r"consistency mode 'ssp:bound=x': bound must be an integer, got 'x'"),
        (MODES, "ssp:bound=-1", r"consistency mode 'ssp:bound=-1': bound must be an integer >= 0"),
        (MODES, "async:1", r"consistency mode 'async:1': async takes no parameters"),
        (POLICIES, "dc-asgd:lambda=-1", r"staleness policy 'dc-asgd:lambda=-1': lambda must be a finite number"),
        (POLICIES, "gap-aware:c=", r"staleness policy 'gap-aware:c=': c needs a value"),
        (OPTIMIZERS, "adam:beta1=0.9", r"optimizer 'adam:beta1=0.9': unknown key 'beta1'; adam takes: "
                                       r"beta_1, beta_2, epsilon"),
        (OPTIMIZERS, "rmsprop", r"unknown optimizer 'rmsprop'; valid: sgd \| momentum"),
    ],
)
def test_errors_name_the_kind_the_spec_and_what_is_allowed(registry: Registry[Any], spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        registry.parse(spec)


@pytest.mark.parametrize(
    "spec, message",
    [("adam", "the learning rate lr=FLOAT is required"), ("adam:lr=x", "lr must be a number"),
     ("adam:lr=0.1,beta_1=2", r"beta_1 must be in \[0.0, 1.0\)"), ("sgd:lr=0", "learning_rate must be > 0"),
     ("sgd:lr=0.1,momentum=0.9", r"unknown key 'momentum'; sgd takes: lr")],
)
def test_optimizer_config_parse_errors(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        OptimizerConfig.parse(spec)
    assert f"optimizer {spec!r}" in str(error.value)


def test_a_bad_spec_on_the_wire_is_invalid_argument() -> None:
    good = rule_to_proto(UpdateRuleConfig(OptimizerConfig("adam", 0.01, {"beta_2": 0.99}), mode="sync:backup=1",
                                          staleness_policy="drop:bound=2", num_workers=3))
    assert (good.optimizer, good.mode, good.staleness_policy) == ("adam:lr=0.01,beta_2=0.99", "sync:backup=1",
                                                                 "drop:bound=2")
    assert rule_to_proto(rule_from_proto(good)) == good
    for field, spec in [("mode", "sync:backup=x"), ("staleness_policy", "drop"), ("optimizer", "adam:beta_1=0.9")]:
        bad = ps_pb2.UpdateRule()
        bad.CopyFrom(good)
        setattr(bad, field, spec)
        with pytest.raises(InvalidArgumentError, match=f"bad update rule: .*{spec}"):
            rule_from_proto(bad)


def test_registry_rejects_what_it_cannot_spell() -> None:
    registry: Registry[StalenessPolicy] = Registry("staleness policy", StalenessPolicy)

    @dataclasses.dataclass
    class Mutable(StalenessPolicy):
        def decide(self, staleness: int) -> Decision:
            return Decision(True)

    with pytest.raises(TypeError, match="frozen dataclasses"):
        registry.register("mutable")(Mutable)
    with pytest.raises(ValueError, match="lowercase"):
        registry.register("Bad Name")(Mutable)
    with pytest.raises(ValueError, match="already registered"):
        POLICIES.register("none")(Mutable)
    with pytest.raises(TypeError, match="is not a StalenessPolicy"):
        registry.register("mode")(type(MODES.parse("async")))


# -- the older spellings -----------------------------------------------------------------------


def test_run_config_folds_the_old_mode_fields_into_the_spec() -> None:
    folded = RunConfig(mode="sync", backup_workers=1, num_workers=3)
    assert folded == RunConfig(mode="sync:backup=1", num_workers=3)
    assert (folded.mode, folded.backup_workers, folded.staleness_bound) == ("sync:backup=1", 1, 0)
    assert RunConfig(mode="ssp", staleness_bound=2).mode == "ssp:bound=2"
    assert RunConfig(mode="ssp:bound=2", staleness_bound=2).staleness_bound == 2  # agreeing is fine
    assert RunConfig(staleness_policy="drop:4").staleness_policy == "drop:bound=4"
    assert RunConfig.from_json(folded.to_json()) == folded
    assert folded.update_rule().mode == "sync:backup=1"


@pytest.mark.parametrize(
    "fields, message",
    [({"mode": "sync:backup=1", "backup_workers": 2}, "backup_workers=2 contradicts the mode spec 'sync:backup=1'"),
     ({"mode": "async", "backup_workers": 1}, "backup_workers=1 applies to mode sync, not to 'async'"),
     ({"mode": "sync", "staleness_bound": 3}, "staleness_bound=3 applies to mode ssp"),
     ({"mode": "sync", "backup_workers": 2}, r"backup workers \(2\) must be < num_workers"),
     ({"mode": "sync", "backup_workers": -1}, "backup must be an integer >= 0"),
     ({"mode": "ssp:bound=q"}, "bound must be an integer")],
)
def test_run_config_rejects_contradicting_mode_settings(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RunConfig(**fields)


def test_fold_mode_aliases_treats_an_explicit_default_as_given() -> None:
    assert fold_mode_aliases("ssp", {"staleness_bound": 0, "backup_workers": 0}) == "ssp"
    assert fold_mode_aliases("sync", {"backup_workers": 2}) == "sync:backup=2"
    with pytest.raises(ValueError, match="contradicts the mode spec 'sync:0'"):
        fold_mode_aliases("sync:0", {"backup_workers": 2})
    with pytest.raises(ValueError, match="unknown mode setting"):
        fold_mode_aliases("sync", {"backups": 1})


def cli_config(*argv: str) -> RunConfig:
    parser = argparse.ArgumentParser()
    add_run_flags(parser)
    return run_config_from(parser.parse_args(list(argv)), environ={}, num_workers=3, num_ps=1)


def test_cli_old_flags_equal_the_mode_spec(tmp_path: Path) -> None:
    assert cli_config("--mode", "sync", "--backup-workers", "1") == cli_config("--mode", "sync:backup=1")
    assert cli_config("--mode", "ssp", "--staleness-bound", "2").mode == "ssp:bound=2"
    with pytest.raises(ValueError, match="contradicts"):
        cli_config("--mode", "sync:backup=1", "--backup-workers", "2")
    # a --run-config file: explicit mode flags win over its mode, the rest of the file stays
    saved = tmp_path / "run.json"
    saved.write_text(RunConfig(mode="ssp:bound=2", num_workers=3, seed=7).to_json())
    assert cli_config("--run-config", str(saved)).mode == "ssp:bound=2"
    assert cli_config("--run-config", str(saved), "--staleness-bound", "5").mode == "ssp:bound=5"
    switched = cli_config("--run-config", str(saved), "--mode", "sync:backup=1")
    assert (switched.mode, switched.staleness_bound, switched.seed) == ("sync:backup=1", 0, 7)


# -- a policy registered at run time -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ScaleBy(StalenessPolicy):
    """Apply every gradient at a fixed fraction of the learning rate (a test policy)."""

    factor: float = param(0.5, help="the fraction")

    def __post_init__(self) -> None:
        if not 0 < self.factor <= 1:
            raise ValueError(f"factor must be in (0, 1], got {self.factor!r}")

    def decide(self, staleness: int) -> Decision:
        return Decision(True, lr_scale=self.factor)


@pytest.fixture
def scale_by() -> Iterator[None]:
    POLICIES.register("test-scale-by")(ScaleBy)
    try:
        yield
    finally:
        POLICIES.unregister("test-scale-by")


def test_a_policy_registered_at_run_time_drives_a_real_store(scale_by: None) -> None:
    assert "test-scale-by" in POLICIES.names() and "test-scale-by[:factor=FLOAT]" in POLICIES.usage()
    rule = UpdateRuleConfig(OptimizerConfig("sgd", 2.0), staleness_policy="test-scale-by:factor=0.25")
    assert rule.staleness_policy == "test-scale-by:factor=0.25"
    assert rule_from_proto(rule_to_proto(rule)) == rule  # and it crosses the wire
    store = ShardStore()
    store.initialize(rule, {"w": np.ones(3, np.float32)})
    outcome = store.push("w0", 0, {"w": np.full(3, 2.0, np.float32)})
    assert outcome.accepted and outcome.effective_lr == 0.5
    np.testing.assert_array_equal(store.values()["w"], np.full(3, 1.0 - 0.5 * 2.0, np.float32))
    with pytest.raises(ValueError, match="factor must be in"):
        UpdateRuleConfig(OptimizerConfig("sgd", 2.0), staleness_policy="test-scale-by:factor=2")


def test_an_unregistered_policy_is_unknown_again(scale_by: None) -> None:
    POLICIES.unregister("test-scale-by")
    try:
        with pytest.raises(ValueError, match="unknown staleness policy 'test-scale-by'"):
            POLICIES.parse("test-scale-by")
    finally:
        POLICIES.register("test-scale-by")(ScaleBy)


# -- the sync mode's accumulation ----------------------------------------------------------------


def reference_sync_step(pushes: list[dict[str, Gradient]]) -> dict[str, Gradient]:
    """What ShardStore computed for a synchronous step before the mode owned it: dense gradients
    summed in arrival order then divided by float32(count); sparse rows concatenated, values divided."""
    count = np.float32(len(pushes))
    dense: dict[str, Array] = {}
    sparse: dict[str, list[SparseRows]] = {}
    for grads in pushes:
        for name, grad in grads.items():
            if isinstance(grad, SparseRows):
                sparse.setdefault(name, []).append(grad)
            elif name in dense:
                dense[name] = dense[name] + grad
            else:
                dense[name] = np.array(grad, copy=True)
    out: dict[str, Gradient] = {name: total / count for name, total in dense.items()}
    for name, parts in sparse.items():
        out[name] = SparseRows(np.concatenate([p.indices for p in parts]),
                               (np.concatenate([p.values for p in parts]) / count).astype(parts[0].values.dtype))
    return out


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_sync_steps_through_the_store_match_the_old_arithmetic(optimizer: str) -> None:
    workers, backup, steps = 4, 1, 5
    config = OptimizerConfig(optimizer, 0.05)
    initial = {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3), "e": np.ones((6, 2), np.float32)}
    store = ShardStore()
    store.initialize(UpdateRuleConfig(config, mode=f"sync:backup={backup}", num_workers=workers), initial)
    opt = make_optimizer(config)
    values = {n: v.copy() for n, v in initial.items()}
    slots = {n: opt.init_slots(v) for n, v in values.items()}
    rng = np.random.default_rng(0)
    for step in range(steps):
        pushes = []
        for worker in range(workers):
            grads: dict[str, Gradient] = {
                "w": rng.normal(size=(4, 3)).astype(np.float32),
                "e": SparseRows(rng.integers(0, 6, size=3), rng.normal(size=(3, 2)).astype(np.float32)),
            }
            outcome = store.push(f"w{worker}", step, grads)
            if worker < workers - backup:
                assert outcome.accepted
                pushes.append(grads)
            else:  # the backup's gradient arrives after its step was applied
                assert not outcome.accepted and outcome.drop is DropReason.LATE
        for name, grad in sorted(reference_sync_step(pushes).items()):
            if isinstance(grad, SparseRows):
                opt.apply_sparse(values[name], grad.indices, grad.values, slots[name], 0.05, step + 1)
            else:
                opt.apply_dense(values[name], grad, slots[name], 0.05, step + 1)
        for name, value in store.values().items():
            np.testing.assert_array_equal(value, values[name], err_msg=f"{name} after step {step}")
    assert store.version == steps
    assert store.stats().dropped_by_reason == {"late": steps}


def test_the_sync_mode_owns_its_pending_step() -> None:
    mode = MODES.parse("sync").start(2)
    assert isinstance(mode, SyncConsistency)
    assert mode.take_step() is None
    mode.accumulate("a", {"w": np.array([1.0, 2.0], np.float32)})
    assert mode.take_step() is None  # quorum 2
    mode.accumulate("b", {"w": np.array([3.0, 4.0], np.float32)})
    step = mode.take_step()
    assert step is not None
    np.testing.assert_array_equal(step["w"], np.array([2.0, 3.0], np.float32))
    assert mode.take_step() is None  # forgotten once taken
    with pytest.raises(TypeError, match="does not accumulate"):
        MODES.parse("async").start(2).accumulate("a", {})


# -- the rules table in docs/experiments.md -------------------------------------------------------


def test_docs_list_every_rule_as_the_registries_do() -> None:
    text = (ROOT / "docs" / "experiments.md").read_text()
    block = text.split(RULES_TABLE_BEGIN, 1)[1].split(RULES_TABLE_END, 1)[0].strip("\n")
    assert block == rules_markdown(), "docs/experiments.md is stale: run scripts/rules_table.py"
    for registry in registries():
        for entry in registry.entries():  # every built-in; plugins other tests loaded are not asyncps's
            assert (f"| `{entry.name}` |" in block) != entry.plugin


def test_rules_table_script_checks_the_docs() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "rules_table.py"), "--check"],
                            capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr


def test_describe_rows_are_json_friendly() -> None:
    rows = [{"name": e.name, "params": [p.key for p in e.params], "summary": e.summary}
            for registry in registries() for e in registry.entries()]
    assert json.loads(json.dumps(rows)) == rows and all(r["summary"] for r in rows)
