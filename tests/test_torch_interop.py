"""gdn_ext.torch: the autograd Function (gradcheck), the torch reference, and the
flash-linear-attention drop-ins against transformers' pure-torch fallbacks for Qwen3-Next."""
import contextlib
import os
import types
from unittest import mock

import numpy as np
import pytest

if os.environ.get("GDN_EXT_REQUIRE_TORCH") == "1":
    import torch
else:
    torch = pytest.importorskip("torch")

import gdn_ext  # noqa: E402
import gdn_ext.torch as gt  # noqa: E402


def _inputs(seed, B=2, T=7, H=2, HV=None, Dk=3, Dv=4, per_key=False, gate="alpha", cu=None,
            dtype=torch.float64, unit_keys=True):
    g = torch.Generator().manual_seed(seed)
    HV = H if HV is None else HV

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    k = rand(B, T, H, Dk)
    k = torch.nn.functional.normalize(k, dim=-1) if unit_keys else k
    alpha = 0.5 + 0.5 * torch.rand(*((B, T, HV, Dk) if per_key else (B, T, HV)), generator=g,
                                   dtype=dtype)
    n = B if cu is None else len(cu) - 1
    out = dict(q=rand(B, T, H, Dk), k=k, v=rand(B, T, HV, Dv),
               beta=torch.rand(B, T, HV, generator=g, dtype=dtype),
               initial_state=rand(n, HV, Dv, Dk))
    out[gate] = alpha if gate == "alpha" else alpha.log()
    return out


GRADCHECK_CASES = {
    "alpha": ({}, {}),
    "g": (dict(gate="g"), {}),
    "per_key": (dict(per_key=True, gate="g"), {}),
    "grouped": (dict(H=1, HV=2), {}),
    "normalize": (dict(unit_keys=False), dict(normalize_qk=True)),
    "varlen": (dict(B=1, T=8, cu=[0, 3, 3, 8]), dict(cu_seqlens=[0, 3, 3, 8])),
}


@pytest.mark.parametrize("case", list(GRADCHECK_CASES))
def test_gradcheck_every_input(case):
    mk, kw = GRADCHECK_CASES[case]
    inputs = _inputs(1, **mk)
    names = list(inputs)
    leaves = [inputs[n].clone().requires_grad_() for n in names]

    def fn(*xs):
        d = dict(zip(names, xs))
        return gt.gated_delta_rule(d.pop("q"), d.pop("k"), d.pop("v"), scale=0.8, **d, **kw)

    assert torch.autograd.gradcheck(fn, leaves)


def test_matches_the_torch_reference_and_numpy():
    inputs = _inputs(2, H=2, HV=4, per_key=True, gate="g", unit_keys=False, T=9)
    leaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}
    refs = {n: t.clone().requires_grad_() for n, t in inputs.items()}
    o, S = gt.gated_delta_rule(**leaves, normalize_qk=True, scale=0.6)
    o_r, S_r = gt.reference_gated_delta_rule(**refs, normalize_qk=True, scale=0.6)
    torch.testing.assert_close(o, o_r, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(S, S_r, rtol=1e-12, atol=1e-12)
    (o.square().sum() + S.sum()).backward()
    (o_r.square().sum() + S_r.sum()).backward()
    for n in leaves:
        torch.testing.assert_close(leaves[n].grad, refs[n].grad, rtol=1e-10, atol=1e-11)
    o_np, _ = gdn_ext.reference.gated_delta_rule(
        **{n: t.numpy() for n, t in inputs.items()}, normalize_qk=True, scale=0.6)
    np.testing.assert_allclose(o.detach().numpy(), o_np, rtol=1e-12, atol=1e-12)


def test_requires_grad_on_a_subset_strides_and_float32():
    inputs = _inputs(3, T=5, dtype=torch.float32)
    v = inputs["v"].clone().requires_grad_()
    q = inputs["q"].transpose(1, 2).contiguous().transpose(1, 2)     # non-contiguous
    assert not q.is_contiguous()
    o, S = gt.gated_delta_rule(q, inputs["k"], v, beta=inputs["beta"], alpha=inputs["alpha"])
    assert o.dtype == torch.float32 and o.shape == (2, 5, 2, 4)
    o.sum().backward()
    assert v.grad is not None and v.grad.shape == v.shape
    assert inputs["q"].grad is None
    o2, _ = gt.gated_delta_rule(q.contiguous(), inputs["k"], v, beta=inputs["beta"],
                                alpha=inputs["alpha"])
    torch.testing.assert_close(o, o2, rtol=0, atol=0)
    assert gt.gated_delta_rule(q, inputs["k"], v, beta=inputs["beta"], alpha=inputs["alpha"],
                               output_final_state=False)[1] is None


def test_double_backward_raises():
    inputs = _inputs(4, T=4)
    q = inputs.pop("q").requires_grad_()
    o, _ = gt.gated_delta_rule(q, inputs.pop("k"), inputs.pop("v"), **inputs)
    (dq,) = torch.autograd.grad(o.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dq.sum().backward()


def test_bad_tensors():
    inputs = _inputs(5, T=3)
    q = inputs.pop("q")
    k, v = inputs.pop("k"), inputs.pop("v")
    with pytest.raises(ValueError, match="q is on meta: gdn_ext runs on the CPU"):
        gt.gated_delta_rule(q.to("meta"), k, v, **inputs)
    with pytest.raises(TypeError, match="k must be float32 or float64; got torch.bfloat16"):
        gt.gated_delta_rule(q, k.bfloat16(), v, **inputs)
    with pytest.raises(TypeError, match="must share one dtype"):
        gt.gated_delta_rule(q, k.float(), v, **inputs)
    with pytest.raises(TypeError, match="v must be a torch.Tensor"):
        gt.gated_delta_rule(q, k, v.numpy(), **inputs)
    with pytest.raises(ValueError, match="exactly one of alpha"):
        gt.gated_delta_rule(q, k, v, beta=inputs["beta"])


# ---- against transformers' pure-torch fallbacks (Qwen3-Next) ------------------------------------

if os.environ.get("GDN_EXT_REQUIRE_TORCH") == "1":
    import transformers.models.qwen3_next.modeling_qwen3_next as qwen3_next
else:
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


class _Float64Torch:
    """torch, except that torch.float32 means float64: runs transformers' fallbacks (which cast to
    float32 internally) in float64, so they can be compared to about 1e-10."""

    def __getattr__(self, name):
        return torch.float64 if name == "float32" else getattr(torch, name)


def _in_float64(fn):
    raw = getattr(fn, "__wrapped__", fn)
    f = types.FunctionType(raw.__code__, dict(raw.__globals__, torch=_Float64Torch()),
                           raw.__name__, raw.__defaults__, raw.__closure__)
    f.__kwdefaults__ = raw.__kwdefaults__
    return f


def _fla_inputs(seed, B=2, T=75, H=2, HV=4, K=16, V=8, dtype=torch.float64, unit_keys=True,
                state=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    k = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    if unit_keys:
        k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(B, T, HV, V, generator=g, dtype=dtype)
    gl = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, generator=g, dtype=dtype) + 2)
    beta = torch.rand(B, T, HV, generator=g, dtype=dtype)
    h0 = torch.randn(B, HV, K, V, generator=g, dtype=dtype) if state else None
    return q, k, v, gl, beta, h0


FALLBACKS = {"chunk": (gt.chunk_gated_delta_rule, qwen3_next.torch_chunk_gated_delta_rule),
             "recurrent": (gt.fused_recurrent_gated_delta_rule,
                           qwen3_next.torch_recurrent_gated_delta_rule)}


@pytest.mark.parametrize("variant", list(FALLBACKS))
@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize("HV", [2, 4])
def test_dropin_matches_transformers_float64(variant, l2, HV):
    ours, theirs = FALLBACKS[variant]
    theirs64 = _in_float64(theirs)
    q, k, v, gl, beta, h0 = _fla_inputs(6, HV=HV, unit_keys=not l2)
    o, ht = ours(q, k, v, g=gl, beta=beta, initial_state=h0, output_final_state=True,
                 use_qk_l2norm_in_kernel=l2)
    o_t, ht_t = theirs64(q, k, v, g=gl, beta=beta, initial_state=h0, output_final_state=True,
                         use_qk_l2norm_in_kernel=l2)
    assert o.dtype == torch.float64 and o_t.dtype == torch.float64
    assert ht.shape == ht_t.shape == (2, HV, 16, 8)
    torch.testing.assert_close(o, o_t, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht, ht_t, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("variant", list(FALLBACKS))
def test_dropin_matches_transformers_float32(variant):
    ours, theirs = FALLBACKS[variant]
    q, k, v, gl, beta, h0 = _fla_inputs(7, T=200, K=64, V=64, dtype=torch.float32)
    o, ht = ours(q, k, v, g=gl, beta=beta, initial_state=h0, output_final_state=True)
    o_t, ht_t = theirs(q, k, v, g=gl, beta=beta, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.float32
    err = ((o - o_t).abs().max() / o_t.abs().max()).item()
    assert err < 1e-5, err
    assert ((ht - ht_t).abs().max() / ht_t.abs().max()).item() < 1e-5


@pytest.mark.parametrize("l2", [False, True])
def test_chunk_dropin_gradients_match_transformers(l2):
    theirs64 = _in_float64(qwen3_next.torch_chunk_gated_delta_rule)
    base = _fla_inputs(8, T=70, HV=4, unit_keys=not l2)
    ours_in = [t.clone().requires_grad_() for t in base]
    their_in = [t.clone().requires_grad_() for t in base]
    w = torch.randn(2, 70, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def loss(fn, xs):
        q, k, v, gl, beta, h0 = xs
        o, ht = fn(q, k, v, g=gl, beta=beta, initial_state=h0, output_final_state=True,
                   use_qk_l2norm_in_kernel=l2)
        return (o * w).sum() + ht.square().sum()

    loss(gt.chunk_gated_delta_rule, ours_in).backward()
    loss(theirs64, their_in).backward()
    for name, a, b in zip(["q", "k", "v", "g", "beta", "h0"], ours_in, their_in):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize("variant", list(FALLBACKS))
def test_dropin_varlen_equals_transformers_per_sequence(variant):
    """transformers' fallbacks have no cu_seqlens: compare with one call per sequence."""
    ours, theirs = FALLBACKS[variant]
    theirs64 = _in_float64(theirs)
    lengths = [1, 15, 64, 65, 20]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]))
    q, k, v, gl, beta, _ = _fla_inputs(9, B=1, T=int(cu[-1]), state=False)
    h0 = torch.randn(5, 4, 16, 8, dtype=torch.float64)
    o, ht = ours(q, k, v, g=gl, beta=beta, initial_state=h0, output_final_state=True,
                 use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    assert ht.shape == (5, 4, 16, 8)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_n, ht_n = theirs64(q[:, a:b], k[:, a:b], v[:, a:b], g=gl[:, a:b], beta=beta[:, a:b],
                             initial_state=h0[n:n + 1], output_final_state=True,
                             use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o[:, a:b], o_n, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(ht[n:n + 1], ht_n, rtol=1e-10, atol=1e-10)


def test_fused_recurrent_per_key_decay_and_defaults():
    q, k, v, gl, beta, h0 = _fla_inputs(10, T=12, HV=2)
    gk = torch.nn.functional.logsigmoid(torch.randn(2, 12, 2, 16, dtype=torch.float64) + 2)
    o, ht = gt.fused_recurrent_gated_delta_rule(q, k, v, gk=gk, beta=beta, initial_state=h0,
                                                output_final_state=True)
    o_ref, S_ref = gt.reference_gated_delta_rule(q, k, v, beta=beta, g=gk,
                                                 initial_state=h0.transpose(-1, -2),
                                                 scale=16 ** -0.5)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ht, S_ref.transpose(-1, -2), rtol=1e-12, atol=1e-12)
    o_c, _ = gt.chunk_gated_delta_rule(q, k, v, gk=gk, beta=beta, initial_state=h0)
    torch.testing.assert_close(o_c, o, rtol=0, atol=0)
    with pytest.raises(ValueError, match="give the log decay g"):
        gt.chunk_gated_delta_rule(q, k, v, beta=beta)
    o1, none = gt.fused_recurrent_gated_delta_rule(q, k, v, g=gl)   # beta defaults to 1
    o2, _ = gt.fused_recurrent_gated_delta_rule(q, k, v, g=gl, beta=torch.ones_like(beta))
    assert none is None
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)


# ---- a real model: tiny Qwen3-Next ------------------------------------------------------------

def tiny_qwen3_next(dtype):
    from gdn_ext.apps.bench_qwen3_next import tiny_qwen3_next as make
    torch.manual_seed(0)
    return make(dtype=dtype)


def _logits_and_grads(model, ids):
    model.zero_grad()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                 if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_qwen3_next_swap_same_logits_and_gradients(dtype):
    """The tiny model's logits and every parameter gradient are the same with gdn_ext's
    gated delta rule swapped in as with transformers' own torch fallback."""
    model = tiny_qwen3_next(dtype)
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    if dtype == torch.float64:   # their fallback in float64 too, so the comparison is tight
        patch = mock.patch.multiple(
            qwen3_next,
            torch_chunk_gated_delta_rule=_in_float64(qwen3_next.torch_chunk_gated_delta_rule),
            torch_recurrent_gated_delta_rule=_in_float64(
                qwen3_next.torch_recurrent_gated_delta_rule))
        tol = dict(rtol=1e-9, atol=1e-10)
    else:
        patch = contextlib.nullcontext()           # their float32 fallback as it ships
        tol = dict(rtol=1e-3, atol=2e-4)    # decay gradients sum many float32 terms
    with patch:
        logits_t, grads_t = _logits_and_grads(model, ids)
    with gt.patch_transformers(), mock.patch.object(gt.fla, "_fla_call", wraps=gt.fla._fla_call) as spy:
        logits_g, grads_g = _logits_and_grads(model, ids)
    assert spy.call_count == 1                     # the one linear-attention layer ran gdn_ext
    torch.testing.assert_close(logits_g, logits_t, **tol)
    assert grads_g.keys() == grads_t.keys()
    linear = [n for n in grads_g if "linear_attn" in n]
    assert any("A_log" in n for n in linear) and any("in_proj" in n for n in linear)
    for n in grads_g:
        scale = grads_t[n].abs().max().clamp_min(1e-12)
        torch.testing.assert_close(grads_g[n] / scale, grads_t[n] / scale, **tol, msg=n)
