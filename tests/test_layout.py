"""Threads, strides, dtypes, unmodified inputs, and the raw generalized ufuncs."""
import threading

import numpy as np
import pytest

import gdn_ext
from gdn_ext import ufuncs
from helpers import assert_rel_close, make_inputs, run_python, split


def _run_both(inputs, **extra):
    rng = np.random.default_rng(99)
    args, kw = split(inputs)
    o, S_T = gdn_ext.gated_delta_rule(*args, **kw, **extra)
    do = rng.standard_normal(o.shape)
    dS = rng.standard_normal(S_T.shape)
    grads = gdn_ext.gated_delta_rule_backward(do, *args, **kw, dS_T=dS, **extra)
    return (o, S_T) + tuple(grads)


@pytest.mark.skipif(not gdn_ext.openmp_enabled(), reason="built without OpenMP")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_results_identical_with_1_and_2_threads(dtype):
    # large enough to run in parallel (small calls run serially)
    inputs = make_inputs(np.random.default_rng(40), 3, 200, 3, 16, 12, dtype=dtype)
    one = _run_both(inputs, num_threads=1)
    two = _run_both(inputs, num_threads=2)
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_large_inputs_converted_in_pieces_on_threads(threads):
    """A per-key log gate and float32 inputs of a float64 call, each several pieces long
    (_threads.PIECE elements): exp(g) and the casts run piece by piece on `threads` threads and
    give the bits NumPy gives on the whole array, so the results are those of one thread; run
    5 times per thread count, with a gradient dg = alpha * dalpha cut into pieces as well."""
    from gdn_ext import _threads
    rng = np.random.default_rng(41)
    B, T, H, D = 1, 600, 2, 512   # 600 * 2 * 512 = 2.3 pieces
    assert B * T * H * D > 2 * _threads.PIECE
    q, k, v = (rng.standard_normal((B, T, H, D)).astype(np.float32) for _ in range(3))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = np.log(rng.uniform(0.9, 1.0, (B, T, H, D)))
    beta = rng.uniform(0.1, 0.9, (B, T, H))
    do = rng.standard_normal((B, T, H, D)).astype(np.float32)
    kw = dict(beta=beta, g=g, check_values=False)
    ref_o, _ = gdn_ext.gated_delta_rule(q.astype(np.float64), k.astype(np.float64),
                                        v.astype(np.float64), beta=beta, alpha=np.exp(g),
                                        check_values=False, num_threads=1)
    ref_g = gdn_ext.gated_delta_rule_backward(do, q, k, v, **kw, num_threads=1)
    for _ in range(5):
        o, _ = gdn_ext.gated_delta_rule(q, k, v, **kw, num_threads=threads)
        np.testing.assert_array_equal(o, ref_o)
        grads = gdn_ext.gated_delta_rule_backward(do, q, k, v, **kw, num_threads=threads)
        for a, b in zip(grads, ref_g):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ref_g.dg, np.exp(g) * gdn_ext.gated_delta_rule_backward(
        do, q, k, v, beta=beta, alpha=np.exp(g), check_values=False, num_threads=1).dalpha)


def test_threadpoolctl_limit_is_respected():
    """num_threads=None leaves the count to OpenMP, so threadpoolctl's limit applies."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from gdn_ext import _core
    if not gdn_ext.openmp_enabled():
        assert _core._threads_for(64) == 1
        return
    with threadpoolctl.threadpool_limits(limits=1, user_api="openmp"):
        assert _core._threads_for(64) == 1
    with threadpoolctl.threadpool_limits(limits=2, user_api="openmp"):
        assert _core._threads_for(64) == 2


def _strided_variants(inputs):
    """Same values, other memory layouts: transposed (Fortran order), sliced, reversed."""
    yield "fortran", {n: np.asfortranarray(a) for n, a in inputs.items()}
    big = {n: np.repeat(a, 2, axis=-1) for n, a in inputs.items()}
    yield "sliced", {n: a[..., ::2] for n, a in big.items()}
    # negative strides along time (and heads of the state)
    rev = {n: np.ascontiguousarray(a[:, ::-1])[:, ::-1] for n, a in inputs.items()}
    assert rev["q"].strides[1] < 0
    yield "negative", rev
    flipped = {n: np.ascontiguousarray(np.flip(a, axis=-1))[..., ::-1] for n, a in inputs.items()
               if a.ndim >= 2}
    flipped.update({n: a for n, a in inputs.items() if n not in flipped})
    yield "negative-inner", flipped


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_strided_inputs_match_contiguous(dtype):
    inputs = make_inputs(np.random.default_rng(41), 2, 30, 3, 5, 4, dtype=dtype)
    want = _run_both(inputs)
    for label, variant in _strided_variants(inputs):
        for n in inputs:
            np.testing.assert_array_equal(variant[n], inputs[n])
        got = _run_both(variant)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b, err_msg=label)


def test_inputs_are_never_modified():
    inputs = make_inputs(np.random.default_rng(42), 2, 20, 2, 4, 3)
    before = {n: a.copy() for n, a in inputs.items()}
    for n in inputs:
        inputs[n].flags.writeable = True
    _run_both(inputs)
    inputs_g = dict(inputs)
    inputs_g["g"] = np.log(inputs_g.pop("alpha"))
    before_g = inputs_g["g"].copy()
    _run_both(inputs_g)
    for n, a in before.items():
        np.testing.assert_array_equal(inputs[n], a, err_msg=n)
    np.testing.assert_array_equal(inputs_g["g"], before_g)


@pytest.mark.parametrize("in_dtype,want", [(np.float32, np.float32), (np.float64, np.float64),
                                           (np.float16, np.float32), (np.int64, np.float64)])
def test_dtypes_follow_ufunc_casting(in_dtype, want):
    rng = np.random.default_rng(43)
    inputs = make_inputs(rng, 1, 5, 1, 3, 3)
    cast = {n: (np.round(a * 4).astype(in_dtype) if np.dtype(in_dtype).kind == "i"
                else a.astype(in_dtype)) for n, a in inputs.items()}
    if np.dtype(in_dtype).kind == "i":
        cast["alpha"] = np.ones_like(cast["alpha"])
        cast["beta"] = np.ones_like(cast["beta"])
    args, kw = split(cast)
    kw["check_values"] = False   # integer keys are far from unit norm; the dtypes are the point
    o, S_T = gdn_ext.gated_delta_rule(*args, **kw)
    assert o.dtype == S_T.dtype == want
    as64 = {n: a.astype(np.float64) for n, a in cast.items()}
    a64, k64 = split(as64)
    o64, _ = gdn_ext.gated_delta_rule(*a64, **k64, check_values=False)
    assert_rel_close(o, o64, 1e-5 if want == np.float32 else 1e-15, "o")


def test_mixed_precision_runs_in_float64():
    inputs = make_inputs(np.random.default_rng(44), 1, 5, 2, 3, 3)
    inputs["q"] = inputs["q"].astype(np.float32)
    args, kw = split(inputs)
    o, S_T = gdn_ext.gated_delta_rule(*args, **kw)
    assert o.dtype == np.float64


def _raw_args(inputs, scale=0.5):
    """[B, T, H, D] inputs as the raw ufunc's [B, H, T, D] views."""
    return (inputs["q"].transpose(0, 2, 1, 3), inputs["k"].transpose(0, 2, 1, 3),
            inputs["v"].transpose(0, 2, 1, 3), inputs["alpha"].transpose(0, 2, 1),
            inputs["beta"].transpose(0, 2, 1), inputs["initial_state"], scale)


def test_raw_ufunc_signatures_and_broadcasting():
    assert ufuncs.gated_delta_rule_fwd.signature == "(t,k),(t,k),(t,v),(t),(t),(v,k),()->(t,v),(v,k)"
    assert ufuncs.gated_delta_rule_bwd.nin == 9 and ufuncs.gated_delta_rule_bwd.nout == 6
    inputs = make_inputs(np.random.default_rng(45), 2, 12, 3, 4, 5)
    q, k, v, a, b, S0, _ = _raw_args(inputs)
    # a per-head scale and a state broadcast over the batch
    scale = np.array([0.5, 1.0, 2.0])
    S0_shared = S0[:1]
    o, S_T = ufuncs.gated_delta_rule_fwd(q, k, v, a, b, S0_shared, scale)
    for h in range(3):
        args, kw = split({n: x[:, :, h:h + 1] if n != "initial_state" else
                          np.broadcast_to(S0_shared[:, h:h + 1], (2, 1, 5, 4))
                          for n, x in inputs.items()})
        o_h, S_h = gdn_ext.gated_delta_rule(*args, **kw, scale=scale[h])
        np.testing.assert_array_equal(o[:, h], o_h[:, :, 0])
        np.testing.assert_array_equal(S_T[:, h], S_h[:, 0])


def test_raw_ufunc_axes_and_out():
    inputs = make_inputs(np.random.default_rng(46), 2, 12, 3, 4, 5)
    args, kw = split(inputs)
    o_api, S_api = gdn_ext.gated_delta_rule(*args, **kw, scale=0.5)
    # axes= reads [B, T, H, D] directly: time is axis 1 of q, k, v
    o = np.empty((2, 12, 3, 5))
    S_T = np.empty((2, 3, 5, 4))
    res = ufuncs.gated_delta_rule_fwd(
        inputs["q"], inputs["k"], inputs["v"], inputs["alpha"], inputs["beta"],
        inputs["initial_state"], 0.5, out=(o, S_T),
        axes=[(1, 3), (1, 3), (1, 3), (1,), (1,), (2, 3), (), (1, 3), (2, 3)])
    assert res[0] is o and res[1] is S_T
    np.testing.assert_array_equal(o, o_api)
    np.testing.assert_array_equal(S_T, S_api)


def test_raw_ufunc_output_aliasing_an_input_still_correct():
    """NumPy copies an input that overlaps an output, so even a reversed alias is safe."""
    inputs = make_inputs(np.random.default_rng(47), 2, 12, 3, 4, 4)
    q, k, v, a, b, S0, s = _raw_args(inputs)
    want_o, want_S = ufuncs.gated_delta_rule_fwd(q, k, v, a, b, S0, s)
    qc, S0c = q.copy(), S0.copy()
    o, S_T = ufuncs.gated_delta_rule_fwd(qc, k, v, a, b, S0c, s, out=(qc[:, :, ::-1], S0c))
    np.testing.assert_array_equal(o, want_o)
    np.testing.assert_array_equal(S_T, want_S)
    do = np.ones_like(want_o)
    want = ufuncs.gated_delta_rule_bwd(do, q, k, v, a, b, S0, S0, s)
    kc = k.copy()
    got = ufuncs.gated_delta_rule_bwd(do, q, kc, v, a, b, S0, S0, s,
                                      out=(None, kc[:, ::-1], None, None, None, None))
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x, y)


def test_raw_ufunc_array_ufunc_dispatch():
    seen = []

    class Tracer:
        def __array_ufunc__(self, ufunc, method, *args, **kwargs):
            seen.append((ufunc.__name__, method, len(args)))
            return "dispatched"

    inputs = make_inputs(np.random.default_rng(48), 1, 3, 1, 2, 2)
    q, k, v, a, b, S0, s = _raw_args(inputs)
    assert ufuncs.gated_delta_rule_fwd(Tracer(), k, v, a, b, S0, s) == "dispatched"
    assert seen == [("gated_delta_rule_fwd", "__call__", 7)]


def test_raw_ufunc_rejects_complex():
    inputs = make_inputs(np.random.default_rng(49), 1, 3, 1, 2, 2)
    q, k, v, a, b, S0, s = _raw_args(inputs)
    with pytest.raises(TypeError):
        ufuncs.gated_delta_rule_fwd(q.astype(complex), k, v, a, b, S0, s)


def test_gil_is_released():
    """Another Python thread keeps running while the kernel computes."""
    rng = np.random.default_rng(50)
    inputs = make_inputs(rng, 2, 4000, 2, 32, 32)
    args, kw = split(inputs)
    counter, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            counter[0] += 1

    th = threading.Thread(target=spin)
    th.start()
    try:
        before = counter[0]
        for _ in range(3):
            gdn_ext.gated_delta_rule(*args, **kw)
        during = counter[0] - before
    finally:
        stop.set()
        th.join()
    assert during > 1000


@pytest.mark.parametrize("num_threads", [1, 2])
def test_floating_point_errors_seen_from_any_thread(num_threads):
    """An overflow in the last (sequence, head) -- run by a worker thread when there are two --
    still reaches np.errstate on the calling thread."""
    inputs = make_inputs(np.random.default_rng(51), 4, 200, 2, 16, 16)   # large: runs in parallel
    inputs["alpha"][-1, 2, -1] = np.inf
    args, kw = split(inputs)
    kw["check_values"] = False                 # alpha > 1 on purpose
    with np.errstate(all="ignore"):
        o, _ = gdn_ext.gated_delta_rule(*args, **kw, num_threads=num_threads)
    assert not np.all(np.isfinite(o[-1, :, -1])) and np.all(np.isfinite(o[:-1]))
    with np.errstate(invalid="raise", over="raise"), pytest.raises(FloatingPointError):
        gdn_ext.gated_delta_rule(*args, **kw, num_threads=num_threads)
    with np.errstate(invalid="raise", over="raise"), pytest.raises(FloatingPointError):
        gdn_ext.gated_delta_rule_backward(np.ones_like(o), *args, **kw, num_threads=num_threads)


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
def test_every_instruction_set_matches_the_reference(isa):
    """The kernels are compiled per instruction set and picked at run time; GDN_EXT_ISA selects
    one (if the CPU has it) in a fresh process. Each must agree with the NumPy reference."""
    code = r"""
import sys, numpy as np, gdn_ext
from gdn_ext import reference, _core
sys.path.insert(0, "tests")
from helpers import make_inputs, split, assert_rel_close
for dt, tol in ((np.float64, 1e-12), (np.float32, 2e-5)):
    inputs = make_inputs(np.random.default_rng(1), 2, 37, 3, 12, 10, dtype=dt)
    args, kw = split(inputs)
    o, S = gdn_ext.gated_delta_rule(*args, **kw, normalize_qk=True)
    o_r, S_r = reference.gated_delta_rule(*(a.astype(np.float64) for a in args),
        **{n: a.astype(np.float64) for n, a in kw.items()}, normalize_qk=True)
    assert_rel_close(o, o_r, tol, "o"); assert_rel_close(S, S_r, tol, "S_T")
    do = np.ones_like(o)
    g = gdn_ext.gated_delta_rule_backward(do, *args, **kw, normalize_qk=True)
    g_r = reference.gated_delta_rule_backward(do.astype(np.float64), *(a.astype(np.float64) for a in args),
        **{n: a.astype(np.float64) for n, a in kw.items()}, normalize_qk=True)
    for n in g._fields:
        assert_rel_close(getattr(g, n), getattr(g_r, n), 10 * tol, n)
print(_core.isa())
"""
    env = dict(__import__("os").environ, GDN_EXT_ISA=isa)
    out = run_python(code, env=env)
    assert out.returncode == 0, out.stderr
    used = out.stdout.strip()
    assert used in ("generic", "avx2", "avx512")
    if used != isa:   # the CPU lacks it: the request falls back to what it has
        assert ["generic", "avx2", "avx512"].index(used) < ["generic", "avx2", "avx512"].index(isa)


@pytest.mark.skipif(not gdn_ext.openmp_enabled(), reason="built without OpenMP")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_one_sequence_split_across_threads(dtype):
    """With fewer (sequence, head) pairs than threads, the forward splits each state's value rows
    between threads: the same numbers as one thread, and as the reference."""
    inputs = make_inputs(np.random.default_rng(52), 1, 300, 1, 24, 100, dtype=dtype)
    args, kw = split(inputs)
    o1, S1 = gdn_ext.gated_delta_rule(*args, **kw, num_threads=1)
    o2, S2 = gdn_ext.gated_delta_rule(*args, **kw, num_threads=2)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(S1, S2)
    o_r, S_r = gdn_ext.reference.gated_delta_rule(*(a.astype(np.float64) for a in args),
                                                  **{n: a.astype(np.float64) for n, a in kw.items()})
    tol = 1e-12 if dtype == np.float64 else 2e-5
    assert_rel_close(o1, o_r, tol, "o")
    assert_rel_close(S1, S_r, tol, "S_T")
