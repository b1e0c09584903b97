"""PyTorch interop: the C kernels as a ``torch.autograd.Function``, a plain-torch reference, and
drop-ins for flash-linear-attention's gated-delta-rule functions on the CPU.

    import gdn_ext.torch as gt
    o, S_T = gt.gated_delta_rule(q, k, v, beta=beta, g=g)          # autograd through C kernels
    o, ht = gt.chunk_gated_delta_rule(q, k, v, g, beta)              # flash-linear-attention API

torch is imported by this module only; ``import gdn_ext`` never needs it.

Conventions: :func:`gated_delta_rule` uses gdn_ext's (state ``[.., Dv, Dk]``, scale default 1);
:func:`chunk_gated_delta_rule` and :func:`fused_recurrent_gated_delta_rule` use
flash-linear-attention's and transformers' (state ``[N, HV, K, V]``, log decay ``g``, scale default
``K ** -0.5``). Source of the math: S. Yang, J. Kautz, A. Hatamizadeh, "Gated Delta Networks:
Improving Mamba2 with Delta Rule", ICLR 2025 (arXiv:2412.06464), section 3.
"""
import numpy as np
import torch
from torch.autograd.function import once_differentiable

from .recurrence import gated_delta_rule as _np_forward
from .recurrence import gated_delta_rule_backward as _np_backward

__all__ = ["gated_delta_rule", "reference_gated_delta_rule", "chunk_gated_delta_rule",
           "fused_recurrent_gated_delta_rule", "patch_transformers"]


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


def gated_delta_rule(q, k, v, *, beta, alpha=None, g=None, initial_state=None, scale=1.0,
                     output_final_state=True, normalize_qk=False, cu_seqlens=None,
                     num_threads=None):
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


def reference_gated_delta_rule(q, k, v, *, beta, alpha=None, g=None, initial_state=None,
                               scale=1.0, output_final_state=True, normalize_qk=False,
                               cu_seqlens=None):
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
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)

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
    G = v.shape[2] // q.shape[2]                 # value heads per query/key head (grouped order)
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
            pred = batch_matvec(S_gated, k[:, t])             # what memory returns for k_t
            delta = v[:, t] - pred                            # the error to correct
            S_cur = S_gated + batch_outer(delta, k[:, t]) * beta[:, t][..., None, None]
            outs.append(scale * batch_matvec(S_cur, q[:, t]))  # read the updated state
        finals.append(S_cur)
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    S_T = finals[0] if cu_seqlens is None else torch.cat(finals, dim=0)
    if single:
        o, S_T = o[:, :, 0], S_T[:, 0]
    return o, (S_T if output_final_state else None)


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


def chunk_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           cu_seqlens=None, *, gk=None, **kwargs):
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


def fused_recurrent_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     cu_seqlens=None, *, gk=None, **kwargs):
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


def patch_transformers(module=None):
    """Make a transformers model use gdn_ext for its gated delta rule: a context manager.

    transformers' Gated DeltaNet layers (Qwen3-Next and models built like it) call the module
    functions ``torch_chunk_gated_delta_rule`` and ``torch_recurrent_gated_delta_rule`` of their
    modeling module, whose pure-torch fallbacks run when flash-linear-attention (CUDA only) is
    missing. Inside ``with gdn_ext.torch.patch_transformers():`` they are gdn_ext's
    :func:`chunk_gated_delta_rule` and :func:`fused_recurrent_gated_delta_rule`::

        with gdn_ext.torch.patch_transformers():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()

    module: the modeling module (default ``transformers.models.qwen3_next.modeling_qwen3_next``).
    Raises AttributeError if the module has no such functions.
    """
    from unittest import mock
    if module is None:
        import transformers.models.qwen3_next.modeling_qwen3_next as module
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        if not hasattr(module, name):
            raise AttributeError(f"{module.__name__} has no {name} to replace")
    return mock.patch.multiple(module, torch_chunk_gated_delta_rule=chunk_gated_delta_rule,
                               torch_recurrent_gated_delta_rule=fused_recurrent_gated_delta_rule)
