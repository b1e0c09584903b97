"""The design note's layer: against a torch port (outputs and every gradient, float64), token
stepping against the full call, and the parameter container."""
import os

import numpy as np
import pytest

import gdn_ext
from gdn_ext.apps import check
from gdn_ext.layer import GatedDeltaNetParams
from helpers import assert_rel_close, make_inputs, split


def _problem(seed=0, B=2, T=9, D=10, H=3, Dk=4, Dv=5):
    rng = np.random.default_rng(seed)
    params = GatedDeltaNetParams.init(D, Dk, Dv, n_heads=H, seed=seed, dtype=np.float64)
    x = rng.standard_normal((B, T, D))
    S = 0.3 * rng.standard_normal((B, H, Dv, Dk))
    return rng, params, x, S


@pytest.mark.parametrize("normalize_qk", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_layer_matches_torch_port(normalize_qk, with_state):
    if os.environ.get("GDN_EXT_REQUIRE_TORCH") != "1":
        pytest.importorskip("torch")
    rng, params, x, S = _problem(1)
    S = S if with_state else None
    y, S_T = gdn_ext.gated_deltanet_forward(x, S, params, normalize_qk=normalize_qk, scale=0.8)
    dy = rng.standard_normal(y.shape)
    dS_T = rng.standard_normal(S_T.shape)
    S_in = np.zeros_like(S_T) if S is None else S
    want = check.torch_gradients(x, S_in, params, dy, dS_T, normalize_qk, 0.8)

    import torch
    y_t, S_t = check.torch_gated_deltanet_forward(
        torch.tensor(x), torch.tensor(S_in), {n: torch.tensor(a) for n, a in params},
        normalize_qk=normalize_qk, scale=0.8)
    assert_rel_close(y, y_t.numpy(), 1e-12, "y")
    assert_rel_close(S_T, S_t.numpy(), 1e-12, "S_T")

    dx, dS, dparams = gdn_ext.gated_deltanet_backward(dy, x, S, params, dS_T,
                                                      normalize_qk=normalize_qk, scale=0.8)
    assert_rel_close(dx, want["x"], 1e-11, "dx")
    assert_rel_close(dS, want["S"], 1e-11, "dS")
    assert [n for n, _ in dparams] == [n for n, _ in params]
    for name, g in dparams:
        assert g.shape == getattr(params, name).shape
        assert_rel_close(g, want[name], 1e-11, name)


def test_check_command_exits_zero(capsys):
    """python -m gdn_ext check: finite differences (and torch when installed) all within tolerance."""
    from gdn_ext.__main__ import main
    assert main(["check", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "all gradients OK" in out and "Wg_state" in out


def test_check_command_fails_on_a_wrong_gradient(monkeypatch, capsys):
    """The check must be able to fail: break one gradient and it exits non-zero."""
    real = check.layer_gradients

    def broken(*args):
        grads = real(*args)
        grads["Weta"] = grads["Weta"] * 1.001
        return grads

    monkeypatch.setattr(check, "layer_gradients", broken)
    assert check.main(["--no-torch"]) == 1
    assert "GRADIENT CHECK FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("gate", ["alpha", "g"])
@pytest.mark.parametrize("single_head", [False, True])
def test_step_api_matches_full_call(gate, single_head):
    inputs = make_inputs(np.random.default_rng(80), 2, 17, 3, 5, 4, gate=gate,
                         single_head=single_head)
    args, kw = split(inputs)
    o, S_T = gdn_ext.gated_delta_rule(*args, **kw, scale=0.7)
    state = inputs["initial_state"]
    outs = []
    for t in range(17):
        o_t, state = gdn_ext.gated_delta_rule_step(
            inputs["q"][:, t], inputs["k"][:, t], inputs["v"][:, t], beta=inputs["beta"][:, t],
            state=state, scale=0.7, **{gate: inputs[gate][:, t]})
        outs.append(o_t)
    # the same up to rounding: one step runs on the untransposed state, a long call on S^T
    assert_rel_close(np.stack(outs, axis=1), o, 1e-13, "o")
    assert_rel_close(state, S_T, 1e-13, "S_T")


def test_step_api_errors():
    q = np.zeros((2, 3, 4))
    with pytest.raises(ValueError, match=r"q_t must have shape \[B, H, Dk\]"):
        gdn_ext.gated_delta_rule_step(q[None], q[None], q[None], beta=q[..., 0], alpha=q[..., 0],
                                      state=None)
    with pytest.raises(ValueError, match=r"beta must have shape \[B, H\] = \[2, 3\]"):
        gdn_ext.gated_delta_rule_step(q, q, q, beta=q, alpha=q[..., 0], state=None)
    with pytest.raises(ValueError, match=r"state must have shape \[B, H, Dv, Dk\] = \[2, 3, 4, 4\]"):
        gdn_ext.gated_delta_rule_step(q, q, q, beta=q[..., 0], alpha=q[..., 0],
                                      state=np.zeros((2, 4, 4)))
    with pytest.raises(ValueError, match="exactly one of alpha"):
        gdn_ext.gated_delta_rule_step(q, q, q, beta=q[..., 0], state=None)


@pytest.mark.parametrize("normalize_qk", [False, True])
def test_layer_step_matches_forward(normalize_qk):
    _, params, x, S = _problem(2)
    y, S_T = gdn_ext.gated_deltanet_forward(x, S, params, normalize_qk=normalize_qk)
    state, ys = S, []
    for t in range(x.shape[1]):
        y_t, state = gdn_ext.gated_deltanet_step(x[:, t], state, params, normalize_qk=normalize_qk)
        ys.append(y_t)
    assert_rel_close(np.stack(ys, axis=1), y, 1e-14, "y")
    assert_rel_close(state, S_T, 1e-14, "S_T")


def test_design_note_single_head_layer():
    """H = 1 is the design note's literal single-head layer; S may be None (zeros)."""
    rng = np.random.default_rng(3)
    params = GatedDeltaNetParams.init(6, 4, 3, seed=3, dtype=np.float64)
    assert params.n_heads == 1 and params.Wg_state.shape == (6, 1)
    x = rng.standard_normal((2, 5, 6))
    y, S_T = gdn_ext.gated_deltanet_forward(x, None, params)
    y0, S0_T = gdn_ext.gated_deltanet_forward(x, np.zeros((2, 1, 3, 4)), params)
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(S_T, S0_T)
    # the NumPy reference of the recurrence, fed the same projections, gives the same y
    h = gdn_ext.rmsnorm(x, params.norm_weight)
    sig = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    O, _ = gdn_ext.reference.gated_delta_rule(h @ params.Wq, h @ params.Wk, h @ params.Wv,
                                              beta=sig(h @ params.Weta),
                                              alpha=sig(h @ params.Wg_state))
    assert_rel_close(y, x + O @ params.Wo, 1e-12, "y")


def test_params_container():
    p = GatedDeltaNetParams.init(16, 8, 4, n_heads=2, seed=5)
    names = [n for n, _ in p]
    assert names == ["Wq", "Wk", "Wv", "Wg_state", "Weta", "Wo", "norm_weight"]
    shapes = {n: a.shape for n, a in p}
    assert shapes == {"Wq": (16, 16), "Wk": (16, 16), "Wv": (16, 8), "Wg_state": (16, 2),
                      "Weta": (16, 2), "Wo": (8, 16), "norm_weight": (16,)}
    assert all(a.dtype == np.float32 for _, a in p)
    r = repr(p)
    assert "D=16, H=2, Dk=8, Dv=4" in r and "Wo=[8, 16]" in r
    same = GatedDeltaNetParams.init(16, 8, 4, n_heads=2, seed=5)
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(p, same))
    with pytest.raises(ValueError, match="n_heads must be a positive int"):
        GatedDeltaNetParams.init(16, 8, 4, n_heads=0)
    with pytest.raises(ValueError, match="dtype must be float32 or float64"):
        GatedDeltaNetParams.init(16, 8, 4, dtype=np.int32)


def test_layer_errors():
    _, params, x, S = _problem(4)
    with pytest.raises(ValueError, match=r"x must have shape \[B, T, D\] with D = 10"):
        gdn_ext.gated_deltanet_forward(x[..., :9], S, params)
    with pytest.raises(ValueError, match=r"S must have shape \[B, H, Dv, Dk\] = \[2, 3, 5, 4\]"):
        gdn_ext.gated_deltanet_forward(x, S[:, :, :4], params)
    bad = GatedDeltaNetParams(**{**dict(params), "Wk": params.Wk[:, :-1]})
    with pytest.raises(ValueError, match=r"params.Wk must have shape \[D, H\*Dk\] = \[10, 12\]"):
        gdn_ext.gated_deltanet_forward(x, S, bad)
    with pytest.raises(ValueError, match=r"dy must have shape \[B, T, D\]"):
        gdn_ext.gated_deltanet_backward(x[:, :3], x, S, params)


@pytest.mark.parametrize("shape", [(2, 0, 10), (0, 3, 10)])
def test_layer_empty_batch_or_sequence(shape):
    _, params, _, _ = _problem(5)
    x = np.ones(shape)
    y, S_T = gdn_ext.gated_deltanet_forward(x, None, params)
    assert y.shape == shape and S_T.shape == (shape[0], 3, 5, 4)
    dx, dS, dparams = gdn_ext.gated_deltanet_backward(x, x, None, params)
    assert dx.shape == shape and np.all(dparams.Wq == 0)


def test_rmsnorm_does_not_overflow():
    """rmsnorm is scale invariant up to eps: 1e200 * x must not square to inf and give h = 0."""
    _, params, x, S = _problem(6)
    y_big, S_big = gdn_ext.gated_deltanet_forward(x * 1e200, S, params)
    _, S_ref = gdn_ext.gated_deltanet_forward(x * 1e5, S, params)
    assert_rel_close(S_big, S_ref, 1e-12, "S_T")
    assert np.all(np.isfinite(y_big))


def test_params_type_errors():
    import dataclasses
    _, params, x, S = _problem(7)
    with pytest.raises(TypeError, match="params must be a GatedDeltaNetParams; got dict"):
        gdn_ext.gated_deltanet_forward(x, S, dict(params))
    with pytest.raises(TypeError, match="params.Wq must be a NumPy array; got list"):
        gdn_ext.gated_deltanet_forward(x, S, dataclasses.replace(params, Wq=params.Wq.tolist()))
    with pytest.raises(TypeError, match="params.Wo must have a real dtype"):
        gdn_ext.gated_deltanet_backward(x, x, S, dataclasses.replace(params, Wo=params.Wo + 0j))
    assert "inconsistent" in repr(dataclasses.replace(params, Wq=None))
    with pytest.raises(TypeError, match="normalize_qk must be a bool"):
        gdn_ext.gated_deltanet_forward(x, S, params, normalize_qk="no")
    with pytest.raises(ValueError, match=r"x_t must have shape \[B, D\] with D = 10; got \[2, 9\]"):
        gdn_ext.gated_deltanet_step(x[:, 0, :9], S, params)


@pytest.mark.parametrize("normalize_qk", [False, True])
@pytest.mark.parametrize("rule", ["gated_delta", "linear"])
def test_backward_from_the_forwards_cache(normalize_qk, rule, monkeypatch):
    """A training step with the forward's cache runs the recurrence forward once (one _ckpt
    forward, one backward from its checkpoints; no other kernel call) and gives the same
    gradients, bitwise, as the backward that recomputes what it needs."""
    from gdn_ext import recurrence
    from gdn_ext.layer import RULES, LayerCache
    gated, delta_rule = RULES[rule]
    kw = dict(normalize_qk=normalize_qk, scale=0.7, gated=gated, delta_rule=delta_rule)
    rng, params, x, S = _problem(3)
    calls = []
    run = recurrence._call
    monkeypatch.setattr(recurrence, "_call",
                        lambda ufunc, *a: calls.append(ufunc.__name__) or run(ufunc, *a))
    y, S_T, cache = gdn_ext.gated_deltanet_forward(x, S, params, return_cache=True, **kw)
    assert isinstance(cache, LayerCache)
    dy, dS_T = rng.standard_normal(y.shape), rng.standard_normal(S_T.shape)
    got = gdn_ext.gated_deltanet_backward(dy, x, S, params, dS_T, cache=cache, **kw)
    assert [c.endswith("fwd_ckpt") for c in calls] == [True, False]
    assert calls[1].endswith("bwd_ckpt")
    y2, S_T2 = gdn_ext.gated_deltanet_forward(x, S, params, **kw)
    assert np.array_equal(y, y2) and np.array_equal(S_T, S_T2)
    want = gdn_ext.gated_deltanet_backward(dy, x, S, params, dS_T, **kw)
    assert np.array_equal(got.dx, want.dx) and np.array_equal(got.d_initial_state,
                                                             want.d_initial_state)
    for (name, a), (_, b) in zip(got.dparams, want.dparams):
        assert np.array_equal(a, b), name


def test_backward_refuses_a_cache_of_other_inputs():
    _, params, x, S = _problem(4)
    y, _, cache = gdn_ext.gated_deltanet_forward(x, S, params, return_cache=True)
    with pytest.raises(TypeError, match="cache must be the LayerCache"):
        gdn_ext.gated_deltanet_backward(y, x, S, params, cache=tuple(cache))
    with pytest.raises(ValueError, match=r"cache\.h must have shape"):
        gdn_ext.gated_deltanet_backward(y[:, :4], x[:, :4], S, params, cache=cache)
