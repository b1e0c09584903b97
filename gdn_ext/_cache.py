"""gdn_ext's block cache: large arrays and kernel workspace reused across calls.

Memory that malloc gives back to the operating system returns as fresh pages, and the first
write to each one is a page fault. A training step allocates tens of MB (the outputs, the chunk
states its backward restarts from, the gradients, the kernels' workspace); without the cache it
faulted on every page of them on every step (with the cache, a one-layer step at D = 128 ran
1.1-1.5 x faster). The arrays the library's functions return, and the workspace of its kernels,
come from blocks that earlier calls freed, up to a limit (docs: the NumPy guide, "Memory: the
block cache").
"""
import functools
import operator
import sys
from typing import Any, Callable, TypeVar

import numpy as np

from ._native import _core

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["empty_cache", "memory_reserved", "set_cache_limit", "uses_block_cache"]


def uses_block_cache(fn: F) -> F:
    """Decorator: the NumPy arrays ``fn`` makes come from the block cache (NumPy's allocator
    interface, NEP 49; arrays remember their allocator, so they may outlive the call)."""
    @functools.wraps(fn)
    def with_block_cache(*args: Any, **kwargs: Any) -> Any:
        previous = _core._cache_current()
        try:   # entered inside the try: an exception from a signal handler still restores it
            _core._cache_enter()
            return fn(*args, **kwargs)
        finally:
            _core._cache_exit(previous)
    return with_block_cache  # type: ignore[return-value]


def empty_cache() -> int:
    """Give every block the cache keeps back to the system allocator (as torch.cuda.empty_cache
    does for its cache). Arrays still in use are not touched.

    Returns
    -------
    int
        The bytes freed.
    """
    return int(_core._empty_cache())


def memory_reserved() -> int:
    """Bytes the cache keeps for reuse now: blocks of freed arrays and workspace, not in use.

    Returns
    -------
    int
        Bytes, >= 0.
    """
    return int(_core._cache_stats()[0])


def set_cache_limit(nbytes: int) -> int:
    """Set the most bytes the cache keeps (default 2 GiB); 0 keeps none, so that every block
    goes back to the system allocator when it is freed. A limit below what the cache keeps now
    frees every kept block at once; one beyond the address space means no limit.

    Parameters
    ----------
    nbytes : int
        The limit, in bytes, >= 0.

    Returns
    -------
    int
        The previous limit, in bytes.

    Raises
    ------
    TypeError
        ``nbytes`` is not an integer (a bool is not one here).
    ValueError
        ``nbytes`` is negative.
    """
    try:
        if isinstance(nbytes, (bool, np.bool_)):
            raise TypeError
        nbytes = operator.index(nbytes)
    except TypeError:
        raise TypeError(f"set_cache_limit: nbytes must be an integer (bytes), got "
                        f"{type(nbytes).__name__}") from None
    if nbytes < 0:
        raise ValueError(f"set_cache_limit: nbytes must be >= 0, got {nbytes}")
    return int(_core._set_cache_limit(min(nbytes, sys.maxsize)))   # more than memory: no limit
