"""The autograd Function: gdn_ext's C forward and backward on torch tensors (gdn_ext conventions).

The forward keeps its state checkpoints for the backward when a gradient will be asked for, so
training runs the recurrence forward once. Source of the math: S. Yang, J. Kautz, A. Hatamizadeh,
"Gated Delta Networks: Improving Mamba2 with Delta Rule", ICLR 2025 (arXiv:2412.06464), sec. 3.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from ..recurrence import gated_delta_rule as _np_forward
from ..recurrence import gated_delta_rule_backward as _np_backward

__all__ = ["gated_delta_rule"]


def _to_numpy(t, name):
    """A CPU float32/float64 tensor as a NumPy view (no copy; any strides)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}: gdn_ext runs on the CPU; move it with .cpu()")
    if t.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name} must be float32 or float64; got {t.dtype}")
    return t.detach().resolve_conj().resolve_neg().numpy()


class _GatedDeltaRule(torch.autograd.Function):
    """Forward and backward through gdn_ext's C kernels (gdn_ext conventions)."""

    @staticmethod
    def forward(ctx, q, k, v, beta, gate, initial_state, opts):
        arrays = [_to_numpy(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v"), (beta, "beta"),
                                                (gate, opts["gate_name"]))]
        s0 = None if initial_state is None else _to_numpy(initial_state, "initial_state")
        # when a gradient will be asked for, keep the forward's checkpoints: the backward then
        # runs the recurrence forward once less (about sqrt(T) states per sequence and head)
        keep = opts["grad"] and any(ctx.needs_input_grad)
        out = _np_forward(*arrays[:3], beta=arrays[3], initial_state=s0,
                          **{opts["gate_name"]: arrays[4]}, **opts["call"],
                          return_checkpoints=keep)
        ctx.ckpt = out[2] if keep else None
        ctx.save_for_backward(q, k, v, beta, gate, initial_state)
        ctx.opts = opts
        return torch.from_numpy(out[0]), torch.from_numpy(out[1])

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dS_T):
        q, k, v, beta, gate, initial_state = ctx.saved_tensors
        opts = ctx.opts
        arrays = [t.detach().numpy() for t in (q, k, v, beta, gate)]
        s0 = None if initial_state is None else initial_state.detach().numpy()
        grads = _np_backward(do.detach().numpy(), *arrays[:3], beta=arrays[3], initial_state=s0,
                             dS_T=None if dS_T is None else dS_T.detach().numpy(),
                             **{opts["gate_name"]: arrays[4]}, **opts["call"],
                             checkpoints=ctx.ckpt)
        dq, dk, dv, dbeta, dgate, dS0 = (torch.from_numpy(np.ascontiguousarray(g)) for g in grads)
        return dq, dk, dv, dbeta, dgate, (None if initial_state is None else dS0), None


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, beta: torch.Tensor,
                     alpha: Optional[torch.Tensor] = None, g: Optional[torch.Tensor] = None,
                     initial_state: Optional[torch.Tensor] = None, scale: float = 1.0,
                     output_final_state: bool = True, normalize_qk: bool = False,
                     cu_seqlens: Union[torch.Tensor, Sequence[int], None] = None,
                     num_threads: Optional[int] = None,
                     ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`gdn_ext.gated_delta_rule` on torch tensors, differentiable (autograd).

    Tensors: CPU, float32 or float64 (all the same dtype), any strides, ``requires_grad`` on any
    subset. Shapes and conventions are gdn_ext's: q, k [B, T, H, Dk]; v [B, T, HV, Dv]; beta
    [B, T, HV]; alpha or g [B, T, HV] or [B, T, HV, Dk]; initial_state [B, HV, Dv, Dk] (packed:
    [N, HV, Dv, Dk]); the single-head form; ``scale`` default 1; ``normalize_qk``;
    ``cu_seqlens`` (a tensor or sequence of ints, with B = 1).

    Returns (o, S_T): o [B, T, HV, Dv], S_T shaped as the state (None when output_final_state is
    False). Gradients reach every tensor input (the backward is gdn_ext's C backward pass over
    time). Double backward is not supported (torch's ``once_differentiable``): differentiating a
    gradient raises RuntimeError, or, through ``torch.autograd.grad(..., allow_unused=True)``,
    gives None where the second derivative is not zero -- do not rely on it. The kernels run
    outside torch, so ``torch.func`` transforms (vmap, grad) do not apply and ``torch.compile``
    breaks the graph around the call.

    Raises: ValueError for a tensor not on the CPU and for the shape errors of
    :func:`gdn_ext.gated_delta_rule`; TypeError for another dtype or a non-tensor input.

    Source: Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025 (arXiv:2412.06464), sec. 3.
    """
    if (alpha is None) == (g is None):
        raise ValueError("give exactly one of alpha (decay in [0, 1]) and g (log decay); got "
                         + ("both" if alpha is not None else "neither"))
    gate_name, gate = ("alpha", alpha) if alpha is not None else ("g", g)
    tensors = {"q": q, "k": k, "v": v, "beta": beta, gate_name: gate}
    if initial_state is not None:
        tensors["initial_state"] = initial_state
    for name, t in tensors.items():
        _to_numpy(t, name)
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) > 1:
        raise TypeError("q, k, v, beta, the gate and initial_state must share one dtype; got "
                        + ", ".join(f"{n} {t.dtype}" for n, t in tensors.items()))
    if isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = cu_seqlens.detach().cpu().numpy()
    opts = {"gate_name": gate_name, "grad": torch.is_grad_enabled(),
            "call": dict(scale=scale, normalize_qk=normalize_qk, cu_seqlens=cu_seqlens,
                         num_threads=num_threads)}
    o, S_T = _GatedDeltaRule.apply(q, k, v, beta, gate, initial_state, opts)
    return o, (S_T if output_final_state else None)

