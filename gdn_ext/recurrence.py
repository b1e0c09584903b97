"""The gated delta rule: checked NumPy entry points over the C generalized ufuncs.

Math (user guide, "The recurrence and its backward pass"): S. Yang, J. Kautz, A. Hatamizadeh,
"Gated Delta Networks: Improving Mamba2 with Delta Rule", ICLR 2025 (arXiv:2412.06464),
section 3.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Sequence, Tuple, Union, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._native import _core
from ._checks import as_real_array, converted, expect_shape, flag, sequence_length
from ._algorithm import chunk_for, refuse_chunk_with_checkpoints
from ._cache import uses_block_cache
from ._problem import _Problem
from ._threads import (fp_recorded, lead_pieces, pieces, report_fp, run_pieces, thread_count,
                       threads)
from ._results import (GatedDeltaRuleGrads, GatedDeltaRuleGradsG, GatedDeltaRuleOutput,
                       GatedDeltaRuleOutputWithCheckpoints, StepResult)

__all__ = ["threads", "gated_delta_rule", "gated_delta_rule_backward", "gated_delta_rule_step",
           "GatedDeltaRuleOutput", "GatedDeltaRuleOutputWithCheckpoints", "GatedDeltaRuleGrads",
           "GatedDeltaRuleGradsG", "openmp_enabled", "checkpoint_interval", "checkpoint_count",
           "StepResult"]

Array = NDArray[Any]
CuSeqlens = Union[ArrayLike, Sequence[int], None]
Algorithm = Literal["auto", "chunk", "recurrent"]


def openmp_enabled() -> bool:
    """Whether this build runs the (sequence, head) loop in parallel with OpenMP.

    False when the compiler had no OpenMP at build time (the kernels then run serially)."""
    return bool(_core.openmp_enabled())


def checkpoint_interval(T: int) -> int:
    """C, the number of steps between state checkpoints in the backward pass: ceil(sqrt(T)).

    The backward holds ceil(T/C) + 1 states of Dv*Dk numbers per (sequence, head) pair in flight
    (the checkpoints and dL/dS_t; Dv and Dk rounded up to multiples of 16), plus one segment of C
    states of a strip of 16 value rows per thread. Raises TypeError for a T that is not an int, ValueError for T < 0 or T >= 2**62."""
    return int(_core.checkpoint_interval(sequence_length(T)))


def _call(ufunc, args, out, num_threads, chunk=(0, False)):
    """Run a gufunc as one call (its casts and all its inner-loop calls; Ctrl-C on the main
    thread stops it as a whole), in the form ``chunk`` = (chunk size, auto) asks for
    (_algorithm.chunk_for; (0, False): the recurrence); NumPy's floating-point errors are
    reported when it ends as the caller's np.errstate says, warnings at the caller's line
    instead of this one (_threads.report_fp), whatever the mix of modes."""
    seen = {}
    try:
        # inside the try: a KeyboardInterrupt right after it returns still ends the call
        _core._call_begin(num_threads, *chunk)
        with fp_recorded(seen):
            ufunc(*args, out=out, dtype=out[0].dtype, casting="same_kind")
    finally:
        _core._call_end()
    if seen:
        report_fp(seen, ufunc.__name__)


def _step_out(p, out):
    """The kernel's view of the step's ``out=`` array, checked (see gated_delta_rule_step)."""
    if not isinstance(out, np.ndarray):
        raise ValueError(f"out must be an ndarray to write S_t into; got {type(out).__name__}")
    expect_shape(out, "out", p.state_shape, p.state_layout)
    if out.dtype != p.dtype or not out.flags.writeable or not out.flags.c_contiguous:
        raise ValueError(f"out must be a writeable, C-contiguous {p.dtype} array (the result's "
                         f"dtype); got a {out.dtype} array that is "
                         f"{'' if out.flags.writeable else 'read-only, '}"
                         f"{'' if out.flags.c_contiguous else 'not '}C-contiguous")
    return p.state_view(out)


def _forward(p, num_threads, checkpoints=False, chunk=(0, False)):
    """Run the forward of a checked problem in the form ``chunk`` asks for; returns
    (o [B, T, HV, Dv], S_T in the state shape) and, with checkpoints=True, what the backward
    restarts from in its user shape: the recurrence's checkpoints for chunk (0, False), else the
    chunk form's states (gdn.h; pairs that auto gives the recurrence leave theirs zero)."""
    o, o_k = p.new_seq(p.Dv)
    S_T, S_T_k = p.new_state()
    args = (p.q, p.k, p.v, p.alpha, p.beta, p.S0, p.scale) + p.ufunc_args()
    if not checkpoints:
        _call(p.ufunc("fwd"), args, (o_k, S_T_k), num_threads, chunk)
        return o, S_T
    # the recurrence's packed checkpoints: zeros in the slots past a shorter sequence's own count
    # (the kernel writes the rest); the chunk form's kernel writes every slot, zeros included
    ck = (np.zeros if p.packed and not chunk[0] else np.empty)(p.ckpt_shape(chunk[0]), p.dtype)
    _call(p.ufunc("fwd_ckpt"), args, (o_k, S_T_k, p.ckpt_view(ck)), num_threads,
          (chunk[0], chunk[1], chunk[0] > 0))
    return o, S_T, ck


# The overloads tell a type checker what the flags return: S_T is an array unless
# output_final_state=False, and return_checkpoints=True adds the checkpoints.
@overload
def gated_delta_rule(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, beta: ArrayLike,
                     alpha: Optional[ArrayLike] = None, g: Optional[ArrayLike] = None,
                     initial_state: Optional[ArrayLike] = None, scale: float = 1.0,
                     output_final_state: Literal[True] = True, num_threads: Optional[int] = None,
                     normalize_qk: bool = False, cu_seqlens: CuSeqlens = None,
                     return_checkpoints: Literal[False] = False, check_values: bool = True,
                     delta_rule: bool = True, algorithm: Algorithm = "auto",
                     chunk_size: Optional[int] = None) -> GatedDeltaRuleOutput: ...
@overload  # noqa: E302
def gated_delta_rule(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, beta: ArrayLike,
                     alpha: Optional[ArrayLike] = None, g: Optional[ArrayLike] = None,
                     initial_state: Optional[ArrayLike] = None, scale: float = 1.0,
                     output_final_state: Literal[True] = True, num_threads: Optional[int] = None,
                     normalize_qk: bool = False, cu_seqlens: CuSeqlens = None,
                     return_checkpoints: Literal[True], check_values: bool = True,
                     delta_rule: bool = True, algorithm: Algorithm = "auto",
                     chunk_size: Optional[int] = None) -> GatedDeltaRuleOutputWithCheckpoints: ...
@overload  # noqa: E302
def gated_delta_rule(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, beta: ArrayLike,
                     alpha: Optional[ArrayLike] = None, g: Optional[ArrayLike] = None,
                     initial_state: Optional[ArrayLike] = None, scale: float = 1.0,
                     output_final_state: bool = True, num_threads: Optional[int] = None,
                     normalize_qk: bool = False, cu_seqlens: CuSeqlens = None,
                     return_checkpoints: bool = False, check_values: bool = True,
                     delta_rule: bool = True, algorithm: Algorithm = "auto",
                     chunk_size: Optional[int] = None,
                     ) -> Union[Tuple[Array, Optional[Array]], Tuple[Array, Optional[Array], Array]]:
    ...


@uses_block_cache
def gated_delta_rule(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, beta: ArrayLike,
                     alpha: Optional[ArrayLike] = None, g: Optional[ArrayLike] = None,
                     initial_state: Optional[ArrayLike] = None, scale: float = 1.0,
                     output_final_state: bool = True, num_threads: Optional[int] = None,
                     normalize_qk: bool = False, cu_seqlens: CuSeqlens = None,
                     return_checkpoints: bool = False, check_values: bool = True,
                     delta_rule: bool = True, algorithm: Algorithm = "auto",
                     chunk_size: Optional[int] = None,
                     ) -> Union[Tuple[Array, Optional[Array]], Tuple[Array, Optional[Array], Array]]:
    """The gated delta rule recurrence (Gated DeltaNet's token mixer), computed in C.

    For each sequence and value head, with state S of shape [Dv, Dk] and t = 1..T::

        p_t = S_{t-1} D_t k_t                    (what the gated memory returns for k_t)
        u_t = beta_t (v_t - p_t)                 (delta rule: write only the correction)
        S_t = S_{t-1} D_t + u_t k_t^T            (D_t = alpha_t I, or diag(alpha_t) per key)
        o_t = scale * S_t q_t                    (read the updated state)

    Parameters
    ----------
    q, k : array [B, T, H, Dk]
        Queries and keys (H query/key heads). The single-head form, [B, T, Dk], is
        accepted too, and then every result is returned in that form.
    v : array [B, T, HV, Dv]  (single-head: [B, T, Dv])
        Values. HV must be a multiple of H: value head hv reads query/key head hv // (HV / H)
        (grouped order, as flash-linear-attention and transformers); HV = H is the usual case.
    beta : array [B, T, HV]  (single-head: [B, T] or [B, T, 1]), or a scalar, keyword-only
        Write strength (``eta`` in :mod:`gdn_ext.layer`), usually in [0, 1]. A scalar or any array
        that broadcasts to [B, T, HV] by NumPy's rules (aligned at the right: [HV] one per
        head, [B, 1, 1] one per sequence) is broadcast; its gradient comes back in the shape
        given. Python numbers do not change the computation's dtype.
    alpha : array [B, T, HV] or [B, T, HV, Dk]  (single-head: [B, T], [B, T, 1] or [B, T, Dk])
        Decay, the fraction of the old state kept at each step, in [0, 1] (``gate`` in
        :mod:`gdn_ext.layer`): one per head, or one per key channel (D_t = diag(alpha_t), the gating of Gated
        Linear Attention and Kimi Delta Attention). The shape picks the variant. Exactly one of
        ``alpha`` and ``g`` must be given. Broadcasts as beta does (``alpha=1.0``: no decay, the
        delta rule of DeltaNet); an array with one dimension more than [B, T, HV] broadcasts to
        the per-key [B, T, HV, Dk] ([1, 1, HV, Dk]: one decay per head and key channel).
    g : array, same shapes as alpha
        Log decay (natural log, <= 0): alpha = exp(g); g = -inf means alpha = 0.
    initial_state : array [B, HV, Dv, Dk]  (single-head: [B, Dv, Dk]; packed: [N, HV, Dv, Dk])
        S_0; zeros when None. Rows index the value dimension, columns the key dimension
        (the transpose of flash-linear-attention's [.., Dk, Dv]).
    scale : float, default 1.0
        Read-out scale s (finite). The paper's recurrence has none; flash-linear-attention uses Dk**-0.5.
    output_final_state : bool, default True
        Return S_T; when False the second result is None.
    num_threads : int or None
        OpenMP threads for the loop over (sequence, head) pairs. None uses OpenMP's default, which
        ``OMP_NUM_THREADS`` and threadpoolctl control. Results do not depend on it (bitwise).
        Threads share out the pairs; with fewer pairs than threads the forward also splits each
        state's value rows between threads. At most 4 threads per processor.
    normalize_qk : bool, default False
        L2-normalise q and k inside the kernel, ``x / sqrt(sum(x**2) + 1e-6)`` (epsilon inside the
        root, as flash-linear-attention's ``use_qk_l2norm_in_kernel``); gradients flow to the raw
        q and k.
    cu_seqlens : int array [N + 1], optional
        Packed variable-length batch (the FlashAttention convention): B must be 1 and sequence n
        is tokens cu_seqlens[n] .. cu_seqlens[n+1] - 1, starting from initial_state[n] and ending in
        S_T[n]; no state crosses a boundary. cu_seqlens starts at 0, never decreases, ends at T.
    return_checkpoints : bool, default False
        Also return the states the backward would recompute as its checkpoints (before steps 0,
        C, 2C, ... of each sequence, C = checkpoint_interval(T)), to pass to
        :func:`gated_delta_rule_backward` as ``checkpoints=``: training then runs the recurrence
        forward once less. They cost checkpoint_count(T) ~ sqrt(T) states per sequence and head.
    delta_rule : bool, default True
        False writes ``u_t = beta_t v_t`` instead of the delta rule's correction: the rule family
        in one kernel -- linear attention (alpha = 1, beta = 1), gated linear attention with a
        scalar decay as in Mamba2 / RetNet or a per-key decay as in GLA (alpha or g), next to
        DeltaNet (alpha = 1), Gated DeltaNet and Kimi Delta Attention's per-key-gated delta rule
        (delta_rule=True). Same cost.
    algorithm : {"auto", "chunk", "recurrent"}, default "auto"
        How to compute it; the function is the same, the rounding and the speed differ.
        "recurrent" walks the tokens one by one. "chunk" runs the chunkwise form (the WY / UT
        transform of Yang et al., NeurIPS 2024, sec. 3): per chunk of ``chunk_size`` tokens a
        unit lower-triangular solve and small matrix products, the state read and written once
        per chunk; a gate per key channel has no chunkwise kernel and runs the recurrence.
        "auto" takes the chunkwise form for a gate of one number per token and sequences of at
        least 64 tokens, unless, with the delta rule and keys not normalised, some
        beta_t ||k_t||^2 exceeds 2 (where the triangular solve amplifies rounding; user guide,
        "Floating point"). With ``return_checkpoints=True`` the recurrence runs (the
        checkpoints are its states): "auto" then means the recurrence, and "chunk" is refused.
    chunk_size : int or None, default None
        Tokens per chunk of the chunkwise form, 1 to 256; None: 32. T need not be a multiple.
        Refused with algorithm="recurrent", which has no chunks.
    check_values : bool, default True
        Warn (UserWarning, at the caller's line) when alpha is outside [0, 1], g above 0, or T < H
        with 1 < T (q may be head-first [B, H, T, D]); with the delta rule also when beta is
        outside [0, 2] or, keys not normalised, beta ||k||^2 is above 2 at a step whose
        transition along k, alpha (1 - beta ||k||^2), exceeds 1 in magnitude (the state is kept
        bounded by beta ||k||^2 in [0, 2] whatever alpha in [0, 1]). The results are computed
        all the same; False skips these checks (a few passes over beta, the gate and k).

    Returns
    -------
    GatedDeltaRuleOutput (o, S_T), a named tuple; with ``return_checkpoints=True``
    GatedDeltaRuleOutputWithCheckpoints (o, S_T, checkpoints). They unpack as tuples.

    o : ndarray [B, T, HV, Dv]  (single-head: [B, T, Dv])
    S_T : ndarray, the shape of initial_state ([B, HV, Dv, Dk]; packed: [N, HV, Dv, Dk]), or None
        when ``output_final_state=False``
    checkpoints : ndarray [B, HV, NCK, Dv, Dk] (single-head [B, NCK, Dv, Dk]; packed
        [N, HV, NCK, Dv, Dk]; NCK = checkpoint_count of the longest sequence), only with
        ``return_checkpoints=True``.

    Both are float32 when every input casts safely to float32 (float32, float16, small ints) and
    float64 otherwise, computed in that precision, as a NumPy ufunc would choose (dtypes that do
    not cast safely to float64, such as longdouble, raise TypeError). Inputs are never modified.
    Floating-point warnings (overflow, invalid) follow NumPy's errstate whichever thread met them.

    Raises
    ------
    TypeError
        An input that is not a real array (complex, object, strings, masked arrays), a non-scalar
        scale, a num_threads that is not an int, a flag that is not a bool, a cu_seqlens that is
        not an integer array.
    ValueError
        Wrong ranks or mismatched sizes (the message names the argument and the expected shape),
        HV not a multiple of H, both or neither of alpha and g, a non-finite scale,
        num_threads < 1, a cu_seqlens that does not start at 0, decreases, does not end at T, or
        comes with B != 1, an algorithm other than "auto", "chunk", "recurrent", a chunk_size
        outside [1, 256] or given with algorithm="recurrent", algorithm="chunk" with
        return_checkpoints=True.

    Notes
    -----
    Cost: about 7*Dk*Dv flops per token and value head. Parallel over the (sequence, head) pairs
    with the GIL released. The raw ufuncs are in ``gdn_ext.ufuncs``.

    Source: S. Yang, J. Kautz, A. Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta
    Rule", ICLR 2025 (arXiv:2412.06464), section 3 (the gated delta rule); per-key gates as in
    S. Yang et al., "Gated Linear Attention Transformers with Hardware-Efficient Training",
    ICML 2024 (arXiv:2312.06635).
    """
    asked = thread_count(num_threads)   # the thread count asked for; 0: OpenMP's default
    output_final_state = flag(output_final_state, "output_final_state")
    return_checkpoints = flag(return_checkpoints, "return_checkpoints")
    p = _Problem(q, k, v, beta, alpha, g, initial_state, scale, normalize_qk, cu_seqlens,
                 check_values=check_values, delta_rule=delta_rule, num_threads=asked)
    chunk = chunk_for(algorithm, chunk_size, p.per_key)
    if return_checkpoints:
        refuse_chunk_with_checkpoints(algorithm, "return_checkpoints=True")
        o, S_T, ck = _forward(p, asked, checkpoints=True)
        return GatedDeltaRuleOutputWithCheckpoints(p.user_seq(o),
                                                   S_T if output_final_state else None, ck)
    o, S_T = _forward(p, asked, chunk=chunk)
    return GatedDeltaRuleOutput(p.user_seq(o), S_T if output_final_state else None)


# The gradient type follows the gate given: dalpha for alpha, dg for g.
@overload
def gated_delta_rule_backward(do: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
                              beta: ArrayLike, alpha: ArrayLike, g: None = None,
                              initial_state: Optional[ArrayLike] = None,
                              dS_T: Optional[ArrayLike] = None, scale: float = 1.0,
                              num_threads: Optional[int] = None, normalize_qk: bool = False,
                              cu_seqlens: CuSeqlens = None, checkpoints: Optional[Array] = None,
                              check_values: bool = True, delta_rule: bool = True,
                              algorithm: Algorithm = "auto", chunk_size: Optional[int] = None,
                              ) -> GatedDeltaRuleGrads: ...
@overload  # noqa: E302
def gated_delta_rule_backward(do: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
                              beta: ArrayLike, alpha: None = None, g: ArrayLike,
                              initial_state: Optional[ArrayLike] = None,
                              dS_T: Optional[ArrayLike] = None, scale: float = 1.0,
                              num_threads: Optional[int] = None, normalize_qk: bool = False,
                              cu_seqlens: CuSeqlens = None, checkpoints: Optional[Array] = None,
                              check_values: bool = True, delta_rule: bool = True,
                              algorithm: Algorithm = "auto", chunk_size: Optional[int] = None,
                              ) -> GatedDeltaRuleGradsG: ...


@uses_block_cache
def gated_delta_rule_backward(do: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
                              beta: ArrayLike, alpha: Optional[ArrayLike] = None,
                              g: Optional[ArrayLike] = None,
                              initial_state: Optional[ArrayLike] = None,
                              dS_T: Optional[ArrayLike] = None, scale: float = 1.0,
                              num_threads: Optional[int] = None, normalize_qk: bool = False,
                              cu_seqlens: CuSeqlens = None, checkpoints: Optional[Array] = None,
                              check_values: bool = True, delta_rule: bool = True,
                              algorithm: Algorithm = "auto", chunk_size: Optional[int] = None,
                              ) -> Union[GatedDeltaRuleGrads, GatedDeltaRuleGradsG]:
    """Gradients of :func:`gated_delta_rule` (backpropagation through time, in C).

    Given ``do`` = dL/do and ``dS_T`` = dL/dS_T, returns dL/d(every input). Walks t = T..1 with
    G = dL/dS_t (derived by hand from the forward; see the user guide, "The backward pass")::

        G += s do_t q_t^T;  dq_t = s S_t^T do_t;  du = G k_t;  dk_t = G^T u_t + D_t S_{t-1}^T dp
        dbeta_t = du . (v_t - p_t);  dv_t = beta_t du;  dp = -beta_t du
        G~ = G + dp k_t^T;  dalpha_t = sum_i G~_i. * S_{t-1},i.;  G = G~ D_t   ->  dS_0 = G

    (summed over the key channels for a scalar gate; through the L2 normalisation to the raw q, k
    when normalize_qk; over the value heads of a group for dq, dk).

    Memory: the states are not stored. The backward reruns the recurrence once keeping S every
    C = ceil(sqrt(T)) steps, then recomputes one segment of C states at a time for one strip of 16
    value rows at a time, so each (sequence, head) pair in flight holds (ceil(T/C) + 1) * Dv * Dk
    numbers and each thread about C * 16 * Dk more -- O(sqrt(T) * Dk * Dv), never T * Dk * Dv --
    besides the gradients themselves (and, with grouped value heads, one [B, T, HV, Dk] partial
    sum of dq and dk). Cost: 5-8x the forward (docs, "Speed").

    Parameters
    ----------
    do : array [B, T, HV, Dv]  (single-head: [B, T, Dv])
        Gradient of the loss with respect to o.
    q, k, v, beta, alpha, g, initial_state, scale, num_threads, normalize_qk, cu_seqlens
        As for :func:`gated_delta_rule` (same shapes, same rules).
    dS_T : array, the shape of the final state, optional
        Gradient of the loss with respect to the final state; zeros when None.
    checkpoints : array, optional
        What ``gated_delta_rule(..., return_checkpoints=True)`` returned for these same inputs:
        the backward then skips its own checkpoint pass (one forward recurrence). Checked for
        shape and for starting at initial_state; they must come from the same inputs, which is
        not otherwise checked.
    check_values, delta_rule : bool, default True
        As for :func:`gated_delta_rule`.
    algorithm, chunk_size
        As for :func:`gated_delta_rule`: the chunkwise form's backward walks the chunks in
        reverse from the states entering them, which it computes first (ceil(T / chunk_size)
        states per pair in flight instead of the recurrence's checkpoints). With
        ``checkpoints=`` the recurrence runs ("auto" then means the recurrence; "chunk" is
        refused).

    Returns
    -------
    GatedDeltaRuleGrads(dq, dk, dv, dbeta, dalpha, d_initial_state) when alpha was given, or
    GatedDeltaRuleGradsG(dq, dk, dv, dbeta, dg, d_initial_state) when g was given (dg = alpha *
    dalpha). Each gradient has the shape its input was given in (a broadcast beta or gate: summed
    over the broadcast axes; a Python number: a 0-d array; d_initial_state: the state's, also
    when initial_state was None) and the dtype of the computation (float32 or float64).

    Raises
    ------
    TypeError, ValueError
        As :func:`gated_delta_rule`; also when do or dS_T has the wrong shape, or
        algorithm="chunk" comes with checkpoints=.

    Source: S. Yang, J. Kautz, A. Hatamizadeh, "Gated Delta Networks", ICLR 2025
    (arXiv:2412.06464), section 3; the equations above are the chain rule through its recurrence.
    """
    asked = thread_count(num_threads)
    p, do, dST = _backward_problem(do, dS_T, q, k, v, beta, alpha, g, initial_state, scale,
                                   normalize_qk, cu_seqlens, check_values, delta_rule, asked)
    chunk = chunk_for(algorithm, chunk_size, p.per_key)
    if checkpoints is not None:
        refuse_chunk_with_checkpoints(algorithm, "checkpoints=")
    ck = None if checkpoints is None else _checked_ckpt(p, checkpoints, initial_state)
    return _backward(p, do, dST, ck, (0, False) if ck is not None else chunk, asked)


def _backward_problem(do, dS_T, q, k, v, beta, alpha, g, initial_state, scale, normalize_qk,
                      cu_seqlens, check_values, delta_rule, asked):
    """The backward's checked problem (do and dS_T take part in the dtype): (p, do, dS_T)."""
    do = as_real_array(do, "do")
    dST = None if dS_T is None else as_real_array(dS_T, "dS_T")
    p = _Problem(q, k, v, beta, alpha, g, initial_state, scale, normalize_qk, cu_seqlens,
                 extra=[do] + ([dST] if dST is not None else []), check_values=check_values,
                 delta_rule=delta_rule, num_threads=asked, backward=True)
    return p, do, dST


def _backward(p, do, dST, ck, chunk, asked):
    """Run the backward of a checked problem: do, dS_T (None: zeros) converted and checked, ck
    the checkpoints' kernel view (None: the backward makes its own), in the form chunk =
    (size, auto) asks for (with ck: chunk states when size > 0, else the recurrence's)."""
    do_k, dST_k = _checked_output_grads(p, converted(do, p.dtype, num_threads=asked),
                                        None if dST is None else converted(dST, p.dtype))
    args = (do_k, p.q, p.k, p.v, p.alpha, p.beta, p.S0, dST_k, p.scale) + p.ufunc_args()
    ufunc = p.ufunc("bwd" if ck is None else "bwd_ckpt")
    if ck is not None:
        args += (ck,)
    grads, views = _new_grads(p)
    _call(ufunc, args, views, asked, (chunk[0], chunk[1], ck is not None and chunk[0] > 0))
    return _user_grads(p, *grads)


def _train_chunk(p, algorithm, chunk_size):
    """The form gdn_ext.torch's training step runs: chunk_for's, but the recurrence for "auto"
    when no sequence is long enough for the chunk form (its checkpoints then save the backward a
    pass; the chunk form's states would go unused)."""
    chunk = chunk_for(algorithm, chunk_size, p.per_key)
    if chunk[1] and p.max_len < _core.CHUNK_AUTO_MIN_LEN:
        return 0, False
    return chunk


@uses_block_cache
def _train_forward(q, k, v, *, beta, alpha=None, g=None, initial_state=None, scale=1.0,
                   normalize_qk=False, cu_seqlens=None, num_threads=None, delta_rule=True,
                   algorithm="auto", chunk_size=None):
    """gdn_ext.torch's forward when a gradient will follow: (o, S_T, ck), ck what
    _train_backward restarts from given the same arguments -- the chunk form's states where it
    runs, else the recurrence's checkpoints (not interchangeable: the public API hands over only
    the recurrence's). Values are not checked (the torch front end warns itself)."""
    asked = thread_count(num_threads)
    p = _Problem(q, k, v, beta, alpha, g, initial_state, scale, normalize_qk, cu_seqlens,
                 check_values=False, delta_rule=delta_rule, num_threads=asked)
    o, S_T, ck = _forward(p, asked, checkpoints=True, chunk=_train_chunk(p, algorithm, chunk_size))
    return p.user_seq(o), S_T, ck


@uses_block_cache
def _train_backward(do, q, k, v, *, beta, alpha=None, g=None, initial_state=None, dS_T=None,
                    scale=1.0, normalize_qk=False, cu_seqlens=None, num_threads=None,
                    delta_rule=True, algorithm="auto", chunk_size=None, checkpoints):
    """The backward from _train_forward's ck (the same arguments): the gradients, as
    gated_delta_rule_backward returns them."""
    asked = thread_count(num_threads)
    p, do, dST = _backward_problem(do, dS_T, q, k, v, beta, alpha, g, initial_state, scale,
                                   normalize_qk, cu_seqlens, False, delta_rule, asked)
    chunk = _train_chunk(p, algorithm, chunk_size)
    ck = as_real_array(checkpoints, "checkpoints")
    expect_shape(ck, "checkpoints", p.ckpt_shape(chunk[0]), "(from _train_forward)")
    return _backward(p, do, dST, p.ckpt_view(ck.astype(p.dtype, copy=False)), chunk, asked)


def _checked_output_grads(p, do, dST):
    """do and dS_T checked against the problem; their kernel views (zeros for dS_T = None)."""
    sh, heads = p.single_head, "HV" if p.HV != p.H else "H"
    expect_shape(do, "do", (p.B, p.T, p.Dv) if sh else (p.B, p.T, p.HV, p.Dv),
                 "[B, T, Dv]" if sh else f"[B, T, {heads}, Dv]")
    if dST is None:
        return p.seq_view(do.reshape(p.B, p.T, p.HV, p.Dv)), p.zero_state()
    expect_shape(dST, "dS_T", p.state_shape, p.state_layout)
    return p.seq_view(do.reshape(p.B, p.T, p.HV, p.Dv)), p.state_view(dST)


def _new_grads(p):
    """The backward ufunc's outputs: arrays (dq, dk, dv, dalpha, dbeta, dS0) in the user's layout
    with one dq, dk per value head, and their kernel views. The general ufunc writes dalpha per
    key channel, also for a scalar gate."""
    dq, dq_k = p.new_seq(p.Dk)
    dk, dk_k = p.new_seq(p.Dk)
    dv, dv_k = p.new_seq(p.Dv)
    dbeta = np.empty((p.B, p.T, p.HV), p.dtype)
    if p.general:
        dalpha = np.empty((p.B, p.T, p.HV, p.Dk), p.dtype)
        dalpha_k = p.seq_view(dalpha)
    else:
        dalpha = np.empty((p.B, p.T, p.HV), p.dtype)
        dalpha_k = p.head_view(dalpha)
    dS0, dS0_k = p.new_state()
    return ((dq, dk, dv, dalpha, dbeta, dS0),
            (dq_k, dk_k, dv_k, dalpha_k, p.head_view(dbeta), dS0_k))


def _user_grads(p, dq, dk, dv, dalpha, dbeta, dS0):
    """The kernel's gradients in the user's shapes: dq, dk summed over each group of value heads,
    dalpha over the keys for a scalar gate, dg = alpha * dalpha when the gate was g."""
    B, T, H, G, Dk = p.B, p.T, p.H, p.G, p.Dk
    if G > 1:
        dq = _summed(dq.reshape(B, T, H, G, Dk), 3, p.num_threads)
        dk = _summed(dk.reshape(B, T, H, G, Dk), 3, p.num_threads)
    if p.general and not p.per_key:
        dalpha = _summed(dalpha, dalpha.ndim - 1, p.num_threads)
    dq, dk, dv = p.user_seq(dq), p.user_seq(dk), p.user_seq(dv)
    dbeta = dbeta.reshape(p.beta_shape)
    if p.gate_name == "g":
        # dg = alpha * dalpha, alpha in the kernels' [B, H, G, T(, Dk)] view
        alpha_k = p.alpha[..., 0] if (p.general and not p.per_key) else p.alpha
        a = alpha_k.transpose(0, 3, 1, 2, 4) if p.per_key else alpha_k.transpose(0, 3, 1, 2)
        a = a.reshape(dalpha.shape)
        dg = np.empty(dalpha.shape, p.dtype)
        run_pieces(lambda sl: np.multiply(a[sl], dalpha[sl], out=dg[sl]), pieces(dg.shape),
                   p.num_threads, "multiply")
        return GatedDeltaRuleGradsG(dq, dk, dv, sum_to(dbeta, p.beta_given),
                                    sum_to(dg.reshape(p.gate_shape), p.gate_given), dS0)
    return GatedDeltaRuleGrads(dq, dk, dv, sum_to(dbeta, p.beta_given),
                               sum_to(dalpha.reshape(p.gate_shape), p.gate_given), dS0)


def _summed(x, axis, num_threads):
    """x summed over ``axis`` (not one of its first two, [B, T]), by pieces of tokens on up to
    num_threads threads: one sum over a large gradient is one call that Ctrl-C waits for."""
    out = np.empty(x.shape[:axis] + x.shape[axis + 1:], x.dtype)
    per = int(np.prod(x.shape[2:], dtype=np.int64))
    run_pieces(lambda sl: np.sum(x[sl], axis=axis, out=out[sl]), lead_pieces(x.shape[:2], per),
               num_threads, "add")
    return out


def sum_to(x, shape):
    """The gradient ``x`` of an argument that was broadcast from ``shape``: summed over the axes
    broadcasting added or stretched (an array of ``shape``; 0-d for a scalar). ``x`` itself when
    the argument was given in full (shape None). A large x is summed by pieces of its first
    axes (Ctrl-C between them), the pieces' sums added in order."""
    if shape is None:
        return x
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape)
                                      if n == 1 and x.shape[lead + i] != 1)
    if not axes:
        return x.reshape(shape)
    k = min(2, x.ndim)
    parts = lead_pieces(x.shape[:k], int(np.prod(x.shape[k:], dtype=np.int64)))
    if len(parts) == 1:
        return x.sum(axis=axes, keepdims=True).reshape(shape)   # (an array, also for shape ())
    total = np.zeros([1 if a in axes else n for a, n in enumerate(x.shape)], x.dtype)
    for sl in parts:   # into the piece's rows of the axes kept, the whole of those summed
        total[tuple(slice(None) if a in axes else i for a, i in enumerate(sl))] += \
            x[sl].sum(axis=axes, keepdims=True)
    return total.reshape(shape)


def _checked_ckpt(p, checkpoints, initial_state):
    """The backward's checkpoints= checked (shape; the first one of every non-empty sequence is
    its initial state) and viewed for the _ckpt ufunc."""
    ck = as_real_array(checkpoints, "checkpoints")
    if ck.dtype != p.dtype:   # a cast would change them: they are the forward's exact states
        raise TypeError(f"checkpoints must have the computation's dtype {p.dtype} (what "
                        f"gated_delta_rule returned for these inputs); got {ck.dtype}")
    shape = p.ckpt_shape()
    lay = p.state_layout[:-len("Dv, Dk]")] + "NCK, Dv, Dk]"
    expect_shape(ck, "checkpoints", shape, lay + " (from gated_delta_rule(..., "
                 "return_checkpoints=True) on the same inputs)")
    if shape[-3] == 0:                              # no tokens: no checkpoints to check
        return p.ckpt_view(ck)
    nonempty = np.diff(p.cu) > 0                    # per packed sequence (one when not packed)
    first = ck[..., 0, :, :]
    s0 = np.zeros(p.state_shape) if initial_state is None else np.asarray(initial_state)
    mask = nonempty.reshape((-1,) + (1,) * (first.ndim - 1)) if p.packed else True
    if not np.array_equal(np.where(mask, first, 0), np.where(mask, s0.astype(first.dtype), 0),
                          equal_nan=True):
        raise ValueError("checkpoints do not start from initial_state: they must come from "
                         "gated_delta_rule(..., return_checkpoints=True) on the same inputs")
    return p.ckpt_view(ck)


def checkpoint_count(T: int) -> int:
    """The number of checkpoints of a T-step sequence, ceil(T / checkpoint_interval(T)): the
    states gated_delta_rule(..., return_checkpoints=True) returns per sequence and head.
    Raises TypeError for a T that is not an int, ValueError for T < 0 or T >= 2**62."""
    return int(_core.checkpoint_count(sequence_length(T)))


@uses_block_cache
def gated_delta_rule_step(q_t: ArrayLike, k_t: ArrayLike, v_t: ArrayLike, *, beta: ArrayLike,
                          alpha: Optional[ArrayLike] = None, g: Optional[ArrayLike] = None,
                          state: Optional[ArrayLike] = None, scale: float = 1.0,
                          normalize_qk: bool = False, num_threads: Optional[int] = None,
                          inplace: bool = False, check_values: bool = True,
                          delta_rule: bool = True, out: Optional[np.ndarray] = None) -> StepResult:
    """One token of the gated delta rule: recurrent (decoding) form of :func:`gated_delta_rule`.

    ``o_t, S_t = gated_delta_rule_step(q_t, k_t, v_t, beta=beta_t, alpha=alpha_t, state=S_{t-1})``
    computes, per sequence and value head, ``S_t = S_{t-1} D_t + beta_t (v_t - S_{t-1} D_t k_t)
    k_t^T`` and ``o_t = scale S_t q_t``. Feeding a sequence one token at a time gives the same
    outputs and final state as one call of :func:`gated_delta_rule`, up to rounding (a few steps
    run on the state as stored, a long call on its transpose: the sums run in another order).

    Parameters
    ----------
    q_t, k_t : array [B, H, Dk]  (single-head form: [B, Dk])
    v_t : array [B, HV, Dv]  (single-head: [B, Dv]); HV a multiple of H, as gated_delta_rule.
    beta : array [B, HV]  (single-head: [B] or [B, 1]), or a scalar / an array that broadcasts
        to it, as gated_delta_rule.
    alpha or g : array [B, HV] or [B, HV, Dk] (per key channel)  (single-head: [B], [B, 1],
        [B, Dk]), or what broadcasts to them, as beta; exactly one of them.
    state : array [B, HV, Dv, Dk]  (single-head: [B, Dv, Dk]), default None: zeros (the first
        token). Not modified unless ``inplace``.
    scale : float, default 1.0
    normalize_qk : bool, default False -- L2-normalise q_t and k_t, as gated_delta_rule.
    num_threads : int or None -- as gated_delta_rule.
    inplace : bool, default False -- write S_t over ``state`` and return it as new_state (decoding
        without a new [B, HV, Dv, Dk] array per token; the same numbers). ``state`` must then be a
        writeable, C-contiguous ndarray of the result's dtype.
    check_values : bool, default True -- warn about alpha, g, beta, beta ||k||^2 out of range,
        as gated_delta_rule.
    delta_rule : bool, default True -- False: u_t = beta_t v_t, as gated_delta_rule.
    out : ndarray or None -- write S_t into ``out`` and return it as new_state, leaving ``state``
        as it is: decoding with two state buffers used in turn (``state=a, out=b``, then
        ``state=b, out=a``) costs what ``inplace`` costs, with no new array per token. A
        writeable, C-contiguous array of the state's shape and the result's dtype; ``out=state``
        is ``inplace=True``, and an ``out`` that overlaps an input otherwise has that input
        copied first (as NumPy's ``out=``).

    Returns
    -------
    o_t : ndarray [B, HV, Dv] (single-head: [B, Dv]);  new_state : ndarray shaped as ``state``
    (``state`` itself when ``inplace``, ``out`` when given). float32 when all inputs cast safely
    to float32, float64 otherwise.

    Raises
    ------
    TypeError, ValueError
        As :func:`gated_delta_rule`, the messages naming the argument and the step's shapes;
        ValueError when ``inplace`` and ``state`` is None, read-only, not C-contiguous or not of
        the result's dtype; when ``out`` is not an ndarray of the state's shape and the result's
        dtype, writeable and C-contiguous, or comes with ``inplace=True``.

    Source: Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025 (arXiv:2412.06464), sec. 3.
    """
    asked = thread_count(num_threads)
    inplace = flag(inplace, "inplace")
    p = _Problem(q_t, k_t, v_t, beta, alpha, g, state, scale, normalize_qk, step=True,
                 check_values=check_values, delta_rule=delta_rule)
    if out is not None:
        if inplace:
            raise ValueError("pass either inplace=True or out=, not both (out=state is inplace)")
        if out is state:
            inplace = True
        else:
            S_T = _step_out(p, out)
            o, o_k = p.new_seq(p.Dv)
            _call(p.ufunc("fwd"), (p.q, p.k, p.v, p.alpha, p.beta, p.S0, p.scale) + p.ufunc_args(),
                  (o_k, S_T), asked)
            return StepResult(p.user_seq(o)[:, 0], out)
    if not inplace:
        o, S_T = _forward(p, asked)
        return StepResult(p.user_seq(o)[:, 0], S_T)
    if not isinstance(state, np.ndarray):
        raise ValueError("inplace=True needs state to be an ndarray (to write S_t into); got "
                         + ("None" if state is None else type(state).__name__))
    if state.dtype != p.dtype or not state.flags.writeable or not state.flags.c_contiguous:
        raise ValueError(f"inplace=True needs state to be a writeable, C-contiguous {p.dtype} "
                         f"array (the result's dtype); got a {state.dtype} array that is "
                         f"{'' if state.flags.writeable else 'read-only, '}"
                         f"{'' if state.flags.c_contiguous else 'not '}C-contiguous")
    # the kernel reads every state row of a step before writing it, so S_t may overwrite S_{t-1}
    o, o_k = p.new_seq(p.Dv)
    _call(p.ufunc("fwd"), (p.q, p.k, p.v, p.alpha, p.beta, p.S0, p.scale) + p.ufunc_args(),
          (o_k, p.state_view(state)), asked)
    return StepResult(p.user_seq(o)[:, 0], state)
