"""Drop-ins for flash-linear-attention's ``chunk_gated_delta_rule`` and
``fused_recurrent_gated_delta_rule`` (and transformers' pure-torch fallbacks of them) on the CPU:
their conventions (state [N, HV, K, V] or V-first [N, HV, V, K], log decay g, gates computed in
the kernel, scale default K ** -0.5) mapped onto :func:`gdn_ext.torch.gated_delta_rule`, every
argument checked in their names and layouts.

Signatures as in flash-linear-attention's ``fla/ops/gated_delta_rule/{chunk,fused_recurrent}.py``
(read at commit bc3b101, 2026-08). Keywords it accepts only to tune GPU kernels are accepted here
and ignored (results do not depend on them): ``chunk_size`` (checked to be 16, 32 or 64, as there),
``chunk_indices``, ``cu_seqlens_cpu``. Refused with an error: ``cp_context`` (context parallelism,
TypeError unless None), ``gv`` (per-value-channel decay, TypeError unless None), ``head_first``
(removed upstream, ValueError). Any other keyword is a TypeError, as for any Python function.
"""
from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .._checks import flag, transposed_state_hint
from .._problem import packed_sequences
from ._inputs import cast, check_float, compute_dtype, input_dtype
from .function import cu_tensor, gated_delta_rule, warn_unusual

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]


def _shape(t):
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _tensor(t, name):
    """A CPU tensor of float16, bfloat16, float32 or float64, else TypeError / ValueError
    naming it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}: gdn_ext runs on the CPU; move it with .cpu()")
    check_float(t, name)
    return t


def _expect(t, name, shape, layout):
    _tensor(t, name)
    if tuple(t.shape) != tuple(shape):
        want = "[" + ", ".join(str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {layout} = {want}; got {_shape(t)}"
                         + transposed_state_hint(t.shape, shape, layout))


def _fla_call(q, k, v, g, gk, beta, scale, initial_state, output_final_state,
              use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
              use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens,
              ungated_ok, check_values=True, algorithm="auto", chunk_size=None):
    """flash-linear-attention's conventions, checked -> gated_delta_rule (in the form algorithm
    and chunk_size name) -> theirs."""
    _tensor(q, "q")
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B, T, H, K]; got {_shape(q)}")
    B, T, H, K = q.shape
    if H == 0:
        raise ValueError("q must have H >= 1 heads; got shape " + _shape(q))
    if K == 0:
        raise ValueError("q must have K >= 1 key channels; got shape " + _shape(q))
    _expect(k, "k", q.shape, "[B, T, H, K] (the shape of q)")
    _tensor(v, "v")
    if v.dim() != 4 or tuple(v.shape[:2]) != (B, T) or v.shape[2] % H:
        raise ValueError(f"v must have shape [B, T, HV, V] = [{B}, {T}, HV, V] with HV a "
                         f"multiple of H = {H}; got {_shape(v)}")
    HV, V = v.shape[2], v.shape[3]
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (beta "
                         "is then 2 * sigmoid(beta), in (0, 2))")
    if g is not None:
        _expect(g, "g", (B, T, HV), "[B, T, HV]")
    if gk is not None:
        _expect(gk, "gk", (B, T, HV, K), "[B, T, HV, K]")
    if beta is not None:
        _expect(beta, "beta", (B, T, HV), "[B, T, HV]")
    cu_seqlens = cu_tensor(cu_seqlens)   # N (for the state's shape) from the one check of it
    N = B if cu_seqlens is None else packed_sequences(cu_seqlens.numpy(), B, T)[1]
    if initial_state is not None:
        state_lay = "[N, HV, V, K]" if state_v_first else "[N, HV, K, V]"
        _expect(initial_state, "initial_state",
                (N, HV, V, K) if state_v_first else (N, HV, K, V), state_lay)

    # the dtype rule of every gdn_ext.torch entry point (gdn_ext.torch._inputs): o in the
    # dtype of q, k, v; computed (and the final state returned) in float32, float64 when any
    # tensor argument is float64
    out_dtype = input_dtype(q, k, v)
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t is not None:
            _tensor(t, name)
    dt = compute_dtype([q, k, v, g, gk, beta, initial_state, A_log, dt_bias])
    # the gate: log decay, from the raw input when the kernel computes it (Mamba2 / Qwen3-Next)
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("A_log [HV] must be given with use_gate_in_kernel=True")
        if g is None:
            raise ValueError("g (the raw gate input) [B, T, HV] must be given with "
                             "use_gate_in_kernel=True")
        _expect(A_log, "A_log", (HV,), "[HV]")
        bias = 0
        if dt_bias is not None:
            _expect(dt_bias, "dt_bias", (HV,), "[HV]")
            bias = dt_bias.to(dt)
        g = -A_log.to(dt).exp() * F.softplus(g.to(dt) + bias)
    if g is None and gk is None:
        if not ungated_ok:
            raise ValueError("give the log decay g [B, T, HV] (or gk [B, T, HV, K] per key "
                             "channel)")
        g = v.new_zeros((B, T, HV), dtype=dt)    # fused recurrent without a gate: alpha = 1
    g, gk = (None if x is None else cast(x, dt) for x in (g, gk))   # added in dt, not in half
    log_decay = gk if g is None else (g if gk is None else g[..., None] + gk)
    if beta is None:                     # the fused recurrent kernel's default: beta = 1
        beta = v.new_ones((B, T, HV), dtype=dt)
    if use_beta_sigmoid_in_kernel:       # beta given as a logit
        beta = (2 if allow_neg_eigval else 1) * torch.sigmoid(beta.to(dt))

    if scale is None:
        scale = K ** -0.5
    if initial_state is not None and not state_v_first:   # [N, HV, K, V] -> gdn_ext's [.., V, K]
        initial_state = initial_state.transpose(-1, -2)
    q, k, v, beta, log_decay = (cast(x, dt) for x in (q, k, v, beta, log_decay))
    if check_values:     # on what the recurrence sees: the log decay and beta as computed here
        warn_unusual(q, k, beta, log_decay, log_gate=True, delta_rule=True,
                     normalize_qk=bool(use_qk_l2norm_in_kernel),
                     gate_name="g + gk" if g is not None and gk is not None else
                     "gk" if g is None else "g", dims=("B", "T", "H", "K"))
    o, S_T = gated_delta_rule(
        q, k, v, beta=beta, g=log_decay,
        initial_state=None if initial_state is None else cast(initial_state, dt), scale=scale,
        output_final_state=output_final_state, normalize_qk=bool(use_qk_l2norm_in_kernel),
        cu_seqlens=cu_seqlens, check_values=False, algorithm=algorithm, chunk_size=chunk_size)
    if S_T is not None and not state_v_first:   # a fresh [N, HV, K, V], as fla returns
        S_T = S_T.transpose(-1, -2).contiguous()
    return cast(o, out_dtype), S_T


def _state_layout(state_v_first, transpose_state_layout):
    """fla's deprecated alias transpose_state_layout for state_v_first."""
    if transpose_state_layout is None:
        return bool(state_v_first)
    if state_v_first:
        raise ValueError("pass state_v_first or the deprecated transpose_state_layout, not both")
    warnings.warn("transpose_state_layout is deprecated and renamed to state_v_first",
                  DeprecationWarning, stacklevel=3)
    return bool(transpose_state_layout)


def _fla_args(scope):
    """The arguments of _fla_call that a drop-in holds under the same names (its locals): the
    two drop-ins share them but for a few of their own."""
    return {name: scope[name] for name in _FLA_NAMES}


_FLA_NAMES = ("q", "k", "v", "g", "gk", "beta", "scale", "initial_state", "output_final_state",
              "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "A_log", "dt_bias",
              "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first", "cu_seqlens")


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           g: Optional[torch.Tensor] = None, beta: Optional[torch.Tensor] = None,
                           scale: Optional[float] = None,
                           initial_state: Optional[torch.Tensor] = None,
                           output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False,
                           use_beta_sigmoid_in_kernel: bool = False,
                           allow_neg_eigval: bool = False, state_v_first: bool = False,
                           cu_seqlens: Optional[torch.Tensor] = None,
                           cu_seqlens_cpu: Optional[torch.Tensor] = None,
                           chunk_indices: Optional[torch.Tensor] = None, cp_context=None, *,
                           gk: Optional[torch.Tensor] = None, use_gate_in_kernel: bool = False,
                           A_log: Optional[torch.Tensor] = None,
                           dt_bias: Optional[torch.Tensor] = None, chunk_size: int = 64,
                           transpose_state_layout: Optional[bool] = None, head_first=None,
                           check_values: bool = True,
                           ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Drop-in for flash-linear-attention's ``chunk_gated_delta_rule`` (and transformers'
    ``torch_chunk_gated_delta_rule``) on CPU tensors, with gradients.

    Args (flash-linear-attention's names and conventions):
      q, k: [B, T, H, K]. v: [B, T, HV, V], HV a multiple of H (grouped: value head hv reads q/k
        head hv // (HV / H)).
      g: [B, T, HV], log decay (<= 0); with ``use_gate_in_kernel=True`` the raw gate input, and
        the log decay is ``-exp(A_log) * softplus(g + dt_bias)`` (A_log, dt_bias [HV]).
      beta: [B, T, HV] (not per value channel); a logit with
        ``use_beta_sigmoid_in_kernel=True`` (beta = sigmoid(beta), or 2 * sigmoid(beta) with
        ``allow_neg_eigval=True``, which requires it).
      scale: default K ** -0.5.
      initial_state: [N, HV, K, V] (``state_v_first=True`` or its deprecated name
        ``transpose_state_layout=True``: [N, HV, V, K]); N = B, or the number of packed sequences.
      output_final_state: return the final state (same layout) or None.
      use_qk_l2norm_in_kernel: q, k -> x / sqrt(sum x^2 + 1e-6).
      cu_seqlens: LongTensor [N + 1], packed sequences with B = 1.
      cu_seqlens_cpu, chunk_indices, chunk_size (16, 32, 64): GPU tuning, accepted and ignored
        (the chunkwise form here uses gdn_ext's chunk size, so the result never depends on it).
      cp_context: context parallelism, not supported (TypeError unless None).
      head_first: removed upstream (ValueError if true).
      gk: [B, T, HV, K] per-key-channel log decay (beyond fla's chunk function; alone or added
        to g).
      check_values: gdn_ext's warnings (a UserWarning at the caller's line; False turns them
        off), on what the recurrence sees: the log decay (g, gk, or the one computed in the
        kernel) above 0; beta (after the sigmoid when computed in the kernel) outside [0, 2];
        without use_qk_l2norm_in_kernel, beta ||k||^2 above 2 at a step that grows the state
        along k; q with 1 < T < H (head-first [B, H, T, K] tensors?), as fla's own check.
        Skipped while torch.compile traces.

    Dtypes, as flash-linear-attention's: tensors float16, bfloat16, float32 or float64; q, k
      and v share one dtype, and o is returned in it. Computed by gdn_ext's C kernels in
      float32, or float64 when any tensor argument is float64: half-precision tensors are cast
      to float32 in torch, so gradients come back in each tensor's own dtype. g, beta,
      initial_state, A_log and dt_bias may have any of the four dtypes (e.g. a float32 g with
      bfloat16 q, k, v, as Qwen3-Next computes it). The final state is returned in the
      computation's dtype (float32 for half inputs, as flash-linear-attention and transformers'
      fallbacks return it).

    Returns a plain tuple (o [B, T, HV, V], final_state or None, contiguous), as
    flash-linear-attention does; gradients through autograd to every tensor argument, A_log
    and dt_bias included. Raises ValueError / TypeError naming the argument, in
    flash-linear-attention's layouts (CUDA tensors included); TypeError for another dtype, for
    q, k, v of different dtypes, and for a keyword it does not know.
    """
    if head_first:
        raise ValueError("head_first=True is not supported (removed upstream): pass "
                         "[B, T, H, K] tensors")
    if cp_context is not None:
        raise TypeError("cp_context (context parallelism across devices) is not supported")
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64 (as flash-linear-attention); got "
                         f"{chunk_size!r}")
    if beta is None:
        raise ValueError("chunk_gated_delta_rule needs beta [B, T, HV]")
    state_v_first = _state_layout(state_v_first, transpose_state_layout)
    # chunk_size tunes fla's GPU tiling, never the result: the chunk form here runs with
    # gdn_ext's own chunk size whatever it is
    return _fla_call(**_fla_args(locals()), ungated_ok=False,
                     check_values=flag(check_values, "check_values"), algorithm="chunk")


def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     g: Optional[torch.Tensor] = None,
                                     gk: Optional[torch.Tensor] = None,
                                     gv: Optional[torch.Tensor] = None,
                                     beta: Optional[torch.Tensor] = None,
                                     scale: Optional[float] = None,
                                     initial_state: Optional[torch.Tensor] = None,
                                     output_final_state: bool = False,
                                     use_qk_l2norm_in_kernel: bool = False,
                                     use_gate_in_kernel: bool = False,
                                     A_log: Optional[torch.Tensor] = None,
                                     dt_bias: Optional[torch.Tensor] = None,
                                     use_beta_sigmoid_in_kernel: bool = False,
                                     allow_neg_eigval: bool = False, state_v_first: bool = False,
                                     cu_seqlens: Optional[torch.Tensor] = None, *,
                                     transpose_state_layout: Optional[bool] = None,
                                     check_values: bool = True,
                                     ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Drop-in for flash-linear-attention's ``fused_recurrent_gated_delta_rule`` (and
    transformers' ``torch_recurrent_gated_delta_rule``) on CPU tensors, with gradients.

    flash-linear-attention's positional order (q, k, v, g, gk, gv, beta, scale, ...): pass
    beta by keyword when porting transformers code, whose fallback takes (q, k, v, g, beta).
    Arguments as :func:`chunk_gated_delta_rule`, and: g and gk both optional (neither: the
    ungated delta rule, alpha = 1); gk [B, T, HV, K] per-key-channel log decay (alone or added to
    g); beta defaults to 1; gv (per-value-channel decay) is not supported (TypeError unless
    None). Dtypes and the result as :func:`chunk_gated_delta_rule`. This one runs the
    recurrence token by token; :func:`chunk_gated_delta_rule` the chunkwise form (a gate per key
    channel: the recurrence there too).
    """
    if gv is not None:
        raise TypeError("gv (a per-value-channel decay) is not supported")
    state_v_first = _state_layout(state_v_first, transpose_state_layout)
    return _fla_call(**_fla_args(locals()), ungated_ok=True,
                     check_values=flag(check_values, "check_values"), algorithm="recurrent",
                     chunk_size=None)
