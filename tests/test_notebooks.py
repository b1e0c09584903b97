"""The notebooks in notebooks/ run from start to end, their assertion cells included (so a change
that breaks a lesson, or makes one of its claims untrue, fails here), and are stored without
outputs. Every figure they draw has a title and labelled axes, tick labels that do not overlap,
and acronyms are spelled out at their first use."""
import json
import os
import pathlib
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")
if os.environ.get("GDN_EXT_REQUIRE_TORCH") != "1":
    pytest.importorskip("torch")

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
IDS = [p.name for p in NOTEBOOKS]

# Run first in the notebook's kernel: keep every figure the notebook makes (under Agg pyplot
# never closes them, but a notebook may; the hook sees them all).
PROLOGUE = """
import matplotlib
matplotlib.use("Agg")
import matplotlib.figure
_nbtest_figures = []
_nbtest_init = matplotlib.figure.Figure.__init__
def _nbtest_record(self, *args, **kwargs):
    _nbtest_init(self, *args, **kwargs)
    _nbtest_figures.append(self)
matplotlib.figure.Figure.__init__ = _nbtest_record
"""
# Run last: describe each figure as it is drawn (titles, axis labels, every text shown, pairs of
# tick labels whose boxes overlap) as one line of JSON.
EPILOGUE = """
import json as _nbtest_json
def _nbtest_describe(fig):
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    axes = []
    for ax in fig.axes:
        if not ax.get_visible() or not ax.axison:
            continue
        overlaps = []
        for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            labels = [t for t in axis.get_ticklabels(which="both")
                      if t.get_visible() and t.get_text().strip()]
            boxes = [t.get_window_extent(renderer) for t in labels]
            overlaps += [(name, labels[i].get_text(), labels[j].get_text())
                         for i in range(len(boxes)) for j in range(i + 1, len(boxes))
                         if boxes[i].overlaps(boxes[j])]
        legend = ax.get_legend()
        texts = [ax.get_title(loc) for loc in ("left", "center", "right")]
        texts += [ax.get_xlabel(), ax.get_ylabel()] + [t.get_text() for t in ax.texts]
        texts += [t.get_text() for t in legend.get_texts()] if legend else []
        axes.append({"title": " ".join(ax.get_title(loc) for loc in ("left", "center", "right")),
                     "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
                     "overlaps": overlaps, "texts": texts})
    suptitle = fig._suptitle.get_text() if fig._suptitle is not None else ""
    return {"suptitle": suptitle, "axes": axes}
print("NBTEST-FIGURES " + _nbtest_json.dumps([_nbtest_describe(f) for f in _nbtest_figures]))
"""

_runs = {}


def executed(path):
    """The notebook run once (per test session) with the hooks above: (its cells, with outputs;
    the figures' descriptions). Raises what the run raised."""
    if path not in _runs:
        nb = nbformat.read(path, as_version=4)
        nb.cells.insert(0, nbformat.v4.new_code_cell(PROLOGUE))
        nb.cells.append(nbformat.v4.new_code_cell(EPILOGUE))
        env = os.environ.get("MPLBACKEND")
        os.environ["MPLBACKEND"] = "Agg"
        try:
            client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                             resources={"metadata": {"path": str(path.parent)}})
            client.execute()
            out = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
            line = [s for s in out.splitlines() if s.startswith("NBTEST-FIGURES ")]
            _runs[path] = (nb.cells[1:-1], json.loads(line[0].split(" ", 1)[1]))
        except Exception as exc:  # noqa: BLE001 -- raised again by every test of this notebook
            _runs[path] = exc
        finally:
            if env is None:
                del os.environ["MPLBACKEND"]
            else:
                os.environ["MPLBACKEND"] = env
    if isinstance(_runs[path], Exception):
        raise _runs[path]
    return _runs[path]


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 5


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None
               for c in nb.cells if c.cell_type == "code"), f"{path.name} has stored outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_runs_and_its_claims_hold(path):
    cells, _ = executed(path)
    text = "".join(o.get("text", "") for o in cells[-1].get("outputs", []))
    assert "checked" in text, f"{path.name}: the assertion cell did not finish"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_every_figure_has_a_title_and_labelled_axes(path):
    _, figures = executed(path)
    assert figures, f"{path.name} draws no figure"
    for n, fig in enumerate(figures, 1):
        for i, ax in enumerate(fig["axes"], 1):
            where = f"{path.name}, figure {n}, axes {i}"
            assert ax["title"].strip(), f"{where} has no title"
            assert ax["xlabel"].strip() and ax["ylabel"].strip(), \
                f"{where}: x label {ax['xlabel']!r}, y label {ax['ylabel']!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_tick_labels_do_not_overlap(path):
    _, figures = executed(path)
    bad = [(n, i, ax["overlaps"]) for n, fig in enumerate(figures, 1)
           for i, ax in enumerate(fig["axes"], 1) if ax["overlaps"]]
    assert not bad, f"{path.name}: overlapping tick labels (figure, axes, pairs): {bad}"


# An acronym: a word of two or more capitals (digits allowed after the first), e.g. MQAR, RNN.
ACRONYM = re.compile(r"\b[A-Z][A-Z0-9]*[A-Z]\b")


def _prose(markdown):
    """The markdown's prose: without code blocks (fenced or indented) and inline code."""
    text = re.sub(r"```.*?```", " ", markdown, flags=re.S)
    text = "\n".join(line for line in text.splitlines() if not line.startswith("    "))
    return re.sub(r"`[^`]*`", " ", text)


def _spelled_out(text, start, acronym):
    """Whether the acronym at text[start:] is written '(ACRONYM)' right after words whose
    initials spell it ('multi-query associative recall (MQAR)')."""
    if text[start - 1:start] != "(" or text[start + len(acronym):start + len(acronym) + 1] != ")":
        return False
    words = re.findall(r"[A-Za-z0-9]+", text[:start - 1])
    initials = "".join(w[0] for w in words[-len(acronym):]).upper()
    return initials == acronym.upper()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_acronyms_are_spelled_out_at_first_use(path):
    nb = nbformat.read(path, as_version=4)
    prose = "\n".join(_prose(c.source) for c in nb.cells if c.cell_type == "markdown")
    first = {}
    for m in ACRONYM.finditer(prose):
        first.setdefault(m.group(), m.start())
    unexplained = sorted(a for a, i in first.items() if not _spelled_out(prose, i, a))
    assert not unexplained, f"{path.name}: acronyms not spelled out at first use: {unexplained}"
    # the figures use only acronyms the prose has spelled out
    _, figures = executed(path)
    shown = {a for fig in figures for ax in fig["axes"]
             for t in ax["texts"] + [fig["suptitle"]] for a in ACRONYM.findall(t)}
    assert shown <= set(first), f"{path.name}: figures use {sorted(shown - set(first))}"
