"""The reference loop in plain torch ops: the autograd baseline gdn_ext's Function is checked
against (any device, differentiable to any order)."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .._constants import L2_EPS
from ._inputs import GatedDeltaRuleOutput, prepare

__all__ = ["reference_gated_delta_rule"]


def reference_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                               beta: Union[torch.Tensor, float],
                               alpha: Union[torch.Tensor, float, None] = None,
                               g: Union[torch.Tensor, float, None] = None,
                               initial_state: Optional[torch.Tensor] = None, scale: float = 1.0,
                               output_final_state: bool = True, normalize_qk: bool = False,
                               cu_seqlens: Union[torch.Tensor, Sequence[int], None] = None,
                               delta_rule: bool = True,
                               ) -> GatedDeltaRuleOutput:
    """The reference loop in plain torch ops, one token at a time: the autograd baseline.

    Same arguments, shapes, broadcasting of beta and the gate, dtype rule and result as
    :func:`gdn_ext.torch.gated_delta_rule` (gdn_ext's conventions): float16 / bfloat16 tensors
    are computed in float32 (float64 when any tensor argument is float64), o comes back in the
    dtype of q, k and v, the final state in the computation's dtype. Tensors on any device;
    autograd differentiates it (to any order). Slow by design: O(T) small ops. Raises
    TypeError / ValueError for dtypes and for beta or a gate that does not broadcast, as
    gated_delta_rule; other shapes are not checked.
    """
    def batch_matvec(S, x):                      # S [..., Dv, Dk], x [..., Dk] -> [..., Dv]
        return torch.einsum("...vk,...k->...v", S, x)

    def batch_outer(a, b):                       # [..., Dv], [..., Dk] -> [..., Dv, Dk]
        return torch.einsum("...v,...k->...vk", a, b)

    def gate_memory(S, gate):                    # S D: scalar gate [...] or per key [..., Dk]
        return S * (gate[..., None, :] if gate.dim() == S.dim() - 1 else gate[..., None, None])

    def l2norm(x):
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2_EPS)

    if (alpha is None) == (g is None):
        raise ValueError("give exactly one of alpha (decay in [0, 1]) and g (log decay); got "
                         + ("both" if alpha is not None else "neither"))
    gate_name, gate = ("alpha", alpha) if alpha is not None else ("g", g)
    q, k, v, beta, gate, initial_state, out_dtype = prepare(q, k, v, beta, gate, gate_name,
                                                            initial_state, cpu=False)
    single = q.dim() == 3
    if single:   # the single-head form is H = HV = 1
        q, k, v = q[:, :, None], k[:, :, None], v[:, :, None]
        beta = beta[:, :, None]
        gate = gate[:, :, None]       # [B, T, 1] or, per key, [B, T, 1, Dk]
        if initial_state is not None:
            initial_state = initial_state[:, None]
    if gate_name == "g":
        gate = torch.exp(gate)
    if normalize_qk:
        q, k = l2norm(q), l2norm(k)
    # value heads per query/key head (grouped order; H = HV = 0: no heads, nothing to repeat)
    G = v.shape[2] // q.shape[2] if q.shape[2] else 1
    q, k = q.repeat_interleave(G, dim=2), k.repeat_interleave(G, dim=2)
    B, T, HV, Dv = v.shape
    Dk = q.shape[-1]
    bounds = [(0, T)] if cu_seqlens is None else list(zip(
        [int(c) for c in cu_seqlens][:-1], [int(c) for c in cu_seqlens][1:]))
    outs, finals = [], []
    for n, (a, b) in enumerate(bounds):
        if initial_state is None:
            S_cur = q.new_zeros(B, HV, Dv, Dk)
        else:
            S_cur = initial_state if cu_seqlens is None else initial_state[n:n + 1]
        for t in range(a, b):
            S_gated = gate_memory(S_cur, gate[:, t])          # forget
            if delta_rule:
                pred = batch_matvec(S_gated, k[:, t])         # what memory returns for k_t
                delta = v[:, t] - pred                        # the error to correct
            else:
                delta = v[:, t]                               # linear attention's write
            S_cur = S_gated + batch_outer(delta, k[:, t]) * beta[:, t][..., None, None]
            outs.append(scale * batch_matvec(S_cur, q[:, t]))  # read the updated state
        finals.append(S_cur)
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    S_T = finals[0] if cu_seqlens is None else torch.cat(finals, dim=0)
    if single:
        o, S_T = o[:, :, 0], S_T[:, 0]
    return GatedDeltaRuleOutput(o.to(out_dtype), S_T if output_final_state else None)
