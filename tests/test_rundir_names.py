"""One owner for every run-directory path: no .py file outside asyncps/rundir names a run file itself.

Writers and readers join run-directory paths through `asyncps.rundir.RunDir` (and `CheckpointNames`
inside a checkpoints directory), so a file is named once and a format has one owner. This test reads
every Python file of the repository and fails on a string literal that is a run file's name (or a
path ending in one), and on a `path / "<run-directory folder>"` join or `path / f"....log"` that
spells a run file's name by hand. Tests that check a format on disk are the exceptions listed below.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

from asyncps.rundir import names
from tests.conftest import REPO_ROOT

# The package that owns the names, and generated code.
OWNERS = ("asyncps/rundir/", "asyncps/pb/")

# Tests that check a format on disk by its literal name (what an older or foreign writer left there).
FORMAT_TESTS = {
    "tests/test_rundir.py",  # writes broken config.json/summary.json files to check the errors name them
    "tests/test_rundir_names.py",  # this file: it shows what it catches
}

#: Every run file's name, from the names module (a new constant there is checked at once).
FILE_NAMES = frozenset(value for key, value in vars(names).items()
                       if key.isupper() and isinstance(value, str) and "." in value)
#: The run directory's folders: `x / "tb"` names one by hand (`secrets` is left out: deploy/ has one too).
FOLDERS = frozenset({names.TENSORBOARD_DIR, names.CHECKPOINTS_DIR, names.LOGS_DIR})
#: What a role's log or port file in logs/ ends with, built by hand as `logs / f"{role}.log"`.
ROLE_FILE_SUFFIXES = (".log", ".port")


def _python_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
                            cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.split()
    return sorted(p for p in listed if (REPO_ROOT / p).exists())


def _names_a_file(text: str) -> bool:
    return any(text == name or text.endswith("/" + name) for name in FILE_NAMES)


def _joined_text(node: ast.expr) -> str:
    """The literal parts of a str or f-string, placeholders as {}."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else "{}"
                       for v in node.values)
    return ""


def violations(source: str, where: str) -> list[str]:
    """Each run-directory name spelled in `source` by hand, as `where:line: what`."""
    found = []
    tree = ast.parse(source)
    # an f-string is judged whole, not again by its literal parts
    parts = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    for node in ast.walk(tree):
        if id(node) in parts:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _names_a_file(node.value):
            found.append(f"{where}:{node.lineno}: {node.value!r}")
        elif isinstance(node, ast.JoinedStr) and _names_a_file(_joined_text(node)):
            found.append(f"{where}:{node.lineno}: f{_joined_text(node)!r}")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            part = _joined_text(node.right)
            # self.logs / f"{role}.log"; a local variable `logs` may be any folder (the docker build's)
            in_logs = (part.endswith(ROLE_FILE_SUFFIXES) and isinstance(node.left, ast.Attribute)
                       and node.left.attr == names.LOGS_DIR)
            if part in FOLDERS or in_logs or part.startswith("ckpt-"):
                found.append(f"{where}:{node.lineno}: / {part!r}")
    return found


def test_no_run_directory_name_outside_asyncps_rundir() -> None:
    found = []
    for path in _python_files():
        if path.startswith(OWNERS) or path in FORMAT_TESTS:
            continue
        found += violations((REPO_ROOT / path).read_text(), path)
    assert found == [], "name these through asyncps.rundir.RunDir / CheckpointNames:\n" + "\n".join(found)


def test_the_check_catches_each_way_of_spelling_a_run_file() -> None:
    source = '\n'.join([
        'a = run_dir / "ledger.jsonl"',
        'b = open(Path(x, "memory.json"))',
        'c = f"{run}/manifest.json"',
        'd = run_dir / "tb"',
        'e = self.logs / f"{role}.log"',
        'f = root / f"ckpt-{n:08d}"',
        'g = "runs/x/summary.json"',
        '"""A docstring may say summary.json."""',
        'h = RunDir(run_dir).ledger',
    ])
    lines = sorted(int(v.split(":")[1]) for v in violations(source, "x.py"))
    assert lines == [1, 2, 3, 4, 5, 6, 7]


def test_every_named_file_is_reached_through_run_dir() -> None:
    run = names.RunDir(Path("/r"))
    reached = {run.config, run.summary, run.manifest, run.pushes, run.timeline, run.restores, run.evals, run.ledger,
               run.reports, run.memory, run.chief_lock, run.launcher_log, run.launch_config, run.exported_model,
               run.input_model, run.input_data,
               names.CheckpointNames.arrays(run.checkpoints / "ckpt-00000001")}
    assert {p.name for p in reached} == FILE_NAMES
    assert {run.tensorboard.name, run.checkpoints.name, run.logs.name} == FOLDERS
