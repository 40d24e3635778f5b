"""notebooks/quickstart.ipynb runs from top to bottom (as a reader would run it)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_quickstart_notebook_executes(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)

    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()

    outputs = "".join(
        output.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for output in cell.get("outputs", [])
    )
    assert "TreasureRooms follows the contract" in outputs
    assert "step 3: success" in outputs
    assert "Trajectory viewer:" in outputs
    assert "is deprecated" not in outputs.replace("`is_gradient_checkpointing` is deprecated", "")  # (TRL 1.16's own)
    # The report's figures, each shown once: the run has no evaluation panel and no dynamic sampling, so no panel.png
    # or dynamic_sampling.png.
    figures = ["advantages.png", "health.png", "loops.png", "outcomes.png", "step_groups.png"]
    assert all(f"{name}\n" in outputs for name in figures)
    images = [o for cell in notebook.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == len(figures)
