"""Reliability: exact aliases of the raw gufuncs' outputs and inputs, fork, floating-point flags
across inner-loop calls, Ctrl-C, and warnings that point at the caller's line."""
import contextlib
import itertools
import multiprocessing
import os
import sys
import warnings

import numpy as np
import pytest

import gdn_ext
from gdn_ext import _core, ufuncs
from helpers import run_python, warns_unstable

U = ufuncs


def _raw_inputs(rng, name, N, D, NS=1):
    """Inputs of the raw gufunc `name` with T = Dk = Dv = D, so that every [.., T, D], [.., D, D]
    operand has one shape (exact aliases possible between all of them)."""
    T = D
    unit = rng.standard_normal((N, T, D))
    unit /= np.linalg.norm(unit, axis=-1, keepdims=True)
    general = "general" in name
    seq = (N, NS) if general else (N,)
    x = dict(q=rng.standard_normal((N, T, D)), k=unit, v=rng.standard_normal((N, T, D)),
             alpha=rng.uniform(0.6, 1, (N, T, D) if general else (N, T)),
             beta=rng.uniform(0.1, 0.9, (N, T)), S0=rng.standard_normal(seq + (D, D)))
    if "bwd" in name:
        x["do"] = rng.standard_normal((N, T, D))
        x["dST"] = rng.standard_normal(seq + (D, D))
    order = (["do"] if "bwd" in name else []) + ["q", "k", "v", "alpha", "beta", "S0"] + \
        (["dST"] if "bwd" in name else [])
    args = [x[n] for n in order] + [np.float64(0.7)]
    if general:
        args += [np.float64(1.0), np.array([0, T], np.int64) if NS == 1 else
                 np.array([0, T // 2, T], np.int64)]
    if name.endswith("bwd_ckpt"):
        fa = [x[n] for n in ["q", "k", "v", "alpha", "beta", "S0"]] + args[len(order):]
        args.append(_outputs(name.replace("bwd", "fwd"), fa)[2])
    return args


def _outputs(name, args):
    """A call with fresh outputs (the forward's checkpoints must be given: their axis c)."""
    fn = getattr(U, name)
    if name.endswith("fwd_ckpt"):
        S0 = args[5]
        T = args[0].shape[1]
        # zeros: a shorter packed sequence leaves the slots past its own count as they are
        ck = np.zeros(S0.shape[:-2] + (gdn_ext.checkpoint_count(T),) + S0.shape[-2:])
        return fn(*args, out=(None, None, ck))
    return fn(*args)


GUFUNCS = ["gated_delta_rule_fwd", "gated_delta_rule_bwd", "gated_delta_rule_general_fwd",
           "gated_delta_rule_general_bwd", "gated_delta_rule_fwd_ckpt",
           "gated_delta_rule_bwd_ckpt", "gated_delta_rule_general_fwd_ckpt",
           "gated_delta_rule_general_bwd_ckpt"]


@pytest.mark.parametrize("name", GUFUNCS)
@pytest.mark.parametrize("D", [4, 70])                 # rowwise short path / strips, blocks
@pytest.mark.parametrize("threads", [1, 3])
def test_output_exactly_an_input(name, D, threads):
    """Every output given as the memory of every input of its shape: the results equal a call
    with fresh outputs, bitwise, and the other inputs are not modified."""
    rng = np.random.default_rng(D)
    N = 2
    args = _raw_inputs(rng, name, N, D, NS=2 if "general" in name else 1)
    prev = _core._set_call_threads(threads)
    try:
        want = _outputs(name, args)
        pairs = [(i, j) for i, j in itertools.product(range(len(args)), range(len(want)))
                 if isinstance(args[i], np.ndarray) and args[i].shape == want[j].shape
                 and args[i].dtype == want[j].dtype]
        assert len(pairs) >= 3
        for i, j in pairs:
            a = list(args)
            a[i] = args[i].copy()
            outs = [np.zeros_like(w) for w in want]
            outs[j] = a[i]
            got = getattr(U, name)(*a, out=tuple(outs))
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w, err_msg=f"{name}: output {j} as input {i}")
    finally:
        _core._set_call_threads(prev)


def test_inplace_state_stays_fast_path():
    """S_0 given as S_T's memory (the step API's inplace) is not copied and is still right, on
    the short path (T = 4) and the strip path (T = 70), one and several threads."""
    for D in (4, 70):
        args = _raw_inputs(np.random.default_rng(D), "gated_delta_rule_fwd", 2, D)
        want = U.gated_delta_rule_fwd(*args)
        for threads in (1, 2):
            a = list(args)
            a[5] = s = args[5].copy()
            prev = _core._set_call_threads(threads)
            try:
                o, S = U.gated_delta_rule_fwd(*a, out=(np.empty_like(want[0]), s))
            finally:
                _core._set_call_threads(prev)
            assert S is s
            np.testing.assert_array_equal(S, want[1])
            np.testing.assert_array_equal(o, want[0])


# ---- fork -----------------------------------------------------------------------------------------

def _child_work(seed):
    rng = np.random.default_rng(seed)
    B, T, H, D = 2, 80, 4, 32
    q = rng.standard_normal((B, T, H, D))
    k = q / np.linalg.norm(q, axis=-1, keepdims=True)
    kw = dict(beta=np.full((B, T, H), 0.5), alpha=np.full((B, T, H), 0.9), num_threads=2)
    o, S = gdn_ext.gated_delta_rule(q, k, q, **kw)
    g = gdn_ext.gated_delta_rule_backward(o, q, k, q, **kw)
    step = gdn_ext.gated_delta_rule_step(q[:, 0], k[:, 0], q[:, 0], beta=kw["beta"][:, 0],
                                         alpha=kw["alpha"][:, 0], state=None, num_threads=2)
    return _core._forked_child(), float(o.sum()), float(g.dq.sum()), float(step.o.sum())


@pytest.mark.skipif(sys.platform == "win32" or not gdn_ext.openmp_enabled(),
                    reason="fork and OpenMP")
def test_fork_after_a_parallel_call():
    """A child forked after the parent ran parallel regions computes (on one thread) the same
    numbers as the parent, instead of hanging."""
    parent = _child_work(0)
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2) as pool:
        got = pool.map_async(_child_work, [0, 0]).get(timeout=60)
    assert not parent[0]
    for child in got:
        assert child[0]
        assert child[1:] == parent[1:]


_FORK_AFTER_TORCH = r"""
import os, signal, sys
import numpy as np
import torch
torch.set_num_threads(2)
x = torch.randn(4_000_000)
for _ in range(3):
    (x * 2).sin().sum()                 # torch's parallel regions: OpenMP's team now exists
assert len(os.listdir("/proc/self/task")) >= 2, "no OpenMP worker threads in the parent"
import gdn_ext                          # imported after torch's parallel work, before the fork
from test_reliability import _child_work as work
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    signal.alarm(60)                    # a hang ends the child instead of the test run
    os.write(write, repr(work(0)).encode())
    os._exit(0)
os.close(write)
got = os.read(read, 4096).decode()
_, status = os.waitpid(pid, 0)
print(status, got, repr(work(0)), sep="\n")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or not gdn_ext.openmp_enabled(),
                    reason="fork, /proc and OpenMP")
def test_fork_after_torch_parallel_work_with_gdn_ext_imported_in_the_parent():
    """The README's fork promise: gdn_ext imported in the parent (here after torch ran parallel
    regions, before the fork) -- a forked child's multi-threaded call completes on one thread
    with the parent's numbers."""
    pytest.importorskip("torch")
    r = run_python(_FORK_AFTER_TORCH, timeout=240)
    assert r.returncode == 0, r.stderr
    status, child, parent = r.stdout.splitlines()[-3:]
    assert status == "0"                # not killed by the alarm
    child, parent = eval(child), eval(parent)
    assert child[0] and not parent[0]   # the child knew it was forked
    assert child[1:] == parent[1:]


# ---- floating-point flags -------------------------------------------------------------------------

@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("where", [(0, 0), (1, 1), (0, 1)])
@pytest.mark.parametrize("backward", [False, True])
def test_overflow_in_any_pair_reaches_errstate(threads, where, backward):
    """B = 2, H = 2 (NumPy calls the inner loop once per batch row): an overflow in any
    (sequence, head) warns once and raises under errstate(over='raise')."""
    rng = np.random.default_rng(5)
    B, T, H, D = 2, 6, 2, 4
    q, k = rng.standard_normal((B, T, H, D)), rng.standard_normal((B, T, H, D))
    v = rng.standard_normal((B, T, H, D))
    v[where[0], :, where[1]] = 1e308
    kw = dict(beta=np.full((B, T, H), 0.5), alpha=np.ones((B, T, H)), num_threads=threads)

    def call():
        if backward:
            return gdn_ext.gated_delta_rule_backward(v, q, k, v, **kw)
        return gdn_ext.gated_delta_rule(q, k, v, **kw)

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        call()
    messages = [str(x.message) for x in w]
    assert any(m.startswith("overflow encountered") for m in messages), messages
    assert all(x.filename == __file__ for x in w), [x.filename for x in w]
    # keys of norm about 2 (beta ||k||^2 above 2, which the value check says) carry v's 1e308 past
    # the largest double
    with pytest.raises(FloatingPointError), warns_unstable(), \
            np.errstate(over="raise", invalid="ignore"):
        call()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("what", ["exp", "cast"])
@pytest.mark.parametrize("mode", ["raise", "ignore", "warn", "call"])
@pytest.mark.parametrize("T", [50, 140_000])
def test_errstate_governs_the_conversions_on_every_thread(threads, what, mode, T):
    """An overflow while the inputs are converted -- exp of a float32 gate g = 100, a Python
    beta too large for float32 -- follows the caller's np.errstate however many threads convert
    (inputs over 2^18 elements, here a gate of 280 000 entries, are converted in pieces on
    helper threads, which do not inherit it: errstate(over="raise") raised nothing, "ignore"
    still warned) and warns at the caller's line, not inside gdn_ext (small inputs too)."""
    rng = np.random.default_rng(7)
    B, H, D = 1, 2, 2
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    kw = dict(beta=np.full((B, T, H), 0.5, np.float32), g=np.full((B, T, H), -0.1, np.float32),
              num_threads=threads, check_values=False)
    if what == "exp":
        kw["g"][0, 5, 0] = 100.0
    else:
        kw["beta"] = 1e300
    calls = []
    with warnings.catch_warnings(record=True) as w, \
            np.errstate(over=mode, invalid="ignore", call=lambda err, flag: calls.append(err)):
        warnings.simplefilter("always")
        if mode == "raise":
            with pytest.raises(FloatingPointError, match=f"overflow encountered in {what}"):
                gdn_ext.gated_delta_rule(q, q, q, **kw)
        else:
            gdn_ext.gated_delta_rule(q, q, q, **kw)
    overflow = [x for x in w if str(x.message).startswith("overflow encountered")]
    if mode == "warn":
        assert [str(x.message) for x in overflow] == [f"overflow encountered in {what}"]
        assert overflow[0].filename == __file__, overflow[0].filename
    else:
        assert overflow == [], [(str(x.message), x.filename) for x in overflow]
    assert calls == (["overflow"] if mode == "call" else [])


@pytest.mark.parametrize("other", ["call", "log", "print", "raise"])
def test_kernel_warnings_at_the_callers_line_whatever_the_other_modes(other, capsys):
    """The kernel's invalid value (from exp(100) = inf in a float32 gate) warns at the caller's
    line while another category is in "call", "log", "print" or "raise" mode (with "call" or
    "log" anywhere it pointed inside gdn_ext); the overflow goes where its own mode says."""
    q = np.full((1, 4, 1, 2), 0.1, np.float32)
    g = np.full((1, 4, 1), -0.1, np.float32)
    g[0, 1] = 100.0
    calls = []

    class Log:
        def write(self, m):
            calls.append(m)

    handler = Log() if other == "log" else lambda err, flag: calls.append(err)
    with warnings.catch_warnings(record=True) as w, \
            np.errstate(over=other, invalid="warn", call=handler):
        warnings.simplefilter("always")
        if other == "raise":
            with pytest.raises(FloatingPointError, match="overflow encountered in exp"):
                gdn_ext.gated_delta_rule(q, q, q, beta=0.5, g=g, check_values=False)
        else:
            gdn_ext.gated_delta_rule(q, q, q, beta=0.5, g=g, check_values=False)
    if other != "raise":
        invalid = [x for x in w if "invalid value" in str(x.message)]
        assert invalid and all(x.filename == __file__ for x in invalid), \
            [(str(x.message), x.filename, x.lineno) for x in w]
    assert len(calls) == (1 if other in ("call", "log") else 0), calls
    if other == "print":
        assert "overflow encountered in exp" in capsys.readouterr().out


# ---- Ctrl-C ---------------------------------------------------------------------------------------

# interrupt(name, call, after): call() with SIGINT ``after`` s after it starts; prints name and
# "interrupted" with the seconds from the signal to the KeyboardInterrupt, or "finished". A line
# "bound S" from the code lowers the latency allowed to S seconds. slack(nbytes): prints
# the longest of three allocations of nbytes, one C call that no design can cut into pieces (under
# AddressSanitizer, whose shadow memory it writes, about 0.5 s for 1.2 GB; here, microseconds)
SIGINT_AFTER = r"""
import os, signal, threading, time
import numpy as np
def interrupt(name, call, after=0.2):
    sent = []
    def fire():
        time.sleep(after)
        sent.append(time.perf_counter())
        os.kill(os.getpid(), signal.SIGINT)
    th = threading.Thread(target=fire)
    th.start()
    try:
        call()
        print(name, "finished")
    except KeyboardInterrupt:
        print(name, "interrupted", time.perf_counter() - sent[0])
    th.join()
def slack(nbytes):
    longest = 0.0
    for _ in range(3):
        t = time.perf_counter()
        np.empty(nbytes, np.uint8)
        longest = max(longest, time.perf_counter() - t)
    print("slack", longest)
"""


def _interrupted_within(code, seconds):
    """Runs SIGINT_AFTER + code in a fresh process: every call it interrupts raised
    KeyboardInterrupt within ``seconds`` of the signal (or the lower bound the code printed), plus
    the slack it printed (one allocation of its largest array, which a sanitizer build makes
    long)."""
    out = run_python(SIGINT_AFTER + code)
    assert out.returncode == 0, out.stderr
    lines = [line.split() for line in out.stdout.splitlines()]
    extra = sum(float(x[1]) for x in lines if x[0] == "slack")
    seconds = min([seconds] + [float(x[1]) for x in lines if x[0] == "bound"])
    calls = [x for x in lines if x[0] not in ("slack", "bound")]
    assert calls, out.stderr
    for name, what, *latency in calls:
        assert what == "interrupted" and float(latency[0]) < seconds + extra, out.stdout


INTERRUPT = SIGINT_AFTER + r"""
import sys
import numpy as np, gdn_ext
T, D = int(sys.argv[1]), 128
rng = np.random.default_rng(0)
q = rng.standard_normal((1, T, 1, D)).astype(np.float32)
k = q / np.linalg.norm(q, axis=-1, keepdims=True)
kw = dict(beta=np.full((1, T, 1), .5, np.float32), alpha=np.full((1, T, 1), .99, np.float32))
short = T // 50
t = time.perf_counter()
gdn_ext.gated_delta_rule(q[:, :short], k[:, :short], q[:, :short], beta=kw["beta"][:, :short],
                         alpha=kw["alpha"][:, :short])
print("estimate", 50 * (time.perf_counter() - t))
interrupt("forward", lambda: gdn_ext.gated_delta_rule(q, k, q, **kw))
interrupt("backward", lambda: gdn_ext.gated_delta_rule_backward(q, q, k, q, **kw))
o, S = gdn_ext.gated_delta_rule(q[:, :64], k[:, :64], q[:, :64], beta=kw["beta"][:, :64],
                                alpha=kw["alpha"][:, :64])
ref, _ = gdn_ext.reference.gated_delta_rule(q[:, :64], k[:, :64], q[:, :64],
                                            beta=kw["beta"][:, :64], alpha=kw["alpha"][:, :64])
print("after", float(np.max(np.abs(o - ref))))
"""


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_stops_long_calls():
    """SIGINT during a forward (about a second of work) and a backward (several): each raises
    KeyboardInterrupt within a fraction of a second of the signal, and the next call is right."""
    out = run_python(INTERRUPT.replace("sys.argv[1]", "1000000"))
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    estimate = float(lines["estimate"])
    for name in ("forward", "backward"):
        what, latency = lines[name].split()
        assert what == "interrupted", out.stdout
        # within a tenth of the call's length of work and well before it would have ended
        assert float(latency) < max(0.5, 0.1 * estimate), out.stdout
    assert float(lines["after"]) < 1e-4


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_stops_the_value_checks():
    """SIGINT while check_values reads a large float16 k (3e6 tokens x 128: one pass over it
    took about a second in one NumPy call, the signal waiting for its end): KeyboardInterrupt
    within 0.5 s (and one allocation of the output), as with check_values=False."""
    _interrupted_within(r"""
import numpy as np, gdn_ext
T, D = 3_000_000, 128
k = np.full((1, T, 1, D), 0.05, np.float16)      # ||k||^2 = 0.32: in range, nothing to warn
kw = dict(beta=np.full((1, T, 1), .5, np.float16), g=np.full((1, T, 1), -.01, np.float16))
gdn_ext.gated_delta_rule(k[:, :8], k[:, :8], k[:, :8], beta=kw["beta"][:, :8], g=kw["g"][:, :8])
slack(T * D * 4)                                 # the float32 output
for check_values in (True, False):
    interrupt(check_values, lambda: gdn_ext.gated_delta_rule(k, k, k, check_values=check_values,
                                                             **kw))
""", 0.5)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_stops_the_torch_casts():
    """SIGINT while gdn_ext.torch casts float32 q, k, v of [1, 600000, 2, 128] to float64 (a
    float64 gate sets the computation's dtype): each .to() was one call the signal waited for
    (0.75-1.5 s); through gdn_ext.torch.gated_delta_rule and the flash-linear-attention drop-in,
    KeyboardInterrupt within a third of one whole .to() (at most 0.5 s) and one allocation of a
    float64 copy (the one step a cast cannot cut: about 0.5 s under AddressSanitizer, where a
    fixed 0.5 s failed with 0.7-0.9 s)."""
    pytest.importorskip("torch")
    _interrupted_within(r"""
import torch, gdn_ext.torch as gt
q = torch.full((1, 600_000, 2, 128), 0.05)                   # float32
beta = torch.full((1, 600_000, 2), 0.5)
g = torch.full((1, 600_000, 2), -0.01, dtype=torch.float64)
# first calls import and register what later calls find ready (torch._dynamo among them)
gt.gated_delta_rule(q[:, :8], q[:, :8], q[:, :8], beta=beta[:, :8], g=g[:, :8])
gt.chunk_gated_delta_rule(q[:, :8], q[:, :8], q[:, :8], g[:, :8], beta[:, :8])
slack(q.numel() * 8)                                          # one float64 copy of q
# the one call a cast was (0.4 s on a fast core): the signal comes early in the first cast, and
# a cast in one piece would hold it for most of that time
t = time.perf_counter()
q.to(torch.float64)
whole = time.perf_counter() - t
print("bound", min(0.5, whole / 3))
interrupt("gdn_ext.torch", lambda: gt.gated_delta_rule(q, q, q, beta=beta, g=g,
                                                       check_values=False), whole / 10)
interrupt("fla", lambda: gt.chunk_gated_delta_rule(q, q, q, g, beta, check_values=False),
          whole / 10)
""", 0.5)


# ---- warnings at the caller's line ----------------------------------------------------------------

def _small(rng, B=1, T=5, H=2, D=3):
    k = rng.standard_normal((B, T, H, D))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)   # unit keys: beta ||k||^2 in range
    return dict(q=rng.standard_normal((B, T, H, D)), k=k,
                v=rng.standard_normal((B, T, H, D)), beta=np.full((B, T, H), 0.5),
                alpha=np.full((B, T, H), 0.9))


@pytest.mark.parametrize("bad,words", [
    (dict(alpha=1.5), "alpha has values outside [0, 1]"),
    (dict(alpha=-0.1), "alpha has values outside [0, 1]"),
    (dict(g=0.2), "g has values above 0"),
    (dict(beta=2.5), "beta has values outside [0, 2]"),
    (dict(beta=-1.0), "beta has values outside [0, 2]")])
@pytest.mark.parametrize("api", ["forward", "backward", "step"])
def test_unusual_values_warn_at_the_callers_line(bad, words, api):
    x = _small(np.random.default_rng(6))
    if "g" in bad:
        x.pop("alpha")
        x["g"] = np.full((1, 5, 2), bad["g"])
    else:
        name, val = next(iter(bad.items()))
        x[name] = np.full_like(x[name], val)

    def call(**extra):
        kw = dict(x)
        q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
        if api == "forward":
            return gdn_ext.gated_delta_rule(q, k, v, **kw, **extra)
        if api == "backward":
            return gdn_ext.gated_delta_rule_backward(v, q, k, v, **kw, **extra)
        kw = {n: a[:, 0] for n, a in kw.items()}
        return gdn_ext.gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], **kw, state=None, **extra)

    # beta = 2.5 with unit keys is also outside the delta rule's stable range: that warning too
    with (warns_unstable() if bad.get("beta", 0) > 2 else contextlib.nullcontext()), \
            pytest.warns(UserWarning, match=words.replace("[", r"\[").replace("]", r"\]")) as w:
        call()
    assert all(r.filename == __file__ for r in w.list)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(check_values=False)


def test_head_first_layout_warns():
    """Head-first arrays [B, H, T, D] (H = 3 heads, T = 8 tokens) passed as [B, T, H, D] read as
    T = 3 < H = 8: a warning says so, at the caller's line; T = 1 (decoding) does not warn."""
    rng = np.random.default_rng(7)
    B, H, T, D = 2, 3, 8, 4
    q = rng.standard_normal((B, H, T, D))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)      # unit keys: only the layout is odd
    gates = np.full((B, H, T), 0.5)
    with pytest.warns(UserWarning, match=r"T = 3 < H = 8: if it is head-first") as w:
        gdn_ext.gated_delta_rule(q, q, q, beta=gates, alpha=gates)
    assert len(w.list) == 1 and w.list[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gdn_ext.gated_delta_rule(q[:, :1], q[:, :1], q[:, :1], beta=gates[:, :1],
                                 alpha=gates[:, :1])


class _GdnDataset:
    """A map-style dataset whose items are computed by gdn_ext with two threads."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return np.float64(_child_work(int(i))[1])


@pytest.mark.skipif(sys.platform == "win32" or not gdn_ext.openmp_enabled(),
                    reason="fork and OpenMP")
def test_torch_dataloader_fork_workers():
    """torch's DataLoader with forked workers calling gdn_ext (num_threads=2) after the parent
    ran a parallel call: the items arrive, equal to the parent's."""
    torch = pytest.importorskip("torch")
    want = [_child_work(i)[1] for i in range(4)]
    loader = torch.utils.data.DataLoader(_GdnDataset(), batch_size=None, num_workers=2,
                                         multiprocessing_context="fork", timeout=60)
    got = [float(x) for x in loader]
    assert got == want
