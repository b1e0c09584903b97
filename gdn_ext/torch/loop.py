"""The design note's loop in plain torch ops: the autograd baseline gdn_ext's Function is checked
against (any dtype, any device, differentiable to any order)."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from .._constants import L2_EPS

__all__ = ["reference_gated_delta_rule"]


def reference_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                               beta: torch.Tensor, alpha: Optional[torch.Tensor] = None,
                               g: Optional[torch.Tensor] = None,
                               initial_state: Optional[torch.Tensor] = None, scale: float = 1.0,
                               output_final_state: bool = True, normalize_qk: bool = False,
                               cu_seqlens: Union[torch.Tensor, Sequence[int], None] = None,
                               delta_rule: bool = True,
                               ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The design note's loop in plain torch ops, one token at a time: the autograd baseline.

    Same arguments, shapes and conventions as :func:`gated_delta_rule` (gdn_ext's), any float
    dtype and device; autograd differentiates it (to any order). Slow by design: O(T) small ops.
    """
    def batch_matvec(S, x):                      # S [..., Dv, Dk], x [..., Dk] -> [..., Dv]
        return torch.einsum("...vk,...k->...v", S, x)

    def batch_outer(a, b):                       # [..., Dv], [..., Dk] -> [..., Dv, Dk]
        return torch.einsum("...v,...k->...vk", a, b)

    def gate_memory(S, gate):                    # S D: scalar gate [...] or per key [..., Dk]
        return S * (gate[..., None, :] if gate.dim() == S.dim() - 1 else gate[..., None, None])

    def l2norm(x):
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2_EPS)

    single = q.dim() == 3
    if single:   # the single-head form is H = HV = 1
        per_key_single = (alpha if g is None else g).dim() == 3 and q.shape[-1] != 1 and \
            (alpha if g is None else g).shape[-1] == q.shape[-1]
        q, k, v = q[:, :, None], k[:, :, None], v[:, :, None]
        beta = beta.reshape(q.shape[:2] + (1,))
        gate_in = alpha if g is None else g
        gate_in = gate_in[:, :, None] if per_key_single else gate_in.reshape(q.shape[:2] + (1,))
        alpha, g = (gate_in, None) if g is None else (None, gate_in)
        if initial_state is not None:
            initial_state = initial_state[:, None]
    gate = alpha if g is None else torch.exp(g)
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
    return o, (S_T if output_final_state else None)
