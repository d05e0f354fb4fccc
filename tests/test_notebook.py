"""examples/train_in_notebook.ipynb in a real Jupyter kernel: a model defined in a cell trains on a
local cluster of processes and comes back trained (nbclient runs every cell; an error fails the test)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "train_in_notebook.ipynb"


@pytest.mark.slow
def test_notebook_trains_a_model_defined_in_a_cell(tmp_path: Path) -> None:
    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("ipykernel")

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # run in tmp_path: the run directory (runs/<time>) goes there
    nbclient.NotebookClient(notebook, kernel_name="python3", timeout=300,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    printed = "".join(output.get("text", "") for output in notebook.cells[-1].outputs)
    measured, chief = (float(value) for value in re.findall(r"\d\.\d+", printed))
    assert measured > 0.8 and abs(measured - chief) <= 0.005, printed
    assert any((tmp_path / "runs").iterdir())
