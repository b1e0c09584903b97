"""The block cache: large arrays and workspace reused across calls, never while in use.

A block handed out twice at once, a stale block passed off as zeros, or a lock left held in a
forked child would all be silent wrong answers or hangs; each test below fails on such a cache."""
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

import gdn_ext
from gdn_ext import _core
from gdn_ext._cache import uses_block_cache
from helpers import run_python

# NumPy 2 moved it (np.core warns there); the function itself is NEP 49's
handler_name = getattr(np, "_core", getattr(np, "core", None)).multiarray.get_handler_name

# B = 1, T = 512, H = 4, D = 128 float32: o is 1 MiB, the smallest block the cache keeps
SHAPE = dict(B=1, T=512, H=4, D=128)


def _inputs(seed, B, T, H, D, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((B, T, H, D)).astype(dtype) for _ in range(3))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    return dict(q=q, k=k, v=v, beta=rng.uniform(0, 1, (B, T, H)).astype(dtype),
                g=-rng.uniform(0, 0.2, (B, T, H)).astype(dtype))


def _run(x, **kw):
    o, S_T = gdn_ext.gated_delta_rule(x["q"], x["k"], x["v"], beta=x["beta"], g=x["g"], **kw)
    return o, S_T


@pytest.fixture
def limit():
    """Restores the default limit (and an empty cache) after a test that changes them."""
    previous = gdn_ext.set_cache_limit(1 << 30)
    gdn_ext.set_cache_limit(previous)
    yield previous
    gdn_ext.set_cache_limit(previous)
    gdn_ext.empty_cache()


def test_blocks_are_reused_after_free_and_only_then(limit):
    x = _inputs(0, **SHAPE)
    gdn_ext.empty_cache()
    o1, _ = _run(x, num_threads=1)
    assert handler_name(o1) == "gdn_ext_block_cache"
    kept = o1.copy()
    reserved = gdn_ext.memory_reserved()        # the workspace's blocks, o1 is in use
    for _ in range(3):                          # calls that want a block of o1's size
        o2, _ = _run(_inputs(1, **SHAPE), num_threads=1)
        assert o2.ctypes.data != o1.ctypes.data
        del o2
    np.testing.assert_array_equal(o1, kept)     # never handed out while in use
    del o1
    before = gdn_ext.memory_reserved()
    assert before >= reserved + kept.nbytes     # o1's block (and o2's) kept for reuse
    o3, _ = _run(x, num_threads=1)
    assert gdn_ext.memory_reserved() <= before - o3.nbytes    # o3 is one of them
    np.testing.assert_array_equal(o3, kept)


def test_a_reused_block_given_as_zeros_is_zero(limit):
    """np.zeros under the cache: a cached block (full of NaN here) is cleared before use."""
    n = (4 << 20) // 8

    @uses_block_cache
    def fill_and_free():
        a = np.empty(n)
        a[:] = np.nan
        return a.ctypes.data

    @uses_block_cache
    def zeros():
        return np.zeros(n)

    address = fill_and_free()
    z = zeros()
    assert z.ctypes.data == address and not z.any()


def test_an_array_from_the_cache_resizes_in_place_keeping_its_values(limit):
    """ndarray.resize reallocates through the array's own allocator (the cache's)."""
    o, _ = _run(_inputs(5, **SHAPE), num_threads=1)
    want = o.ravel().copy()
    for n in (3 * want.size, want.size // 2, 1000):   # larger, smaller, below the cache's blocks
        o.resize((n,), refcheck=False)
        m = min(n, want.size)
        np.testing.assert_array_equal(o[:m], want[:m])
        assert not o[m:].any()                          # NumPy zero-fills what resize adds
        want = o.copy()


def test_a_limit_beyond_memory_means_no_limit(limit):
    gdn_ext.set_cache_limit(1 << 200)
    assert gdn_ext.set_cache_limit(limit) == sys.maxsize


def test_limit_zero_keeps_nothing_and_results_stay(limit):
    x = _inputs(2, **SHAPE)
    want = _run(x, num_threads=1)[0]
    assert gdn_ext.set_cache_limit(0) == limit
    assert gdn_ext.memory_reserved() == 0       # lowering the limit freed what was kept
    got = _run(x, num_threads=1)[0]
    np.testing.assert_array_equal(got, want)
    del got
    assert gdn_ext.memory_reserved() == 0
    gdn_ext.set_cache_limit(limit)
    _run(x, num_threads=1)
    assert gdn_ext.memory_reserved() > 0
    assert gdn_ext.empty_cache() > 0 and gdn_ext.memory_reserved() == 0


def test_the_callers_allocator_is_put_back_even_after_an_error():
    x = _inputs(3, **SHAPE)
    with pytest.raises(ValueError):
        gdn_ext.gated_delta_rule(x["q"], x["k"][:, :-1], x["v"], beta=x["beta"], g=x["g"])
    _run(x)
    assert handler_name() == "default_allocator"
    assert handler_name(np.empty(1 << 20)) == "default_allocator"


class _Interrupt(BaseException):
    pass


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="setitimer")
def test_an_exception_from_a_signal_handler_never_leaves_the_cache_on():
    """A signal handler raising at any point of a call under the cache's decorator (here every
    0.13 ms, for 2 s of calls of an empty function, where the switching is most of the time)
    leaves the thread with NumPy's own allocator. With the cache switched on before the
    decorator's try block, it stayed on within the first 2 300 calls on 5 runs of 5.
    (Not decode steps here: an exception raised inside np.errstate's __enter__ leaves that
    errstate set, a NumPy matter that would upset the floating-point tests that follow.)"""
    fn = uses_block_cache(lambda: None)
    fn()
    inside = [False]

    def handler(*_):
        if inside[0]:
            raise _Interrupt()

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.001, 0.00013)
    leaked, calls, t0 = False, 0, time.monotonic()
    try:
        while not leaked and time.monotonic() - t0 < 2.0:
            calls += 1
            try:
                inside[0] = True
                try:
                    fn()
                except _Interrupt:
                    pass
                inside[0] = False
            except _Interrupt:
                inside[0] = False
            leaked = handler_name(np.empty(4)) != "default_allocator"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert not leaked, f"the cache stayed this thread's allocator after {calls} calls"
    assert calls > 1000


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (np.int64(-1), ValueError),
                                        (1.5, TypeError), ("1", TypeError), (True, TypeError),
                                        (np.bool_(True), TypeError), (None, TypeError),
                                        (np.array([5]), TypeError)])
def test_set_cache_limit_rejects_bad_limits(bad, error, limit):
    with pytest.raises(error, match="nbytes"):
        gdn_ext.set_cache_limit(bad)
    assert gdn_ext.set_cache_limit(limit) == limit     # unchanged


def test_threads_sharing_the_cache_get_their_own_blocks(limit):
    """8 Python threads, 40 calls each (forward and backward, each result checked bitwise against
    its single-threaded value while the others allocate and free blocks of the same sizes): the
    calls as users make them. (Their workspace races are brief; the churn test below is the one
    that catches a cache without its lock.)"""
    xs = [_inputs(10 + i, **SHAPE) for i in range(4)]
    want = [_run(x, num_threads=1)[0] for x in xs]
    do = np.ones_like(xs[0]["v"])
    want_dq = [gdn_ext.gated_delta_rule_backward(do, x["q"], x["k"], x["v"], beta=x["beta"],
                                                 g=x["g"], num_threads=1).dq for x in xs]
    failures = []

    def work(t):
        for r in range(40):
            i = (t + r) % 4
            o, _ = _run(xs[i], num_threads=1)
            g = gdn_ext.gated_delta_rule_backward(do, xs[i]["q"], xs[i]["k"], xs[i]["v"],
                                                  beta=xs[i]["beta"], g=xs[i]["g"], num_threads=1)
            if not (np.array_equal(o, want[i]) and np.array_equal(g.dq, want_dq[i])):
                failures.append((t, r))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not failures


def test_callers_racing_for_cached_blocks_never_share_one(limit):
    """4 threads, each 3000 rounds of taking two 1 MiB blocks, tagging, checking and freeing them
    without the GIL (the kernels' workspace is taken so, inside the gufunc loops). With the
    cache's lock taken out, every run of 5 found shared blocks or crashed; with it, none."""
    gdn_ext.empty_cache()
    counts = {}

    def churn(tag):
        counts[tag] = _core._cache_churn(3000, 1 << 20, tag)

    threads = [threading.Thread(target=churn, args=(tag,)) for tag in range(1, 5)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert counts == {1: 0, 2: 0, 3: 0, 4: 0}
    assert 0 < gdn_ext.memory_reserved() <= 8 * (1 << 20)   # at most two blocks per thread


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_fork_while_other_threads_use_the_cache():
    """Forks while 4 threads allocate and free cached blocks: each child's own calls complete (the
    cache's lock is never inherited held) and agree with the parent's. 20 forks."""
    code = r"""
import os, sys, threading, numpy as np, gdn_ext
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 512, 4, 128)).astype(np.float32) for _ in range(3))
k /= np.linalg.norm(k, axis=-1, keepdims=True)
beta = np.full((1, 512, 4), 0.5, np.float32)
g = np.full((1, 512, 4), -0.1, np.float32)
want = gdn_ext.gated_delta_rule(q, k, v, beta=beta, g=g, num_threads=1)[0]
stop = False
def churn():
    while not stop:
        gdn_ext.gated_delta_rule(q, k, v, beta=beta, g=g, num_threads=1)
threads = [threading.Thread(target=churn) for _ in range(4)]
for t in threads: t.start()
bad = 0
for _ in range(20):
    pid = os.fork()
    if pid == 0:
        o = gdn_ext.gated_delta_rule(q, k, v, beta=beta, g=g, num_threads=1)[0]
        os._exit(0 if np.array_equal(o, want) else 3)
    _, status = os.waitpid(pid, 0)
    bad += status != 0
stop = True
for t in threads: t.join()
sys.exit(bad)
"""
    r = run_python(code, timeout=240)
    assert r.returncode == 0, r.stderr


def test_workspace_is_traced_while_in_use_only(limit):
    """tracemalloc sees the kernels' workspace during a call (a cached block included) and not
    after it: memory the cache keeps is not memory in use."""
    import tracemalloc
    x = _inputs(4, **SHAPE)
    do = np.ones_like(x["v"])
    call = lambda: gdn_ext.gated_delta_rule_backward(do, x["q"], x["k"], x["v"], beta=x["beta"],
                                                     g=x["g"], num_threads=1)
    call()                                          # its workspace is now cached
    assert gdn_ext.memory_reserved() > 0
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        g = call()
        peak = tracemalloc.get_traced_memory()[1] - base
        after = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    grads = sum(a.nbytes for a in g if isinstance(a, np.ndarray))
    assert peak > grads + 1_000_000                # the workspace (several MB) was seen
    assert after < grads + 100_000                 # and untraced when it went back to the cache


def test_chunk_states_hold_no_garbage_from_a_reused_block(limit):
    """The chunk form's states come in an uninitialised (here: reused, all-NaN) block: the kernel
    writes every slot -- the states, and zeros where a pair keeps none (a packed sequence shorter
    than the longest, an empty one, a head that auto gives the recurrence) -- and the backward
    from them matches the recurrent one."""
    from gdn_ext.recurrence import _train_backward, _train_forward
    rng = np.random.default_rng(7)
    cu = np.array([0, 10, 10, 710])                 # 10 tokens, none, 700: NS = 3
    T, H, D = int(cu[-1]), 2, 128
    q, k, v = (rng.standard_normal((1, T, H, D)) for _ in range(3))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    k[:, :, 1] *= 3.0                               # head 1: beta |k|^2 = 4.5 > 2, the recurrence
    beta = np.full((1, T, H), 0.5)
    g = -rng.uniform(0, 0.1, (1, T, H))
    kw = dict(beta=beta, g=g, cu_seqlens=cu, num_threads=1)
    n = _core._chunk_checkpoint_count(700, 32, D, D)
    shape = (3, H, n, D, D)

    @uses_block_cache
    def poison():
        np.full(shape, np.nan)                      # made and freed: its block is kept

    poison()
    o, S_T, ck = _train_forward(q, k, v, **kw)
    assert ck.shape == shape and not np.isnan(ck).any()
    assert not ck[:, 1].any()                       # the recurrent head keeps no states
    assert not ck[0, 0, 1:].any() and not ck[1, 0].any()   # 10 tokens: one chunk; none: none
    assert ck[2, 0].any() and ck[0, 0, 0].any() == False   # noqa: E712 (S_0 = 0 enters chunk 0)
    do = rng.standard_normal(v.shape)
    got = _train_backward(do, q, k, v, checkpoints=ck, **kw)
    want = gdn_ext.gated_delta_rule_backward(do, q, k, v, algorithm="recurrent", check_values=False,
                                             **kw)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
