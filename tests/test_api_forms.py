"""What a user types: scalars and broadcastable beta / alpha / g, the step's default state, and
the forward's named-tuple result, in the NumPy and dask front ends."""
import numpy as np
import pytest

import gdn_ext
from gdn_ext.recurrence import sum_to
from helpers import central_differences

B, T, H, HV, Dk, Dv = 2, 6, 2, 4, 3, 5


def _qkv(dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, Dk))
    k = rng.standard_normal((B, T, H, Dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    return q.astype(dtype), k.astype(dtype), rng.standard_normal((B, T, HV, Dv)).astype(dtype)


# (beta as given, gate as given, per_key): each broadcasts to [B, T, HV] (gate: or [.., Dk])
FORMS = [
    (0.5, 0.9, False),                                   # Python numbers: one for everything
    (1, 1, False),                                       # ints: DeltaNet's alpha = 1
    (np.linspace(0.2, 0.8, HV), np.array(0.95), False),  # one per head; a 0-d array
    (np.full((B, 1, 1), 0.4), np.linspace(0.6, 0.99, T)[:, None], False),  # per sequence / step
    (0.5, np.linspace(0.7, 0.99, HV * Dk).reshape(1, 1, HV, Dk), True),    # per head and key
    (0.5, np.linspace(0.7, 0.99, Dk)[None, None, None], True),             # per key channel
]


def _full(x, per_key, dtype):
    shape = (B, T, HV, Dk) if per_key else (B, T, HV)
    return np.ascontiguousarray(np.broadcast_to(np.asarray(x, dtype), shape))


@pytest.mark.parametrize("beta,gate,per_key", FORMS)
@pytest.mark.parametrize("gate_name", ["alpha", "g"])
def test_broadcast_forward_equals_full_arrays(beta, gate, per_key, gate_name):
    """Bitwise the call with the arrays written out in full, in float32 (Python numbers and
    float64 arrays given with float32 q, k, v: as NumPy would choose the dtype)."""
    q, k, v = _qkv(np.float32)
    if gate_name == "g":
        gate = np.log(gate) if not isinstance(gate, (int, float)) else float(np.log(gate))
    dtype = np.result_type(np.float32, *(x for x in (beta, gate)
                                         if type(x) not in (int, float)))
    got = gdn_ext.gated_delta_rule(q, k, v, beta=beta, **{gate_name: gate})
    want = gdn_ext.gated_delta_rule(q, k, v, beta=_full(beta, False, dtype),
                                    **{gate_name: _full(gate, per_key, dtype)})
    assert got.o.dtype == dtype
    np.testing.assert_array_equal(got.o, want.o)
    np.testing.assert_array_equal(got.S_T, want.S_T)


@pytest.mark.parametrize("beta,gate,per_key", FORMS)
@pytest.mark.parametrize("gate_name", ["alpha", "g"])
def test_broadcast_gradients_are_summed_to_the_given_shape(beta, gate, per_key, gate_name):
    q, k, v = _qkv(np.float64, 1)
    if gate_name == "g":
        gate = np.log(gate) if not isinstance(gate, (int, float)) else float(np.log(gate))
    do = np.random.default_rng(2).standard_normal((B, T, HV, Dv))
    got = gdn_ext.gated_delta_rule_backward(do, q, k, v, beta=beta, **{gate_name: gate})
    full = gdn_ext.gated_delta_rule_backward(do, q, k, v, beta=_full(beta, False, np.float64),
                                             **{gate_name: _full(gate, per_key, np.float64)})
    dgate = got.dg if gate_name == "g" else got.dalpha
    dgate_full = full.dg if gate_name == "g" else full.dalpha
    assert isinstance(got.dbeta, np.ndarray) and got.dbeta.shape == np.shape(beta)
    assert isinstance(dgate, np.ndarray) and dgate.shape == np.shape(gate)
    for want_shape, x, x_full in ((np.shape(beta), got.dbeta, full.dbeta),
                                  (np.shape(gate), dgate, dgate_full)):
        lead = x_full.ndim - len(want_shape)
        axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(want_shape)
                                          if n == 1)
        np.testing.assert_allclose(x, x_full.sum(axis=axes).reshape(want_shape), rtol=1e-12,
                                   atol=1e-12)
    np.testing.assert_array_equal(got.dv, full.dv)


def test_scalar_gradients_match_finite_differences():
    """d loss / d beta and d loss / d g for scalar beta and g, against central differences of
    the forward in float64."""
    q, k, v = _qkv(np.float64, 3)
    do = np.random.default_rng(4).standard_normal((B, T, HV, Dv))
    beta, g = 0.6, -0.2
    grads = gdn_ext.gated_delta_rule_backward(do, q, k, v, beta=beta, g=g)

    def loss(x):   # the scalars as Python numbers, as a user passes them
        o = gdn_ext.gated_delta_rule(q, k, v, beta=float(x["beta"]), g=float(x["g"])).o
        return float(np.sum(do * o))
    fd = central_differences(loss, {"beta": np.array(beta), "g": np.array(g)})
    np.testing.assert_allclose(grads.dbeta, fd["beta"], rtol=1e-7)
    np.testing.assert_allclose(grads.dg, fd["g"], rtol=1e-7)


def test_python_numbers_keep_float32_and_numpy_scalars_do_not():
    q, k, v = _qkv(np.float32)
    assert gdn_ext.gated_delta_rule(q, k, v, beta=0.5, alpha=1).o.dtype == np.float32
    assert gdn_ext.gated_delta_rule(q, k, v, beta=np.float32(0.5), alpha=1.0).o.dtype == np.float32
    # a NumPy float64 scalar is a float64 input, as in any NumPy ufunc
    assert gdn_ext.gated_delta_rule(q, k, v, beta=np.float64(0.5), alpha=1.0).o.dtype == np.float64


@pytest.mark.parametrize("bad,name", [
    (dict(beta=np.ones(3)), "beta"),                      # 3 heads for HV = 4
    (dict(alpha=np.ones((T + 1, 1))), "alpha"),           # T + 1 steps
    (dict(alpha=np.ones((1, 1, 1, HV, Dk))), "alpha"),    # too many dimensions
    (dict(beta=np.ones((1, 1, HV, Dk))), "beta"),         # beta has no per-key form
])
def test_shapes_that_do_not_broadcast_are_named(bad, name):
    q, k, v = _qkv(np.float64)
    kw = dict(beta=0.5, alpha=0.9)
    kw.update(bad)
    with pytest.raises(ValueError, match=f"^{name} must have shape .* broadcasts to that shape"):
        gdn_ext.gated_delta_rule(q, k, v, **kw)


def test_broadcast_inputs_are_not_modified():
    q, k, v = _qkv(np.float64)
    beta, alpha = np.linspace(0.2, 0.8, HV), np.full((B, 1, 1), 0.9)
    copies = [x.copy() for x in (beta, alpha)]
    gdn_ext.gated_delta_rule_backward(np.ones((B, T, HV, Dv)), q, k, v, beta=beta, alpha=alpha)
    for x, c in zip((beta, alpha), copies):
        np.testing.assert_array_equal(x, c)


def test_step_takes_numbers_and_starts_from_zeros_by_default():
    q, k, v = _qkv(np.float32)
    o1, S1 = gdn_ext.gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], beta=0.5, alpha=0.9)
    want = gdn_ext.gated_delta_rule(q[:, :1], k[:, :1], v[:, :1], beta=0.5, alpha=0.9)
    assert o1.dtype == np.float32
    np.testing.assert_allclose(o1, want.o[:, 0], rtol=1e-6)
    np.testing.assert_allclose(S1, want.S_T, rtol=1e-6)
    o2, _ = gdn_ext.gated_delta_rule_step(q[:, 1], k[:, 1], v[:, 1], beta=np.full(HV, 0.5),
                                          g=np.log(np.full((B, 1), 0.9)), state=S1)
    want2 = gdn_ext.gated_delta_rule(q[:, :2], k[:, :2], v[:, :2], beta=0.5, alpha=0.9)
    np.testing.assert_allclose(o2, want2.o[:, 1], rtol=1e-5)


def test_forward_returns_named_tuples():
    q, k, v = _qkv(np.float64)
    out = gdn_ext.gated_delta_rule(q, k, v, beta=0.5, alpha=0.9)
    assert type(out) is gdn_ext.GatedDeltaRuleOutput and out._fields == ("o", "S_T")
    o, S_T = out
    assert o is out.o and S_T is out.S_T and S_T.shape == (B, HV, Dv, Dk)
    assert "o=array(shape=[2, 6, 4, 5], dtype=float64)" in repr(out)
    ck = gdn_ext.gated_delta_rule(q, k, v, beta=0.5, alpha=0.9, return_checkpoints=True)
    assert type(ck) is gdn_ext.GatedDeltaRuleOutputWithCheckpoints
    assert ck._fields == ("o", "S_T", "checkpoints")
    np.testing.assert_array_equal(ck.o, o)
    assert gdn_ext.gated_delta_rule(q, k, v, beta=0.5, alpha=0.9,
                                    output_final_state=False).S_T is None


def test_sum_to():
    x = np.arange(24.0).reshape(2, 3, 4)
    assert sum_to(x, None) is x
    assert sum_to(x, ()).shape == () and sum_to(x, ()) == x.sum()
    np.testing.assert_array_equal(sum_to(x, (4,)), x.sum(axis=(0, 1)))
    np.testing.assert_array_equal(sum_to(x, (2, 1, 1)), x.sum(axis=(1, 2), keepdims=True))
    np.testing.assert_array_equal(sum_to(x, (3, 1)), x.sum(axis=(0, 2))[:, None])


@pytest.mark.parametrize("shape", [(), (4,), (1, 4), (70000, 1), (3, 1, 4), (3, 70000, 1),
                                   (1, 1, 1), (3, 1, 1), (1, 70000, 4)])
def test_sum_to_by_pieces(shape):
    """A gradient of more than 2^18 elements is summed by pieces of its first axes (Ctrl-C
    between them): the sums of one NumPy call, to rounding, in every broadcast form."""
    x = np.random.default_rng(30).standard_normal((3, 70000, 4))
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape)
                                      if n == 1 and x.shape[lead + i] != 1)
    want = x.sum(axis=axes, keepdims=True).reshape(shape)
    got = sum_to(x, shape)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(x).sum())


def test_grouped_gradients_by_pieces():
    """dq, dk summed over each group of value heads by pieces of tokens, on 1 and 2 threads: the
    same bits either way, equal to summing the value heads' own (the same call without groups,
    k and q repeated per value head)."""
    rng = np.random.default_rng(31)
    B, T, H, G, D = 1, 3000, 2, 2, 32            # dq per value head: 384 000 elements
    q, k = rng.standard_normal((B, T, H, D)), rng.standard_normal((B, T, H, D)) / np.sqrt(D)
    v, do = rng.standard_normal((B, T, H * G, D)), rng.standard_normal((B, T, H * G, D))
    kw = dict(beta=rng.uniform(0, 1, (B, T, H * G)), alpha=rng.uniform(0.9, 1, (B, T, H * G)))
    one = gdn_ext.gated_delta_rule_backward(do, q, k, v, num_threads=1, **kw)
    two = gdn_ext.gated_delta_rule_backward(do, q, k, v, num_threads=2, **kw)
    np.testing.assert_array_equal(one.dq, two.dq)
    np.testing.assert_array_equal(one.dk, two.dk)
    wide = gdn_ext.gated_delta_rule_backward(do, np.repeat(q, G, axis=2), np.repeat(k, G, axis=2),
                                             v, num_threads=1, **kw)
    np.testing.assert_allclose(one.dq, wide.dq.reshape(B, T, H, G, D).sum(3), rtol=1e-12,
                               atol=1e-12)
    np.testing.assert_allclose(one.dk, wide.dk.reshape(B, T, H, G, D).sum(3), rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("beta,gate,per_key", FORMS)
def test_dask_takes_the_same_forms(beta, gate, per_key):
    """gdn_ext.dask: the same results, bitwise, as one NumPy call, and gradients in the shapes
    given (a dask gate broadcast too)."""
    da = pytest.importorskip("dask.array")
    import dask
    import gdn_ext.dask as gd
    q, k, v = _qkv(np.float32, 5)
    chunked = [da.from_array(x, chunks=(1, -1, 1, -1)) for x in (q, k)]
    vd = da.from_array(v, chunks=(1, -1, HV // H, -1))
    gate_d = gate if isinstance(gate, (int, float)) else da.from_array(np.asarray(gate))
    want = gdn_ext.gated_delta_rule(q, k, v, beta=beta, alpha=gate)
    got = dask.compute(*gd.gated_delta_rule(*chunked, vd, beta=beta, alpha=gate_d))
    assert got[0].dtype == want.o.dtype
    np.testing.assert_array_equal(got[0], want.o)
    np.testing.assert_array_equal(got[1], want.S_T)
    do = np.ones_like(v)
    g_np = gdn_ext.gated_delta_rule_backward(do, q, k, v, beta=beta, alpha=gate)
    g_d = dask.compute(*gd.gated_delta_rule_backward(da.from_array(do, chunks=vd.chunks),
                                                    *chunked, vd, beta=beta, alpha=gate_d))
    for a, b in zip(g_np, g_d):
        assert np.shape(a) == np.shape(b)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_api_tour_runs():
    """examples/api_tour.py, the script CI type-checks with mypy --strict, runs as written."""
    import runpy
    from pathlib import Path
    tour = Path(__file__).resolve().parents[1] / "examples" / "api_tour.py"
    if not tour.exists():
        pytest.skip("examples/ is not shipped with the package")
    runpy.run_path(str(tour), run_name="__main__")


@pytest.mark.parametrize("front", ["forward", "backward", "step", "dask"])
def test_torch_tensors_are_refused_with_the_function_that_takes_them(front):
    """The NumPy and dask front ends refuse a torch tensor the same way, naming the argument
    and gdn_ext.torch (a tensor used to come back silently as an ndarray, without its
    gradient)."""
    torch = pytest.importorskip("torch")
    q, k, v = _qkv(np.float64)
    tq = torch.from_numpy(q)
    with pytest.raises(TypeError) as info:
        if front == "forward":
            gdn_ext.gated_delta_rule(tq, k, v, beta=0.5, alpha=0.9)
        elif front == "backward":
            gdn_ext.gated_delta_rule_backward(np.ones((B, T, HV, Dv)), tq, k, v, beta=0.5,
                                              alpha=0.9)
        elif front == "step":
            gdn_ext.gated_delta_rule_step(tq[:, 0], k[:, 0], v[:, 0], beta=0.5, alpha=0.9)
        else:
            pytest.importorskip("dask.array")
            import gdn_ext.dask as gd
            gd.gated_delta_rule(tq, k, v, beta=0.5, alpha=0.9)
    msg = str(info.value)
    name = "q_t" if front == "step" else "q"
    assert msg.startswith(f"{name} is a torch tensor") and "gdn_ext.torch.gated_delta_rule" in msg


def test_readme_examples_pass_mypy_strict(tmp_path):
    """The README's Python examples, as one user script, pass mypy --strict against the installed
    package (run from another folder, so that gdn_ext is found as a user's script finds it)."""
    import re
    import subprocess
    import sys
    from pathlib import Path
    pytest.importorskip("mypy")
    readme = Path(__file__).resolve().parents[1] / "README.md"
    if not readme.exists():
        pytest.skip("no README.md beside the tests")
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), flags=re.S)
    assert blocks
    script = tmp_path / "readme_examples.py"
    script.write_text("\n".join(blocks))
    run = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-incremental",
                          str(script)], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def _front(name):
    """gated_delta_rule of the NumPy, torch or dask front end, on NumPy inputs."""
    if name == "numpy":
        return gdn_ext.gated_delta_rule
    if name == "torch":
        torch = pytest.importorskip("torch")
        import gdn_ext.torch as gt

        def call(q, k, v, **kw):
            kw = {n: torch.from_numpy(x) if isinstance(x, np.ndarray) else x
                  for n, x in kw.items()}
            return gt.gated_delta_rule(torch.from_numpy(q), torch.from_numpy(k),
                                       torch.from_numpy(v), **kw)
        return call
    pytest.importorskip("dask.array")
    import gdn_ext.dask as gd
    return gd.gated_delta_rule


@pytest.mark.parametrize("front", ["numpy", "torch", "dask"])
def test_a_gate_read_per_head_with_dk_entries_warns(front):
    """A gate whose last axis has Dk entries but lines up with the heads (HV = Dk) is one gate
    per head by NumPy's rules, not the per-key gate it looks like: a warning says so and what
    to give instead, at the caller's line; none for the per-key form, for HV != Dk, or with
    check_values=False."""
    fn = _front(front)
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 5, 4, 4))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)    # (no stability warning)
    ambiguous = np.full(4, 0.9)
    with pytest.warns(UserWarning, match=r"alpha of shape \[4\] was broadcast to one gate per "
                                         r"head, \[2, 5, 4\].*e\.g\. shape \[1, 1, 1, 4\]") as w:
        fn(q, q, q, beta=0.5, alpha=ambiguous)
    assert all(r.filename == __file__ for r in w if "broadcast to one gate" in str(r.message))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn(q, q, q, beta=0.5, alpha=ambiguous, check_values=False)
        fn(q, q, q, beta=0.5, alpha=ambiguous.reshape(1, 1, 1, 4))
        v3 = rng.standard_normal((2, 5, 8, 4))      # HV = 8 != Dk: not ambiguous
        fn(q, q, v3, beta=0.5, alpha=np.full(8, 0.9))


def test_single_head_beta_broadcasts_with_its_unit_axis():
    """The single-head form's beta [B, T, 1] broadcasts too ([B, 1, 1]), gradient as given."""
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((2, 5, 3)) for _ in range(3))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta = np.array([0.3, 0.6]).reshape(2, 1, 1)
    got = gdn_ext.gated_delta_rule_backward(np.ones_like(v), q, k, v, beta=beta, alpha=0.9)
    full = gdn_ext.gated_delta_rule_backward(np.ones_like(v), q, k, v,
                                             beta=np.repeat(beta, 5, axis=1), alpha=0.9)
    assert got.dbeta.shape == (2, 1, 1)
    np.testing.assert_allclose(got.dbeta, full.dbeta.sum(axis=1, keepdims=True), rtol=1e-12)
