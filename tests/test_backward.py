"""The C backward (BPTT with checkpoints) against the reference and finite differences."""
import numpy as np
import pytest

import gdn_ext
from gdn_ext import reference
from helpers import (assert_rel_close, central_differences, make_inputs, split,
                     split_in_time)

SHAPES = [  # B, T, H, Dk, Dv -- T = 1, a perfect square, and lengths that leave a short last segment
    (1, 1, 1, 4, 4),
    (2, 63, 1, 8, 5),
    (2, 75, 3, 5, 8),
    (1, 500, 2, 16, 12),
    (2, 64, 2, 3, 3),
]


def random_cotangents(rng, inputs):
    """Random dL/do and dL/dS_T for these inputs."""
    return (rng.standard_normal(inputs["v"].shape),
            rng.standard_normal(inputs["initial_state"].shape))


@pytest.mark.parametrize("B,T,H,Dk,Dv", SHAPES)
@pytest.mark.parametrize("gate", ["alpha", "g"])
def test_matches_reference_float64(B, T, H, Dk, Dv, gate):
    rng = np.random.default_rng(10 + T)
    inputs = make_inputs(rng, B, T, H, Dk, Dv, gate=gate)
    do, dS_T = random_cotangents(rng, inputs)
    args, kw = split(inputs)
    got = gdn_ext.gated_delta_rule_backward(do, *args, **kw, dS_T=dS_T, scale=0.6)
    want = reference.gated_delta_rule_backward(do, *args, **kw, dS_T=dS_T, scale=0.6)
    assert type(got) is type(want)
    assert got._fields[4] == ("dalpha" if gate == "alpha" else "dg")
    for name in got._fields:
        g = getattr(got, name)
        assert g.dtype == np.float64
        assert_rel_close(g, getattr(want, name), 1e-11, name)


def _loss(inputs, do, dS_T, scale):
    args, kw = split(inputs)
    o, S_T = gdn_ext.gated_delta_rule(*args, **kw, scale=scale)
    return np.sum(o * do) + np.sum(S_T * dS_T)


@pytest.mark.parametrize("gate", ["alpha", "g"])
@pytest.mark.parametrize("single_head", [False, True])
def test_central_finite_differences(gate, single_head):
    """Every gradient, every element, against (L(x + h) - L(x - h)) / 2h in float64."""
    rng = np.random.default_rng(20)
    inputs = make_inputs(rng, 2, 7, 2, 3, 4, gate=gate, single_head=single_head)
    do, dS_T = random_cotangents(rng, inputs)
    args, kw = split(inputs)
    grads = gdn_ext.gated_delta_rule_backward(do, *args, **kw, dS_T=dS_T, scale=0.8)
    field = {"q": "dq", "k": "dk", "v": "dv", "beta": "dbeta", "alpha": "dalpha", "g": "dg",
             "initial_state": "d_initial_state"}
    numeric = central_differences(lambda x: _loss(x, do, dS_T, 0.8), inputs)
    for name, num in numeric.items():
        assert_rel_close(getattr(grads, field[name]), num, 1e-7, field[name])


@pytest.mark.parametrize("case", ["alpha0", "alpha1", "beta0", "beta1", "g-20", "g-inf"])
def test_edge_gates(case):
    rng = np.random.default_rng(21)
    inputs = make_inputs(rng, 2, 40, 2, 6, 5)
    field, value = {"alpha0": ("alpha", 0.0), "alpha1": ("alpha", 1.0), "beta0": ("beta", 0.0),
                    "beta1": ("beta", 1.0), "g-20": ("g", -20.0), "g-inf": ("g", -np.inf)}[case]
    if field == "g":
        inputs["g"] = np.log(inputs.pop("alpha"))
    inputs[field][:, ::2] = value
    do, dS_T = random_cotangents(rng, inputs)
    args, kw = split(inputs)
    got = gdn_ext.gated_delta_rule_backward(do, *args, **kw, dS_T=dS_T)
    want = reference.gated_delta_rule_backward(do, *args, **kw, dS_T=dS_T)
    for name in got._fields:
        assert np.all(np.isfinite(getattr(got, name))), name
        assert_rel_close(getattr(got, name), getattr(want, name), 1e-11, name)
    if case == "g-inf":  # alpha = 0: the gradient with respect to g is exactly 0 there
        assert np.all(got.dg[:, ::2] == 0)


def test_split_sequence_chains_gradients():
    """Backward of the second half gives d_initial_state, which is dS_T of the first half."""
    rng = np.random.default_rng(22)
    inputs = make_inputs(rng, 2, 75, 2, 5, 4)
    do, dS_T = random_cotangents(rng, inputs)
    args, kw = split(inputs)
    full = gdn_ext.gated_delta_rule_backward(do, *args, **kw, dS_T=dS_T)
    cut = 40
    first, second = split_in_time(inputs, cut)
    a1, k1 = split(first)
    _, S_mid = gdn_ext.gated_delta_rule(*a1, **k1)
    a2, k2 = split(second)
    g2 = gdn_ext.gated_delta_rule_backward(do[:, cut:], *a2, **k2, initial_state=S_mid,
                                           dS_T=dS_T)
    g1 = gdn_ext.gated_delta_rule_backward(do[:, :cut], *a1, **k1, dS_T=g2.d_initial_state)
    for name in ("dq", "dk", "dv", "dbeta", "dalpha"):
        joined = np.concatenate([getattr(g1, name), getattr(g2, name)], axis=1)
        assert_rel_close(joined, getattr(full, name), 1e-12, name)
    assert_rel_close(g1.d_initial_state, full.d_initial_state, 1e-12, "d_initial_state")


def test_float32_gradients_close_to_float64():
    rng = np.random.default_rng(23)
    inputs = make_inputs(rng, 2, 200, 2, 32, 32)
    do, dS_T = random_cotangents(rng, inputs)
    args, kw = split(inputs)
    want = gdn_ext.gated_delta_rule_backward(do, *args, **kw, dS_T=dS_T)
    f32 = {n: a.astype(np.float32) for n, a in inputs.items()}
    a32, k32 = split(f32)
    got = gdn_ext.gated_delta_rule_backward(do.astype(np.float32), *a32, **k32,
                                            dS_T=dS_T.astype(np.float32))
    for name in got._fields:
        assert getattr(got, name).dtype == np.float32
        assert_rel_close(getattr(got, name), getattr(want, name), 2e-5, name)


def test_zero_length_sequence():
    rng = np.random.default_rng(24)
    inputs = make_inputs(rng, 1, 0, 2, 3, 4)
    do, dS_T = random_cotangents(rng, inputs)
    args, kw = split(inputs)
    g = gdn_ext.gated_delta_rule_backward(do, *args, **kw, dS_T=dS_T)
    assert g.dq.shape == (1, 0, 2, 3)
    np.testing.assert_array_equal(g.d_initial_state, dS_T)
