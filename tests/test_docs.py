"""The documentation's code runs as written: every Python block of README.md and of the docs'
Markdown / reST pages, executed page by page (the blocks of a page in order, in one namespace,
in a scratch folder); a block preceded by ``<!-- not-runnable: reason -->`` is skipped. Warnings
that a block's own lines raise (gdn_ext's value warnings, NumPy's floating-point ones) are
errors: a page should not teach a call that warns unless it catches the warning itself.

Also: the gufunc table lists every gufunc, with arguments that match it; the API pages list every
public name; .ci/run runs the README's test command and builds the docs with the README's command.
The docs/ folder is not in the sdist: its tests skip there."""
import ast
import importlib.util
import os
import pathlib
import re
import warnings

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SKIP_MARK = re.compile(r"<!--\s*not-runnable:\s*(\S.*?)\s*-->")


def _pages():
    pages = [ROOT / "README.md"]
    if DOCS.is_dir():
        for path in sorted(DOCS.rglob("*")):
            rel = path.relative_to(DOCS).parts
            if path.suffix in (".md", ".rst") and rel[0] not in ("_build", "notebooks", "api"):
                pages.append(path)
    return pages


def python_blocks(path):
    """[(line, source, skip reason or None)] of a Markdown or reST page's Python blocks."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    blocks = []
    if path.suffix == ".md":
        i = 0
        while i < len(lines):
            m = re.match(r"^(\s*)(`{3,}|~{3,})\s*(\{code-block\}\s*)?(python|py|python3)\s*$",
                         lines[i])
            if not m:
                i += 1
                continue
            indent, fence = m.group(1), m.group(2)
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(fence):
                j += 1
            body = [ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1:j]]
            body = [ln for ln in body if not re.match(r"^:\w+:", ln)]   # directive options
            before = "\n".join(lines[max(0, i - 3):i])
            skip = SKIP_MARK.search(before)
            blocks.append((i + 1, "\n".join(body), skip.group(1) if skip else None))
            i = j + 1
    else:
        for i, line in enumerate(lines):
            if re.match(r"^\s*\.\. (code-block|code|sourcecode)::\s*(python|py)\s*$", line):
                indent = len(line) - len(line.lstrip())
                body, j = [], i + 1
                while j < len(lines) and (not lines[j].strip()
                                          or len(lines[j]) - len(lines[j].lstrip()) > indent):
                    body.append(lines[j])
                    j += 1
                body = [ln for ln in body if not re.match(r"^\s*:\w+:", ln)]
                src = "\n".join(ln[indent + 3:] if ln.strip() else "" for ln in body)
                skip = SKIP_MARK.search("\n".join(lines[max(0, i - 3):i]))
                blocks.append((i + 1, src, skip.group(1) if skip else None))
    return blocks


PAGES = [p for p in _pages() if python_blocks(p)]


def _imports(src):
    """The top-level modules a block imports."""
    mods = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            mods.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            mods.add(node.module.split(".")[0])
    return mods


def test_pages_with_code_are_found():
    assert ROOT / "README.md" in PAGES
    if DOCS.is_dir():
        assert DOCS / "guide" / "numpy.md" in PAGES


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_code_runs(page, tmp_path, monkeypatch):
    blocks = python_blocks(page)
    for mod in sorted(set().union(*(_imports(src) for _, src, skip in blocks if not skip))):
        if mod == "torch" and os.environ.get("GDN_EXT_REQUIRE_TORCH") == "1":
            continue
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{page.name} needs {mod}")
    monkeypatch.chdir(tmp_path)              # blocks may write files (the dask example: zarr)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace = {"__name__": "docs_block"}
    ran = 0
    for line, src, skip in blocks:
        if skip:
            continue
        code = compile(src, f"{page.relative_to(ROOT)}:{line}", "exec")
        with warnings.catch_warnings():
            # warnings whose reported location is a line of the block
            warnings.filterwarnings("error", module="docs_block")
            try:
                exec(code, namespace)
            except Exception as exc:
                raise AssertionError(f"{page.relative_to(ROOT)}, the block at line {line} "
                                     f"failed: {type(exc).__name__}: {exc}") from exc
        ran += 1
    assert ran, f"{page.name}: every block is marked not runnable"


def test_skip_marks_give_a_reason():
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        for m in re.finditer(r"<!--\s*not-runnable(.*?)-->", text, re.S):
            assert re.match(r":\s*\S", m.group(1)), f"{page.name}: a not-runnable mark without " \
                                                    "a reason"


def _gdn_docs():
    if not (DOCS / "_ext" / "gdn_docs.py").exists():
        pytest.skip("docs/ is not in this tree (an sdist)")
    spec = importlib.util.spec_from_file_location("gdn_docs", DOCS / "_ext" / "gdn_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _core_gufuncs():
    import gdn_ext.ufuncs
    core = gdn_ext.ufuncs._core
    return {n: getattr(core, n) for n in dir(core) if isinstance(getattr(core, n), np.ufunc)}


def test_the_gufunc_table_lists_every_gufunc():
    import gdn_ext.ufuncs
    rows = {name: (call, sig) for name, call, sig, _ in _gdn_docs().ufunc_rows()}
    every = _core_gufuncs()
    assert len(every) >= 12
    assert set(every) <= set(rows), f"missing from the table: {sorted(set(every) - set(rows))}"
    assert set(gdn_ext.ufuncs.__all__) <= set(rows)
    assert set(every) == set(gdn_ext.ufuncs.__all__), "gdn_ext.ufuncs does not export them all"
    for name, uf in every.items():
        call, sig = rows[name]
        assert sig == uf.signature
        # the call names each input and each output: as many as the gufunc has
        m = re.fullmatch(rf"{name}\((.*)\)\s*->\s*\((.*)\)", call)
        assert m, f"{name}: the table's call {call!r} is not 'name(inputs) -> (outputs)'"
        ins, outs = ([a.strip() for a in g.split(",")] for g in m.groups())
        assert len(ins) == uf.nin and len(outs) == uf.nout, (name, ins, outs)


def test_the_numpy_guide_shows_the_table():
    if not DOCS.is_dir():
        pytest.skip("docs/ is not in this tree (an sdist)")
    text = (DOCS / "guide" / "numpy.md").read_text(encoding="utf-8")
    assert re.search(r"^```\{gdn-ufunc-table\}", text, re.M)


def test_the_api_pages_list_every_public_name():
    pages = _gdn_docs().api_pages()
    import gdn_ext
    for modname, text in pages.items():
        mod = importlib.import_module(modname)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if name.startswith("__") or isinstance(obj, np.ufunc):
                continue
            if type(obj).__name__ == "module":
                assert f":doc:`{modname}.{name}`" in text, (modname, name)
            elif modname == "gdn_ext.layer" and name in gdn_ext.__all__:
                assert re.search(rf"^   {name}$", pages["gdn_ext"], re.M), (modname, name)
            else:
                assert re.search(rf"^   {name}$", text, re.M), (modname, name)


def _readme_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [ln.strip() for ln in block.splitlines() if ln.strip() and not ln.startswith("#")]


def test_ci_runs_the_readme_test_command_and_the_docs_build():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    commands = _readme_commands()
    assert len(commands) == 2
    assert commands[1] in ci, "the README's test command is not in .ci/run"
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    build = re.search(r"python -m sphinx [^\n`]*", text).group(0)
    assert "-W" in build.split() and build in ci, "the README's docs build is not in .ci/run"


def test_a_warning_at_a_tests_line_fails_the_run(request):
    """The suite runs quiet: a warning raised at a line of the tests is an error (pyproject's
    filterwarnings), so a test either asserts the warnings its inputs give or gives inputs that
    raise none; a warning from a library's own code stays a warning."""
    import gdn_ext
    rules = request.config.getini("filterwarnings")
    assert {"error:::test_", "error:::helpers"} <= set(rules), rules
    q = np.full((1, 4, 1, 3), 2.0)                     # ||k||^2 = 12: outside the stable range
    with pytest.raises(UserWarning, match="beta"):
        gdn_ext.gated_delta_rule(q, q, q, beta=np.full((1, 4, 1), 0.5), alpha=np.ones((1, 4, 1)))


def test_the_docs_stand_without_the_design_note():
    """The design note the project started from is not shipped: the pages, the notebooks and the
    package's docstrings and messages name each lesson by its content, and the note itself comes up
    in one place only, the user guide's "Where the names come from"."""
    import json
    shown = _pages() + [p for p in [ROOT / "CHANGELOG.md"] if p.is_file()]   # not in the sdist
    texts = {p: p.read_text(encoding="utf-8") for p in shown}
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        texts[nb] = "\n".join("".join(c["source"]) for c in cells)
    for src in sorted((ROOT / "gdn_ext").rglob("*.py")):
        texts[src] = src.read_text(encoding="utf-8")
    home = ROOT / "docs" / "guide" / "recurrence.md"
    if home in texts:   # its one section, cut out
        texts[home] = re.sub(r"\n## Where the names come from\n.*?(?=\n## )", "", texts[home],
                             flags=re.S)
    found = [f"{p.relative_to(ROOT)}: ...{t[max(0, m.start() - 40):m.end() + 20]!r}..."
             for p, t in texts.items() for m in re.finditer(r"design[ -]note", t, re.I)]
    assert not found, "\n".join(found)


def test_written_signatures_match_the_functions():
    """A signature the guide writes out in full ({func}`name(params) <target>`, no "...") names
    the function's parameters in its order, keyword-only marker included: a keyword the code
    gained (algorithm=, check_values=) must not be missing from the page."""
    import importlib
    import inspect
    if not DOCS.is_dir():
        pytest.skip("docs/ is not in this tree (an sdist)")
    pat = re.compile(r"\{func\}`[\w.]+\((.*?)\)\s*<([\w.]+)>`", re.S)
    seen = 0
    for page in _pages():
        for m in pat.finditer(page.read_text(encoding="utf-8")):
            params, target = m.groups()
            if "..." in params:
                continue
            mod, _, name = target.rpartition(".")
            fn = getattr(importlib.import_module(mod), name)
            written = [p.split("=")[0].strip() for p in params.replace("\n", " ").split(",")]
            actual = []
            for p in inspect.signature(fn).parameters.values():
                if p.kind is p.KEYWORD_ONLY and "*" not in actual:
                    actual.append("*")
                actual.append(p.name)
            assert written == actual, f"{page.name}: {target}: written {written}, code {actual}"
            seen += 1
    assert seen >= 2


def test_the_speed_pages_logs_speak_to_users():
    """The logs the Speed page links are read by users: no words of how the team runs its
    machines (leases, scratch scripts under .ab/ or .dev/, "device" for a machine)."""
    logs = sorted((DOCS / "benchmarks").glob("*.txt")) if DOCS.is_dir() else []
    found = [f"{p.name}:{i + 1}: {line[:80]}" for p in logs
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines())
             if re.search(r"\blease\b|\.ab/|\.dev\b|\bdevice\b", line)]
    assert not found, "\n".join(found)


@pytest.mark.skipif(not DOCS.is_dir(), reason="docs/ is not in the sdist")
def test_the_site_is_readable_at_its_width(monkeypatch):
    """Notebook figures are drawn as SVG (vector: zoomable, legible) and no wider than the text
    column shows near full size, long code lines wrap instead of being cut at the column's edge,
    and a page with no sub-pages has no empty left sidebar."""
    import sys
    monkeypatch.setattr(os, "environ", dict(os.environ))    # conf.py sets the kernels' variables
    monkeypatch.setattr(sys, "path", list(sys.path))
    conf = {"__file__": str(DOCS / "conf.py")}
    exec(compile((DOCS / "conf.py").read_text(encoding="utf-8"), str(DOCS / "conf.py"), "exec"),
         conf)
    profile = pathlib.Path(conf["IPYTHONDIR"]) / "profile_default" / "ipython_kernel_config.py"
    assert re.search(r"InlineBackend\.figure_formats = \{\"svg\"\}", profile.read_text()), profile
    css = "".join((DOCS / d / f).read_text(encoding="utf-8")
                  for d in conf["html_static_path"] for f in conf["html_css_files"])
    assert re.search(r"pre\s*\{[^}]*white-space:\s*pre-wrap", css), css
    toc = re.search(r"```\{toctree\}(.*?)```", (DOCS / "index.md").read_text(encoding="utf-8"),
                    re.S).group(1)
    leaves = [ln.strip() for ln in toc.splitlines()
              if ln.strip() and not ln.startswith(":") and not ln.strip().endswith("/index")]
    assert leaves and all(conf["html_sidebars"].get(p) == [] for p in leaves), \
        (leaves, conf["html_sidebars"])
    # at most 8 inches wide: the text column shows it near full size (panels go one above another)
    import json
    wide = [(nb.name, w) for nb in sorted((ROOT / "notebooks").glob("*.ipynb"))
            for c in json.loads(nb.read_text(encoding="utf-8"))["cells"]
            for w in re.findall(r"figsize=\(([\d.]+),", "".join(c["source"])) if float(w) > 8]
    assert not wide, wide


def test_every_extra_the_texts_name_exists_and_the_apps_imports_are_in_one():
    """`pip install -e ".[x]"` in the README, the docs and the package's own messages names an
    extra that pyproject.toml defines; the optional modules that a command imports
    (``python -m gdn_ext ondisk``: dask and zarr) are in the extra its message names."""
    tomllib = pytest.importorskip("tomllib")   # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    texts = [ROOT / "README.md", *(ROOT / "gdn_ext").rglob("*.py")]
    if DOCS.is_dir():
        texts += [p for p in DOCS.rglob("*.md") if "_build" not in p.parts]
    named = set()
    for path in texts:
        for group in re.findall(r"""pip install[^\n`]*?\.\[([a-z0-9_,-]+)\]""", path.read_text()):
            named.update((n.strip(), path.name) for n in group.split(","))
    assert ("ondisk", "ondisk.py") in named
    for name, where in sorted(named):
        assert name in extras, f"{where} names the extra [{name}], which pyproject.toml lacks"
    wanted = {re.split(r"[<>=\[ ]", r)[0] for r in extras["ondisk"]}
    assert {"dask", "zarr"} <= wanted, extras["ondisk"]
