"""examples/lessons/*.ipynb in a real Jupyter kernel (nbclient runs every cell; an error fails the test),
then the numbers each lesson's last cell prints are checked against what the lesson teaches."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

LESSONS = Path(__file__).resolve().parent.parent / "examples" / "lessons"


def run_lesson(name: str, where: Path) -> str:
    """Execute the lesson `name` in a kernel whose working directory is `where`; its last cell's printed text."""
    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    notebook: Any = nbformat.read(LESSONS / name, as_version=4)
    nbclient.NotebookClient(notebook, kernel_name="python3", timeout=400,
                            resources={"metadata": {"path": str(where)}}).execute()
    return "".join(output.get("text", "") for output in notebook.cells[-1].outputs)


@pytest.mark.slow
def test_lesson_01_async_reaches_the_target_sooner_than_sync_with_a_straggler(tmp_path: Path) -> None:
    printed = run_lesson("01_async_vs_sync.ipynb", tmp_path)
    seconds = dict(re.findall(r"(async|sync) reached accuracy [\d.]+ after ([\d.]+) s", printed))
    assert set(seconds) == {"async", "sync"}, printed  # both reached it ("None" does not match)
    assert float(seconds["async"]) < float(seconds["sync"]), printed


@pytest.mark.slow
def test_lesson_02_mean_staleness_grows_with_the_number_of_workers(tmp_path: Path) -> None:
    printed = run_lesson("02_staleness.ipynb", tmp_path)
    means = {int(workers): float(mean) for workers, mean in re.findall(r"workers (\d+): mean staleness ([\d.]+)",
                                                                       printed)}
    assert sorted(means) == [1, 2, 4, 8], printed
    assert means[1] == 0.0, printed  # one worker: nobody else updates between its pull and its push
    assert means[1] < means[2] < means[4] < means[8], printed
    for workers, mean in means.items():  # about λ - 1 (workers of equal speed)
        assert abs(mean - (workers - 1)) <= 0.5 * (workers - 1) + 0.5, printed


@pytest.mark.slow
def test_lesson_03_a_backup_worker_removes_the_straggler(tmp_path: Path) -> None:
    printed = run_lesson("03_stragglers_backup_workers.ipynb", tmp_path)
    found = {name: (float(rate), float(idle), int(dropped)) for name, rate, idle, dropped in re.findall(
        r"^(sync|sync \+ 1 backup): updates/s ([\d.]+), fast workers idle ([\d.]+) %, dropped (\d+)$", printed, re.M)}
    assert set(found) == {"sync", "sync + 1 backup"}, printed
    (sync_rate, sync_idle, sync_dropped), (backup_rate, backup_idle, backup_dropped) = (
        found["sync"], found["sync + 1 backup"])
    assert backup_rate >= 2 * sync_rate, printed  # the straggler no longer sets the pace
    assert backup_idle * 3 <= sync_idle, printed  # the fast workers no longer wait for it
    assert sync_dropped == 0 < backup_dropped, printed  # the price: the late gradients are dropped
