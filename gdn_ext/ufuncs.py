"""The raw generalized ufuncs of gdn_ext (C, OpenMP over the loop dimensions).

``gated_delta_rule_fwd``
    Signature ``(t,k),(t,k),(t,v),(t),(t),(v,k),()->(t,v),(v,k)``:
    ``o, S_T = gated_delta_rule_fwd(q, k, v, alpha, beta, S_0, scale)`` for one (sequence, head) per
    loop element: q, k ``[..., T, Dk]``, v ``[..., T, Dv]``, alpha, beta ``[..., T]``,
    S_0 ``[..., Dv, Dk]``, scale ``[...]``; o ``[..., T, Dv]``, S_T ``[..., Dv, Dk]``.

``gated_delta_rule_bwd``
    Signature ``(t,v),(t,k),(t,k),(t,v),(t),(t),(v,k),(v,k),()->(t,k),(t,k),(t,v),(t),(t),(v,k)``:
    ``dq, dk, dv, dalpha, dbeta, dS_0 = gated_delta_rule_bwd(do, q, k, v, alpha, beta, S_0, dS_T,
    scale)``, the backward pass over time of the forward (the documentation's user guide, "The
    recurrence and its backward pass"), recomputing states from checkpoints every
    ``C = ceil(sqrt(T))`` steps.

``gated_delta_rule_general_fwd``
    Signature ``(t,k),(t,k),(t,v),(t,k),(t),(n,v,k),(),(),(m)->(t,v),(n,v,k)``:
    ``o, S_T = gated_delta_rule_general_fwd(q, k, v, alpha, beta, S_0, scale, normalize_qk,
    cu_seqlens)``. The gate is per key channel, alpha ``[..., T, Dk]`` (``D_t = diag(alpha_t)``;
    pass a scalar gate as a stride-0 broadcast ``np.broadcast_to(a[..., None], (..., T, Dk))``);
    ``normalize_qk`` ``[...]`` nonzero L2-normalises q and k inside the kernel
    (``x / sqrt(sum x^2 + 1e-6)``); ``cu_seqlens`` int64 ``[..., n + 1]`` packs n sequences along
    t, sequence i being tokens ``cu_seqlens[i] .. cu_seqlens[i+1] - 1`` with its own initial and
    final state ``S_0[..., i, :, :]``, ``S_T[..., i, :, :]`` (``[0, T]`` and n = 1 for one
    sequence). A cu_seqlens that does not start at 0, does not end at T or decreases raises
    ValueError.

``gated_delta_rule_general_bwd``
    Signature ``(t,v),(t,k),(t,k),(t,v),(t,k),(t),(n,v,k),(n,v,k),(),(),(m)->(t,k),(t,k),(t,v),(t,k),(t),(n,v,k)``:
    ``dq, dk, dv, dalpha, dbeta, dS_0 = gated_delta_rule_general_bwd(do, q, k, v, alpha, beta,
    S_0, dS_T, scale, normalize_qk, cu_seqlens)``, dalpha per key channel ``[..., T, Dk]``.

``gated_delta_rule_fwd_ckpt``, ``gated_delta_rule_general_fwd_ckpt``
    The forwards with one more output, the checkpoints ``[..., c, Dv, Dk]`` (general:
    ``[..., n, c, Dv, Dk]``): the states before steps 0, C, 2C, ... of each sequence,
    ``C = checkpoint_interval(T)``, ``c >= checkpoint_count(T)`` of the longest sequence. Pass it
    with ``out=`` (c is not an input dimension).

``gated_delta_rule_bwd_ckpt``, ``gated_delta_rule_general_bwd_ckpt``
    The backwards with the checkpoints as one more input, after ``scale`` (general: after
    ``cu_seqlens``): they skip their own checkpoint pass and trust the checkpoints to come from a
    forward over the same inputs (``gdn_ext.gated_delta_rule_backward`` checks what it can).

The rule family: ``gated_rule_fwd`` / ``gated_rule_bwd`` (and their ``_ckpt`` variants) are the
general pair with one more input after ``cu_seqlens``, ``delta_rule`` (a scalar per loop
element): nonzero is the delta rule, zero writes ``u_t = beta_t v_t`` (linear attention and its
gated forms, GLA, Mamba2 / RetNet decays).

Grouped value heads need no ufunc of their own: broadcast q and k over the value heads of a
group (a stride-0 view, no copy) and sum dq, dk over the group afterwards.

Time is a core dimension, so the (sequence, head) pairs are the loop dimensions: put them first,
e.g. ``q.transpose(0, 2, 1, 3)`` for the ``[B, T, H, Dk]`` layout (a view, no copy), or use
``axes=``. Being ufuncs, they broadcast over the loop dimensions, cast dtypes (float16 and small
integers run in float32, other integers in float64), accept ``out=`` and honour
``__array_ufunc__``. Loops exist for float32 and float64; complex input raises TypeError.

Aliasing: an ``out=`` array may be the memory of any input. NumPy copies an input that partly
overlaps an output; one that is exactly an output (the same memory and strides) it passes
through, and the loops copy it themselves before computing (the kernels are not element-wise).
The forward's S_0 given as S_T's memory is the one exact alias computed in place without a copy
(each state row is read whole before it is written): that is ``gated_delta_rule_step``'s
``inplace=True``.

The loop over loop elements runs in parallel with OpenMP (default thread count: OpenMP's, which
``OMP_NUM_THREADS`` and threadpoolctl control) with the GIL released; in a process made by
``fork()`` it runs on one thread (the OpenMP runtime's threads do not survive a fork). Calls of
10**7 multiply-adds or more stop within a block of tokens on Ctrl-C and raise KeyboardInterrupt
(POSIX). Floating-point errors of every (sequence, head) and every inner-loop call reach
``np.errstate``. Shapes are not checked beyond
what the signature implies: ``gdn_ext.gated_delta_rule`` is the checked, documented entry point.

Math: S. Yang, J. Kautz, A. Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule",
ICLR 2025 (arXiv:2412.06464).
"""
from ._native import _core
from ._core import (gated_delta_rule_bwd, gated_delta_rule_bwd_ckpt, gated_delta_rule_fwd,
                    gated_delta_rule_fwd_ckpt, gated_delta_rule_general_bwd,
                    gated_delta_rule_general_bwd_ckpt, gated_delta_rule_general_fwd,
                    gated_delta_rule_general_fwd_ckpt, gated_rule_bwd, gated_rule_bwd_ckpt,
                    gated_rule_fwd, gated_rule_fwd_ckpt)

__all__ = ["gated_delta_rule_fwd", "gated_delta_rule_bwd", "gated_delta_rule_general_fwd",
           "gated_delta_rule_general_bwd", "gated_delta_rule_fwd_ckpt", "gated_delta_rule_bwd_ckpt",
           "gated_delta_rule_general_fwd_ckpt", "gated_delta_rule_general_bwd_ckpt",
           "gated_rule_fwd", "gated_rule_bwd", "gated_rule_fwd_ckpt", "gated_rule_bwd_ckpt"]
