"""The gated delta rule in plain NumPy, step by step: the teaching version and the tests' oracle.

One token at a time, in three small helpers (``batch_matvec``, ``batch_outer``, ``gate_memory``),
with the backward pass over time (user guide, "The backward pass") written the same way, and
what real models need: gates per key channel, grouped value heads, L2-normalised q and k, and
packed variable-length batches.
Slow (a Python loop over time) and memory-hungry (the backward keeps every state, grouped heads
copy q and k): use :func:`gdn_ext.gated_delta_rule` for real work.

Arguments, shapes and results are those of :func:`gdn_ext.gated_delta_rule` and
:func:`gdn_ext.gated_delta_rule_backward` (q, k [B, T, H, Dk]; v [B, T, HV, Dv]; gates
[B, T, HV] or [B, T, HV, Dk]; state [B, HV, Dv, Dk]; the single-head form; ``cu_seqlens``),
without the argument checking. Computed in the inputs' promoted float dtype.

Source: S. Yang, J. Kautz, A. Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta
Rule", ICLR 2025 (arXiv:2412.06464), section 3.
"""
from __future__ import annotations

from typing import Optional, Union

import numpy as np
from numpy.typing import ArrayLike

# only pure-Python siblings: the oracle must import when the compiled module is missing or broken
from ._constants import L2_EPS
from ._results import (ChunkIntermediates, GatedDeltaRuleGrads, GatedDeltaRuleGradsG,
                       GatedDeltaRuleOutput)

__all__ = ["batch_matvec", "batch_outer", "gate_memory", "l2norm", "l2norm_backward",
           "gated_delta_rule", "gated_delta_rule_backward", "segment_decay",
           "chunk_gated_delta_rule"]


def batch_matvec(S: np.ndarray, x: np.ndarray) -> np.ndarray:
    """S x for a batch: S [..., Dv, Dk], x [..., Dk] -> [..., Dv]."""
    return np.einsum("...vk,...k->...v", S, x)


def batch_outer(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a b^T for a batch: a [..., Dv], b [..., Dk] -> [..., Dv, Dk]."""
    return np.einsum("...v,...k->...vk", a, b)


def gate_memory(S: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """The gate applied to the state, S D: S [..., Dv, Dk] times a scalar gate [...] or, per key
    channel, times gate [..., Dk] along the columns (D = diag(gate)).

    (Written ``S * gate[:, None, None]`` for a gate of shape [B, 1], this would
    broadcast to [B, B, Dv, Dk] when B > 1; here the gate has one number per state.)"""
    if gate.ndim == S.ndim - 1:
        return S * gate[..., None, :]
    return S * gate[..., None, None]


def l2norm(x: np.ndarray, eps: float = L2_EPS) -> np.ndarray:
    """x / sqrt(sum x^2 + eps) over the last axis (epsilon inside the root, as
    flash-linear-attention's use_qk_l2norm_in_kernel). x [..., D], unchecked."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def l2norm_backward(dy: np.ndarray, x: np.ndarray, eps: float = L2_EPS) -> np.ndarray:
    """dx of :func:`l2norm` given dy [..., D]: y = x / n, dx = (dy - y (y . dy)) / n with
    n = sqrt(sum x^2 + eps). For D = 1 that difference is dy eps / n^2, two nearly equal numbers
    subtracted (relative error about the dtype's epsilon times n^2 / eps), so it is taken in
    closed form there: dx = dy eps / n^3. Unchecked."""
    n = np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)
    if x.shape[-1] == 1:
        return dy * (eps / (n * n)) / n
    y = x / n
    return (dy - y * np.sum(y * dy, axis=-1, keepdims=True)) / n


def _as_multihead(q, k, v, beta, gate, state, arrays_dtype):
    """The single-head form [B, T, D] as H = 1; a [B, T, 1] scalar gate as [B, T]."""
    dt = arrays_dtype
    q, k, v, beta, gate = (np.asarray(a, dt) for a in (q, k, v, beta, gate))
    single = q.ndim == 3
    if single:
        per_key = gate.shape == q.shape and q.shape[-1] != 1
        q, k, v = q[:, :, None], k[:, :, None], v[:, :, None]
        beta = beta.reshape(q.shape[:2] + (1,))
        gate = gate[:, :, None] if per_key else gate.reshape(q.shape[:2] + (1,))
        state = None if state is None else np.asarray(state, dt)[:, None]
    elif state is not None:
        state = np.asarray(state, dt)
    return single, q, k, v, beta, gate, state


def _forward_loop(q, k, v, beta, alpha, S_cur, scale, delta_rule=True):
    """The reference loop, with heads: q, k [B, T, H, Dk] (one query/key per value head),
    v [B, T, H, Dv], beta [B, T, H], alpha [B, T, H] or [B, T, H, Dk], S_cur [B, H, Dv, Dk].
    delta_rule=False: linear attention's write, v_t itself instead of the correction."""
    outputs = []
    for t in range(q.shape[1]):
        q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]
        g_t, e_t = alpha[:, t], beta[:, t]
        S_gated = gate_memory(S_cur, g_t)                  # forget: keep a fraction alpha
        if delta_rule:
            pred = batch_matvec(S_gated, k_t)              # what memory returns for k_t
            delta = v_t - pred                             # the error to correct
        else:
            delta = v_t                                    # linear attention: add v_t k_t^T
        write = batch_outer(delta, k_t)
        S_new = S_gated + write * e_t[..., None, None]     # write with strength beta
        o_t = scale * batch_matvec(S_new, q_t)             # read the updated state
        outputs.append(o_t)
        S_cur = S_new
    o = np.stack(outputs, axis=1) if outputs else np.zeros(v.shape, v.dtype)
    return o, S_cur


def _backward_loop(do, q, k, v, beta, alpha, S0, dS_T, scale, delta_rule=True):
    """Backward of _forward_loop (same shapes), keeping every state."""
    T = q.shape[1]
    states, preds, writes = [S0], [], []
    for t in range(T):
        S_gated = gate_memory(states[-1], alpha[:, t])
        pred = batch_matvec(S_gated, k[:, t]) if delta_rule else np.zeros_like(v[:, t])
        u = beta[:, t][..., None] * (v[:, t] - pred)
        states.append(S_gated + batch_outer(u, k[:, t]))
        preds.append(pred)
        writes.append(u)

    G = np.zeros_like(S0) if dS_T is None else np.array(dS_T, S0.dtype)   # dL/dS_t
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dalpha, dbeta = np.zeros_like(alpha), np.zeros_like(beta)
    per_key = alpha.ndim == q.ndim
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
        dp = -b_t[..., None] * du if delta_rule else np.zeros_like(du)   # p_t feeds u_t
        # p_t = S_gated k_t
        S_gated = gate_memory(S_prev, a_t)
        dk[:, t] += batch_matvec(np.swapaxes(S_gated, -1, -2), dp)
        G_gated = G + batch_outer(dp, k[:, t])
        # S_gated = S_{t-1} D_t
        dalpha[:, t] = np.sum(G_gated * S_prev, axis=-2 if per_key else (-2, -1))
        G = gate_memory(G_gated, a_t)
    return dq, dk, dv, dbeta, dalpha, G


def _prepare(q, k, v, beta, alpha, g, initial_state, normalize_qk, extra=()):
    """Float arrays in the multi-head layout, gate as alpha, q and k repeated per value head
    (normalised when asked), and what is needed to undo each step in the backward."""
    gate_in = alpha if g is None else g
    beta_shape = np.shape(beta)               # the gradients come back in the inputs' shapes
    arrays = [q, k, v, beta, gate_in] + list(extra)
    if initial_state is not None:
        arrays.append(initial_state)
    dt = np.result_type(np.float32, *(np.asarray(a) for a in arrays))
    single, q, k, v, beta, gate, S0 = _as_multihead(q, k, v, beta, gate_in, initial_state, dt)
    alpha = gate if g is None else np.exp(gate)
    # value heads per query/key head (H = HV = 0: no heads, nothing to repeat)
    G = v.shape[2] // q.shape[2] if q.shape[2] else 1
    qn, kn = (l2norm(q), l2norm(k)) if normalize_qk else (q, k)
    q_rep, k_rep = np.repeat(qn, G, axis=2), np.repeat(kn, G, axis=2)
    return dict(dt=dt, single=single, q=q, k=k, v=v, beta=beta, alpha=alpha, gate=gate, S0=S0,
                G=G, q_rep=q_rep, k_rep=k_rep, gate_shape=np.shape(gate_in), beta_shape=beta_shape)


def _sequences(T, cu_seqlens):
    """(start, end) of each sequence: the whole T, or the packed pieces."""
    if cu_seqlens is None:
        return [(0, T)]
    cu = [int(c) for c in cu_seqlens]
    return list(zip(cu[:-1], cu[1:]))


def gated_delta_rule(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, beta: ArrayLike,
                     alpha: Optional[ArrayLike] = None, g: Optional[ArrayLike] = None,
                     initial_state: Optional[ArrayLike] = None, scale: float = 1.0,
                     normalize_qk: bool = False, cu_seqlens: Optional[ArrayLike] = None,
                     delta_rule: bool = True) -> GatedDeltaRuleOutput:
    """The reference forward loop, generalised. Returns (o, S_T) shaped as
    :func:`gdn_ext.gated_delta_rule` returns them; ``delta_rule=False`` writes
    ``beta_t v_t k_t^T`` (linear attention, gated or not) instead of the delta rule's
    correction."""
    P = _prepare(q, k, v, beta, alpha, g, initial_state, normalize_qk)
    v, beta, alpha = P["v"], P["beta"], P["alpha"]
    B, T, HV, Dv = v.shape
    Dk = P["q"].shape[-1]
    outs, finals = [], []
    for n, (a, b) in enumerate(_sequences(T, cu_seqlens)):   # each packed sequence on its own
        if P["S0"] is None:
            S0 = np.zeros((B, HV, Dv, Dk), P["dt"])
        else:
            S0 = P["S0"] if cu_seqlens is None else P["S0"][n:n + 1]
        o, S_T = _forward_loop(P["q_rep"][:, a:b], P["k_rep"][:, a:b], v[:, a:b], beta[:, a:b],
                               alpha[:, a:b], S0, scale, delta_rule)
        outs.append(o)
        finals.append(S_T)
    o = np.concatenate(outs, axis=1)
    S_T = finals[0] if cu_seqlens is None else np.concatenate(finals, axis=0)
    if P["single"]:
        return GatedDeltaRuleOutput(o[:, :, 0], S_T[:, 0])
    return GatedDeltaRuleOutput(o, S_T)


def gated_delta_rule_backward(do: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
                              beta: ArrayLike, alpha: Optional[ArrayLike] = None,
                              g: Optional[ArrayLike] = None,
                              initial_state: Optional[ArrayLike] = None,
                              dS_T: Optional[ArrayLike] = None, scale: float = 1.0,
                              normalize_qk: bool = False, cu_seqlens: Optional[ArrayLike] = None,
                              delta_rule: bool = True,
                              ) -> Union[GatedDeltaRuleGrads, GatedDeltaRuleGradsG]:
    """Backward pass over time (user guide, "The backward pass") of :func:`gated_delta_rule`, keeping
    every state. Returns the same named tuple as :func:`gdn_ext.gated_delta_rule_backward`, each
    gradient in its input's shape (a single-head beta [B, T] gives dbeta [B, T])."""
    P = _prepare(q, k, v, beta, alpha, g, initial_state, normalize_qk, extra=(do,))
    dt, v, beta, alpha, G = P["dt"], P["v"], P["beta"], P["alpha"], P["G"]
    do = np.asarray(do, dt)
    if P["single"]:
        do = do[:, :, None]
        dS_T = None if dS_T is None else np.asarray(dS_T, dt)[:, None]
    B, T, HV, Dv = v.shape
    Dk = P["q"].shape[-1]
    dq_rep, dk_rep = np.zeros_like(P["q_rep"]), np.zeros_like(P["k_rep"])
    dv, dbeta, dalpha = np.zeros_like(v), np.zeros_like(beta), np.zeros_like(alpha)
    dS0 = []
    for n, (a, b) in enumerate(_sequences(T, cu_seqlens)):
        if P["S0"] is None:
            S0 = np.zeros((B, HV, Dv, Dk), dt)
        else:
            S0 = P["S0"] if cu_seqlens is None else P["S0"][n:n + 1]
        dST_n = None if dS_T is None else (dS_T if cu_seqlens is None else dS_T[n:n + 1])
        (dq_rep[:, a:b], dk_rep[:, a:b], dv[:, a:b], dbeta[:, a:b], dalpha[:, a:b],
         dS0_n) = _backward_loop(do[:, a:b], P["q_rep"][:, a:b], P["k_rep"][:, a:b], v[:, a:b],
                                 beta[:, a:b], alpha[:, a:b], S0, dST_n, scale, delta_rule)
        dS0.append(dS0_n)
    dS0 = dS0[0] if cu_seqlens is None else np.concatenate(dS0, axis=0)

    # q, k were repeated for each value head of a group: their gradients add up
    H = P["q"].shape[2]
    dq = dq_rep.reshape(B, T, H, G, Dk).sum(axis=3)
    dk = dk_rep.reshape(B, T, H, G, Dk).sum(axis=3)
    if normalize_qk:
        dq, dk = l2norm_backward(dq, P["q"]), l2norm_backward(dk, P["k"])
    if P["single"]:
        dq, dk, dv, dS0 = dq[:, :, 0], dk[:, :, 0], dv[:, :, 0], dS0[:, 0]
    dbeta = dbeta.reshape(P["beta_shape"])
    if g is None:
        return GatedDeltaRuleGrads(dq, dk, dv, dbeta, dalpha.reshape(P["gate_shape"]), dS0)
    return GatedDeltaRuleGradsG(dq, dk, dv, dbeta, (alpha * dalpha).reshape(P["gate_shape"]), dS0)


def segment_decay(g: np.ndarray) -> np.ndarray:
    """Gamma [..., C, C] from log decays g [..., C]: Gamma_ij = exp(g_{j+1} + ... + g_i), the
    product of the gates of the tokens after j up to i, for i >= j (1 on the diagonal), 0 above
    it. Summed by position rather than as exp(G_i - G_j) of cumulative sums, which is 0/0 --
    (-inf) - (-inf) -- after a gate of exactly 0 and loses digits when G is large."""
    C = g.shape[-1]
    below = np.tril(np.ones((C, C), bool), -1)
    # x[..., l, j] = g_l for l > j; summed down the rows, row i holds g_{j+1} + ... + g_i
    seg = np.cumsum(np.where(below, g[..., :, None], 0.0), axis=-2)
    return np.where(np.tril(np.ones((C, C), bool)), np.exp(seg), 0.0)


def chunk_gated_delta_rule(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, beta: ArrayLike,
                           g: ArrayLike, chunk_size: int = 64, scale: float = 1.0,
                           initial_state: Optional[ArrayLike] = None, normalize_qk: bool = False,
                           return_intermediates: bool = True,
                           ) -> Union[ChunkIntermediates, GatedDeltaRuleOutput]:
    """The chunkwise (WY / UT-transform) form of the gated delta rule in plain NumPy, one chunk of
    ``chunk_size`` tokens at a time, for reading next to a chunk kernel of one's own.

    The same function as :func:`gated_delta_rule` (scalar gate, given as the log decay ``g``),
    computed as flash-linear-attention's ``chunk_gated_delta_rule`` does. Per chunk, with rows of
    Q, K, V its C tokens, H = S^T the state entering it and Gamma = :func:`segment_decay` (g)::

        G     = cumsum(g)                                   g_cumsum
        A     = (I + strictly_lower(diag(beta) (K K^T o Gamma)))^-1   (forward substitution)
        w     = A diag(beta e^G) K ;   u = A diag(beta) V
        v_new = u - w H
        o     = scale (diag(e^G) Q H + lower(Q K^T o Gamma) v_new)
        H    <- e^{G_C} H + (diag(e^{G_C - G}) K)^T v_new

    Parameters
    ----------
    q, k : array [B, T, H, Dk] (single-head: [B, T, Dk])
    v : array [B, T, HV, Dv], HV a multiple of H (grouped value heads)
    beta : array [B, T, HV]
    g : array [B, T, HV]
        Log decays (alpha = exp(g)); -inf is a gate of exactly 0.
    chunk_size : int, default 64
        C, tokens per chunk; T need not be a multiple of it.
    scale, initial_state, normalize_qk
        As :func:`gated_delta_rule` (initial_state in gdn_ext's layout [B, HV, Dv, Dk]).
    return_intermediates : bool, default True
        Return :class:`~gdn_ext.ChunkIntermediates` (o, S_T and the pieces g_cumsum, A, w, u, h,
        v_new, whose layouts it lists); False: ``GatedDeltaRuleOutput(o, S_T)``.

    Raises
    ------
    ValueError
        chunk_size < 1, or a gate per key channel (this form's per-key variant needs sub-chunks;
        use :func:`gated_delta_rule`).

    Precision: the UT transform solves a triangular system whose condition grows with beta
    ||k||^2 and the chunk size; in float64 it agrees with the recurrence to about 1e-13 for
    normalised keys. Unchecked otherwise, slow, float64 unless every input is float32.

    Source: S. Yang, B. Wang, Y. Zhang, Y. Shen, Y. Kim, "Parallelizing Linear Transformers with
    the Delta Rule over Sequence Length", NeurIPS 2024 (arXiv:2406.06484), section 3; with the
    gate as in S. Yang, J. Kautz, A. Hatamizadeh, "Gated Delta Networks", ICLR 2025, section 3.
    """
    if int(chunk_size) != chunk_size or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
    C = int(chunk_size)
    P = _prepare(q, k, v, beta, None, g, initial_state, normalize_qk)
    dt, v, beta = P["dt"], P["v"], P["beta"]
    gl = np.broadcast_to(P["gate"], beta.shape) if np.ndim(P["gate"]) < beta.ndim else P["gate"]
    if gl.shape != beta.shape:
        raise ValueError(f"g must have one log decay per head, shape {beta.shape}; got "
                         f"{np.shape(g)} (a gate per key channel: use gated_delta_rule)")
    qr, kr = P["q_rep"], P["k_rep"]
    B, T, HV, Dv = v.shape
    Dk = qr.shape[-1]
    NT = -(-T // C)
    pad = NT * C - T
    # [B, HV, NT, C, D] chunks; padded tokens have k = v = 0, beta = 0, g = 0: they write nothing
    def chunks(x):
        x = np.concatenate([x, np.zeros((B, pad) + x.shape[2:], dt)], axis=1)
        x = x.reshape((B, NT, C) + x.shape[2:])
        return np.moveaxis(x, 3, 1)
    Q, K, V, b, gc = chunks(qr), chunks(kr), chunks(v), chunks(beta), chunks(gl)
    G = np.cumsum(gc, axis=-1)                                      # [B, HV, NT, C]
    Gam = segment_decay(gc)                                         # [B, HV, NT, C, C]
    eye = np.eye(C, dtype=dt)
    Araw = np.tril(b[..., None] * (K @ np.swapaxes(K, -1, -2)) * Gam, -1)
    A = np.linalg.solve(eye + Araw, np.broadcast_to(eye, Araw.shape))   # (I + A)^-1
    w = A @ ((b * np.exp(G))[..., None] * K)
    u = A @ (b[..., None] * V)
    Hs = np.zeros((B, HV, Dk, Dv), dt) if P["S0"] is None else np.swapaxes(P["S0"], -1, -2)
    h = np.empty((B, HV, NT, Dk, Dv), dt)
    o = np.empty((B, HV, NT, C, Dv), dt)
    v_new = np.empty_like(u)
    for n in range(NT):
        h[:, :, n] = Hs
        vn = u[:, :, n] - w[:, :, n] @ Hs
        v_new[:, :, n] = vn
        Qn, Kn, Gn = Q[:, :, n], K[:, :, n], G[:, :, n]
        P_ = np.tril(Qn @ np.swapaxes(Kn, -1, -2)) * Gam[:, :, n]
        o[:, :, n] = scale * (np.exp(Gn)[..., None] * (Qn @ Hs) + P_ @ vn)
        last = Gam[:, :, n][..., -1, :]                             # e^{G_C - G_j}
        Hs = np.exp(Gn[..., -1])[..., None, None] * Hs + np.swapaxes(last[..., None] * Kn, -1, -2) @ vn

    def tokens(x):                                                  # [B, HV, NT, C, D] -> [B, T, HV, D]
        return np.moveaxis(x, 1, 3).reshape((B, NT * C, HV) + x.shape[4:])[:, :T]
    o_t, S_T = tokens(o), np.swapaxes(Hs, -1, -2)
    if P["single"]:
        o_t, S_T = o_t[:, :, 0], S_T[:, 0]
    if not return_intermediates:
        return GatedDeltaRuleOutput(o_t, S_T)
    g_cum = tokens(G[..., None])[..., 0]
    return ChunkIntermediates(o_t, S_T, g_cum, A, tokens(w), tokens(u), np.moveaxis(h, 2, 1),
                              tokens(v_new))
