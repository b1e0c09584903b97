"""The gated delta rule in plain NumPy, step by step: the teaching version and the tests' oracle.

It follows the reference loop of the design note gdn_ext started from (a single-head PyTorch loop)
with its names -- ``batch_matvec``, ``batch_outer``, ``gate_memory`` -- and adds the backward pass
over time (README, "The backward pass") written the same way. Slow (a Python loop over time) and memory-hungry (the
backward keeps every state): use :func:`gdn_ext.gated_delta_rule` for real work.

Layouts are those of :func:`gdn_ext.gated_delta_rule`: q, k [B, T, H, Dk], v [B, T, H, Dv],
alpha / g / beta [B, T, H], state [B, H, Dv, Dk]; or the single-head form q [B, T, Dk],
gate [B, T] or [B, T, 1], state [B, Dv, Dk]. Computed in the inputs' promoted float dtype.

Source: S. Yang, J. Kautz, A. Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta
Rule", ICLR 2025 (arXiv:2412.06464), section 3.
"""
import numpy as np

from .recurrence import GatedDeltaRuleGrads, GatedDeltaRuleGradsG

__all__ = ["batch_matvec", "batch_outer", "gate_memory", "gated_delta_rule",
           "gated_delta_rule_backward"]


def batch_matvec(S, x):
    """S x for a batch: S [..., Dv, Dk], x [..., Dk] -> [..., Dv]."""
    return np.einsum("...vk,...k->...v", S, x)


def batch_outer(a, b):
    """a b^T for a batch: a [..., Dv], b [..., Dk] -> [..., Dv, Dk]."""
    return np.einsum("...v,...k->...vk", a, b)


def gate_memory(S, gate):
    """The scalar gate applied to the state: S [..., Dv, Dk] times gate [...].

    (The design note writes ``S * gate[:, None, None]`` for a gate of shape [B, 1], which would
    broadcast to [B, B, Dv, Dk] when B > 1; here the gate has one number per state.)"""
    return S * gate[..., None, None]


def _inputs(q, k, v, beta, alpha, g, initial_state, extra=()):
    """Float arrays in the layouts above, gate as alpha, gate and beta without a trailing 1."""
    arrays = [np.asarray(x) for x in (q, k, v, beta, alpha if g is None else g) + tuple(extra)]
    if initial_state is not None:
        arrays.append(np.asarray(initial_state))
    dt = np.result_type(np.float32, *arrays)
    q, k, v, beta, gate = (a.astype(dt) for a in arrays[:5])
    if q.ndim == 3:  # single head: a [B, T, 1] gate is [B, T]
        beta = beta.reshape(q.shape[:2])
        gate = gate.reshape(q.shape[:2])
    alpha = gate if g is None else np.exp(gate)
    state_shape = q.shape[:1] + q.shape[2:-1] + (v.shape[-1], q.shape[-1])
    S0 = np.zeros(state_shape, dt) if initial_state is None else np.asarray(initial_state, dt)
    return q, k, v, beta, alpha, S0, dt


def gated_delta_rule(q, k, v, *, beta, alpha=None, g=None, initial_state=None, scale=1.0):
    """Forward loop of the design note, with heads. Returns (o, S_T) shaped as
    :func:`gdn_ext.gated_delta_rule` returns them."""
    q, k, v, beta, alpha, S_cur, _ = _inputs(q, k, v, beta, alpha, g, initial_state)
    outputs = []
    for t in range(q.shape[1]):
        q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]          # [B, (H,) Dk] / [B, (H,) Dv]
        g_t, e_t = alpha[:, t], beta[:, t]                 # [B, (H)]
        S_gated = gate_memory(S_cur, g_t)                  # forget: keep a fraction alpha
        pred = batch_matvec(S_gated, k_t)                  # what memory returns for k_t
        delta = v_t - pred                                 # the error to correct
        write = batch_outer(delta, k_t)
        S_new = S_gated + write * e_t[..., None, None]     # write with strength beta
        o_t = scale * batch_matvec(S_new, q_t)             # read the updated state
        outputs.append(o_t)
        S_cur = S_new
    o = np.stack(outputs, axis=1) if outputs else np.zeros(v.shape, v.dtype)
    return o, S_cur


def gated_delta_rule_backward(do, q, k, v, *, beta, alpha=None, g=None, initial_state=None,
                              dS_T=None, scale=1.0):
    """Backward pass over time (README, "The backward pass") of :func:`gated_delta_rule`, keeping every
    state. Returns the same named tuple as :func:`gdn_ext.gated_delta_rule_backward`."""
    gate_shape, beta_shape = np.shape(alpha if g is None else g), np.shape(beta)
    q, k, v, beta, alpha, S0, dt = _inputs(q, k, v, beta, alpha, g, initial_state, (do,))
    do = np.asarray(do, dt)
    T = q.shape[1]

    # forward, keeping S_{t-1}, p_t and u_t for every t
    states, preds, writes = [S0], [], []
    for t in range(T):
        S_gated = gate_memory(states[-1], alpha[:, t])
        pred = batch_matvec(S_gated, k[:, t])
        u = beta[:, t][..., None] * (v[:, t] - pred)
        states.append(S_gated + batch_outer(u, k[:, t]))
        preds.append(pred)
        writes.append(u)

    G = np.zeros_like(S0) if dS_T is None else np.array(dS_T, dt)   # dL/dS_t
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dalpha, dbeta = np.zeros_like(alpha), np.zeros_like(beta)
    for t in reversed(range(T)):
        S_prev, S_t = states[t], states[t + 1]
        a_t, b_t = alpha[:, t], beta[:, t]
        # o_t = s S_t q_t
        G = G + scale * batch_outer(do[:, t], q[:, t])
        dq[:, t] = scale * batch_matvec(np.swapaxes(S_t, -1, -2), do[:, t])
        # S_t = S_gated + u_t k_t^T
        du = batch_matvec(G, k[:, t])
        dk[:, t] = batch_matvec(np.swapaxes(G, -1, -2), writes[t])
        # u_t = beta_t (v_t - p_t)
        dbeta[:, t] = np.sum(du * (v[:, t] - preds[t]), axis=-1)
        dv[:, t] = b_t[..., None] * du
        dp = -b_t[..., None] * du
        # p_t = S_gated k_t
        S_gated = gate_memory(S_prev, a_t)
        dk[:, t] += batch_matvec(np.swapaxes(S_gated, -1, -2), dp)
        G_gated = G + batch_outer(dp, k[:, t])
        # S_gated = alpha_t S_{t-1}
        dalpha[:, t] = np.sum(G_gated * S_prev, axis=(-2, -1))
        G = gate_memory(G_gated, a_t)

    dbeta = dbeta.reshape(beta_shape)
    if g is None:
        return GatedDeltaRuleGrads(dq, dk, dv, dbeta, dalpha.reshape(gate_shape), G)
    return GatedDeltaRuleGradsG(dq, dk, dv, dbeta, (alpha * dalpha).reshape(gate_shape), G)
