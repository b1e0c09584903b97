"""gdn_ext.torch as users call it: float16 / bfloat16 in every entry point (computed in float32,
returned and differentiated in the input dtype), one rule for mixed dtypes, Python numbers and
broadcastable tensors for beta / alpha / g, the forward's named tuple, torch.compile."""
import copy
import os
import pickle
import typing

import pytest

if os.environ.get("GDN_EXT_REQUIRE_TORCH") == "1":
    import torch
else:
    torch = pytest.importorskip("torch")

import gdn_ext.torch as gt  # noqa: E402

HALF = [torch.bfloat16, torch.float16]
# largest error relative to the largest value, for a result rounded once to the dtype
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _inputs(seed, B=2, T=9, H=2, HV=4, Dk=8, Dv=6, dtype=torch.float32):
    """gdn_ext's layout: q, k (unit keys) [B, T, H, Dk], v [B, T, HV, Dv], beta, g [B, T, HV],
    initial_state [B, HV, Dv, Dk]."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = dict(q=rand(B, T, H, Dk), k=torch.nn.functional.normalize(rand(B, T, H, Dk), dim=-1),
             v=rand(B, T, HV, Dv),
             beta=0.1 + 0.8 * torch.rand(B, T, HV, generator=gen, dtype=torch.float64),
             g=-0.01 - torch.rand(B, T, HV, generator=gen, dtype=torch.float64),
             initial_state=0.5 * rand(B, HV, Dv, Dk))
    return {n: t.to(dtype) for n, t in x.items()}


def _gdn(fn):
    def run(x):
        return fn(x["q"], x["k"], x["v"], beta=x["beta"], g=x["g"],
                  initial_state=x["initial_state"], scale=0.5)
    return run


def _fla(fn):
    """A drop-in on the same inputs: its state is [N, HV, K, V]; S_T back in gdn_ext's."""
    def run(x):
        o, S = fn(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], scale=0.5,
                  initial_state=x["initial_state"].transpose(-1, -2), output_final_state=True)
        return o, S.transpose(-1, -2)
    return run


ENTRY = {"gated_delta_rule": _gdn(gt.gated_delta_rule),
         "reference_gated_delta_rule": _gdn(gt.reference_gated_delta_rule),
         "chunk_gated_delta_rule": _fla(gt.chunk_gated_delta_rule),
         "fused_recurrent_gated_delta_rule": _fla(gt.fused_recurrent_gated_delta_rule)}


def _leaves(x):
    return {n: t.clone().requires_grad_() for n, t in x.items()}


def _backward(o, S, seed):
    """A loss with fixed weights (representable in bfloat16 and float16, so a half run and a
    float32 run receive the same upstream gradient)."""
    gen = torch.Generator().manual_seed(seed)
    w_o = torch.randn(o.shape, generator=gen).bfloat16().half().float()
    w_S = torch.randn(S.shape, generator=gen)
    ((o.float() * w_o).sum() + (S.float() * w_S).sum()).backward()


# ---- float16 / bfloat16 ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("entry", list(ENTRY))
def test_half_inputs_are_computed_in_float32(entry, dtype):
    """Half-precision inputs: o in their dtype, the final state in float32, every gradient in
    its input's dtype; o and the gradients are the float32 run's on the same values, rounded
    once; o is within the dtype's rounding of float64."""
    run = ENTRY[entry]
    x = _inputs(1, dtype=dtype)
    half, single = _leaves(x), _leaves({n: t.float() for n, t in x.items()})
    o, S = run(half)
    o32, S32 = run(single)
    assert o.dtype == dtype and S.dtype == torch.float32
    torch.testing.assert_close(o, o32.to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(S, S32, rtol=0, atol=0)
    o64, _ = run({n: t.double() for n, t in x.items()})
    err = ((o.double() - o64).abs().max() / o64.abs().max()).item()
    assert err < TOL[dtype], err
    _backward(o, S, 2)
    _backward(o32, S32, 2)
    for n in x:
        assert half[n].grad is not None and half[n].grad.dtype == dtype, n
        torch.testing.assert_close(half[n].grad, single[n].grad.to(dtype), rtol=0, atol=0,
                                   msg=n)


@pytest.mark.parametrize("entry", list(ENTRY))
def test_mixed_dtypes_one_rule(entry):
    """bfloat16 q, k, v with a float32 gate and state (as Qwen3-Next makes them): o bfloat16,
    the state float32, each gradient in its input's dtype. A float64 argument makes the
    computation float64 (o still in q's dtype). q, k, v of different dtypes, or an integer
    tensor, are refused with what to do."""
    run = ENTRY[entry]
    x = _inputs(3)
    mixed = _leaves(dict(x, q=x["q"].bfloat16(), k=x["k"].bfloat16(), v=x["v"].bfloat16()))
    o, S = run(mixed)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    _backward(o, S, 4)
    assert [mixed[n].grad.dtype for n in x] == [torch.bfloat16] * 3 + [torch.float32] * 3

    wide = dict(x, initial_state=x["initial_state"].double())
    o, S = run(wide)
    o64, S64 = run({n: t.double() for n, t in x.items()})
    assert o.dtype == torch.float32 and S.dtype == torch.float64
    torch.testing.assert_close(o, o64.float(), rtol=0, atol=0)
    torch.testing.assert_close(S, S64, rtol=0, atol=0)

    with pytest.raises(TypeError, match=r"q, k and v must share one dtype \(o is returned in "
                                        r"it\); got q torch.float32, k torch.float32, v "
                                        r"torch.float64: convert them"):
        run(dict(x, v=x["v"].double()))
    with pytest.raises(TypeError, match=r"beta must be float16, bfloat16, float32 or float64; "
                                        r"got torch.int64"):
        run(dict(x, beta=torch.ones(x["beta"].shape, dtype=torch.long)))


def _layer_pair(dtype):
    torch.manual_seed(5)
    layer = gt.GatedDeltaNet(32, 2, 4, 8, 6, dtype=torch.float64)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    half = copy.deepcopy(layer).to(dtype)
    return half, copy.deepcopy(half).double()      # the same rounded weights in float64


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_layer_in_half_precision(dtype):
    """A half-precision layer: y and every gradient in its dtype, close to float64 with the same
    weights; the recurrent state float32 in every call (T = 0 too) and carried over."""
    half, ref = _layer_pair(dtype)
    x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(6)).to(dtype)
    xh, xr = x.clone().requires_grad_(), x.double().requires_grad_()
    y, st = half(xh)
    y_r, _ = ref(xr)
    assert y.dtype == dtype and st.recurrent.dtype == torch.float32 and st.conv.dtype == dtype
    assert (((y.double() - y_r).abs().max() / y_r.abs().max()).item()) < 5 * TOL[dtype]
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
    (y.float() * w).sum().backward()
    (y_r * w.double()).sum().backward()
    assert xh.grad.dtype == dtype
    for (n, p), (_, p_r) in zip(half.named_parameters(), ref.named_parameters()):
        assert p.grad.dtype == dtype, n
        err = ((p.grad.double() - p_r.grad).abs().max() / p_r.grad.abs().max()).item()
        assert err < 0.1, (n, err)
    with torch.no_grad():
        _, empty = half(x[:, :0])
        y2, st2 = half(x[:, :1], st)
    assert empty.recurrent.dtype == torch.float32
    assert y2.dtype == dtype and st2.recurrent.dtype == torch.float32


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_layer_in_half_precision_matches_transformers_qwen3_next(dtype):
    """Same half-precision weights and input as transformers' Qwen3-Next layer, which computes
    the recurrence, the decay and its gated RMSNorm's gate in float32: the same y, but for a
    rare last-bit difference (the recurrence's float32 sums run in another order)."""
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig
    cfg = Qwen3NextConfig(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=8, linear_value_head_dim=6,
                          linear_conv_kernel_dim=4, num_hidden_layers=1,
                          layer_types=["linear_attention"], rms_norm_eps=1e-6)
    torch.manual_seed(0)
    theirs = qwen3_next.Qwen3NextGatedDeltaNet(cfg, 0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        theirs.A_log.copy_(torch.linspace(-2, 1, 4))
    theirs = theirs.to(dtype)
    ours = gt.GatedDeltaNet.from_config(cfg, dtype=dtype)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 40, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        y_t = theirs(x)
        y, _ = ours(x)
    assert y.dtype == dtype
    assert (y != y_t).double().mean().item() < 0.01
    torch.testing.assert_close(y, y_t, rtol=TOL[dtype], atol=TOL[dtype] * y_t.abs().max().item())


# ---- beta, alpha, g: Python numbers and tensors that broadcast --------------------------------

B, T, H, HV, DK, DV = 2, 5, 2, 4, 3, 2
RNG = torch.Generator().manual_seed(11)


def _r(*shape, lo=0.2, hi=0.9):
    return lo + (hi - lo) * torch.rand(shape, generator=RNG, dtype=torch.float64)


# (argument, what it is given as, the full shape it stands for)
BROADCAST = {
    "beta=0.5": ("beta", 0.5, (B, T, HV)),
    "beta=1 (int)": ("beta", 1, (B, T, HV)),
    "beta 0-d": ("beta", _r(), (B, T, HV)),
    "beta [HV]": ("beta", _r(HV), (B, T, HV)),
    "beta [T, 1]": ("beta", _r(T, 1), (B, T, HV)),
    "beta [B, 1, HV]": ("beta", _r(B, 1, HV), (B, T, HV)),
    "alpha=1.0": ("alpha", 1.0, (B, T, HV)),
    "alpha [B, T, 1]": ("alpha", _r(B, T, 1), (B, T, HV)),
    "g=-0.3": ("g", -0.3, (B, T, HV)),
    "g [HV]": ("g", -_r(HV), (B, T, HV)),
    "g [1, 1, 1, Dk] (per key)": ("g", -_r(1, 1, 1, DK), (B, T, HV, DK)),
    "g [B, T, HV, 1] (per key)": ("g", -_r(B, T, HV, 1), (B, T, HV, DK)),
}


def _call(fn, x, **over):
    kw = dict(beta=x["beta"], initial_state=x["initial_state"], scale=0.7)
    kw.update(over)
    if "alpha" not in kw and "g" not in kw:
        kw["g"] = x["g"]
    return fn(x["q"], x["k"], x["v"], **kw)


def _full(given, shape):
    if isinstance(given, torch.Tensor):
        return given.detach().expand(shape).contiguous()
    return torch.full(shape, float(given), dtype=torch.float64)


@pytest.mark.parametrize("fn", [gt.gated_delta_rule, gt.reference_gated_delta_rule],
                         ids=["gated_delta_rule", "reference"])
@pytest.mark.parametrize("case", list(BROADCAST))
def test_broadcast_beta_and_gates_equal_full_tensors(case, fn):
    """A number or a broadcastable tensor gives the values of the same call with the full
    tensor; its gradient is the full tensor's summed over the broadcast axes, in its shape."""
    name, given, shape = BROADCAST[case]
    x = _leaves(_inputs(12, B=B, T=T, H=H, HV=HV, Dk=DK, Dv=DV, dtype=torch.float64))
    full = _full(given, shape).requires_grad_()
    if isinstance(given, torch.Tensor):
        given = given.clone().requires_grad_()
    o, S = _call(fn, x, **{name: given})
    x_full = _leaves({n: t.detach() for n, t in x.items()})
    o_f, S_f = _call(fn, x_full, **{name: full})
    torch.testing.assert_close(o, o_f, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(S, S_f, rtol=1e-14, atol=1e-14)
    _backward(o, S, 13)
    _backward(o_f, S_f, 13)
    for n in ("q", "k", "v", "initial_state"):
        torch.testing.assert_close(x[n].grad, x_full[n].grad, rtol=1e-12, atol=1e-13)
    if isinstance(given, torch.Tensor):
        assert given.grad.shape == given.shape
        torch.testing.assert_close(given.grad, full.grad.sum_to_size(given.shape), rtol=1e-12,
                                   atol=1e-13)


@pytest.mark.parametrize("fn", [gt.gated_delta_rule, gt.reference_gated_delta_rule],
                         ids=["gated_delta_rule", "reference"])
def test_single_head_form_broadcasts(fn):
    """The single-head form: beta and the gate broadcast to [B, T]; a gate with three
    dimensions is one decay per key channel ([B, T, Dk])."""
    x = _inputs(14, B=B, T=T, H=1, HV=1, Dk=DK, Dv=DV, dtype=torch.float64)
    x = {n: t[:, :, 0] if n in ("q", "k", "v") else t for n, t in x.items()}
    x["initial_state"] = x["initial_state"][:, 0]
    gk = -_r(1, 1, DK)
    for over, full in [
            (dict(beta=0.5, alpha=1.0), dict(beta=torch.full((B, T), 0.5, dtype=torch.float64),
                                             alpha=torch.ones(B, T, dtype=torch.float64))),
            (dict(beta=x["beta"][0, :, 0], g=gk),
             dict(beta=x["beta"][0, :, 0].expand(B, T), g=gk.expand(B, T, DK)))]:
        o, S = _call(fn, x, **over)
        o_f, S_f = _call(fn, x, **full)
        assert o.shape == (B, T, DV) and S.shape == (B, DV, DK)
        torch.testing.assert_close(o, o_f, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(S, S_f, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_python_numbers_keep_the_dtype(dtype):
    """beta=0.5, alpha=1.0 (Python floats, i.e. doubles) do not make a float32 or bfloat16 call
    float64: the result is the one with tensors of the inputs' dtype."""
    x = _inputs(15, dtype=dtype)
    o, S = gt.gated_delta_rule(x["q"], x["k"], x["v"], beta=0.5, alpha=1.0)
    o_t, S_t = gt.gated_delta_rule(x["q"], x["k"], x["v"], beta=torch.full_like(x["beta"], 0.5),
                                   alpha=torch.ones_like(x["beta"]))
    assert o.dtype == dtype and S.dtype == torch.float32
    torch.testing.assert_close(o, o_t, rtol=0, atol=0)
    torch.testing.assert_close(S, S_t, rtol=0, atol=0)


def test_gradcheck_broadcast_beta_and_gate():
    """torch.autograd.gradcheck in float64 through a per-head beta [HV] and a gate [B, 1, HV]
    broadcast over T (and q, k, v, the state)."""
    x = _inputs(16, B=2, T=4, H=1, HV=2, Dk=3, Dv=2, dtype=torch.float64)
    leaves = (x["q"], x["k"], x["v"], _r(2), -_r(2, 1, 2), x["initial_state"])
    leaves = tuple(t.clone().requires_grad_() for t in leaves)

    def f(q, k, v, beta, g, s0):
        return tuple(gt.gated_delta_rule(q, k, v, beta=beta, g=g, initial_state=s0, scale=0.8))

    assert torch.autograd.gradcheck(f, leaves)


@pytest.mark.parametrize("fn", [gt.gated_delta_rule, gt.reference_gated_delta_rule],
                         ids=["gated_delta_rule", "reference"])
def test_shapes_that_do_not_broadcast_are_named(fn):
    x = _inputs(17, B=B, T=T, H=H, HV=HV, Dk=DK, Dv=DV, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^beta must be a real number or a tensor that "
                                         r"broadcasts to \[B, T, HV\] = \[2, 5, 4\]; got shape "
                                         r"\[3\]$"):
        _call(fn, x, beta=torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^g must be a real number or a tensor that broadcasts "
                                         r"to \[B, T, HV\] = \[2, 5, 4\] \(one gate per head\) "
                                         r"or, with one more axis, to \[B, T, HV, Dk\] = "
                                         r"\[2, 5, 4, 3\] \(one per key channel\); got shape "
                                         r"\[1, 5, 1, 1, 3\]$"):
        _call(fn, x, g=-torch.ones(1, T, 1, 1, DK, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"alpha must be .* got shape \[2, 5, 4, 2\]$"):
        _call(fn, x, alpha=torch.ones(B, T, HV, 2, dtype=torch.float64))
    for bad in (True, "0.5", [0.5]):
        with pytest.raises(TypeError, match="beta must be a torch.Tensor or a real number"):
            _call(fn, x, beta=bad)


# ---- the result --------------------------------------------------------------------------------

def test_forward_returns_a_named_tuple():
    x = _inputs(18)
    out = gt.gated_delta_rule(x["q"], x["k"], x["v"], beta=x["beta"], g=x["g"])
    assert isinstance(out, gt.GatedDeltaRuleOutput) and isinstance(out, tuple)
    assert gt.GatedDeltaRuleOutput._fields == ("o", "S_T")
    assert typing.get_type_hints(gt.GatedDeltaRuleOutput) == {
        "o": torch.Tensor, "S_T": torch.Tensor}
    assert "GatedDeltaRuleOutput" in gt.__all__
    o, S_T = out
    assert o is out.o is out[0] and S_T is out.S_T is out[1]
    assert o.shape == (2, 9, 4, 6) and S_T.shape == (2, 4, 6, 8)
    assert repr(out).startswith("GatedDeltaRuleOutput(o=tensor(")
    assert pickle.loads(pickle.dumps(out)).S_T.equal(S_T)
    none = gt.gated_delta_rule(x["q"], x["k"], x["v"], beta=x["beta"], g=x["g"],
                               output_final_state=False)
    assert isinstance(none, gt.GatedDeltaRuleOutput) and none.S_T is None
    ref = gt.reference_gated_delta_rule(x["q"], x["k"], x["v"], beta=x["beta"], g=x["g"])
    assert isinstance(ref, gt.GatedDeltaRuleOutput)
    # the drop-ins return what flash-linear-attention returns: a plain tuple
    for dropin in (gt.chunk_gated_delta_rule, gt.fused_recurrent_gated_delta_rule):
        assert type(dropin(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"])) is tuple


def test_large_inputs_cast_in_pieces_keep_their_gradients():
    """float32 q, k, v of more than 2^18 elements with a float64 gate: cast to float64 piece by
    piece (Ctrl-C between pieces), with o returned in float32 and the gradients of every input
    in its own dtype, bit for bit those of casting them up front."""
    rng = torch.Generator().manual_seed(29)
    B, T, H, D = 1, 2100, 1, 128                     # 268 800 elements each
    x = {"q": torch.randn(B, T, H, D, generator=rng), "v": torch.randn(B, T, H, D, generator=rng),
         "k": torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=rng), dim=-1)}
    beta = torch.rand(B, T, H, generator=rng, dtype=torch.float64)
    g = -torch.rand(B, T, H, generator=rng, dtype=torch.float64)
    a = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, S = gt.gated_delta_rule(a["q"], a["k"], a["v"], beta=beta, g=g)
    assert o.dtype == torch.float32 and S.dtype == torch.float64
    (o.sum() + S.sum()).backward()
    b = {n: t.clone().requires_grad_() for n, t in x.items()}
    o2, S2 = gt.gated_delta_rule(*(b[n].double() for n in ("q", "k", "v")), beta=beta, g=g)
    (o2.float().sum() + S2.sum()).backward()
    torch.testing.assert_close(o, o2.float(), rtol=0, atol=0)
    for n in x:
        assert a[n].grad.dtype == torch.float32
        torch.testing.assert_close(a[n].grad, b[n].grad, rtol=0, atol=0)


@pytest.mark.parametrize("gate_shape", ["[HV]", "[1, 1, HV]", "[T, HV]"])
@pytest.mark.parametrize("gate", ["g", "alpha"])
def test_torch_compile_dynamic_gate_per_head_with_HV_equal_Dk(gate_shape, gate):
    """A per-head gate given with fewer axes whose last one has Dk entries (HV == Dk) warns
    eagerly that it might have meant one decay per key channel; under torch.compile(
    fullgraph=True, dynamic=True) that warning's text (built from sizes that are symbolic there)
    broke the graph. It compiles in one graph and gives the eager result."""
    B, T, H, D = 2, 7, 4, 4
    rng = torch.Generator().manual_seed(23)
    q, v = torch.randn(B, T, H, D, generator=rng), torch.randn(B, T, H, D, generator=rng)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=rng), dim=-1)
    shape = {"[HV]": (H,), "[1, 1, HV]": (1, 1, H), "[T, HV]": (T, H)}[gate_shape]
    a = torch.rand(shape, generator=rng) * 0.5 + 0.4
    a = a.log() if gate == "g" else a
    beta = torch.rand(B, T, H, generator=rng)

    def f(q, k, v, beta, a):
        return gt.gated_delta_rule(q, k, v, beta=beta, **{gate: a})

    with pytest.warns(UserWarning, match="broadcast to one gate per head"):
        o, S = f(q, k, v, beta, a)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    o_c, S_c = compiled(q, k, v, beta, a)
    torch.testing.assert_close(o_c, o, rtol=0, atol=0)
    torch.testing.assert_close(S_c, S, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torch_compile_fullgraph_plain_call(dtype):
    """A plain call (a Python-number beta, bfloat16 too) compiles in one graph and gives the
    eager results and gradients."""
    x = _inputs(19, dtype=dtype)

    def f(q, k, v, g):
        out = gt.gated_delta_rule(q, k, v, beta=0.5, g=g)
        return out.o * 2, out.S_T

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    eager_in = _leaves({n: x[n] for n in ("q", "k", "v", "g")})
    comp_in = _leaves({n: x[n] for n in ("q", "k", "v", "g")})
    o, S = f(**eager_in)
    o_c, S_c = compiled(**comp_in)
    assert o_c.dtype == dtype and S_c.dtype == torch.float32
    torch.testing.assert_close(o_c, o, rtol=0, atol=0)
    torch.testing.assert_close(S_c, S, rtol=1e-6, atol=1e-6)
    _backward(o, S, 20)
    _backward(o_c, S_c, 20)
    for n in eager_in:
        assert comp_in[n].grad.dtype == dtype
        torch.testing.assert_close(comp_in[n].grad.float(), eager_in[n].grad.float(),
                                   rtol=1e-2, atol=1e-5)
