"""Thread counts: the ``gdn_ext.threads(n)`` block, the ``num_threads`` argument of every call,
the count a default call gets, and large elementwise work cut into pieces run on threads.

Precedence, resolved by `thread_count`: a call's own ``num_threads=`` > the innermost
``threads(n)`` > OpenMP's default (``OMP_NUM_THREADS``, threadpoolctl's limit), which the compiled
module applies (0 stands for it here) with its cap for a busy machine."""
import contextvars
import operator
from typing import Optional

import numpy as np

__all__ = ["threads"]


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


def default_threads(items=1 << 30):
    """The threads a default call (``num_threads=None``, outside any ``threads(n)`` block) gets
    for ``items`` independent work items: OpenMP's default count, at most ``items``."""
    from ._native import _core   # here: this module imports without the compiled module
    return int(_core._threads_for(items))


def busy_cap():
    """The cap the compiled module puts on default thread counts now, 0 for none: it lowers them
    while the machine's cores are busy with other work (user guide, "Threads and signals")."""
    from ._native import _core
    return int(_core._busy_cap())


class raw_ufunc_threads:
    """``with raw_ufunc_threads(n):`` the raw gufuncs (``gdn_ext.ufuncs``), which take no
    ``num_threads``, run on ``n`` threads in the block (0: OpenMP's default); for timing them."""

    def __init__(self, n):
        self.n = n

    def __enter__(self):
        from ._native import _core
        self.prev = _core._set_call_threads(self.n)
        return self

    def __exit__(self, *exc):
        from ._native import _core
        _core._set_call_threads(self.prev)
        return False


class threads:
    """Run gdn_ext's kernels on ``n`` threads inside a ``with`` block, in the calling thread
    (and asyncio task) only::

        with gdn_ext.threads(4):
            o, S = gdn_ext.gated_delta_rule(q, k, v, beta=beta, g=g)

    Precedence: a call's own ``num_threads=`` > the innermost ``threads(n)`` > threadpoolctl's
    OpenMP limit and ``OMP_NUM_THREADS`` (OpenMP's default; torch shares the runtime, so
    ``torch.set_num_threads`` changes it too). ``threads(None)`` restores that default for the
    block. Other Python threads, and dask tasks (which run in other threads), are not affected:
    give ``gdn_ext.dask`` its ``num_threads``. Composes with ``threadpoolctl.threadpool_limits``
    (which limits NumPy's BLAS and the OpenMP default) by taking precedence over it for gdn_ext.

    The object holds only ``n``: one object (say a module-level ``TWO = gdn_ext.threads(2)``) may
    be entered from several threads and asyncio tasks at once, nested, and again; it pickles and
    copies as its ``n``. What a block restores on exit lives in the thread's (or task's) context
    (a generator that yields inside a block leaves it open in its caller until it resumes).
    Raises TypeError / ValueError for an n that is not None or a positive int (when made), and
    RuntimeError when a block exits in a context where it was not entered."""

    __slots__ = ("n",)

    def __init__(self, n: Optional[int]):
        self.n = 0 if n is None else thread_count(n)

    def __enter__(self):
        context_threads.set(context_threads.get() + (self.n,))
        return self

    def __exit__(self, *exc):
        stack = context_threads.get()
        if not stack or stack[-1] != self.n:
            raise RuntimeError("gdn_ext.threads: exit without a matching enter in this thread "
                               "or task")
        context_threads.set(stack[:-1])
        return False

    def __reduce__(self):
        return (threads, (self.n or None,))

    def __repr__(self):
        return f"gdn_ext.threads({self.n or None})"


# Elements per piece of `converted` and `pieces`: well under a millisecond of work.
PIECE = 1 << 18


def pieces(shape, size=PIECE):
    """Index tuples that cut an array of ``shape`` (C order) into pieces of about ``size``
    elements along its leading axes; each piece of a C-contiguous array is contiguous."""
    if int(np.prod(shape, dtype=np.int64)) <= size:
        return [()]
    # the first axis whose trailing block fits in a piece; steps of several of its entries
    axis, block = len(shape) - 1, 1
    while axis > 0 and block * shape[axis] <= size:
        block *= shape[axis]
        axis -= 1
    step = max(1, size // max(1, int(np.prod(shape[axis + 1:], dtype=np.int64))))
    return [lead + (slice(s, s + step),)
            for lead in np.ndindex(*shape[:axis]) for s in range(0, shape[axis], step)]


# NumPy's names of its floating-point errors (what an errcall receives), the np.geterr() key of
# each and its flag, in the order NumPy reports them
_FP_ERRORS = (("divide by zero", "divide", 1), ("overflow", "over", 2),
              ("underflow", "under", 4), ("invalid value", "invalid", 8))


def fp_recorded(seen):
    """An np.errstate in which NumPy's floating-point errors are only recorded, as keys of the
    dict ``seen``, for `report_fp` to report later on the calling thread."""
    return np.errstate(all="call", call=seen.__setitem__)


def fp_policy():
    """This thread's np.errstate: (np.geterr(), np.geterrcall()), for `report_fp`."""
    return np.geterr(), np.geterrcall()


def report_fp(seen, what, policy=None, at=None):
    """The floating-point errors ``seen`` (`fp_recorded`) in operation ``what`` reported as NumPy
    would have under ``policy`` (`fp_policy`; default: this thread's np.errstate): warned at the
    user's line (``at``: a _checks.caller_location), raised, called, printed or logged."""
    from ._checks import warn
    modes, errcall = fp_policy() if policy is None else policy
    for err, key, flag in _FP_ERRORS:
        mode = modes[key] if err in seen else "ignore"
        message = f"{err} encountered in {what}"
        if mode == "warn":
            warn(message, RuntimeWarning, at=at)
        elif mode == "raise":
            raise FloatingPointError(message)
        elif mode == "call":   # with what NumPy passed: all the flags raised
            errcall(err, seen[err])
        elif mode == "print":
            print(f"Warning: {message}")
        elif mode == "log":
            errcall.write(f"Warning: {message}\n")


def lead_pieces(lead, per=1):
    """Index tuples of slices (every axis kept) that cut the leading axes ``lead`` of an array
    with ``per`` elements per leading entry into pieces of about PIECE elements; [()] when it
    is one piece."""
    if int(np.prod(lead, dtype=np.int64)) * per <= PIECE:
        return [()]
    return [tuple(i if isinstance(i, slice) else slice(i, i + 1) for i in sl)
            for sl in pieces(tuple(lead), max(1, PIECE // max(1, per)))]


def run_pieces(work, items, num_threads=1, what="cast"):
    """``work(item)`` for every item: in order on the calling thread, or on up to
    ``num_threads`` threads (0: OpenMP's default count) when there are several items (NumPy's
    loops release the GIL, so pieces of an elementwise operation run in parallel). The work must
    write disjoint outputs:
    each element is then computed by the same code whatever the thread count. The threads live
    for this call only (nothing is left behind for a fork). Ctrl-C: items not yet started are
    dropped and the KeyboardInterrupt propagates once the running ones end.

    Floating-point errors (``what``: the operation they are reported in) follow the caller's
    np.errstate, which helper threads do not inherit (NumPy keeps it in a context variable):
    each piece only records them, and once all are done they are reported on the calling
    thread -- warned at the user's line, raised, called or ignored -- whatever the thread count."""
    seen = {}

    def guarded(item):
        with fp_recorded(seen):
            work(item)
    if num_threads == 0 and len(items) > 1:   # OpenMP's default, asked only when it matters
        num_threads = default_threads(len(items))
    n = min(num_threads, len(items))
    if n <= 1:
        for item in items:
            guarded(item)
        if seen:
            report_fp(seen, what)
        return
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(n, thread_name_prefix="gdn_ext-piece") as pool:
        futures = [pool.submit(guarded, item) for item in items]
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    if seen:
        report_fp(seen, what)


