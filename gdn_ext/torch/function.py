"""gdn_ext's C forward and backward as PyTorch custom operators (gdn_ext conventions).

``torch.ops.gdn_ext.gated_delta_rule_fwd`` and ``torch.ops.gdn_ext.gated_delta_rule_bwd`` are
registered with ``torch.library``: each has a fake (meta) implementation, so ``torch.compile``
traces through them without graph breaks (``fullgraph=True`` works), and the forward has a
registered autograd formula whose backward is the C backward pass. The forward keeps its state
checkpoints for the backward when a gradient will be asked for, so training runs the recurrence
forward once. Differentiating the gradient again (double backward, ``create_graph=True``) is
computed through the torch reference loop (:mod:`gdn_ext.torch.loop`): correct, slow.

Source of the math: S. Yang, J. Kautz, A. Hatamizadeh, "Gated Delta Networks: Improving Mamba2
with Delta Rule", ICLR 2025 (arXiv:2412.06464), sec. 3.
"""
from __future__ import annotations

import numbers
from typing import List, Literal, Optional, Sequence, Tuple, Union, overload

import numpy as np
import torch

from .._algorithm import check_algorithm, chunk_for
from .._checks import contiguous, flag, head_first_message, value_messages, warn
from .._native import _core
from .._threads import thread_count
from ..recurrence import checkpoint_count
from ..recurrence import gated_delta_rule as _np_forward
from ..recurrence import gated_delta_rule_backward as _np_backward
from ..recurrence import _train_backward, _train_forward
from ._inputs import GatedDeltaRuleOutput, cast, check_ranks, prepare
from .loop import reference_gated_delta_rule

__all__ = ["gated_delta_rule", "GatedDeltaRuleOutput"]

CHUNK_AUTO_MIN_LEN = _core.CHUNK_AUTO_MIN_LEN


def _numpy(t: Optional[torch.Tensor]):
    """A CPU tensor as a NumPy view (no copy unless it carries a conj / negative bit)."""
    if t is None:
        return None
    return t.detach().resolve_conj().resolve_neg().numpy()


def _state_shape(q, v, initial_state, cu_seqlens):
    """The state's shape: initial_state's, else [N, (HV,) Dv, Dk] with N = B or the number of
    packed sequences."""
    if initial_state is not None:
        return tuple(initial_state.shape)
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    heads = () if q.dim() == 3 else (v.shape[2],)
    return (N,) + heads + (v.shape[-1], q.shape[-1])


def cu_tensor(cu_seqlens):
    """cu_seqlens (a tensor or a sequence of ints) as a CPU tensor for the operators, or None;
    its values are checked by gdn_ext.gated_delta_rule when they run."""
    if cu_seqlens is None:
        return None
    try:
        return torch.as_tensor(cu_seqlens, device="cpu")
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"cu_seqlens must be an integer tensor [N + 1]: {exc}") from None


def _gate_kw(gate, gate_is_log):
    return {"g": gate} if gate_is_log else {"alpha": gate}


def _ckpt_count(q, v, gate, algorithm, chunk_size):
    """How many states the forward keeps for its backward, unpacked (recurrence._train_chunk's
    choice, from the shapes): the chunk form's for a gate of one number per token in chunks, else
    the recurrence's checkpoints."""
    T, Dk, Dv = q.shape[1], q.shape[-1], v.shape[-1]
    C, auto = chunk_for(algorithm, chunk_size, per_key=gate.dim() == q.dim())
    if C == 0 or (auto and T < CHUNK_AUTO_MIN_LEN):
        return checkpoint_count(T)
    return int(_core._chunk_checkpoint_count(T, C, Dk, Dv))


@torch.library.custom_op("gdn_ext::gated_delta_rule_fwd", mutates_args=(), device_types="cpu")
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
            gate: torch.Tensor, initial_state: Optional[torch.Tensor], scale: float,
            gate_is_log: bool, normalize_qk: bool, cu_seqlens: Optional[torch.Tensor],
            keep_checkpoints: bool, num_threads: Optional[int], delta_rule: bool,
            algorithm: str = "auto", chunk_size: Optional[int] = None,
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, S_T, checkpoints): with keep_checkpoints what the backward restarts from
    ([..., NCK, Dv, Dk]: the chunk form's states where it runs, else the recurrence's
    checkpoints, NCK = checkpoint_count of the longest sequence; _ckpt_count), or an empty
    tensor."""
    kw = dict(beta=_numpy(beta), **_gate_kw(_numpy(gate), gate_is_log),
              initial_state=_numpy(initial_state), scale=scale, normalize_qk=normalize_qk,
              cu_seqlens=_numpy(cu_seqlens), num_threads=num_threads, delta_rule=delta_rule,
              algorithm=algorithm, chunk_size=chunk_size)
    if keep_checkpoints:   # what the backward restarts from: chunk states or checkpoints
        out = _train_forward(_numpy(q), _numpy(k), _numpy(v), **kw)
    else:
        out = _np_forward(_numpy(q), _numpy(k), _numpy(v), check_values=False, **kw)
    o, S_T = torch.from_numpy(out[0]), torch.from_numpy(out[1])
    if not keep_checkpoints:
        return o, S_T, q.new_empty((0,))
    return o, S_T, torch.from_numpy(out[2])


@_fwd_op.register_fake
def _(q, k, v, beta, gate, initial_state, scale, gate_is_log, normalize_qk, cu_seqlens,
      keep_checkpoints, num_threads, delta_rule, algorithm="auto", chunk_size=None):
    S = _state_shape(q, v, initial_state, cu_seqlens)
    if not keep_checkpoints:
        return v.new_empty(v.shape), v.new_empty(S), v.new_empty((0,))
    # packed: the count follows the longest sequence, a value of cu_seqlens
    nck = (_ckpt_count(q, v, gate, algorithm, chunk_size) if cu_seqlens is None
           else torch.library.get_ctx().new_dynamic_size())
    return v.new_empty(v.shape), v.new_empty(S), v.new_empty(S[:-2] + (nck,) + S[-2:])


@torch.library.custom_op("gdn_ext::gated_delta_rule_bwd", mutates_args=(), device_types="cpu")
def _bwd_op(do: torch.Tensor, dS_T: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, beta: torch.Tensor, gate: torch.Tensor,
            initial_state: Optional[torch.Tensor], checkpoints: Optional[torch.Tensor],
            scale: float, gate_is_log: bool, normalize_qk: bool,
            cu_seqlens: Optional[torch.Tensor], num_threads: Optional[int],
            delta_rule: bool, algorithm: str = "auto",
            chunk_size: Optional[int] = None) -> List[torch.Tensor]:
    """[dq, dk, dv, dbeta, dgate, d_initial_state] (the last one shaped as the state)."""
    kw = dict(beta=_numpy(beta), **_gate_kw(_numpy(gate), gate_is_log),
              initial_state=_numpy(initial_state), dS_T=_numpy(dS_T), scale=scale,
              normalize_qk=normalize_qk, cu_seqlens=_numpy(cu_seqlens), num_threads=num_threads,
              delta_rule=delta_rule, algorithm=algorithm, chunk_size=chunk_size)
    if checkpoints is not None:   # the forward operator's (chunk states or checkpoints)
        g = _train_backward(_numpy(do), _numpy(q), _numpy(k), _numpy(v),
                            checkpoints=_numpy(checkpoints), **kw)
    else:
        g = _np_backward(_numpy(do), _numpy(q), _numpy(k), _numpy(v), check_values=False, **kw)
    return [torch.from_numpy(contiguous(x)) for x in g]


@_bwd_op.register_fake
def _(do, dS_T, q, k, v, beta, gate, initial_state, checkpoints, scale, gate_is_log,
      normalize_qk, cu_seqlens, num_threads, delta_rule, algorithm="auto", chunk_size=None):
    S = _state_shape(q, v, initial_state, cu_seqlens)
    return [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            beta.new_empty(beta.shape), gate.new_empty(gate.shape), v.new_empty(S)]


_INPUTS = ("q", "k", "v", "beta", "gate", "initial_state")


def _setup_context(ctx, inputs, output):
    (q, k, v, beta, gate, initial_state, scale, gate_is_log, normalize_qk, cu_seqlens,
     keep_checkpoints, num_threads, delta_rule, algorithm, chunk_size) = inputs
    ckpt = output[2] if keep_checkpoints else None
    # the checkpoints are no result, and an unused S_T has no gradient: None, not a zero tensor
    # of their size (tens of MB for the chunk form's states) made on every step
    ctx.mark_non_differentiable(output[2])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, beta, gate, initial_state, cu_seqlens, ckpt)
    ctx.opts = (scale, gate_is_log, normalize_qk, num_threads, delta_rule, algorithm, chunk_size)


def _backward(ctx, do, dS_T, _dckpt):
    q, k, v, beta, gate, initial_state, cu_seqlens, ckpt = ctx.saved_tensors
    scale, gate_is_log, normalize_qk, num_threads, delta_rule, algorithm, chunk_size = ctx.opts
    inputs = (q, k, v, beta, gate, initial_state)
    if do is None:
        do = torch.zeros_like(v)
    if torch.is_grad_enabled():
        # create_graph=True: the gradient must itself be differentiable; the torch loop is
        return _differentiable_backward(ctx, inputs, do, dS_T, scale, gate_is_log,
                                        normalize_qk, cu_seqlens, delta_rule)
    grads = torch.ops.gdn_ext.gated_delta_rule_bwd(
        do, dS_T, q, k, v, beta, gate, initial_state, ckpt, scale, gate_is_log, normalize_qk,
        cu_seqlens, num_threads, delta_rule, algorithm, chunk_size)
    grads = list(grads)
    if initial_state is None:
        grads[5] = None
    return tuple(grads) + (None,) * 9


def _differentiable_backward(ctx, inputs, do, dS_T, scale, gate_is_log, normalize_qk,
                             cu_seqlens, delta_rule):
    """The gradients as torch operations (the reference loop under autograd), so that a second
    derivative flows through them."""
    q, k, v, beta, gate, initial_state = inputs
    wanted = [i for i, t in enumerate(inputs)
              if t is not None and ctx.needs_input_grad[i]]
    with torch.enable_grad():
        o, S_T = reference_gated_delta_rule(
            q, k, v, beta=beta, **({"g": gate} if gate_is_log else {"alpha": gate}),
            initial_state=initial_state, scale=scale, normalize_qk=normalize_qk,
            cu_seqlens=None if cu_seqlens is None else cu_seqlens.tolist(),
            delta_rule=delta_rule)
        pairs = [(x, dx) for x, dx in ((o, do), (S_T, dS_T))
                 if dx is not None and x.requires_grad]
        if not pairs:
            got = [None] * len(wanted)
        else:
            got = torch.autograd.grad([x for x, _ in pairs], [inputs[i] for i in wanted],
                                      [dx for _, dx in pairs], create_graph=True,
                                      allow_unused=True)
    result = [None] * 6
    for i, g in zip(wanted, got):
        result[i] = torch.zeros_like(inputs[i]) if g is None else g
    return tuple(result) + (None,) * 9


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _plain(t) -> bool:
    """A dense CPU tensor whose values Python can read now (not a fake / functional tensor of a
    trace): others skip the value checks and meet the kernels' own errors."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided
            and t.device.type == "cpu")


def warn_unusual(q, k, beta, gate, *, log_gate, delta_rule, normalize_qk, gate_name=None,
                 dims=("B", "T", "H", "Dk")):
    """The NumPy front end's warnings (:func:`gdn_ext._checks.value_messages`,
    ``head_first_message``) for CPU tensors, at the caller's line. q, k [B, T, H, Dk] (or the
    single-head [B, T, Dk]), beta and the gate as :func:`gated_delta_rule` takes them. Skipped
    while torch.compile traces (the values are not known then, and reading them would break
    the graph) and for tensor subclasses whose values cannot be read."""
    if torch.compiler.is_compiling():
        return
    m = head_first_message(tuple(q.shape), "q", dims)
    if m:
        warn(m)
    if not all(_plain(t) for t in (k, beta, gate)):
        return
    k_, beta_, gate_ = _numpy(k), _numpy(beta), _numpy(gate)
    if k_.ndim == 3:                           # single-head: the general form, H = 1
        k_ = k_[:, :, None]
    for m in value_messages(beta_, gate_, k_, log_gate=log_gate, gate_name=gate_name,
                            delta_rule=delta_rule, normalize_qk=normalize_qk):
        warn(m)


Gate = Union[torch.Tensor, float]


# The overloads tell a type checker that S_T is a tensor unless output_final_state=False.
@overload
def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, beta: Gate,
                     alpha: Optional[Gate] = None, g: Optional[Gate] = None,
                     initial_state: Optional[torch.Tensor] = None, scale: float = 1.0,
                     output_final_state: Literal[True] = True, normalize_qk: bool = False,
                     cu_seqlens: Union[torch.Tensor, Sequence[int], None] = None,
                     num_threads: Optional[int] = None, delta_rule: bool = True,
                     check_values: bool = True, algorithm: str = "auto",
                     chunk_size: Optional[int] = None) -> GatedDeltaRuleOutput: ...
@overload  # noqa: E302
def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, beta: Gate,
                     alpha: Optional[Gate] = None, g: Optional[Gate] = None,
                     initial_state: Optional[torch.Tensor] = None, scale: float = 1.0,
                     output_final_state: bool = True, normalize_qk: bool = False,
                     cu_seqlens: Union[torch.Tensor, Sequence[int], None] = None,
                     num_threads: Optional[int] = None, delta_rule: bool = True,
                     check_values: bool = True, algorithm: str = "auto",
                     chunk_size: Optional[int] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]: ...


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, beta: Gate,
                     alpha: Optional[Gate] = None, g: Optional[Gate] = None,
                     initial_state: Optional[torch.Tensor] = None, scale: float = 1.0,
                     output_final_state: bool = True, normalize_qk: bool = False,
                     cu_seqlens: Union[torch.Tensor, Sequence[int], None] = None,
                     num_threads: Optional[int] = None, delta_rule: bool = True,
                     check_values: bool = True, algorithm: str = "auto",
                     chunk_size: Optional[int] = None,
                     ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`gdn_ext.gated_delta_rule` on torch tensors, differentiable (autograd).

    Tensors: dense, on the CPU, any strides, storage offsets and conj / negative bits,
    ``requires_grad`` on any subset. Shapes and conventions are gdn_ext's: q, k [B, T, H, Dk];
    v [B, T, HV, Dv]; initial_state [B, HV, Dv, Dk] (packed: [N, HV, Dv, Dk]); the single-head
    form (q, k [B, T, Dk], v [B, T, Dv], state [B, Dv, Dk]); ``scale`` default 1;
    ``normalize_qk``; ``cu_seqlens`` (a tensor or sequence of ints, with B = 1);
    ``delta_rule=False`` for linear attention's write u_t = beta_t v_t (the rule family, as
    :func:`gdn_ext.gated_delta_rule`).

    beta and the gate (exactly one of alpha, the decay in [0, 1], and g, the log decay): a
    Python number or a tensor that broadcasts (NumPy's rules, aligned at the right) to the
    per-head shape [B, T, HV] (single-head form: [B, T]), e.g. ``beta=0.5``, ``alpha=1.0``
    (DeltaNet), a tensor [HV] (one per head) or [B, 1, HV]. A gate with one more dimension,
    broadcasting to [B, T, HV, Dk] ([B, T, Dk]), is one decay per key channel. Gradients come
    back in the shape each tensor was given in (summed over the broadcast axes).

    Dtypes, as flash-linear-attention's functions take them: tensors float16, bfloat16,
    float32 or float64; q, k and v share one dtype, and o is returned in it. The recurrence
    runs in float32, or in float64 when any tensor argument is float64: half-precision tensors
    are cast to float32 in torch before gdn_ext's kernels, so their gradients come back in
    their own dtype. beta, the gate and initial_state may have any of the four dtypes; a
    Python number takes the computation's dtype and does not change it. The final state is
    returned in the computation's dtype (float32 for float16 / bfloat16 inputs, as
    flash-linear-attention and transformers return it), ready to pass back as initial_state.

    ``check_values`` (default True): the warnings of :func:`gdn_ext.gated_delta_rule` (a
    UserWarning at the caller's line for alpha outside [0, 1], g above 0, with the delta rule
    beta outside [0, 2] or, keys not normalised, beta ||k||^2 above 2 where a step can grow the
    state, and q with 1 < T < H, perhaps head-first), read from the tensors' values before the
    kernels run (a min / max pass over beta, the gate and k); False turns them off. While
    ``torch.compile`` traces the function they are skipped (values are unknown then).

    Returns :class:`GatedDeltaRuleOutput` ``(o, S_T)``, a named tuple (unpacks as
    ``o, S_T = ...``): o [B, T, HV, Dv]; S_T shaped as the state (None when
    output_final_state is False). Gradients reach every tensor input through gdn_ext's C
    backward pass over time; second derivatives (``create_graph=True``, ``gradgradcheck``) go
    through the torch reference loop instead (correct, slow). Runs as the custom operators
    ``torch.ops.gdn_ext.*``, so ``torch.compile(fullgraph=True)`` traces it; ``torch.func``
    transforms (vmap) do not apply. Under ``torch.compile`` the forward keeps no checkpoints
    for the backward (their number depends on T, which would be fixed in the graph): the
    backward reruns the forward recurrence once, and T stays dynamic.

    ``algorithm`` ("auto", "chunk", "recurrent") and ``chunk_size`` pick the form of the
    computation, forward and backward, as for :func:`gdn_ext.gated_delta_rule`. The forward
    keeps for the backward the states entering its chunks (chunk form; for long sequences those
    of every ceil(sqrt(T / chunk_size))-th chunk) or the recurrence's checkpoints, so that the
    backward does not rerun the forward.

    Raises: ValueError for a tensor not on the CPU, a beta or gate that does not broadcast
    (naming it and the shape expected) and the shape errors of :func:`gdn_ext.gated_delta_rule`
    (in its names); TypeError for another dtype (integer, complex, float8), q, k, v of
    different dtypes, a non-tensor or sparse input (beta and the gate: neither a tensor nor a
    real number), a num_threads that is not a positive int, a flag that is not a bool.

    Source: Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025 (arXiv:2412.06464), sec. 3.
    """
    if (alpha is None) == (g is None):
        raise ValueError("give exactly one of alpha (decay in [0, 1]) and g (log decay); got "
                         + ("both" if alpha is not None else "neither"))
    gate_name, gate = ("alpha", alpha) if alpha is not None else ("g", g)
    given = [t for t in (q, k, v, beta, gate, initial_state) if isinstance(t, torch.Tensor)]
    notes = []
    q, k, v, beta, gate, initial_state, out_dtype = prepare(q, k, v, beta, gate, gate_name,
                                                            initial_state, notes=notes)
    cu_seqlens = cu_tensor(cu_seqlens)
    check_ranks(q, k, v, initial_state, cu_seqlens)
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        raise TypeError(f"scale must be a real number; got {type(scale).__name__}")
    # None stays None: resolved when the kernel runs (gdn_ext.threads(n) of that thread, else
    # OpenMP's default), in the backward too
    threads = None if num_threads is None else thread_count(num_threads)
    normalize_qk = flag(normalize_qk, "normalize_qk")
    output_final_state = flag(output_final_state, "output_final_state")
    delta_rule = flag(delta_rule, "delta_rule")
    if flag(check_values, "check_values"):
        for m in notes:
            warn(m)
        warn_unusual(q, k, beta, gate, log_gate=gate_name == "g", delta_rule=delta_rule,
                     normalize_qk=normalize_qk)
    algorithm, chunk_size = check_algorithm(algorithm, chunk_size)
    # Under torch.compile the checkpoints are not handed over: their count is a function of T
    # that would fix T in the graph; the backward then makes its own.
    keep = (torch.is_grad_enabled() and any(t.requires_grad for t in given)
            and not torch.compiler.is_compiling())
    o, S_T, _ = torch.ops.gdn_ext.gated_delta_rule_fwd(
        q, k, v, beta, gate, initial_state, float(scale), gate_name == "g", normalize_qk,
        cu_seqlens, keep, threads, delta_rule, algorithm, chunk_size)
    return GatedDeltaRuleOutput(cast(o, out_dtype), S_T if output_final_state else None)
