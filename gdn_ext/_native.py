"""The compiled module gdn_ext._core, loaded here and only here.

``_core`` is the extension for the library's modules (``from ._native import _core``). When it
cannot be loaded (a source folder that was not built), ``CORE_ERROR`` holds an ImportError saying
how to build it, and importing ``_core`` from here raises that error instead of Python's
"cannot import name '_core'"; gdn_ext.reference works without it.

Also checks ``GDN_EXT_ISA`` (the kernels' instruction set, read by the compiled module when it
loads): a value it could not honour -- not one of the allowed names, or a level this CPU lacks --
gives a RuntimeWarning saying so and which level runs instead."""
import importlib
import os
import sys
import warnings

__all__ = ["_core", "CORE_ERROR"]


def _load():
    """(the compiled module, None), or (None, the ImportError to raise where it is needed).

    Idle OpenMP threads sleep instead of spinning, unless the user chose (OMP_WAIT_POLICY,
    GOMP_SPINCOUNT): spinning threads take the cores from NumPy's BLAS threads and from other
    processes (measured: the main job 2.5 x slower with one busy process on 2 cores). The OpenMP
    runtime reads this once, when the extension loads it; the environment is restored afterwards
    so that runtimes loaded later (torch's own) keep their defaults."""
    set_policy = "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ
    if set_policy:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        # (import_module: a missing module is reported as missing, not as a circular import)
        return importlib.import_module(__package__ + "._core"), None   # loads the OpenMP runtime
    except ImportError as exc:
        why = ("is not built" if isinstance(exc, ModuleNotFoundError)
               else f"could not be loaded ({exc})")
        error = ImportError(
            f"gdn_ext's compiled module gdn_ext._core {why}. In a source checkout, build it "
            f"first: `pip install -e .` (or `python setup.py build_ext --inplace`), which needs a "
            f"C compiler (README, Install); or run from outside the source folder so that an "
            f"installed gdn_ext is found. gdn_ext.reference works without it.")
        error.__cause__ = exc
        return None, error
    finally:
        if set_policy:
            del os.environ["OMP_WAIT_POLICY"]


_loaded, CORE_ERROR = _load()


def __getattr__(name):
    # reached for _core only when it failed to load (else it is a global of this module)
    if name == "_core" and CORE_ERROR is not None:
        raise CORE_ERROR
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


ISA_LEVELS = ("generic", "avx2", "avx512")   # GDN_EXT_ISA's allowed values, slowest first


def isa_request_problem(requested, chosen):
    """Why a ``GDN_EXT_ISA`` value was not honoured, or None (unset, empty, or honoured).
    ``chosen``: the level the kernels run (``_core.isa()``)."""
    if not requested:
        return None
    if requested not in ISA_LEVELS:
        why = "is not one of the allowed values (case matters)"
    elif requested != chosen:
        why = "is not available on this CPU"
    else:
        return None
    return (f"GDN_EXT_ISA={requested!r} {why}; the allowed values are "
            f"{', '.join(ISA_LEVELS)}; the kernels use {chosen!r} (the best this CPU has)")


def _warn_at_importer(message, category):
    """Warn at the line that imported gdn_ext (the first frame outside gdn_ext and importlib)."""
    package = os.path.dirname(os.path.abspath(__file__))
    f = sys._getframe(1)
    while f is not None and (os.path.abspath(f.f_code.co_filename).startswith(package)
                             or "importlib" in f.f_code.co_filename):
        f = f.f_back
    if f is None:
        warnings.warn(message, category, stacklevel=2)
        return
    warnings.warn_explicit(message, category, f.f_code.co_filename, f.f_lineno,
                           module=f.f_globals.get("__name__"),
                           registry=f.f_globals.setdefault("__warningregistry__", {}))


if CORE_ERROR is None:
    _core = _loaded
    _problem = isa_request_problem(os.environ.get("GDN_EXT_ISA"), _core.isa())
    if _problem is not None:
        _warn_at_importer(_problem, RuntimeWarning)
