"""The value and layout warnings from every front end: NumPy, gdn_ext.torch's function, the
flash-linear-attention drop-ins, the torch layer and gdn_ext.dask. Each warning points at the
caller's line (here: this file), check_values=False turns it off, ordinary inputs give none."""
import math
import warnings

import numpy as np
import pytest

import gdn_ext

B, T, H, D = 2, 6, 2, 4


def _inputs(rng, gate="alpha", T=T, H=H):
    """Ordinary inputs: unit keys, beta in [0, 1], alpha in [0.5, 1] (or its log)."""
    k = rng.standard_normal((B, T, H, D))
    x = dict(q=rng.standard_normal((B, T, H, D)), k=k / np.linalg.norm(k, axis=-1, keepdims=True),
             v=rng.standard_normal((B, T, H, D)), beta=rng.uniform(0, 1, (B, T, H)))
    alpha = rng.uniform(0.5, 1, (B, T, H))
    x[gate] = alpha if gate == "alpha" else np.log(alpha)
    return x


def _caught(call):
    """The warnings a call issues, every one (no once-per-line filtering)."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        call()
    return w


def _silent(call):
    """The call issues no warning at all (asserted); returns what it returned."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = call()
    assert [str(r.message) for r in w] == []
    return out


def _expect(w, words, lineno=None):
    """Exactly one warning containing ``words``, a UserWarning issued at this file (and line)."""
    hits = [r for r in w if words in str(r.message)]
    assert len(hits) == 1, [str(r.message) for r in w]
    r = hits[0]
    assert issubclass(r.category, UserWarning)
    assert r.filename == __file__, (r.filename, str(r.message))
    if lineno is not None:
        assert r.lineno == lineno, (r.lineno, lineno)
    assert "check_values=False turns this warning off" in str(r.message)


# The bad inputs, by what the warning names. "big keys": unit-variance keys x 10 with beta in
# [0, 1], the case that overflows with no warning in gdn_ext 0.x.
BAD = {
    "alpha": ("alpha has values outside [0, 1]", lambda x: x.update(alpha=x["alpha"] * 3)),
    "g": ("g has values above 0", lambda x: x.update(g=x["g"] + 0.5)),
    "beta": ("beta has values outside [0, 2]", lambda x: x.update(beta=x["beta"] + 4)),
    "negative beta": ("beta has values outside [0, 2]", lambda x: x.update(beta=-x["beta"])),
    "big keys": ("beta * ||k||^2 is above 2", lambda x: x.update(k=x["k"] * 10 * math.sqrt(D))),
}


def _bad(name, seed=0):
    words, change = BAD[name]
    x = _inputs(np.random.default_rng(seed), gate="g" if name == "g" else "alpha")
    change(x)
    return x, words


# ---- NumPy --------------------------------------------------------------------------------------

@pytest.mark.parametrize("api", ["forward", "backward", "step"])
def test_numpy_big_keys_warn(api):
    """beta ||k||^2 far above 2 with beta in [0, 1]: the state can grow, and a warning says so;
    normalize_qk=True makes the keys unit, and then beta in [0, 1] is in range."""
    x, words = _bad("big keys")
    q, k, v = x.pop("q"), x.pop("k"), x.pop("v")

    def call(**extra):
        if api == "forward":
            return gdn_ext.gated_delta_rule(q, k, v, **x, **extra)
        if api == "backward":
            return gdn_ext.gated_delta_rule_backward(v, q, k, v, **x, **extra)
        return gdn_ext.gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], state=None, **extra,
                                             **{n: a[:, 0] for n, a in x.items()})

    _expect(_caught(call), words)
    _silent(lambda: call(check_values=False))
    _silent(lambda: call(normalize_qk=True))          # unit keys in the kernel: in range


def test_small_decay_keeps_big_keys_quiet():
    """alpha (1 - beta ||k||^2) is the transition along k: beta ||k||^2 = 3 with alpha = 0.4
    shrinks the state (|0.4 * -2| < 1), so no warning; with alpha = 0.6 it grows (1.2): warning.
    Per-key gates use their largest decay."""
    rng = np.random.default_rng(2)
    x = _inputs(rng)
    x["beta"] = np.full((B, T, H), 0.75)
    k = x["k"] * 2                                        # ||k||^2 = 4: beta ||k||^2 = 3
    args = (x["q"], k, x["v"])
    o, _ = _silent(lambda: gdn_ext.gated_delta_rule(*args, beta=x["beta"],
                                                   alpha=np.full((B, T, H), 0.4)))
    assert np.all(np.abs(o) < 100)                       # what the quiet case promises: bounded
    w = _caught(lambda: gdn_ext.gated_delta_rule(*args, beta=x["beta"],
                                                 alpha=np.full((B, T, H), 0.6)))
    _expect(w, "beta * ||k||^2 is above 2")
    per_key = np.full((B, T, H, D), 0.4)
    o, _ = _silent(lambda: gdn_ext.gated_delta_rule(*args, beta=x["beta"], alpha=per_key))
    assert np.all(np.abs(o) < 100)
    per_key[0, 3, 1, 2] = 0.6
    _expect(_caught(lambda: gdn_ext.gated_delta_rule(*args, beta=x["beta"], alpha=per_key)),
            "beta * ||k||^2 is above 2")


def test_single_head_and_grouped_heads_check_the_right_keys():
    """Single-head form and grouped value heads (HV = 2 H: value head hv reads key head
    hv // 2): the product pairs each beta with its own key."""
    rng = np.random.default_rng(3)
    x = _inputs(rng)
    # single-head: one big key at (b=1, t=2) with a big beta there only
    q, k, v = x["q"][:, :, 0], x["k"][:, :, 0].copy(), x["v"][:, :, 0]
    beta, alpha = x["beta"][:, :, 0].copy(), x["alpha"][:, :, 0]
    beta[:] = 0.1
    k[1, 2] *= 5                                         # ||k||^2 = 25, beta = 0.1: 2.5 > 2
    ones = np.ones_like(alpha)
    _expect(_caught(lambda: gdn_ext.gated_delta_rule(q, k, v, beta=beta, alpha=ones)),
            "beta * ||k||^2 is above 2")
    beta[1, 2] = 0.01                                    # 0.25: fine
    _silent(lambda: gdn_ext.gated_delta_rule(q, k, v, beta=beta, alpha=ones))
    # grouped: key head 1 is big; value heads 2, 3 read it, 0, 1 do not
    HV = 2 * H
    k = x["k"].copy()
    k[:, :, 1] *= 3                                      # ||k||^2 = 9
    v = rng.standard_normal((B, T, HV, D))
    beta = np.full((B, T, HV), 0.1)
    beta[:, :, :2] = 1.0                                 # big beta on the small keys: 1 <= 2
    _silent(lambda: gdn_ext.gated_delta_rule(x["q"], k, v, beta=beta, alpha=np.ones((B, T, HV))))
    beta[:, :, 3] = 1.0                                  # 9 on value head 3 (key head 1)
    _expect(_caught(lambda: gdn_ext.gated_delta_rule(x["q"], k, v, beta=beta,
                                                     alpha=np.ones((B, T, HV)))),
            "beta * ||k||^2 is above 2")


@pytest.mark.parametrize("gate", ["per head", "per key"])
def test_big_keys_in_many_pieces_give_the_whole_arrays_numbers(gate):
    """The beta ||k||^2 check reads k by pieces of tokens (Ctrl-C between them): with keys of
    1 700 tokens x 2 heads x 96 (several pieces), grouped value heads and the worst step in a
    late piece, the warning's three numbers are those of the whole arrays."""
    rng = np.random.default_rng(8)
    B, T, H, G, Dk = 2, 1700, 2, 2, 96
    k = rng.standard_normal((B, T, H, Dk)) / np.sqrt(Dk)
    k[1, 1500, 1] *= 4.0                                 # ||k||^2 about 16 there
    beta = rng.uniform(0.0, 0.1, (B, T, H * G))
    beta[1, 1500, 3] = 0.5                               # value head 3 reads key head 1
    shape = (B, T, H * G) if gate == "per head" else (B, T, H * G, Dk)
    a = rng.uniform(0.5, 1.0, shape)
    kk = np.einsum("bthd,bthd->bth", k, k)
    x = beta.reshape(B, T, H, G) * kk[..., None]
    a_max = a.reshape(B, T, H, G) if gate == "per head" else a.reshape(B, T, H, G, Dk).max(-1)
    worst = np.where(x > 2, a_max * (x - 1), 0).max()
    assert worst > 1
    q = rng.standard_normal((B, T, H, Dk))
    v = rng.standard_normal((B, T, H * G, 3))
    w = _caught(lambda: gdn_ext.gated_delta_rule(q, k, v, beta=beta, alpha=a))
    m = [str(r.message) for r in w if "beta * ||k||^2" in str(r.message)]
    assert len(m) == 1, m
    for number in (x.max(), kk.max(), worst):
        assert f"{number:.3g}" in m[0], (f"{number:.3g}", m[0])


def test_linear_attention_takes_any_beta():
    """delta_rule=False writes beta v k^T: beta only scales the write, nothing diverges from it;
    no beta warning there (the decay's still stands)."""
    x, _ = _bad("beta")
    x["k"] = x["k"] * 10
    args = (x.pop("q"), x.pop("k"), x.pop("v"))
    o, S = _silent(lambda: gdn_ext.gated_delta_rule(*args, **x, delta_rule=False))
    ref = gdn_ext.reference.gated_delta_rule(*args, **x, delta_rule=False)
    assert np.allclose(o, ref[0], rtol=1e-10, atol=1e-8) and np.allclose(S, ref[1], rtol=1e-10,
                                                                          atol=1e-8)
    x["alpha"] = x["alpha"] * 3
    _expect(_caught(lambda: gdn_ext.gated_delta_rule(*args, **x, delta_rule=False)),
            "alpha has values outside [0, 1]")


# ---- torch --------------------------------------------------------------------------------------

def _torch():
    return pytest.importorskip("torch")


def _tensors(x, requires_grad=False):
    torch = _torch()
    return {n: torch.tensor(a, requires_grad=requires_grad and n in "qkv") for n, a in x.items()}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_torch_function_warns_at_the_callers_line(bad):
    import gdn_ext.torch as gt
    x, words = _bad(bad)
    t = _tensors(x, requires_grad=True)
    q, k, v = t.pop("q"), t.pop("k"), t.pop("v")
    w = _caught(lambda: gt.gated_delta_rule(q, k, v, **t))
    _expect(w, words)
    _silent(lambda: gt.gated_delta_rule(q, k, v, **t, check_values=False))


def test_torch_function_head_first_layout_warns():
    """[B, H, T, D] tensors (H = 3 heads, T = 8 tokens) passed as [B, T, H, D]: T = 3 < H = 8."""
    torch = _torch()
    import gdn_ext.torch as gt
    q = torch.randn(B, 3, 8, D, dtype=torch.float64)
    gates = torch.full((B, 3, 8), 0.5, dtype=torch.float64)
    k = torch.nn.functional.normalize(q, dim=-1)
    w = _caught(lambda: gt.gated_delta_rule(q, k, q, beta=gates, alpha=gates))
    _expect(w, "T = 3 < H = 8: if it is head-first")
    _silent(lambda: gt.gated_delta_rule(q, k, q, beta=gates, alpha=gates, check_values=False))
    _silent(lambda: gt.gated_delta_rule(q[:, :1], k[:, :1], q[:, :1], beta=gates[:, :1],
                                        alpha=gates[:, :1]))       # decoding: T = 1


def test_torch_ordinary_inputs_are_silent_in_every_form():
    """Unit keys, beta in [0, 1], alpha in [0.5, 1]: no warning for the plain, single-head,
    per-key, grouped and packed forms, forward and backward, nor under checkpointing."""
    torch = _torch()
    import gdn_ext.torch as gt
    x = _inputs(np.random.default_rng(4))
    t = _tensors(x, requires_grad=True)
    q, k, v = t.pop("q"), t.pop("k"), t.pop("v")

    def run():
        o, S = gt.gated_delta_rule(q, k, v, **t)
        (o.sum() + S.sum()).backward()
        gt.gated_delta_rule(q[:, :, 0], k[:, :, 0], v[:, :, 0], beta=t["beta"][:, :, 0],
                            alpha=t["alpha"][:, :, 0])
        gt.gated_delta_rule(q, k, v, beta=t["beta"], alpha=t["alpha"][..., None].expand(B, T, H, D))
        vv = torch.cat([v, v], 2)
        gt.gated_delta_rule(q, k, vv, beta=torch.cat([t["beta"]] * 2, 2),
                            alpha=torch.cat([t["alpha"]] * 2, 2))
        gt.gated_delta_rule(q[:1], k[:1], v[:1], beta=t["beta"][:1], alpha=t["alpha"][:1],
                            cu_seqlens=[0, 2, T])
        torch.utils.checkpoint.checkpoint(
            lambda a: gt.gated_delta_rule(a, k, v, **t)[0], q, use_reentrant=False).sum().backward()
    _silent(run)


def test_torch_big_keys_warn_through_checkpointing_and_not_while_compiling():
    """The warning comes from the Python front end before the custom operator runs, so it points
    at the user's line through torch.utils.checkpoint (forward and recomputation); under
    torch.compile(fullgraph=True) the checks are skipped and tracing does not break."""
    torch = _torch()
    import gdn_ext.torch as gt
    x, words = _bad("big keys")
    t = _tensors(x, requires_grad=True)
    q, k, v = t.pop("q"), t.pop("k"), t.pop("v")

    def layer(a):
        return gt.gated_delta_rule(a, k, v, **t)[0]      # the user's line

    lineno = layer.__code__.co_firstlineno + 1
    w = _caught(lambda: torch.utils.checkpoint.checkpoint(layer, q, use_reentrant=False)
                .sum().backward())
    hits = [r for r in w if words in str(r.message)]
    assert len(hits) == 2 and all(r.filename == __file__ and r.lineno == lineno for r in hits)

    compiled = torch.compile(lambda a, b, c, be, al: gt.gated_delta_rule(a, b, c, beta=be,
                                                                         alpha=al)[0],
                             fullgraph=True, dynamic=False)
    args = (q.detach(), k.detach(), v.detach(), t["beta"], t["alpha"])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        o = compiled(*args)
    assert not [r for r in w if "check_values" in str(r.message)]
    torch.testing.assert_close(o, gt.gated_delta_rule(*args[:3], beta=args[3], alpha=args[4],
                                                      check_values=False)[0])


# ---- flash-linear-attention drop-ins ------------------------------------------------------------

def _fla(name):
    import gdn_ext.torch as gt
    return getattr(gt, name)


def _fla_inputs(seed=5, T=T, H=H):
    torch = _torch()
    x = _inputs(np.random.default_rng(seed), gate="g", T=T, H=H)
    t = {n: torch.tensor(a) for n, a in x.items()}
    return t["q"], t["k"], t["v"], t["g"], t["beta"]


FLA = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]


def test_torch_floating_point_warnings_point_at_the_callers_line():
    """An overflow inside the kernels, through gdn_ext.torch's forward, a drop-in's forward and
    the backward that autograd runs: NumPy's RuntimeWarning names this file's lines, not torch's
    custom-operator machinery."""
    torch = _torch()
    import gdn_ext.torch as gt
    r = np.random.default_rng(0)
    q, k, v = (torch.tensor(r.standard_normal((1, 3000, 1, 16)), requires_grad=True)
               for _ in range(3))
    one = torch.ones(1, 3000, 1, dtype=torch.float64)
    with np.errstate(over="warn", invalid="warn"):
        w = _caught(lambda: gt.gated_delta_rule(q, k, v, beta=one, alpha=one,
                                                check_values=False))
        assert w and all(x.filename == __file__ for x in w), [(x.filename, x.lineno) for x in w]
        out = []
        w = _caught(lambda: out.append(gt.chunk_gated_delta_rule(
            q, k, v, torch.zeros_like(one), one, scale=1.0, check_values=False)[0]))
        assert w and all(x.filename == __file__ for x in w), [(x.filename, x.lineno) for x in w]
        w = _caught(lambda: out[0].sum().backward())
        assert w and all(x.filename == __file__ for x in w), [(x.filename, x.lineno) for x in w]


@pytest.mark.parametrize("fn", FLA)
def test_fla_values_warn_on_what_the_recurrence_sees(fn):
    torch = _torch()
    f = _fla(fn)
    q, k, v, g, beta = _fla_inputs()
    _silent(lambda: f(q, k, v, g=g, beta=beta))
    _silent(lambda: f(q, k * 10, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True))
    cases = [
        (dict(g=g + 1), "g has values above 0"),
        (dict(g=g, beta=beta * 5), "beta has values outside [0, 2]"),
        (dict(g=g, k=k * 10), "beta * ||k||^2 is above 2"),
        (dict(g=None, gk=g[..., None].expand(B, T, H, D) + 1), "gk has values above 0"),
    ]
    if fn == "fused_recurrent_gated_delta_rule":
        cases.append((dict(g=g, gk=torch.ones(B, T, H, D, dtype=g.dtype)),
                      "g + gk has values above 0"))
    for kw, words in cases:
        kw = {"k": k, "beta": beta, **kw}
        kk = kw.pop("k")
        w = _caught(lambda: f(q, kk, v, **kw))
        _expect(w, words)
        _silent(lambda: f(q, kk, v, **kw, check_values=False))
    # gates computed in the kernel are what the recurrence sees: in range whatever the inputs
    A_log = torch.zeros(H, dtype=g.dtype)
    _silent(lambda: f(q, k, v, g=g * 100 + 50, beta=beta * 100 - 50, use_gate_in_kernel=True,
                      A_log=A_log, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True))


@pytest.mark.parametrize("fn", FLA)
def test_fla_head_first_layout_warns(fn):
    f = _fla(fn)
    q, k, v, g, beta = _fla_inputs(T=3, H=8)          # [B, H, T, K] read as [B, T, H, K]
    w = _caught(lambda: f(q, k, v, g=g, beta=beta))
    _expect(w, "[B, T, H, K] = [2, 3, 8, 4] with T = 3 < H = 8")
    _silent(lambda: f(q, k, v, g=g, beta=beta, check_values=False))
    _silent(lambda: f(q[:, :1], k[:, :1], v[:, :1], g=g[:, :1], beta=beta[:, :1]))
    with pytest.raises(TypeError, match="check_values must be a bool"):
        f(q, k, v, g=g, beta=beta, check_values="no")


def test_torch_layer_short_prompt_is_silent():
    """GatedDeltaNet with more heads than tokens (a short prompt, then decoding): its gates are
    in range and its layout fixed, so no warning (it turns the drop-in's checks off)."""
    torch = _torch()
    import gdn_ext.torch as gt
    torch.manual_seed(0)
    layer = gt.GatedDeltaNet(16, num_k_heads=4, num_v_heads=8, head_k_dim=4, head_v_dim=4,
                             dtype=torch.float64)
    x = torch.randn(2, 3, 16, dtype=torch.float64)

    def run():
        y, s = layer(x)
        layer(x[:, :1], s)[0].sum().backward()
    _silent(run)


# ---- dask ---------------------------------------------------------------------------------------

def _dask():
    pytest.importorskip("dask")
    import dask.array as da
    import gdn_ext.dask as gd
    return da, gd


def _chunked(x):
    da, _ = _dask()
    return {n: da.from_array(a, chunks=(1,) + a.shape[1:2] + (1,) + a.shape[3:])
            for n, a in x.items()}


@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("scheduler", ["threads", "sync"])
def test_dask_values_warn_at_compute_time_at_the_callers_line(bad, scheduler):
    """Values are unknown when the graph is built: no warning then; computing it warns (from
    each chunk's values, on dask's threads too), pointing at the line that built the graph."""
    import dask
    _, gd = _dask()
    x, words = _bad(bad)
    c = _chunked(x)
    q, k, v = c.pop("q"), c.pop("k"), c.pop("v")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        o, S = gd.gated_delta_rule(q, k, v, **c); line = _lineno()    # noqa: E702
        grads = gd.gated_delta_rule_backward(o, q, k, v, **c); bline = _lineno()   # noqa: E702
    assert not w, [str(r.message) for r in w]
    w = _caught(lambda: dask.compute(o, S, scheduler=scheduler))
    hits = [r for r in w if words in str(r.message)]
    assert hits and all(r.filename == __file__ and r.lineno == line for r in hits), \
        [(r.filename, r.lineno, str(r.message)) for r in w]
    assert "in a dask chunk" in str(hits[0].message)
    w = _caught(lambda: dask.compute(grads.dq, scheduler=scheduler))
    assert any(words in str(r.message) and r.lineno == bline and r.filename == __file__
               for r in w)
    o, S = gd.gated_delta_rule(q, k, v, **c, check_values=False)
    grads = gd.gated_delta_rule_backward(o, q, k, v, **c, check_values=False)
    _silent(lambda: dask.compute(o, S, grads.dq, scheduler=scheduler))


@pytest.mark.parametrize("mode", ["raise", "ignore", "warn"])
@pytest.mark.parametrize("scheduler", ["threads", "sync"])
@pytest.mark.parametrize("api", ["forward", "backward"])
def test_dask_floating_point_errors_follow_the_graphs_errstate(mode, scheduler, api):
    """An overflow in a chunk (exp of a float32 gate g = 100) follows the np.errstate in force
    when the graph was built -- dask's threads do not inherit it: errstate(over="raise") raised
    nothing and "ignore" still warned -- and warns at the line that built the graph."""
    import dask
    da, gd = _dask()
    rng = np.random.default_rng(9)
    B, T, H, D = 2, 20, 2, 4
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    k = q / np.linalg.norm(q, axis=-1, keepdims=True)
    g = np.full((B, T, H), -0.1, np.float32)
    g[1, 3, 0] = 100.0
    x = _chunked(dict(q=q, k=k, v=q, beta=np.full((B, T, H), 0.5, np.float32), g=g))
    q_, k_, v_ = x.pop("q"), x.pop("k"), x.pop("v")

    def build():   # the user's line: the call below
        if api == "forward":
            return gd.gated_delta_rule(q_, k_, v_, check_values=False, **x).o
        return gd.gated_delta_rule_backward(v_, q_, k_, v_, check_values=False, **x).dq
    line = build.__code__.co_firstlineno + (2 if api == "forward" else 3)
    with np.errstate(over=mode, invalid="ignore"):
        out = build()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        if mode == "raise":
            with pytest.raises(FloatingPointError, match="overflow encountered in a dask chunk"):
                dask.compute(out, scheduler=scheduler)
        else:
            dask.compute(out, scheduler=scheduler)
    over = [r for r in w if "overflow" in str(r.message)]
    if mode == "warn":
        assert over and all(r.filename == __file__ and r.lineno == line for r in over), \
            [(r.filename, r.lineno, str(r.message)) for r in over]
    else:
        assert not over, [(r.filename, r.lineno, str(r.message)) for r in over]


def _lineno():
    import sys
    return sys._getframe(1).f_lineno


def test_dask_head_first_layout_warns_when_the_graph_is_built():
    import dask
    _, gd = _dask()
    rng = np.random.default_rng(7)
    x = _inputs(rng, T=3, H=8)
    c = _chunked(x)
    q, k, v = c.pop("q"), c.pop("k"), c.pop("v")
    w = _caught(lambda: gd.gated_delta_rule(q, k, v, **c))
    _expect(w, "T = 3 < H = 8: if it is head-first")
    _silent(lambda: dask.compute(*gd.gated_delta_rule(q, k, v, **c, check_values=False)))
    _silent(lambda: dask.compute(*gd.gated_delta_rule(q[:, :1], k[:, :1], v[:, :1],
                                                      beta=c["beta"][:, :1],
                                                      alpha=c["alpha"][:, :1])))


def test_dask_ordinary_inputs_are_silent():
    import dask
    _, gd = _dask()
    x = _inputs(np.random.default_rng(8), gate="g")
    c = _chunked(x)
    q, k, v = c.pop("q"), c.pop("k"), c.pop("v")

    def run():
        o, S = gd.gated_delta_rule(q, k, v, **c)
        g = gd.gated_delta_rule_backward(o, q, k, v, **c)
        first = dask.compute(o, S, *g)
        o, S = gd.gated_delta_rule(q, k * 10, v, **c, normalize_qk=True)
        return first, dask.compute(o, S)
    (o, S, *g), (o2, S2) = _silent(run)
    # and the results are NumPy's
    want = gdn_ext.gated_delta_rule(**x)
    assert np.allclose(o, want[0], rtol=1e-12, atol=1e-12) and np.allclose(S, want[1], rtol=1e-12,
                                                                            atol=1e-12)
    want = gdn_ext.gated_delta_rule(x["q"], x["k"] * 10, x["v"], beta=x["beta"], g=x["g"],
                                    normalize_qk=True)
    assert np.allclose(o2, want[0], rtol=1e-12, atol=1e-12)
    assert len(g) == 6 and all(np.all(np.isfinite(a)) for a in g)


def test_the_compiled_screen_gives_the_numpy_checks_messages():
    """Small float32 / float64 arrays (a decoding step's) are screened in one compiled pass:
    every message is the one NumPy's passes give, for values around every threshold (beta and
    beta ||k||^2 at 2, alpha at 0 and 1, g at 0), NaN, inf, signed zeros, keys whose float32
    squares overflow or underflow, each array float32 or float64, grouped heads and per-key
    gates. 600 random cases: a wrong range, a NaN let through or a screen that skipped a step
    NumPy puts above 2 shows as a different message (the rarer kinds a longer fuzz found are the
    next test's)."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from gdn_ext import _checks

    special = [0.0, -0.0, 1.0, 2.0, 1e-30, np.nan, np.inf, -np.inf, -1e-7, 1 + 1e-7, 2 + 1e-6,
               2 - 1e-6, 1e19, 1e20, 3e-23, 1e-39, 2e45, 1e-45, 3e38]

    @st.composite
    def cases(draw):
        dts = [draw(st.sampled_from([np.float32, np.float64])) for _ in range(3)]
        Bn, Tn, Hn, G, Dk = (draw(st.integers(1, n)) for n in (2, 3, 3, 2, 6))
        per_key = draw(st.booleans())
        log_gate = draw(st.booleans())
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        k = rng.standard_normal((Bn, Tn, Hn, Dk))
        if draw(st.booleans()):   # unit keys, whose beta ||k||^2 sits at beta, 2 included
            k /= np.linalg.norm(k, axis=-1, keepdims=True)
        beta = rng.uniform(0, 2.2, (Bn, Tn, Hn * G))
        gate = rng.uniform(-0.1, 1.05, (Bn, Tn, Hn * G) + ((Dk,) if per_key else ()))
        for a in (k, beta, gate):   # some elements at the thresholds and the special values
            flat = a.reshape(-1)
            for i in draw(st.lists(st.integers(0, flat.size - 1), max_size=3)):
                flat[i] = draw(st.sampled_from(special))
        with np.errstate(over="ignore"):
            arrays = [x.astype(dt) for x, dt in zip((beta, gate, k), dts)]
        return arrays + [log_gate, draw(st.booleans())]

    @settings(max_examples=600, deadline=None, derandomize=True)
    @given(cases())
    def check(case):
        beta, gate, k, log_gate, normalize = case
        kw = dict(log_gate=log_gate, normalize_qk=normalize)
        assert _checks._screen(beta, gate, k) is not None     # the compiled path ran
        with np.errstate(all="ignore"):   # NumPy's own sums overflow for some of these keys
            fast = _checks.value_messages(beta, gate, k, **kw)
        screen, _checks._screen = _checks._screen, lambda *a: None
        try:
            with np.errstate(all="ignore"):
                slow = _checks.value_messages(beta, gate, k, **kw)
        finally:
            _checks._screen = screen
        assert fast == slow
    check()


@pytest.mark.parametrize("case", ["float32 sum overflows", "float32 squares underflow",
                                  "signed zero minimum"])
def test_the_screen_leaves_what_it_cannot_settle_to_numpy(case, monkeypatch):
    """The step's warnings with the compiled screen are NumPy's where NumPy's own float32 sums
    differ from the true ||k||^2: a sum that overflows (beta 1e-39: NumPy warns, up to inf), a
    square that rounds up to the least subnormal (beta 2e45 in float64: NumPy's 2.8 warns), and
    the sign NumPy prints for a zero minimum. Each gave another message before the fix (a fuzzer
    found 87 cases of these kinds in 55 000; the test above, with 600, none)."""
    from gdn_ext import _checks
    f32 = np.float32
    if case == "float32 sum overflows":
        kw = dict(q_t=np.ones((1, 1, 4), f32), k_t=np.full((1, 1, 4), 1e19, f32),
                  beta=np.full((1, 1), 1e-39, f32))
    elif case == "float32 squares underflow":
        kw = dict(q_t=np.ones((1, 1, 1), f32), k_t=np.full((1, 1, 1), 3e-23, f32),
                  beta=np.full((1, 1), 2e45))
    else:
        H = 20
        k = np.zeros((1, H, 2), f32)
        k[..., 0] = 1
        kw = dict(q_t=k.copy(), k_t=k, beta=np.array([[0.0] + [-0.0] * (H - 2) + [5.0]], f32))
    H, Dk = kw["k_t"].shape[1:]
    # alpha 0.9: the transition along k, alpha (beta ||k||^2 - 1), exceeds 1 at NumPy's 2.8
    kw.update(v_t=np.ones((1, H, Dk), f32), alpha=np.full((1, H), 0.9, f32))

    def messages():
        with np.errstate(all="ignore"):
            return [str(w.message) for w in _caught(lambda: gdn_ext.gated_delta_rule_step(**kw))]
    fast = messages()
    monkeypatch.setattr(_checks, "_screen", lambda *a: None)
    assert fast == messages()
    assert any("beta" in m for m in fast)
