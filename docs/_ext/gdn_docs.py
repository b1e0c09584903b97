"""Sphinx extension of gdn_ext's docs: the API pages written from the modules' ``__all__`` (so
every public name is documented, and a new one without editing a list), and the table of the raw
gufuncs read from ``gdn_ext.ufuncs`` (``{gdn-ufunc-table}`` in a page).

``ufunc_rows()`` and ``api_pages()`` are plain functions: tests/test_docs.py checks them too.
"""
import importlib
import pathlib
import re
import shutil

import numpy as np

API = pathlib.Path(__file__).resolve().parents[1] / "api"

# The pages of the API reference: module -> (title, sections). A section is (heading, test): the
# public names a test accepts, in __all__'s order; names that no section takes go to "More".
# Submodules of gdn_ext are linked, not listed.
def _from(*modules):
    return lambda name, obj: getattr(obj, "__module__", None) in modules


def _is_result(name, obj):
    return isinstance(obj, type) and issubclass(obj, tuple)


PAGES = {
    "gdn_ext": ("gdn_ext", [
        ("The gated delta rule", lambda n, o: _from("gdn_ext.recurrence")(n, o)
         and not _is_result(n, o)),
        ("Threads", _from("gdn_ext._threads")),
        ("Memory: the block cache", _from("gdn_ext._cache")),
        ("The layer", lambda n, o: _from("gdn_ext.layer")(n, o) and not _is_result(n, o)),
        ("Results", _is_result),
    ]),
    "gdn_ext.layer": ("gdn_ext.layer", [("More of the layer", lambda n, o: True)]),
    "gdn_ext.reference": ("gdn_ext.reference", [("The NumPy oracle", lambda n, o: True)]),
    "gdn_ext.ufuncs": ("gdn_ext.ufuncs", []),
    "gdn_ext.torch": ("gdn_ext.torch", [
        ("Functions", lambda n, o: not isinstance(o, type)),
        ("The layer as a module", lambda n, o: isinstance(o, type)),
    ]),
    "gdn_ext.dask": ("gdn_ext.dask", [("Functions", lambda n, o: True)]),
    "gdn_ext.conformance": ("gdn_ext.conformance", [("The suite", lambda n, o: True)]),
}


def _public(modname):
    """(name, object) of a module's __all__, without submodules and dunder names; for a
    submodule of gdn_ext, without the names gdn_ext itself exports (documented there)."""
    mod = importlib.import_module(modname)
    top = set(importlib.import_module("gdn_ext").__all__) if modname != "gdn_ext" else set()
    out = []
    for name in mod.__all__:
        obj = getattr(mod, name)
        # modules are linked, not listed; the gufuncs have their own table (gdn-ufunc-table)
        if name.startswith("__") or type(obj).__name__ == "module" or isinstance(obj, np.ufunc):
            continue
        if modname == "gdn_ext.layer" and name in top:
            continue
        out.append((name, obj))
    return out


def api_pages():
    """{module: reST text of its API page}."""
    pages = {}
    for modname, (title, sections) in PAGES.items():
        lines = [title, "=" * len(title), "", f".. automodule:: {modname}", "   :no-members:",
                 "", f".. currentmodule:: {modname}", ""]
        left = _public(modname)
        for heading, test in sections + [("More", lambda n, o: True)]:
            names = [n for n, o in left if test(n, o)]
            left = [(n, o) for n, o in left if n not in names]
            if not names:
                continue
            lines += [heading, "-" * len(heading), "", ".. autosummary::",
                      "   :toctree: generated/", "   :nosignatures:", ""]
            lines += [f"   {n}" for n in names] + [""]
        if modname == "gdn_ext.ufuncs":
            lines += ["The gufuncs", "-----------", "", ".. gdn-ufunc-table::", ""]
        if modname == "gdn_ext":
            subs = [n for n in importlib.import_module(modname).__all__
                    if type(getattr(importlib.import_module(modname), n)).__name__ == "module"]
            lines += ["Submodules", "----------", ""]
            lines += [f"- :doc:`gdn_ext.{n}`" for n in subs] + [""]
        pages[modname] = "\n".join(lines)
    return pages


def write_api_pages(app=None, config=None):
    """Write docs/api/<module>.rst (generated, not in git) where it changed, and clear
    autosummary's stubs (docs/api/generated/), so that a name no longer public leaves none."""
    API.mkdir(exist_ok=True)
    shutil.rmtree(API / "generated", ignore_errors=True)
    for modname, text in api_pages().items():
        path = API / f"{modname}.rst"
        if not path.exists() or path.read_text() != text:
            path.write_text(text)


def _ufuncs():
    """Every gufunc gdn_ext's compiled module defines, in gdn_ext.ufuncs.__all__'s order
    first (any the module does not export come last, so that the table still shows them)."""
    import gdn_ext.ufuncs as u
    core = u._core
    names = list(u.__all__)
    names += sorted(n for n in dir(core)
                    if isinstance(getattr(core, n), np.ufunc) and n not in names)
    return [(n, getattr(u, n, None) or getattr(core, n)) for n in names]


def ufunc_rows():
    """(name, call, signature, summary) per gufunc, from the ufunc's own docstring: its second
    paragraph is the call with argument names, the first sentence of its third what it
    computes."""
    rows = []
    for name, uf in _ufuncs():
        paras = [" ".join(p.split()) for p in uf.__doc__.split("\n\n")]
        call = paras[1] if len(paras) > 1 else name
        call = re.sub(r",?\s*/,\s*out=None,\s*\*\*kwargs", "", call)
        summary = paras[2] if len(paras) > 2 else ""
        summary = summary.replace("See gdn_ext.ufuncs.", "").strip()
        summary = re.split(r"(?<=[\w)\]])\.\s", summary + " ")[0].strip().rstrip(".") + "."
        rows.append((name, call, uf.signature, summary))
    return rows


def _ufunc_table_directive():
    """``.. gdn-ufunc-table::`` -- the raw gufuncs, their arguments and core signatures, as a
    table node (built directly: the directive also runs inside MyST pages, whose nested parsing
    reads Markdown). Sphinx is imported here only: the tests use the functions above without it."""
    from docutils import nodes
    from sphinx.util.docutils import SphinxDirective

    def entry(*children):
        return nodes.entry("", nodes.paragraph("", "", *children))

    class UfuncTable(SphinxDirective):
        has_content = False

        def run(self):
            header = ["gufunc and its arguments", "core signature", "what it computes"]
            table = nodes.table(classes=["gdn-ufunc-table"])
            group = nodes.tgroup(cols=3)
            table += group
            group += [nodes.colspec(colwidth=w) for w in (35, 35, 30)]
            head = nodes.thead()
            head += nodes.row("", *(entry(nodes.Text(h)) for h in header))
            body = nodes.tbody()
            for name, call, sig, summary in ufunc_rows():
                body += nodes.row("", entry(nodes.literal(call, call)),
                                  entry(nodes.literal(sig, sig)), entry(nodes.Text(summary)))
            group += [head, body]
            return [table]

    return UfuncTable


_SECTION_WITH_NOTE = re.compile(r"^(\s*)(Args|Returns|Raises) \((.+)\):\s*$")


def google_section_notes(app, what, name, obj, options, lines):
    """A Google-style section header with a note, ``Args (note):``, becomes the note as a line
    of its own and a plain ``Args:``, which napoleon reads (it knows only the plain header)."""
    for i, line in enumerate(lines):
        m = _SECTION_WITH_NOTE.match(line)
        if m:
            indent, section, note = m.groups()
            title = {"Args": "Arguments"}.get(section, section)
            lines[i:i + 1] = [f"{indent}{title}: {note}.", "", f"{indent}{section}:"]


def setup(app):
    app.connect("config-inited", write_api_pages)
    # before napoleon (priority 500) turns the Google-style sections into fields
    app.connect("autodoc-process-docstring", google_section_notes, priority=400)
    app.add_directive("gdn-ufunc-table", _ufunc_table_directive())
    return {"parallel_read_safe": True, "parallel_write_safe": True}
