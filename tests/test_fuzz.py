"""A standing fuzz test (hypothesis, a bounded number of examples so that CI stays fast): random
shapes, strides, dtypes, gate kinds, grouped heads, packing, normalisation and thread counts
against gdn_ext.reference; malformed arguments must raise ValueError or TypeError only."""
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import gdn_ext  # noqa: E402
from gdn_ext import reference  # noqa: E402

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw):
    B = draw(st.integers(1, 2))
    H = draw(st.integers(1, 3))
    G = draw(st.integers(1, 2))
    Dk = draw(st.integers(1, 9))
    Dv = draw(st.integers(1, 9))
    packed = draw(st.booleans())
    if packed:
        lengths = draw(st.lists(st.integers(0, 6), min_size=1, max_size=3))
        B, T = 1, sum(lengths)
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        N = len(lengths)
    else:
        T = draw(st.integers(0, 70))
        cu, N = None, B
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    per_key = draw(st.booleans())
    gate = draw(st.sampled_from(["alpha", "g"]))
    normalize = draw(st.booleans())
    strided = draw(st.booleans())
    threads = draw(st.sampled_from([None, 1, 2, 3]))
    with_state = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(B=B, T=T, H=H, HV=H * G, Dk=Dk, Dv=Dv, cu=cu, N=N, dtype=dtype,
                per_key=per_key, gate=gate, normalize=normalize, strided=strided,
                threads=threads, with_state=with_state, seed=seed)


def _arrays(p):
    rng = np.random.default_rng(p["seed"])
    B, T, H, HV, Dk, Dv = p["B"], p["T"], p["H"], p["HV"], p["Dk"], p["Dv"]

    def make(shape, lo=None, hi=None):
        a = rng.uniform(lo, hi, shape) if lo is not None else rng.standard_normal(shape)
        if p["strided"] and len(shape) > 1:   # a non-contiguous view with the same values
            big = np.zeros(shape[:-1] + (2 * shape[-1],))
            big[..., ::2] = a
            a = big[..., ::2]
        return a.astype(p["dtype"])

    k = make((B, T, H, Dk))
    if not p["normalize"]:
        k = (k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1)).astype(p["dtype"])
    decay = make((B, T, HV, Dk) if p["per_key"] else (B, T, HV), 0.5, 1.0)
    x = dict(q=make((B, T, H, Dk)), k=k, v=make((B, T, HV, Dv)), beta=make((B, T, HV), 0, 1))
    x[p["gate"]] = decay if p["gate"] == "alpha" else np.log(decay)
    if p["with_state"]:
        x["initial_state"] = make((p["N"], HV, Dv, Dk))
    return x


@SETTINGS
@given(problems())
def test_random_problems_match_the_reference(p):
    x = _arrays(p)
    q, k, v = x.pop("q"), x.pop("k"), x.pop("v")
    kw = dict(x, normalize_qk=p["normalize"], cu_seqlens=p["cu"], scale=0.5)
    o, S = gdn_ext.gated_delta_rule(q, k, v, num_threads=p["threads"], check_values=False, **kw)
    o_r, S_r = reference.gated_delta_rule(q, k, v, **kw)
    tol = 1e-4 if p["dtype"] == np.float32 else 1e-10
    np.testing.assert_allclose(o, o_r, rtol=tol, atol=tol)
    np.testing.assert_allclose(S, S_r, rtol=tol, atol=tol)
    do = np.ones_like(o)
    g = gdn_ext.gated_delta_rule_backward(do, q, k, v, num_threads=p["threads"],
                                          check_values=False, **kw)
    g_r = reference.gated_delta_rule_backward(do, q, k, v, **kw)
    for name, a, b in zip(g._fields, g, g_r):
        scale = max(1.0, float(np.max(np.abs(b)))) if b.size else 1.0
        np.testing.assert_allclose(a / scale, b / scale, rtol=10 * tol, atol=10 * tol,
                                   err_msg=name)


BAD_VALUES = [None, 1.0, np.float64(2.0), np.array(3.0), "text", [1, [2, 3]], [[1.0, 2.0]],
              np.zeros((2, 2), complex), np.zeros(0), np.zeros((1, 2, 3, 4, 5)), object(),
              np.ma.masked_array([1.0]), np.zeros((2, 3), np.int8), True, -1, 2**40]


@SETTINGS
@given(problems(), st.sampled_from(["q", "k", "v", "beta", "gate", "initial_state", "scale",
                                    "cu_seqlens", "num_threads", "normalize_qk"]),
       st.sampled_from(BAD_VALUES), st.sampled_from(["forward", "backward", "step"]))
def test_malformed_arguments_raise_value_or_type_errors(p, name, bad, api):
    x = _arrays(p)
    assume(api != "step" or (p["T"] > 0 and p["cu"] is None))
    gate = p["gate"]
    kw = dict(beta=x["beta"], initial_state=x.get("initial_state"), scale=1.0,
              cu_seqlens=p["cu"], num_threads=None, normalize_qk=False)
    kw[gate] = x[gate]
    args = dict(q=x["q"], k=x["k"], v=x["v"])
    target = gate if name == "gate" else name
    if target in args:
        args[target] = bad
    else:
        kw[target] = bad
    try:
        if api == "forward":
            gdn_ext.gated_delta_rule(args["q"], args["k"], args["v"], check_values=False, **kw)
        elif api == "backward":
            gdn_ext.gated_delta_rule_backward(np.ones(np.shape(x["v"])), args["q"], args["k"],
                                              args["v"], check_values=False, **kw)
        else:
            kw.pop("cu_seqlens")
            state = kw.pop("initial_state")
            one = {n: (a[:, 0] if isinstance(a, np.ndarray) and a.ndim >= 2 else a)
                   for n, a in args.items()}
            kw = {n: (a[:, 0] if n in ("beta", gate) and isinstance(a, np.ndarray)
                      and a.ndim >= 2 else a) for n, a in kw.items()}
            gdn_ext.gated_delta_rule_step(one["q"], one["k"], one["v"], state=state,
                                          check_values=False, **kw)
    except (ValueError, TypeError):
        pass
