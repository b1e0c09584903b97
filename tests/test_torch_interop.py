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


def test_bad_tensors():
    inputs = _inputs(5, T=3)
    q = inputs.pop("q")
    k, v = inputs.pop("k"), inputs.pop("v")
    with pytest.raises(ValueError, match="q is on meta: gdn_ext runs on the CPU"):
        gt.gated_delta_rule(q.to("meta"), k, v, **inputs)
    with pytest.raises(TypeError, match="k must be float16, bfloat16, float32 or float64; got "
                                        "torch.int32"):
        gt.gated_delta_rule(q, k.int(), v, **inputs)
    with pytest.raises(TypeError, match="q, k and v must share one dtype"):
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


# ---- every flash-linear-attention keyword, checked against transformers' loop in float64 --------

def _oracle(q, k, v, g, beta, h0, l2=True):
    """transformers' recurrent fallback in float64, gates and beta already activated, state in
    fla's [N, HV, K, V]."""
    return _in_float64(qwen3_next.torch_recurrent_gated_delta_rule)(
        q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=l2)


def _issue_inputs(seed=11):
    """The issue's shapes: K = V = 16, HV = 4, H = 2, T = 24, an initial state."""
    return _fla_inputs(seed, B=2, T=24, H=2, HV=4, K=16, V=16, unit_keys=False)


@pytest.mark.parametrize("dropin", list(FALLBACKS))
def test_gate_computed_in_kernel(dropin):
    """use_gate_in_kernel=True: g is the raw input, the decay -exp(A_log) softplus(g + dt_bias);
    gradients reach A_log and dt_bias."""
    q, k, v, _, beta, h0 = _issue_inputs()
    gen = torch.Generator().manual_seed(3)
    raw = torch.randn(2, 24, 4, generator=gen, dtype=torch.float64)
    A_log = torch.randn(4, generator=gen, dtype=torch.float64).requires_grad_()
    dt_bias = torch.randn(4, generator=gen, dtype=torch.float64).requires_grad_()
    fn = FALLBACKS[dropin][0]
    o, ht = fn(q, k, v, g=raw, beta=beta, initial_state=h0, output_final_state=True,
               use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
               dt_bias=dt_bias)
    decay = -A_log.exp() * torch.nn.functional.softplus(raw + dt_bias)
    o_t, ht_t = _oracle(q, k, v, decay, beta, h0)
    torch.testing.assert_close(o, o_t, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht, ht_t, rtol=1e-10, atol=1e-10)
    (o.square().sum() + ht.sum()).backward()
    grads = (A_log.grad.clone(), dt_bias.grad.clone())
    A_log.grad = dt_bias.grad = None
    (o_t.square().sum() + ht_t.sum()).backward()
    torch.testing.assert_close(grads[0], A_log.grad, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(grads[1], dt_bias.grad, rtol=1e-9, atol=1e-10)
    with pytest.raises(ValueError, match="A_log"):
        fn(q, k, v, g=raw, beta=beta, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match=r"A_log must have shape \[HV\] = \[4\]"):
        fn(q, k, v, g=raw, beta=beta, use_gate_in_kernel=True, A_log=A_log[:2])


@pytest.mark.parametrize("dropin", list(FALLBACKS))
@pytest.mark.parametrize("neg", [False, True])
def test_beta_as_a_logit(dropin, neg):
    """use_beta_sigmoid_in_kernel: beta = sigmoid(b); with allow_neg_eigval: 2 sigmoid(b)."""
    q, k, v, gl, b, h0 = _issue_inputs()
    b = 3 * b - 1
    fn = FALLBACKS[dropin][0]
    o, ht = fn(q, k, v, g=gl, beta=b, initial_state=h0, output_final_state=True,
               use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
               allow_neg_eigval=neg)
    o_t, ht_t = _oracle(q, k, v, gl, (2 if neg else 1) * torch.sigmoid(b), h0)
    torch.testing.assert_close(o, o_t, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht, ht_t, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="allow_neg_eigval=True requires"):
        fn(q, k, v, g=gl, beta=b, allow_neg_eigval=True)


@pytest.mark.parametrize("dropin", list(FALLBACKS))
@pytest.mark.parametrize("name", ["state_v_first", "transpose_state_layout"])
@pytest.mark.parametrize("KV", [(16, 16), (8, 6)])
def test_value_first_state_layout(dropin, name, KV):
    """state_v_first (and its deprecated name): states [N, HV, V, K] in and out."""
    K, V = KV
    q, k, v, gl, beta, h0 = _fla_inputs(12, B=2, T=24, H=2, HV=4, K=K, V=V, unit_keys=False)
    fn = FALLBACKS[dropin][0]
    ctx = pytest.warns(DeprecationWarning) if name == "transpose_state_layout" else \
        contextlib.nullcontext()
    with ctx:
        o, ht = fn(q, k, v, g=gl, beta=beta, initial_state=h0.transpose(-1, -2).contiguous(),
                   output_final_state=True, use_qk_l2norm_in_kernel=True, **{name: True})
    o_t, ht_t = _oracle(q, k, v, gl, beta, h0)
    assert ht.shape == (2, 4, V, K)
    torch.testing.assert_close(o, o_t, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht, ht_t.transpose(-1, -2), rtol=1e-10, atol=1e-10)
    if K != V:   # the fla layout given where V-first is asked for: named in their layout
        with pytest.raises(ValueError, match=rf"initial_state must have shape \[N, HV, V, K\] = "
                                             rf"\[2, 4, {V}, {K}\]; got \[2, 4, {K}, {V}\]; "
                                             rf"that is the transpose"):
            fn(q, k, v, g=gl, beta=beta, initial_state=h0, state_v_first=True)
        with pytest.raises(ValueError, match=r"shape \[N, HV, K, V\].*transpose.*"
                                             r"state_v_first=True takes it"):
            fn(q, k, v, g=gl, beta=beta, initial_state=h0.transpose(-1, -2))


def test_unknown_keywords_raise_and_tuning_keywords_pass():
    q, k, v, gl, beta, h0 = _issue_inputs()
    k = k / k.norm(dim=-1, keepdim=True)   # unit keys: no stability warning in the way
    for fn in (gt.chunk_gated_delta_rule, gt.fused_recurrent_gated_delta_rule):
        with pytest.raises(TypeError, match="intial_state"):
            fn(q, k, v, g=gl, beta=beta, intial_state=h0)
    ref = gt.chunk_gated_delta_rule(q, k, v, gl, beta, initial_state=h0)[0]
    for kw in (dict(chunk_size=16), dict(chunk_indices=torch.zeros(3, 2, dtype=torch.long)),
               dict(cu_seqlens_cpu=None), dict(cp_context=None)):
        torch.testing.assert_close(gt.chunk_gated_delta_rule(q, k, v, gl, beta, initial_state=h0,
                                                             **kw)[0], ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match="chunk_size"):
        gt.chunk_gated_delta_rule(q, k, v, gl, beta, chunk_size=48)
    with pytest.raises(TypeError, match="cp_context"):
        gt.chunk_gated_delta_rule(q, k, v, gl, beta, cp_context=object())
    with pytest.raises(TypeError, match="gv"):
        gt.fused_recurrent_gated_delta_rule(q, k, v, g=gl, gv=torch.zeros(2, 24, 4, 16),
                                            beta=beta)


def test_errors_speak_fla_layouts():
    """A [2, 4, 6, 8] state where fla's layout is [2, 4, 8, 6]: the message names the expected
    [N, HV, K, V] and the shape passed; a bad gk is named gk."""
    q, k, v, gl, beta, _ = _fla_inputs(13, B=2, T=5, H=2, HV=4, K=8, V=6)
    for fn in (gt.chunk_gated_delta_rule, gt.fused_recurrent_gated_delta_rule):
        with pytest.raises(ValueError, match=r"initial_state must have shape \[N, HV, K, V\] = "
                                             r"\[2, 4, 8, 6\]; got \[2, 4, 6, 8\]"):
            fn(q, k, v, g=gl, beta=beta, initial_state=torch.zeros(2, 4, 6, 8,
                                                                   dtype=torch.float64))
        with pytest.raises(ValueError, match=r"gk must have shape \[B, T, HV, K\]"):
            fn(q, k, v, gk=torch.zeros(2, 5, 4, 9, dtype=torch.float64), beta=beta)
        for bad in (q.numpy(), 1.0):
            with pytest.raises(TypeError, match="q must be a torch.Tensor"):
                fn(bad, k, v, g=gl, beta=beta)
        with pytest.raises(TypeError, match="g must be a torch.Tensor"):
            fn(q, k, v, g=gl.numpy(), beta=beta)
        with pytest.raises(ValueError, match="initial_state must have shape"):
            fn(q, k, v, g=gl, beta=beta, initial_state=torch.zeros(5, dtype=torch.float64))
        with pytest.raises(ValueError, match="K >= 1"):
            fn(q[..., :0], k[..., :0], v, g=gl, beta=beta)


def test_fused_recurrent_without_gate_is_the_delta_rule():
    q, k, v, _, beta, h0 = _issue_inputs()
    o, ht = gt.fused_recurrent_gated_delta_rule(q, k, v, beta=beta, initial_state=h0,
                                                output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
    o_t, ht_t = _oracle(q, k, v, torch.zeros(2, 24, 4, dtype=torch.float64), beta, h0)
    torch.testing.assert_close(o, o_t, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht, ht_t, rtol=1e-10, atol=1e-10)


def test_negative_and_conjugate_bits_strides_offsets():
    """Inputs that are negative-bit views (z.conj().imag), strided and offset views work forward
    and backward, and equal the same values as plain tensors."""
    inputs = _inputs(21, T=6)
    plain = {n: t.clone().requires_grad_() for n, t in inputs.items()}
    o, S = gt.gated_delta_rule(plain.pop("q"), plain.pop("k"), plain.pop("v"), **plain)
    z = torch.complex(torch.zeros_like(inputs["q"]), -inputs["q"])      # conj().imag == q
    q_neg = z.conj().imag
    assert q_neg.is_neg()
    big = torch.zeros(3, *inputs["k"].shape, dtype=torch.float64)
    big[1] = inputs["k"]
    k_off = big[1]                                                       # storage offset
    v_str = inputs["v"].transpose(0, 1).contiguous().transpose(0, 1)     # other strides
    leaves = [q_neg, k_off, v_str]
    o2, S2 = gt.gated_delta_rule(q_neg, leaves[1], leaves[2], beta=inputs["beta"],
                                 alpha=inputs["alpha"], initial_state=inputs["initial_state"])
    torch.testing.assert_close(o2, o, rtol=0, atol=0)
    # backward through a negative-bit tensor that requires grad
    zq = torch.complex(torch.zeros_like(inputs["q"]), -inputs["q"]).requires_grad_()
    qn = zq.conj().imag
    o3, _ = gt.gated_delta_rule(qn, leaves[1], leaves[2], beta=inputs["beta"],
                                alpha=inputs["alpha"], initial_state=inputs["initial_state"])
    o3.square().sum().backward()
    ref_q = inputs["q"].clone().requires_grad_()
    o4, _ = gt.gated_delta_rule(ref_q, inputs["k"], inputs["v"], beta=inputs["beta"],
                                alpha=inputs["alpha"], initial_state=inputs["initial_state"])
    o4.square().sum().backward()
    # qn = imag(conj(z)) = -imag(z): the gradient reaches imag(z) with its sign flipped
    torch.testing.assert_close(zq.grad.imag, -ref_q.grad, rtol=1e-12, atol=1e-12)


# ---- double backward, custom operators, torch.compile -------------------------------------------

@pytest.mark.parametrize("case", ["alpha", "per_key", "grouped", "normalize", "varlen"])
def test_double_backward_is_correct(case):
    """gradgradcheck passes; the issue's case (k's gradient through dq) is not zero and equals
    the torch loop's."""
    make, call = GRADCHECK_CASES[case]
    inputs = _inputs(31, **dict(dict(T=4, Dk=3, Dv=2), **make))
    names = [n for n in ("q", "k", "v", "beta", "alpha", "g", "initial_state") if n in inputs]
    leaves = {n: inputs[n].clone().requires_grad_() for n in names}

    def f(*xs):
        kw = dict(zip(names, xs))
        o, S = gt.gated_delta_rule(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw, **call)
        return o, S

    assert torch.autograd.gradgradcheck(f, tuple(leaves[n] for n in names), atol=1e-6)

    def second(fn):
        xs = {n: inputs[n].clone().requires_grad_() for n in names}
        o, _ = fn(xs)
        (gq,) = torch.autograd.grad(o.square().sum(), xs["q"], create_graph=True)
        (gq ** 2).sum().backward()
        return xs["k"].grad

    ours = second(lambda xs: gt.gated_delta_rule(xs["q"], xs["k"], xs["v"], **{
        n: xs[n] for n in names if n not in "qkv"}, **call))
    ref = second(lambda xs: gt.reference_gated_delta_rule(xs["q"], xs["k"], xs["v"], **{
        n: xs[n] for n in names if n not in "qkv"}, **call))
    assert ours.abs().max() > 0
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-10)


def test_opcheck_passes():
    inputs = _inputs(41, T=5, gate="g")
    fwd = torch.ops.gdn_ext.gated_delta_rule_fwd
    for keep in (False, True):
        args = (inputs["q"], inputs["k"], inputs["v"], inputs["beta"], inputs["g"],
                inputs["initial_state"], 0.5, True, False, None, keep, None, True)
        torch.library.opcheck(fwd, args)
        grads_args = [a.clone().requires_grad_() if isinstance(a, torch.Tensor) else a
                      for a in args]
        torch.library.opcheck(fwd, tuple(grads_args))
    packed = _inputs(42, B=1, T=8, cu=[0, 3, 3, 8], gate="g")
    torch.library.opcheck(fwd, (packed["q"], packed["k"], packed["v"], packed["beta"],
                                packed["g"], packed["initial_state"], 1.0, True, True,
                                torch.tensor([0, 3, 3, 8]), True, 2, False))
    o, S, ck = fwd(*args)
    bwd = torch.ops.gdn_ext.gated_delta_rule_bwd
    torch.library.opcheck(bwd, (torch.ones_like(o), torch.ones_like(S), inputs["q"], inputs["k"],
                                inputs["v"], inputs["beta"], inputs["g"],
                                inputs["initial_state"], ck, 0.5, True, False, None, None, True))


def test_packed_checkpoints_are_the_numpy_apis():
    """The forward operator hands the backward the NumPy API's checkpoints of packed sequences
    (a count for the longest sequence, not padded to one for T), and its fake gives them a
    data-dependent size that torch.compile accepts."""
    cu = [0, 20, 20, 40]
    packed = _inputs(44, B=1, T=40, cu=cu, gate="g")
    assert gdn_ext.checkpoint_count(20) < gdn_ext.checkpoint_count(40)
    args = (packed["q"], packed["k"], packed["v"], packed["beta"], packed["g"],
            packed["initial_state"], 1.0, True, False, torch.tensor(cu), True, None, True)
    _, _, ck = torch.ops.gdn_ext.gated_delta_rule_fwd(*args)
    n = {k: packed[k].numpy() for k in ("q", "k", "v", "beta", "g", "initial_state")}
    _, _, want = gdn_ext.gated_delta_rule(n.pop("q"), n.pop("k"), n.pop("v"), **n,
                                          cu_seqlens=cu, return_checkpoints=True)
    assert ck.shape == want.shape
    np.testing.assert_array_equal(ck.numpy(), want)
    torch.library.opcheck(torch.ops.gdn_ext.gated_delta_rule_fwd, args)


def test_torch_compile_fullgraph():
    """A module that calls the drop-in traces in one graph and gives the eager numbers and
    gradients."""
    q, k, v, gl, beta, h0 = _fla_inputs(43, B=2, T=12, H=2, HV=4, K=8, V=6, dtype=torch.float32)

    class Mixer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(6))

        def forward(self, q, k, v, g, beta, h0):
            o, ht = gt.chunk_gated_delta_rule(q, k, v * self.w, g, beta, initial_state=h0,
                                              output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
            return o.sum(-1), ht

    m = Mixer()
    eager = m(q, k, v, gl, beta, h0)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v, gl, beta, h0)
    torch.testing.assert_close(got[0], eager[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], eager[1], rtol=1e-6, atol=1e-6)
    got[0].sum().backward()
    g_c = m.w.grad.clone()
    m.w.grad = None
    eager[0].sum().backward()
    torch.testing.assert_close(g_c, m.w.grad, rtol=1e-5, atol=1e-5)


# ---- the nn.Module layer against transformers' Qwen3-Next layer ----------------------------------

def _qwen3_layer(dtype, HK=2, HV=4):
    from transformers import Qwen3NextConfig
    cfg = Qwen3NextConfig(hidden_size=32, linear_num_key_heads=HK, linear_num_value_heads=HV,
                          linear_key_head_dim=8, linear_value_head_dim=6,
                          linear_conv_kernel_dim=4, num_hidden_layers=1,
                          layer_types=["linear_attention"], rms_norm_eps=1e-6)
    torch.manual_seed(0)
    theirs = qwen3_next.Qwen3NextGatedDeltaNet(cfg, 0).to(dtype)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        theirs.A_log.copy_(torch.linspace(-2, 1, HV, dtype=dtype))
    ours = gt.GatedDeltaNet.from_config(cfg, dtype=dtype)
    ours.load_state_dict(theirs.state_dict())
    return cfg, ours, theirs


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.float32, 2e-4)])
@pytest.mark.parametrize("HK", [1, 2, 4])
def test_layer_matches_transformers_qwen3_next(dtype, tol, HK):
    """Same weights (load_state_dict of theirs), same outputs and gradients of x and of every
    parameter (their float32 norm and gate bound the float64 agreement)."""
    _, ours, theirs = _qwen3_layer(dtype, HK=HK)
    x = torch.randn(2, 11, 32, dtype=dtype, generator=torch.Generator().manual_seed(1))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    patch = contextlib.nullcontext() if dtype == torch.float32 else mock.patch.multiple(
        qwen3_next,
        torch_chunk_gated_delta_rule=_in_float64(qwen3_next.torch_chunk_gated_delta_rule))
    with patch:
        y_t = theirs(xb)
    y, state = ours(xa)
    scale = y_t.abs().max()
    torch.testing.assert_close(y / scale, y_t / scale, rtol=tol, atol=tol)
    w = torch.randn_like(y)
    (y * w).sum().backward()
    (y_t * w).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=10 * tol, atol=10 * tol * xb.grad.abs().max())
    for (n, p), (n2, p2) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert n == n2
        s = p2.grad.abs().max()
        torch.testing.assert_close(p.grad / s, p2.grad / s, rtol=10 * tol, atol=10 * tol, msg=n)


def test_layer_decodes_token_by_token_as_one_call():
    """Prefill then one token at a time, carrying the state, gives the one call's outputs and
    final state; a mask zeroes padded inputs; bad shapes are refused."""
    _, layer, _ = _qwen3_layer(torch.float64)
    x = torch.randn(2, 9, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y, state = layer(x)
        y1, st = layer(x[:, :5])
        ys = [y1]
        for t in range(5, 9):
            yt, st = layer(x[:, t:t + 1], st)
            ys.append(yt)
    torch.testing.assert_close(torch.cat(ys, 1), y, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(st.recurrent, state.recurrent, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(st.conv, state.conv, rtol=1e-12, atol=1e-13)
    mask = torch.ones(2, 9, dtype=torch.float64)
    mask[:, :3] = 0
    with torch.no_grad():
        ym, _ = layer(x, attention_mask=mask)
        yz, _ = layer(x * mask[:, :, None])
    torch.testing.assert_close(ym, yz, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"x must be a tensor of shape \[B, T, D\]"):
        layer(x[0])
    with pytest.raises(ValueError, match="state must hold"):
        layer(x, gt.GatedDeltaNetState(state.conv[:1], state.recurrent))


def test_compiled_training_with_varying_lengths():
    """A compiled layer trained on sequences of 12 different lengths: one dynamic graph (the
    checkpoints are not handed over under compile), gradients equal to eager."""
    _, layer, _ = _qwen3_layer(torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager")
    for T in range(3, 15):
        x = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(T))
        y, _ = compiled(x)
        y.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    for T in range(3, 15):
        x = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(T))
        layer(x)[0].square().mean().backward()
    for n, p in layer.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_layer_activation_from_config():
    """from_config takes the convolution's activation from config.hidden_act (gelu here), as
    transformers' layer does; an unknown one is refused."""
    from transformers import Qwen3NextConfig
    cfg = Qwen3NextConfig(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=8, linear_value_head_dim=6, num_hidden_layers=1,
                          layer_types=["linear_attention"], hidden_act="gelu")
    torch.manual_seed(1)
    theirs = qwen3_next.Qwen3NextGatedDeltaNet(cfg, 0)
    ours = gt.GatedDeltaNet.from_config(cfg)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], theirs(x), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="activation must be one of"):
        gt.GatedDeltaNet(32, 2, 4, 8, 6, activation="mish")


def test_final_states_are_contiguous_and_o_in_the_dtype_of_qkv():
    """o in the dtype of q, k, v; the final state (contiguous) in the computation's, float64
    here for a float64 gate, beta and state."""
    q, k, v, gl, beta, h0 = _fla_inputs(51, B=2, T=9, H=2, HV=4, K=8, V=6)
    for fn in (gt.chunk_gated_delta_rule, gt.fused_recurrent_gated_delta_rule):
        o, ht = fn(q.float(), k.float(), v.float(), g=gl, beta=beta, initial_state=h0,
                   output_final_state=True)
        assert ht.is_contiguous() and ht.view(2, -1).shape == (2, 4 * 8 * 6)
        assert o.dtype == torch.float32 and ht.dtype == torch.float64


def test_more_bad_inputs_are_named():
    q, k, v, gl, beta, h0 = _fla_inputs(52, B=1, T=10, H=2, HV=2, K=4, V=3)
    C = gt.chunk_gated_delta_rule
    with pytest.raises(ValueError, match="H >= 1"):
        C(q[:, :, :0], k[:, :, :0], v[:, :, :0], gl[:, :, :0], beta[:, :, :0])
    for bad in ("0,10", [0, None], torch.tensor([False, True])):
        with pytest.raises(TypeError, match="cu_seqlens"):
            gt.gated_delta_rule(q, k, v, beta=beta, g=gl, cu_seqlens=bad)
    with pytest.raises(TypeError, match="dense"):
        gt.gated_delta_rule(q.to_sparse(), k, v, beta=beta, g=gl)
    for bad in (0, "2", 2.7, True):
        with pytest.raises((TypeError, ValueError), match="num_threads"):
            gt.gated_delta_rule(q, k, v, beta=beta, g=gl, num_threads=bad)
    with pytest.raises(TypeError, match="normalize_qk"):
        gt.gated_delta_rule(q, k, v, beta=beta, g=gl, normalize_qk="no")
    f = torch.compile(lambda *a: gt.gated_delta_rule(*a[:3], beta=a[3], g=a[4]),
                      fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="q must have shape") as info:
        f(q[0, :, 0], k[0, :, 0], v[0, :, 0], beta[0, :, 0], gl[0, :, 0])
    assert not isinstance(info.value, IndexError)
    _, layer, _ = _qwen3_layer(torch.float64)
    x = torch.randn(2, 0, 32, dtype=torch.float64)
    y, st = layer(x)
    assert y.shape == (2, 0, 32) and st.recurrent.shape == (2, 4, 8, 6)
    with pytest.raises(ValueError, match="state must hold"):
        layer(torch.randn(2, 3, 32, dtype=torch.float64), gt.GatedDeltaNetState(st.conv, None))
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        layer(torch.randn(2, 3, 32, dtype=torch.float64), attention_mask=torch.ones(3))
