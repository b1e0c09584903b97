"""The one rule every torch entry point applies to dtypes, and the shapes beta and the gates may
take in gdn_ext's convention; the forward's named result.

Dtypes: tensors are float16, bfloat16, float32 or float64. q, k and v share one dtype, the one o
is returned in. The recurrence runs in float64 when any tensor argument is float64, else in
float32 (half-precision tensors are cast in torch, so autograd casts their gradients back); the
final state is returned in that dtype. Python numbers take the computation's dtype and do not
choose it.
"""
import numbers
from typing import NamedTuple, Optional, Sequence

import torch

from .._checks import gate_axis_note
from .._threads import PIECE, pieces

__all__ = ["GatedDeltaRuleOutput"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class GatedDeltaRuleOutput(NamedTuple):
    """What :func:`gdn_ext.torch.gated_delta_rule` returns; unpacks as ``o, S_T = ...``.

    o: [B, T, HV, Dv] (single-head form [B, T, Dv]) in the dtype of q, k and v.
    S_T: the final state, shaped as the state ([B, HV, Dv, Dk]; packed [N, HV, Dv, Dk]) in the
    dtype the recurrence ran in (float32, or float64 when an input is float64). (With
    ``output_final_state=False`` S_T is None, and the function's declared type says so: a tuple
    of a tensor and None.)
    """
    o: torch.Tensor
    S_T: torch.Tensor


GatedDeltaRuleOutput.__module__ = "gdn_ext.torch"   # its public home (repr, docs, pickle)


def check_float(t: torch.Tensor, name: str) -> None:
    """TypeError naming ``name`` unless t holds one of the four floating dtypes."""
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64; got {t.dtype} "
                        f"(convert it, e.g. with .float())")


def input_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """The dtype of q, k and v, which o is returned in; TypeError when they differ."""
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one dtype (o is returned in it); got q {q.dtype}, "
                        f"k {k.dtype}, v {v.dtype}: convert them to one, e.g. with "
                        f".to({q.dtype})")
    return q.dtype


def compute_dtype(tensors: Sequence[Optional[torch.Tensor]]) -> torch.dtype:
    """float64 when any of the tensors is float64, else float32 (as the NumPy API picks)."""
    return (torch.float64 if any(isinstance(t, torch.Tensor) and t.dtype == torch.float64
                                 for t in tensors) else torch.float32)


class _CastInPieces(torch.autograd.Function):
    """x.to(dtype) for a large CPU tensor, copied piece by piece (`cast`); its gradient is cast
    back the same way."""

    @staticmethod
    def forward(ctx, x, dtype):   # type: ignore[override]
        ctx.source = x.dtype
        out = torch.empty(x.shape, dtype=dtype)
        with torch.no_grad():
            for sl in pieces(tuple(x.shape)):
                out[sl].copy_(x[sl])
        return out

    @staticmethod
    def backward(ctx, grad):   # type: ignore[override]
        return cast(grad, ctx.source), None


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x.to(dtype), differentiable as it is. One .to() of a large tensor is one call that Ctrl-C
    waits for (float32 [1, 600000, 2, 128] to float64: about a second); on the CPU and outside
    torch.compile (whose graph would hold every piece) a tensor of more than PIECE elements is
    copied in pieces, between which Python handles signals."""
    if x.dtype == dtype or x.numel() <= PIECE or x.device.type != "cpu" \
            or torch.compiler.is_compiling():
        return x.to(dtype)
    return _CastInPieces.apply(x, dtype)


def is_number(x) -> bool:
    """A real Python (or NumPy) number, not a bool: beta or a gate given as a scalar."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def per_head(x, name: str, dtype: torch.dtype, device, B, T, HV, Dk=None, single=False,
             heads: str = "HV", notes=None) -> torch.Tensor:
    """beta (Dk None) or a gate as a tensor of ``dtype`` broadcast (NumPy's rules, aligned at the
    right) to the per-head shape [B, T, HV] (single-head form [B, T]); a gate with one more
    dimension broadcasts to [B, T, HV, Dk] ([B, T, Dk]), one value per key channel. A view when
    x is a tensor: autograd sums the gradient back to x's shape. ValueError naming the argument
    and the shape expected. A gate read per head whose last axis has Dk entries adds a warning
    to ``notes`` (gdn_ext._checks.gate_axis_note)."""
    if is_number(x):
        x = torch.tensor(float(x), dtype=dtype, device=device)
    else:
        x = cast(x, dtype)
    given = list(x.shape)
    shape = (B, T) if single else (B, T, HV)
    if single and Dk is None and x.dim() == 3 and x.shape[-1] == 1:
        x = x.squeeze(-1)          # the single-head form's beta [B, T, 1] (H = 1), as NumPy's
    per_key = Dk is not None and x.dim() == len(shape) + 1
    if per_key and x.shape[-1] == 1:
        x, per_key = x.squeeze(-1), False    # the same value for every key: one per head
    want = shape + (Dk,) if per_key else shape
    try:
        full = x.expand(want)
    except RuntimeError:
        pass
    else:
        # (not while torch.compile traces: sizes may be symbolic, and the checks are skipped)
        if Dk is not None and not per_key and notes is not None and tuple(x.shape) != shape \
                and not torch.compiler.is_compiling():
            note = gate_axis_note(name, tuple(x.shape), shape, Dk)
            if note:
                notes.append(note)
        return full
    lay = "[B, T]" if single else f"[B, T, {heads}]"
    msg = (f"{name} must be a real number or a tensor that broadcasts to {lay} = "
           f"{list(shape)}")
    if Dk is not None:
        key_lay = "[B, T, Dk]" if single else f"[B, T, {heads}, Dk]"
        msg += (f" (one gate per head) or, with one more axis, to {key_lay} = "
                f"{list(shape + (Dk,))} (one per key channel)")
    raise ValueError(f"{msg}; got shape {given}")


def check_tensor(t, name, device=True):
    """TypeError / ValueError naming ``name`` unless t is a dense floating tensor (on the CPU
    when ``device``)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor; got layout {t.layout}")
    if device and t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}: gdn_ext runs on the CPU; move it with .cpu()")
    check_float(t, name)


def check_ranks(q, k, v, initial_state, cu_seqlens):
    """Ranks only (gdn_ext.gated_delta_rule, which the operators call, checks every size and
    value): what the fake implementations need to run under torch.compile before it does."""
    if q.dim() not in (3, 4):
        raise ValueError(f"q must have shape [B, T, H, Dk] (or [B, T, Dk], the single-head form); "
                         f"got {list(q.shape)}")
    single = q.dim() == 3
    want = "[B, T, Dv]" if single else "[B, T, HV, Dv]"
    if k.dim() != q.dim():
        raise ValueError(f"k must have the shape of q {list(q.shape)}; got {list(k.shape)}")
    if v.dim() != q.dim():
        raise ValueError(f"v must have shape {want}; got {list(v.shape)}")
    if initial_state is not None and initial_state.dim() != q.dim():
        raise ValueError(f"initial_state must have shape "
                         f"{'[B, Dv, Dk]' if single else '[B, HV, Dv, Dk]'}; got "
                         f"{list(initial_state.shape)}")
    if cu_seqlens is not None and cu_seqlens.dim() != 1:
        raise ValueError(f"cu_seqlens must have shape [N + 1] with N >= 1; got "
                         f"{list(cu_seqlens.shape)}")


def prepare(q, k, v, beta, gate, gate_name, initial_state, cpu=True, notes=None):
    """The dtype rule and the shapes of beta and the gate (this module's docstring), applied:
    (q, k, v, beta, gate, initial_state) in the computation's dtype, beta and the gate
    broadcast to their full shapes, and the dtype o is returned in. ``cpu``: refuse tensors on
    another device (the reference loop runs on any). ``notes``: a list that collects warnings
    about the shapes given."""
    tensors = {"q": q, "k": k, "v": v, "beta": beta, gate_name: gate}
    if initial_state is not None:
        tensors["initial_state"] = initial_state
    for name, t in tensors.items():
        if name in ("beta", gate_name) and is_number(t):
            continue
        if name in ("beta", gate_name) and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or a real number; got "
                            f"{type(t).__name__}")
        check_tensor(t, name, device=cpu)
    out_dtype = input_dtype(q, k, v)
    dt = compute_dtype(list(tensors.values()))
    check_ranks(q, k, v, initial_state, None)
    single = q.dim() == 3
    B, T, Dk = q.shape[0], q.shape[1], q.shape[-1]
    HV = 1 if single else v.shape[2]
    heads = "HV" if single or v.shape[2] != q.shape[2] else "H"
    beta = per_head(beta, "beta", dt, q.device, B, T, HV, single=single, heads=heads)
    gate = per_head(gate, gate_name, dt, q.device, B, T, HV, Dk, single=single, heads=heads,
                    notes=notes)
    q, k, v = cast(q, dt), cast(k, dt), cast(v, dt)
    if initial_state is not None:
        initial_state = cast(initial_state, dt)
    return q, k, v, beta, gate, initial_state, out_dtype
