"""The C forward against the NumPy reference loop (the design note's code)."""
import numpy as np
import pytest

import gdn_ext
from gdn_ext import reference
from helpers import assert_rel_close, make_inputs, split, split_in_time

SHAPES = [  # B, T, H, Dk, Dv
    (1, 1, 1, 4, 4),
    (2, 63, 1, 8, 5),
    (2, 75, 3, 5, 8),
    (1, 500, 2, 16, 12),
    (3, 1, 4, 7, 3),
]


@pytest.mark.parametrize("B,T,H,Dk,Dv", SHAPES)
@pytest.mark.parametrize("gate", ["alpha", "g"])
def test_matches_reference_float64(B, T, H, Dk, Dv, gate):
    inputs = make_inputs(np.random.default_rng(T + H), B, T, H, Dk, Dv, gate=gate)
    args, kw = split(inputs)
    o, S_T = gdn_ext.gated_delta_rule(*args, **kw, scale=0.7)
    o_ref, S_ref = reference.gated_delta_rule(*args, **kw, scale=0.7)
    assert o.shape == (B, T, H, Dv) and S_T.shape == (B, H, Dv, Dk)
    assert o.dtype == S_T.dtype == np.float64
    assert_rel_close(o, o_ref, 1e-12, "o")
    assert_rel_close(S_T, S_ref, 1e-12, "S_T")


@pytest.mark.parametrize("T", [1, 63, 75])
@pytest.mark.parametrize("gate_trailing_one", [False, True])
def test_single_head_form(T, gate_trailing_one):
    """q [B, T, Dk], gate [B, T] or [B, T, 1], state [B, Dv, Dk]; answered in the same form."""
    inputs = make_inputs(np.random.default_rng(T), 2, T, Dk=6, Dv=4, single_head=True)
    if gate_trailing_one:
        inputs["alpha"] = inputs["alpha"][..., None]
        inputs["beta"] = inputs["beta"][..., None]
    args, kw = split(inputs)
    o, S_T = gdn_ext.gated_delta_rule(*args, **kw)
    assert o.shape == (2, T, 4) and S_T.shape == (2, 4, 6)
    o_ref, S_ref = reference.gated_delta_rule(*args, **kw)
    assert_rel_close(o, o_ref, 1e-12, "o")
    assert_rel_close(S_T, S_ref, 1e-12, "S_T")
    # the same numbers as the multi-head form with H = 1
    multi = {n: (a[:, :, None] if n != "initial_state" else a[:, None]) for n, a in inputs.items()}
    multi["alpha"] = multi["alpha"].reshape(2, T, 1)
    multi["beta"] = multi["beta"].reshape(2, T, 1)
    args_m, kw_m = split(multi)
    o_m, S_m = gdn_ext.gated_delta_rule(*args_m, **kw_m)
    np.testing.assert_array_equal(o, o_m[:, :, 0])
    np.testing.assert_array_equal(S_T, S_m[:, 0])


def test_float32_close_to_float64_reference():
    inputs = make_inputs(np.random.default_rng(0), 2, 256, 2, 64, 64)
    args, kw = split(inputs)
    o_ref, S_ref = reference.gated_delta_rule(*args, **kw)
    args32, kw32 = split({n: a.astype(np.float32) for n, a in inputs.items()})
    o, S_T = gdn_ext.gated_delta_rule(*args32, **kw32)
    assert o.dtype == S_T.dtype == np.float32
    assert_rel_close(o, o_ref, 1e-5, "o")
    assert_rel_close(S_T, S_ref, 1e-5, "S_T")


def test_no_initial_state_means_zeros():
    inputs = make_inputs(np.random.default_rng(1), 2, 20, 2, 4, 5)
    args, kw = split(inputs)
    S0 = kw.pop("initial_state")
    o, S_T = gdn_ext.gated_delta_rule(*args, **kw)
    o0, S0_T = gdn_ext.gated_delta_rule(*args, **kw, initial_state=np.zeros_like(S0))
    np.testing.assert_array_equal(o, o0)
    np.testing.assert_array_equal(S_T, S0_T)
    assert gdn_ext.gated_delta_rule(*args, **kw, output_final_state=False)[1] is None


@pytest.mark.parametrize("case", ["alpha0", "alpha1", "beta0", "beta1", "g-20", "g-inf"])
def test_edge_gates(case):
    """Regimes real implementations got wrong: alpha exactly 0 and 1, beta 0 and 1, g = -20."""
    inputs = make_inputs(np.random.default_rng(2), 2, 40, 2, 6, 5)
    B, T, H = inputs["beta"].shape
    field, value = {"alpha0": ("alpha", 0.0), "alpha1": ("alpha", 1.0), "beta0": ("beta", 0.0),
                    "beta1": ("beta", 1.0), "g-20": ("g", -20.0), "g-inf": ("g", -np.inf)}[case]
    if field == "g":
        inputs.pop("alpha")
        inputs["g"] = np.full((B, T, H), -0.1)
    # set every other step to the edge value, so that it meets a nonzero state
    inputs[field][:, ::2] = value
    args, kw = split(inputs)
    o, S_T = gdn_ext.gated_delta_rule(*args, **kw)
    o_ref, S_ref = reference.gated_delta_rule(*args, **kw)
    assert np.all(np.isfinite(o))
    assert_rel_close(o, o_ref, 1e-12, "o")
    assert_rel_close(S_T, S_ref, 1e-12, "S_T")
    if case == "beta0":   # with beta = 0 everywhere nothing is written: the state only decays
        a0, kw0 = split(dict(inputs, beta=np.zeros_like(inputs["beta"])))
        _, S0_T = gdn_ext.gated_delta_rule(*a0, **kw0)
        decay = np.prod(inputs["alpha"], axis=1)
        assert_rel_close(S0_T, inputs["initial_state"] * decay[..., None, None], 1e-12)
    if case == "alpha0":  # the last step with alpha = 0 forgets S_0 completely
        inputs2 = dict(inputs, initial_state=inputs["initial_state"] * 7.0)
        a2, kw2 = split(inputs2)
        o2, _ = gdn_ext.gated_delta_rule(*a2, **kw2)
        np.testing.assert_array_equal(o[:, T - 2:], o2[:, T - 2:])


def test_split_sequence_carries_state():
    """One call over T steps equals two calls with the state carried over."""
    inputs = make_inputs(np.random.default_rng(3), 2, 75, 3, 6, 4)
    args, kw = split(inputs)
    o, S_T = gdn_ext.gated_delta_rule(*args, **kw)
    cut = 31
    first, second = split_in_time(inputs, cut)
    a1, k1 = split(first)
    o1, S_mid = gdn_ext.gated_delta_rule(*a1, **k1)
    a2, k2 = split(second)
    o2, S_end = gdn_ext.gated_delta_rule(*a2, **k2, initial_state=S_mid)
    assert_rel_close(np.concatenate([o1, o2], axis=1), o, 1e-13, "o")
    assert_rel_close(S_end, S_T, 1e-13, "S_T")


def test_zero_length_sequence():
    inputs = make_inputs(np.random.default_rng(4), 2, 0, 2, 3, 4)
    args, kw = split(inputs)
    o, S_T = gdn_ext.gated_delta_rule(*args, **kw)
    assert o.shape == (2, 0, 2, 4)
    np.testing.assert_array_equal(S_T, inputs["initial_state"])
