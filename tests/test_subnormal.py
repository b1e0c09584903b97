"""Subnormal numbers (README, "Subnormal numbers"): the kernels flush them to zero -- results
smaller than the smallest normal number nu become 0 and such inputs are read as 0 -- so a state
decaying towards zero (a padded batch) costs no more than any other; the difference from IEEE
arithmetic stays of the order of nu; results stay bitwise the same for any thread count; and no
thread is left flushing after a call (the caller's, OpenMP's pool threads shared with torch).
No timing is asserted here: ``python -m gdn_ext bench --padded`` measures the speed."""
import os
import platform

import numpy as np
import pytest

import gdn_ext
from gdn_ext import reference
from helpers import assert_rel_close, run_python

# where the CPU has the modes (MXCSR on x86-64, FPCR on AArch64); elsewhere IEEE subnormals
FLUSHES = platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64")
needs_flush = pytest.mark.skipif(not FLUSHES, reason="no flush-to-zero mode on this CPU")
DTYPES = [np.float32, np.float64]
TOL = {np.float32: 3e-4, np.float64: 1e-11}   # float32: 1000 decaying steps of rounding


def tiny(dtype):
    """nu, the smallest normal number of the dtype."""
    return np.finfo(dtype).tiny


def subnormals(a):
    """How many elements of a are subnormal (nonzero and smaller than nu)."""
    a = np.asarray(a)
    return int(np.count_nonzero((a != 0) & (np.abs(a) < tiny(a.dtype))))


def padded(dtype, B=2, H=2, Dk=16, Dv=12, t0=100, T=1100, seed=0):
    """A right-padded batch: real tokens before t0, then k = v = 0 with q kept (so the outputs read
    the state as it decays) and a scalar gate in [0.3, 0.5], which takes a state of size 1 below
    the smallest subnormal of float64 within the padding. The states, outputs and gradients of an
    IEEE computation end in subnormals."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, Dk))
    k = rng.standard_normal((B, T, H, Dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, H, Dv))
    k[:, t0:] = 0
    v[:, t0:] = 0
    alpha = np.concatenate([rng.uniform(0.5, 1.0, (B, t0, H)),
                            rng.uniform(0.3, 0.5, (B, T - t0, H))], axis=1)
    kw = dict(beta=rng.uniform(0.1, 0.9, (B, T, H)), alpha=alpha,
              initial_state=rng.standard_normal((B, H, Dv, Dk)), scale=Dk ** -0.5)
    cast = lambda a: a.astype(dtype) if isinstance(a, np.ndarray) else a  # noqa: E731
    return tuple(map(cast, (q, k, v))), {n: cast(a) for n, a in kw.items()}, t0


def _f64(args, kw):
    return (tuple(a.astype(np.float64) for a in args),
            {n: a.astype(np.float64) if isinstance(a, np.ndarray) else a for n, a in kw.items()})


@needs_flush
@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_batch_flushes_within_a_bound_of_the_reference(dtype):
    """Outputs and gradients against the reference loop (float64, IEEE, subnormals kept). In the
    padding S_t = P_t S_pre (P_t: the product of the gates since t0, S_pre: the state after the
    real tokens), so o_t = scale P_t S_pre q_t and dq_t = scale P_t S_pre^T do_t; per token the
    kernels' error is at most rtol times that size, plus 2 |scale| (D + ||x_t||_1) nu for the
    numbers flushed (each below nu: D terms of the sum and the state's elements weighted by x_t).
    The kernels' own results hold no subnormal number."""
    args, kw, t0 = padded(dtype)
    o, S = gdn_ext.gated_delta_rule(*args, **kw)
    rng = np.random.default_rng(1)
    do = rng.standard_normal(o.shape).astype(dtype)
    g = gdn_ext.gated_delta_rule_backward(do, *args, **kw)
    rargs, rkw = _f64(args, kw)
    o_r, S_r = reference.gated_delta_rule(*rargs, **rkw)
    g_r = reference.gated_delta_rule_backward(do.astype(np.float64), *rargs, **rkw)
    nu, scale = tiny(dtype), abs(kw["scale"])
    # the reference's own tail does reach the subnormal range of the dtype: flushing happened
    assert np.any((np.abs(o_r[:, t0:]) < nu) & (o_r[:, t0:] != 0))
    assert np.any((np.abs(g_r.dq[:, t0:]) < nu) & (g_r.dq[:, t0:] != 0))

    # before the padding: as on any input
    assert_rel_close(o[:, :t0], o_r[:, :t0], TOL[dtype], "o")
    # the padding: a bound per token (sizes in float64)
    pre = {n: (a[:, :t0] if isinstance(a, np.ndarray) and n != "initial_state" else a)
           for n, a in rkw.items()}
    _, S_pre = reference.gated_delta_rule(*(a[:, :t0] for a in rargs), **pre)
    P = np.cumprod(rkw["alpha"][:, t0:], axis=1)                      # [B, T - t0, H]
    size = np.abs(S_pre).max(axis=(2, 3))[:, None, :] * P * scale      # [B, T - t0, H]
    q_tail, do_tail = rargs[0][:, t0:], do[:, t0:].astype(np.float64)
    Dk, Dv = q_tail.shape[-1], do_tail.shape[-1]
    for name, got, want, x, D in (("o", o, o_r, q_tail, Dk), ("dq", g.dq, g_r.dq, do_tail, Dv)):
        l1 = np.abs(x).sum(axis=-1)                                    # [B, T - t0, H]
        bound = TOL[dtype] * size * l1 + 2 * scale * (D + l1) * nu
        err = np.abs(got[:, t0:].astype(np.float64) - want[:, t0:]).max(axis=-1)
        worst = np.max(err / bound)
        assert worst <= 1, f"{name}: error {worst:.2f} x the bound in the padding"
    # the rest of the results: relative to their scale, as everywhere
    assert_rel_close(S, S_r, TOL[dtype], "S_T")
    for name in g._fields:
        assert_rel_close(getattr(g, name), getattr(g_r, name), 10 * TOL[dtype], name)
    # flushed, so no subnormal number anywhere (IEEE arithmetic leaves them in o, S_T, dq ...)
    assert subnormals(o) == 0 and subnormals(S) == 0
    for name in g._fields:
        assert subnormals(getattr(g, name)) == 0, name
    np.testing.assert_array_equal(S, 0)   # far below the smallest subnormal in exact arithmetic


@pytest.mark.skipif(not gdn_ext.openmp_enabled(), reason="built without OpenMP")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H,Dv,threads", [(2, 2, 12, (1, 2, 3)),
                                            (1, 1, 40, (1, 2, 8))])   # one pair: strips split
def test_padded_batch_identical_for_any_thread_count(dtype, B, H, Dv, threads):
    """Every thread flushes the same way: bit for bit the results of one thread, including the
    backward's one-pair-on-many-threads path (whose calling thread folds the strips' sums)."""
    args, kw, _ = padded(dtype, B=B, H=H, Dv=Dv)
    do = np.random.default_rng(2).standard_normal(args[2].shape).astype(dtype)
    first = None
    for nt in threads:
        o, S = gdn_ext.gated_delta_rule(*args, **kw, num_threads=nt)
        g = gdn_ext.gated_delta_rule_backward(do, *args, **kw, num_threads=nt)
        res = (o, S) + tuple(g)
        if first is None:
            first = res
            continue
        for a, b in zip(first, res):
            np.testing.assert_array_equal(b, a, err_msg=f"{nt} threads")


@needs_flush
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 8])   # the decoding path (T <= 4) and the strips
def test_subnormal_inputs_are_read_as_zero(dtype, T):
    """A state or query made of subnormal numbers is read as 0 by the arithmetic (IEEE would give
    subnormal outputs); normal inputs beside them are used as usual."""
    B, H, Dk, Dv = 1, 2, 8, 4
    nu = tiny(dtype)
    sub = np.full((B, H, Dv, Dk), nu / 4, dtype)
    sub[..., ::2] *= -1
    q = np.ones((B, T, H, Dk), dtype)
    k = np.zeros((B, T, H, Dk), dtype)
    v = np.zeros((B, T, H, Dv), dtype)
    kw = dict(beta=np.full((B, T, H), 0.5, dtype), alpha=np.ones((B, T, H), dtype))
    o, S = gdn_ext.gated_delta_rule(q, k, v, **kw, initial_state=sub)
    np.testing.assert_array_equal(o, 0)
    np.testing.assert_array_equal(S, 0)
    # normal state, subnormal query: the read-out is 0, the state carries on unchanged
    state = np.ones((B, H, Dv, Dk), dtype)
    o, S = gdn_ext.gated_delta_rule(np.full_like(q, nu / 8), k, v, **kw, initial_state=state)
    np.testing.assert_array_equal(o, 0)
    np.testing.assert_array_equal(S, state)


@pytest.mark.skipif(not gdn_ext.openmp_enabled(), reason="built without OpenMP")
def test_no_thread_is_left_flushing():
    """In a fresh process whose first OpenMP threads start inside gdn_ext's calls (a thread
    inherits its creator's modes), after forward and backward calls on 1, 2 and 8 threads (the
    one-pair path too), the calling thread and the OpenMP pool threads, which torch shares, still
    compute subnormal numbers."""
    code = r"""
import sys
import numpy as np
try:
    import torch
except ImportError:
    torch = None
import gdn_ext
sys.path.insert(0, ".")
from test_subnormal import padded
for dt in (np.float32, np.float64):
    for B, H, Dv in ((2, 2, 12), (1, 1, 40)):
        args, kw, _ = padded(dt, B=B, H=H, Dv=Dv)
        for nt in (8, 2, 1):
            o, _ = gdn_ext.gated_delta_rule(*args, **kw, num_threads=nt)
            gdn_ext.gated_delta_rule_backward(np.ones_like(o), *args, **kw, num_threads=nt)
assert np.float32(1e-38) * np.float32(0.01) != 0, "calling thread flushes float32"
assert np.float64(1e-307) * np.float64(0.001) != 0, "calling thread flushes float64"
if torch is not None:
    torch.set_num_threads(8)
    for dt in (torch.float32, torch.float64):
        small = torch.finfo(dt).tiny
        x = torch.full((1 << 20,), small, dtype=dt) * 0.01   # split over the pool's threads
        assert bool((x != 0).all()), f"{int((x == 0).sum())} of {x.numel()} flushed ({dt})"
print("ok", torch is not None)
"""
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "ok"


# ---- GDN_EXT_ISA ----------------------------------------------------------------------------

def _isa_run(value):
    env = {n: v for n, v in os.environ.items() if n != "GDN_EXT_ISA"}
    if value is not None:
        env["GDN_EXT_ISA"] = value
    return run_python("import gdn_ext; print(gdn_ext._core.isa())", env=env)


def test_isa_request_problem_messages():
    from gdn_ext._native import isa_request_problem
    assert isa_request_problem(None, "avx2") is None
    assert isa_request_problem("", "avx2") is None
    assert isa_request_problem("avx2", "avx2") is None
    for bad in ("bogus", "AVX2", " avx2"):
        msg = isa_request_problem(bad, "avx2")
        assert "not one of the allowed values" in msg and "generic, avx2, avx512" in msg
        assert repr(bad) in msg and "'avx2'" in msg
    msg = isa_request_problem("avx512", "avx2")
    assert "not available on this CPU" in msg and "'avx2'" in msg


@pytest.mark.parametrize("value", ["bogus", "AVX2"])
def test_bad_isa_value_is_warned_about(value):
    best = _isa_run(None).stdout.strip()
    out = _isa_run(value)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == best
    assert "RuntimeWarning" in out.stderr and "generic, avx2, avx512" in out.stderr
    assert f"GDN_EXT_ISA={value!r}" in out.stderr and f"use {best!r}" in out.stderr


def test_isa_level_the_cpu_lacks_is_warned_about():
    levels = ["generic", "avx2", "avx512"]
    best = _isa_run(None).stdout.strip()
    if best == levels[-1]:
        pytest.skip("this CPU has every level")
    want = levels[levels.index(best) + 1]
    out = _isa_run(want)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == best
    assert "RuntimeWarning" in out.stderr and "not available on this CPU" in out.stderr


def test_honoured_isa_request_is_silent():
    out = _isa_run("generic")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "generic" and "Warning" not in out.stderr
