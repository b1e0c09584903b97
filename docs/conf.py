"""Sphinx configuration of gdn_ext's documentation.

Build (from the repository root, after ``pip install torch==2.13.0 -e ".[docs]"``)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html

-W turns every warning into an error; the notebooks in notebooks/ are executed on every build
(myst-nb, no pandoc needed). The API pages in docs/api/ are generated at each build from the
modules' ``__all__`` (docs/_ext/gdn_docs.py), so a new public name is documented without editing
a list here.
"""
import os
import pathlib
import shutil
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "_ext"))

import gdn_ext  # noqa: E402  (the installed or in-place-built package the docs describe)

project = "gdn_ext"
author = "the gdn_ext authors"
copyright = "the gdn_ext authors, MIT License"
release = version = gdn_ext.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "sphinx.ext.napoleon",  # only for the Google-style "Args:" docstrings (numpydoc: the rest)
    "numpydoc",
    "myst_nb",          # MyST Markdown pages and the notebooks (executed on each build)
    "gdn_docs",         # docs/_ext: the generated API pages and the gufunc table
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"
exclude_patterns = ["_build", "benchmarks", "Thumbs.db", ".DS_Store"]
templates_path = ["_templates"]

# -- the notebooks: copied from notebooks/ (their one home) into docs/notebooks/ and run there
NOTEBOOKS = HERE / "notebooks"
NOTEBOOKS.mkdir(exist_ok=True)
for old in NOTEBOOKS.glob("*.ipynb"):
    if not (ROOT / "notebooks" / old.name).exists():
        old.unlink()
for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
    dst = NOTEBOOKS / nb.name
    if not dst.exists() or dst.read_bytes() != nb.read_bytes():
        shutil.copyfile(nb, dst)
# the notebooks' kernels inherit this: figures as inline images, whatever MPLBACKEND said
os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
# ... drawn as SVG (vector: legends and ticks stay legible when the page is zoomed), through a
# kernel profile of the build's own (a reader's own IPython settings do not change the site).
# The profile also drops the kernels' "running over TCP without encryption" line: the build's
# kernels listen on the loopback interface only, for the length of one notebook.
KERNEL_CONFIG = """\
import logging
c.InlineBackend.figure_formats = {"svg"}
class LoopbackOnly(logging.Filter):
    def filter(self, record):
        return "without encryption" not in record.getMessage()
logging.getLogger("IPKernelApp").addFilter(LoopbackOnly())
"""
IPYTHONDIR = HERE / "_build" / "ipython"
(IPYTHONDIR / "profile_default").mkdir(parents=True, exist_ok=True)
(IPYTHONDIR / "profile_default" / "ipython_kernel_config.py").write_text(KERNEL_CONFIG,
                                                                          encoding="utf-8")
os.environ["IPYTHONDIR"] = str(IPYTHONDIR)

nb_execution_mode = "force"           # always run them: a broken lesson fails the build
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# -- API reference
autosummary_generate = True
autosummary_imported_members = True
autodoc_default_options = {"members": False}
autodoc_typehints = "none"            # the signatures show them; numpydoc's sections say the rest
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_validation_checks = set()
napoleon_numpy_docstring = False      # numpydoc's job
napoleon_google_docstring = True


# -- HTML
html_theme = "pydata_sphinx_theme"
html_title = f"gdn_ext {release}"
html_static_path = ["_static"]
html_css_files = ["gdn.css"]
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
}
html_show_sourcelink = False
# pages with no sub-pages: the left sidebar would be an empty column
html_sidebars = {page: [] for page in ("speed", "install", "changelog", "contributing")}
