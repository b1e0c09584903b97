"""The compiled module gdn_ext._core for the library's modules, or the clear ImportError that
gdn_ext/__init__.py prepared (a source folder that was not built), instead of Python's
"cannot import name '_core'"."""
from . import _CORE_ERROR

if _CORE_ERROR is not None:
    raise _CORE_ERROR

from . import _core  # noqa: E402

__all__ = ["_core"]
