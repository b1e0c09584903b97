"""The reference loops (gdn_ext.reference, gdn_ext.torch.reference_gated_delta_rule) return what
gdn_ext returns, shape for shape: every gradient in its input's shape (single-head forms
included), and zero heads (H = HV = 0) as empty results, not an error."""
import itertools
import os

import numpy as np
import pytest

import gdn_ext
from gdn_ext import reference

B, T, D = 2, 5, 3


def _both(q, k, v, **kw):
    """(gdn_ext's (o, S_T, grads...), the reference's), float64, upstream gradients of ones."""
    out = []
    for mod in (gdn_ext, reference):
        o, S = mod.gated_delta_rule(q, k, v, **kw)
        grads = mod.gated_delta_rule_backward(np.ones(o.shape), q, k, v, dS_T=np.ones(S.shape),
                                              **kw)
        out.append((o, S) + tuple(grads))
    return out


def _assert_same(ext, ref):
    assert [a.shape for a in ref] == [a.shape for a in ext]
    for a, b in zip(ref, ext):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


SINGLE = list(itertools.product([(B, T), (B, T, 1)], [(B, T), (B, T, 1), (B, T, D)],
                                ["alpha", "g"]))


@pytest.mark.parametrize("beta_shape,gate_shape,gate", SINGLE,
                         ids=[f"beta{list(b)}-{g}{list(a)}" for b, a, g in SINGLE])
def test_single_head_gradients_in_the_inputs_shapes(beta_shape, gate_shape, gate):
    """The single-head form [B, T, D]: beta [B, T] or [B, T, 1], the gate [B, T], [B, T, 1] or
    per key channel [B, T, Dk]; dbeta and the gate's gradient come back in those shapes."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, T, D))
    k = q / np.linalg.norm(q, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, D))
    alpha = rng.uniform(0.5, 1.0, gate_shape)
    kw = dict(beta=rng.uniform(0.1, 0.9, beta_shape),
              initial_state=rng.standard_normal((B, D, D)))
    kw[gate] = alpha if gate == "alpha" else np.log(alpha)
    ext, ref = _both(q, k, v, **kw)
    assert ext[5].shape == beta_shape and ext[6].shape == gate_shape
    _assert_same(ext, ref)


@pytest.mark.parametrize("per_key", [False, True])
@pytest.mark.parametrize("cu_seqlens", [None, [0, 2, 5]])
@pytest.mark.parametrize("gate", ["alpha", "g"])
def test_zero_heads(per_key, cu_seqlens, gate):
    """H = HV = 0: empty outputs and gradients, as gdn_ext gives them."""
    Bn = 1 if cu_seqlens else B
    shape = (Bn, T, 0, D)
    q = np.zeros(shape)
    kw = dict(beta=np.zeros(shape[:3]), cu_seqlens=cu_seqlens)
    kw[gate] = np.full(shape if per_key else shape[:3], 0.5 if gate == "alpha" else -0.5)
    ext, ref = _both(q, q, q, **kw)
    assert ext[1].shape == (Bn if cu_seqlens is None else 2, 0, D, D)
    _assert_same(ext, ref)


def test_torch_reference_zero_heads():
    torch = (__import__("torch") if os.environ.get("GDN_EXT_REQUIRE_TORCH") == "1"
             else pytest.importorskip("torch"))
    import gdn_ext.torch as gt
    results = []
    for fn in (gt.gated_delta_rule, gt.reference_gated_delta_rule):
        q = torch.zeros(B, T, 0, D, dtype=torch.float64, requires_grad=True)
        beta = torch.zeros(B, T, 0, dtype=torch.float64, requires_grad=True)
        g = torch.zeros(B, T, 0, D, dtype=torch.float64, requires_grad=True)
        o, S = fn(q, q, q, beta=beta, g=g, output_final_state=True)
        (o.sum() + S.sum()).backward()
        results.append([o.shape, S.shape, q.grad.shape, beta.grad.shape, g.grad.shape])
    assert results[1] == results[0]
