"""Bad input raises a clear TypeError / ValueError naming the argument and the expected shape."""
import re

import numpy as np
import pytest

import gdn_ext
from helpers import make_inputs, split


@pytest.fixture
def good():
    return make_inputs(np.random.default_rng(60), 2, 5, 3, 4, 6)


def call(inputs, backward=False, **extra):
    args, kw = split(inputs)
    kw.update(extra)
    if backward:
        do = kw.pop("do", np.zeros(inputs["v"].shape))
        return gdn_ext.gated_delta_rule_backward(do, *args, **kw)
    return gdn_ext.gated_delta_rule(*args, **kw)


SHAPE_CASES = [
    # (argument, bad value maker, words the message must contain)
    # a 3-d q is the single-head form, so the mismatch shows at k
    ("q", lambda x: x["q"][0], ["k must have shape [B, T, Dk] (the shape of q)"]),
    ("q", lambda x: x["q"][None], ["q", "[B, T, H, Dk]"]),
    ("k", lambda x: x["k"][:, :4], ["k", "[B, T, H, Dk] (the shape of q) = [2, 5, 3, 4]", "[2, 4, 3, 4]"]),
    ("k", lambda x: x["k"][..., :3], ["k", "[B, T, H, Dk]"]),
    ("v", lambda x: x["v"][:1], ["v", "[B, T, H, Dv]", "[2, 5, 3, Dv]"]),
    ("v", lambda x: x["v"][:, :, :2], ["v", "[B, T, H, Dv]"]),
    ("beta", lambda x: x["beta"][..., None], ["beta", "[B, T, H] = [2, 5, 3]"]),
    ("beta", lambda x: x["beta"][:, :2], ["beta", "[B, T, H]"]),
    # ([:, :, :1] broadcasts: one gate for every head)
    ("alpha", lambda x: x["alpha"][:, :, :2], ["alpha", "[B, T, H] = [2, 5, 3]"]),
    ("initial_state", lambda x: np.swapaxes(x["initial_state"], -1, -2),
     ["initial_state", "[B, H, Dv, Dk] = [2, 3, 6, 4]", "transpose of the expected",
      "flash-linear-attention keeps a state as [..., K, V]", "swapaxes(-1, -2)"]),
    ("initial_state", lambda x: x["initial_state"][0], ["initial_state", "[B, H, Dv, Dk]"]),
]


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("name,make,words", SHAPE_CASES)
def test_wrong_shapes(good, name, make, words, backward):
    bad = dict(good, **{name: make(good)})
    with pytest.raises(ValueError) as info:
        call(bad, backward=backward)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_single_head_form_messages(good):
    sh = make_inputs(np.random.default_rng(61), 2, 5, Dk=4, Dv=6, single_head=True)
    with pytest.raises(ValueError, match=re.escape("beta must have shape [B, T] or [B, T, 1]")):
        call(dict(sh, beta=sh["beta"][..., None, None]))
    with pytest.raises(ValueError, match=re.escape("initial_state must have shape [B, Dv, Dk]")):
        call(dict(sh, initial_state=sh["initial_state"][:, None]))


def test_do_and_dS_T_shapes(good):
    with pytest.raises(ValueError, match=re.escape("do must have shape [B, T, H, Dv]")):
        call(good, backward=True, do=np.zeros((2, 5, 3, 5)))
    with pytest.raises(ValueError, match=re.escape("dS_T must have shape [B, H, Dv, Dk]")
                       + ".*transpose of the expected"):
        call(good, backward=True, dS_T=np.zeros((2, 3, 4, 6)))


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (2, 3, 6, 6), (3, 2, 4, 6), (2, 3, 4)])
def test_a_wrong_state_that_is_no_transpose_gets_no_transpose_hint(good, shape):
    with pytest.raises(ValueError, match="initial_state must have shape") as info:
        call(dict(good, initial_state=np.zeros(shape)))
    assert "transpose" not in str(info.value)


def test_a_square_state_gets_no_transpose_hint():
    sq = make_inputs(np.random.default_rng(62), 2, 5, 3, 4, 4)   # Dk = Dv: either layout fits
    with pytest.raises(ValueError) as info:
        call(dict(sq, initial_state=np.zeros((2, 3, 4, 5))))
    assert "transpose" not in str(info.value)


@pytest.mark.parametrize("backward", [False, True])
def test_both_or_neither_gate(good, backward):
    with pytest.raises(ValueError, match="exactly one of alpha .* and g.*both"):
        call(dict(good, g=np.log(good["alpha"])), backward=backward)
    neither = dict(good)
    del neither["alpha"]
    with pytest.raises(ValueError, match="exactly one of alpha .* and g.*neither"):
        call(neither, backward=backward)


@pytest.mark.parametrize("scale,exc", [(np.nan, ValueError), (np.inf, ValueError),
                                       (-np.inf, ValueError), (1j, TypeError),
                                       (np.ones(2), TypeError), ("1", TypeError), (True, TypeError),
                                       (None, TypeError)])
def test_bad_scale(good, scale, exc):
    with pytest.raises(exc, match="scale"):
        call(good, scale=scale)
    with pytest.raises(exc, match="scale"):
        call(good, backward=True, scale=scale)


@pytest.mark.parametrize("name", ["q", "k", "v", "beta", "alpha", "initial_state"])
@pytest.mark.parametrize("kind", ["complex", "object", "str"])
def test_non_real_dtypes(good, name, kind):
    x = good[name]
    bad = {"complex": x.astype(np.complex128), "object": x.astype(object),
           "str": x.astype(str)}[kind]
    with pytest.raises(TypeError, match=f"^{name} must have a real dtype"):
        call(dict(good, **{name: bad}))


def test_missing_or_ragged(good):
    with pytest.raises(TypeError, match="beta is required"):
        call(dict(good, beta=None))
    with pytest.raises(TypeError, match="^q must"):
        call(dict(good, q=[[1.0, 2.0], [3.0]]))


@pytest.mark.parametrize("n,exc", [(0, ValueError), (-2, ValueError), (1.5, TypeError),
                                   (True, TypeError), ("2", TypeError)])
def test_bad_num_threads(good, n, exc):
    with pytest.raises(exc, match="num_threads"):
        call(good, num_threads=n)


def test_errors_leave_inputs_alone(good):
    before = {n: a.copy() for n, a in good.items()}
    with pytest.raises(ValueError):
        call(dict(good, k=good["k"][:, :3]))
    for n, a in before.items():
        np.testing.assert_array_equal(good[n], a)


def test_more_dtype_and_flag_errors(good):
    with pytest.raises(TypeError, match="^q must have a real dtype that casts safely to float64"):
        call(dict(good, q=good["q"].astype(np.longdouble)))
    with pytest.raises(TypeError, match="^v is a masked array"):
        call(dict(good, v=np.ma.masked_less(good["v"], 0)))
    with pytest.raises(TypeError, match="output_final_state must be a bool"):
        call(good, output_final_state="no")
    with pytest.raises(ValueError, match=r"num_threads must be .* \[1, 2\*\*31 - 1\]"):
        call(good, num_threads=2**64)
    with pytest.raises(ValueError, match="scale must be finite"):
        call(good, scale=10**400)


def test_large_scale_values_are_accepted(good):
    """A huge int or a NumPy scalar is still a real scalar."""
    o1, _ = call(good, scale=2**70)
    o2, _ = call(good, scale=np.float32(2.0**70))
    np.testing.assert_allclose(o1, o2, rtol=1e-12)


def test_oversized_thread_request_is_capped_not_fatal(good):
    """Asking for far more threads than processors must not kill the process."""
    from gdn_ext import _core
    q = np.zeros((1, 1, 5000, 1))
    o, _ = gdn_ext.gated_delta_rule(q, q, q, beta=q[..., 0], alpha=q[..., 0], num_threads=5000)
    assert o.shape == (1, 1, 5000, 1)
    prev = _core._set_call_threads(5000)
    try:
        assert _core._threads_for(5000) <= 4 * __import__("os").cpu_count()
    finally:
        _core._set_call_threads(prev)


@pytest.mark.parametrize("api", ["forward", "backward"])
def test_outputs_too_large_for_memory_fail_before_the_checks(api, monkeypatch):
    """A call whose outputs cannot be allocated (a broadcast v of 10^14 entries: o of 400 TB,
    more than a 64-bit process can address, whatever the overcommit policy) raises MemoryError,
    saying how much, before the value checks and conversions run (on inputs of tens of GB those
    take minutes, and the error came after them)."""
    import gdn_ext._problem as problem

    def checks_ran(*a, **kw):
        raise AssertionError("the value checks ran before the outputs were allocated")
    monkeypatch.setattr(problem, "value_messages", checks_ran)
    T = 10 ** 7
    q = np.ones((1, T, 1, 2), np.float32)
    v = np.broadcast_to(np.float32(1), (1, T, 1, T))
    with pytest.raises(MemoryError, match="GiB of float32"):
        if api == "forward":
            gdn_ext.gated_delta_rule(q, q, v, beta=0.5, g=-0.1)
        else:
            gdn_ext.gated_delta_rule_backward(v, q, q, v, beta=0.5, g=-0.1)


def test_workspace_size_overflow_raises_memory_error():
    """Sizes whose workspace would overflow size_t raise MemoryError (stride-0 fakes, no RAM)."""
    from numpy.lib.stride_tricks import as_strided

    from gdn_ext import ufuncs

    def fake(*shape):
        return as_strided(np.zeros(1), shape=shape, strides=(0,) * len(shape))

    def const(*shape):
        return np.broadcast_to(0.0, shape)

    T, Dk, Dv = 4, 230584300921369396, 1
    with pytest.raises(MemoryError):
        ufuncs.gated_delta_rule_bwd(
            const(T, Dv), const(T, Dk), const(T, Dk), const(T, Dv), const(T), const(T),
            const(Dv, Dk), const(Dv, Dk), 1.0,
            out=(fake(T, Dk), fake(T, Dk), fake(T, Dv), fake(T), fake(T), fake(Dv, Dk)))
