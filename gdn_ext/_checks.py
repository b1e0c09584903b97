"""Argument checking shared by the public functions: every message names the argument and the
shape it expected, so that bad input fails here, in Python, before any kernel runs."""
import math
import operator
import os
import sys
import warnings

import numpy as np

from ._threads import PIECE, fp_recorded, lead_pieces, pieces, report_fp, run_pieces

__all__ = []


_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def gate_axis_note(name, given, per_head, Dk):
    """The warning for a gate broadcast to one per head although its last axis has Dk entries,
    as a per-key gate's would (NumPy's rules line it up with the heads, or the batch): what to
    give for one decay per key channel; None when the shapes are not ambiguous."""
    if not given or given[-1] != Dk or Dk <= 1:
        return None
    return (f"{name} of shape {fmt(given)} was broadcast to one gate per head, {fmt(per_head)} "
            f"(NumPy's rules line its last axis up with the last of those), although its last "
            f"axis has Dk = {Dk} entries as a per-key gate's would: for one decay per key "
            f"channel give it {len(per_head) + 1} axes, e.g. shape "
            f"{fmt((1,) * len(per_head) + (Dk,))} (check_values=False turns this warning off)")


def torch_tensor_message(name):
    """The NumPy and dask front ends' refusal of a torch tensor: which function takes it."""
    return (f"{name} is a torch tensor: gdn_ext.torch.gated_delta_rule takes tensors (and "
            f"differentiates them); for this NumPy function pass {name}.detach().numpy()")


def as_real_array(x, name):
    """``x`` as an ndarray of a real dtype (bool, int, float); TypeError otherwise."""
    if type(x) is np.ndarray and x.dtype in _FLOATS:   # the common case, without the checks below
        return x
    if x is None:
        raise TypeError(f"{name} is required (got None)")
    if type(x).__module__.split(".")[0] == "torch":
        raise TypeError(torch_tensor_message(name))
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


_STATE_AXES = {("Dv", "Dk"): "flash-linear-attention keeps a state as [..., K, V]",
               ("V", "K"): "flash-linear-attention's default is [..., K, V]",
               ("K", "V"): "the [..., V, K] layout is gdn_ext's own: state_v_first=True takes it"}


def transposed_state_hint(got, shape, names):
    """The end of a shape error for a state given with its last two axes swapped (the other
    layout of the state, [.., Dk, Dv] against [.., Dv, Dk]): '' when that is not the mistake."""
    axes = tuple(x.strip() for x in names.split("]")[0].strip("[ ").split(","))[-2:]
    got, shape = tuple(got), tuple(shape)
    if (axes not in _STATE_AXES or len(shape) < 2 or shape[-1] == shape[-2]
            or got != shape[:-2] + (shape[-1], shape[-2])):
        return ""
    return (f"; that is the transpose of the expected [..., {axes[0]}, {axes[1]}] "
            f"({_STATE_AXES[axes]}): swap its last two axes (.swapaxes(-1, -2), or "
            f".transpose(-1, -2) for a tensor)")


def expect_shape(a, name, shape, names):
    """Raise ValueError unless ``a.shape == shape``; ``names`` spells the expected shape."""
    if a.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {names} = {fmt(shape)}; got {fmt(a.shape)}"
                         + transposed_state_hint(a.shape, shape, names))


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


def converted(a, dtype, fn=None, num_threads=1):
    """``fn(a)`` (or ``a``) as ``dtype``, computed piece by piece along ``a``'s leading axes, on
    up to ``num_threads`` threads (`run_pieces`); ``fn`` is a NumPy ufunc (it takes ``out=``).

    NumPy converts a whole array in one C call, with no check for signals; one conversion of a
    large input (float32 to float64: seconds) would delay Ctrl-C until it ends. Between pieces
    Python handles signals, so a KeyboardInterrupt comes within a piece. ``a`` is returned as it
    is when it already has ``dtype`` and there is no ``fn``."""
    dtype = np.dtype(dtype)
    if fn is None and a.dtype == dtype:
        return a
    what = "cast" if fn is None else fn.__name__
    # floating-point errors as the caller's np.errstate says, at the caller's line
    if a.size <= PIECE:   # one piece, here
        seen = {}
        with fp_recorded(seen):
            r = (a if fn is None else fn(a.astype(dtype, copy=False))).astype(dtype, copy=False)
        if seen:
            report_fp(seen, what)
        return r
    out = np.empty(a.shape, dtype)

    def one(sl):   # into out, with no temporary
        if fn is None:
            out[sl] = a[sl]
        else:
            fn(a[sl].astype(dtype, copy=False), out=out[sl])
    run_pieces(one, pieces(a.shape), num_threads, what)
    return out


def contiguous(a, num_threads=1):
    """``a`` as a C-contiguous array: itself when it is one, else a copy made piece by piece
    (Ctrl-C between pieces, as `converted`)."""
    if a.flags.c_contiguous:
        return a
    out = np.empty(a.shape, a.dtype)
    run_pieces(lambda sl: np.copyto(out[sl], a[sl]), pieces(a.shape), num_threads, "copy")
    return out


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _internal(f):
    """Whether frame ``f`` runs gdn_ext's code, or PyTorch's through which gdn_ext's custom
    operators and autograd functions are called (torch.library, autograd): not the user's."""
    name = os.path.abspath(f.f_code.co_filename)
    if name.startswith(_PACKAGE):
        return True
    torch = sys.modules.get("torch")
    where = getattr(torch, "__file__", None)
    return where is not None and name.startswith(os.path.dirname(os.path.abspath(where)) + os.sep)


def _outside(f):
    """The first frame from ``f`` outward that is not gdn_ext's or torch's (None if none)."""
    while f is not None and _internal(f):
        f = f.f_back
    return f


def caller_stacklevel():
    """The ``stacklevel`` that makes a warning issued by the caller of this function point at
    the first frame outside gdn_ext (and torch, which calls gdn_ext's operators): the user's
    line, however deep inside gdn_ext it is."""
    level, f = 2, sys._getframe(2)
    while f is not None and _internal(f):
        level, f = level + 1, f.f_back
    return level


def caller_location():
    """(filename, lineno, module name) of the user's line that called into gdn_ext: where a
    warning issued later, e.g. by a dask task in another thread, should point."""
    f = _outside(sys._getframe(1))
    if f is None:
        return None
    return f.f_code.co_filename, f.f_lineno, f.f_globals.get("__name__", "<string>")


def warn(message, category=UserWarning, at=None):
    """A warning that points at the user's line: the caller's (first frame outside gdn_ext), or
    ``at`` from :func:`caller_location` (filtered and shown once per line as warnings.warn)."""
    if at is None:
        warnings.warn(message, category, stacklevel=caller_stacklevel())
        return
    filename, lineno, module = at
    globs = getattr(sys.modules.get(module), "__dict__", None)
    registry = None if globs is None else globs.setdefault("__warningregistry__", {})
    warnings.warn_explicit(message, category, filename, lineno, module, registry, globs)


# ---- values a learner may not mean -------------------------------------------------------------
# One implementation for every front end (NumPy, torch, the flash-linear-attention drop-ins,
# dask): they pass NumPy arrays (views of their tensors / blocks) and issue what comes back.

OFF = " (check_values=False turns this warning off)"


# The value checks read every element of k, beta and the gate: by pieces (PIECE elements, well
# under a millisecond each), between which Python handles signals, so that Ctrl-C stops them.

def _reduced(ufunc, x):
    """ufunc.reduce over all of x (not empty), by pieces combined with the same ufunc."""
    if x.size <= PIECE:
        return ufunc.reduce(x, axis=None)
    return ufunc.reduce([ufunc.reduce(x[sl], axis=None) for sl in pieces(x.shape)])


def _range(x):
    """(min, max) ignoring NaN (NaN where all are); None for an empty array."""
    x = np.asarray(x)
    if x.size == 0:
        return None
    return _reduced(np.fmin, x), _reduced(np.fmax, x)


def _screen(beta, gate, k):
    """value_messages' numbers for small float32 / float64 arrays (a decoding step's) in one
    compiled pass: (min, max of beta, min, max of the gate, the largest ||k_t||^2 or None), or
    None (then NumPy computes them; large arrays by pieces, so that Ctrl-C stops them). A zero
    min or max is taken from NumPy (whose -0 or 0 the message prints)."""
    for a in (beta, gate) if k is None else (beta, gate, k):
        if type(a) is not np.ndarray or not 0 < a.size <= PIECE:
            return None
    from . import _native
    if _native.CORE_ERROR is not None:   # gdn_ext.reference without the compiled module
        return None
    return _native._core._value_screen(beta, gate, k)


# A sum of Dk squares in k's dtype (NumPy's) and in double (the screen's) differ by at most
# (Dk + 1) eps relative, plus (Dk + 1) of the dtype's smallest subnormal where squares underflow,
# unless the dtype's sum overflows: the screen settles a step only inside those bounds, with a
# margin of 4, and leaves every other (and every one near 2) to NumPy's own sums.
_FLOAT = {np.dtype(t): (float(np.finfo(t).eps), float(np.finfo(t).smallest_subnormal),
                        float(np.finfo(t).max)) for t in (np.float32, np.float64)}


def _below_two(beta_max, kk_max, k):
    """Whether beta ||k||^2 stays at most 2 for every step, however k's dtype sums ||k||^2:
    from the screen's beta_max and kk_max (a double sum); False when it cannot tell."""
    eps, tiny, big = _FLOAT[k.dtype]
    slack = 4 * (k.shape[-1] + 1)
    if not kk_max <= big * (1 - slack * eps):   # the dtype's sum may overflow (or NaN)
        return False
    return not beta_max * (kk_max * (1 + slack * eps) + slack * tiny) > 2


def head_first_message(shape, name="q", dims=("B", "T", "H", "Dk")):
    """The layout warning for q of ``shape`` [B, T, H, D] with 1 < T < H, else None: arrays
    [B, H, T, D] (head-first) read as [B, T, H, D] show a short T and many heads. Decoding
    (T = 1) never warns; a prompt shorter than the number of heads does (as fla's own check)."""
    if len(shape) != 4 or not 1 < shape[1] < shape[2]:
        return None
    lay = "[" + ", ".join(dims) + "]"
    return (f"{name} has shape {lay} = {fmt(shape)} with T = {shape[1]} < H = {shape[2]}: if it "
            f"is head-first [B, H, T, {dims[3]}], transpose q, k, v and the gates to "
            f"[B, T, H, ...]" + OFF)


def value_messages(beta, gate, k=None, *, log_gate, gate_name=None, delta_rule=True,
                   normalize_qk=False, where=""):
    """Warnings (strings) for values the recurrence takes but a learner may not mean:

    - alpha outside [0, 1] or g above 0 (the decay should keep at most the whole state);
    - with the delta rule: beta outside [0, 2], and, keys not normalised, steps where
      beta ||k||^2 > 2 and the transition along k, alpha (1 - beta ||k||^2), has magnitude
      above 1. The transition S -> S alpha (I - beta k k^T) keeps alpha on directions
      orthogonal to k and alpha (1 - beta ||k||^2) along k: for every alpha in [0, 1] it does
      not grow the state iff beta ||k||^2 is in [0, 2] (the wider [1 - 1/alpha, 1 + 1/alpha]
      for that alpha), so only steps past 2 with alpha (beta ||k||^2 - 1) > 1 warn.

    Arrays (NumPy, any real dtype): the general form, k [B, T, H, Dk], beta [B, T, HV] (or
    [B, T] / [B, T, 1] with H = 1), the gate shaped as beta (one per head) or beta + [Dk] (one
    per key channel); alpha, or g = log alpha when ``log_gate``. Shapes that do not match are
    skipped here (the kernels' checks name them). ``where`` follows the argument's name in each
    message (gdn_ext.dask: " in a dask chunk"). Cost: a few passes over beta, the gate and k,
    small next to the recurrence's 7 Dk Dv flops per token and head; small float arrays (a
    decoding step's) in one compiled pass (_screen), NumPy's passes only near a threshold."""
    gate_name = gate_name or ("g" if log_gate else "alpha")
    msgs = []
    screen = _screen(beta, gate, k if delta_rule and not normalize_qk else None)
    with np.errstate(invalid="ignore", over="ignore"):
        r = _range(gate) if screen is None or 0 in screen[2:4] else screen[2:4]
        if r is not None and not log_gate and (r[0] < 0 or r[1] > 1):
            msgs.append(f"{gate_name} has values outside [0, 1]{where} (min {r[0]:.3g}, max "
                        f"{r[1]:.3g}): it is the fraction of the state kept per step; for a "
                        f"log decay pass g instead" + OFF)
        if r is not None and log_gate and r[1] > 0:
            msgs.append(f"{gate_name} has values above 0{where} (max {r[1]:.3g}): it is the log "
                        f"decay, alpha = exp({gate_name}) <= 1; positive values make the state "
                        f"grow" + OFF)
        if not delta_rule:      # linear attention's write beta v k^T: any beta is a scale
            return msgs
        r = _range(beta) if screen is None or 0 in screen[0:2] else screen[0:2]
        if r is not None and (r[0] < 0 or r[1] > 2):
            msgs.append(f"beta has values outside [0, 2]{where} (min {r[0]:.3g}, max "
                        f"{r[1]:.3g}): the delta rule's write strength; the state stays bounded "
                        f"for beta ||k||^2 in [0, 2], i.e. beta in [0, 2] for unit-norm keys" + OFF)
        if k is not None and not normalize_qk:
            m = _key_norm_message(np.asarray(beta), np.asarray(gate), np.asarray(k), log_gate,
                                  where, screen)
            if m:
                msgs.append(m)
    return msgs


def _key_norm_message(beta, gate, k, log_gate, where, screen=None):
    """value_messages' beta ||k||^2 warning, or None; ``screen``: _screen's numbers, which settle
    the usual case (no step near beta ||k||^2 = 2) without NumPy's passes."""
    if k.ndim != 4 or k.size == 0:
        return None
    B, T, H, Dk = k.shape
    if beta.size == 0 or beta.size % (B * T * H) or beta.shape[:2] != (B, T):
        return None
    G = beta.size // (B * T * H)                              # value heads per key head
    if gate.size == beta.size:
        a = gate.reshape(B, T, H, G)
    elif gate.size == beta.size * Dk:
        a = gate.reshape(B, T, H, G, Dk)
    else:
        return None
    beta = beta.reshape(B, T, H, G)
    if screen is not None and screen[4] is not None and k.dtype in _FLOAT:
        if _below_two(screen[1], screen[4], k):
            return None                                       # the usual case: done
    parts = lead_pieces((B, T, H), Dk * G)                    # over tokens and heads
    dt = k.dtype if k.dtype in _FLOATS else np.float64       # float16 squares overflow early
    if len(parts) == 1:                                       # ||k||^2 per token and head
        kd = k.astype(dt, copy=False)
        kk = np.einsum("bthd,bthd->bth", kd, kd)
    else:
        kk = np.empty((B, T, H), dt)
        for sl in parts:
            kd = k[sl].astype(dt, copy=False)
            np.einsum("bthd,bthd->bth", kd, kd, out=kk[sl])
    kk_max = _reduced(np.fmax, kk)
    if not _reduced(np.fmax, beta) * kk_max > 2:              # the usual case: done
        return None
    worst = x_max = -np.inf
    for sl in parts:
        x = beta[sl] * kk[sl][..., None]
        ai = a[sl] if a.ndim == 4 else np.max(a[sl], axis=-1)   # per key: the largest decay
        grow = np.where(x > 2, (np.exp(ai) if log_gate else ai) * (x - 1), 0)
        worst = np.fmax(worst, np.fmax.reduce(grow, axis=None))
        x_max = np.fmax(x_max, np.fmax.reduce(x, axis=None))
    if not worst > 1:
        return None
    return (f"beta * ||k||^2 is above 2{where} (up to {x_max:.3g}; "
            f"||k||^2 up to {kk_max:.3g}) at steps where the transition along k, "
            f"alpha * (1 - beta ||k||^2), has magnitude up to {worst:.3g} > 1: the state can "
            f"grow without bound (the delta rule is stable for beta ||k||^2 in [0, 2]); "
            f"normalise the keys (normalize_qk=True) or scale beta down" + OFF)
