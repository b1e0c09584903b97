"""The gated delta rule on dask arrays: lazy, chunked over batch and heads, one NumPy call of
gdn_ext per chunk (dask is an optional dependency: ``pip install -e ".[dask]"`` in a clone).

    import dask.array as da, gdn_ext.dask as gd
    q = da.from_zarr("q.zarr")                    # [B, T, H, Dk], chunks over B and H only
    o, S_T = gd.gated_delta_rule(q, k, v, beta=beta, g=g, num_threads=2)
    o.to_zarr("o.zarr")                           # computed chunk by chunk

Every chunk is an independent set of (sequence, head) pairs, so the results equal one NumPy call
bitwise, on any scheduler. Time and the head dimensions must each be one chunk (the recurrence
runs along T); with grouped value heads (HV = G H) a chunk of value heads must hold whole groups
(G value heads per query/key head). Output dtypes are chosen up front as NumPy's would be:
float32 when every input casts safely to float32, float64 otherwise (a Python float ``scale``
does not change it).

Warnings (``check_values=True``, as :func:`gdn_ext.gated_delta_rule`'s): the layout one (q with
1 < T < H, head-first?) comes from the shapes when the graph is built; the value ones (alpha, g,
beta, beta ||k||^2) when a chunk is computed, from that chunk's values. All point at the line
that called ``gdn_ext.dask``. A chunk's warnings are issued where it runs: in this process for
the threaded and synchronous schedulers, in the worker for processes and ``distributed``.
Floating-point errors in a chunk (overflow, invalid, ...) follow the ``np.errstate`` in force when
the graph was built, at that same line: warned, raised from ``compute()``, or ignored.

Source of the math: S. Yang, J. Kautz, A. Hatamizadeh, "Gated Delta Networks: Improving Mamba2
with Delta Rule", ICLR 2025 (arXiv:2412.06464), sec. 3.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import numpy as np

try:
    import dask.array as da
except ImportError as _exc:  # pragma: no cover - exercised without dask
    raise ImportError('gdn_ext.dask needs dask: pip install "dask[array]" (or, in a clone, '
                      'pip install -e ".[dask]")'
                      ) from _exc

from ._algorithm import check_algorithm
from ._problem import _Problem
from ._checks import (as_real_array, caller_location, compute_dtype, flag, head_first_message, real_scalar,
                      value_messages, warn)
from ._results import GatedDeltaRuleGrads, GatedDeltaRuleGradsG, GatedDeltaRuleOutput
from ._threads import fp_policy, fp_recorded, report_fp, thread_count
from .recurrence import gated_delta_rule as _np_forward
from .recurrence import gated_delta_rule_backward as _np_backward
from .recurrence import sum_to

__all__ = ["gated_delta_rule", "gated_delta_rule_backward"]


def _array(x, name, ndim, layout, chunks=None):
    """A dask array of ``ndim`` dimensions. A NumPy array (or array-like) is wrapped with
    ``chunks`` (those of the dask inputs it goes with; one chunk when None)."""
    x = _operand(x, name)
    if not isinstance(x, da.Array):
        if x.ndim == ndim and chunks is not None and tuple(map(sum, chunks)) == x.shape:
            x = da.from_array(x, chunks=chunks)
        else:
            x = da.from_array(x, chunks=-1)
    if x.ndim != ndim:
        raise ValueError(f"{name} must have shape {layout}; got {list(x.shape)}")
    if any(np.isnan(c) for cs in x.chunks for c in cs):
        raise ValueError(f"{name} has unknown chunk sizes; call {name}.compute_chunk_sizes()")
    return x


def _operand(x, name):
    """A dask array as it is, anything else as an ndarray; either of a real dtype."""
    if x is None:
        raise TypeError(f"{name} is required (got None)")
    if not isinstance(x, da.Array):
        x = as_real_array(x, name)
    if x.dtype.kind not in "biuf" or not np.can_cast(x.dtype, np.float64, "safe"):
        raise TypeError(f"{name} must have a real dtype that casts safely to float64; got "
                        f"{x.dtype}")
    return x


def _full(x, name, shape, chunks):
    """beta or the gate broadcast to its full ``shape`` (no copy), a dask array; one that was
    broadcast (or given as NumPy) gets ``chunks``, a dask one given in full keeps its own."""
    if not isinstance(x, da.Array):
        return da.from_array(np.broadcast_to(x, shape), chunks=chunks)
    if any(np.isnan(c) for cs in x.chunks for c in cs):
        raise ValueError(f"{name} has unknown chunk sizes; call {name}.compute_chunk_sizes()")
    return x if x.shape == tuple(shape) else da.broadcast_to(x, shape).rechunk(chunks)


def _stand_in(x):
    """A read-only NumPy array of x's shape and dtype that takes no memory (None for None)."""
    return None if x is None else np.broadcast_to(np.zeros((), x.dtype), x.shape)


def _one_chunk(x, name, axes, what):
    for ax in axes:
        if len(x.chunks[ax]) > 1:
            raise ValueError(
                f"{name} is chunked along axis {ax} ({what[ax]}): gdn_ext.dask chunks over batch "
                f"and heads only; rechunk it, e.g. {name}.rechunk({{{ax}: -1}})")


class _Inputs:
    """The arguments checked and laid out for da.apply_gufunc: loop dimensions [B, H], the G
    value heads of a group a core dimension (so a chunk always holds whole groups)."""

    def __init__(self, q, k, v, beta, alpha, g, initial_state, extra=()):
        self.gate_name = "alpha" if alpha is not None else "g"
        gate = alpha if alpha is not None else g
        q = _array(q, "q", 4, "[B, T, H, Dk]")
        B, T, H, Dk = q.shape
        # NumPy inputs take the chunks of q's batch and head chunks (whole groups for values)
        G0 = (np.shape(v)[2] // H) if H and np.ndim(v) == 4 else 1
        hv_chunks = tuple(c * G0 for c in q.chunks[2])
        seq = lambda extra: (q.chunks[0], (T,), hv_chunks) + extra  # noqa: E731
        k = _array(k, "k", 4, "[B, T, H, Dk]", chunks=q.chunks)
        v = _array(v, "v", 4, "[B, T, HV, Dv]",
                   chunks=seq(((np.shape(v)[-1],),)) if np.ndim(v) == 4 else None)
        # Python numbers are weak (as in the NumPy API): they do not change the dtype; they are
        # cast to the computation's (cast_numbers), as the NumPy API casts them
        weak = [type(x) in (int, float) for x in (beta, gate)]
        self.weak = dict(zip(("beta", "gate"), weak))
        beta = _operand(beta, "beta")
        gate = None if gate is None else _operand(gate, self.gate_name)
        if initial_state is not None:
            initial_state = _array(initial_state, "initial_state", 4, "[B, HV, Dv, Dk]",
                                   chunks=(q.chunks[0], hv_chunks) + tuple(
                                       (n,) for n in np.shape(initial_state)[2:]))
        # the shape rules are the NumPy API's: checked on stand-ins of the right shapes
        p = _Problem(*(_stand_in(x) for x in (q, k, v, beta)),
                     _stand_in(gate) if alpha is not None else None,
                     _stand_in(gate) if g is not None else None,
                     _stand_in(initial_state), 1.0, check_values=False, views=False)
        strong = [x for x, w in zip((beta, gate), weak) if not w]
        arrays = [q, k, v] + strong + ([initial_state] if initial_state is not None else [])
        self.dtype = compute_dtype([np.empty(0, a.dtype) for a in arrays + list(extra)])
        # a scalar or broadcastable beta / gate: broadcast, chunked as v along B and the heads
        self.beta_given, self.gate_given = p.beta_given, p.gate_given
        self.shape_notes = p.shape_notes
        beta = _full(beta, "beta", p.beta_shape, seq(()))
        gate = _full(gate, self.gate_name, p.gate_shape,
                     seq(((Dk,),)) if p.per_key else seq(()))
        G, HV, Dv, self.per_key = p.G, p.HV, p.Dv, p.per_key
        what = {1: "T", 3: "D"}
        for x, name in ((q, "q"), (k, "k"), (v, "v")):
            _one_chunk(x, name, (1, 3), what)
        _one_chunk(beta, "beta", (1,), what)
        _one_chunk(gate, self.gate_name, (1, 3) if self.per_key else (1,), what)
        if initial_state is not None:
            _one_chunk(initial_state, "initial_state", (2, 3), {2: "Dv", 3: "Dk"})
        # value-head chunks must be whole groups, aligned with the query/key heads' chunks
        self.head_chunks = q.chunks[2]
        want = tuple(c * G for c in self.head_chunks)
        grouped = [(v, "v", 2), (beta, "beta", 2), (gate, self.gate_name, 2)]
        if initial_state is not None:
            grouped.append((initial_state, "initial_state", 1))
        for x, name, ax in grouped:
            if x.chunks[ax] != want:
                raise ValueError(
                    f"{name}'s chunks along its head axis {x.chunks[ax]} must be q's head chunks "
                    f"{self.head_chunks} times G = {G} (whole groups of value heads: value head "
                    f"hv reads query/key head hv // G); rechunk {name}")
        if k.chunks != q.chunks:
            raise ValueError(f"k must be chunked as q {q.chunks}; got {k.chunks}")
        for x, name, _ in grouped:
            if x.chunks[0] != q.chunks[0]:
                raise ValueError(f"{name} must be chunked along B as q {q.chunks[0]}; got "
                                 f"{x.chunks[0]}")
        self.sizes = (B, T, H, G, HV, Dk, Dv)
        self.q, self.k = q, k
        self.initial_state = initial_state
        self.v, self.beta, self.gate = v, beta, gate

    def cast_numbers(self):
        """beta and the gate given as Python numbers in the computation's dtype (self.dtype)."""
        if self.weak["beta"]:
            self.beta = self.beta.astype(self.dtype)
        if self.weak["gate"]:
            self.gate = self.gate.astype(self.dtype)

    def grouped(self, x):
        """[B, T, HV, ...] -> [B, H, G, T, ...] (lazy)."""
        B, T, H, G = self.sizes[:4]
        x = x.reshape((B, T, H, G) + x.shape[3:])
        return x.transpose((0, 2, 3, 1) + tuple(range(4, x.ndim)))

    def heads(self, x):
        """[B, T, H, D] -> [B, H, T, D] (lazy)."""
        return x.transpose(0, 2, 1, 3)

    def state(self, x):
        """[B, HV, Dv, Dk] -> [B, H, G, Dv, Dk] (lazy)."""
        B, T, H, G = self.sizes[:4]
        return x.reshape((B, H, G) + x.shape[2:])


def _options(scale, normalize_qk, delta_rule, num_threads, algorithm, chunk_size):
    """The options every task passes to the NumPy entry point, checked once here."""
    algorithm, chunk_size = check_algorithm(algorithm, chunk_size)
    return dict(scale=real_scalar(scale, "scale"), normalize_qk=flag(normalize_qk, "normalize_qk"),
                delta_rule=flag(delta_rule, "delta_rule"),
                num_threads=thread_count(num_threads) or None, algorithm=algorithm,
                chunk_size=chunk_size)


def _fp_reporter(what):
    """The graph-time np.errstate and user's line, and a context manager for a chunk's work
    that reports its floating-point errors by them when it ends (dask's threads do not inherit
    the errstate; its processes and workers do not have it)."""
    policy, at = fp_policy(), caller_location()

    @contextlib.contextmanager
    def chunk():
        seen = {}
        with fp_recorded(seen):
            yield
        if seen:
            report_fp(seen, f"a dask chunk of {what}", policy, at)
    return chunk


def _checker(x, check_values, delta_rule, normalize_qk):
    """The layout warning now (graph time), and a function that warns about a chunk's values
    when it runs (compute time), both at the user's line; None when check_values is False."""
    if not flag(check_values, "check_values"):
        return None
    for m in [head_first_message(tuple(x.q.shape), "q")] + x.shape_notes:
        if m:
            warn(m)
    at = caller_location()
    log_gate = x.gate_name == "g"

    def check(u):
        for m in value_messages(u["beta"], u["gate"], u["k"], log_gate=log_gate,
                                delta_rule=delta_rule, normalize_qk=normalize_qk,
                                where=" in a dask chunk"):
            warn(m, at=at)
    return check


def _to_user(q, k, v, beta, gate, s0):
    """Block arrays in the gufunc layout -> gdn_ext's [b, T, h, D] layout."""
    b, h, G, T = v.shape[:4]
    user = dict(q=q.transpose(0, 2, 1, 3), k=k.transpose(0, 2, 1, 3),
                v=v.transpose(0, 3, 1, 2, 4).reshape(b, T, h * G, v.shape[-1]),
                beta=beta.transpose(0, 3, 1, 2).reshape(b, T, h * G))
    if gate.ndim == 5:
        user["gate"] = gate.transpose(0, 3, 1, 2, 4).reshape(b, T, h * G, gate.shape[-1])
    else:
        user["gate"] = gate.transpose(0, 3, 1, 2).reshape(b, T, h * G)
    user["s0"] = None if s0 is None else s0.reshape((b, h * G) + s0.shape[3:])
    return user


def _from_user_seq(x, h, G):
    """[b, T, h * G, D] -> [b, h, G, T, D]."""
    b, T = x.shape[:2]
    return x.reshape((b, T, h, G) + x.shape[3:]).transpose((0, 2, 3, 1) + tuple(range(4, x.ndim + 1)))


def gated_delta_rule(q, k, v, *, beta, alpha=None, g=None, initial_state=None, scale=1.0,
                     normalize_qk: bool = False, delta_rule: bool = True,
                     num_threads: Optional[int] = 1, check_values: bool = True,
                     algorithm: str = "auto", chunk_size: Optional[int] = None):
    """:func:`gdn_ext.gated_delta_rule` on dask arrays, lazily, one gdn_ext call per chunk.

    q, k [B, T, H, Dk]; v [B, T, HV, Dv]; beta [B, T, HV]; alpha or g [B, T, HV] or
    [B, T, HV, Dk]; initial_state [B, HV, Dv, Dk] or None (dask or NumPy arrays); beta and the
    gate may also be Python numbers or arrays that broadcast to those shapes, as in
    :func:`gdn_ext.gated_delta_rule` (a broadcast one is chunked as v). Chunked along
    B and the heads only (a chunked T, Dk or Dv raises ValueError naming the argument); value
    heads in chunks of whole groups aligned with q's head chunks. ``num_threads``: kernel threads
    per task (default 1: dask runs tasks in parallel already; None: OpenMP's default).
    ``check_values`` (default True): :func:`gdn_ext.gated_delta_rule`'s warnings, at the line
    of this call: the layout one from the shapes now, the value ones from each chunk's values
    when it is computed (see the module docstring); False turns them off. ``algorithm`` and
    ``chunk_size``: the form each task computes, as :func:`gdn_ext.gated_delta_rule` (its
    chunk_size is the chunkwise form's tokens per chunk, not a dask chunk).

    Returns a GatedDeltaRuleOutput (o [B, T, HV, Dv], S_T [B, HV, Dv, Dk]) of lazy arrays of
    the computation's dtype.
    Raises ValueError / TypeError for bad shapes, chunks, dtypes, options.
    Source: Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025, sec. 3.
    """
    x = _Inputs(q, k, v, beta, alpha, g, initial_state)
    opts = _options(scale, normalize_qk, delta_rule, num_threads, algorithm, chunk_size)
    check = _checker(x, check_values, opts["delta_rule"], opts["normalize_qk"])
    gate_name, dt = x.gate_name, x.dtype
    x.cast_numbers()
    B, T, H, G, HV, Dk, Dv = x.sizes
    tg = "(g,t,k)" if x.per_key else "(g,t)"
    args = [x.heads(x.q), x.heads(x.k), x.grouped(x.v), x.grouped(x.beta), x.grouped(x.gate)]
    sig = f"(t,k),(t,k),(g,t,v),(g,t),{tg}"
    if x.initial_state is not None:
        args.append(x.state(x.initial_state))
        sig += ",(g,v,k)"

    fp = _fp_reporter("gated_delta_rule")

    def block(q_, k_, v_, b_, a_, s0_=None):
        u = _to_user(q_, k_, v_, b_, a_, s0_)
        if check is not None:
            check(u)
        with fp():
            o, S = _np_forward(u["q"], u["k"], u["v"], beta=u["beta"], **{gate_name: u["gate"]},
                               initial_state=u["s0"], check_values=False, **opts)
        h = q_.shape[1]
        return (_from_user_seq(o, h, G).astype(dt, copy=False),
                S.reshape((S.shape[0], h, G) + S.shape[2:]).astype(dt, copy=False))

    o, S = da.apply_gufunc(block, sig + "->(g,t,v),(g,v,k)", *args, output_dtypes=(dt, dt),
                           allow_rechunk=False, vectorize=False)
    o = o.transpose(0, 3, 1, 2, 4).reshape(B, T, HV, Dv)
    return GatedDeltaRuleOutput(o, S.reshape(B, HV, Dv, Dk))


def gated_delta_rule_backward(do, q, k, v, *, beta, alpha=None, g=None, initial_state=None,
                              dS_T=None, scale=1.0, normalize_qk: bool = False,
                              delta_rule: bool = True, num_threads: Optional[int] = 1,
                              check_values: bool = True, algorithm: str = "auto",
                              chunk_size: Optional[int] = None):
    """:func:`gdn_ext.gated_delta_rule_backward` on dask arrays, lazily, chunk by chunk.

    Arguments as :func:`gated_delta_rule`, plus do [B, T, HV, Dv] and dS_T [B, HV, Dv, Dk] (or
    None), chunked like v and initial_state (``check_values``, ``algorithm``, ``chunk_size`` as
    there). Returns the gradients tuple of
    :func:`gdn_ext.gated_delta_rule_backward` (``GatedDeltaRuleGrads`` for alpha,
    ``GatedDeltaRuleGradsG`` for g) holding lazy dask arrays, d_initial_state always given; a
    broadcast beta or gate's gradient in the shape it was given in.
    """
    x = _Inputs(q, k, v, beta, alpha, g, initial_state)
    vc = x.v.chunks
    do = _array(do, "do", 4, "[B, T, HV, Dv]", chunks=vc)
    dST = None if dS_T is None else _array(dS_T, "dS_T", 4, "[B, HV, Dv, Dk]",
                                           chunks=(vc[0], vc[2], (vc[3][0],),
                                                   (x.q.chunks[3][0],)))
    x.dtype = compute_dtype([np.empty(0, x.dtype), np.empty(0, do.dtype)]
                            + ([np.empty(0, dST.dtype)] if dST is not None else []))
    B, T, H, G, HV, Dk, Dv = x.sizes
    if do.shape != x.v.shape or do.chunks != x.v.chunks:
        raise ValueError(f"do must have v's shape {list(x.v.shape)} and chunks {x.v.chunks}; got "
                         f"{list(do.shape)} and {do.chunks}")
    if dST is not None and (dST.shape != (B, HV, Dv, Dk)
                            or dST.chunks[:2] != (x.q.chunks[0], x.v.chunks[2])
                            or len(dST.chunks[2]) > 1 or len(dST.chunks[3]) > 1):
        raise ValueError(f"dS_T must have shape [B, HV, Dv, Dk] = {[B, HV, Dv, Dk]}, chunked as "
                         f"v along B and HV, whole along Dv, Dk; got {list(dST.shape)}, "
                         f"{dST.chunks}")
    opts = _options(scale, normalize_qk, delta_rule, num_threads, algorithm, chunk_size)
    check = _checker(x, check_values, opts["delta_rule"], opts["normalize_qk"])
    gate_name, dt = x.gate_name, x.dtype
    x.cast_numbers()
    tg = "(g,t,k)" if x.per_key else "(g,t)"
    has_s0, has_dst = x.initial_state is not None, dST is not None
    args = [x.grouped(do), x.heads(x.q), x.heads(x.k), x.grouped(x.v), x.grouped(x.beta),
            x.grouped(x.gate)]
    sig = f"(g,t,v),(t,k),(t,k),(g,t,v),(g,t),{tg}"
    if has_s0:
        args.append(x.state(x.initial_state))
        sig += ",(g,v,k)"
    if has_dst:
        args.append(x.state(dST))
        sig += ",(g,v,k)"

    fp = _fp_reporter("gated_delta_rule_backward")

    def block(do_, q_, k_, v_, b_, a_, *states):
        s0_ = states[0] if has_s0 else None
        dst_ = states[-1] if has_dst else None
        u = _to_user(q_, k_, v_, b_, a_, s0_)
        if check is not None:
            check(u)
        h, b = q_.shape[1], q_.shape[0]
        d_o = do_.transpose(0, 3, 1, 2, 4).reshape(b, T, h * G, Dv)
        dS = None if dst_ is None else dst_.reshape((b, h * G) + dst_.shape[3:])
        with fp():
            gr = _np_backward(d_o, u["q"], u["k"], u["v"], beta=u["beta"],
                              **{gate_name: u["gate"]}, initial_state=u["s0"], dS_T=dS,
                              check_values=False, **opts)
        dq, dk, dv, dbeta, dgate, ds0 = gr
        heads = lambda a: a.transpose(0, 2, 1, 3).astype(dt, copy=False)  # noqa: E731
        return (heads(dq), heads(dk), _from_user_seq(dv, h, G).astype(dt, copy=False),
                _from_user_seq(dbeta[..., None], h, G)[..., 0].astype(dt, copy=False),
                (_from_user_seq(dgate, h, G) if dgate.ndim == 4
                 else _from_user_seq(dgate[..., None], h, G)[..., 0]).astype(dt, copy=False),
                ds0.reshape((b, h, G) + ds0.shape[2:]).astype(dt, copy=False))

    outs = da.apply_gufunc(block, sig + f"->(t,k),(t,k),(g,t,v),(g,t),{tg},(g,v,k)", *args,
                           output_dtypes=(dt,) * 6, allow_rechunk=False, vectorize=False)
    dq, dk, dv, dbeta, dgate, ds0 = outs
    dq, dk = dq.transpose(0, 2, 1, 3), dk.transpose(0, 2, 1, 3)
    dv = dv.transpose(0, 3, 1, 2, 4).reshape(B, T, HV, Dv)
    dbeta = dbeta.transpose(0, 3, 1, 2).reshape(B, T, HV)
    dgate = (dgate.transpose(0, 3, 1, 2, 4).reshape(B, T, HV, Dk) if x.per_key
             else dgate.transpose(0, 3, 1, 2).reshape(B, T, HV))
    ds0 = ds0.reshape(B, HV, Dv, Dk)
    cls = GatedDeltaRuleGradsG if gate_name == "g" else GatedDeltaRuleGrads
    return cls(dq, dk, dv, sum_to(dbeta, x.beta_given), sum_to(dgate, x.gate_given), ds0)
