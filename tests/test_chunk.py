"""The chunkwise (WY / UT-transform) form: against the recurrence, finite differences and the
NumPy reference of the chunk form, on the inputs chunk kernels get wrong; auto's choice."""
import numpy as np
import pytest

import gdn_ext
from gdn_ext import reference
from gdn_ext import _core
from gdn_ext._algorithm import DEFAULT_CHUNK_SIZE
from helpers import assert_rel_close, central_differences, warns_unstable

AUTO_MIN_LEN, AUTO_MAX_BETA_K2 = _core.CHUNK_AUTO_MIN_LEN, _core.CHUNK_AUTO_MAX_BETA_K2

FIELDS = ("o", "S_T", "dq", "dk", "dv", "dbeta", "dgate", "d_initial_state")


def problem(rng, B=2, T=75, H=2, HV=None, Dk=20, Dv=12, dtype=np.float64, key_norm=1.0,
            beta=(0.0, 1.0), g=(-1.0, 0.0)):
    """q, k, v, beta, g, S_0, do, dS_T; keys of norm key_norm (None: raw normal draws)."""
    HV = H if HV is None else HV
    q = rng.standard_normal((B, T, H, Dk))
    k = rng.standard_normal((B, T, H, Dk))
    if key_norm is not None:
        k *= key_norm / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, HV, Dv))
    b = rng.uniform(*beta, (B, T, HV))
    gl = rng.uniform(*g, (B, T, HV))
    S0 = rng.standard_normal((B, HV, Dv, Dk))
    do = rng.standard_normal((B, T, HV, Dv))
    dST = rng.standard_normal((B, HV, Dv, Dk))
    cast = lambda x: x.astype(dtype)  # noqa: E731
    return dict(q=cast(q), k=cast(k), v=cast(v), beta=cast(b), g=cast(gl), initial_state=cast(S0),
                do=cast(do), dS_T=cast(dST))


def run(P, algorithm, chunk_size=None, gate="g", **kw):
    """Forward and backward with one algorithm: a dict of every result by FIELDS."""
    P = dict(P)
    do, dST = P.pop("do"), P.pop("dS_T")
    chunk_size = kw.pop("chunk_size", chunk_size)
    q, k, v = P.pop("q"), P.pop("k"), P.pop("v")
    if gate == "alpha":
        P["alpha"] = np.exp(P.pop("g"))
    kw = dict(P, algorithm=algorithm, chunk_size=chunk_size, **kw)
    o, S_T = gdn_ext.gated_delta_rule(q, k, v, **kw)
    grads = gdn_ext.gated_delta_rule_backward(do, q, k, v, dS_T=dST, **kw)
    return dict(zip(FIELDS, (o, S_T) + tuple(grads)))


def assert_agree(a, b, rtol, what=""):
    for name in FIELDS:
        assert_rel_close(a[name], b[name], rtol, f"{what} {name}")


@pytest.mark.parametrize("T", [1, 2, 31, 32, 33, 63, 65, 75, 127, 130])
@pytest.mark.parametrize("chunk_size", [1, 16, 32, 64])
def test_lengths_and_chunks_float64(T, chunk_size):
    """T not a multiple of the chunk (the short last chunk adds nothing), T = 1, chunk 1."""
    P = problem(np.random.default_rng(T * 7 + chunk_size), T=T, Dk=9, Dv=7)
    assert_agree(run(P, "chunk", chunk_size), run(P, "recurrent"), 1e-12, f"T={T}")


HARD = {
    # g down to -100 and exactly -inf (a gate of 0: no 0 / 0 from cumulative products)
    "g=-100": dict(g=(-100.0, -20.0)),
    "g=-inf": dict(g=(-1.0, -0.5)),   # with -inf in the middle of a chunk (below)
    "alpha=1": dict(g=(0.0, 0.0)),
    "beta in [0, 2]": dict(beta=(0.0, 2.0)),
    "beta=0": dict(beta=(0.0, 0.0)),
    # unnormalised keys with norms up to 10, beta keeping beta ||k||^2 <= 2
    "|k|=10": dict(key_norm=10.0, beta=(0.0, 0.02)),
    "|k|=3, beta ||k||^2 up to 1.8": dict(key_norm=3.0, beta=(0.0, 0.2)),
}


@pytest.mark.parametrize("case", sorted(HARD))
@pytest.mark.parametrize("gate", ["g", "alpha"])
def test_hard_inputs_float64(case, gate):
    P = problem(np.random.default_rng(len(case)), T=75, **HARD[case])
    if case == "g=-inf":
        P["g"][:, 10:14] = -np.inf
        P["g"][:, 14:] = np.log(0.9)
    assert_agree(run(P, "chunk", 32, gate=gate), run(P, "recurrent", gate=gate), 1e-12, case)


def test_mixed_gates_of_zero_and_one_float64():
    P = problem(np.random.default_rng(5), T=70)
    P["g"][:, ::7] = -np.inf
    P["g"][:, 3::7] = 0.0
    assert_agree(run(P, "chunk", 16), run(P, "recurrent"), 1e-12)


def test_zero_rows_float64():
    P = problem(np.random.default_rng(6), T=40)
    P["k"][:, 5:9] = 0
    P["q"][:, 20:30] = 0
    P["v"][:, 30:] = 0
    assert_agree(run(P, "chunk", 16), run(P, "recurrent"), 1e-12)


@pytest.mark.parametrize("variant", ["grouped", "normalize_qk", "linear", "no_state", "Dk!=Dv",
                                     "wide", "scale"])
def test_variants_float64(variant):
    rng = np.random.default_rng(len(variant))
    kw, shape = {}, {}
    if variant == "grouped":
        shape = dict(H=2, HV=6)
    elif variant == "Dk!=Dv":
        shape = dict(Dk=33, Dv=5)
    elif variant == "wide":
        shape = dict(Dk=64, Dv=80, T=70, B=1, H=1)
    P = problem(rng, key_norm=None if variant == "normalize_qk" else 1.0, **shape)
    if variant == "normalize_qk":
        kw["normalize_qk"] = True
    elif variant == "linear":
        kw["delta_rule"] = False
    elif variant == "no_state":
        P["initial_state"] = None
    elif variant == "scale":
        kw["scale"] = 0.125
    assert_agree(run(P, "chunk", 16, **kw), run(P, "recurrent", **kw), 1e-12, variant)


def test_packed_sequences_float64():
    """cu_seqlens with sequences of 1 token, an empty one, and ones that end mid-chunk."""
    rng = np.random.default_rng(8)
    cu = np.array([0, 1, 1, 17, 18, 50, 83])
    P = problem(rng, B=1, T=83)
    P["initial_state"] = rng.standard_normal((6, 2, 12, 20))
    P["dS_T"] = rng.standard_normal((6, 2, 12, 20))
    for normalize in (False, True):
        a = run(P, "chunk", 16, cu_seqlens=cu, normalize_qk=normalize)
        b = run(P, "recurrent", cu_seqlens=cu, normalize_qk=normalize)
        assert_agree(a, b, 1e-12, f"normalize_qk={normalize}")


def test_strided_inputs_float64():
    """Non-contiguous views (a transposed layout, every other token) give the contiguous result."""
    rng = np.random.default_rng(9)
    P = problem(rng, T=150)
    strided = {}
    for n, x in P.items():
        if n in ("q", "k", "v", "do"):   # [B, T, H, D] stored as [B, H, D, T], every other token
            y = np.ascontiguousarray(np.moveaxis(x, 1, -1).repeat(2, axis=-1))
            strided[n] = np.moveaxis(y, -1, 1)[:, ::2]
            assert not strided[n].flags.c_contiguous
        else:
            strided[n] = x
    a, b = run(strided, "chunk", 32), run(P, "chunk", 32)
    for name in FIELDS:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bitwise_across_thread_counts(dtype):
    P = problem(np.random.default_rng(10), B=3, T=100, H=2, Dk=16, Dv=16, dtype=dtype)
    ref = run(P, "chunk", 32, num_threads=1)
    for nt in (2, 3, 5):
        got = run(P, "chunk", 32, num_threads=nt)
        for name in FIELDS:
            np.testing.assert_array_equal(got[name], ref[name], err_msg=f"{name}, {nt} threads")


@pytest.mark.parametrize("auto", [False, True])
def test_one_sequence_split_between_threads_bitwise(auto):
    """Fewer pairs than threads: the forward splits the value columns between threads (the
    recurrence's fallback too, under auto): bit for bit what one thread gives, for 80 columns
    (strips of 32, 32 and 16)."""
    P = problem(np.random.default_rng(26), B=1, T=130, H=1, Dk=24, Dv=80)
    if auto:
        P["beta"][0, 5, 0] = 100.0   # beta ||k||^2 > 2: auto gives this pair the recurrence
    alg = "auto" if auto else "chunk"
    kw = dict(beta=P["beta"], g=P["g"], initial_state=P["initial_state"], algorithm=alg,
              check_values=False)
    ref = gdn_ext.gated_delta_rule(P["q"], P["k"], P["v"], num_threads=1, **kw)
    for nt in (2, 3, 4):
        got = gdn_ext.gated_delta_rule(P["q"], P["k"], P["v"], num_threads=nt, **kw)
        np.testing.assert_array_equal(got.o, ref.o, err_msg=f"{nt} threads")
        np.testing.assert_array_equal(got.S_T, ref.S_T, err_msg=f"{nt} threads")


def _train_forward(P, **kw):
    """o, S_T and the states gdn_ext.torch keeps for its backward (the chunk form's states)."""
    from gdn_ext.recurrence import _train_forward
    return _train_forward(P["q"], P["k"], P["v"], beta=P["beta"], g=P["g"],
                          initial_state=P["initial_state"], **kw)


@pytest.mark.parametrize("case", ["one pair", "three pairs", "packed", "normalize_qk", "linear",
                                  "many chunks", "odd widths"])
def test_forward_of_few_pairs_on_many_threads_bitwise(case):
    """Fewer pairs than threads: the forward splits each pair's value columns between threads
    (the chunk states it keeps for training too): bit for bit what one thread gives."""
    rng = np.random.default_rng(40)
    shape, kw = dict(B=1, T=300, H=1, Dk=24, Dv=80), dict(algorithm="chunk", chunk_size=16)
    if case == "three pairs":
        shape["H"] = 3
    if case == "packed":   # lengths 1, 0, 32 (one whole chunk) and the rest
        kw["cu_seqlens"] = [0, 1, 1, 33, 300]
        P = problem(rng, **shape)
        P["initial_state"] = rng.standard_normal((4, 1, 80, 24))
    if case == "normalize_qk":
        kw["normalize_qk"] = True
    if case == "linear":
        kw["delta_rule"] = False
    if case == "many chunks":   # the last one short
        kw["chunk_size"] = 3
    if case == "odd widths":
        shape.update(Dk=19, Dv=45)
    if case != "packed":
        P = problem(rng, **shape)
    ref = _train_forward(P, num_threads=1, **kw)
    for nt in (2, 3, 4, 8):   # 8: more threads than cores
        got = _train_forward(P, num_threads=nt, **kw)
        for name, a, b in zip(("o", "S_T", "states"), got, ref):
            np.testing.assert_array_equal(a, b, err_msg=f"{name}, {nt} threads")
    if case == "one pair":
        o, S_T = gdn_ext.gated_delta_rule(P["q"], P["k"], P["v"], beta=P["beta"], g=P["g"],
                                          initial_state=P["initial_state"], algorithm="recurrent")
        assert_rel_close(ref[0], o, 1e-12, "o")
        assert_rel_close(ref[1], S_T, 1e-12, "S_T")


def test_strips_keep_the_states_of_the_whole_width():
    """Few pairs, auto giving one of them the recurrence: the other splits its value columns
    between threads and keeps its chunk states every R chunks, R counted for all of its columns
    (counted for a strip's, it wrote past the states' array and returned wrong outputs)."""
    rng = np.random.default_rng(41)
    P = problem(rng, B=1, T=2000, H=2, Dk=16, Dv=80, g=(-0.05, 0.0))
    P["beta"][0, 5, 0] = 100.0   # beta ||k||^2 > 2: the recurrence for this pair
    kw = dict(algorithm="auto", chunk_size=1)
    ref = _train_forward(P, num_threads=1, **kw)
    got = _train_forward(P, num_threads=4, **kw)
    for name, a, b in zip(("o", "S_T", "states"), got, ref):
        np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("case", ["one pair", "auto fallback", "two pairs", "packed", "linear",
                                  "long"])
def test_backward_of_few_pairs_on_many_threads_bitwise(case):
    """Eight threads per pair or more: the backward runs each pair on every thread (the walk over
    dH by strips of value columns, then the chunks in parallel): bit for bit what one thread
    gives."""
    rng = np.random.default_rng(27)
    shape, kw = dict(B=1, T=150, H=1, Dk=24, Dv=80), dict(algorithm="chunk", chunk_size=16)
    if case == "auto fallback":
        kw["algorithm"] = "auto"
    if case == "two pairs":   # 16 threads for the team: here (2 cores, at most 8) one per pair
        shape["H"] = 2
    if case == "long":   # segments of states in the one-thread backward
        shape, kw = dict(B=1, T=3000, H=1, Dk=32, Dv=48), dict(algorithm="chunk", chunk_size=1)
    P = problem(rng, **shape)
    if case == "auto fallback":
        P["beta"][0, 5, 0] = 100.0      # the pair gets the recurrence, inside the team
    if case == "packed":
        kw["cu_seqlens"] = [0, 7, 150]
        P["initial_state"] = rng.standard_normal((2, 1, 80, 24))
        P["dS_T"] = rng.standard_normal((2, 1, 80, 24))
    if case == "linear":
        kw["delta_rule"] = False
    ref = run(P, num_threads=1, check_values=False, **kw)
    for nt in (2, 4, 8):   # 8 threads per pair or more: the team (more threads than cores too)
        got = run(P, num_threads=nt, check_values=False, **kw)
        for name in FIELDS:
            np.testing.assert_array_equal(got[name], ref[name], err_msg=f"{name}, {nt} threads")
    if case == "one pair":
        assert_agree(ref, run(P, "recurrent"), 1e-12)
        # the team's phases meet at barriers: a race would show as a rare difference; 20 runs
        # (the team's uninitialised padding, before it was zeroed, differed in 1 of 3)
        for _ in range(20):
            got = run(P, num_threads=8, check_values=False, **kw)
            assert all(np.array_equal(got[n], ref[n]) for n in FIELDS)


def _loss(P, do, dST, **kw):
    o, S_T = gdn_ext.gated_delta_rule(P["q"], P["k"], P["v"], beta=P["beta"], g=P["g"],
                                      initial_state=P["initial_state"], **kw)
    return np.sum(o * do) + np.sum(S_T * dST)


@pytest.mark.parametrize("kw", [{}, {"normalize_qk": True}, {"delta_rule": False}],
                         ids=["delta", "normalize_qk", "linear"])
def test_central_finite_differences(kw):
    """Every gradient of the chunk form, every element, against central differences in float64
    (T = 11 with chunks of 4: two whole chunks and a short one)."""
    rng = np.random.default_rng(11)
    P = problem(rng, B=1, T=11, H=2, Dk=3, Dv=4, key_norm=None if kw else 1.0)
    do, dST = P.pop("do"), P.pop("dS_T")
    kw = dict(kw, algorithm="chunk", chunk_size=4, scale=0.7)
    grads = gdn_ext.gated_delta_rule_backward(do, P["q"], P["k"], P["v"], beta=P["beta"],
                                              g=P["g"], initial_state=P["initial_state"],
                                              dS_T=dST, **kw)
    numeric = central_differences(lambda x: _loss(x, do, dST, **kw), P)
    field = dict(q="dq", k="dk", v="dv", beta="dbeta", g="dg", initial_state="d_initial_state")
    for name, num in numeric.items():
        assert_rel_close(getattr(grads, field[name]), num, 1e-7, name)


def test_float32_error_within_a_small_factor_of_the_recurrences():
    """On well-scaled inputs the float32 chunk form's error against float64 is within 5x the
    float32 recurrence's, output and every gradient. Measured here: o, S_T, dS_0 1.0-1.9x,
    dv, dbeta, dg 1.4-3.3x, dk 2.7-3.7x (its sums are regrouped per chunk: products of
    partial sums of up to C terms, each larger than the result)."""
    P64 = problem(np.random.default_rng(12), B=2, T=512, H=2, Dk=64, Dv=64, g=(-0.2, 0.0))
    P32 = {n: (None if x is None else x.astype(np.float32)) for n, x in P64.items()}
    truth = run(P64, "recurrent")
    rec = run(P32, "recurrent")
    for C in (16, 32, 64):
        chk = run(P32, "chunk", C)
        for name in FIELDS:
            scale = np.max(np.abs(truth[name]))
            e_rec = np.max(np.abs(rec[name] - truth[name])) / scale
            e_chk = np.max(np.abs(chk[name] - truth[name])) / scale
            assert e_chk <= 5 * e_rec, f"C={C} {name}: {e_chk:.2e} vs {e_rec:.2e}"


def pair(r, b, h):
    """The results of one (sequence, head) pair."""
    out = {}
    for n, x in r.items():
        out[n] = x[b, h] if n in ("S_T", "d_initial_state") else x[b, :, h]
    return out


def same(a, b):
    return all(np.array_equal(a[n], b[n]) for n in a)


def test_auto_picks_by_the_documented_rule_per_pair():
    rng = np.random.default_rng(13)
    long = problem(rng, T=AUTO_MIN_LEN)
    short = problem(rng, T=AUTO_MIN_LEN - 1)
    # a different rounding tells the forms apart
    assert not same(run(long, "chunk"), run(long, "recurrent"))
    assert same(run(long, "auto"), run(long, "chunk", DEFAULT_CHUNK_SIZE))
    assert same(run(long, "auto", chunk_size=16), run(long, "chunk", 16))
    assert same(run(short, "auto"), run(short, "recurrent"))
    # an ill-conditioned UT transform (beta ||k||^2 above the bound at one token of pair (0, 0)):
    # that pair runs the recurrence, the others the chunk form
    bad = dict(long, beta=long["beta"].copy(), k=long["k"].copy())
    bad["k"][0, 40, 0] *= 2.0
    bad["beta"][0, 40, 0] = AUTO_MAX_BETA_K2 / 4 + 0.01
    auto, rec, chk = run(bad, "auto"), run(bad, "recurrent"), run(bad, "chunk")
    assert same(pair(auto, 0, 0), pair(rec, 0, 0))
    for b, h in [(0, 1), (1, 0), (1, 1)]:
        assert same(pair(auto, b, h), pair(chk, b, h))
    # the same choices whatever k's memory layout (the rule's pass reads rows with a stride
    # between elements, or reversed, as the kernels do)
    for k in (np.asfortranarray(bad["k"]), bad["k"][..., ::-1].copy()[..., ::-1]):
        laid = dict(bad, k=k)
        assert same(run(laid, "auto"), auto)
    # ... unless the keys are normalised in the kernel (||k|| < 1: beta alone decides)
    assert same(run(bad, "auto", normalize_qk=True), run(bad, "chunk", normalize_qk=True))
    # without the delta rule there is no solve: the chunk form
    assert same(run(bad, "auto", delta_rule=False), run(bad, "chunk", delta_rule=False))
    # a per-key gate has no chunkwise kernel: "chunk" runs the recurrence
    gk = dict(long)
    gk["g"] = np.repeat(long["g"][..., None], 20, axis=-1) * np.linspace(0.5, 1.5, 20)
    assert same(run(gk, "chunk"), run(gk, "recurrent"))


def test_auto_packed_sequences_give_what_they_give_alone():
    """auto decides per sequence: in a pack of a short and a long sequence each gets the form
    (and the bits) it gets alone."""
    rng = np.random.default_rng(18)
    cu = np.array([0, 10, 10 + AUTO_MIN_LEN + 5])
    P = problem(rng, B=1, T=int(cu[-1]))
    P["initial_state"] = rng.standard_normal((2, 2, 12, 20))
    P["dS_T"] = rng.standard_normal((2, 2, 12, 20))
    packed = run(P, "auto", cu_seqlens=cu)
    for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        one = {m: (x[n:n + 1] if m in ("initial_state", "dS_T") else x[:, a:b])
               for m, x in P.items()}
        alone = run(one, "auto", cu_seqlens=[0, b - a])   # a pack of one: the same loops
        for m in FIELDS:
            got = packed[m][n:n + 1] if m in ("S_T", "d_initial_state") else packed[m][:, a:b]
            np.testing.assert_array_equal(got, alone[m], err_msg=f"sequence {n} {m}")


def test_ill_conditioned_float32_auto_stays_accurate():
    """Keys of norm 3 with beta up to 1 (beta ||k||^2 up to 9): the chunk form's float32 error
    grows past the recurrence's; auto runs the recurrence and keeps its accuracy."""
    P64 = problem(np.random.default_rng(14), B=1, T=256, H=2, Dk=32, Dv=32, key_norm=3.0,
                  beta=(0.5, 1.0), g=(-3.0, -2.0))
    P32 = {n: x.astype(np.float32) for n, x in P64.items()}
    with warns_unstable():
        truth = run(P64, "recurrent")
        auto, rec = run(P32, "auto"), run(P32, "recurrent")
    for name in FIELDS:
        np.testing.assert_array_equal(auto[name], rec[name], err_msg=name)
        assert_rel_close(rec[name], truth[name], 1e-4, name)


@pytest.mark.parametrize("bad,err", [
    (dict(algorithm="fast"), ValueError), (dict(algorithm=None), TypeError),
    (dict(chunk_size=0), ValueError), (dict(chunk_size=257), ValueError),
    (dict(chunk_size=16.0), TypeError), (dict(chunk_size=True), TypeError)])
def test_bad_arguments(bad, err):
    P = problem(np.random.default_rng(15), T=8)
    name = next(iter(bad))
    with pytest.raises(err, match=name):
        gdn_ext.gated_delta_rule(P["q"], P["k"], P["v"], beta=P["beta"], g=P["g"], **bad)
    with pytest.raises(err, match=name):
        gdn_ext.gated_delta_rule_backward(P["do"], P["q"], P["k"], P["v"], beta=P["beta"],
                                          g=P["g"], **bad)



@pytest.mark.parametrize("chunk_size", [16, 32])
def test_chunk_size_with_the_recurrence_is_refused(chunk_size):
    """A chunk size changes nothing in the recurrence: the caller meant another form."""
    P = problem(np.random.default_rng(18), T=8)
    kw = dict(beta=P["beta"], g=P["g"], algorithm="recurrent", chunk_size=chunk_size)
    with pytest.raises(ValueError, match="chunk_size=%d .*'recurrent'" % chunk_size):
        gdn_ext.gated_delta_rule(P["q"], P["k"], P["v"], **kw)
    with pytest.raises(ValueError, match="'recurrent' has no chunks"):
        gdn_ext.gated_delta_rule_backward(P["do"], P["q"], P["k"], P["v"], **kw)
    # the same call without chunk_size runs, and auto / chunk take it
    gdn_ext.gated_delta_rule(P["q"], P["k"], P["v"], beta=P["beta"], g=P["g"],
                             algorithm="recurrent")
    for alg in ("auto", "chunk"):
        gdn_ext.gated_delta_rule(P["q"], P["k"], P["v"], **dict(kw, algorithm=alg))


def test_chunk_with_the_recurrences_checkpoints_is_refused():
    """return_checkpoints=True / checkpoints= make the recurrence run: an explicit "chunk" beside
    them is refused (it used to run the recurrence without a word); "auto" runs the recurrence
    with them, bitwise as "recurrent"."""
    P = problem(np.random.default_rng(19), T=100)
    kw = dict(beta=P["beta"], g=P["g"], initial_state=P["initial_state"])
    with pytest.raises(ValueError, match="return_checkpoints=True .*algorithm='chunk'"):
        gdn_ext.gated_delta_rule(P["q"], P["k"], P["v"], **kw, algorithm="chunk",
                                 return_checkpoints=True)
    o, S_T, ck = gdn_ext.gated_delta_rule(P["q"], P["k"], P["v"], **kw, return_checkpoints=True)
    with pytest.raises(ValueError, match="checkpoints= .*algorithm='chunk'"):
        gdn_ext.gated_delta_rule_backward(P["do"], P["q"], P["k"], P["v"], **kw,
                                          algorithm="chunk", checkpoints=ck)
    got = {a: gdn_ext.gated_delta_rule_backward(P["do"], P["q"], P["k"], P["v"], **kw,
                                                algorithm=a, checkpoints=ck)
           for a in ("auto", "recurrent")}
    for a, b in zip(got["auto"], got["recurrent"]):
        np.testing.assert_array_equal(a, b)


def test_torch_chunk_size_with_the_recurrence_is_refused():
    torch = pytest.importorskip("torch")
    from gdn_ext.torch import GatedDeltaNet, gated_delta_rule
    P = {n: torch.from_numpy(x) for n, x in problem(np.random.default_rng(20), T=8).items()}
    with pytest.raises(ValueError, match="'recurrent' has no chunks"):
        gated_delta_rule(P["q"], P["k"], P["v"], beta=P["beta"], g=P["g"],
                         algorithm="recurrent", chunk_size=16)
    with pytest.raises(ValueError, match="'recurrent' has no chunks"):
        GatedDeltaNet(32, 2, 4, 8, 8, algorithm="recurrent", chunk_size=16)

def test_inputs_not_modified():
    P = problem(np.random.default_rng(16), T=70)
    before = {n: x.copy() for n, x in P.items()}
    run(P, "chunk", 16, normalize_qk=True)
    for n in P:
        np.testing.assert_array_equal(P[n], before[n], err_msg=n)


# ---- the NumPy reference of the chunk form ----------------------------------------------------

@pytest.mark.parametrize("T,C", [(1, 4), (75, 16), (64, 64), (70, 32)])
def test_reference_chunk_form_matches_the_recurrence(T, C):
    rng = np.random.default_rng(T + C)
    P = problem(rng, T=T, H=2, HV=4)
    P["g"][:, T // 2] = -np.inf
    kw = dict(beta=P["beta"], g=P["g"], initial_state=P["initial_state"], scale=0.5)
    got = reference.chunk_gated_delta_rule(P["q"], P["k"], P["v"], chunk_size=C, **kw)
    want = reference.gated_delta_rule(P["q"], P["k"], P["v"], **kw)
    assert_rel_close(got.o, want.o, 1e-12, "o")
    assert_rel_close(got.S_T, want.S_T, 1e-12, "S_T")
    # the pieces are what they are documented to be
    B, _, HV, Dv = P["v"].shape
    NT = -(-T // C)
    assert got.A.shape == (B, HV, NT, C, C) and got.h.shape == (B, NT, HV, 20, Dv)
    assert np.allclose(np.triu(got.A, 1), 0) and np.allclose(np.diagonal(got.A, 0, -2, -1), 1)
    m = min(C, T)
    vn = got.u[:, :m] - np.einsum("bthk,bhkv->bthv", got.w[:, :m], got.h[:, 0])
    assert_rel_close(got.v_new[:, :m], vn, 1e-12, "v_new = u - w h")
    np.testing.assert_array_equal(np.swapaxes(got.h[:, 0], -1, -2), P["initial_state"])
    np.testing.assert_allclose(got.g_cumsum[:, :m], np.cumsum(P["g"][:, :m], axis=1))


def test_reference_segment_decay_after_a_gate_of_zero():
    g = np.array([-0.5, -np.inf, -0.25, -1.0])
    G = reference.segment_decay(g)
    assert not np.isnan(G).any()
    assert G[3, 2] == np.exp(-1.0) and G[2, 0] == 0 and G[3, 3] == 1 and G[0, 1] == 0


def test_reference_refuses_per_key_gates_and_bad_chunks():
    P = problem(np.random.default_rng(17), T=8)
    with pytest.raises(ValueError, match="chunk_size"):
        reference.chunk_gated_delta_rule(P["q"], P["k"], P["v"], beta=P["beta"], g=P["g"],
                                         chunk_size=0)
    with pytest.raises(ValueError, match="per key"):
        reference.chunk_gated_delta_rule(P["q"], P["k"], P["v"], beta=P["beta"],
                                         g=np.repeat(P["g"][..., None], 20, axis=-1))


def test_long_sequence_recomputes_segments_float64():
    """2000 chunks of Dk = Dv = 32 exceed what the backward keeps of every chunk's state: it keeps
    one per segment of ceil(sqrt(2000)) = 45 chunks and recomputes the rest, with the same
    results."""
    P = problem(np.random.default_rng(19), B=1, T=4000, H=1, Dk=32, Dv=32, g=(-0.05, 0.0))
    assert _core.CHUNK_MAX >= 2
    assert_agree(run(P, "chunk", 2), run(P, "recurrent"), 1e-11, "T=4000, chunks of 2")


def test_backward_memory_grows_as_sqrt_of_the_chunks():
    """The chunk form's backward keeps O(sqrt(T / C)) states for a long sequence (tracemalloc sees
    the workspace), not one per chunk and never one per token."""
    import tracemalloc
    T, Dk, Dv = 100_000, 32, 32
    P = problem(np.random.default_rng(20), B=1, T=T, H=1, Dk=Dk, Dv=Dv, g=(-0.1, 0.0))
    per_chunk = (T // DEFAULT_CHUNK_SIZE) * Dk * Dv * 8           # 25.6 MB: a state per chunk
    grads_bytes = (2 * T * Dk + T * Dv + 2 * T + Dk * Dv) * 8
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        grads = gdn_ext.gated_delta_rule_backward(P["do"], P["q"], P["k"], P["v"], beta=P["beta"],
                                                  g=P["g"], algorithm="chunk", num_threads=1)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert grads_bytes <= peak < grads_bytes + per_chunk / 4, (peak, grads_bytes, per_chunk)
    assert np.all(np.isfinite(grads.dq))


# ---- through gdn_ext.torch: the forward hands the backward its chunk states -------------------

def _torch_grads(P, **kw):
    torch = pytest.importorskip("torch")
    import gdn_ext.torch as gt
    t = {n: torch.tensor(x, requires_grad=True) for n, x in P.items()
         if n not in ("do", "dS_T") and x is not None}
    o, S_T = gt.gated_delta_rule(t["q"], t["k"], t["v"], beta=t["beta"], g=t["g"],
                                 initial_state=t.get("initial_state"), **kw)
    loss = (o * torch.tensor(P["do"])).sum()
    if "initial_state" in t:
        loss = loss + (S_T * torch.tensor(P["dS_T"])).sum()
    loss.backward()   # one backward call, as the NumPy one: do and dS_T together
    return {n: x.grad.numpy() for n, x in t.items()}, o.detach().numpy()


@pytest.mark.parametrize("case", ["chunk", "auto", "long", "packed"])
def test_torch_training_hands_over_chunk_states(case):
    """The torch forward keeps the chunk form's states and the backward starts from them: the
    gradients are bit for bit the NumPy backward's, which makes its own (float64)."""
    pytest.importorskip("torch")
    rng = np.random.default_rng(21)
    kw, shape = dict(algorithm="auto" if case == "auto" else "chunk", chunk_size=16), {}
    if case == "long":   # segments of the chunks' states: 2000 chunks of 2 tokens
        shape, kw = dict(B=1, T=4000, H=1, Dk=32, Dv=32, g=(-0.05, 0.0)), dict(chunk_size=2,
                                                                               algorithm="chunk")
    shape = dict(dict(T=100), **shape)
    P = problem(rng, **shape) if case != "packed" else problem(rng, B=1, T=100)
    if case == "packed":
        kw = dict(kw, algorithm="auto", cu_seqlens=[0, 10, 100])   # 10 tokens: the recurrence
        P["initial_state"] = rng.standard_normal((2, 2, 12, 20))
        P["dS_T"] = rng.standard_normal((2, 2, 12, 20))
    grads, o = _torch_grads(P, **kw)
    want = run(P, kw.pop("algorithm"), **kw)
    np.testing.assert_array_equal(o, want["o"])
    for name, field in [("q", "dq"), ("k", "dk"), ("v", "dv"), ("beta", "dbeta"), ("g", "dgate"),
                        ("initial_state", "d_initial_state")]:
        np.testing.assert_array_equal(grads[name], want[field], err_msg=name)


@pytest.mark.parametrize("algorithm", ["chunk", "recurrent"])
@pytest.mark.parametrize("loss_of", ["o", "S_T"])
def test_torch_loss_of_one_output_gets_no_gradient_for_the_other(algorithm, loss_of):
    """Autograd hands the backward no zero tensors for what has no gradient (the checkpoints
    never have one; S_T or o when the loss ignores it): None stands for zeros, and the gradients
    are the NumPy backward's with that argument zero."""
    torch = pytest.importorskip("torch")
    import gdn_ext.torch as gt
    P = problem(np.random.default_rng(28), T=70)
    if loss_of == "o":
        P["dS_T"] = np.zeros_like(P["dS_T"])
    else:
        P["do"] = np.zeros_like(P["do"])
    t = {n: torch.tensor(P[n], requires_grad=True) for n in ("q", "k", "v", "beta", "g",
                                                              "initial_state")}
    o, S_T = gt.gated_delta_rule(t["q"], t["k"], t["v"], beta=t["beta"], g=t["g"],
                                 initial_state=t["initial_state"], algorithm=algorithm)
    loss = ((o * torch.tensor(P["do"])).sum() if loss_of == "o"
            else (S_T * torch.tensor(P["dS_T"])).sum())
    loss.backward()
    want = run(P, algorithm)
    for name, field in [("q", "dq"), ("k", "dk"), ("v", "dv"), ("beta", "dbeta"), ("g", "dgate"),
                        ("initial_state", "d_initial_state")]:
        np.testing.assert_array_equal(t[name].grad.numpy(), want[field], err_msg=name)


def test_per_key_gate_given_as_a_broadcast_view_keeps_per_key_gradients():
    """A per-key gate [B, T, HV, Dk] that is a stride-0 view of one number per token is still a
    per-key argument: its gradient comes back per key, as the recurrence computes it."""
    P = problem(np.random.default_rng(22), T=70)
    P["g"] = np.broadcast_to(P["g"][..., None], P["g"].shape + (20,))
    assert P["g"].strides[-1] == 0
    for algorithm in ("chunk", "auto"):
        assert_agree(run(P, algorithm), run(P, "recurrent"), 0, algorithm)


# ---- the other front ends pass the choice through ---------------------------------------------

def test_layer_trains_in_the_chunk_form():
    """gated_deltanet_forward / _backward with algorithm="chunk": the cache holds the chunk
    states, and the gradients agree with the recurrence's (float64)."""
    from gdn_ext.layer import GatedDeltaNetParams, gated_deltanet_backward, gated_deltanet_forward
    rng = np.random.default_rng(23)
    params = GatedDeltaNetParams.init(24, 8, 8, n_heads=2, seed=1, dtype=np.float64)
    x = rng.standard_normal((2, 100, 24))
    dy = rng.standard_normal((2, 100, 24))
    out = {}
    for algorithm in ("chunk", "recurrent"):
        C = 16 if algorithm == "chunk" else None
        y, S_T, cache = gated_deltanet_forward(x, None, params, normalize_qk=True, scale=0.5,
                                               algorithm=algorithm, chunk_size=C,
                                               return_cache=True)
        grads = gated_deltanet_backward(dy, x, None, params, normalize_qk=True, scale=0.5,
                                        cache=cache, algorithm=algorithm, chunk_size=C)
        out[algorithm] = (y, S_T, cache, grads)
    c, r = out["chunk"], out["recurrent"]
    assert c[2].checkpoints.shape[-3] == -(-100 // 16)          # a state per chunk
    assert_rel_close(c[0], r[0], 1e-12, "y")
    assert_rel_close(c[3].dx, r[3].dx, 1e-12, "dx")
    for (name, a), (_, b) in zip(c[3].dparams, r[3].dparams):
        assert_rel_close(a, b, 1e-11, name)


def test_dask_passes_the_form_to_each_task():
    da = pytest.importorskip("dask.array")
    import gdn_ext.dask as gd
    P = problem(np.random.default_rng(24), B=2, T=80)
    lazy = {n: da.from_array(x, chunks=(1,) + x.shape[1:]) for n, x in P.items()}
    for algorithm in ("chunk", "recurrent"):
        kw = dict(beta=lazy["beta"], g=lazy["g"], initial_state=lazy["initial_state"],
                  algorithm=algorithm, chunk_size=16 if algorithm == "chunk" else None)
        o, S_T = gd.gated_delta_rule(lazy["q"], lazy["k"], lazy["v"], **kw)
        grads = gd.gated_delta_rule_backward(lazy["do"], lazy["q"], lazy["k"], lazy["v"],
                                             dS_T=lazy["dS_T"], **kw)
        want = run(P, algorithm, kw["chunk_size"])
        np.testing.assert_array_equal(o.compute(), want["o"])
        np.testing.assert_array_equal(grads.dq.compute(), want["dq"])
        np.testing.assert_array_equal(grads.dg.compute(), want["dgate"])
    with pytest.raises(ValueError, match="algorithm"):
        gd.gated_delta_rule(lazy["q"], lazy["k"], lazy["v"], beta=lazy["beta"], g=lazy["g"],
                            algorithm="fast")


def test_fla_drop_ins_run_the_forms_their_names_say():
    """chunk_gated_delta_rule runs the chunk form (whatever fla's chunk_size, a GPU tiling
    knob), fused_recurrent_gated_delta_rule the recurrence, each bit for bit."""
    torch = pytest.importorskip("torch")
    import gdn_ext.torch as gt
    P = problem(np.random.default_rng(25), T=80)
    q, k, v = (torch.tensor(P[n]) for n in ("q", "k", "v"))
    beta, g = torch.tensor(P["beta"]), torch.tensor(P["g"])
    h0 = torch.tensor(P["initial_state"])
    for fn, algorithm in ((gt.chunk_gated_delta_rule, "chunk"),
                          (gt.fused_recurrent_gated_delta_rule, "recurrent")):
        o, _ = fn(q, k, v, g=g, beta=beta, scale=0.5, initial_state=h0.transpose(-1, -2),
                  check_values=False)
        want = gdn_ext.gated_delta_rule(P["q"], P["k"], P["v"], beta=P["beta"], g=P["g"],
                                        scale=0.5, initial_state=P["initial_state"],
                                        algorithm=algorithm).o
        np.testing.assert_array_equal(o.numpy(), want)


def test_torch_module_takes_the_form():
    torch = pytest.importorskip("torch")
    from gdn_ext.torch import GatedDeltaNet
    torch.manual_seed(0)
    layers = {a: GatedDeltaNet(32, 2, 4, 8, 8, dtype=torch.float64, algorithm=a)
              for a in ("chunk", "recurrent")}
    layers["recurrent"].load_state_dict(layers["chunk"].state_dict())
    x = torch.randn(2, 90, 32, dtype=torch.float64)
    y_c, _ = layers["chunk"](x)
    y_r, _ = layers["recurrent"](x)
    torch.testing.assert_close(y_c, y_r, rtol=1e-12, atol=1e-12)
    assert not torch.equal(y_c, y_r)   # two forms, two roundings
    with pytest.raises(ValueError, match="algorithm"):
        GatedDeltaNet(32, 2, 4, 8, 8, algorithm="fast")
