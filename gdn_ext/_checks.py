"""Argument checking shared by the public functions: every message names the argument and the
shape it expected, so that bad input fails here, in Python, before any kernel runs."""
import contextvars
import math
import operator
import os
import sys
import warnings

import numpy as np

__all__ = []


_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def as_real_array(x, name):
    """``x`` as an ndarray of a real dtype (bool, int, float); TypeError otherwise."""
    if type(x) is np.ndarray and x.dtype in _FLOATS:   # the common case, without the checks below
        return x
    if x is None:
        raise TypeError(f"{name} is required (got None)")
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(f"{name} is a masked array, whose mask the kernels would ignore; pass "
                        f"{name}.filled(value) or a plain ndarray")
    try:
        a = np.asarray(x)
    except Exception as exc:  # ragged lists and the like
        raise TypeError(f"{name} must be array-like of real numbers: {exc}") from None
    if a.dtype.kind not in "biuf" or not np.can_cast(a.dtype, np.float64, "safe"):
        raise TypeError(f"{name} must have a real dtype that casts safely to float64 (the kernels "
                        f"run in float32 or float64); got dtype {a.dtype}")
    return a


def fmt(shape):
    return "[" + ", ".join(str(s) for s in shape) + "]"


def expect_shape(a, name, shape, names):
    """Raise ValueError unless ``a.shape == shape``; ``names`` spells the expected shape."""
    if a.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {names} = {fmt(shape)}; got {fmt(a.shape)}")


def real_scalar(x, name):
    """``x`` as a finite Python float; TypeError if not a real scalar, ValueError if not finite."""
    ok = isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)
    if not ok and isinstance(x, np.ndarray) and x.ndim == 0:
        ok = x.dtype.kind in "iuf"
    if not ok:
        raise TypeError(f"{name} must be a real scalar (a float); got {x!r}")
    try:
        f = float(x)
    except OverflowError:
        raise ValueError(f"{name} must be finite; got {x!r}") from None
    if not math.isfinite(f):
        raise ValueError(f"{name} must be finite; got {f}")
    return f


# The thread counts of the gdn_ext.threads(n) blocks open in the current thread (and asyncio
# task), innermost last (0: OpenMP's default): a tuple, so that a shared threads object keeps no
# per-thread state of its own.
context_threads = contextvars.ContextVar("gdn_ext_threads", default=())


def thread_count(num_threads):
    """None -> gdn_ext.threads(n)'s n when inside one, else 0 (OpenMP's default:
    OMP_NUM_THREADS / threadpoolctl); else a positive int."""
    if num_threads is None:
        stack = context_threads.get()
        return stack[-1] if stack else 0
    if isinstance(num_threads, bool):
        raise TypeError("num_threads must be None or a positive int; got a bool")
    try:
        n = operator.index(num_threads)
    except TypeError:
        raise TypeError(f"num_threads must be None or a positive int; got "
                        f"{type(num_threads).__name__}") from None
    if not 1 <= n <= 2**31 - 1:
        raise ValueError(f"num_threads must be None or an int in [1, 2**31 - 1]; got {n}")
    return n


def sequence_length(T):
    """A number of steps: a non-negative int below 2**62; TypeError / ValueError otherwise."""
    if isinstance(T, (bool, np.bool_)):
        raise TypeError("T must be a non-negative int; got a bool")
    try:
        n = operator.index(T)
    except TypeError:
        raise TypeError(f"T must be a non-negative int; got {type(T).__name__}") from None
    if not 0 <= n < 2**62:
        raise ValueError(f"T must be a non-negative int below 2**62; got {n}")
    return n


def flag(x, name):
    """A bool argument; TypeError for anything else (a string like "no" is truthy)."""
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool; got {x!r}")
    return bool(x)


def compute_dtype(arrays):
    """The precision a NumPy ufunc with float32 and float64 loops would pick for these inputs."""
    f32 = np.dtype(np.float32)
    dtypes = {a.dtype for a in arrays}
    if dtypes <= {f32}:
        return f32
    return f32 if all(np.can_cast(d, f32, "safe") for d in dtypes) else np.dtype(np.float64)


# Elements converted per piece by `converted`: a few milliseconds of work.
_PIECE = 1 << 21


def converted(a, dtype, fn=None):
    """``fn(a)`` (or ``a``) as ``dtype``, computed piece by piece along ``a``'s leading axes.

    NumPy converts a whole array in one C call, with no check for signals; one conversion of a
    large input (float32 to float64: seconds) would delay Ctrl-C until it ends. Between pieces
    Python handles signals, so a KeyboardInterrupt comes within a piece. ``a`` is returned as it
    is when it already has ``dtype`` and there is no ``fn``."""
    dtype = np.dtype(dtype)
    if fn is None and a.dtype == dtype:
        return a
    if a.size <= _PIECE:
        return (a if fn is None else fn(a.astype(dtype, copy=False))).astype(dtype, copy=False)
    # the first axis whose trailing block fits in a piece; steps of several of its entries
    axis, block = a.ndim - 1, 1
    while axis > 0 and block * a.shape[axis] <= _PIECE:
        block *= a.shape[axis]
        axis -= 1
    block_axis = a.shape[axis + 1:] if axis + 1 < a.ndim else ()
    step = max(1, _PIECE // max(1, int(np.prod(block_axis, dtype=np.int64))))
    out = np.empty(a.shape, dtype)
    for lead in np.ndindex(*a.shape[:axis]):
        for s in range(0, a.shape[axis], step):
            sl = lead + (slice(s, s + step),)
            piece = a[sl]
            out[sl] = piece if fn is None else fn(piece.astype(dtype, copy=False))
    return out


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def caller_stacklevel():
    """The ``stacklevel`` that makes a warning issued by the caller of this function point at
    the first frame outside gdn_ext (the user's line), however deep inside gdn_ext it is."""
    level, f = 2, sys._getframe(2)
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(_PACKAGE):
        level, f = level + 1, f.f_back
    return level


def warn(message, category=UserWarning):
    """A warning that points at the user's line."""
    warnings.warn(message, category, stacklevel=caller_stacklevel())
