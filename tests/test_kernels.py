"""The strip kernels on shapes that exercise their edges: strips of 1, 2 and 4 vector registers
(the count falls as Dk grows), Dv not a multiple of a strip, odd Dk and Dv, T across the forward's
64-token blocks and the backward's checkpoint segments, packed sequences of length 0 and 1,
non-contiguous operands, and 1 or several threads (bitwise the same) -- against the reference.

``check_all()`` runs every case once; the instruction-set test runs it in a fresh process per ISA.
"""
import os

import numpy as np
import pytest

import gdn_ext
from gdn_ext import reference
from helpers import assert_rel_close, run_python

SHAPES = [  # (T, Dk, Dv): one (sequence, head) pair each, so several threads split its strips
    (130, 13, 70),     # odd sizes, Dv not a multiple of a strip, T past two 64-token blocks
    (65, 128, 100),    # 4 zmm registers of floats per strip
    (64, 256, 24),     # 2 registers (a 4-register strip would outgrow L1)
    (9, 512, 20),      # 1 register
    (5, 7, 3),         # a few steps: the untransposed (decoding) path
    (1, 4, 1),
]
TOL = {np.float64: 1e-11, np.float32: 3e-5}


def _inputs(rng, T, Dk, Dv, dtype, per_key, B=1, H=1):
    q = rng.standard_normal((B, T, H, Dk))
    k = rng.standard_normal((B, T, H, Dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    gate = (B, T, H, Dk) if per_key else (B, T, H)
    kw = dict(beta=rng.uniform(0.05, 0.95, (B, T, H)), alpha=rng.uniform(0.5, 1.0, gate),
              initial_state=rng.standard_normal((B, H, Dv, Dk)))
    args = (q, k, rng.standard_normal((B, T, H, Dv)))
    cast = lambda a: a.astype(dtype)  # noqa: E731
    return tuple(map(cast, args)), {n: cast(a) for n, a in kw.items()}


def check_case(T, Dk, Dv, dtype, per_key, normalize_qk, threads=(1, 3)):
    rng = np.random.default_rng(T * 1000 + Dk + Dv)
    args, kw = _inputs(rng, T, Dk, Dv, dtype, per_key)
    o, S = gdn_ext.gated_delta_rule(*args, **kw, normalize_qk=normalize_qk, num_threads=threads[0])
    do = rng.standard_normal(o.shape).astype(dtype)
    dS = rng.standard_normal(S.shape).astype(dtype)
    g = gdn_ext.gated_delta_rule_backward(do, *args, **kw, dS_T=dS, normalize_qk=normalize_qk,
                                          num_threads=threads[0])
    f64 = lambda a: a.astype(np.float64)  # noqa: E731
    ref_args, ref_kw = tuple(map(f64, args)), {n: f64(a) for n, a in kw.items()}
    o_r, S_r = reference.gated_delta_rule(*ref_args, **ref_kw, normalize_qk=normalize_qk)
    g_r = reference.gated_delta_rule_backward(f64(do), *ref_args, **ref_kw, dS_T=f64(dS),
                                              normalize_qk=normalize_qk)
    tol = TOL[dtype]
    assert_rel_close(o, o_r, tol, "o")
    assert_rel_close(S, S_r, tol, "S_T")
    for name in g._fields:
        assert_rel_close(getattr(g, name), getattr(g_r, name), 10 * tol, name)
    for nt in threads[1:]:   # the same numbers, bit for bit, whatever the threads
        o2, S2 = gdn_ext.gated_delta_rule(*args, **kw, normalize_qk=normalize_qk, num_threads=nt)
        g2 = gdn_ext.gated_delta_rule_backward(do, *args, **kw, dS_T=dS,
                                               normalize_qk=normalize_qk, num_threads=nt)
        np.testing.assert_array_equal(o2, o)
        np.testing.assert_array_equal(S2, S)
        for name in g._fields:
            np.testing.assert_array_equal(getattr(g2, name), getattr(g, name), err_msg=name)


def check_all():
    for T, Dk, Dv in SHAPES:
        for dtype in (np.float64, np.float32):
            check_case(T, Dk, Dv, dtype, per_key=Dk % 2 == 0, normalize_qk=Dk % 2 == 1)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("T,Dk,Dv", SHAPES)
@pytest.mark.parametrize("per_key,normalize_qk", [(False, False), (True, True)])
def test_strip_kernels_match_reference(T, Dk, Dv, dtype, per_key, normalize_qk):
    check_case(T, Dk, Dv, dtype, per_key, normalize_qk)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_one_pair_on_many_threads(dtype):
    """One (sequence, head) pair with 8 strips of value rows on 8 threads: the backward runs the
    strips in parallel and folds their sums; the same bits as one thread."""
    check_case(100, 32, 128, dtype, per_key=True, normalize_qk=True, threads=(1, 8))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_packed_sequences_of_length_0_and_1(dtype):
    """Packed sequences of lengths 1, 0, 64, 65 and 1 equal separate calls (bitwise) and the
    reference, with 1 and 3 threads."""
    lens = [1, 0, 64, 65, 1]
    cu = np.concatenate([[0], np.cumsum(lens)])
    T, H, Dk, Dv = int(cu[-1]), 2, 20, 36
    rng = np.random.default_rng(81)
    args, kw = _inputs(rng, T, Dk, Dv, dtype, per_key=True, H=H)
    kw["initial_state"] = rng.standard_normal((len(lens), H, Dv, Dk)).astype(dtype)
    o, S = gdn_ext.gated_delta_rule(*args, **kw, cu_seqlens=cu, num_threads=1)
    do = rng.standard_normal(o.shape).astype(dtype)
    g = gdn_ext.gated_delta_rule_backward(do, *args, **kw, cu_seqlens=cu, num_threads=1)
    g3 = gdn_ext.gated_delta_rule_backward(do, *args, **kw, cu_seqlens=cu, num_threads=3)
    for name in g._fields:
        np.testing.assert_array_equal(getattr(g3, name), getattr(g, name), err_msg=name)
    for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        part = dict(kw, beta=kw["beta"][:, a:b], alpha=kw["alpha"][:, a:b],
                    initial_state=kw["initial_state"][n:n + 1])
        sl = tuple(x[:, a:b] for x in args)
        o_n, S_n = gdn_ext.gated_delta_rule(*sl, **part, num_threads=1)
        np.testing.assert_array_equal(o[:, a:b], o_n)
        np.testing.assert_array_equal(S[n:n + 1], S_n)
        g_n = gdn_ext.gated_delta_rule_backward(do[:, a:b], *sl, **part, num_threads=1)
        np.testing.assert_array_equal(g.dq[:, a:b], g_n.dq)
        np.testing.assert_array_equal(g.d_initial_state[n:n + 1], g_n.d_initial_state)
    f64 = lambda a: a.astype(np.float64)  # noqa: E731
    o_r, _ = reference.gated_delta_rule(*map(f64, args), **{n: f64(a) for n, a in kw.items()},
                                        cu_seqlens=cu)
    assert_rel_close(o, o_r, TOL[dtype], "o")


def test_non_contiguous_operands():
    """Strided views (every other token, heads interleaved, a transposed state) give the numbers
    of their contiguous copies."""
    rng = np.random.default_rng(82)
    T, H, Dk, Dv = 140, 3, 24, 40
    big = {n: rng.standard_normal(s) for n, s in
           dict(q=(1, 2 * T, H, Dk), k=(1, 2 * T, H, Dk), v=(1, 2 * T, H, Dv),
                beta=(1, 2 * T, H), alpha=(1, 2 * T, H)).items()}
    big["k"] /= np.linalg.norm(big["k"], axis=-1, keepdims=True)
    big["beta"] = 1 / (1 + np.exp(-big["beta"]))
    big["alpha"] = 1 / (1 + np.exp(-big["alpha"] - 3))
    views = {n: a[:, ::2] for n, a in big.items()}
    views["initial_state"] = rng.standard_normal((1, H, Dk, Dv)).transpose(0, 1, 3, 2)
    copies = {n: np.ascontiguousarray(a) for n, a in views.items()}
    outs = []
    for inp in (views, copies):
        kw = {n: a for n, a in inp.items() if n not in "qkv"}
        o, S = gdn_ext.gated_delta_rule(inp["q"], inp["k"], inp["v"], **kw)
        g = gdn_ext.gated_delta_rule_backward(np.ones_like(o), inp["q"], inp["k"], inp["v"], **kw)
        outs.append((o, S) + tuple(g))
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
def test_every_instruction_set_on_the_strip_shapes(isa):
    """Each instruction set's build (its own strip width) passes the cases above, in a fresh
    process with GDN_EXT_ISA set."""
    code = "import test_kernels; test_kernels.check_all()"
    out = run_python(code, env=dict(os.environ, GDN_EXT_ISA=isa))
    assert out.returncode == 0, out.stderr[-3000:]


def _step_inputs(rng, Dv, general, B=2, H=2, HV=4, Dk=24, T=5):
    """q, k, v, beta, alpha of T tokens for the step tests (unit keys; a per-key gate when
    general)."""
    q = rng.standard_normal((B, T, H, Dk))
    k = rng.standard_normal((B, T, H, Dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, HV, Dv))
    beta = rng.uniform(0.1, 0.9, (B, T, HV))
    alpha = rng.uniform(0.5, 1, (B, T, HV, Dk) if general else (B, T, HV))
    return q, k, v, beta, alpha


@pytest.mark.parametrize("Dv", [6, 64])           # rows padded (state copied) / written in place
@pytest.mark.parametrize("general", [False, True])  # scalar-gate ufunc / general ufunc
def test_step_inplace_equals_a_new_state(Dv, general):
    """gated_delta_rule_step(inplace=True) writes S_t over the state it reads: the same numbers as
    a new state, over several tokens, on 1 and 3 threads."""
    rng = np.random.default_rng(83)
    q, k, v, beta, alpha = _step_inputs(rng, Dv, general)
    B, T, HV, Dk = v.shape[0], v.shape[1], v.shape[2], q.shape[3]
    S0 = rng.standard_normal((B, HV, Dv, Dk))
    for nt in (1, 3):
        S_new, S_in = S0.copy(), S0.copy()
        for t in range(T):
            kw = dict(beta=beta[:, t], alpha=alpha[:, t], normalize_qk=general, num_threads=nt)
            o1, S_new = gdn_ext.gated_delta_rule_step(q[:, t], k[:, t], v[:, t], state=S_new, **kw)
            o2, S_ret = gdn_ext.gated_delta_rule_step(q[:, t], k[:, t], v[:, t], state=S_in,
                                                      inplace=True, **kw)
            assert S_ret is S_in
            np.testing.assert_array_equal(o2, o1)
            np.testing.assert_array_equal(S_in, S_new)


def test_step_inplace_errors():
    q = np.ones((1, 2, 4))
    kw = dict(beta=np.full((1, 2), 0.5), alpha=np.full((1, 2), 0.9), inplace=True)
    S = np.zeros((1, 2, 4, 4))
    with pytest.raises(ValueError, match="inplace=True needs state to be an ndarray"):
        gdn_ext.gated_delta_rule_step(q, q, q, state=None, **kw)
    with pytest.raises(ValueError, match="float64 array"):
        gdn_ext.gated_delta_rule_step(q, q, q, state=S.astype(np.float32).astype(np.float16),
                                      **kw)
    ro = S.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        gdn_ext.gated_delta_rule_step(q, q, q, state=ro, **kw)
    with pytest.raises(ValueError, match="not C-contiguous"):
        gdn_ext.gated_delta_rule_step(q, q, q, state=S.transpose(0, 1, 3, 2), **kw)
    with pytest.raises(TypeError, match="inplace must be a bool"):
        gdn_ext.gated_delta_rule_step(q, q, q, state=S, **dict(kw, inplace="yes"))
    np.testing.assert_array_equal(S, 0)


@pytest.mark.parametrize("Dv", [6, 64])
@pytest.mark.parametrize("general", [False, True])
def test_step_out_double_buffered(Dv, general):
    """gated_delta_rule_step(state=a, out=b) writes S_t into b and leaves a as it was: two buffers
    used in turn give the numbers of new states, token after token, on 1 and 3 threads; the
    first token may start from state=None; out=state is the in-place step."""
    rng = np.random.default_rng(84)
    q, k, v, beta, alpha = _step_inputs(rng, Dv, general)
    B, T, HV, Dk = v.shape[0], v.shape[1], v.shape[2], q.shape[3]
    for nt in (1, 3):
        S_new = None
        bufs = [np.full((B, HV, Dv, Dk), np.nan), np.full((B, HV, Dv, Dk), np.nan)]
        cur = None
        for t in range(T):
            kw = dict(beta=beta[:, t], alpha=alpha[:, t], normalize_qk=general, num_threads=nt)
            o1, S_new = gdn_ext.gated_delta_rule_step(q[:, t], k[:, t], v[:, t], state=S_new, **kw)
            out = bufs[t % 2]
            before = None if cur is None else cur.copy()
            o2, S_ret = gdn_ext.gated_delta_rule_step(q[:, t], k[:, t], v[:, t], state=cur,
                                                      out=out, **kw)
            assert S_ret is out
            np.testing.assert_array_equal(o2, o1)
            np.testing.assert_array_equal(out, S_new)
            if before is not None:
                np.testing.assert_array_equal(cur, before)
            cur = out
        S = S_new.copy()
        o3, S_ret = gdn_ext.gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], state=S, out=S,
                                                  beta=beta[:, 0], alpha=alpha[:, 0],
                                                  normalize_qk=general, num_threads=nt)
        o4, S_ref = gdn_ext.gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], state=S_new,
                                                  beta=beta[:, 0], alpha=alpha[:, 0],
                                                  normalize_qk=general, num_threads=nt)
        assert S_ret is S
        np.testing.assert_array_equal(o3, o4)
        np.testing.assert_array_equal(S, S_ref)


def test_step_out_errors():
    q = np.ones((1, 2, 4))
    kw = dict(beta=np.full((1, 2), 0.5), alpha=np.full((1, 2), 0.9))
    S = np.zeros((1, 2, 4, 4))
    with pytest.raises(ValueError, match=r"out must have shape \[B, H, Dv, Dk\] = \[1, 2, 4, 4\]"):
        gdn_ext.gated_delta_rule_step(q, q, q, state=S, out=np.zeros((1, 2, 4, 5)), **kw)
    with pytest.raises(ValueError, match="out must be an ndarray"):
        gdn_ext.gated_delta_rule_step(q, q, q, state=S, out=[[0.0]], **kw)
    with pytest.raises(ValueError, match="float64 array"):
        gdn_ext.gated_delta_rule_step(q, q, q, state=S, out=np.zeros((1, 2, 4, 4), np.float32),
                                      **kw)
    ro = np.zeros_like(S)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        gdn_ext.gated_delta_rule_step(q, q, q, state=S, out=ro, **kw)
    with pytest.raises(ValueError, match="not C-contiguous"):
        gdn_ext.gated_delta_rule_step(q, q, q, state=S,
                                      out=np.zeros((1, 2, 4, 4)).transpose(0, 1, 3, 2), **kw)
    with pytest.raises(ValueError, match="either inplace=True or out="):
        gdn_ext.gated_delta_rule_step(q, q, q, state=S, out=np.zeros_like(S), inplace=True, **kw)
    np.testing.assert_array_equal(S, 0)


def test_step_out_overlapping_an_input():
    """An out= that half overlaps the state it reads, or that holds q_t: the input is read as it
    was before the step (copied first), so the result is that of separate arrays."""
    rng = np.random.default_rng(85)
    kw = dict(beta=np.full((1, 2), 0.5), alpha=np.full((1, 2), 0.9), check_values=False)
    q, k, v = (rng.standard_normal((1, 2, 4)) for _ in range(3))
    flat = rng.standard_normal(48)   # two states, half on top of each other
    state, out = flat[:32].reshape(1, 2, 4, 4), flat[16:48].reshape(1, 2, 4, 4)
    o_ref, S_ref = gdn_ext.gated_delta_rule_step(q, k, v, state=state.copy(), **kw)
    o, S = gdn_ext.gated_delta_rule_step(q, k, v, state=state, out=out, **kw)
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(out, S_ref)
    buf = np.zeros((1, 2, 4, 4))
    buf[:, :, 0] = q
    o_ref, S_ref = gdn_ext.gated_delta_rule_step(q, k, v, state=np.ones((1, 2, 4, 4)), **kw)
    o, S = gdn_ext.gated_delta_rule_step(buf[:, :, 0], k, v, state=np.ones((1, 2, 4, 4)),
                                         out=buf, **kw)
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(buf, S_ref)


@pytest.mark.parametrize("user", [None, "ACTIVE"])
def test_wait_policy_set_for_the_extension_only(user):
    """Importing gdn_ext asks its OpenMP runtime for passive waiting unless the user chose a
    policy, and leaves the environment as it found it (torch's runtime keeps its defaults)."""
    env = {n: v for n, v in os.environ.items() if n not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if user:
        env["OMP_WAIT_POLICY"] = user
    code = "import os, gdn_ext; print(os.environ.get('OMP_WAIT_POLICY'))"
    out = run_python(code, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(user)


HANDOVER_CASES = {   # name: (inputs' shape and gate, call keywords)
    "scalar gate": (dict(T=130), {}),
    "per-key gate, q/k norm": (dict(T=70, per_key=True), dict(normalize_qk=True)),
    "grouped heads": (dict(T=65, H=1, HV=3), {}),
    "packed, lengths 0 and 1": (dict(T=68, B=1), dict(cu_seqlens=[0, 1, 1, 67, 68])),
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", sorted(HANDOVER_CASES))
def test_forward_hands_its_checkpoints_to_the_backward(case, dtype):
    """gated_delta_rule(return_checkpoints=True) then gated_delta_rule_backward(checkpoints=):
    the same gradients, bit for bit, as the recurrent backward's own checkpoint pass, on 1 and 3
    threads (the checkpoints are the recurrence's: "auto" runs the recurrence with them)."""
    shape, kw = HANDOVER_CASES[case]
    T, B, H = shape["T"], shape.get("B", 2), shape.get("H", 2)
    HV, Dk, Dv = shape.get("HV", H), 20, 36
    rng = np.random.default_rng(84)
    q = rng.standard_normal((B, T, H, Dk)).astype(dtype)
    k = rng.standard_normal((B, T, H, Dk))
    k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
    v = rng.standard_normal((B, T, HV, Dv)).astype(dtype)
    gate = rng.uniform(0.5, 1, (B, T, HV, Dk) if shape.get("per_key") else (B, T, HV))
    nstates = len(kw["cu_seqlens"]) - 1 if "cu_seqlens" in kw else B
    S0 = rng.standard_normal((nstates, HV, Dv, Dk)).astype(dtype)
    common = dict(beta=rng.uniform(0.1, 0.9, (B, T, HV)).astype(dtype), g=np.log(gate).astype(dtype),
                  initial_state=S0, **kw)
    for nt in (1, 3):
        o, S, ck = gdn_ext.gated_delta_rule(q, k, v, **common, num_threads=nt,
                                            return_checkpoints=True)
        o2, S2 = gdn_ext.gated_delta_rule(q, k, v, **common, num_threads=nt,
                                          algorithm="recurrent")
        np.testing.assert_array_equal(o, o2)
        np.testing.assert_array_equal(S, S2)
        longest = max(np.diff(kw["cu_seqlens"])) if "cu_seqlens" in kw else T
        assert ck.shape == S0.shape[:-2] + (gdn_ext.checkpoint_count(longest), Dv, Dk)
        do = rng.standard_normal(o.shape).astype(dtype)
        dS = rng.standard_normal(S.shape).astype(dtype)
        own = gdn_ext.gated_delta_rule_backward(do, q, k, v, **common, dS_T=dS, num_threads=nt,
                                                algorithm="recurrent")
        handed = gdn_ext.gated_delta_rule_backward(do, q, k, v, **common, dS_T=dS,
                                                   num_threads=nt, checkpoints=ck,
                                                   algorithm="auto")
        for name, a, b in zip(own._fields, own, handed):
            np.testing.assert_array_equal(b, a, err_msg=name)


def test_checkpoints_that_do_not_fit_are_refused():
    rng = np.random.default_rng(85)
    q = rng.standard_normal((1, 50, 2, 8))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)   # also the keys: beta ||k||^2 <= 1
    kw = dict(beta=np.full((1, 50, 2), 0.5), alpha=np.full((1, 50, 2), 0.9))
    S0 = rng.standard_normal((1, 2, 8, 8))
    _, _, ck = gdn_ext.gated_delta_rule(q, q, q, **kw, initial_state=S0, return_checkpoints=True)
    do = np.ones((1, 50, 2, 8))
    with pytest.raises(ValueError, match=r"checkpoints must have shape .*NCK, Dv, Dk\] .* = \[1, 2, 7, 8, 8\]"):
        gdn_ext.gated_delta_rule_backward(do, q, q, q, **kw, initial_state=S0,
                                          checkpoints=ck[:, :, :-1])
    with pytest.raises(ValueError, match="do not start from initial_state"):
        gdn_ext.gated_delta_rule_backward(do, q, q, q, **kw, initial_state=S0 + 1, checkpoints=ck)
    with pytest.raises(ValueError, match="do not start from initial_state"):
        gdn_ext.gated_delta_rule_backward(do, q, q, q, **kw, checkpoints=ck)   # S0 = zeros
    with pytest.raises(TypeError, match="return_checkpoints must be a bool"):
        gdn_ext.gated_delta_rule(q, q, q, **kw, return_checkpoints=1)
    # the raw ufunc checks the count too
    U = gdn_ext._core
    qv = q.transpose(0, 2, 1, 3)
    few = np.zeros((1, 2, 3, 8, 8))
    with pytest.raises(ValueError, match="checkpoints: need 7 along their axis c"):
        U.gated_delta_rule_fwd_ckpt(qv, qv, qv, np.full((1, 2, 50), 0.9), np.full((1, 2, 50), 0.5),
                                    S0, 1.0, out=(np.empty((1, 2, 50, 8)), np.empty_like(S0), few))


def test_busy_machine_cap_rule():
    """Default calls use fewer threads after calls whose threads arrived late (their cores ran
    other work): as many as arrived on time; they grow back once the threads arrive on time. Waking
    delays under GDN_LATE_S (0.5 ms), a straggler or two in a team (a virtual CPU slow to wake:
    on an idle 16-vCPU VM the last of 16 threads started 3-7 ms late while 8 threads started
    within 0.2 ms) and explicit thread counts are left alone."""
    cap = gdn_ext._core._busy_cap
    procs = os.cpu_count()
    if cap() != 0:                                   # an earlier test left a cap: let it go
        for _ in range(10):
            cap(max(cap(), 2), 0.0, 1.0)
    assert cap() == 0
    assert cap(16, 0.0004, 0.001, 0) == 0            # late but within an idle thread's wake-up
    assert cap(16, 0.005, 0.010, 1) == 0             # one straggler: not a busy machine
    assert cap(16, 0.005, 0.010, 4) == 0             # a quarter of the team: not yet
    assert cap(16, 0.002, 0.004, 8) == 8             # half the team late: the 8 on time
    assert cap(8, 0.01, 0.02, 3) == 5
    assert cap(2, 0.01, 0.02, 1) == 1                # two cores, one busy: one thread
    assert cap(2, 0.0, 0.1, 0) == (0 if 2 >= procs else 2)
    while cap() != 0:
        cap(max(cap(), 2), 0.0, 0.1, 0)
    assert cap(16, 0.01, 0.02) == 1                  # n_late left out: all of them
    assert cap(4, 0.01, 0.1, 4) == 1                 # neither late nor on time: keep
    grown = cap(4, 0.0, 0.1, 0)                      # on time at the cap: double (0 = no cap)
    assert grown == (0 if 2 >= procs else 2)
    while cap() != 0:
        cap(max(cap(), 2), 0.0, 0.1, 0)
    assert gdn_ext._core._threads_for(1 << 20) >= 1  # explicit requests bypass the cap entirely


def test_busy_machine_cap_ignores_oversubscribed_calls():
    """A call asked to run more threads than there are processors waits for them by
    construction: it must not lower the cap on default threads (before, a num_threads=16 call on 2
    cores left default calls capped; 5 calls here)."""
    cap = gdn_ext._core._busy_cap
    while cap() != 0:
        cap(max(cap(), 2), 0.0, 0.1, 0)
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 512, 8, 64)).astype(np.float32)
    kw = dict(beta=np.full((2, 512, 8), 0.5, np.float32), g=np.full((2, 512, 8), -0.1, np.float32))
    for _ in range(5):
        gdn_ext.gated_delta_rule(q, q, q, **kw, normalize_qk=True, num_threads=2 * os.cpu_count())
        assert cap() == 0


def test_checkpoints_edge_cases():
    """A NaN in the initial state propagates as without checkpoints; T = 0 has none; a dtype other
    than the computation's is refused (a cast would not give the forward's states)."""
    rng = np.random.default_rng(86)
    q = rng.standard_normal((1, 20, 1, 4))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)   # also the keys: beta ||k||^2 <= 1
    kw = dict(beta=np.full((1, 20, 1), 0.5), alpha=np.full((1, 20, 1), 0.9))
    S0 = rng.standard_normal((1, 1, 4, 4))
    S0[0, 0, 0, 0] = np.nan
    o, _, ck = gdn_ext.gated_delta_rule(q, q, q, **kw, initial_state=S0, return_checkpoints=True)
    with np.errstate(invalid="ignore"):
        own = gdn_ext.gated_delta_rule_backward(np.ones_like(o), q, q, q, **kw, initial_state=S0)
        handed = gdn_ext.gated_delta_rule_backward(np.ones_like(o), q, q, q, **kw,
                                                   initial_state=S0, checkpoints=ck)
    for a, b in zip(own, handed):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match="checkpoints must have the computation's dtype float64"):
        gdn_ext.gated_delta_rule_backward(np.ones_like(o), q, q, q, **kw, initial_state=S0,
                                          checkpoints=ck.astype(np.float32))
    z = np.zeros((1, 0, 1, 4))
    zkw = dict(beta=np.zeros((1, 0, 1)), alpha=np.zeros((1, 0, 1)))
    o, S, ck = gdn_ext.gated_delta_rule(z, z, z, **zkw, return_checkpoints=True)
    assert ck.shape == (1, 1, 0, 4, 4)
    g = gdn_ext.gated_delta_rule_backward(z, z, z, z, **zkw, checkpoints=ck)
    np.testing.assert_array_equal(g.d_initial_state, 0)


@pytest.mark.parametrize("per_key", [False, True])
def test_no_value_rows_gives_zero_gradients(per_key):
    """Dv = 0: nothing is read out, so every gradient is exactly zero (not uninitialised memory)."""
    rng = np.random.default_rng(87)
    q = rng.standard_normal((1, 70, 2, 4))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)   # also the keys: beta ||k||^2 <= 1
    v = np.zeros((1, 70, 2, 0))
    a = rng.uniform(0.5, 1, (1, 70, 2, 4) if per_key else (1, 70, 2))
    for nt in (1, 3):
        g = gdn_ext.gated_delta_rule_backward(v, q, q, v, beta=np.full((1, 70, 2), 0.5), alpha=a,
                                              num_threads=nt)
        for name, x in zip(g._fields, g):
            np.testing.assert_array_equal(x, 0, err_msg=name)
