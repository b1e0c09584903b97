"""The compiled module gdn_ext._core for the library's modules, or the clear ImportError that
gdn_ext/__init__.py prepared (a source folder that was not built), instead of Python's
"cannot import name '_core'".

Also checks ``GDN_EXT_ISA`` (the kernels' instruction set, read by the compiled module when it
loads): a value it could not honour -- not one of the allowed names, or a level this CPU lacks --
gives a RuntimeWarning saying so and which level runs instead."""
import os
import sys
import warnings

from . import _CORE_ERROR

if _CORE_ERROR is not None:
    raise _CORE_ERROR

from . import _core  # noqa: E402

__all__ = ["_core"]

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


_problem = isa_request_problem(os.environ.get("GDN_EXT_ISA"), _core.isa())
if _problem is not None:
    _warn_at_importer(_problem, RuntimeWarning)
