"""The notebooks in notebooks/ run from start to end, their assertion cells included (so a change
that breaks a lesson fails here), and are stored without outputs."""
import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")
if os.environ.get("GDN_EXT_REQUIRE_TORCH") != "1":
    pytest.importorskip("torch")

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 5


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_and_its_claims_hold(path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None
               for c in nb.cells if c.cell_type == "code"), f"{path.name} has stored outputs"
    monkeypatch.setenv("MPLBACKEND", "Agg")
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    last = nb.cells[-1]
    text = "".join(o.get("text", "") for o in last.get("outputs", []))
    assert "checked" in text, f"{path.name}: the assertion cell did not finish"
