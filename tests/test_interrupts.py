"""Ctrl-C never changes a result: a call returns its complete result or raises; a SIGINT belongs
to the main thread's call, never to another thread's or a forked child's; it stops a call of any
shape in any phase (casts, inner-loop calls) promptly; a Python handler that does not raise lets
the call complete; SIGINT's disposition after a call is what it would have been without gdn_ext.
And gdn_ext.threads objects shared between threads and asyncio tasks.

Each race test runs long enough to have caught the bug it guards against on the code before the
fix in every run tried (the counts are in each test's docstring)."""
import asyncio
import copy
import pickle
import random
import sys
import threading
import time

import numpy as np
import pytest

import gdn_ext
from gdn_ext._threads import thread_count
from helpers import run_python

posix = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

# Shared by the scripts: inputs, and SIGINT's disposition as the C library sees it (Python's
# signal.getsignal shows only Python's own table).
PRELUDE = r"""
import ctypes, os, signal, sys, threading, time
import numpy as np, gdn_ext

def inputs(B, T, H, D, seed=0, unit=True, dtype=np.float32):
    r = np.random.default_rng(seed)
    q = r.standard_normal((B, T, H, D)).astype(dtype)
    k = q / np.linalg.norm(q, axis=-1, keepdims=True) if unit else q
    return dict(q=q, k=k, v=r.standard_normal((B, T, H, D)).astype(dtype),
                beta=np.full((B, T, H), .5, dtype), alpha=np.full((B, T, H), .95, dtype))

_libc = ctypes.CDLL(None, use_errno=True)
def c_handler():
    buf = ctypes.create_string_buffer(512)   # struct sigaction; the handler comes first
    assert _libc.sigaction(signal.SIGINT, None, buf) == 0
    return ctypes.c_void_p.from_buffer(buf).value

def sigint_after(delay, sent):
    def fire():
        time.sleep(delay)
        sent.append(time.perf_counter())
        os.kill(os.getpid(), signal.SIGINT)
    th = threading.Thread(target=fire)
    th.start()
    return th
"""


def _run(script, timeout=300):
    out = run_python(PRELUDE + script, timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


RACE_THREADS = r"""
DUR = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
small = [inputs(1, 8, 2, 16, s) for s in (1, 2)]      # two problems: a skipped call's garbage
want = [gdn_ext.gated_delta_rule(**x) for x in small]  # can't be the previous call's result
steps = [dict(q_t=x["q"][:, 0], k_t=x["k"][:, 0], v_t=x["v"][:, 0], beta=x["beta"][:, 0],
              alpha=x["alpha"][:, 0], state=None) for x in small]
want_step = [gdn_ext.gated_delta_rule_step(**s) for s in steps]
big = inputs(1, 20000, 2, 64, 3)
stop = threading.Event()
counts = {"wrong": 0, "total": 0}
lock = threading.Lock()

def worker(i):
    n = bad = 0
    while not stop.is_set():
        j = n % 2
        if (n + i) % 3 == 0:
            o, S = gdn_ext.gated_delta_rule_step(**steps[j])
            ok = np.array_equal(o, want_step[j][0]) and np.array_equal(S, want_step[j][1])
        else:
            o, S = gdn_ext.gated_delta_rule(**small[j])
            ok = np.array_equal(o, want[j][0]) and np.array_equal(S, want[j][1])
        bad += not ok
        n += 1
    with lock:
        counts["wrong"] += bad
        counts["total"] += n

def signaller():
    while not stop.is_set():
        time.sleep(0.03)
        os.kill(os.getpid(), signal.SIGINT)

# KeyboardInterrupt only while the main thread is in a call, once per call: the script's own
# lines never see one
in_call = [False]
def handler(signum, frame):
    if in_call[0]:
        in_call[0] = False
        raise KeyboardInterrupt
signal.signal(signal.SIGINT, handler)

threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
threads.append(threading.Thread(target=signaller))
for t in threads:
    t.start()
end = time.time() + DUR
interrupted = 0
while time.time() < end:
    try:
        in_call[0] = True
        gdn_ext.gated_delta_rule(**big)
        in_call[0] = False
    except KeyboardInterrupt:
        interrupted += 1
stop.set()
for t in threads:
    t.join()
print(counts["wrong"], counts["total"], interrupted)
"""


@posix
def test_sigint_never_changes_other_threads_results():
    """SIGINTs every 30 ms while the main thread runs long calls and three threads run short
    calls and decode steps, for 4 s: every short call exact, the main thread interrupted.
    Before the fix: 84 and 121 wrong results of 5 653 and 10 649 calls (two runs)."""
    wrong, total, interrupted = map(int, _run(RACE_THREADS.replace("sys.argv[1]", "'4'")).split())
    assert total > 100 and interrupted > 0
    assert wrong == 0, f"{wrong} of {total} calls in other threads returned wrong results"


FORK = r"""
small = inputs(1, 8, 2, 16, 1)
want = gdn_ext.gated_delta_rule(**small)
mid = inputs(1, 4000, 2, 64, 2)
want_mid = gdn_ext.gated_delta_rule(**mid)
long = inputs(1, 200000, 2, 64, 3)
python_handler = c_handler()

def child_checks():
    # one caught KeyboardInterrupt, then every call must be exact and complete
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2)
    except KeyboardInterrupt:
        pass
    bad = sum(not np.array_equal(gdn_ext.gated_delta_rule(**small)[0], want[0])
              for _ in range(200))
    bad += not np.array_equal(gdn_ext.gated_delta_rule(**mid)[0], want_mid[0])
    bad += c_handler() != python_handler   # no handler of the parent's call left behind
    os._exit(min(bad, 100))

def in_long_call():
    try:
        gdn_ext.gated_delta_rule(**long)
    except KeyboardInterrupt:
        pass

results = []
def fork_from(who):
    pid = os.fork()
    if pid == 0:
        child_checks()
    results.append((who, os.waitpid(pid, 0)[1]))

# another thread in a long call, the main thread forks
th = threading.Thread(target=in_long_call)
th.start()
time.sleep(0.3)
fork_from("main")
th.join()
# the main thread in a long call, another thread forks
th = threading.Thread(target=lambda: (time.sleep(0.3), fork_from("thread")))
th.start()
in_long_call()
th.join()
print(results)
"""


@posix
def test_forked_child_is_not_cancelled_by_the_parents_call():
    """A fork() while another thread is in a long call; in the child, one caught
    KeyboardInterrupt, then 200 short calls and a longer one: all exact, and SIGINT's handler is
    Python's. Before the fix every short call after the interrupt returned garbage."""
    import ast
    results = ast.literal_eval(_run(FORK).strip())
    assert [w for w, _ in results] == ["main", "thread"]
    assert all(status == 0 for _, status in results), results


LATENCY = r"""
case, delay = sys.argv[1], 0.3
if case == "rows":     # B = 4, H = 4: NumPy calls the inner loop once per batch row
    B, T, H, D = 4, 100_000, 4, 128
elif case == "small":  # many rows, each a small call
    B, T, H, D = 1000, 1000, 2, 64
elif case == "one sequence":   # one pair on every thread (the chunk form's team)
    B, T, H, D = 1, 200_000, 1, 512
if case in ("rows", "small", "backward", "one sequence"):
    if case == "backward":
        B, T, H, D = 8, 20_000, 4, 128
    r = np.random.default_rng(0)
    x = r.standard_normal((1, T, 1, D)).astype(np.float32)
    x /= np.linalg.norm(x, axis=-1, keepdims=True)
    q = np.broadcast_to(x, (B, T, H, D))       # memory for one head, rows for B * H
    kw = dict(beta=np.full((B, T, H), .5, np.float32), alpha=np.full((B, T, H), .99, np.float32))
    if case == "backward":
        call = lambda: gdn_ext.gated_delta_rule_backward(q, q, q, q, **kw)
    else:
        call = lambda: gdn_ext.gated_delta_rule(q, q, q, **kw)
elif case == "cast":   # float32 q, k, v with float64 gates: q, k, v converted before the kernel
    x = inputs(1, 1_000_000, 2, 64)
    kw = dict(beta=x["beta"].astype(np.float64), alpha=x["alpha"].astype(np.float64))
    call = lambda: gdn_ext.gated_delta_rule(x["q"], x["k"], x["v"], **kw)
sent = []
start = time.perf_counter()
th = sigint_after(delay, sent)
try:
    call()
    end = time.perf_counter()
except KeyboardInterrupt:
    print("interrupted", time.perf_counter() - sent[0])
else:   # what a failure report needs: when the signal went, and to which handler
    try:
        th.join()
        late = ""
    except KeyboardInterrupt:
        late = "raised after the call"
    print("finished", end - start, "signal sent at", sent and sent[0] - start, late,
          "C handler", c_handler(), "Python handler", signal.getsignal(signal.SIGINT))
th.join()
"""


@posix
@pytest.mark.parametrize("case", ["rows", "small", "backward", "one sequence", "cast"])
def test_ctrl_c_stops_every_shape_and_phase_promptly(case):
    """SIGINT 0.3 s into calls of several seconds: B = H = 4 (one inner-loop call per row),
    1000 rows of small calls, a backward over 8 rows, one long sequence that every thread works
    on, and a call whose inputs are converted to float64 first. KeyboardInterrupt within 1 s (a fraction of a second on an idle machine;
    the bound allows for a loaded one). Before the fix: 3.4 s, the whole call, 1 s, 7-46 s."""
    line = _run(LATENCY.replace("sys.argv[1]", repr(case))).strip()
    what, seconds = line.split()[:2]
    assert what == "interrupted", line
    assert float(seconds) < 1.0, f"KeyboardInterrupt {seconds} s after the signal"


OVERFLOW = r"""
import warnings
x = inputs(1, 100_000, 4, 128, unit=False)   # keys not normalised: the state overflows
# one thread: the forward takes about 0.4 s (0.2 s on two threads of a Zen 5, which would end
# before the signal)
fwd = lambda: gdn_ext.gated_delta_rule(x["q"], x["k"], x["v"], beta=x["beta"], alpha=x["alpha"],
                                       num_threads=1)
bwd = lambda: gdn_ext.gated_delta_rule_backward(x["q"], x["q"], x["k"], x["v"], beta=x["beta"],
                                                alpha=x["alpha"])
def recorded(f):
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        return f()
for name, call in (("forward", fwd), ("backward", bwd), ("recorded", lambda: recorded(bwd))):
    sent = []
    th = sigint_after(0.1, sent)
    try:
        call()
        print(name, "returned")
    except KeyboardInterrupt:
        print(name, "KeyboardInterrupt")
    except BaseException as e:
        print(name, type(e).__name__)
    th.join()
"""


@posix
def test_ctrl_c_with_overflowing_inputs_raises_keyboard_interrupt():
    """Inputs whose states overflow (floating-point flags set when the signal comes): the forward,
    the backward, and the backward inside catch_warnings(record=True) each raise
    KeyboardInterrupt. Before the fix: the backward returned with 80 % of dq zero, the others
    raised SystemError."""
    lines = dict(line.split() for line in _run(OVERFLOW).splitlines())
    assert lines == {"forward": "KeyboardInterrupt", "backward": "KeyboardInterrupt",
                     "recorded": "KeyboardInterrupt"}


HANDLER = r"""
x = inputs(1, 200_000, 2, 64)
args = (x["q"], x["k"], x["v"])
kw = dict(beta=x["beta"], alpha=x["alpha"])
want_o, want_S = gdn_ext.gated_delta_rule(*args, **kw)
want_g = gdn_ext.gated_delta_rule_backward(x["q"], *args, **kw)
hits = []
python_handler = c_handler()
def finish_this_step(signum, frame):   # records the request, does not raise
    hits.append(signum)
signal.signal(signal.SIGINT, finish_this_step)
installed = c_handler()
results = []
for name in ("forward", "backward"):
    sent = []
    th = sigint_after(0.2, sent)
    if name == "forward":
        o, S = gdn_ext.gated_delta_rule(*args, **kw)
        results.append(np.array_equal(o, want_o) and np.array_equal(S, want_S))
    else:
        g = gdn_ext.gated_delta_rule_backward(x["q"], *args, **kw)
        results.append(all(np.array_equal(a, b) for a, b in zip(g, want_g)))
    th.join()
    results.append(c_handler() == installed)

# a handler that changes SIGINT's disposition while the main thread's call runs
def stop_next_time(signum, frame):
    hits.append(signum)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
signal.signal(signal.SIGINT, stop_next_time)
sent = []
th = sigint_after(0.2, sent)
o, S = gdn_ext.gated_delta_rule(*args, **kw)
th.join()
results.append(np.array_equal(o, want_o))
results.append(c_handler() is None)               # SIG_DFL, as the handler left it

# SIG_DFL set by the main thread while another thread is in a long call
signal.signal(signal.SIGINT, signal.default_int_handler)
th = threading.Thread(target=lambda: gdn_ext.gated_delta_rule(*args, **kw))
th.start()
time.sleep(0.2)
signal.signal(signal.SIGINT, signal.SIG_DFL)
th.join()
results.append(c_handler() is None)
print(len(hits), results)
"""


@posix
def test_a_python_handler_that_does_not_raise_lets_the_call_complete():
    """A SIGINT handler that only records the request: the forward and the backward it came
    during complete, bitwise equal to uninterrupted calls, and the handler stays installed. A
    handler that sets SIG_DFL keeps SIG_DFL after the call; so does SIG_DFL set by the main thread
    while another thread's call runs. Before the fix the calls raised
    KeyboardInterrupt('gdn_ext: interrupted') and the handler change was undone."""
    hits, results = _run(HANDLER).split(" ", 1)
    assert int(hits) == 3
    assert results.strip() == str([True] * 7), results


NESTED = r"""
r = np.random.default_rng(0)
x = r.standard_normal((1, 50000, 1, 64)).astype(np.float32)
x /= np.linalg.norm(x, axis=-1, keepdims=True)
q = np.broadcast_to(x, (4, 50000, 2, 64))          # 4 rows: 4 inner-loop calls
kw = dict(beta=np.full((4, 50000, 2), .5, np.float32), alpha=np.full((4, 50000, 2), .99, np.float32))
want = gdn_ext.gated_delta_rule(q, q, q, **kw)
small = inputs(1, 8, 2, 16)
want_small = gdn_ext.gated_delta_rule(**small)
T, D = 4, 3
bad = (np.ones((T, D)), np.ones((T, D)), np.ones((T, D)), np.ones((T, D)), np.ones(T),
       np.zeros((1, D, D)), 1.0, 0.0, np.array([0, T + 1]))   # cu_seqlens that does not end at T
seen = []
def handler(signum, frame):
    seen.append(np.array_equal(gdn_ext.gated_delta_rule(**small)[0], want_small[0]))
    try:
        gdn_ext.ufuncs.gated_delta_rule_general_fwd(*bad)   # fails in the C loop's checks
    except ValueError:
        seen.append("caught")
signal.signal(signal.SIGINT, handler)
th = sigint_after(0.2, [])
o, S = gdn_ext.gated_delta_rule(q, q, q, **kw)
th.join()
print(seen, np.array_equal(o, want[0]) and np.array_equal(S, want[1]))
"""


@posix
def test_calls_from_a_signal_handler_leave_the_interrupted_call_whole():
    """A SIGINT handler that calls gdn_ext, and a raw ufunc that fails in C (caught): the call it
    interrupted (four inner-loop calls) still completes with every row right."""
    assert _run(NESTED).strip() == "[True, 'caught'] True"


STREAM = r"""
x = inputs(2, 40000, 1, 64)      # two rows: two inner-loop calls
t = time.perf_counter()
want = gdn_ext.gated_delta_rule(**x, num_threads=1)
base = time.perf_counter() - t
hits = []
signal.signal(signal.SIGINT, lambda s, f: hits.append(s))
stop = threading.Event()
def pelt():                      # SIGINTs three times per row's time, without end
    while not stop.is_set():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(base / 6)
def watchdog():
    if not stop.wait(20 * base + 10):
        print("hang", len(hits), flush=True)
        os._exit(1)
threading.Thread(target=pelt, daemon=True).start()
threading.Thread(target=watchdog, daemon=True).start()
o, S = gdn_ext.gated_delta_rule(**x, num_threads=1)
stop.set()
print(np.array_equal(o, want[0]) and np.array_equal(S, want[1]), len(hits) > 2)
"""


@posix
def test_a_stream_of_sigints_whose_handler_does_not_raise_cannot_stall_a_call():
    """SIGINTs arriving three times per row's time, handled without raising: the call still
    completes, exact (each row is run again at most once). Before the fix every signal restarted
    the row, and the call never finished."""
    assert _run(STREAM).split() == ["True", "True"]


# ---- gdn_ext.threads objects, shared --------------------------------------------------------------

TWO = gdn_ext.threads(2)


def test_threads_object_shared_between_threads():
    """One module-level threads(2) entered from 8 threads at once, 5 blocks each, with a call
    inside: no error, the count seen inside is 2 and outside the default. Before the fix 8 to 30 of
    the 40 blocks raised ValueError."""
    errors, seen = [], []
    rng = np.random.default_rng(0)
    x = dict(beta=np.full((1, 4, 1), .5), alpha=np.full((1, 4, 1), .9))
    q = rng.standard_normal((1, 4, 1, 3))
    barrier = threading.Barrier(8)

    def run(i):
        r = random.Random(i)
        try:
            barrier.wait()
            for _ in range(5):
                with TWO:
                    time.sleep(r.uniform(0, 0.01))
                    seen.append(thread_count(None))
                    gdn_ext.gated_delta_rule(q, q, q, **x)
                    time.sleep(r.uniform(0, 0.01))
                seen.append(thread_count(None))
        except Exception as exc:   # noqa: BLE001 -- the test counts them
            errors.append(repr(exc))

    ts = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []
    assert sorted(seen) == [0] * 40 + [2] * 40


def test_threads_object_shared_between_asyncio_tasks():
    """20 tasks enter the same threads(2), or threads(3) nested inside it, and await inside the
    block: each sees its own innermost count and the default after."""
    THREE = gdn_ext.threads(3)

    async def task(i):
        with TWO:
            await asyncio.sleep(0.001 * (i % 3))
            if i % 2:
                with THREE:
                    await asyncio.sleep(0)
                    assert thread_count(None) == 3
            assert thread_count(None) == 2
        return thread_count(None)

    async def main():
        return await asyncio.gather(*(task(i) for i in range(20)))

    assert asyncio.run(main()) == [0] * 20


def test_threads_object_pickles_and_copies_while_entered():
    with TWO:
        for clone in (pickle.loads(pickle.dumps(TWO)), copy.deepcopy(TWO), copy.copy(TWO)):
            assert isinstance(clone, gdn_ext.threads) and clone.n == 2
            with clone:
                assert thread_count(None) == 2
        assert thread_count(None) == 2
    assert thread_count(None) == 0
    default = pickle.loads(pickle.dumps(gdn_ext.threads(None)))
    assert default.n == 0
    with pytest.raises(RuntimeError, match="exit without a matching enter"):
        gdn_ext.threads(4).__exit__(None, None, None)
