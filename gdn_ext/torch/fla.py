"""Drop-ins for flash-linear-attention's ``chunk_gated_delta_rule`` and
``fused_recurrent_gated_delta_rule`` (and transformers' pure-torch fallbacks of them) on the CPU:
their conventions (state [N, HV, K, V], log decay g, scale default K ** -0.5) mapped onto
:func:`gdn_ext.torch.gated_delta_rule`."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from .function import gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]


def _fla_call(q, k, v, g, gk, beta, scale, initial_state, output_final_state,
              use_qk_l2norm_in_kernel, cu_seqlens):
    """flash-linear-attention conventions -> gated_delta_rule -> flash-linear-attention's."""
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B, T, H, K]; got {list(q.shape)}")
    out_dtype = q.dtype
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32   # half types in float32
    K = q.shape[-1]
    if scale is None:
        scale = K ** -0.5
    if g is None and gk is None:
        raise ValueError("give the log decay g [B, T, HV] (or gk [B, T, HV, K] per key channel)")
    log_decay = gk if g is None else (g if gk is None else g[..., None] + gk)
    if beta is None:   # flash-linear-attention's fused recurrent kernel treats beta as 1
        beta = v.new_ones(v.shape[:3])
    if initial_state is not None:    # [N, HV, K, V] -> gdn_ext's [N, HV, V, K]
        initial_state = initial_state.transpose(-1, -2).to(dt)
    o, S_T = gated_delta_rule(
        q.to(dt), k.to(dt), v.to(dt), beta=beta.to(dt), g=log_decay.to(dt),
        initial_state=initial_state, scale=scale, output_final_state=output_final_state,
        normalize_qk=bool(use_qk_l2norm_in_kernel), cu_seqlens=cu_seqlens)
    return o.to(out_dtype), (None if S_T is None else S_T.transpose(-1, -2))


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           g: Optional[torch.Tensor] = None, beta: Optional[torch.Tensor] = None,
                           scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           cu_seqlens: Optional[torch.Tensor] = None, *,
                           gk: Optional[torch.Tensor] = None, **kwargs: Any,
                           ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Drop-in for flash-linear-attention's ``chunk_gated_delta_rule`` (and transformers'
    ``torch_chunk_gated_delta_rule``) on CPU tensors, with gradients.

    Args (flash-linear-attention's conventions): q, k [B, T, H, K]; v [B, T, HV, V] (HV a
    multiple of H, grouped: value head hv reads q/k head hv // (HV / H)); g [B, T, HV] log decay
    (<= 0); beta [B, T, HV]; scale (default K ** -0.5); initial_state [N, HV, K, V];
    output_final_state; use_qk_l2norm_in_kernel (x / sqrt(sum x^2 + 1e-6)); cu_seqlens
    (LongTensor [N + 1], with B = 1). Beyond flash-linear-attention's chunk function: ``gk``
    [B, T, HV, K], a per-key-channel log decay (alone or added to g). Other keywords
    (transformers' ``chunk_size``, attention kwargs) are accepted and ignored, as upstream does --
    so a misspelt keyword is ignored too: the result does not depend on a chunk size.

    Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] or None). Computed by gdn_ext's
    C kernels in float64 for float64 inputs, else float32 (bfloat16 / float16 inputs: o is cast
    back to their dtype, the final state stays float32, as transformers' fallbacks do); gradients
    through autograd. Raises ValueError / TypeError as :func:`gated_delta_rule` (CUDA tensors
    included).
    """
    if kwargs.get("head_first"):
        raise ValueError("head_first=True is not supported: pass [B, T, H, K] tensors")
    if beta is None:
        raise ValueError("chunk_gated_delta_rule needs beta [B, T, HV]")
    return _fla_call(q, k, v, g, gk, beta, scale, initial_state, output_final_state,
                     use_qk_l2norm_in_kernel, cu_seqlens)


def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     g: Optional[torch.Tensor] = None, beta: Optional[torch.Tensor] = None,
                                     scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
                                     output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                                     cu_seqlens: Optional[torch.Tensor] = None, *,
                                     gk: Optional[torch.Tensor] = None, **kwargs: Any,
                                     ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Drop-in for flash-linear-attention's ``fused_recurrent_gated_delta_rule`` (and
    transformers' ``torch_recurrent_gated_delta_rule``) on CPU tensors.

    Same arguments and results as :func:`chunk_gated_delta_rule`, plus flash-linear-attention's
    per-key log decay ``gk`` [B, T, HV, K] (alone or added to ``g``) and ``beta`` defaulting to 1.
    The same C kernels serve both: they run the recurrence token by token, so this is the decoding
    path (and it has gradients too). Other keywords are accepted and ignored; ``gv`` is refused.
    """
    if kwargs.get("gv") is not None:
        raise ValueError("gv (a per-value-channel decay) is not supported")
    return _fla_call(q, k, v, g, gk, beta, scale, initial_state, output_final_state,
                     use_qk_l2norm_in_kernel, cu_seqlens)
