"""Beyond the design note: per-key gates, grouped value heads, packed sequences (cu_seqlens) and
in-kernel q/k L2 normalisation -- against the reference, finite differences and each other."""
import numpy as np
import pytest

import gdn_ext
from gdn_ext import reference, ufuncs
from helpers import assert_rel_close, central_differences

FIELD = {"q": "dq", "k": "dk", "v": "dv", "beta": "dbeta", "alpha": "dalpha", "g": "dg",
         "initial_state": "d_initial_state"}


def make(rng, B=2, T=12, H=2, HV=None, Dk=4, Dv=3, per_key=False, gate="alpha", cu=None,
         dtype=np.float64, unit_keys=True):
    """Inputs as keyword arguments (q, k, v included), for any combination of the features."""
    HV = H if HV is None else HV
    q = rng.standard_normal((B, T, H, Dk))
    k = rng.standard_normal((B, T, H, Dk))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True) if unit_keys else 0.5 * k
    gate_shape = (B, T, HV, Dk) if per_key else (B, T, HV)
    alpha = rng.uniform(0.5, 1.0, gate_shape)
    n_states = B if cu is None else len(cu) - 1
    inputs = dict(q=q, k=k, v=rng.standard_normal((B, T, HV, Dv)),
                  beta=rng.uniform(0.05, 0.95, (B, T, HV)),
                  initial_state=rng.standard_normal((n_states, HV, Dv, Dk)))
    inputs["alpha" if gate == "alpha" else "g"] = alpha if gate == "alpha" else np.log(alpha)
    return {n: a.astype(dtype) for n, a in inputs.items()}


def run(inputs, backward=False, **kw):
    args = (inputs["q"], inputs["k"], inputs["v"])
    rest = {n: a for n, a in inputs.items() if n not in ("q", "k", "v")}
    if backward:
        rng = np.random.default_rng(1234)
        o, S_T = gdn_ext.gated_delta_rule(*args, **rest, **kw)
        do, dS = rng.standard_normal(o.shape), rng.standard_normal(S_T.shape)
        return gdn_ext.gated_delta_rule_backward(do, *args, **rest, dS_T=dS, **kw), (do, dS)
    return gdn_ext.gated_delta_rule(*args, **rest, **kw)


def run_reference(inputs, cot=None, **kw):
    args = (inputs["q"], inputs["k"], inputs["v"])
    rest = {n: a for n, a in inputs.items() if n not in ("q", "k", "v")}
    if cot is not None:
        return reference.gated_delta_rule_backward(cot[0], *args, **rest, dS_T=cot[1], **kw)
    return reference.gated_delta_rule(*args, **rest, **kw)


CASES = {  # name: (make() keywords, call keywords)
    "per_key": (dict(per_key=True), {}),
    "per_key_g": (dict(per_key=True, gate="g"), {}),
    "grouped": (dict(H=2, HV=6), {}),
    "grouped_per_key": (dict(H=1, HV=3, per_key=True, gate="g"), {}),
    "normalize": (dict(unit_keys=False), dict(normalize_qk=True)),
    "varlen": (dict(B=1, T=20, cu=[0, 1, 8, 8, 20]), dict(cu_seqlens=[0, 1, 8, 8, 20])),
    "everything": (dict(B=1, T=14, H=2, HV=4, per_key=True, gate="g", unit_keys=False,
                        cu=[0, 5, 14]), dict(normalize_qk=True, cu_seqlens=[0, 5, 14])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case):
    mk, kw = CASES[case]
    inputs = make(np.random.default_rng(hash(case) % 2**32), **mk)
    o, S_T = run(inputs, **kw)
    o_ref, S_ref = run_reference(inputs, **kw)
    assert_rel_close(o, o_ref, 1e-12, "o")
    assert_rel_close(S_T, S_ref, 1e-12, "S_T")
    grads, cot = run(inputs, backward=True, **kw)
    want = run_reference(inputs, cot, **kw)
    for name in grads._fields:
        assert getattr(grads, name).shape == getattr(want, name).shape, name
        assert_rel_close(getattr(grads, name), getattr(want, name), 1e-11, name)


@pytest.mark.parametrize("case", list(CASES))
def test_central_finite_differences(case):
    mk, kw = CASES[case]
    mk, kw = dict(mk, T=min(mk.get("T", 6), 6)), dict(kw)
    if "cu" in mk:
        mk["cu"] = kw["cu_seqlens"] = [0, 2, 2, 6]
    inputs = make(np.random.default_rng(7), **dict(mk, B=min(mk.get("B", 2), 2)))
    grads, (do, dS) = run(inputs, backward=True, **kw)

    def loss(x):
        o, S_T = run(x, **kw)
        return np.sum(o * do) + np.sum(S_T * dS)

    for name, num in central_differences(loss, inputs).items():
        assert_rel_close(getattr(grads, FIELD[name]), num, 2e-7, f"{case}: {FIELD[name]}")


@pytest.mark.parametrize("case", list(CASES))
def test_float32_close_to_float64(case):
    mk, kw = CASES[case]
    inputs = make(np.random.default_rng(8), **dict(mk, Dk=16, Dv=16))
    o64, S64 = run(inputs, **kw)
    o32, S32 = run({n: a.astype(np.float32) for n, a in inputs.items()}, **kw)
    assert o32.dtype == np.float32
    assert_rel_close(o32, o64, 1e-5, "o")
    assert_rel_close(S32, S64, 1e-5, "S_T")


def test_per_key_gate_with_equal_channels_is_the_scalar_gate():
    inputs = make(np.random.default_rng(9), T=30)
    per_key = dict(inputs, alpha=np.repeat(inputs["alpha"][..., None], 4, axis=-1))
    o_s, S_s = run(inputs)
    o_k, S_k = run(per_key)
    assert_rel_close(o_k, o_s, 1e-14, "o")
    assert_rel_close(S_k, S_s, 1e-14, "S_T")
    g_s, _ = run(inputs, backward=True)
    g_k, _ = run(per_key, backward=True)
    assert g_k.dalpha.shape == per_key["alpha"].shape
    assert_rel_close(g_k.dalpha.sum(axis=-1), g_s.dalpha, 1e-13, "dalpha")
    for name in ("dq", "dk", "dv", "dbeta", "d_initial_state"):
        assert_rel_close(getattr(g_k, name), getattr(g_s, name), 1e-13, name)


@pytest.mark.parametrize("per_key", [False, True])
def test_grouped_heads_equal_repeated_qk(per_key):
    """HV = 3 H value heads reading q, k head hv // 3 equal the call with q, k repeated."""
    inputs = make(np.random.default_rng(10), H=2, HV=6, per_key=per_key, T=25)
    rep = dict(inputs, q=np.repeat(inputs["q"], 3, axis=2), k=np.repeat(inputs["k"], 3, axis=2))
    o_g, S_g = run(inputs)
    o_r, S_r = run(rep)
    np.testing.assert_array_equal(o_g, o_r)
    np.testing.assert_array_equal(S_g, S_r)
    g_g, cot = run(inputs, backward=True)
    args = (rep["q"], rep["k"], rep["v"])
    g_r = gdn_ext.gated_delta_rule_backward(cot[0], *args, dS_T=cot[1],
                                            **{n: a for n, a in rep.items() if n not in "qkv"})
    assert g_g.dq.shape == inputs["q"].shape
    assert_rel_close(g_g.dq, g_r.dq.reshape(2, 25, 2, 3, 4).sum(axis=3), 1e-14, "dq")
    assert_rel_close(g_g.dk, g_r.dk.reshape(2, 25, 2, 3, 4).sum(axis=3), 1e-14, "dk")
    for name in ("dv", "dbeta", "dalpha", "d_initial_state"):
        np.testing.assert_array_equal(getattr(g_g, name), getattr(g_r, name))


@pytest.mark.parametrize("per_key", [False, True])
@pytest.mark.parametrize("normalize_qk", [False, True])
def test_varlen_equals_separate_calls(per_key, normalize_qk):
    """Lengths 1, 15, 64, 65, 100 in one pack: each sequence as if called alone."""
    lengths = [1, 15, 64, 65, 100]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    inputs = make(np.random.default_rng(11), B=1, T=int(cu[-1]), H=2, HV=4, per_key=per_key,
                  cu=cu, unit_keys=not normalize_qk)
    kw = dict(normalize_qk=normalize_qk)
    o, S_T = run(inputs, cu_seqlens=cu, **kw)
    grads, (do, dS) = run(inputs, backward=True, cu_seqlens=cu, **kw)
    assert S_T.shape == (5, 4, 3, 4) and grads.d_initial_state.shape == (5, 4, 3, 4)
    for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        one = {name: (x[n:n + 1] if name == "initial_state" else x[:, a:b])
               for name, x in inputs.items()}
        o_n, S_n = run(one, **kw)
        np.testing.assert_array_equal(o[:, a:b], o_n)
        np.testing.assert_array_equal(S_T[n:n + 1], S_n)
        args = (one["q"], one["k"], one["v"])
        g_n = gdn_ext.gated_delta_rule_backward(
            do[:, a:b], *args, dS_T=dS[n:n + 1], **kw,
            **{m: x for m, x in one.items() if m not in "qkv"})
        for name in ("dq", "dk", "dv", "dbeta", "dalpha"):
            np.testing.assert_array_equal(getattr(grads, name)[:, a:b], getattr(g_n, name))
        np.testing.assert_array_equal(grads.d_initial_state[n:n + 1], g_n.d_initial_state)


def test_varlen_no_state_leaks_across_a_boundary():
    cu = [0, 10, 30]
    inputs = make(np.random.default_rng(12), B=1, T=30, cu=cu)
    o, _ = run(inputs, cu_seqlens=cu)
    changed = dict(inputs, initial_state=inputs["initial_state"] * np.array([1.0, 5.0])[:, None, None, None])
    o2, _ = run(changed, cu_seqlens=cu)
    np.testing.assert_array_equal(o[:, :10], o2[:, :10])      # sequence 0 untouched
    assert not np.allclose(o[:, 10:], o2[:, 10:])              # sequence 1 changed
    grads, _ = run(inputs, backward=True, cu_seqlens=cu)
    do = np.zeros_like(o)
    do[:, 10:] = 1.0   # a loss on sequence 1 only gives sequence 0 no gradient
    args = (inputs["q"], inputs["k"], inputs["v"])
    g = gdn_ext.gated_delta_rule_backward(do, *args, cu_seqlens=cu,
                                          **{n: a for n, a in inputs.items() if n not in "qkv"})
    assert np.all(g.dq[:, :10] == 0) and np.all(g.d_initial_state[0] == 0)
    assert np.any(g.d_initial_state[1] != 0)


def test_normalize_qk_equals_prenormalised_inputs():
    inputs = make(np.random.default_rng(13), unit_keys=False)
    o, S_T = run(inputs, normalize_qk=True)
    pre = dict(inputs, q=reference.l2norm(inputs["q"]), k=reference.l2norm(inputs["k"]))
    o2, S2 = run(pre)
    assert_rel_close(o, o2, 1e-13, "o")
    assert_rel_close(S_T, S2, 1e-13, "S_T")
    # scale invariance of the normalisation: gradients are orthogonal to q and k
    grads, _ = run(inputs, backward=True, normalize_qk=True)
    assert np.max(np.abs(np.sum(grads.dq * inputs["q"], axis=-1))) < 1e-6 * np.max(np.abs(grads.dq))


@pytest.mark.parametrize("api", ["recurrent", "chunk", "reference"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_normalize_qk_with_one_key_channel_is_accurate(api, dtype):
    """Dk = 1: x^ = x / sqrt(x^2 + eps) is +-1 up to eps, and its gradient eps / n^3 was taken as
    the difference of two nearly equal numbers: relative errors of about the dtype's epsilon
    times n^2 / eps (here |x| up to 9: float64 1e-8, float32 all digits lost). Element by
    element against the chain rule through the same call on pre-normalised inputs."""
    from gdn_ext._constants import L2_EPS
    rng = np.random.default_rng(16)
    B, T, H, Dv = 1, 80, 2, 8
    x = dict(q=rng.standard_normal((B, T, H, 1)) * 3, k=rng.standard_normal((B, T, H, 1)) * 3,
             v=rng.standard_normal((B, T, H, Dv)), beta=rng.uniform(0, 1, (B, T, H)),
             alpha=rng.uniform(0.5, 1, (B, T, H)), do=rng.standard_normal((B, T, H, Dv)))
    x = {n: a.astype(dtype) for n, a in x.items()}
    eps = dtype(L2_EPS)
    norm = {c: np.sqrt(x[c] * x[c] + eps) for c in "qk"}   # as the kernels round it

    def backward(q, k, **kw):
        rest = {n: x[n] for n in ("beta", "alpha")}
        if api == "reference":
            return reference.gated_delta_rule_backward(x["do"], q, k, x["v"], **rest, **kw)
        return gdn_ext.gated_delta_rule_backward(x["do"], q, k, x["v"], **rest, **kw,
                                                 algorithm=api,
                                                 chunk_size=16 if api == "chunk" else None)
    pre = backward(x["q"] / norm["q"], x["k"] / norm["k"])
    got = backward(x["q"], x["k"], normalize_qk=True)
    for c in "qk":
        want = getattr(pre, "d" + c) * (eps / (norm[c] * norm[c])) / norm[c]
        np.testing.assert_allclose(getattr(got, "d" + c), want, rtol=1e-13 if dtype == np.float64
                                   else 1e-5, atol=0, err_msg=f"d{c}")


@pytest.mark.skipif(not gdn_ext.openmp_enabled(), reason="built without OpenMP")
def test_general_path_identical_with_1_and_2_threads():
    cu = [0, 50, 51, 300]
    kw = dict(normalize_qk=True, cu_seqlens=cu)
    inputs = make(np.random.default_rng(14), B=1, T=300, H=2, HV=4, Dk=16, Dv=16, per_key=True,
                  gate="g", unit_keys=False, cu=cu)   # large enough to run in parallel
    one = run(inputs, backward=True, num_threads=1, **kw)[0]
    two = run(inputs, backward=True, num_threads=2, **kw)[0]
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("per_key", [False, True])
def test_step_api_with_grouped_heads_and_per_key_gate(per_key):
    inputs = make(np.random.default_rng(15), H=1, HV=2, per_key=per_key, unit_keys=False, T=9)
    o, S_T = run(inputs, normalize_qk=True)
    state, outs = inputs["initial_state"], []
    for t in range(9):
        o_t, state = gdn_ext.gated_delta_rule_step(
            inputs["q"][:, t], inputs["k"][:, t], inputs["v"][:, t], beta=inputs["beta"][:, t],
            alpha=inputs["alpha"][:, t], state=state, normalize_qk=True)
        outs.append(o_t)
    # the same up to rounding: one step runs on the untransposed state, a long call on S^T
    assert_rel_close(np.stack(outs, axis=1), o, 1e-13, "o")
    assert_rel_close(state, S_T, 1e-13, "S_T")


BAD_CU = [
    ([1, 5, 20], ValueError, "cu_seqlens must start at 0"),
    ([0, 12, 8, 20], ValueError, "cu_seqlens must be non-decreasing"),
    ([0, 5, 21], ValueError, "cu_seqlens must end at T = 20"),
    ([0, 5, 19], ValueError, "cu_seqlens must end at T = 20"),
    (np.array([0.0, 5.0, 20.0]), TypeError, "cu_seqlens must be an integer array"),
    (np.array([[0, 5, 20]]), ValueError, r"cu_seqlens must have shape \[N \+ 1\]"),
]


@pytest.mark.parametrize("cu,exc,msg", BAD_CU)
@pytest.mark.parametrize("backward", [False, True])
def test_bad_cu_seqlens(cu, exc, msg, backward):
    inputs = make(np.random.default_rng(16), B=1, T=20, cu=[0, 5, 20])
    with pytest.raises(exc, match=msg):
        run(inputs, backward=backward, cu_seqlens=cu)


@pytest.mark.parametrize("cu,exc,msg", BAD_CU + [([0, 5, 15, 20], ValueError, "initial_state")])
def test_bad_cu_seqlens_same_error_in_every_front_end(cu, exc, msg):
    """cu_seqlens has one check: the torch function and the flash-linear-attention drop-ins
    raise the NumPy API's error, word for word (the last case: a valid cu_seqlens for 3
    sequences with a state for 2)."""
    torch = pytest.importorskip("torch")
    import gdn_ext.torch as gt
    inputs = make(np.random.default_rng(16), B=1, T=20, cu=[0, 5, 20])
    with pytest.raises(exc, match=msg) as want:
        run(inputs, cu_seqlens=cu)
    t = {n: torch.from_numpy(np.ascontiguousarray(a)) for n, a in inputs.items()
         if n in ("q", "k", "v", "beta", "alpha", "initial_state")}
    with pytest.raises(exc) as got:
        gt.gated_delta_rule(t["q"], t["k"], t["v"], beta=t["beta"], alpha=t["alpha"],
                            initial_state=t["initial_state"], cu_seqlens=cu)
    assert str(got.value) == str(want.value)
    if msg == "initial_state":     # the drop-ins' state is [N, HV, K, V]: their own message
        return
    with pytest.raises(exc) as got:
        gt.chunk_gated_delta_rule(t["q"], t["k"], t["v"], g=t["alpha"].log(), beta=t["beta"],
                                  cu_seqlens=cu if not isinstance(cu, list) else
                                  torch.tensor(cu))
    assert str(got.value) == str(want.value)


def test_other_generalisation_errors():
    inputs = make(np.random.default_rng(17), B=2, T=10, cu=[0, 4, 10])
    with pytest.raises(ValueError, match="cu_seqlens packs sequences along T, so B must be 1"):
        run(inputs, cu_seqlens=[0, 4, 10])
    one = make(np.random.default_rng(17), B=1, T=10)
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N, H, Dv, Dk\] = "
                                         r"\[2, 2, 3, 4\]"):
        run(one, cu_seqlens=[0, 4, 10])
    grouped = make(np.random.default_rng(18), H=2, HV=5)
    with pytest.raises(ValueError, match="HV a multiple of H = 2"):
        run(grouped)
    keyed = make(np.random.default_rng(19), per_key=True)
    with pytest.raises(ValueError, match=r"alpha must have shape \[B, T, H\] = \[2, 12, 2\] "
                                         r"\(one gate per head\) or \[B, T, H, Dk\]"):
        run(dict(keyed, alpha=keyed["alpha"][..., :3]))
    with pytest.raises(TypeError, match="normalize_qk must be a bool"):
        run(keyed, normalize_qk=1)


def test_raw_general_ufunc_checks_cu_seqlens_itself():
    """The C loop refuses a bad cu_seqlens even without the Python layer's checks."""
    rng = np.random.default_rng(20)
    T, Dk, Dv = 10, 3, 2
    q, k = rng.standard_normal((T, Dk)), rng.standard_normal((T, Dk))
    v, a, b = rng.standard_normal((T, Dv)), np.full((T, Dk), 0.9), np.full(T, 0.5)
    S0 = np.zeros((2, Dv, Dk))
    o, S_T = ufuncs.gated_delta_rule_general_fwd(q, k, v, a, b, S0, 1.0, 0.0, np.array([0, 4, 10]))
    assert o.shape == (T, Dv) and S_T.shape == (2, Dv, Dk)
    for cu, msg in (([0, 4, 11], "end at T"), ([0, 6, 4, 10], "one more entry"),
                    ([1, 4, 10], "start at 0")):
        S = np.zeros((len(cu) - 1 if "one more" not in msg else 2, Dv, Dk))
        with pytest.raises(ValueError, match=msg):
            ufuncs.gated_delta_rule_general_fwd(q, k, v, a, b, S, 1.0, 0.0, np.array(cu))
    with pytest.raises(ValueError, match="non-decreasing"):
        ufuncs.gated_delta_rule_general_fwd(q, k, v, a, b, np.zeros((3, Dv, Dk)), 1.0, 0.0,
                                            np.array([0, 6, 4, 10]))


def test_single_head_packed_and_degenerate_heads():
    rng = np.random.default_rng(21)
    q = rng.standard_normal((1, 9, 3))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)   # also the keys: beta ||k||^2 <= 1
    v = rng.standard_normal((1, 9, 2))
    a, b = rng.uniform(0.5, 1, (1, 9)), rng.uniform(0, 1, (1, 9))
    S0 = rng.standard_normal((2, 2, 3))                      # [N, Dv, Dk]
    o, S_T = gdn_ext.gated_delta_rule(q, q, v, beta=b, alpha=a, initial_state=S0,
                                      cu_seqlens=[0, 4, 9])
    assert o.shape == (1, 9, 2) and S_T.shape == (2, 2, 3)
    o_ref, S_ref = reference.gated_delta_rule(q, q, v, beta=b, alpha=a, initial_state=S0,
                                              cu_seqlens=[0, 4, 9])
    assert_rel_close(o, o_ref, 1e-12, "o")
    assert_rel_close(S_T, S_ref, 1e-12, "S_T")
    g = gdn_ext.gated_delta_rule_backward(np.ones_like(o), q, q, v, beta=b, alpha=a,
                                          initial_state=S0, cu_seqlens=[0, 4, 9])
    assert g.d_initial_state.shape == (2, 2, 3) and g.dalpha.shape == (1, 9)
    with pytest.raises(ValueError, match=r"cu_seqlens must have shape \[N \+ 1\] with N >= 1; got \[0\]"):
        gdn_ext.gated_delta_rule(q, q, v, beta=b, alpha=a, cu_seqlens=[])
    z = np.zeros((1, 5, 0, 3))
    o0, S0_T = gdn_ext.gated_delta_rule(z, z, z, beta=z[..., 0], alpha=z[..., 0])
    assert o0.shape == (1, 5, 0, 3) and S0_T.shape == (1, 0, 3, 3)
    with pytest.raises(ValueError, match="q_t must have shape"):
        gdn_ext.gated_delta_rule_step(q[0, 0], q[0, 0], v[0, 0], beta=b[0, :1], alpha=a[0, :1],
                                      state=None)


def test_raw_general_ufunc_with_no_sequences():
    """cu_seqlens = [0]: no sequence at all (the checked API refuses it; the raw ufunc returns
    empty results, forward and backward, instead of crashing)."""
    z = np.zeros
    o, S_T = ufuncs.gated_delta_rule_general_fwd(z((0, 4)), z((0, 4)), z((0, 4)), z((0, 4)), z(0),
                                                 z((0, 4, 4)), 1.0, 0.0, np.array([0]))
    assert o.shape == (0, 4) and S_T.shape == (0, 4, 4)
    o, S_T = ufuncs.gated_delta_rule_general_fwd(z((2, 0, 4)), z((2, 0, 4)), z((2, 0, 4)),
                                                 z((2, 0, 4)), z((2, 0)), z((2, 0, 4, 4)), 1.0, 0.0,
                                                 np.array([0]))
    assert o.shape == (2, 0, 4) and S_T.shape == (2, 0, 4, 4)
    grads = ufuncs.gated_delta_rule_general_bwd(z((0, 4)), z((0, 4)), z((0, 4)), z((0, 4)),
                                                z((0, 4)), z(0), z((0, 4, 4)), z((0, 4, 4)), 1.0,
                                                0.0, np.array([0]))
    assert grads[-1].shape == (0, 4, 4)
