"""The gated delta rule: checked NumPy entry points over the C generalized ufuncs.

Math (README, "The recurrence" and "The backward pass"): S. Yang, J. Kautz, A. Hatamizadeh, "Gated Delta Networks: Improving
Mamba2 with Delta Rule", ICLR 2025 (arXiv:2412.06464), section 3.
"""
from collections import namedtuple

import numpy as np

from . import _core
from ._checks import (as_real_array, compute_dtype, expect_shape, flag, real_scalar,
                      thread_count)

__all__ = ["gated_delta_rule", "gated_delta_rule_backward", "gated_delta_rule_step", "GatedDeltaRuleGrads",
           "GatedDeltaRuleGradsG", "openmp_enabled", "checkpoint_interval"]

GatedDeltaRuleGrads = namedtuple("GatedDeltaRuleGrads",
                                 ["dq", "dk", "dv", "dbeta", "dalpha", "d_initial_state"])
GatedDeltaRuleGrads.__doc__ = """Gradients of gated_delta_rule when the gate was given as alpha.
Each field has the shape of its input (d_initial_state: of the state) and the dtype the
computation ran in (float32 or float64)."""
GatedDeltaRuleGradsG = namedtuple("GatedDeltaRuleGradsG",
                                  ["dq", "dk", "dv", "dbeta", "dg", "d_initial_state"])
GatedDeltaRuleGradsG.__doc__ = """Gradients of gated_delta_rule when the gate was given as log
decay g (dg = alpha * dalpha). Each field has the shape of its input and the dtype the
computation ran in (float32 or float64)."""


def openmp_enabled():
    """Whether this build runs the (sequence, head) loop in parallel with OpenMP.

    False when the compiler had no OpenMP at build time (the kernels then run serially)."""
    return bool(_core.openmp_enabled())


def checkpoint_interval(T):
    """C, the number of steps between state checkpoints in the backward pass: ceil(sqrt(T)).

    The backward holds (ceil(T/C) + C + 2) states of Dv*Dk numbers per thread at any time."""
    return int(_core.checkpoint_interval(int(T)))


class _Problem:
    """Inputs checked and viewed in the kernels' layout: loop dimensions (B, H) first, time next."""

    def __init__(self, q, k, v, beta, alpha, g, initial_state, scale, extra=()):
        q = as_real_array(q, "q")
        if q.ndim == 4:
            self.single_head = False
            B, T, H, Dk = q.shape
        elif q.ndim == 3:
            self.single_head = True
            B, T, Dk = q.shape
            H = 1
        else:
            raise ValueError("q must have shape [B, T, H, Dk] (or [B, T, Dk], the single-head form); "
                             f"got {q.ndim} dimensions, shape {list(q.shape)}")
        k = as_real_array(k, "k")
        v = as_real_array(v, "v")
        beta = as_real_array(beta, "beta")
        if (alpha is None) == (g is None):
            raise ValueError("give exactly one of alpha (decay in [0, 1]) and g (log decay, "
                             "alpha = exp(g)); got " + ("both" if alpha is not None else "neither"))
        self.gate_name = "alpha" if alpha is not None else "g"
        gate = as_real_array(alpha if alpha is not None else g, self.gate_name)
        s0 = None if initial_state is None else as_real_array(initial_state, "initial_state")
        self.scale = real_scalar(scale, "scale")

        sh = self.single_head
        lay_qk = "[B, T, Dk]" if sh else "[B, T, H, Dk]"
        expect_shape(k, "k", q.shape, lay_qk + " (the shape of q)")
        if v.ndim != q.ndim or v.shape[:-1] != q.shape[:-1]:
            want = (B, T, "Dv") if sh else (B, T, H, "Dv")
            raise ValueError(f"v must have shape {'[B, T, Dv]' if sh else '[B, T, H, Dv]'} = "
                             f"[{', '.join(map(str, want))}]; got {list(v.shape)}")
        Dv = v.shape[-1]
        self.gate_shape = self.beta_shape = None
        gate_lay = "[B, T] or [B, T, 1]" if sh else "[B, T, H]"
        gate_want = (B, T) if sh else (B, T, H)
        for name, a in ((self.gate_name, gate), ("beta", beta)):
            ok = a.shape == gate_want or (sh and a.shape == (B, T, 1))
            if not ok:
                raise ValueError(f"{name} must have shape {gate_lay} = {list(gate_want)}; "
                                 f"got {list(a.shape)}")
        self.gate_shape, self.beta_shape = gate.shape, beta.shape
        if s0 is not None:
            expect_shape(s0, "initial_state", (B, Dv, Dk) if sh else (B, H, Dv, Dk),
                         "[B, Dv, Dk]" if sh else "[B, H, Dv, Dk]")

        self.B, self.T, self.H, self.Dk, self.Dv = B, T, H, Dk, Dv
        arrays = [q, k, v, beta, gate] + ([s0] if s0 is not None else []) + list(extra)
        self.dtype = dt = compute_dtype(arrays)
        self.state_shape = (B, Dv, Dk) if sh else (B, H, Dv, Dk)
        self.q, self.k, self.v = (self._seq(x, Dk_or_Dv) for x, Dk_or_Dv in
                                  ((q, Dk), (k, Dk), (v, Dv)))
        gate = gate.reshape(B, T, H)
        if self.gate_name == "g":
            gate = np.exp(gate.astype(dt, copy=False))
        self.alpha = gate.transpose(0, 2, 1)        # [B, H, T]
        self.beta = beta.reshape(B, T, H).transpose(0, 2, 1)
        if s0 is None:
            self.S0 = np.zeros((1, 1, Dv, Dk), dt)  # broadcast over (B, H) by the gufunc
        else:
            self.S0 = s0.reshape(B, H, Dv, Dk)

    def _seq(self, x, D):
        """[B, T, H, D] (or [B, T, D]) -> a [B, H, T, D] view."""
        return x.reshape(self.B, self.T, self.H, D).transpose(0, 2, 1, 3)

    def seq_empty(self, D):
        """A new [B, T, H, D] array (user layout) and its [B, H, T, D] view for the kernel."""
        a = np.empty((self.B, self.T, self.H, D), self.dtype)
        return a, a.transpose(0, 2, 1, 3)

    def user_seq(self, a):
        return a[:, :, 0, :] if self.single_head else a

    def user_state(self, a):
        return a.reshape(self.state_shape)


def _call(ufunc, args, out, num_threads):
    prev = _core._set_call_threads(num_threads)
    try:
        ufunc(*args, out=out, dtype=out[0].dtype, casting="same_kind")
    finally:
        _core._set_call_threads(prev)


def gated_delta_rule(q, k, v, *, beta, alpha=None, g=None, initial_state=None, scale=1.0,
                     output_final_state=True, num_threads=None):
    """The gated delta rule recurrence (Gated DeltaNet's token mixer), computed in C.

    For each sequence b and head h, with state S of shape [Dv, Dk] and t = 1..T::

        p_t = alpha_t S_{t-1} k_t                   (what the gated memory returns for k_t)
        u_t = beta_t (v_t - p_t)                    (delta rule: write only the correction)
        S_t = alpha_t S_{t-1} + u_t k_t^T
        o_t = scale * S_t q_t                       (read the updated state)

    Parameters
    ----------
    q, k : array [B, T, H, Dk]
        Queries and keys. The single-head form of the design note, [B, T, Dk], is accepted too,
        and then every result is returned in that form.
    v : array [B, T, H, Dv]  (single-head: [B, T, Dv])
    beta : array [B, T, H]  (single-head: [B, T] or [B, T, 1]), keyword-only
        Write strength (the design note's ``eta``), usually in [0, 1].
    alpha : array [B, T, H]  (single-head: [B, T] or [B, T, 1]), optional
        Decay, the fraction of the old state kept at each step, in [0, 1] (the design note's
        ``gate``). Exactly one of ``alpha`` and ``g`` must be given.
    g : array, same shape as alpha, optional
        Log decay (natural log, <= 0): alpha = exp(g); g = -inf means alpha = 0.
    initial_state : array [B, H, Dv, Dk]  (single-head: [B, Dv, Dk]), optional
        S_0; zeros when None. Rows index the value dimension, columns the key dimension
        (the transpose of flash-linear-attention's [B, H, Dk, Dv]).
    scale : float, default 1.0
        Read-out scale s (finite). The design note has none; flash-linear-attention uses Dk**-0.5.
    output_final_state : bool, default True
        Return S_T; when False the second result is None.
    num_threads : int or None
        OpenMP threads for the loop over (sequence, head) pairs. None uses OpenMP's default, which
        ``OMP_NUM_THREADS`` and threadpoolctl control. Results do not depend on it (bitwise).
        At most B*H threads are used, and at most 4 per processor.

    Returns
    -------
    o : ndarray [B, T, H, Dv]  (single-head: [B, T, Dv])
    S_T : ndarray [B, H, Dv, Dk]  (single-head: [B, Dv, Dk]), or None

    Both are float32 when every input casts safely to float32 (float32, float16, small ints) and
    float64 otherwise, computed in that precision, as a NumPy ufunc would choose (dtypes that do
    not cast safely to float64, such as longdouble, raise TypeError). Inputs are never modified.
    Floating-point warnings (overflow, invalid) follow NumPy's errstate whichever thread met them.

    Raises
    ------
    TypeError
        An input that is not a real array (complex, object, strings, masked arrays), a non-scalar
        scale, a num_threads that is not an int, an output_final_state that is not a bool.
    ValueError
        Wrong ranks or mismatched sizes (the message names the argument and the expected shape),
        both or neither of alpha and g, a non-finite scale, num_threads < 1.

    Notes
    -----
    Cost: about 7*Dk*Dv flops per token and head. Parallel over the B*H (sequence, head) pairs
    with the GIL released. The raw ufunc is ``gdn_ext.ufuncs.gated_delta_rule_fwd``.

    Source: S. Yang, J. Kautz, A. Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta
    Rule", ICLR 2025 (arXiv:2412.06464), section 3 (the gated delta rule).
    """
    nt = thread_count(num_threads)
    output_final_state = flag(output_final_state, "output_final_state")
    p = _Problem(q, k, v, beta, alpha, g, initial_state, scale)
    o, o_k = p.seq_empty(p.Dv)
    S_T = np.empty((p.B, p.H, p.Dv, p.Dk), p.dtype)
    _call(_core.gated_delta_rule_fwd,
          (p.q, p.k, p.v, p.alpha, p.beta, p.S0, p.scale), (o_k, S_T), nt)
    return p.user_seq(o), (p.user_state(S_T) if output_final_state else None)


def gated_delta_rule_backward(do, q, k, v, *, beta, alpha=None, g=None, initial_state=None,
                              dS_T=None, scale=1.0, num_threads=None):
    """Gradients of :func:`gated_delta_rule` (backpropagation through time, in C).

    Given ``do`` = dL/do and ``dS_T`` = dL/dS_T, returns dL/d(every input). Walks t = T..1 with
    G = dL/dS_t (derived by hand from the forward; see the README, "The backward pass")::

        G += s do_t q_t^T;  dq_t = s S_t^T do_t;  du = G k_t;  dk_t = G^T u_t + alpha_t S_{t-1}^T dp
        dbeta_t = du . (v_t - p_t);  dv_t = beta_t du;  dp = -beta_t du
        G~ = G + dp k_t^T;  dalpha_t = sum(G~ * S_{t-1});  G = alpha_t G~   ->  dS_0 = G

    Memory: the states are not stored. The backward reruns the recurrence once keeping S every
    C = ceil(sqrt(T)) steps, then recomputes one segment of C states at a time, so each thread
    holds (ceil(T/C) + C + 2) * Dv * Dk numbers (plus O(C*Dv + Dk)) -- O(sqrt(T) * Dk * Dv), never
    T * Dk * Dv -- besides the gradients themselves. Cost: about 3.5x the forward.

    Parameters
    ----------
    do : array [B, T, H, Dv]  (single-head: [B, T, Dv])
        Gradient of the loss with respect to o.
    q, k, v, beta, alpha, g, initial_state, scale, num_threads
        As for :func:`gated_delta_rule` (same shapes, same rules).
    dS_T : array [B, H, Dv, Dk]  (single-head: [B, Dv, Dk]), optional
        Gradient of the loss with respect to the final state; zeros when None.

    Returns
    -------
    GatedDeltaRuleGrads(dq, dk, dv, dbeta, dalpha, d_initial_state) when alpha was given, or
    GatedDeltaRuleGradsG(dq, dk, dv, dbeta, dg, d_initial_state) when g was given (dg = alpha *
    dalpha). Each gradient has its input's shape (d_initial_state: the state's, also when
    initial_state was None) and the dtype of the computation (float32 or float64).

    Raises
    ------
    TypeError, ValueError
        As :func:`gated_delta_rule`; also when do or dS_T has the wrong shape.

    Source: S. Yang, J. Kautz, A. Hatamizadeh, "Gated Delta Networks", ICLR 2025
    (arXiv:2412.06464), section 3; the equations above are the chain rule through its recurrence.
    """
    nt = thread_count(num_threads)
    do = as_real_array(do, "do")
    dST = None if dS_T is None else as_real_array(dS_T, "dS_T")
    p = _Problem(q, k, v, beta, alpha, g, initial_state, scale,
                 extra=[do] + ([dST] if dST is not None else []))
    o_shape = (p.B, p.T, p.Dv) if p.single_head else (p.B, p.T, p.H, p.Dv)
    expect_shape(do, "do", o_shape, "[B, T, Dv]" if p.single_head else "[B, T, H, Dv]")
    if dST is None:
        dST = np.zeros((1, 1, p.Dv, p.Dk), p.dtype)
    else:
        expect_shape(dST, "dS_T", p.state_shape,
                     "[B, Dv, Dk]" if p.single_head else "[B, H, Dv, Dk]")
        dST = dST.reshape(p.B, p.H, p.Dv, p.Dk)

    dq, dq_k = p.seq_empty(p.Dk)
    dk, dk_k = p.seq_empty(p.Dk)
    dv, dv_k = p.seq_empty(p.Dv)
    dalpha = np.empty((p.B, p.T, p.H), p.dtype)
    dbeta = np.empty((p.B, p.T, p.H), p.dtype)
    dS0 = np.empty((p.B, p.H, p.Dv, p.Dk), p.dtype)
    _call(_core.gated_delta_rule_bwd,
          (p._seq(do, p.Dv), p.q, p.k, p.v, p.alpha, p.beta, p.S0, dST, p.scale),
          (dq_k, dk_k, dv_k, dalpha.transpose(0, 2, 1), dbeta.transpose(0, 2, 1), dS0), nt)

    dq, dk, dv = p.user_seq(dq), p.user_seq(dk), p.user_seq(dv)
    dbeta = dbeta.reshape(p.beta_shape)
    dS0 = p.user_state(dS0)
    if p.gate_name == "g":
        dg = (p.alpha.transpose(0, 2, 1) * dalpha).astype(p.dtype, copy=False)
        return GatedDeltaRuleGradsG(dq, dk, dv, dbeta, dg.reshape(p.gate_shape), dS0)
    return GatedDeltaRuleGrads(dq, dk, dv, dbeta, dalpha.reshape(p.gate_shape), dS0)


def gated_delta_rule_step(q_t, k_t, v_t, *, beta, alpha=None, g=None, state, scale=1.0):
    """One token of the gated delta rule: recurrent (decoding) form of :func:`gated_delta_rule`.

    ``o_t, S_t = gated_delta_rule_step(q_t, k_t, v_t, beta=beta_t, alpha=alpha_t, state=S_{t-1})``
    computes, per sequence and head, ``S_t = alpha_t S_{t-1} + beta_t (v_t - alpha_t S_{t-1} k_t)
    k_t^T`` and ``o_t = scale S_t q_t``. Feeding a sequence one token at a time gives the same
    outputs and final state as one call of :func:`gated_delta_rule` (bitwise: same kernel).

    Parameters
    ----------
    q_t, k_t : array [B, H, Dk]  (single-head form: [B, Dk])
    v_t : array [B, H, Dv]  (single-head: [B, Dv])
    beta, alpha or g : array [B, H]  (single-head: [B] or [B, 1]); exactly one of alpha and g.
    state : array [B, H, Dv, Dk]  (single-head: [B, Dv, Dk]), or None for zeros. Not modified.
    scale : float, default 1.0

    Returns
    -------
    o_t : ndarray [B, H, Dv] (single-head: [B, Dv]);  new_state : ndarray shaped as ``state``.
    float32 when all inputs cast safely to float32, float64 otherwise.

    Raises
    ------
    TypeError, ValueError
        As :func:`gated_delta_rule`, the messages naming the argument and the step's shapes.

    Source: Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025 (arXiv:2412.06464), sec. 3.
    """
    q_t = as_real_array(q_t, "q_t")
    if q_t.ndim not in (2, 3):
        raise ValueError("q_t must have shape [B, H, Dk] (or [B, Dk], the single-head form); "
                         f"got shape {list(q_t.shape)}")
    sh = q_t.ndim == 2
    B, Dk = q_t.shape[0], q_t.shape[-1]
    H = 1 if sh else q_t.shape[1]
    k_t = as_real_array(k_t, "k_t")
    v_t = as_real_array(v_t, "v_t")
    expect_shape(k_t, "k_t", q_t.shape, "[B, Dk]" if sh else "[B, H, Dk]")
    if v_t.shape[:-1] != q_t.shape[:-1]:
        raise ValueError(f"v_t must have shape {'[B, Dv]' if sh else '[B, H, Dv]'} with "
                         f"{'B' if sh else '[B, H]'} = {list(q_t.shape[:-1])}; got {list(v_t.shape)}")
    Dv = v_t.shape[-1]
    if (alpha is None) == (g is None):
        raise ValueError("give exactly one of alpha (decay in [0, 1]) and g (log decay); got "
                         + ("both" if alpha is not None else "neither"))
    gate_name = "alpha" if alpha is not None else "g"
    gate = as_real_array(alpha if alpha is not None else g, gate_name)
    beta = as_real_array(beta, "beta")
    for name, a in ((gate_name, gate), ("beta", beta)):
        if not (a.shape == (B, H) if not sh else a.shape in ((B,), (B, 1))):
            raise ValueError(f"{name} must have shape {'[B] or [B, 1]' if sh else '[B, H]'} = "
                             f"{[B] if sh else [B, H]}; got {list(a.shape)}")
    state_shape = (B, Dv, Dk) if sh else (B, H, Dv, Dk)
    arrays = [q_t, k_t, v_t, gate, beta]
    if state is not None:
        state = as_real_array(state, "state")
        expect_shape(state, "state", state_shape, "[B, Dv, Dk]" if sh else "[B, H, Dv, Dk]")
        arrays.append(state)
    s = real_scalar(scale, "scale")
    dt = compute_dtype(arrays)
    gate = gate.reshape(B, H, 1)
    if gate_name == "g":
        gate = np.exp(gate.astype(dt, copy=False))
    S0 = np.zeros((1, 1, Dv, Dk), dt) if state is None else state.reshape(B, H, Dv, Dk)
    o = np.empty((B, H, 1, Dv), dt)
    S_new = np.empty((B, H, Dv, Dk), dt)
    _core.gated_delta_rule_fwd(q_t.reshape(B, H, 1, Dk), k_t.reshape(B, H, 1, Dk),
                               v_t.reshape(B, H, 1, Dv), gate, beta.reshape(B, H, 1), S0, s,
                               out=(o, S_new), dtype=dt, casting="same_kind")
    return o.reshape(v_t.shape), S_new.reshape(state_shape)
