"""The Gated DeltaNet layer as real models build it, as a ``torch.nn.Module`` on gdn_ext's kernels.

Input projections to q, k, v, the output gate z and the gate inputs a, b; a short causal
depthwise convolution (with SiLU) over q, k, v; beta = sigmoid(b) and the log decay
g = -exp(A_log) * softplus(a + dt_bias) (Mamba2's parameterisation); the gated delta rule with
L2-normalised q, k and scale K ** -0.5; a gated RMSNorm (RMSNorm(o) * SiLU(z)) and the output
projection. This is flash-linear-attention's ``GatedDeltaNet`` layer and transformers'
``Qwen3NextGatedDeltaNet``; parameter names, shapes and the packing of the projections follow
the latter, so ``load_state_dict`` takes a Qwen3-Next layer's weights unchanged.

Sources: S. Yang, J. Kautz, A. Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta
Rule", ICLR 2025 (arXiv:2412.06464), sections 3-4; Qwen3-Next (transformers'
``models/qwen3_next/modeling_qwen3_next.py``).
"""
from __future__ import annotations

import math
from collections import namedtuple
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .._algorithm import check_algorithm
from .fla import _fla_call as fla_call

__all__ = ["GatedDeltaNet", "GatedDeltaNetState"]

# the convolution's activation, by transformers' names (ACT2FN) for from_config
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu, "tanh": torch.tanh}

GatedDeltaNetState = namedtuple("GatedDeltaNetState", ["conv", "recurrent"])
GatedDeltaNetState.__doc__ = """The layer's state between calls (decoding): ``conv`` [B, C,
kernel - 1], the last inputs of the causal convolution (C = 2 H K + HV V channels), and
``recurrent`` [B, HV, K, V], the gated delta rule's state (flash-linear-attention's layout)."""


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer: ``y, state = layer(x, state=None)``.

    No value warnings (gdn_ext.torch's check_values): the layer makes its own gates, in range by
    construction (beta = sigmoid(b), g <= 0), normalises q and k, and x [B, T, D] has no
    head-first reading (a prompt shorter than the number of heads is fine).

    Args:
      hidden_size: D, the model width.
      num_k_heads: H, query / key heads; num_v_heads: HV, value heads (a multiple of H; value
        head hv reads query / key head hv // (HV / H)).
      head_k_dim: K; head_v_dim: V.
      conv_kernel_size: width of the causal convolution (4 in Qwen3-Next).
      rms_norm_eps: epsilon of the gated RMSNorm.
      activation: after the convolution, one of ACTIVATIONS ("silu" in Qwen3-Next and fla).
      dtype, device: of the parameters (CPU; float16, bfloat16, float32 or float64).
      algorithm, chunk_size: the form of the recurrence, as :func:`gdn_ext.torch.gated_delta_rule`
        ("auto": the chunkwise form for sequences of 64 tokens or more).

    ``forward(x, state=None, attention_mask=None)``: x [B, T, D]; state a
    :class:`GatedDeltaNetState` from the previous call (None: zeros, the start of a sequence);
    attention_mask [B, T], bool or numbers 0 / 1 (1: a real token, 0: padding; transformers'
    convention). Returns (y [B, T, D], the new state). Feeding a sequence in pieces (prefill, then
    one token at a time) gives what one call gives, up to rounding. Gradients reach x and every
    parameter.

    Dtypes: a float16 / bfloat16 layer (``.to(torch.bfloat16)``, x in that dtype) runs its
    projections and convolution in that dtype and, as flash-linear-attention's layer, its
    decay, its gated RMSNorm (but for the weight) and the gated delta rule in float32 (the
    rule of :mod:`gdn_ext.torch`), as transformers' Qwen3-Next layer does; y and every gradient
    come back in the layer's dtype. The state's
    ``recurrent`` is float32 for such a layer (float64 for a float64 one), ``conv`` in the
    layer's dtype.

    Padding is neutral: a masked token changes neither the recurrent nor the convolution state,
    wherever it sits (left, right, between real tokens; in a prefill, a continuation from a
    carried state, or a decode step of a finished row). Each row's outputs at its real tokens and
    its returned state are those of that row's real tokens alone, unpadded (up to rounding): the
    convolution of a real token reads the previous real tokens of its row (the carried ``conv``
    first), and a masked token is an identity step of the recurrence (decay 1, beta 0). y is zero
    at masked positions, whatever x holds there (NaN included), and no gradient flows back from
    them. An attention_mask of all ones runs the unmasked path (outside torch.compile).

    Raises ValueError for an x that is not [B, T, D], a state of the wrong shapes, an
    attention_mask that is not a [B, T] tensor of bool or 0 / 1 values, an unknown activation.
    """

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, conv_kernel_size: int = 4, rms_norm_eps: float = 1e-6,
                 activation: str = "silu", dtype: Optional[torch.dtype] = None, device=None,
                 algorithm: str = "auto", chunk_size: Optional[int] = None):
        super().__init__()
        self.algorithm, self.chunk_size = check_algorithm(algorithm, chunk_size)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}; got "
                             f"{activation!r}")
        self.activation = activation
        if num_v_heads % num_k_heads:
            raise ValueError(f"num_v_heads must be a multiple of num_k_heads; got "
                             f"{num_v_heads} and {num_k_heads}")
        kw = dict(dtype=dtype, device=device)
        self.hidden_size, self.num_k_heads, self.num_v_heads = hidden_size, num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = head_k_dim * num_k_heads, head_v_dim * num_v_heads
        self.conv_kernel_size, self.rms_norm_eps = conv_kernel_size, rms_norm_eps
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel_size, bias=False,
                                groups=self.conv_dim, padding=conv_kernel_size - 1, **kw)
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim,
                                      bias=False, **kw)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False, **kw)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads, **kw))
        self.A_log = nn.Parameter(torch.log(torch.empty(num_v_heads, **kw).uniform_(1, 16)))
        self.norm = _GatedRMSNorm(head_v_dim, rms_norm_eps, **kw)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **kw)

    @classmethod
    def from_config(cls, config, **kw) -> "GatedDeltaNet":
        """A layer sized as a transformers Qwen3-Next config's linear-attention layers."""
        return cls(config.hidden_size, config.linear_num_key_heads,
                   config.linear_num_value_heads, config.linear_key_head_dim,
                   config.linear_value_head_dim, config.linear_conv_kernel_dim,
                   config.rms_norm_eps, activation=getattr(config, "hidden_act", "silu"), **kw)

    def _split(self, qkvz, ba):
        """Qwen3-Next's packing: per key head, [q, k, the group's v, the group's z] and
        [the group's b, the group's a]."""
        B, T = qkvz.shape[:2]
        H, G = self.num_k_heads, self.num_v_heads // self.num_k_heads
        K, V = self.head_k_dim, self.head_v_dim
        q, k, v, z = torch.split(qkvz.view(B, T, H, 2 * K + 2 * G * V), [K, K, G * V, G * V], 3)
        b, a = torch.split(ba.view(B, T, H, 2 * G), [G, G], 3)
        return (q, k, v.reshape(B, T, H * G, V), z.reshape(B, T, H * G, V),
                b.reshape(B, T, H * G), a.reshape(B, T, H * G))

    def forward(self, x: torch.Tensor, state: Optional[GatedDeltaNetState] = None,
                attention_mask: Optional[torch.Tensor] = None,
                ) -> Tuple[torch.Tensor, GatedDeltaNetState]:
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be a tensor of shape [B, T, D] with D = {self.hidden_size}; "
                             f"got {getattr(x, 'shape', type(x).__name__)}")
        B, T, _ = x.shape
        H, HV, K, V = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        keep = None if attention_mask is None else _check_mask(attention_mask, B, T, x.device)
        if keep is not None and not torch.compiler.is_compiling() and bool(keep.all()):
            keep = None                                  # no padding: the unmasked path
        if keep is not None:
            # padded inputs may hold anything (NaN); where, not a product, so none leaks
            x = torch.where(keep[:, :, None], x, x.new_zeros(()))
        want = (B, self.conv_dim, self.conv_kernel_size - 1)
        if state is None:
            conv = x.new_zeros(want)
            recurrent = None
        else:
            conv, recurrent = state
            if not isinstance(conv, torch.Tensor) or not isinstance(recurrent, torch.Tensor) or \
                    tuple(conv.shape) != want or tuple(recurrent.shape) != (B, HV, K, V):
                raise ValueError(f"state must hold conv [B, C, kernel - 1] = {list(want)} and "
                                 f"recurrent [B, HV, K, V] = {[B, HV, K, V]}; got "
                                 f"{getattr(conv, 'shape', conv)} and "
                                 f"{getattr(recurrent, 'shape', recurrent)}")
        if T == 0:   # nothing to mix: no output, the state as it was
            if recurrent is None:   # in the dtype the recurrence runs in, as when T > 0
                recurrent = x.new_zeros((B, HV, K, V),
                                        dtype=torch.promote_types(x.dtype, torch.float32))
            return x.new_zeros((B, 0, self.hidden_size)), GatedDeltaNetState(conv, recurrent)
        q, k, v, z, b, a = self._split(self.in_proj_qkvz(x), self.in_proj_ba(x))
        mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], -1)
        if keep is not None:
            # each row's real tokens first, in order (then its padded ones): the convolution of
            # a real token then reads the previous real tokens, never a padded one
            pos = torch.arange(T, device=x.device)
            order = torch.argsort(torch.where(keep, pos, pos + T), dim=1)
            mixed = torch.gather(mixed, 1, order[:, :, None].expand_as(mixed))
        # causal depthwise convolution over [the previous kernel - 1 inputs, this call's]
        padded = torch.cat([conv.to(mixed.dtype), mixed.transpose(1, 2)], -1)
        if keep is None:
            new_conv = padded[:, :, padded.shape[-1] - (self.conv_kernel_size - 1):]
        else:   # the last kernel - 1 real inputs: they end at the row's count of real tokens
            last = keep.sum(1, keepdim=True) + torch.arange(self.conv_kernel_size - 1,
                                                            device=x.device)
            new_conv = torch.gather(padded, 2, last[:, None, :].expand(-1, self.conv_dim, -1))
        mixed = ACTIVATIONS[self.activation](
            F.conv1d(padded, self.conv1d.weight, None, groups=self.conv_dim))
        if keep is not None:                              # back to the tokens' own positions
            back = torch.argsort(order, dim=1)
            mixed = torch.gather(mixed, 2, back[:, None, :].expand_as(mixed))
        q, k, v = torch.split(mixed.transpose(1, 2), [self.key_dim, self.key_dim,
                                                      self.value_dim], -1)
        q, k, v = q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, HV, V)
        beta = b.sigmoid()
        wide = torch.promote_types(a.dtype, torch.float32)   # a half model's gate in float32
        g = -self.A_log.to(wide).exp() * F.softplus(a.to(wide) + self.dt_bias.to(wide))
        if keep is not None:   # a padded token: decay 1 and no write, the state passes unchanged
            g = torch.where(keep[:, :, None], g, g.new_zeros(()))
            beta = torch.where(keep[:, :, None], beta, beta.new_zeros(()))
        o, recurrent = fla_call(   # flash-linear-attention's chunk_gated_delta_rule, our form
            q, k, v, g, None, beta, scale=1 / math.sqrt(K), initial_state=recurrent,
            output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False,
            A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
            state_v_first=False, cu_seqlens=None, ungated_ok=False, algorithm=self.algorithm,
            chunk_size=self.chunk_size,
            check_values=False)   # gates in range by construction; x [B, T, D] has one layout
        o = self.norm(o.reshape(-1, V), z.reshape(-1, V)).reshape(B, T, HV * V)
        y = self.out_proj(o)
        if keep is not None:
            y = torch.where(keep[:, :, None], y, y.new_zeros(()))
        return y, GatedDeltaNetState(new_conv, recurrent)


def _check_mask(mask, B, T, device):
    """attention_mask as a bool [B, T] (True: a real token), or ValueError."""
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (B, T):
        raise ValueError(f"attention_mask must have shape [B, T] = {[B, T]} (a tensor); got "
                         f"{getattr(mask, 'shape', type(mask).__name__)}")
    if mask.dtype == torch.bool:
        return mask.to(device)
    if mask.is_complex():
        raise ValueError(f"attention_mask must hold bool or 0 / 1 values; got {mask.dtype}")
    # a data-dependent check: left to eager runs (torch.compile would break the graph here)
    if not torch.compiler.is_compiling() and not bool(((mask == 0) | (mask == 1)).all()):
        bad = mask[(mask != 0) & (mask != 1)].flatten()[:3].tolist()
        raise ValueError(f"attention_mask must hold bool or 0 / 1 values (1: a real token, "
                         f"0: padding); got values such as {bad}")
    return (mask != 0).to(device)


class _GatedRMSNorm(nn.Module):
    """RMSNorm(x) * SiLU(gate) per value head (weight [V]), computed in float32 at least."""

    def __init__(self, dim, eps, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.variance_epsilon = eps

    def forward(self, x, gate):
        dt = x.dtype
        wide = torch.promote_types(dt, torch.float32)
        x = x.to(wide)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        x = self.weight * x.to(dt)
        # the output gate in float32 at least, as transformers' Qwen3NextRMSNormGated
        return (x.to(wide) * F.silu(gate.to(wide))).to(dt)
